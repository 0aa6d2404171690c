"""Independent evaluations on this machine's cores or on a Dask cluster (``search``, ``sweep``):
:class:`Workers` builds one context per process (an estimator, a loaded scenario) with a factory,
then maps a function ``fn(context, item)`` over items in order, on one of two backends: the local
one (``--jobs N``: ``jobs=1`` runs inline, more fork a pool whose workers inherit the factory's
arguments) or Dask (``--scheduler tcp://HOST:8786``: :class:`collsim.core.dask_client.DaskPool`).
Every map waits at most ``timeout_s`` and the connection ``connect_timeout_s``: a hang, a dead
pool or a lost scheduler is an error that says so (:class:`SchedulerLost` for the last), never a
hang.
"""

from __future__ import annotations

import multiprocessing
import os
import signal
import time
from collections.abc import Callable, Iterable, Iterator
from concurrent.futures import Future, ProcessPoolExecutor, wait
from concurrent.futures.process import BrokenProcessPool
from typing import Any, Generic, TypeVar

from collsim.core.dask_client import CONNECT_TIMEOUT_S, DaskPool, SchedulerLost, check_scheduler
from collsim.core.errors import SimulationError
from collsim.core.runtime import collector_relaxed
from collsim.core.task_stream import MAX_TASK_ITEMS, stream_tasks

__all__ = [
    "Workers",
    "SchedulerLost",
    "check_scheduler",
    "default_jobs",
    "MAX_TASK_ITEMS",
    "LOCAL_TASK_TARGET_S",
]

#: Seconds of work a task of :meth:`Workers.stream` on this machine's pool is sized to: a
#: local round trip costs a fraction of a millisecond, and a short task keeps the plans
#: estimated past a search's bound (at most two tasks per process) few.
LOCAL_TASK_TARGET_S = 0.05

C = TypeVar("C")
T = TypeVar("T")
K = TypeVar("K")
R = TypeVar("R")

#: The worker process's context, built once by :func:`_start` (one per process).
_context: Any = None


def default_jobs() -> int:
    """The cores this process may run on (its CPU affinity), at least 1."""
    try:
        return max(1, len(os.sched_getaffinity(0)))
    except AttributeError:  # pragma: no cover - not on Linux
        return max(1, os.cpu_count() or 1)


def _start(factory: Callable[..., Any], args: tuple[Any, ...]) -> None:
    global _context
    # Ctrl-C is the parent's to handle (it keeps what is done and closes the pool); a worker
    # that took it too would break the pool under the parent's feet
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    _context = factory(*args)


def _call(fn: Callable[[Any, Any], Any], item: Any) -> Any:
    with collector_relaxed():
        return fn(_context, item)


def _call_batch(fn: Callable[[Any, Any], Any], items: list[Any]) -> tuple[float, list[Any]]:
    """A local task: ``[fn(context, item) for item in items]`` and the seconds they took (the
    collector's full passes made rarer: :func:`~collsim.core.runtime.collector_relaxed`)."""
    started = time.perf_counter()
    with collector_relaxed():
        out = [fn(_context, item) for item in items]
    return time.perf_counter() - started, out


