"""Rank functions for the launcher tests (module level, so that spawned ranks can import them)."""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path
from typing import Any


def _note_pid(ctx: Any, pid_dir: str) -> None:
    Path(pid_dir, f"rank{ctx.rank}.pid").write_text(str(os.getpid()))


def sum_of_ranks(ctx: Any, pid_dir: str, offset: float) -> float:
    import torch
    import torch.distributed as dist

    _note_pid(ctx, pid_dir)
    x = torch.tensor([float(ctx.rank) + offset])
    dist.all_reduce(x)
    return float(x.item())


def _wait_for_rank0(pid_dir: str, timeout_s: float = 20.0) -> None:
    """Rank 1 fails only once rank 0 has started its part too (on a loaded machine rank 0 may
    still be joining the process group, and would then never note its pid)."""
    deadline = time.monotonic() + timeout_s
    while not Path(pid_dir, "rank0.pid").exists() and time.monotonic() < deadline:
        time.sleep(0.01)


def rank1_raises(ctx: Any, pid_dir: str) -> None:
    import torch.distributed as dist

    _note_pid(ctx, pid_dir)
    if ctx.rank == 1:
        _wait_for_rank0(pid_dir)
        raise ValueError("boom on purpose")
    dist.barrier()  # rank 0 waits for a peer that will never come


def rank1_killed(ctx: Any, pid_dir: str) -> None:
    import torch.distributed as dist

    _note_pid(ctx, pid_dir)
    if ctx.rank == 1:
        _wait_for_rank0(pid_dir)
        os.kill(os.getpid(), signal.SIGKILL)
    dist.barrier()


def rank1_hangs(ctx: Any, pid_dir: str) -> None:
    import torch.distributed as dist

    _note_pid(ctx, pid_dir)
    if ctx.rank == 1:
        time.sleep(3600)
    dist.barrier()


def both_sleep(ctx: Any, pid_dir: str) -> None:
    _note_pid(ctx, pid_dir)
    time.sleep(3600)


def ddp_buckets(ctx: Any, caps_mb: tuple[float, ...]) -> list[int | None]:
    """Gradient buckets of DDP over a 3 x 1 MiB fp32 model after two steps, per bucket cap
    (None: unknown)."""
    import torch
    from torch.nn.parallel import DistributedDataParallel

    from collsim.validate.measure.step import ddp_bucket_count

    counts = []
    for cap in caps_mb:
        model = torch.nn.Sequential(*(torch.nn.Linear(512, 512, bias=False) for _ in range(3)))
        ddp = DistributedDataParallel(model, bucket_cap_mb=cap)
        for _ in range(2):  # the reducer rebuilds its buckets after the first backward
            ddp(torch.ones(2, 512)).sum().backward()
        counts.append(ddp_bucket_count(ddp)[0])
    return counts


def scheduling(ctx: Any) -> tuple[str, str]:
    """The rank's scheduling policy, and that of a thread it starts (gloo's threads inherit)."""
    import threading

    from collsim.validate.measure.launch import current_scheduling

    seen: list[str] = []
    thread = threading.Thread(target=lambda: seen.append(current_scheduling()))
    thread.start()
    thread.join()
    return current_scheduling(), seen[0]
