"""An all_reduce right after a burst of compute vs back to back (what a DDP step with one
bucket does vs what the bench times), on local gloo ranks::

    python validate/probes/allreduce_after_compute.py -n 4 --size 13719552 --compute-ms 80

Prints the median over iterations of the slowest rank's all_reduce time, in ms, for: the
all_reduce alone (before and after the others, to see drift), after ``--compute-ms`` of small
matmuls, and after the same compute plus a pass over 13 gradient-sized buffers (cache gone).
"""

from __future__ import annotations

import argparse
import statistics
import time
from typing import Any

from collsim.core.units import parse_size
from collsim.validate.measure.launch import spawn_ranks

MODES = ("alone", "after_compute", "after_compute_and_touch", "alone_again")


def _rank(ctx: Any, size_bytes: int, compute_s: float, iters: int) -> dict[str, float]:
    import torch
    import torch.distributed as dist

    x = torch.ones(size_bytes // 4)
    a, w = torch.randn(256, 256), torch.randn(256, 256)
    grads = [torch.randn(size_bytes // 4 // 13) for _ in range(13)]
    out = {}
    for mode in MODES:
        times = torch.zeros(iters, dtype=torch.float64)
        for i in range(iters):
            dist.barrier()
            if mode.startswith("after_compute"):
                t = time.perf_counter()
                while time.perf_counter() - t < compute_s:
                    a = torch.tanh(a @ w)
                if mode.endswith("touch"):
                    for g in grads:
                        g.mul_(1.0)
            start = time.perf_counter()
            dist.all_reduce(x)
            times[i] = time.perf_counter() - start
        dist.all_reduce(times, op=dist.ReduceOp.MAX)
        out[mode] = statistics.median(times.tolist()) * 1e3
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("-n", "--world-size", type=int, default=4)
    parser.add_argument("--size", default="13719552", help="bytes (default: the step's model)")
    parser.add_argument("--compute-ms", type=float, default=80.0)
    parser.add_argument("--iters", type=int, default=12)
    parser.add_argument("--timeout", type=float, default=300.0)
    args = parser.parse_args()
    result = spawn_ranks(
        _rank,
        args.world_size,
        args=(parse_size(args.size), args.compute_ms / 1e3, args.iters),
        timeout_s=args.timeout,
    )[0]
    print(
        f"# all_reduce of {parse_size(args.size)} B on {args.world_size} gloo ranks, median "
        f"of {args.iters} (slowest rank), ms"
    )
    for mode in MODES:
        print(f"{mode:<26} {result[mode]:8.1f}")


if __name__ == "__main__":
    main()
