"""Independent evaluations on this machine's cores or on a Dask cluster (``search``, ``sweep``).

:class:`Workers` builds one context per process (an estimator, a loaded scenario) with a
factory, then maps a function ``fn(context, item)`` over items in order. Two backends: the
local one (``--jobs N``: ``jobs=1`` runs inline, more fork a pool whose workers inherit the
factory's arguments) and Dask (``--scheduler tcp://HOST:8786``, the optional ``distributed``
package): the factory and its arguments go to every worker once, as a worker plugin that builds
the context there (:mod:`collsim.core.dask_worker`; a worker that joins later builds it as it
starts), and the items go in batches that carry nothing else, so a worker that dies is replaced
and its batches rerun by Dask with the same results. Every map waits at most
``timeout_s`` and the connection ``connect_timeout_s``: a hang, a dead pool or a lost scheduler
is an error that says so (:class:`SchedulerLost` for the last), never a hang.
"""

from __future__ import annotations

import logging
import math
import multiprocessing
import os
import signal
import socket
import threading
import time
import uuid
from collections import deque
from collections.abc import Callable, Iterable, Iterator
from concurrent.futures import (
    CancelledError,
    Future,
    ProcessPoolExecutor,
    ThreadPoolExecutor,
    wait,
)
from concurrent.futures.process import BrokenProcessPool
from typing import Any, Generic, TypeVar
from urllib.parse import urlsplit

from collsim.core.errors import ConfigError, SimulationError

__all__ = ["Workers", "SchedulerLost", "check_scheduler", "default_jobs"]

#: Seconds to reach a Dask scheduler before ``--scheduler`` is refused (the issue asks for one
#: line within 10 s on an unreachable address).
CONNECT_TIMEOUT_S = 3.0

#: Times Dask reruns a batch whose task raised (a worker that dies is rescheduled by Dask
#: itself, up to its ``distributed.scheduler.allowed-failures``, 3 by default).
TASK_RETRIES = 2

#: Seconds of work a Dask task of :meth:`Workers.stream` is sized to, by the items' own
#: measured times: the per-task cost of the client, the scheduler and the worker (a few
#: milliseconds, tens on a loaded machine) stays a few percent of it, and the last tasks of a
#: search keep no worker waiting for long.
TASK_TARGET_S = 0.5

#: Seconds of work a task of :meth:`Workers.stream` on this machine's pool is sized to: a
#: local round trip costs a fraction of a millisecond, and a short task keeps the plans
#: estimated past a search's bound (at most two tasks per process) few.
LOCAL_TASK_TARGET_S = 0.05

#: The most items one such task carries.
MAX_TASK_ITEMS = 256

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
    return fn(_context, item)


def check_scheduler(address: str, connect_timeout_s: float = CONNECT_TIMEOUT_S) -> None:
    """Reach the Dask scheduler at ``address`` and let it go: done before long work, so that a
    wrong ``--scheduler`` is one line within seconds.

    A ``tcp://HOST:PORT`` address is first tried with a plain socket, so that a port where
    nothing listens is refused before ``distributed`` is even imported (seconds on a busy
    machine).

    Raises:
        ConfigError: no ``distributed`` package, or no scheduler answers there (exit 2).
    """
    _probe(address, connect_timeout_s)
    _connect(address, connect_timeout_s).close()


def _probe(address: str, timeout_s: float) -> None:
    """Open and close a TCP connection to a ``tcp://HOST:PORT`` address (others: nothing)."""

    if "://" not in address:  # Dask reads HOST:PORT as tcp://HOST:PORT
        address = f"tcp://{address}"
    if not address.startswith("tcp://"):
        return
    try:
        parts = urlsplit(address)
        host, port = parts.hostname, parts.port or 8786  # Dask's default port
    except ValueError as exc:
        raise ConfigError(f"not an address: {address!r} ({exc})", key_path="--scheduler") from None
    if host is None or port is None:
        raise ConfigError(f"expected tcp://HOST:PORT, got {address!r}", key_path="--scheduler")
    try:
        socket.create_connection((host, port), timeout=timeout_s).close()
    except OSError as exc:
        why = exc.strerror or type(exc).__name__
        raise ConfigError(
            f"cannot reach the Dask scheduler {address!r} in {timeout_s:g} s ({why})",
            key_path="--scheduler",
        ) from None


