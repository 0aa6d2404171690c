"""Checks and settings that come before ranks start: whether this process runs under torchrun
(:func:`in_torchrun`), whether the installed torch has the backend and the GPUs asked for
(:func:`check_backend`, one line and exit 2 where not, run in a forked child so that the parent
never loads torch), and the real-time scheduling of the ranks (:func:`realtime_problem`, the
policy ranks started with ``realtime=True`` enter, :func:`current_scheduling` as read back);
:mod:`collsim.validate.measure.launch` starts the ranks.
"""

from __future__ import annotations

import multiprocessing
import os
import sys
import threading
from typing import Any

from collsim.core.errors import ConfigError

__all__ = [
    "in_torchrun",
    "check_backend",
    "realtime_problem",
    "enter_realtime",
    "current_scheduling",
    "TORCH_HINT",
    "CUDA_HINT",
    "REALTIME_PRIORITY",
]

#: SCHED_RR priority of ranks started with ``realtime=True``: the low end of the real-time band
#: (1-99), above every normal process and below the kernel's own real-time threads.
REALTIME_PRIORITY = 10


#: How to get torch (the package requirement is ``torch>=2.2``, the ``validate`` extra; 2.13
#: is the version this repository's measurements were taken with).
TORCH_HINT = "pip install 'collsim[validate]' (or: pip install torch==2.13.0)"
#: How to get a torch that has CUDA and NCCL (the PyTorch install selector's form).
CUDA_HINT = (
    "pip install torch==2.13.0 --index-url https://download.pytorch.org/whl/cu128 "
    "(a CUDA build), or use --backend gloo"
)


#: Seconds the forked child of :func:`check_backend` gets to import torch and answer.
_CHECK_TIMEOUT_S = 300.0


def check_backend(backend: str, world_size: int | None = None) -> None:
    """Fail at once, in the parent, when the ranks could not start: no torch, or a backend
    the installed torch lacks (``nccl`` in a CPU-only build), or fewer GPUs than ranks.

    Before local ranks are spawned (``world_size`` given, not under torchrun) the check runs in
    a forked child where the platform forks, so that the parent, which only watches the ranks,
    never loads torch: its memory (about as much as one rank's) stays out of the run's peak.
    If the child cannot answer, the check runs here.

    Raises:
        ConfigError: one line with the install command (exit 2).
    """
    forks = "fork" in multiprocessing.get_all_start_methods()
    if world_size is None or in_torchrun() or "torch" in sys.modules or not forks:
        _check_backend_here(backend, world_size)
        return
    ctx = multiprocessing.get_context("fork")
    receiver, sender = ctx.Pipe(duplex=False)
    child = ctx.Process(
        target=_check_backend_child, args=(sender, backend, world_size), daemon=True
    )
    child.start()
    sender.close()
    answer: Any = None
    try:
        if receiver.poll(_CHECK_TIMEOUT_S):
            answer = receiver.recv()
    except (EOFError, OSError):  # the child died before answering: check here
        answer = None
    finally:
        receiver.close()
        child.join(timeout=5.0)
        if child.is_alive():
            child.kill()
            child.join(timeout=5.0)
    if answer is None:
        _check_backend_here(backend, world_size)
    elif answer != "ok":
        message, key_path = answer
        raise ConfigError(message, key_path=key_path)


def _check_backend_child(sender: Any, backend: str, world_size: int | None) -> None:
    """Body of the forked child of :func:`check_backend`: ``"ok"`` or (message, key path)."""
    try:
        _check_backend_here(backend, world_size)
        sender.send("ok")
    except ConfigError as exc:
        sender.send((exc.message, exc.key_path))
    finally:
        sender.close()


