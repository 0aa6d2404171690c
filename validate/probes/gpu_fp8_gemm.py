"""Time FP8 GEMMs beside bf16 ones on one GPU, over a grid of aligned shapes, and write a CSV:
the rate of ``torch.mm`` in bf16 and of ``torch._scaled_mm`` on e4m3 operands with one scale
per tensor (with and without fast accumulation) and one per row / column, each shape's
variants timed one after another (the same clock), plus what casting a bf16 operand to FP8
costs (its absolute maximum, then the scaled cast: what a delayed-scaling-free recipe runs per
operand). Each timing queues enough calls for about 20 ms between two CUDA events after a
warm-up; the SM clock and board power NVML reads after each shape are in the row. What
``collsim.workload.op_costs`` prices an FP8 GEMM at is compared with it in
validate/data/h200/README.md.

    python3 validate/probes/gpu_fp8_gemm.py -o fp8_gemm.csv [--dims 512,1024,...] [--graph]
"""

from __future__ import annotations

import argparse
import csv
import time
from typing import Any

DIMS = (512, 1024, 2048, 4096, 8192, 16384)
TARGET_S = 0.02
VARIANTS = ("bf16", "fp8_tensor", "fp8_tensor_fast", "fp8_row_fast")


def _timed(torch: Any, fn: Any, target_s: float = TARGET_S, graph: bool = False) -> float:
    """Seconds of one call of ``fn``: calls queued back to back for about ``target_s``
    between two CUDA events (the count from one timed call after a warm-up call). Queued
    from Python, a call that takes the GPU less than the host's launch is timed at the
    launch; with ``graph`` the calls are captured in a CUDA graph and replayed, the GPU's
    time alone."""
    fn()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    fn()
    end.record()
    end.synchronize()
    one = max(start.elapsed_time(end) * 1e-3, 1e-6)
    reps = max(3, min(2000, int(target_s / one)))
    if graph:
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            fn()
        torch.cuda.current_stream().wait_stream(side)
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g):
            for _ in range(reps):
                fn()
        g.replay()
        start.record()
        g.replay()
        end.record()
        end.synchronize()
        return float(start.elapsed_time(end)) * 1e-3 / reps
    start.record()
    for _ in range(reps):
        fn()
    end.record()
    end.synchronize()
    return float(start.elapsed_time(end)) * 1e-3 / reps


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("-o", "--output", required=True)
    ap.add_argument("--dims", default=",".join(map(str, DIMS)))
    ap.add_argument("--max-flops", type=float, default=2.2e12, help="skip larger GEMMs")
    ap.add_argument("--graph", action="store_true", help="replay CUDA graphs: the GPU's time")
    args = ap.parse_args()
    import torch

    try:
        import pynvml

        pynvml.nvmlInit()
        handle = pynvml.nvmlDeviceGetHandleByIndex(torch.cuda.current_device())
    except Exception:  # noqa: BLE001 - the clocks are context, not the measurement
        handle = None

    def clocks() -> tuple[Any, Any]:
        if handle is None:
            return "", ""
        sm = pynvml.nvmlDeviceGetClockInfo(handle, pynvml.NVML_CLOCK_SM)
        return sm, round(pynvml.nvmlDeviceGetPowerUsage(handle) / 1e3, 1)

    dev = torch.device("cuda")
    f8 = torch.float8_e4m3fn
    fmax = torch.finfo(f8).max
    gen = torch.Generator(device=dev).manual_seed(0)
    dims = [int(d) for d in args.dims.split(",")]
    big = torch.randn(8192, 8192, device=dev, dtype=torch.bfloat16, generator=gen)
    t_end = time.perf_counter() + 0.25
    while time.perf_counter() < t_end:  # clocks up from idle
        torch.mm(big, big)
    torch.cuda.synchronize()
    del big
    with open(args.output, "w", newline="") as fh:
        fh.write(
            f"# gpu: {torch.cuda.get_device_name(0)}; torch {torch.__version__}; "
            f"{'CUDA graphs of ' if args.graph else ''}queued calls for about "
            f"{TARGET_S * 1e3:g} ms per timing; e4m3 operands, bf16 "
            "output; cast_us: amax of a bf16 m x k operand then its scaled cast to e4m3\n"
        )
        w = csv.writer(fh)
        w.writerow(["m", "n", "k", "variant", "time_us", "tflops", "sm_mhz", "power_w"])
        fh.flush()
        for m in dims:
            for n in dims:
                for k in dims:
                    flops = 2.0 * m * n * k
                    if flops > args.max_flops:
                        continue
                    a = torch.randn(m, k, device=dev, dtype=torch.bfloat16, generator=gen)
                    b = torch.randn(n, k, device=dev, dtype=torch.bfloat16, generator=gen)
                    a8 = (a * (fmax / a.abs().amax())).to(f8)
                    b8 = (b * (fmax / b.abs().amax())).to(f8).t()  # column-major k x n
                    one = torch.ones((), device=dev, dtype=torch.float32)
                    row_a = torch.ones(m, 1, device=dev, dtype=torch.float32)
                    row_b = torch.ones(1, n, device=dev, dtype=torch.float32)
                    bt = b.t()
                    calls = {
                        "bf16": lambda a=a, bt=bt: torch.mm(a, bt),
                        "fp8_tensor": lambda a8=a8, b8=b8, s=one: torch._scaled_mm(
                            a8, b8, scale_a=s, scale_b=s, out_dtype=torch.bfloat16
                        ),
                        "fp8_tensor_fast": lambda a8=a8, b8=b8, s=one: torch._scaled_mm(
                            a8, b8, scale_a=s, scale_b=s, out_dtype=torch.bfloat16,
                            use_fast_accum=True,
                        ),
                        "fp8_row_fast": lambda a8=a8, b8=b8, ra=row_a, rb=row_b: (
                            torch._scaled_mm(
                                a8, b8, scale_a=ra, scale_b=rb, out_dtype=torch.bfloat16,
                                use_fast_accum=True,
                            )
                        ),
                    }  # fmt: skip
                    for variant in VARIANTS:
                        try:
                            t = _timed(torch, calls[variant], graph=args.graph)
                        except Exception as exc:  # noqa: BLE001 - an unsupported variant
                            w.writerow([m, n, k, variant, "", "", "", repr(exc)[:80]])
                            continue
                        sm, power = clocks()
                        w.writerow(
                            [m, n, k, variant, round(t * 1e6, 3), round(flops / t / 1e12, 1),
                             sm, power]
                        )  # fmt: skip

                    def cast(a: Any = a) -> Any:
                        scale = fmax / a.abs().amax()
                        return (a * scale).to(f8)

                    t = _timed(torch, cast, graph=args.graph)
                    w.writerow([m, n, k, "cast_us", round(t * 1e6, 3), "", *clocks()])
                    fh.flush()
                    del a, b, a8, b8, bt, calls


if __name__ == "__main__":
    main()