class Workers(Generic[C]):
    """A pool of ``jobs`` processes, each holding ``factory(*args)``.

    Args:
        jobs: processes (1: inline, no pool); ignored with ``scheduler``.
        factory: builds the context a worker keeps (called once per process).
        args: the factory's arguments.
        timeout_s: the longest one :meth:`map` may take.
        scheduler: a Dask scheduler's address (``tcp://HOST:8786``): the items go there.
        connect_timeout_s: the longest the scheduler may take to answer at the start
            (:class:`collsim.core.errors.ConfigError` naming ``--scheduler`` past it).
    """

    def __init__(
        self,
        jobs: int,
        factory: Callable[..., C],
        args: tuple[Any, ...] = (),
        *,
        timeout_s: float = 3600.0,
        scheduler: str | None = None,
        connect_timeout_s: float = CONNECT_TIMEOUT_S,
    ) -> None:
        if jobs < 1:
            raise ValueError(f"jobs must be >= 1, got {jobs}")
        self.jobs = jobs
        self.timeout_s = timeout_s
        self._pool: ProcessPoolExecutor | None = None
        self._inline: C | None = None
        self._dask: DaskPool | None = None
        if scheduler is not None:
            self._dask = DaskPool(
                scheduler,
                factory,
                args,
                timeout_s=timeout_s,
                connect_timeout_s=connect_timeout_s,
            )
            self.jobs = self._dask.slots()
            return
        if jobs == 1:
            self._inline = factory(*args)
            return
        methods = multiprocessing.get_all_start_methods()
        ctx = multiprocessing.get_context("fork" if "fork" in methods else "spawn")
        self._pool = ProcessPoolExecutor(
            max_workers=jobs, mp_context=ctx, initializer=_start, initargs=(factory, args)
        )

    def map(self, fn: Callable[[C, T], R], items: Iterable[T]) -> list[R]:
        """``[fn(context, item) for item in items]``, spread over the processes."""
        items = list(items)
        if self._dask is not None:
            return self._dask.map(fn, items)
        if self._pool is None:
            with collector_relaxed():
                return [fn(self._inline, item) for item in items]  # type: ignore[arg-type]
        futures = [self._pool.submit(_call, fn, item) for item in items]
        done, late = wait(futures, timeout=self.timeout_s)
        if late:
            for future in late:
                future.cancel()
            raise SimulationError(
                f"{len(late)} of {len(futures)} evaluations did not finish in "
                f"{self.timeout_s:g} s on {self.jobs} processes"
            )
        try:
            return [future.result() for future in futures]
        except BrokenProcessPool as exc:
            raise SimulationError(f"a worker process died: {exc}") from None

    def imap(self, fn: Callable[[C, T], R], items: Iterable[T]) -> Iterator[R]:
        """:meth:`map`, yielding each result as soon as it and those before it are done."""
        items = list(items)
        if self._dask is not None:
            yield from self._dask.imap(fn, items)
            return
        if self._pool is None:
            for item in items:
                with collector_relaxed():
                    out = fn(self._inline, item)  # type: ignore[arg-type]
                yield out
            return
        futures = [self._pool.submit(_call, fn, item) for item in items]
        try:
            for future in futures:
                try:
                    yield future.result(timeout=self.timeout_s)
                except TimeoutError:
                    raise SimulationError(
                        f"an evaluation did not finish in {self.timeout_s:g} s "
                        f"on {self.jobs} processes"
                    ) from None
                except BrokenProcessPool as exc:
                    raise SimulationError(f"a worker process died: {exc}") from None
        finally:
            for future in futures:
                future.cancel()

    def stream(
        self, fn: Callable[[C, T], R], feed: Callable[[int], tuple[K, list[T]] | None]
    ) -> Iterator[tuple[K, list[R]]]:
        """Results of batches that ``feed`` picks as workers free up: ``feed(n)`` returns
        ``(tag, items)`` with at most ``n`` items (None: no more), and each batch comes back
        as ``(tag, [fn(context, item) ...])`` in the order fed, so that ``feed`` may choose
        the next items by the results so far. Inline a batch is one item; on the local pool
        and on Dask the batches are tasks sized by their measured cost and sent as soon as a
        process has room (:func:`collsim.core.task_stream.stream_tasks`;
        :data:`LOCAL_TASK_TARGET_S` and :data:`collsim.core.dask_client.TASK_TARGET_S` of work
        each)."""
        if self._dask is not None:
            yield from self._dask.stream(fn, feed)
            return
        pool = self._pool
        if pool is None:
            while (got := feed(self.batch_size)) is not None:
                tag, items = got
                with collector_relaxed():
                    out = [fn(self._inline, item) for item in items]  # type: ignore[arg-type]
                yield tag, out
            return
        yield from stream_tasks(
            feed,
            lambda items: pool.submit(_call_batch, fn, items),
            self._local_outcome,
            lambda: self.jobs,
            target_s=LOCAL_TASK_TARGET_S,
            timeout_s=self.timeout_s,
            late=self._late,
        )

    @staticmethod
    def _local_outcome(future: Future[tuple[float, list[Any]]]) -> tuple[float, list[Any]]:
        """A local task's seconds and results (a dead process: :class:`SimulationError`)."""
        try:
            return future.result()
        except BrokenProcessPool as exc:
            raise SimulationError(f"a worker process died: {exc}") from None

    def _late(self) -> None:
        raise SimulationError(
            f"no evaluation finished in {self.timeout_s:g} s on {self.jobs} processes"
        )

    @property
    def batch_size(self) -> int:
        """Items worth sending in one :meth:`map` when the caller picks them a batch at a
        time: 1 inline, two per process locally, sixteen per worker thread on Dask
        (:meth:`stream` sizes its tasks by their measured cost instead)."""
        if self._dask is not None:
            return 16 * self.jobs
        return 1 if self.jobs == 1 else 2 * self.jobs

    @property
    def backend(self) -> str:
        """``dask tcp://...``, ``N processes`` or ``inline``."""
        if self._dask is not None:
            return f"dask {self._dask.address}"
        return f"{self.jobs} processes" if self._pool is not None else "inline"

    def close(self, *, abandon: bool = False) -> None:
        """Stop the workers: after their work (the default), or at once (``abandon``: the
        processes are terminated, what runs is lost; Ctrl-C and errors take this path)."""
        if self._dask is not None:
            self._dask.close()
            self._dask = None
        if self._pool is not None:
            pool, self._pool = self._pool, None
            if not abandon:
                pool.shutdown(wait=True, cancel_futures=True)
                return
            processes = list(getattr(pool, "_processes", {}).values())
            pool.shutdown(wait=False, cancel_futures=True)
            for process in processes:
                process.terminate()
            for process in processes:
                process.join(timeout=10.0)

    def __enter__(self) -> Workers[C]:
        return self

    def __exit__(self, kind: type[BaseException] | None, *exc: object) -> None:
        self.close(abandon=kind is not None)
