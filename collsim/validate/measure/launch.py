"""Start ranks that cannot hang, one rank function two ways: :func:`spawn_ranks` starts
``world_size`` local processes (the ``spawn`` start method) that join a gloo (or nccl) process
group through a ``FileStore`` in a fresh temporary directory (never a fixed TCP port, so two runs
on one machine cannot collide) and call ``fn(ctx, *args)``, with the parent as a watchdog that
kills every other rank at once when one raises, dies or passes the deadline, and raises
:class:`RankFailure` naming the rank(s) and the cause (no process is left behind); under
``torchrun`` (``RANK``/``WORLD_SIZE``/``MASTER_ADDR`` in the environment) :func:`run_distributed`
joins the job's group through ``env://`` and runs ``fn`` in this process, torchrun being the
watchdog and the process-group timeout bounding every collective. Each rank runs one intra-op and
one inter-op thread (``OMP_NUM_THREADS=1``), so that N ranks on a small machine do not
oversubscribe its cores, and imports torch only inside itself; ``realtime=True`` puts it under
``SCHED_RR`` (:func:`collsim.validate.measure.preflight.enter_realtime` says why)."""

from __future__ import annotations

import multiprocessing
import os
import pickle
import shutil
import signal
import socket
import tempfile
import threading
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path
from typing import Any

from collsim.core.errors import CollsimError
from collsim.validate.measure.preflight import (
    REALTIME_PRIORITY,
    TORCH_HINT,
    check_backend,
    current_scheduling,
    enter_realtime,
    in_torchrun,
    realtime_problem,
)

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


def free_port() -> int:
    """A TCP port that was free a moment ago (bind to port 0, read it, close).

    Only for launchers that insist on a port; :func:`spawn_ranks` uses a FileStore instead.
    """
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


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
            enter_realtime()
        _exit_with_parent(run_dir)
        # torch is optional (the validate extra): imported where ranks run
        import torch.distributed as dist

        # torch re-exports FileStore from its C extension without listing it in __all__
        store = dist.FileStore(str(out / "store"), world_size)  # type: ignore[attr-defined]
        _init_group(backend, timeout_s, store=store, rank=rank, world_size=world_size)
        # every rank's side of the group is up before any runs fn: gloo can finish one rank's
        # join while a peer still connects, and a rank that ran a short fn and left closed
        # that peer's connection under it (torch no longer waits for all ranks in
        # init_process_group unless TORCH_DIST_INIT_BARRIER=1)
        store.set(f"joined_{rank}", "1")
        store.wait([f"joined_{r}" for r in range(world_size)], timedelta(seconds=timeout_s))
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
            enter_realtime()
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
