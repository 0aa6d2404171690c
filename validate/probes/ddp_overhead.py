"""What a DDP step with one bucket costs beyond its compute and its all_reduce, on local gloo
ranks, with the model of ``collsim validate step``::

    python validate/probes/ddp_overhead.py -n 4 --iters 15

Per iteration, each after a barrier, slowest rank: ``local`` (a whole step of the model with no
communication), ``all_reduce`` (one all_reduce of the model's gradient bytes, right after the
local step, as DDP's single bucket would run), ``ddp`` (torch's DistributedDataParallel with one
bucket). Prints the medians and ``ddp - local - all_reduce``: what DDP adds of its own (bucket
copies, hooks, the division by the world size) or loses to ranks reaching the all_reduce at
different times.
"""

from __future__ import annotations

import argparse
import statistics
import time
from typing import Any

from collsim.validate.measure.launch import spawn_ranks
from collsim.validate.measure.step import _ddp_step
from collsim.validate.measure.step_model import StepConfig, build_gpt, rank_batch

PARTS = ("local", "all_reduce", "ddp")


def _rank(ctx: Any, cfg: StepConfig, bucket_mb: int) -> dict[str, float]:
    import torch
    import torch.distributed as dist

    ddp_step, _ = _ddp_step(torch, cfg, ctx, bucket_mb)
    torch.manual_seed(cfg.seed)
    model = build_gpt(torch, cfg)
    opt = torch.optim.SGD(model.parameters(), lr=cfg.lr)
    idx, targets = rank_batch(torch, cfg, ctx.rank, "cpu")
    flat = torch.zeros(sum(p.numel() for p in model.parameters()))

    def local() -> None:
        opt.zero_grad()
        model(idx, targets).backward()
        opt.step()

    rows = []
    for it in range(cfg.warmup + cfg.iters):
        row = []
        for part, fn in (
            ("local", local),
            ("all_reduce", lambda: dist.all_reduce(flat)),
            ("ddp", ddp_step),
        ):
            if part != "all_reduce":  # the all_reduce follows the local step directly
                dist.barrier()
            start = time.perf_counter()
            fn()
            row.append(time.perf_counter() - start)
        if it >= cfg.warmup:
            rows.append(row)
    table = torch.tensor(rows, dtype=torch.float64)
    dist.all_reduce(table, op=dist.ReduceOp.MAX)
    return {p: statistics.median(table[:, j].tolist()) * 1e3 for j, p in enumerate(PARTS)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("-n", "--world-size", type=int, default=4)
    parser.add_argument("--iters", type=int, default=15)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--bucket-mb", type=int, default=25)
    parser.add_argument("--timeout", type=float, default=600.0)
    args = parser.parse_args()
    cfg = StepConfig(iters=args.iters, warmup=args.warmup)
    out = spawn_ranks(_rank, args.world_size, args=(cfg, args.bucket_mb), timeout_s=args.timeout)[0]
    print(
        f"# {args.world_size} gloo ranks, DDP bucket {args.bucket_mb} MB, median of "
        f"{args.iters} (slowest rank), ms"
    )
    for part in PARTS:
        print(f"{part:<12} {out[part]:8.1f}")
    print(f"{'ddp - local - all_reduce':<12} {out['ddp'] - out['local'] - out['all_reduce']:8.1f}")


if __name__ == "__main__":
    main()
