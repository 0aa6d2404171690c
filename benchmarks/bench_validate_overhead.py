"""The bench's own overhead: how much its timing adds, and its busbw against a plain loop.

Run: ``.venv/bin/python benchmarks/bench_validate_overhead.py [--world-size 2] [--repeats 3]
[--realtime]`` (``--realtime``: ranks under SCHED_RR, as ``collsim validate bench --realtime``).

On the same ranks, for each size: (a) a plain torch.distributed loop (back-to-back all_reduce,
no barrier, no check; mean time per call, slowest rank), (b) ``collsim validate bench``'s
measurement (barrier before each iteration, median of the slowest rank). Also the bench's
timing loop around nothing and around a 4-byte all_reduce. Prints medians over repeats and the
ratio bench busbw / plain busbw.
"""

from __future__ import annotations

import argparse
import statistics
import time
from typing import Any

SIZES = (1 << 16, 1 << 20, 1 << 24)


def _rank(ctx: Any, iters: int) -> dict[str, Any]:
    import torch
    import torch.distributed as dist

    from collsim.validate.measure.bench import BenchConfig, bench_rank

    plain = {}
    for size in SIZES:
        x = torch.zeros(size // 4)
        for _ in range(3):
            dist.all_reduce(x)
        dist.barrier()
        start = time.perf_counter()
        for _ in range(iters):
            dist.all_reduce(x)
        t = torch.tensor([(time.perf_counter() - start) / iters], dtype=torch.float64)
        dist.all_reduce(t, op=dist.ReduceOp.MAX)
        plain[size] = float(t.item())
    out = bench_rank(
        ctx,
        BenchConfig(
            ops=("all_reduce",), sizes_bytes=SIZES, iters=iters, warmup=3, probe_backend=False
        ),
    )
    return {
        "plain": plain,
        "bench": {p.size_bytes: p.time_us * 1e-6 for p in out["points"]},
        "overhead": out["overhead"],
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--world-size", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--iters", type=int, default=20)
    parser.add_argument("--realtime", action="store_true")
    args = parser.parse_args()
    from collsim.validate.measure.bench import bus_factor
    from collsim.validate.measure.launch import realtime_problem, spawn_ranks

    if args.realtime and (problem := realtime_problem()):
        parser.error(problem)
    runs = [
        spawn_ranks(
            _rank, args.world_size, args=(args.iters,), timeout_s=600, realtime=args.realtime
        )[0]
        for _ in range(args.repeats)
    ]
    n = args.world_size
    print("ranks under " + ("SCHED_RR" if args.realtime else "the default policy"))
    noop = statistics.median(r["overhead"]["noop_us"] for r in runs)
    tiny = statistics.median(r["overhead"]["all_reduce_4B_us"] for r in runs)
    print(f"world size {n}, {args.repeats} repeats x {args.iters} iterations (medians)")
    print(
        f"bench timing loop around nothing: {noop:.1f} us; around a 4-byte all_reduce: "
        f"{tiny:.1f} us"
    )
    print(f"{'size(B)':>10} {'plain busbw(GB/s)':>18} {'bench busbw(GB/s)':>18} {'ratio':>6}")
    for size in SIZES:
        plain_s = statistics.median(r["plain"][size] for r in runs)
        bench_s = statistics.median(r["bench"][size] for r in runs)
        factor = bus_factor("all_reduce", n)
        plain_bw = size / plain_s / 1e9 * factor
        bench_bw = size / bench_s / 1e9 * factor
        print(f"{size:>10} {plain_bw:>18.3f} {bench_bw:>18.3f} {bench_bw / plain_bw:>6.2f}")


if __name__ == "__main__":
    main()