def _connect(address: str, connect_timeout_s: float) -> Any:
    """A ``distributed.Client`` on ``address`` (ConfigError naming ``--scheduler`` if none)."""
    try:
        # optional (the cluster extra): loaded only with a Dask scheduler
        from distributed import Client
    except ImportError:
        raise ConfigError(
            "needs the distributed package (pip install 'collsim[cluster]')",
            key_path="--scheduler",
        ) from None

    # a lost scheduler is reported once, by the caller (SchedulerLost): not also as the
    # client's own "Failed to reconnect" log record
    logging.getLogger("distributed.client").setLevel(logging.CRITICAL)
    try:
        return Client(  # type: ignore[no-untyped-call]
            address, timeout=f"{connect_timeout_s}s", set_as_default=False
        )
    except Exception as exc:  # refused, timed out, a bad address, not a scheduler
        why = " ".join(str(exc).split())[:200] or type(exc).__name__
        raise ConfigError(
            f"cannot reach the Dask scheduler {address!r} in {connect_timeout_s:g} s ({why})",
            key_path="--scheduler",
        ) from None


def _call_batch(fn: Callable[[Any, Any], Any], items: list[Any]) -> tuple[float, list[Any]]:
    """A local task: ``[fn(context, item) for item in items]`` and the seconds they took."""
    started = time.perf_counter()
    out = [fn(_context, item) for item in items]
    return time.perf_counter() - started, out


def _stream(
    feed: Callable[[int], tuple[K, list[Any]] | None],
    submit: Callable[[list[Any]], Any],
    outcome: Callable[[Any], tuple[float, list[Any]]],
    slots: Callable[[], int],
    *,
    target_s: float,
    timeout_s: float,
    late: Callable[[], None],
) -> Iterator[tuple[K, list[Any]]]:
    """The batches ``feed`` picks, as tasks (``submit(items) -> future``; ``outcome(future) ->
    (seconds on the worker, results)``), yielded as ``(tag, results)`` in the order fed. Up to
    two tasks per worker slot are queued or running at any time and a new one is sent as soon
    as one finishes (no worker waits for the others at a barrier); each task carries about
    ``target_s`` seconds of work as the finished ones measured it (one item at first, at most
    :data:`MAX_TASK_ITEMS`). ``late()`` is called (and must raise) when no task finishes in
    ``timeout_s``."""
    queue: deque[tuple[Any, K, int]] = deque()  # (future, tag, items), in sent order
    finished = threading.Event()  # set as any task finishes (the backend's callback thread)
    size, spent_s, done_items = 1, 0.0, 0
    fed = True
    try:
        while True:
            running = sum(1 for future, _, _ in queue if not future.done())
            while fed and running < 2 * slots():
                got = feed(size)
                if got is None:
                    fed = False
                    break
                tag, items = got
                future = submit(items)
                future.add_done_callback(lambda _: finished.set())
                queue.append((future, tag, len(items)))
                running += 1
            if not queue:
                return
            future, tag, count = queue[0]
            if not future.done():
                finished.clear()
                still = sum(1 for f, _, _ in queue if not f.done())
                if still >= running and not finished.wait(timeout_s):
                    late()
                continue
            queue.popleft()
            seconds, results = outcome(future)
            spent_s, done_items = spent_s + seconds, done_items + count
            if spent_s > 0:
                size = max(1, min(MAX_TASK_ITEMS, round(target_s * done_items / spent_s)))
            yield tag, results
    finally:
        for future, _, _ in queue:
            try:
                future.cancel()
            except Exception:  # a client without its scheduler has nothing to cancel
                pass


class SchedulerLost(SimulationError):
    """The Dask scheduler went away (or stopped answering) during a map."""


