"""The client side of the Dask backend of :class:`collsim.core.jobs.Workers` (``--scheduler
tcp://HOST:8786``, the optional ``distributed`` package): :func:`check_scheduler` reaches a
scheduler before long work, and :class:`DaskPool` sends the context's factory to every worker
once (a worker plugin, :mod:`collsim.core.dask_worker`) and the items in tasks that carry
nothing else, so that a worker that dies is replaced and its tasks rerun by Dask with the same
results; a lost scheduler is :class:`SchedulerLost`, never a hang.
"""

from __future__ import annotations

import logging
import math
import socket
import time
import uuid
from collections.abc import Callable, Iterator
from concurrent.futures import CancelledError, ThreadPoolExecutor
from typing import Any, TypeVar
from urllib.parse import urlsplit

from collsim.core.errors import ConfigError, SimulationError
from collsim.core.task_stream import stream_tasks

__all__ = ["DaskPool", "SchedulerLost", "check_scheduler", "CONNECT_TIMEOUT_S"]

#: Seconds to reach a Dask scheduler before ``--scheduler`` is refused (the issue asks for one
#: line within 10 s on an unreachable address).
CONNECT_TIMEOUT_S = 3.0

#: Times Dask reruns a batch whose task raised (a worker that dies is rescheduled by Dask
#: itself, up to its ``distributed.scheduler.allowed-failures``, 3 by default).
TASK_RETRIES = 2

#: Seconds of work a Dask task of :meth:`collsim.core.jobs.Workers.stream` is sized to, by the
#: items' own measured times: the per-task cost of the client, the scheduler and the worker (a few
#: milliseconds, tens on a loaded machine) stays a few percent of it, and the last tasks of a
#: search keep no worker waiting for long.
TASK_TARGET_S = 0.5

R = TypeVar("R")


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
        if isinstance(exc, OSError):  # (distributed's timeouts and closed comms among them)
            message = f"cannot reach the Dask scheduler {address!r} in {connect_timeout_s:g} s"
        else:  # the port answered, in another protocol (Dask read its bytes as a frame)
            message = (
                f"{address!r} answers, but not as a Dask scheduler (a scheduler listens on "
                "port 8786 by default; 8787 is its dashboard)"
            )
        raise ConfigError(f"{message} ({why})", key_path="--scheduler") from None


class SchedulerLost(SimulationError):
    """The Dask scheduler went away (or stopped answering) during a map."""


class DaskPool:
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
        """:meth:`collsim.core.jobs.Workers.stream` on the cluster
        (:func:`collsim.core.task_stream.stream_tasks`): two tasks per worker thread,
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

        yield from stream_tasks(
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
