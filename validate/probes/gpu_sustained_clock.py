"""Run bf16 GEMMs on one GPU for a while, alone or interleaved with memory-bound adds so that
the GEMMs take a set share of the time (``--duties``), and log per window of about half a
second the rate the GEMMs ran at (CUDA events) beside the SM clock, the board power, the
temperature and the clock-event reasons NVML reads while the window's work runs (its share
counts the device's time in GEMMs and adds, not the host's gaps between windows): whether a
GEMM-heavy load holds the boost clock or settles at a power-limited one, and how that depends
on the share of the step the GEMMs take (the premise of
``collsim.cluster.hardware.HOPPER_SUSTAINED_CLOCK_FRACTION``).

    python validate/probes/gpu_sustained_clock.py --seconds 20 --duties 1,0.75,0.5 -o clock.csv

Needs torch with CUDA and ``nvidia-ml-py`` (``pynvml``). The CSV is written window by window.
"""

from __future__ import annotations

import argparse
import csv
import math
import time
from typing import Any

GEMMS_PER_CYCLE = 4
WINDOW_S = 0.5


def _timed(torch: Any, fn: Any) -> float:
    """Seconds of ``fn``'s device work (alone, after a synchronize)."""
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    torch.cuda.synchronize()
    start.record()
    fn()
    end.record()
    end.synchronize()
    return float(start.elapsed_time(end)) * 1e-3


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--seconds", type=float, default=20.0, help="per duty")
    ap.add_argument("--duties", default="1.0", help="GEMM shares of the time, comma-separated")
    ap.add_argument("--size", type=int, default=8192, help="m = n = k of the GEMM")
    ap.add_argument("-o", "--output", required=True)
    args = ap.parse_args()
    duties = [float(d) for d in args.duties.split(",")]
    if not all(0 < d <= 1 for d in duties):
        ap.error(f"--duties: each share must be in (0, 1], got {args.duties}")
    import pynvml
    import torch

    pynvml.nvmlInit()
    handle = pynvml.nvmlDeviceGetHandleByIndex(torch.cuda.current_device())
    reasons_of = getattr(
        pynvml,
        "nvmlDeviceGetCurrentClocksEventReasons",
        getattr(pynvml, "nvmlDeviceGetCurrentClocksThrottleReasons", None),
    )
    n = args.size
    gen = torch.Generator(device="cuda").manual_seed(0)
    a = torch.randn(n, n, device="cuda", dtype=torch.bfloat16, generator=gen)
    b = torch.randn(n, n, device="cuda", dtype=torch.bfloat16, generator=gen)
    out = torch.empty(n, n, device="cuda", dtype=torch.bfloat16)
    elems = 128 * 2**20  # three fp32 tensors of 512 MiB: each add moves 1.5 GiB
    x, y, z = (torch.randn(elems, device="cuda") for _ in range(3))
    flops = 2.0 * n**3

    def gemms() -> None:
        for _ in range(GEMMS_PER_CYCLE):
            torch.mm(a, b, out=out)

    def add() -> None:
        torch.add(x, y, out=z)

    for _ in range(3):  # warm up both kernels
        gemms()
        add()
    t_gemms, t_add = _timed(torch, gemms), _timed(torch, add)
    t_start = time.perf_counter()
    with open(args.output, "w", newline="") as fh:
        fh.write(
            f"# gpu: {torch.cuda.get_device_name(0)}; torch {torch.__version__}; {n}^3 bf16 "
            f"GEMMs on randn operands, {GEMMS_PER_CYCLE} a cycle, then the cycle's fp32 adds "
            f"of {elems} elements; alone {t_gemms * 1e3:.3f} ms per cycle of GEMMs, "
            f"{t_add * 1e3:.3f} ms per add\n"
        )
        w = csv.writer(fh)
        w.writerow(
            ["duty", "t_s", "gemm_tflops", "gemm_share", "add_gbps", "sm_mhz", "mem_mhz",
             "power_w", "power_limit_w", "temp_c", "clock_event_reasons_hex"]
        )  # fmt: skip
        for duty in duties:
            adds = 0 if duty >= 1 else max(1, round(t_gemms * (1 - duty) / duty / t_add))
            cycles = max(1, math.ceil(WINDOW_S / (t_gemms + adds * t_add)))
            t_duty = time.perf_counter()
            while time.perf_counter() - t_duty < args.seconds:
                marks = []
                for _ in range(cycles):
                    ev = [torch.cuda.Event(enable_timing=True) for _ in range(3)]
                    ev[0].record()
                    gemms()
                    ev[1].record()
                    for _ in range(adds):
                        add()
                    ev[2].record()
                    marks.append(ev)
                time.sleep(0.05)  # read NVML while the queued work runs
                samples = []
                while not marks[-1][2].query():
                    samples.append(
                        (
                            pynvml.nvmlDeviceGetClockInfo(handle, pynvml.NVML_CLOCK_SM),
                            pynvml.nvmlDeviceGetClockInfo(handle, pynvml.NVML_CLOCK_MEM),
                            pynvml.nvmlDeviceGetPowerUsage(handle) / 1e3,
                            pynvml.nvmlDeviceGetTemperature(handle, pynvml.NVML_TEMPERATURE_GPU),
                            reasons_of(handle) if reasons_of else 0,
                        )
                    )
                    time.sleep(0.02)
                marks[-1][2].synchronize()
                if not samples:
                    continue
                g_s = sum(ev[0].elapsed_time(ev[1]) for ev in marks) * 1e-3
                a_s = sum(ev[1].elapsed_time(ev[2]) for ev in marks) * 1e-3
                mid = samples[len(samples) // 2]
                reasons = 0
                for s in samples:
                    reasons |= s[4]
                w.writerow(
                    [
                        duty,
                        round(time.perf_counter() - t_start, 2),
                        round(flops * GEMMS_PER_CYCLE * cycles / g_s / 1e12, 1),
                        round(g_s / (g_s + a_s), 3),
                        round(3 * 4 * elems * adds * cycles / a_s / 1e9, 1) if adds else "",
                        mid[0],
                        mid[1],
                        round(sum(s[2] for s in samples) / len(samples), 1),
                        round(pynvml.nvmlDeviceGetEnforcedPowerLimit(handle) / 1e3, 1),
                        mid[3],
                        hex(reasons),
                    ]
                )
                fh.flush()


if __name__ == "__main__":
    main()
