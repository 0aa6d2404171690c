"""Where the spread of a gloo timing comes from: one op, many iterations, every sample kept.

Per iteration and rank it records the entry and exit time on the host's monotonic clock (one
clock for every local process), then prints, per size, the distribution of

* ``slowest``: the slowest rank's own exit - entry (what ``collsim validate bench`` reports),
* ``op``: last exit - last entry (the op proper, from the moment the last rank joined),
* ``skew``: last entry - first entry (how far apart the ranks left the barrier),

and the sorted samples, so that two clusters (iterations that waited out a time slice) show.
Run it with and without ``--realtime`` (ranks under SCHED_RR)::

    python validate/probes/sched_noise.py -n 2 --sizes 16K,256K,1M --iters 60
    python validate/probes/sched_noise.py -n 2 --sizes 16K,256K,1M --iters 60 --realtime
"""

from __future__ import annotations

import argparse
import time
from typing import Any

from collsim.core.units import parse_size
from collsim.validate.measure.launch import realtime_problem, spawn_ranks


def _rank(ctx: Any, op: str, sizes: list[int], iters: int) -> dict[int, dict[str, list[float]]]:
    import torch
    import torch.distributed as dist

    n = ctx.world_size
    out: dict[int, dict[str, list[float]]] = {}
    for size in sizes:
        count = size // 4 // n * n
        x = torch.ones(count)
        gathered = torch.empty(count)
        fns = {
            "all_reduce": lambda: dist.all_reduce(x),
            "broadcast": lambda: dist.broadcast(x, 0),
            "all_gather": lambda: dist.all_gather_into_tensor(gathered, x[: count // n]),
        }
        fn = fns[op]
        for _ in range(3):
            fn()
        start = torch.zeros(iters, dtype=torch.float64)
        end = torch.zeros(iters, dtype=torch.float64)
        for i in range(iters):
            dist.barrier()
            start[i] = time.perf_counter()
            fn()
            end[i] = time.perf_counter()
        starts = [torch.zeros_like(start) for _ in range(n)]
        ends = [torch.zeros_like(end) for _ in range(n)]
        dist.all_gather(starts, start)
        dist.all_gather(ends, end)
        s, e = torch.stack(starts), torch.stack(ends)
        out[size] = {
            "slowest": sorted((e - s).max(0).values.tolist()),
            "op": sorted((e.max(0).values - s.max(0).values).tolist()),
            "skew": sorted((s.max(0).values - s.min(0).values).tolist()),
        }
    return out


def _quantile(values: list[float], q: float) -> float:
    return values[int(round(q * (len(values) - 1)))] * 1e3


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("-n", "--world-size", type=int, default=2)
    parser.add_argument(
        "--op", choices=("all_reduce", "broadcast", "all_gather"), default="all_reduce"
    )
    parser.add_argument("--sizes", default="16K,256K,1M")
    parser.add_argument("--iters", type=int, default=60)
    parser.add_argument("--realtime", action="store_true")
    parser.add_argument("--timeout", type=float, default=300.0)
    args = parser.parse_args()
    if args.realtime and (problem := realtime_problem()):
        parser.error(problem)
    sizes = [parse_size(s) for s in args.sizes.split(",")]
    result = spawn_ranks(
        _rank,
        args.world_size,
        args=(args.op, sizes, args.iters),
        timeout_s=args.timeout,
        realtime=args.realtime,
    )[0]
    policy = "SCHED_RR" if args.realtime else "default policy"
    print(f"# {args.op}, {args.world_size} gloo ranks, {args.iters} iterations, {policy}; ms")
    for size, parts in result.items():
        cells = "  ".join(
            f"{k} median {_quantile(v, 0.5):6.2f} p90 {_quantile(v, 0.9):6.2f}"
            for k, v in parts.items()
        )
        print(f"{size:>10} B  {cells}")
        print("            sorted slowest: " + " ".join(f"{v * 1e3:.1f}" for v in parts["slowest"]))


if __name__ == "__main__":
    main()
