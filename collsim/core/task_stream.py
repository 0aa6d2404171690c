"""The stream of tasks that :class:`collsim.core.jobs.Workers` sends to its local pool and to a
Dask cluster alike: the caller's ``feed`` picks each batch as a worker frees up, a task carries
about a target number of seconds of work as the finished ones measured it, and the results come
back in the order fed.
"""

from __future__ import annotations

import threading
from collections import deque
from collections.abc import Callable, Iterator
from typing import Any, TypeVar

__all__ = ["MAX_TASK_ITEMS", "stream_tasks"]

#: The most items one task carries.
MAX_TASK_ITEMS = 256

K = TypeVar("K")


def stream_tasks(
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
