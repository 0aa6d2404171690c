"""Start ranks that cannot hang: local spawn with a FileStore and a watchdog, or torchrun.

Two ways to get a process group, one rank function:

* ``spawn_ranks(fn, world_size, ...)`` starts ``world_size`` local processes (the ``spawn``
  start method), each joins a gloo (or nccl) process group through a ``FileStore`` in a fresh
  temporary directory -- never a fixed TCP port, so two runs on one machine cannot collide -- and
  calls ``fn(ctx, *args)``. The parent is a watchdog: if a rank raises, is killed, or the run
  passes its deadline, every other rank is killed at once and :class:`RankFailure` names the
  rank(s) and the cause. No process is left behind.
* Under ``torchrun`` (``RANK``/``WORLD_SIZE``/``MASTER_ADDR`` in the environment) the current
  process joins the job's process group through ``env://`` and runs ``fn`` itself; torchrun is the
  watchdog there and the process-group timeout bounds every collective.

Each rank runs with one intra-op and one inter-op thread (``OMP_NUM_THREADS=1``), so that N ranks
on a small machine do not oversubscribe its cores. torch is imported only inside the ranks.

``realtime=True`` runs every rank, and every thread it starts (gloo's worker and transport
threads inherit the policy), under the Linux ``SCHED_RR`` policy at priority
:data:`REALTIME_PRIORITY`. On a small shared machine a gloo rank is a chain of hand-offs between
threads (caller, process-group worker, transport loop); under the default policy a thread that
wakes up may wait out the time slice of another runnable thread, which added milliseconds to
a large share of the iterations of a small all_reduce; under SCHED_RR a woken rank thread runs
at once (the timings are in docs/derivations.md, measurements). The
kernel's real-time throttling (``sched_rt_runtime_us``, 95 % by default) still leaves the rest
of the machine some time.
"""

from __future__ import annotations

import multiprocessing
import os
import pickle
import shutil
import signal
import socket
import sys
import tempfile
import threading
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path
from typing import Any

from collsim.core.errors import CollsimError, ConfigError

#: SCHED_RR priority of ranks started with ``realtime=True``: the low end of the real-time band
#: (1-99), above every normal process and below the kernel's own real-time threads.
REALTIME_PRIORITY = 10

__all__ = [
    "RankFailure",
    "RankContext",
    "in_torchrun",
    "spawn_ranks",
    "run_distributed",
    "free_port",
    "realtime_problem",
    "current_scheduling",
    "check_backend",
    "TORCH_HINT",
    "REALTIME_PRIORITY",
]

#: Seconds between two looks of the watchdog at its children.
_POLL_S = 0.05
#: Seconds a rank gets to exit after it wrote its result, before it is killed.
_EXIT_GRACE_S = 10.0


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


class RankFailure(CollsimError):
    """A rank raised, died, or the run passed its deadline. The message names the rank(s).

    Attributes:
        ranks: the ranks that failed first (raised, died or did not finish in time).
        reason: ``"error"``, ``"died"``, ``"timeout"`` or ``"terminated"`` (SIGTERM).
    """

    exit_code = 1

    def __init__(self, message: str, *, ranks: tuple[int, ...], reason: str) -> None:
        self.ranks = ranks
        self.reason = reason
        super().__init__(message)


@dataclass
class RankContext:
    """What a rank function gets: who it is and how to wait for its device.

    Attributes:
        rank: global rank.
        world_size: number of ranks.
        local_rank: rank inside its node.
        local_world_size: ranks on this node.
        backend: ``"gloo"`` or ``"nccl"``.
        device: ``"cpu"`` or ``"cuda:<local_rank>"``.
        launcher: ``"spawn"`` or ``"torchrun"``.
    """

    rank: int
    world_size: int
    local_rank: int
    local_world_size: int
    backend: str
    device: str
    launcher: str

    def sync(self) -> None:
        """Wait for queued device work (a no-op on CPU; ``cuda.synchronize`` with nccl)."""
        if self.device.startswith("cuda"):
            # torch is optional (the validate extra): imported where ranks run
            import torch

            torch.cuda.synchronize()


