"""The steady state of an allocator replay: a pipeline's step repeats one period of memory
events (forwards and backwards of later and later micro-batches) many times, and once the
caching allocator and the live allocations come back to the same state a whole number of
periods apart, every later repeat of those periods makes the same requests of the same cache
and changes nothing but the micro-batch numbers. :func:`find_period` finds the period of a
rank's events and :class:`Steady` lets :func:`collsim.step.allocator.replay_ledger` jump
over its repeats: the peaks, retries and unmatched bytes are those of a replay of every event
(a test compares both on every shipped scenario). The argument is in docs/memory.md.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from collsim.step.replay_events import SHIFTING_KINDS, ReplayEvents

__all__ = ["MICROBATCH_AT", "MIN_REPEATS", "Period", "Steady", "find_period"]

MICROBATCH_AT = 2
"""Where a labelled activation's micro-batch sits: ``(kind, layer, micro-batch, chunk)``
(``act``, ``recompute`` and ``free`` labels of :class:`collsim.step.memory.MemoryEvent`) and
its pairing key ``(category, layer, micro-batch, chunk)``."""

_KINDS = SHIFTING_KINDS

MIN_REPEATS = 2
"""Fewer repeats than this are replayed event by event (nothing to gain)."""

CANDIDATES = 32
"""How many later events of the same layer and chunk are tried as the twin that sets the
period (interleaved schedules run micro-batches in groups: the nearest is not always it)."""

WINDOW = 4
"""Periods over which a candidate period's twins are checked before it is taken."""

MAX_BOUNDARIES = 512
"""Period boundaries a replay looks at for a repeated state before it gives up (bounds the
cost of a replay that never settles)."""

MAX_STATES = 3
"""Whole states a replay takes before it gives up (each costs about as much as replaying a
period)."""

KEPT_STATES = 3
"""Whole states kept at the first boundaries of a run of boundaries: a state that recurs from
one of them is seen at its first return, not a cycle later. Each costs about as much as a
few events' replay; on 3d_175b's first stage the first kept state recurs eight periods on. A
data-parallel step's cache settles at the third boundary (the first micro-batch makes the
segments, the second splits them as every later one does): kept there, its return is seen a
period sooner (ddp_gpt3_1.3b: 156 of 420 events replayed instead of 208)."""


@dataclass(frozen=True, slots=True)
class Period:
    """Events repeat every ``events`` events with their micro-batches ``shift`` on (where
    they do: :meth:`Steady._skip` checks each repeat it jumps over)."""

    events: int
    shift: int


def _twins_until(events: Sequence[Any], x: int, stop: int, period: int, shift: int) -> int:
    """The first ``x' >= x`` (at most ``stop``) where ``events[x' + period]`` is not
    ``events[x']`` with its micro-batch ``shift`` on (on the columns of a
    :class:`ReplayEvents`)."""
    if isinstance(events, ReplayEvents):
        return events.twins_until(x, stop, period, shift)
    stop = min(stop, len(events) - period)
    while x < stop:
        a, b = events[x], events[x + period]
        if a[2] != b[2] or a[1] != b[1]:
            return x
        la, lb = a[3], b[3]
        if type(la) is tuple and len(la) == 4 and la[0] in _KINDS and type(la[2]) is int:
            if lb != (la[0], la[1], la[2] + shift, la[3]):
                return x
        elif la != lb:
            return x
        x += 1
    return x


