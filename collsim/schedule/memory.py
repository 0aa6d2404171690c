"""Memory of one rank as a timeline of allocations and frees.

Every tensor the engine allocates is an event ``(time_s, category, delta_bytes, label)``.
Events may be recorded ahead of simulated time (a fused op knows when each of its layers ends),
so they are sorted by time at the end; at equal times by signed size, so frees come before
allocations (memory released at an instant is reusable at that instant, as a caching allocator
reuses a freed block). The timeline therefore does not depend on the order in which
simultaneous events were recorded, so the engine and the closed form, which record them in
different orders, read the same peak. Peak memory and the category split at the
peak are read from the sorted timeline; the closed forms (ZeRO, Korthikanti) are only tests.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from operator import itemgetter
from typing import Any, NamedTuple

from collsim.errors import SimulationError
from collsim.schedule.result import MEMORY_KEYS

__all__ = ["MemoryEvent", "MemoryLedger", "MemoryPeak"]


class MemoryEvent(NamedTuple):
    """One allocation (delta > 0) or free (delta < 0)."""

    time_s: float
    category: str
    delta_bytes: float
    label: Any
    """What it is: a string, or a tuple such as ("act", layer, microbatch, chunk)."""


class _Sorted(NamedTuple):
    times: Any
    deltas: Any
    cats: Any
    totals: Any


@dataclass(slots=True)
class MemoryPeak:
    """The peak of a timeline and what was allocated at that moment."""

    time_s: float
    total_bytes: float
    by_category: dict[str, float]


@dataclass(slots=True)
class MemoryLedger:
    """The allocation events of one rank."""

    rank: int
    events: list[MemoryEvent] = field(default_factory=list)
    _sorted: list[MemoryEvent] | None = None
    _sorted_n: int = 0
    _arr: _Sorted | None = None
    _arr_n: int = -1

    def alloc(self, time_s: float, category: str, size_bytes: float, label: Any = "") -> None:
        """Record ``size_bytes`` of ``category`` allocated at ``time_s``."""
        if category not in MEMORY_KEYS:
            raise SimulationError(f"unknown memory category {category!r}")
        if size_bytes:
            self.events.append(MemoryEvent(time_s, category, float(size_bytes), label))

    def free(self, time_s: float, category: str, size_bytes: float, label: Any = "") -> None:
        """Record ``size_bytes`` of ``category`` freed at ``time_s``."""
        if size_bytes:
            self.events.append(MemoryEvent(time_s, category, -float(size_bytes), label))

    def sorted_events(self) -> list[MemoryEvent]:
        """Events by time; at equal times by signed size (frees first), ties in recording order
        (cached until the next event)."""
        if self._sorted is None or self._sorted_n != len(self.events):
            self._sorted = sorted(self.events, key=itemgetter(0, 2))
            self._sorted_n = len(self.events)
        return self._sorted

    def _arrays(self) -> _Sorted:
        """The sorted events as arrays, with the running total after each (cached).

        Same order as :meth:`sorted_events` (``numpy.lexsort`` is stable), and the same sums:
        ``numpy.cumsum`` adds one element after another, as a Python running sum does.
        """
        n = len(self.events)
        if self._arr is not None and self._arr_n == n:
            return self._arr
        import numpy as np

        times = np.fromiter((ev[0] for ev in self.events), dtype=float, count=n)
        deltas = np.fromiter((ev[2] for ev in self.events), dtype=float, count=n)
        index = {k: i for i, k in enumerate(MEMORY_KEYS)}
        cats = np.fromiter((index[ev[1]] for ev in self.events), dtype=np.int8, count=n)
        order = np.lexsort((deltas, times))
        times, deltas, cats = times[order], deltas[order], cats[order]
        self._arr = _Sorted(times, deltas, cats, np.cumsum(deltas))
        self._arr_n = n
        return self._arr

    def timeline(self) -> list[tuple[float, float]]:
        """Step-wise ``(time_s, bytes in use)`` after each distinct event time."""
        import numpy as np

        arr = self._arrays()
        if not len(arr.times):
            return []
        last = np.flatnonzero(np.append(arr.times[1:] != arr.times[:-1], True))
        return list(zip(arr.times[last].tolist(), arr.totals[last].tolist()))

    def peak(self) -> MemoryPeak:
        """Highest total in use (checked after every event) and its category split."""
        import numpy as np

        arr = self._arrays()
        current = dict.fromkeys(MEMORY_KEYS, 0.0)
        if not len(arr.totals):
            return MemoryPeak(0.0, 0.0, current)
        top = int(np.argmax(arr.totals))  # first index of the maximum
        total = float(arr.totals[top])
        if total <= 0:
            return MemoryPeak(0.0, 0.0, current)
        final = dict.fromkeys(MEMORY_KEYS, 0.0)
        for i, key in enumerate(MEMORY_KEYS):
            mine = arr.deltas[arr.cats == i]
            if len(mine):
                running = np.cumsum(mine)
                upto = int(np.count_nonzero(arr.cats[: top + 1] == i))
                current[key] = float(running[upto - 1]) if upto else 0.0
                final[key] = float(running[-1])
        if min(final.values()) < -1e-6 * max(1.0, total):
            raise SimulationError(f"rank {self.rank}: memory freed more than allocated: {final}")
        return MemoryPeak(float(arr.times[top]), total, current)

    def category_peak(self, category: str) -> float:
        """Highest bytes in use of one category over the step."""
        arr = self._arrays()
        mine = arr.deltas[arr.cats == MEMORY_KEYS.index(category)]
        if not len(mine):
            return 0.0
        return max(0.0, float(mine.cumsum().max()))

    def in_use(self, time_s: float, category: str | None = None) -> float:
        """Bytes in use just after all events at ``time_s`` (of one category, or all)."""
        total = 0.0
        for ev in self.sorted_events():
            if ev.time_s > time_s:
                break
            if category is None or ev.category == category:
                total += ev.delta_bytes
        return total
