"""Independent evaluations on N processes (``--jobs N`` of ``search`` and ``sweep``).

:class:`Workers` builds one context per process (an estimator, a loaded scenario) with a
factory, then maps a function ``fn(context, item)`` over items in order. ``jobs=1`` runs
inline in this process (no pool, the same results). On Linux the pool forks, so the
factory's arguments are inherited rather than pickled; elsewhere they are pickled to each
worker at its start. Every map waits at most ``timeout_s``: a worker that hangs or dies is
an error that says so, never a hang.
"""

from __future__ import annotations

import multiprocessing
import os
from collections.abc import Callable, Iterable, Iterator
from concurrent.futures import ProcessPoolExecutor, wait
from concurrent.futures.process import BrokenProcessPool
from typing import Any, Generic, TypeVar

from collsim.errors import SimulationError

__all__ = ["Workers", "default_jobs"]

C = TypeVar("C")
T = TypeVar("T")
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
    _context = factory(*args)


def _call(fn: Callable[[Any, Any], Any], item: Any) -> Any:
    return fn(_context, item)


class Workers(Generic[C]):
    """A pool of ``jobs`` processes, each holding ``factory(*args)``.

    Args:
        jobs: processes (1: inline, no pool).
        factory: builds the context a worker keeps (called once per process).
        args: the factory's arguments.
        timeout_s: the longest one :meth:`map` may take.
    """

    def __init__(
        self,
        jobs: int,
        factory: Callable[..., C],
        args: tuple[Any, ...] = (),
        *,
        timeout_s: float = 3600.0,
    ) -> None:
        if jobs < 1:
            raise ValueError(f"jobs must be >= 1, got {jobs}")
        self.jobs = jobs
        self.timeout_s = timeout_s
        self._pool: ProcessPoolExecutor | None = None
        self._inline: C | None = None
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
        if self._pool is None:
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
        if self._pool is None:
            for item in items:
                yield fn(self._inline, item)  # type: ignore[arg-type]
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

    def close(self) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=True, cancel_futures=True)
            self._pool = None

    def __enter__(self) -> Workers[C]:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