def find_period(events: Sequence[Any]) -> Period | None:
    """The period of a rank's sorted memory events where a pipeline's steady state runs:
    from a labelled activation a third of the way in to one of its next :data:`CANDIDATES`
    namesakes (same kind, layer and chunk, later micro-batch), the first whose twins hold for
    :data:`WINDOW` periods on (interleaved schedules run micro-batches in groups: the nearest
    namesake is not always the period); None when there is none."""
    if isinstance(events, ReplayEvents):
        return _period_of_columns(events)
    n = len(events)
    for s in range(n // 3, n):
        label = events[s][3]
        if not (type(label) is tuple and len(label) == 4 and label[0] in _KINDS):
            continue
        if type(label[2]) is not int:
            continue
        kind, layer, mb, chunk = label
        category, delta = events[s][1], events[s][2]
        tried = 0
        for j in range(s + 1, n):
            ev = events[j]
            lj = ev[3]
            if not (type(lj) is tuple and len(lj) == 4 and lj[0] == kind and lj[1] == layer):
                continue
            if lj[3] != chunk or type(lj[2]) is not int or lj[2] <= mb:
                continue
            if ev[2] != delta or ev[1] != category:
                continue
            period, shift = j - s, lj[2] - mb
            stop = s + WINDOW * period
            if stop <= n - period and _twins_until(events, s, stop, period, shift) >= stop:
                return Period(period, shift)
            tried += 1
            if tried >= CANDIDATES:
                break
        return None
    return None


def _period_of_columns(events: ReplayEvents) -> Period | None:
    """:func:`find_period` on the columns of a :class:`ReplayEvents`."""
    n = len(events)
    first = n // 3
    labelled = events.shifting[first:].nonzero()[0]
    if not len(labelled):
        return None
    s = first + int(labelled[0])
    mb = int(events.microbatches[s])
    for j in events.namesakes(s)[:CANDIDATES].tolist():
        period, shift = j - s, int(events.microbatches[j]) - mb
        stop = s + WINDOW * period
        if stop <= n - period and events.twins_until(s, stop, period, shift) >= stop:
            return Period(period, shift)
    return None


class Steady:
    """The period skip of one replay. At loop tops one period apart (boundaries) a cheap
    signature of the allocator is kept, and the whole state (allocator, live allocations with
    their micro-batches counted from the boundary, the replay's own) at the first
    :data:`KEPT_STATES`. When a signature comes back ``c`` boundaries later, the whole state
    there is compared with the one kept, if any; else it is taken there and compared again
    ``c`` boundaries on (one such comparison at a time). When the two are the same, the
    replay jumps over the whole cycles of ``c`` periods ahead whose events repeat. The
    allocator's addresses may rotate over several periods (buffers of the micro-batches in
    flight), hence cycles, not single periods."""

    def __init__(self, events: Sequence[Any], period: Period) -> None:
        self.events = events
        self.period = period.events
        self.shift = period.shift
        self.anchor = -1
        """The loop top the boundaries are counted from (-1: none yet)."""
        self.due = 0
        """The next boundary."""
        self.seen: dict[tuple[Any, ...], int] = {}
        """Boundary by signature (the latest)."""
        self.waiting: tuple[int, tuple[Any, ...], int] | None = None
        """(the boundary to compare at, the state taken a cycle before it, the cycle)."""
        self.states = 0
        self.kept: dict[int, tuple[Any, ...]] = {}
        """Whole states taken at the first :data:`KEPT_STATES` boundaries, by boundary."""
        self.done = False

    def jump(self, i: int, alloc: Any, pairs: Any, extra: Any) -> int:
        """The loop top to go on from: ``i``, or past the repeats of the state at ``i``
        (``extra``: the replay's own state beside the allocator and the pairing)."""
        if i < self.due or self.done:
            return i
        period = self.period
        if i > self.due or self.anchor < 0:  # the first boundary, or one stepped over
            self.anchor = i
            self.seen.clear()
            self.kept.clear()
            self.waiting = None
        k = (i - self.anchor) // period
        if k >= MAX_BOUNDARIES or i + 2 * period >= len(self.events):
            self.done = True
            return i
        self.due = i + period
        sig = (alloc.signature(), pairs.unmatched, pairs.early, extra)
        before = self.seen.get(sig)
        self.seen[sig] = k
        waiting = self.waiting
        if waiting is not None and waiting[0] == k:
            self.waiting = None
            if _state(alloc, pairs, k * self.shift, extra) == waiting[1]:
                return self._skip(i, waiting[2], pairs)
        now = None
        if before is not None and self.waiting is None:
            # the signature came back: compare with the state kept there, else take the
            # state, to compare a cycle on
            kept = self.kept.get(before)
            if kept is not None:
                now = _state(alloc, pairs, k * self.shift, extra)
                if now == kept:
                    return self._skip(i, k - before, pairs)
            self.states += 1
            if self.states > MAX_STATES:
                self.done = True
                return i
            cycle = k - before
            if now is None:
                now = _state(alloc, pairs, k * self.shift, extra)
            self.waiting = (k + cycle, now, cycle)
        if k < KEPT_STATES:
            self.kept[k] = now if now is not None else _state(alloc, pairs, k * self.shift, extra)
        return i

    def _skip(self, i: int, cycle: int, pairs: Any) -> int:
        """Jump from loop top ``i``, whose state is the one ``cycle`` periods before, over
        the whole cycles ahead whose events are the cycle before them a cycle on. Every event
        from ``cycle`` periods before ``i`` up to the one after the last skipped (the last
        skipped event may look one ahead: a layer's rebuilt activations and their free) must
        be its namesake a period before, a shift on."""
        period = self.period
        first = i - cycle * period
        end = _twins_until(self.events, first, len(self.events), period, self.shift)
        repeats = (end - i + period - 1) // period // cycle * cycle
        if repeats < MIN_REPEATS:
            return i
        self.done = True
        pairs.relabel(repeats * self.shift)
        return i + repeats * period


def _state(alloc: Any, pairs: Any, less: int, extra: Any) -> tuple[Any, ...]:
    """What the rest of a replay depends on: the cache's state
    (:meth:`~collsim.step.caching_allocator.CachingAllocator.state`), the live allocations'
    with their micro-batches ``less`` (``_Pairing.state`` of :mod:`collsim.step.allocator`)
    and the replay's own (``extra``)."""
    return alloc.state(), pairs.state(less), extra
