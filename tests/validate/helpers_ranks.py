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


def rank1_raises(ctx: Any, pid_dir: str) -> None:
    import torch.distributed as dist

    _note_pid(ctx, pid_dir)
    if ctx.rank == 1:
        raise ValueError("boom on purpose")
    dist.barrier()   # rank 0 waits for a peer that will never come


def rank1_killed(ctx: Any, pid_dir: str) -> None:
    import torch.distributed as dist

    _note_pid(ctx, pid_dir)
    if ctx.rank == 1:
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
