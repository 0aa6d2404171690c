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
from itertools import accumulate
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

    def _totals(self) -> list[float]:
        """Bytes in use after each sorted event."""
        return list(accumulate(ev[2] for ev in self.sorted_events()))

    def timeline(self) -> list[tuple[float, float]]:
        """Step-wise ``(time_s, bytes in use)`` after each distinct event time."""
        events = self.sorted_events()
        out: list[tuple[float, float]] = []
        for ev, total in zip(events, self._totals()):
            if out and out[-1][0] == ev.time_s:
                out[-1] = (ev.time_s, total)
            else:
                out.append((ev.time_s, total))
        return out

    def peak(self) -> MemoryPeak:
        """Highest total in use (checked after every event) and its category split."""
        events = self.sorted_events()
        totals = self._totals()
        current = dict.fromkeys(MEMORY_KEYS, 0.0)
        if not totals:
            return MemoryPeak(0.0, 0.0, current)
        top = max(range(len(totals)), key=totals.__getitem__)  # first index of the maximum
        if totals[top] <= 0:
            return MemoryPeak(0.0, 0.0, current)
        for ev in events[: top + 1]:
            current[ev.category] += ev.delta_bytes
        final = dict.fromkeys(MEMORY_KEYS, 0.0)
        for ev in events:
            final[ev.category] += ev.delta_bytes
        if min(final.values()) < -1e-6 * max(1.0, totals[top]):
            raise SimulationError(f"rank {self.rank}: memory freed more than allocated: {final}")
        return MemoryPeak(events[top].time_s, totals[top], current)

    def category_peak(self, category: str) -> float:
        """Highest bytes in use of one category over the step."""
        current = best = 0.0
        for ev in self.sorted_events():
            if ev.category == category:
                current += ev.delta_bytes
                best = max(best, current)
        return best

    def in_use(self, time_s: float, category: str | None = None) -> float:
        """Bytes in use just after all events at ``time_s`` (of one category, or all)."""
        total = 0.0
        for ev in self.sorted_events():
            if ev.time_s > time_s:
                break
            if category is None or ev.category == category:
                total += ev.delta_bytes
        return total