class _Dask:
    """The Dask side of :class:`Workers`: a client on ``address``, the worker plugin that
    holds the context on every worker, and the batches it sends."""

    def __init__(
        self,
        address: str,
        factory: Callable[..., Any],
        args: tuple[Any, ...],
        *,
        timeout_s: float,
        connect_timeout_s: float,
    ) -> None:
        self.address = address
        self.timeout_s = timeout_s
        self.token = f"collsim-{uuid.uuid4().hex}"
        self.client: Any = _connect(address, connect_timeout_s)
        self._slots: tuple[float, int] | None = None
        try:
            self._register(factory, args)
        except BaseException:
            self.close()
            raise

    def _register(self, factory: Callable[..., Any], args: tuple[Any, ...]) -> None:
        """Send the context's factory to every worker (and to those that join later), and
        wait at most ``timeout_s`` for the workers to build it."""

        # optional (the cluster extra): loaded only with a Dask scheduler
        from collsim.core.dask_worker import ContextPlugin

        plugin = ContextPlugin(self.token, factory, args)
        with ThreadPoolExecutor(max_workers=1) as pool:
            future = pool.submit(self.client.register_plugin, plugin, self.token)
            try:
                future.result(timeout=self.timeout_s)
            except TimeoutError:
                raise SimulationError(
                    f"the Dask workers of {self.address} did not build the context in "
                    f"{self.timeout_s:g} s"
                ) from None

    def slots(self) -> int:
        """Worker threads the cluster has now (at least 1; asked at most once a second)."""
        now = time.monotonic()
        if self._slots is not None and now - self._slots[0] < 1.0:
            return self._slots[1]
        try:
            nthreads: dict[str, int] = self.client.nthreads(callback_timeout=CONNECT_TIMEOUT_S)
            count = max(1, sum(nthreads.values()))
        except Exception:  # a cluster that does not answer has one slot
            count = 1
        self._slots = (now, count)
        return count

    def submit(
        self, fn: Callable[[Any, Any], Any], items: list[Any], *, batched: bool = True
    ) -> list[tuple[Any, int]]:
        """The items in batches (two per worker thread, so that one waits while the other
        runs; one item each unless ``batched``), one task per batch: (future, items in it)."""
        if not items:
            return []

        # optional (the cluster extra): loaded only with a Dask scheduler
        from collsim.core.dask_worker import run_batch

        chunks = min(len(items), 2 * self.slots()) if batched else len(items)
        size = math.ceil(len(items) / chunks)
        out = []
        for start in range(0, len(items), size):
            chunk = items[start : start + size]
            future = self.client.submit(
                run_batch, self.token, fn, chunk, pure=False, retries=TASK_RETRIES
            )
            out.append((future, len(chunk)))
        return out

    def result(self, future: Any, timeout_s: float) -> list[Any]:
        """A batch's results; a lost scheduler or a timeout is a :class:`SimulationError`."""
        return self.outcome(future, timeout_s)[1]

    def outcome(self, future: Any, timeout_s: float) -> tuple[float, list[Any]]:
        """A batch's seconds on its worker and its results (errors as :meth:`result`)."""

        # optional (the cluster extra): loaded only with a Dask scheduler
        from distributed import KilledWorker
        from distributed.client import ClosedClientError
        from distributed.comm.core import CommClosedError

        try:
            seconds, results = future.result(timeout=timeout_s)
            return float(seconds), list(results)
        except KilledWorker as exc:
            raise SimulationError(f"Dask workers died on a batch of plans ({exc})") from None
        except TimeoutError:
            if self.client.status != "running":
                raise SchedulerLost(f"lost the Dask scheduler {self.address}") from None
            raise SimulationError(
                f"a batch did not finish in {timeout_s:g} s on the Dask cluster {self.address}"
            ) from None
        except (CancelledError, ClosedClientError, CommClosedError, OSError) as exc:
            raise SchedulerLost(
                f"lost the Dask scheduler {self.address} ({type(exc).__name__})"
            ) from None

    def _submit(
        self, fn: Callable[[Any, Any], Any], items: list[Any], *, batched: bool = True
    ) -> list[tuple[Any, int]]:
        """:meth:`submit`; a client that lost its scheduler is :class:`SchedulerLost`."""

        # optional (the cluster extra): loaded only with a Dask scheduler
        from distributed.client import ClosedClientError
        from distributed.comm.core import CommClosedError

        try:
            return self.submit(fn, items, batched=batched)
        except (ClosedClientError, CommClosedError, CancelledError, OSError) as exc:
            raise SchedulerLost(
                f"lost the Dask scheduler {self.address} ({type(exc).__name__})"
            ) from None

    def map(self, fn: Callable[[Any, Any], Any], items: list[Any]) -> list[Any]:

        deadline = time.monotonic() + self.timeout_s
        batches = self._submit(fn, items)
        out: list[Any] = []
        try:
            for future, _ in batches:
                out += self.result(future, max(0.1, deadline - time.monotonic()))
        finally:
            for future, _ in batches:
                future.release()
        return out

    def imap(self, fn: Callable[[Any, Any], Any], items: list[Any]) -> Iterator[Any]:
        batches = self._submit(fn, items, batched=False)
        try:
            for future, _ in batches:
                yield from self.result(future, self.timeout_s)
        finally:
            for future, _ in batches:
                try:
                    future.cancel()
                except Exception:  # a client without its scheduler has nothing to cancel
                    pass

    def stream(
        self,
        fn: Callable[[Any, Any], Any],
        feed: Callable[[int], tuple[Any, list[Any]] | None],
    ) -> Iterator[tuple[Any, list[Any]]]:
        """:meth:`Workers.stream` on the cluster (:func:`_stream`): two tasks per worker thread,
        each of about :data:`TASK_TARGET_S` seconds of work."""

        # optional (the cluster extra): loaded only with a Dask scheduler
        from collsim.core.dask_worker import run_batch

        def submit(items: list[Any]) -> Any:
            return self._call(
                self.client.submit,
                run_batch,
                self.token,
                fn,
                items,
                pure=False,
                retries=TASK_RETRIES,
            )

        yield from _stream(
            feed,
            submit,
            lambda future: self.outcome(future, self.timeout_s),
            self.slots,
            target_s=TASK_TARGET_S,
            timeout_s=self.timeout_s,
            late=self._late,
        )

    def _late(self) -> None:
        """No task finished in ``timeout_s``: a lost scheduler or a cluster that hangs."""
        if self.client.status != "running":
            raise SchedulerLost(f"lost the Dask scheduler {self.address}")
        raise SimulationError(
            f"no batch finished in {self.timeout_s:g} s on the Dask cluster {self.address}"
        )

    def _call(self, call: Callable[..., R], *args: Any, **kwargs: Any) -> R:
        """``call(*args, **kwargs)``; a client that lost its scheduler is
        :class:`SchedulerLost`."""

        # optional (the cluster extra): loaded only with a Dask scheduler
        from distributed.client import ClosedClientError
        from distributed.comm.core import CommClosedError

        try:
            return call(*args, **kwargs)
        except (ClosedClientError, CommClosedError, CancelledError, OSError) as exc:
            raise SchedulerLost(
                f"lost the Dask scheduler {self.address} ({type(exc).__name__})"
            ) from None

    def close(self) -> None:
        """Remove the plugin (the workers drop the context) and close the client; a
        scheduler that is gone or slow to answer is left as it is."""
        with ThreadPoolExecutor(max_workers=1) as pool:
            future = pool.submit(self.client.unregister_worker_plugin, self.token)
            try:
                future.result(timeout=CONNECT_TIMEOUT_S)
            except Exception:  # a scheduler that is gone has no plugin to remove
                pass
        try:
            self.client.close(timeout=CONNECT_TIMEOUT_S)
        except Exception:  # closing a client whose scheduler is gone
            pass


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
        self._dask: _Dask | None = None
        if scheduler is not None:
            self._dask = _Dask(
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

    def stream(
        self, fn: Callable[[C, T], R], feed: Callable[[int], tuple[K, list[T]] | None]
    ) -> Iterator[tuple[K, list[R]]]:
        """Results of batches that ``feed`` picks as workers free up: ``feed(n)`` returns
        ``(tag, items)`` with at most ``n`` items (None: no more), and each batch comes back
        as ``(tag, [fn(context, item) ...])`` in the order fed, so that ``feed`` may choose
        the next items by the results so far. Inline a batch is one item; on the local pool
        and on Dask the batches are tasks sized by their measured cost and sent as soon as a
        process has room (:func:`_stream`; :data:`LOCAL_TASK_TARGET_S` and
        :data:`TASK_TARGET_S` of work each)."""
        if self._dask is not None:
            yield from self._dask.stream(fn, feed)
            return
        pool = self._pool
        if pool is None:
            while (got := feed(self.batch_size)) is not None:
                tag, items = got
                yield tag, [fn(self._inline, item) for item in items]  # type: ignore[arg-type]
            return
        yield from _stream(
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
