"""How long `collsim validate compute --device cuda` (the full CUDA grid) runs on a GPU.

Counts the timed calls of every grid point (as collsim/validate/measure/compute.py makes them: one
warm-up and ``reps`` timed calls, each followed by a synchronize; GEMMs in three layouts;
attention forward, one more forward, then forward + backward) and prices each call with the
device's compute model (``collsim validate kernels``' own pricing of that kernel), plus a fixed
host cost per call. Needs no torch and no GPU::

    PYTHONPATH=$PWD python validate/recipes/gpu_compute_estimate.py --device h200

PER_CALL_S and FIXED_S are ASSUMPTIONS (no measurement of them on the GPU machine exists yet):
a Python call, a kernel launch and a ``torch.cuda.synchronize`` round trip of ~30 us, plus
one-off costs (torch import, CUDA context, cuBLAS / cuDNN handles, one cuDNN attention graph
per shape and phase) of 60 s in all. A measured model of the device is optimistic for small
kernels, so the estimate is a lower bound on the kernel time; the fixed terms dominate.
"""

from __future__ import annotations

import argparse
from pathlib import Path
from tempfile import TemporaryDirectory
from typing import Any

from collsim.cluster.hardware import get_device, load_device_file
from collsim.validate.check.kernels import compare_kernels
from collsim.validate.measure.compute import ComputeGrid, attention_notes, write_profile

PER_CALL_S = 30e-6
FIXED_S = 60.0
VIEW_S = 3e-6
"""Building one operand view pair (64 per GEMM shape and layout)."""
BACKENDS = ("flash2", "eager", "cudnn")


def grid_profile(grid: ComputeGrid) -> dict[str, Any]:
    """The grid's points as a profile's tables (rates are placeholders: only shapes count)."""
    dims = grid.gemm_dims
    gemm = [
        [m, n, k, d, 1.0]
        for d in ("bf16", "fp16", "fp32")
        for m in dims
        for n in dims
        for k in dims
        if 2.0 * m * n * k <= grid.gemm_max_flops
    ]
    notes = {"threads": 1, "device": "cuda", "optimizer_params": grid.optimizer_params}
    notes |= attention_notes("cuda")
    from collsim.validate.measure.compute import attention_shape

    attention = []
    for kern in BACKENDS:
        for d in grid.head_dims:
            for s in grid.seqs:
                b, h = attention_shape(s, d, notes["attention_tokens"], notes["attention_hidden"])
                if 3.5 * 4.0 * b * h * s * s * d / 2 <= grid.attention_max_flops:
                    attention.append([kern, True, d, s, 1.0, 1.0])
    sizes = [float(12 * (s // 12)) for s in grid.mem_sizes_bytes if s <= grid.mem_max_bytes]
    return {
        "gemm": gemm,
        "attention": attention,
        "bandwidth": [[s, 1.0] for s in sizes],
        "optimizer_bytes_per_s": 1.0,
        "host_us": 1.0,
        "notes": notes,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="h200")
    args = parser.parse_args()
    grid = ComputeGrid.full("cuda")
    tables = grid_profile(grid)
    with TemporaryDirectory() as tmp:
        profile = load_device_file(write_profile(Path(tmp) / "grid.yaml", tables, device="cuda"))
        rows, _ = compare_kernels(profile, get_device(args.device))
    reps = grid.reps
    total: dict[str, list[float]] = {}
    for r in rows:
        kind = r.kind.split()[0]
        if kind == "gemm":
            calls = 3 * (1 + reps)
            kernel_s = calls * r.model_s + 3 * 64 * VIEW_S
        elif kind == "attention":
            # fwd: warm-up + reps + 1; bwd: the fwd+bwd calls (warm-up + reps), both phases
            phase_fwd = r.kind.endswith("fwd")
            calls = (2 + reps) + (1 + reps) if phase_fwd else 1 + reps
            kernel_s = calls * r.model_s
        elif kind == "memory":
            calls = 1 + max(reps, 5)
            kernel_s = calls * r.model_s
        elif kind == "optimizer":
            calls = 1 + max(reps, 3)
            kernel_s = calls * r.model_s
        else:  # host: 8 chains of 100 tiny kernels
            calls, kernel_s = 8, 8 * 100 * r.model_s
        acc = total.setdefault(kind, [0.0, 0.0, 0.0])
        acc[0] += 1
        acc[1] += calls
        acc[2] += kernel_s + calls * PER_CALL_S
    grand = FIXED_S
    for kind, (points, calls, secs) in total.items():
        print(f"{kind:<10} {points:>5.0f} rows {calls:>6.0f} calls {secs:>8.2f} s")
        grand += secs
    print(f"fixed      {FIXED_S:.0f} s (import, CUDA context, handles, cuDNN graphs)")
    print(f"total      {grand:.0f} s on {get_device(args.device).name}")


if __name__ == "__main__":
    main()
