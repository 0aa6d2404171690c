"""The worker side of the Dask backend (:mod:`collsim.core.jobs`): a worker plugin that builds a
map's context once on every worker, those that join later included, and the task that runs a
batch of items with it, so that a task carries its items only (the context, a cluster and a
model of a hundred KB or more, crosses the network once per worker). Loaded only with a Dask
scheduler (the optional ``distributed`` package).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from typing import Any

from distributed.diagnostics.plugin import WorkerPlugin

from collsim.core.runtime import collector_relaxed

__all__ = ["ContextPlugin", "run_batch"]

#: The contexts this worker holds, by the token of the map that registered them, each with the
#: lock its batches take: a worker started with several threads runs one batch of a context at
#: a time (an estimator's caches are one walk's at a time; pure Python gains nothing from a
#: second thread under the GIL).
_contexts: dict[str, tuple[Any, threading.Lock]] = {}


class ContextPlugin(WorkerPlugin):
    """Builds ``factory(*args)`` on a worker when it starts (or when the plugin is
    registered) and drops it when the plugin is removed."""

    idempotent = False

    def __init__(self, token: str, factory: Callable[..., Any], args: tuple[Any, ...]) -> None:
        self.token = token
        self.factory, self.args = factory, args

    def setup(self, worker: Any) -> None:
        _contexts[self.token] = (self.factory(*self.args), threading.Lock())

    def teardown(self, worker: Any) -> None:
        _contexts.pop(self.token, None)


def run_batch(
    token: str, fn: Callable[[Any, Any], Any], items: list[Any]
) -> tuple[float, list[Any]]:
    """One task: ``[fn(context, item) for item in items]`` with this worker's context (one task
    of a context at a time, whatever the worker's threads), and the seconds they took here
    (the client sizes its next tasks by them).

    Raises:
        RuntimeError: the worker holds no context of that token (its plugin did not run).
    """
    held = _contexts.get(token)
    if held is None:
        raise RuntimeError(f"no context {token} on this Dask worker (its plugin did not run)")
    ctx, lock = held
    with lock:  # (the seconds are the batch's own, not its wait for another thread's)
        started = time.perf_counter()
        with collector_relaxed():
            out = [fn(ctx, item) for item in items]
        return time.perf_counter() - started, out