def in_torchrun() -> bool:
    """True when this process was started by torchrun (or any env:// launcher)."""
    return all(key in os.environ for key in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"))


def free_port() -> int:
    """A TCP port that was free a moment ago (bind to port 0, read it, close).

    Only for launchers that insist on a port; :func:`spawn_ranks` uses a FileStore instead.
    """
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


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


def _enter_realtime() -> None:
    """Put the calling thread (and the threads it starts from now on) under SCHED_RR."""
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


def _limit_threads() -> None:
    for key in ("OMP_NUM_THREADS", "MKL_NUM_THREADS", "OPENBLAS_NUM_THREADS"):
        os.environ[key] = "1"


def _device_for(backend: str, local_rank: int) -> str:
    return f"cuda:{local_rank}" if backend == "nccl" else "cpu"


def _init_group(backend: str, timeout_s: float, **kwargs: Any) -> None:
    # torch is optional (the validate extra): imported where ranks run
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    try:
        torch.set_num_interop_threads(1)
    except RuntimeError:  # already set in this process: harmless
        pass
    dist.init_process_group(backend=backend, timeout=timedelta(seconds=timeout_s), **kwargs)


def _rank_entry(
    fn: Callable[..., Any],
    rank: int,
    world_size: int,
    run_dir: str,
    backend: str,
    timeout_s: float,
    args: tuple[Any, ...],
    realtime: bool = False,
) -> None:
    """Body of one spawned rank: join the group, run ``fn``, leave the result in ``run_dir``."""
    _limit_threads()
    out = Path(run_dir)
    try:
        if realtime:
            _enter_realtime()
        _exit_with_parent(run_dir)
        # torch is optional (the validate extra): imported where ranks run
        import torch.distributed as dist

        # torch re-exports FileStore from its C extension without listing it in __all__
        store = dist.FileStore(str(out / "store"), world_size)  # type: ignore[attr-defined]
        _init_group(backend, timeout_s, store=store, rank=rank, world_size=world_size)
        if backend == "nccl":
            # torch is optional (the validate extra): imported where ranks run
            import torch

            torch.cuda.set_device(rank)
        ctx = RankContext(
            rank=rank,
            world_size=world_size,
            local_rank=rank,
            local_world_size=world_size,
            backend=backend,
            device=_device_for(backend, rank),
            launcher="spawn",
        )
        result = fn(ctx, *args)
        tmp = out / f"result_{rank}.tmp"
        tmp.write_bytes(pickle.dumps(result))
        tmp.rename(out / f"result_{rank}.pkl")
        try:
            dist.destroy_process_group()
        except Exception:  # noqa: BLE001 - the result is safe; teardown errors do not matter
            pass
    except BaseException as exc:  # noqa: BLE001 - report everything, including SystemExit
        text = f"{type(exc).__name__}: {exc}\n{traceback.format_exc()}"
        (out / f"error_{rank}.txt").write_text(text)
        os._exit(1)


def _exit_with_parent(run_dir: str | None = None) -> None:
    """End this rank as soon as the parent that spawned it is gone (killed, crashed), removing
    the run's folder first: a parent killed with SIGKILL cannot remove it itself."""

    parent = os.getppid()

    def watch() -> None:
        while True:
            time.sleep(0.5)
            if os.getppid() != parent:
                if run_dir is not None:
                    shutil.rmtree(run_dir, ignore_errors=True)
                os._exit(1)

    threading.Thread(target=watch, name="collsim-parent-watch", daemon=True).start()


class _Terminated(Exception):
    """SIGTERM reached the parent: stop the ranks, then leave."""


def _kill_all(procs: list[Any]) -> None:
    for proc in procs:
        if proc.is_alive():
            proc.kill()
    for proc in procs:
        proc.join(timeout=5.0)


def spawn_ranks(
    fn: Callable[..., Any],
    world_size: int,
    *,
    args: tuple[Any, ...] = (),
    backend: str = "gloo",
    timeout_s: float = 120.0,
    realtime: bool = False,
) -> list[Any]:
    """Run ``fn(ctx, *args)`` on ``world_size`` fresh local processes and return their results.

    Args:
        fn: a module-level function (it is pickled into the children) taking a
            :class:`RankContext` first; its return value must pickle.
        world_size: number of ranks (>= 1).
        args: extra positional arguments for ``fn``.
        backend: ``"gloo"`` (CPU) or ``"nccl"`` (one GPU per rank).
        timeout_s: deadline for the whole run, start-up included; also the process-group
            timeout, so a collective whose peer is gone fails instead of waiting forever.
        realtime: run the ranks under SCHED_RR (see the module docstring); check
            :func:`realtime_problem` first, or a rank fails with its PermissionError.

    Returns:
        The results of ranks 0..world_size-1, in order.

    Raises:
        RankFailure: a rank raised (its traceback is in the message), died (exit code or
            signal), or the deadline passed; every rank is dead when this is raised.
        ValueError: world_size < 1 or timeout_s <= 0.
    """
    if world_size < 1:
        raise ValueError(f"world_size must be >= 1, got {world_size}")
    if timeout_s <= 0:
        raise ValueError(f"timeout_s must be > 0, got {timeout_s}")

    ctx = multiprocessing.get_context("spawn")
    run_dir = tempfile.mkdtemp(prefix="collsim-ranks-")
    procs: list[Any] = []
    deadline = time.monotonic() + timeout_s
    previous = None
    if threading.current_thread() is threading.main_thread():

        def on_term(signum: int, frame: Any) -> None:
            raise _Terminated(f"signal {signum}")

        previous = signal.signal(signal.SIGTERM, on_term)
    try:
        for rank in range(world_size):
            proc = ctx.Process(
                target=_rank_entry,
                name=f"collsim-rank-{rank}",
                daemon=True,
                args=(fn, rank, world_size, run_dir, backend, timeout_s, args, realtime),
            )
            proc.start()
            procs.append(proc)
        _watch(procs, Path(run_dir), deadline, timeout_s)
        results = []
        for rank in range(world_size):
            results.append(pickle.loads((Path(run_dir) / f"result_{rank}.pkl").read_bytes()))
        return results
    except _Terminated:
        raise RankFailure(
            "terminated by a signal; all ranks were stopped", ranks=(), reason="terminated"
        ) from None
    finally:
        _kill_all(procs)
        shutil.rmtree(run_dir, ignore_errors=True)
        if previous is not None:
            signal.signal(signal.SIGTERM, previous)


#: Error texts that mean "a peer went away", i.e. a consequence of another rank's failure.
_PEER_SYMPTOMS = (
    "Connection reset",
    "Connection closed",
    "Broken pipe",
    "Timed out",
    "timed out",
    "Timeout",
    "peer",
    "EOF",
)


def _diagnose(procs: list[Any], run_dir: Path) -> RankFailure:
    """Kill every rank, then name the rank that failed first (the cause, not its victims).

    A rank that died (signal or exit code without a Python error) is the cause; otherwise a
    rank whose error is not a lost-peer symptom; otherwise the lowest rank with an error.
    """
    time.sleep(0.5)  # let the other ranks' reports of the same event arrive
    exit_codes = [proc.exitcode for proc in procs]  # before our kills
    _kill_all(procs)
    errors: dict[int, str] = {}
    died: dict[int, str] = {}
    for rank, code in enumerate(exit_codes):
        path = run_dir / f"error_{rank}.txt"
        if path.exists():
            errors[rank] = path.read_text().strip()
        elif code is not None and not (run_dir / f"result_{rank}.pkl").exists():
            died[rank] = f"was killed by signal {-code}" if code < 0 else f"exited with code {code}"

    def first_line(text: str) -> str:
        return text.splitlines()[0] if text else text

    if died:
        rank = min(died)
        others = "".join(f"; rank {r} then failed: {first_line(t)}" for r, t in errors.items())
        return RankFailure(
            f"rank {rank} {died[rank]} before finishing{others}; all ranks were stopped",
            ranks=(rank,),
            reason="died",
        )
    causes = [r for r, t in errors.items() if not any(s in first_line(t) for s in _PEER_SYMPTOMS)]
    rank = min(causes) if causes else min(errors)
    return RankFailure(f"rank {rank} raised: {errors[rank]}", ranks=(rank,), reason="error")


def _watch(procs: list[Any], run_dir: Path, deadline: float, timeout_s: float) -> None:
    """Wait for every rank to leave a result; on the first failure kill all and raise."""
    world_size = len(procs)
    done_at: dict[int, float] = {}
    while True:
        now = time.monotonic()
        failed = any((run_dir / f"error_{r}.txt").exists() for r in range(world_size))
        dead: list[int] = []
        for rank, proc in enumerate(procs):
            has_result = (run_dir / f"result_{rank}.pkl").exists()
            if has_result:
                done_at.setdefault(rank, now)
            elif proc.exitcode is not None:
                dead.append(rank)
        if failed or dead:
            raise _diagnose(procs, run_dir)
        if len(done_at) == world_size:
            # Every result is in: give the ranks a moment to tear down, then stop them anyway.
            if all(not p.is_alive() for p in procs) or now - max(done_at.values()) > _EXIT_GRACE_S:
                return
        elif now > deadline:
            late = tuple(r for r in range(world_size) if r not in done_at)
            _kill_all(procs)
            names = ", ".join(str(r) for r in late)
            raise RankFailure(
                f"rank(s) {names} did not finish within the {timeout_s:g} s "
                f"timeout; all ranks were stopped",
                ranks=late,
                reason="timeout",
            )
        time.sleep(_POLL_S)


def run_distributed(
    fn: Callable[..., Any],
    world_size: int | None,
    *,
    args: tuple[Any, ...] = (),
    backend: str = "gloo",
    timeout_s: float = 120.0,
    realtime: bool = False,
) -> tuple[Any, bool]:
    """Run ``fn`` under torchrun if this process is a torchrun rank, else spawn local ranks.

    Args:
        fn: rank function, as for :func:`spawn_ranks`.
        world_size: ranks to spawn when not under torchrun (ignored under torchrun, where the
            job's WORLD_SIZE rules; None there means "whatever torchrun says").
        args: extra arguments for ``fn``.
        backend: ``"gloo"`` or ``"nccl"``.
        timeout_s: run deadline (spawn) and process-group timeout (both).
        realtime: run the ranks (under torchrun: this process) under SCHED_RR.

    Returns:
        ``(result, is_reporter)``: the result of rank 0 (spawn) or of this rank (torchrun), and
        whether this process should print and write files (always true for spawn; rank 0 only
        under torchrun).

    Raises:
        RankFailure: see :func:`spawn_ranks`.
        ValueError: world_size is None outside torchrun.
        ConfigError: no torch, or a backend it lacks (:func:`check_backend`).
    """
    check_backend(backend, world_size)
    if in_torchrun():
        _limit_threads()
        if realtime:
            _enter_realtime()
        rank = int(os.environ["RANK"])
        size = int(os.environ["WORLD_SIZE"])
        local_rank = int(os.environ.get("LOCAL_RANK", "0"))
        local_size = int(os.environ.get("LOCAL_WORLD_SIZE", str(size)))
        if backend == "nccl":
            # torch is optional (the validate extra): imported where ranks run
            import torch

            torch.cuda.set_device(local_rank)
        _init_group(backend, timeout_s, init_method="env://")
        # torch is optional (the validate extra): imported where ranks run
        import torch.distributed as dist

        ctx = RankContext(
            rank=rank,
            world_size=size,
            local_rank=local_rank,
            local_world_size=local_size,
            backend=backend,
            device=_device_for(backend, local_rank),
            launcher="torchrun",
        )
        try:
            result = fn(ctx, *args)
        finally:
            dist.destroy_process_group()
        return result, rank == 0
    if world_size is None:
        raise ValueError("world_size is required outside torchrun")
    return spawn_ranks(
        fn, world_size, args=args, backend=backend, timeout_s=timeout_s, realtime=realtime
    )[0], True