def _check_backend_here(backend: str, world_size: int | None) -> None:
    """:func:`check_backend` in this process."""
    try:
        # torch is optional (the validate extra): imported where ranks run
        import torch
        import torch.distributed as dist
    except ImportError:
        raise ConfigError(
            f"torch is not installed; the validate commands need it: {TORCH_HINT}",
            key_path="--backend",
        ) from None

    if not dist.is_available():
        raise ConfigError(
            f"the installed torch {torch.__version__} has no torch.distributed: {TORCH_HINT}",
            key_path="--backend",
        )
    available = {
        "gloo": dist.is_gloo_available(),
        "nccl": dist.is_nccl_available() and torch.cuda.is_available(),
    }
    if backend not in available:
        raise ConfigError(f"must be gloo or nccl, got {backend!r}", key_path="--backend")
    if not available[backend]:
        build = "CPU-only" if not torch.cuda.is_available() else "without NCCL"
        hint = CUDA_HINT if backend == "nccl" else TORCH_HINT
        raise ConfigError(
            f"the installed torch {torch.__version__} ({build}) has no {backend} backend: {hint}",
            key_path="--backend",
        )
    if backend == "nccl" and world_size is not None and not in_torchrun():
        gpus = torch.cuda.device_count()
        if world_size > gpus:
            raise ConfigError(
                f"{world_size} ranks need {world_size} GPUs, this machine has {gpus}",
                key_path="--world-size",
            )


def in_torchrun() -> bool:
    """True when this process was started by torchrun (or any env:// launcher)."""
    return all(key in os.environ for key in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"))


def realtime_problem() -> str | None:
    """Why ranks cannot run under SCHED_RR here, or None when they can.

    Probed on a short-lived thread (on Linux the policy belongs to the thread that sets it), so
    this process itself is left as it was.
    """

    if not hasattr(os, "sched_setscheduler") or not hasattr(os, "SCHED_RR"):
        return "real-time scheduling (SCHED_RR) needs Linux"
    problems: list[str] = []

    def probe() -> None:
        try:
            os.sched_setscheduler(0, os.SCHED_RR, os.sched_param(REALTIME_PRIORITY))
        except OSError as exc:
            problems.append(
                f"cannot run ranks under SCHED_RR priority {REALTIME_PRIORITY}: "
                f"{exc.strerror}; it needs root, CAP_SYS_NICE or "
                f"'ulimit -r {REALTIME_PRIORITY}'"
            )

    thread = threading.Thread(target=probe, name="collsim-rt-probe")
    thread.start()
    thread.join()
    return problems[0] if problems else None


def enter_realtime() -> None:
    """Put the calling thread (and the threads it starts from now on: gloo's worker and
    transport threads inherit the policy) under SCHED_RR at :data:`REALTIME_PRIORITY`. On a
    small shared machine a gloo rank is a chain of hand-offs between threads (caller,
    process-group worker, transport loop); under the default policy a thread that wakes up may
    wait out the time slice of another runnable thread, which added milliseconds to a large
    share of the iterations of a small all_reduce; under SCHED_RR a woken rank thread runs at
    once (the timings are in docs/derivations.md, measurements). The kernel's real-time
    throttling (``sched_rt_runtime_us``, 95 % by default) still leaves the rest of the machine
    some time."""
    os.sched_setscheduler(0, os.SCHED_RR, os.sched_param(REALTIME_PRIORITY))


def current_scheduling() -> str:
    """The scheduling policy of the calling thread as read back from the kernel, for a
    measurement's metadata (e.g. ``"SCHED_RR priority 10"``, ``"SCHED_OTHER"``)."""
    if not hasattr(os, "sched_getscheduler"):
        return "unknown"
    policy = os.sched_getscheduler(0)
    names = {
        getattr(os, n): n
        for n in ("SCHED_OTHER", "SCHED_BATCH", "SCHED_IDLE", "SCHED_FIFO", "SCHED_RR")
        if hasattr(os, n)
    }
    name = names.get(policy, f"policy {policy}")
    if name in ("SCHED_FIFO", "SCHED_RR"):
        return f"{name} priority {os.sched_getparam(0).sched_priority}"
    return name
