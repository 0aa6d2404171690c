"""Memory of one rank as a timeline of allocations and frees.

Every tensor the engine allocates is an event ``(time_s, category, delta_bytes, label)``.
Events may be recorded ahead of simulated time (a fused op knows when each of its layers ends),
so they are sorted by time at the end; at equal times by signed size, so frees come before
allocations (memory released at an instant is reusable at that instant, as a caching allocator
reuses a freed block). The timeline therefore does not depend on the order in which
simultaneous events were recorded, so the engine and the closed form, which record them in
different orders, read the same peak. Peak memory and the category split at the
peak are read from the sorted timeline; the closed forms (ZeRO, Korthikanti) are only tests.

An op that repeats (the same chunk and phase, every micro-batch) records its activation events
as one :class:`MemoryPattern` placed at the op's start (:meth:`MemoryLedger.place`): one append
per op instead of one tuple per layer. Single events a walk knows as arrays (a ZeRO-2 step's
thousands of bucket buffers) are recorded as an :class:`EventBlock` of columns. The sorted
arrays are built from the patterns and blocks with numpy; the event list
(:attr:`MemoryLedger.events`, with labels) is expanded only when asked for.
"""

from __future__ import annotations

from bisect import bisect_right
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from operator import itemgetter
from typing import Any, NamedTuple

import numpy as np

from collsim.core.errors import SimulationError
from collsim.step.result import MEMORY_KEYS
from collsim.step.shapes import ShapeCache, same_objects

_CATEGORY_NUMBER = {k: i for i, k in enumerate(MEMORY_KEYS)}
_new = tuple.__new__
"""A NamedTuple made without its keyword-argument layer: ``_new(MemoryEvent, (t, c, d, l))``
is ``MemoryEvent(t, c, d, l)`` (the ledger makes thousands per step)."""

__all__ = [
    "EventBlock",
    "MemoryEvent",
    "MemoryLedger",
    "MemoryPattern",
    "MemoryPeak",
    "PlacedOps",
    "SingleEvents",
    "Timelines",
    "event_columns",
    "first_uses",
    "numbered_patterns",
    "pattern_columns",
    "time_order",
]


class MemoryEvent(NamedTuple):
    """One allocation (delta > 0) or free (delta < 0)."""

    time_s: float
    category: str
    delta_bytes: float
    label: Any
    """What it is: a string, or a tuple such as ("act", layer, microbatch, chunk)."""


class EventBlock(NamedTuple):
    """Single events recorded as columns (:meth:`MemoryLedger.add_block`): where a walk knows
    thousands of events as arrays, the ledger keeps them so and makes an event only when one
    is read."""

    at: int
    """How many events of the ledger's list come before the block."""
    times: Any
    deltas: Any
    categories: Any
    """Category numbers (:data:`MEMORY_KEYS` order, int8)."""
    labels: tuple[Any, ...]
    """The distinct labels of the block's events."""
    label_of: Any
    """Each event's label as an index into ``labels`` (integer array)."""

    def first_uses(self) -> list[int]:
        """The indices into ``labels`` of the labels the events use, in order of first use
        (one pass over the events per label: a block has a handful)."""
        return first_uses(self.label_of, len(self.labels))

    def event(self, i: int) -> MemoryEvent:
        """The block's ``i``-th event."""
        return _new(
            MemoryEvent,
            (
                float(self.times[i]),
                MEMORY_KEYS[self.categories[i]],
                float(self.deltas[i]),
                self.labels[self.label_of[i]],
            ),
        )

    def events(self) -> list[MemoryEvent]:
        """The block's events in order."""
        cats = [MEMORY_KEYS[c] for c in self.categories.tolist()]
        labels = [self.labels[i] for i in self.label_of.tolist()]
        rows = zip(self.times.tolist(), cats, self.deltas.tolist(), labels, strict=True)
        return list(map(_new, [MemoryEvent] * len(cats), rows))


LEXSORT_MAX_EVENTS = 4096
"""Up to how many events :func:`time_order` and :func:`moved_order` take the permutation from
one ``numpy.lexsort``: on ledgers sampled from the three searches' walks (860-3,700 events) a
lexsort was mostly the faster (for a replay's moved events, always: a third to two thirds of
the time), and from some 5,000 events on (a ZeRO-2 stage of the MoE search records 20,000)
the stable sort by time with the ties sorted apart is the cheaper (measured on one core:
docs/derivations.md, measurements)."""


def time_order(times: Any, deltas: Any, then: Any = None) -> Any:
    """The permutation ``numpy.lexsort((deltas, times))`` gives (with ``then``:
    ``numpy.lexsort((then, deltas, times))``); above :data:`LEXSORT_MAX_EVENTS` events made
    cheaper: a stable sort by time (a ledger's columns are a few runs already in time order,
    which a stable sort merges), then the events that share a time, usually a few hundred of
    tens of thousands, sorted among themselves by the other keys (both sorts are stable, so
    events equal in every key keep their order: the same permutation; two keys as one complex
    number, which numpy orders by real part, then imaginary part)."""
    if len(times) <= LEXSORT_MAX_EVENTS:
        return np.lexsort((deltas, times) if then is None else (then, deltas, times))
    order = np.argsort(times, kind="stable")
    at_time = times[order]
    tie = at_time[1:] == at_time[:-1]
    if not tie.any():
        return order
    tied = np.zeros(len(order), dtype=bool)
    tied[1:] |= tie
    tied[:-1] |= tie
    at = np.flatnonzero(tied)
    group = at_time[at]  # the time each shares: in order, so it says which run it is in
    members = order[at]
    if then is None:  # by (time, size) as complex numbers, stably
        order[at] = members[np.argsort(group + 1j * deltas[members], kind="stable")]
    else:
        order[at] = members[np.lexsort((then[members], deltas[members], group))]
    return order


def moved_order(order: Any, moved: Any, times: Any, deltas: Any) -> Any:
    """:func:`time_order` of ``times`` and ``deltas`` when ``order`` was the time order of the
    same columns before the elements ``moved`` (indices, increasing) took their present
    values: the others keep their order among themselves; each moved one is placed among
    them by (time, size, index), the order a stable sort by (time, size) gives (up to
    :data:`LEXSORT_MAX_EVENTS` events, that sort itself: ``numpy.lexsort``)."""
    if not len(moved):
        return order
    if len(order) <= LEXSORT_MAX_EVENTS:
        return np.lexsort((deltas, times))
    is_moved = np.zeros(len(order), dtype=bool)
    is_moved[moved] = True
    kept = order[~is_moved[order]]
    new = moved[time_order(times[moved], deltas[moved])]
    keys = times[kept] + 1j * deltas[kept]  # (numpy orders complex numbers lexicographically)
    mine = times[new] + 1j * deltas[new]
    at = np.searchsorted(keys, mine, side="left")
    past = np.searchsorted(keys, mine, side="right")
    for j in np.flatnonzero(past > at).tolist():  # equal keys: by index
        lo, hi = int(at[j]), int(past[j])
        at[j] = lo + int(np.searchsorted(kept[lo:hi], new[j]))
    return np.insert(kept, at, new)


def first_uses(label_of: Any, count: int) -> list[int]:
    """The values in ``0..count-1`` that ``label_of`` (an integer array) holds, in order of
    first appearance (one vectorized pass per value: for a short table of labels, far cheaper
    than sorting the array)."""
    if not len(label_of):
        return []
    firsts = []
    for i in range(count):
        where = label_of == i
        j = int(where.argmax())
        if where[j]:
            firsts.append((j, i))
    return [i for _, i in sorted(firsts)]


class SingleEvents(Sequence[MemoryEvent]):
    """A ledger's single events in recording order (its list with its blocks between them,
    :meth:`MemoryLedger.recorded_view`): an event of a block made when it is read."""

    def __init__(self, listed: list[MemoryEvent], blocks: list[EventBlock]) -> None:
        self.listed = listed
        self.blocks = blocks
        starts, through, n = [], [], 0  # each block's first index; the blocks' events up to it
        for block in blocks:
            starts.append(block.at + n)
            n += len(block.times)
            through.append(n)
        self._starts, self._through = starts, through
        self._count = len(listed) + n

    def __len__(self) -> int:
        return self._count

    def __getitem__(self, i: Any) -> Any:
        if isinstance(i, slice):
            return [self[j] for j in range(*i.indices(self._count))]
        if i < 0:
            i += self._count
        k = bisect_right(self._starts, i) - 1  # the last block that starts at or before i
        if k < 0:
            return self.listed[i]
        within = i - self._starts[k]
        if within < len(self.blocks[k].times):
            return self.blocks[k].event(within)
        return self.listed[i - self._through[k]]

    def pieces(self) -> Iterator[list[MemoryEvent] | EventBlock]:
        """The events in order as runs: slices of the list and blocks (none empty)."""
        done = 0
        for block in self.blocks:
            if block.at > done:
                yield self.listed[done : block.at]
            yield block
            done = block.at
        if len(self.listed) > done:
            yield self.listed[done:]


class MemoryPattern:
    """The events of one op relative to its start, all of one category.

    Args:
        category: a MEMORY_KEYS category.
        events: ``(offset_s, delta_bytes, kind, key)`` per event; zero deltas are dropped. A
            placed event is labelled ``(kind, key, microbatch, chunk)``.
        steps: the seconds of the op's segments, one after another, when its events fall on
            their boundaries; ``at``: each event's boundary (0 the start, ``i`` the end of
            segment ``i - 1``). A placement's boundaries are then its start with the steps
            added one by one (:meth:`times`), the very floats of a clock that runs the
            segments in turn, where ``start + offset_s`` can be a rounding apart.
    """

    __slots__ = ("at", "category", "digest", "events", "steps")

    def __init__(
        self,
        category: str,
        events: list[tuple[float, float, str, Any]],
        steps: tuple[float, ...] | None = None,
        at: list[int] | None = None,
    ) -> None:
        if category not in MEMORY_KEYS:
            raise SimulationError(f"unknown memory category {category!r}")
        if (steps is None) != (at is None) or (
            at is not None
            and steps is not None
            and (len(at) != len(events) or any(not 0 <= i <= len(steps) for i in at))
        ):
            raise SimulationError(
                "a stepped pattern needs one boundary in 0..len(steps) per event (steps and at)"
            )
        self.category = category
        kept = [i for i, ev in enumerate(events) if ev[1]]
        self.events = [
            (float(t), float(d), kind, key) for t, d, kind, key in map(events.__getitem__, kept)
        ]
        self.steps = steps
        self.at = None if at is None else np.array([at[i] for i in kept], dtype=np.intp)
        self.digest: bytes | None = None
        """A digest of the content, made when a search first keys a replay by it
        (:func:`collsim.step.replay_events.recording_digest`)."""

    def times(self, starts: Any) -> Any:
        """A stepped pattern's event times placed at each of ``starts`` (an array): one row
        per start, one column per event (a pattern without steps is placed at ``start +
        offset``, for all its placements at once: :func:`_pattern_arrays`)."""
        if self.steps is None:
            raise SimulationError("MemoryPattern.times: a pattern without steps")
        starts = np.asarray(starts, dtype=float)
        grid = np.empty((len(starts), len(self.steps) + 1))
        grid[:, 0] = starts
        grid[:, 1:] = self.steps
        np.add.accumulate(grid, axis=1, out=grid)  # left to right along each row
        return grid[:, self.at]

    def times_at(self, start_s: float) -> list[float]:
        """The events' times placed at ``start_s`` (:meth:`times` of one start, in Python)."""
        if self.steps is None:
            return [start_s + ev[0] for ev in self.events]
        bounds = [start_s]
        t = start_s
        for step in self.steps:
            t += step
            bounds.append(t)
        return [bounds[i] for i in self.at.tolist()]  # type: ignore[union-attr]


def pattern_columns(kinds: list[MemoryPattern]) -> tuple[Any, Any]:
    """(offsets, deltas) of the events of ``kinds``, one pattern after another, as arrays (two
    conversions for all of them: the columns in one transposition)."""
    columns = list(zip(*[ev for pattern in kinds for ev in pattern.events])) or [(), ()]
    return np.array(columns[0], dtype=float), np.array(columns[1], dtype=float)


class PlacedOps(NamedTuple):
    """Patterns placed at the starts of many ops at once, as columns (one entry a placement, in
    recording order; :meth:`MemoryLedger.place_ops`)."""

    starts: Any
    """Float array: each op's start."""
    which: Any
    """Integer array: each placement's pattern, an index into ``kinds``."""
    kinds: list[MemoryPattern]
    """The patterns, distinct, each with events, in order of first placement."""
    microbatches: Any
    """Each placement's micro-batch (an integer array, or a list of what was placed)."""
    chunks: Any
    """Each placement's chunk (as ``microbatches``)."""
    before: Any
    """Integer array: how many single events were recorded before each placement."""
    ops: Any = None
    """Integer array: the op of each placement, in the walk's op order (None when not known:
    a ledger's own rows)."""
    kept: list[Any] | None = None
    """Where :meth:`sorted_columns` keeps what it made (a list of one item, None until made),
    shared by copies of the placements that differ in ``before`` alone (a walk's ZeRO-2
    variants); None: made each time."""

    def sorted_columns(self) -> tuple[Any, Any, Any]:
        """The placed events as (times, deltas, categories) in :func:`_pattern_arrays`' order
        sorted by :func:`time_order` (events equal in time and size in that order)."""
        kept = self.kept
        if kept is not None and kept[0] is not None:
            out: tuple[Any, Any, Any] = kept[0]
            return out
        t, d, c = _pattern_arrays(self.starts, self.which, self.kinds)
        order = time_order(t, d)
        out = (t[order], d[order], c[order])
        if kept is not None:
            kept[0] = out
        return out


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
    _events: list[MemoryEvent] = field(default_factory=list)
    _placed: list[tuple[float, MemoryPattern, int, int, int]] = field(default_factory=list)
    """Patterns placed at op starts, not yet expanded into ``_events``: (start, pattern,
    micro-batch, chunk, how many single events were recorded before it)."""
    _sorted: list[MemoryEvent] | None = None
    _sorted_n: int = 0
    _arr: _Sorted | None = None
    _arr_n: tuple[int, int, int] = (-1, -1, -1)
    _batch: PlacedOps | None = None
    """Placements recorded as columns (:meth:`place_ops`), while ``_placed`` is empty."""
    _known: list[tuple[int, Any, Any, Any]] = field(default_factory=list)
    """Runs of single events whose columns are known (:meth:`known_columns`): (first
    index, times, deltas, categories), in order."""
    _columns: tuple[tuple[int, int, int], tuple[Any, Any, Any]] | None = None
    """:meth:`single_columns` with the (list, count, declared runs) they hold for."""
    _order: tuple[tuple[int, int, int], Any, Any, Any, Any] | None = None
    """The counts, unsorted columns and time order :meth:`known_order` last set."""
    _peaks: tuple[tuple[int, int, int], MemoryPeak, float] | None = None
    """:meth:`peak` and the activations' :meth:`category_peak` as declared
    (:meth:`known_peaks`), with the counts of events they hold for."""
    _blocks: list[EventBlock] = field(default_factory=list)
    """Single events recorded as columns (:meth:`add_block`), in order; merged into
    ``_events`` (:meth:`_settle`) before the list is handed out or read as a list."""

    @property
    def events(self) -> list[MemoryEvent]:
        """Every event in recording order (placed patterns expanded, with their labels)."""
        self._settle()
        self._unbatch()
        if self._placed:
            self._expand()
        return self._events

    def place_ops(self, batch: PlacedOps) -> None:
        """:meth:`place` of many ops, in recording order, as columns (kept as such until a
        row is placed or the events are read)."""
        if not len(batch.starts):
            return
        self._unbatch()
        self._batch = batch
        if self._placed:
            self._unbatch()

    def _unbatch(self) -> None:
        """The columns of :meth:`place_ops` appended to ``_placed`` as rows (Python numbers)."""
        batch = self._batch
        if batch is None:
            return
        self._batch = None
        kinds = batch.kinds
        self._placed.extend(
            zip(
                batch.starts.tolist(),
                [kinds[i] for i in batch.which.tolist()],
                batch.microbatches.tolist(),
                batch.chunks.tolist(),
                batch.before.tolist(),
                strict=True,
            )
        )

    def _expand(self) -> None:
        """Expand the placed patterns into events, in recording order."""
        new = tuple.__new__  # NamedTuple construction without its keyword-argument layer
        singles = self._events
        out: list[MemoryEvent] = []
        done = 0
        for t0, pattern, mb, c, before in self._placed:
            out.extend(singles[done:before])
            done = before
            cat = pattern.category
            out.extend(
                new(MemoryEvent, (t, cat, delta, (kind, key, mb, c)))
                for t, (_, delta, kind, key) in zip(
                    pattern.times_at(t0), pattern.events, strict=True
                )
            )
        out.extend(singles[done:])
        self._placed.clear()
        self._known.clear()  # the single events moved
        self._events = out

    def copy_rows(
        self,
    ) -> tuple[list[MemoryEvent], list[tuple[float, Any, int, int, int]], list[EventBlock]] | None:
        """Copies of the single events and the placed rows, in recording order (columns placed
        as rows), and the blocks of single events (:meth:`add_block`, held: their arrays are
        not written): what ``MemoryLedger(rank, events, placed)`` with :meth:`add_blocks`
        records again; None when some single events are declared as columns
        (:meth:`known_columns`)."""
        self._unbatch()
        if self._known:
            return None
        return list(self._events), list(self._placed), list(self._blocks)

    def add_blocks(self, blocks: list[EventBlock]) -> None:
        """Record blocks of single events as :meth:`copy_rows` gave them (each at its place in
        the event list it was recorded with), after the blocks recorded so far."""
        self._blocks.extend(blocks)

    def rows(
        self,
    ) -> tuple[list[MemoryEvent], list[tuple[float, Any, int, int, int]], list[EventBlock]] | None:
        """The single events, the placed rows and the blocks of single events as the ledger
        holds them (not copies), when it holds the placements as rows and no run of events as
        declared columns: None while some are columns (:meth:`place_ops`,
        :meth:`known_columns`). Valid until the next event is recorded."""
        if self._batch is not None or self._known:
            return None
        return self._events, self._placed, self._blocks

    def add_block(
        self, times: Any, deltas: Any, categories: Any, labels: tuple[Any, ...], label_of: Any
    ) -> None:
        """Record single events given as columns (:class:`EventBlock`: times, signed bytes,
        category numbers, the distinct labels and each event's index into them), after the
        events recorded so far; events of known categories and non-zero sizes, as
        :meth:`alloc` and :meth:`free` record them."""
        if len(times):
            self._blocks.append(
                EventBlock(len(self._events), times, deltas, categories, labels, label_of)
            )

    def _settle(self) -> None:
        """Merge the blocks into the event list, in place (its identity kept)."""
        if not self._blocks:
            return
        singles = self._events
        out: list[MemoryEvent] = []
        done = 0
        for block in self._blocks:
            out.extend(singles[done : block.at])
            out.extend(block.events())
            done = block.at
        out.extend(singles[done:])
        singles[:] = out
        self._blocks = []

    def recorded_view(self) -> tuple[SingleEvents, PlacedOps | None]:
        """:meth:`recorded` with the single events as a :class:`SingleEvents` view (the
        blocks' events not made)."""
        singles, placed = self._recorded()
        return SingleEvents(singles, self._blocks), placed

    def recorded(self) -> tuple[list[MemoryEvent], PlacedOps | None]:
        """The single events and the placed patterns as columns (None without placements), in
        recording order, the patterns not expanded. Valid until the next event is recorded."""
        self._settle()
        return self._recorded()

    def _recorded(self) -> tuple[list[MemoryEvent], PlacedOps | None]:
        """:meth:`recorded` with the blocks left as they are (the list holds their events
        only once they are merged)."""
        if self._batch is not None:  # then nothing in _placed
            return self._events, self._batch
        placed = self._placed
        if not placed:
            return self._events, None
        kinds, which = numbered_patterns(placed)
        n = len(placed)
        return self._events, PlacedOps(
            starts=np.fromiter(map(itemgetter(0), placed), dtype=float, count=n),
            which=which,
            kinds=kinds,
            microbatches=list(map(itemgetter(2), placed)),
            chunks=list(map(itemgetter(3), placed)),
            before=np.fromiter(map(itemgetter(4), placed), np.intp, n),
        )

    def known_columns(self, first: int, columns: tuple[Any, Any, Any]) -> None:
        """Declare the columns (:func:`event_columns`) of the single events recorded from
        index ``first`` on, for the peak arrays to read instead of the events (runs declared
        in recording order, after the events are recorded)."""
        if len(columns[0]):
            self._known.append((first, *columns))

    def place(self, time_s: float, pattern: MemoryPattern, microbatch: int, chunk: int) -> None:
        """Record ``pattern``'s events for an op of ``microbatch`` / ``chunk`` starting at
        ``time_s`` (now or later)."""
        self._settle()
        self._unbatch()
        if pattern.events:
            self._placed.append((time_s, pattern, microbatch, chunk, len(self._events)))

    def appenders(
        self,
    ) -> tuple[list[MemoryEvent], list[tuple[float, MemoryPattern, int, int, int]]]:
        """The lists :meth:`alloc` / :meth:`free` and :meth:`place` append to, for a loop that
        records many events: append ``MemoryEvent(time_s, category, ±bytes, label)`` (a known
        category, a non-zero size) and ``(start, pattern, micro-batch, chunk, len(events))``
        (a pattern with events) as those methods do. Valid until the next read of
        :attr:`events`."""
        self._settle()
        self._unbatch()
        return self._events, self._placed

    def alloc(self, time_s: float, category: str, size_bytes: float, label: Any = "") -> None:
        """Record ``size_bytes`` of ``category`` allocated at ``time_s``."""
        if category not in _CATEGORY_NUMBER:
            raise SimulationError(f"unknown memory category {category!r}")
        if size_bytes:
            self._events.append(_new(MemoryEvent, (time_s, category, float(size_bytes), label)))

    def free(self, time_s: float, category: str, size_bytes: float, label: Any = "") -> None:
        """Record ``size_bytes`` of ``category`` freed at ``time_s``."""
        if size_bytes:
            self._events.append(_new(MemoryEvent, (time_s, category, -float(size_bytes), label)))

    def sorted_events(self) -> list[MemoryEvent]:
        """Events by time; at equal times by signed size (frees first), ties in recording order
        (cached until the next event)."""
        if self._sorted is None or self._sorted_n != len(self.events):
            # two stable sorts (size, then time) give the order of one by (time, size) with
            # ties in recording order, comparing floats instead of key tuples
            events = sorted(self.events, key=itemgetter(2))
            events.sort(key=itemgetter(0))
            self._sorted = events
            self._sorted_n = len(self.events)
        return self._sorted

    def _arrays(self) -> _Sorted:
        """The sorted events as arrays, with the running total after each (cached).

        Sorted by time, then signed size, as :meth:`sorted_events` (:func:`time_order`). The
        single events come first and the placed patterns after them, grouped by pattern
        (columns placed at once come sorted so, :meth:`PlacedOps.sorted_columns`), so
        events that tie on both time and size may sit in another order than recorded; such
        ties have equal sizes, so the running totals (``numpy.cumsum`` adds one element after
        another) and the category split at the peak (the peak never falls inside a run of
        equal frees or equal allocations) are the same in any order.
        """
        key = self._counts()
        if self._arr is not None and self._arr_n == key:
            return self._arr
        t, d, c = self.unsorted_columns()
        self.known_order(t, d, c, time_order(t, d))
        return self._arr  # type: ignore[return-value]

    def known_order(self, times: Any, deltas: Any, cats: Any, order: Any) -> None:
        """Declare the time order (:func:`time_order`) of :meth:`unsorted_columns` (given as
        ``times``, ``deltas``, ``cats``), worked out elsewhere: the sorted arrays the peaks
        read until the next event is recorded."""
        t, d, c = times[order], deltas[order], cats[order]
        self._arr = _Sorted(t, d, c, np.cumsum(d))
        self._arr_n = self._counts()
        self._order = (self._arr_n, times, deltas, cats, order)

    def ordered_columns(self) -> tuple[tuple[int, int, int], Any, Any, Any, Any] | None:
        """What :meth:`known_order` last set, with the counts of the events it held for
        (single, placed rows, placed columns or -1; None before): for another ledger with the
        same events, whose caller checks the counts."""
        return self._order

    def unsorted_columns(self) -> tuple[Any, Any, Any]:
        """Every event as columns, before :meth:`_arrays` sorts them: the single events in
        recording order (:meth:`single_columns`), then the placed patterns'."""
        t, d, c = self.single_columns()
        times, deltas, cats = [t], [d], [c]
        if self._batch is not None:  # then nothing in _placed
            # sorted already: the sort below keeps their order among themselves
            t, d, c = self._batch.sorted_columns()
            times.append(t)
            deltas.append(d)
            cats.append(c)
        elif self._placed:
            t, d, c = self._placed_arrays()
            times.append(t)
            deltas.append(d)
            cats.append(c)
        return np.concatenate(times), np.concatenate(deltas), np.concatenate(cats)

    def single_columns(self) -> tuple[Any, Any, Any]:
        """The single events (placed patterns not expanded) as columns
        (:func:`event_columns`), the runs declared by :meth:`known_columns` taken as declared;
        kept until the next event is recorded (the peaks and the allocator's replay both read
        them)."""
        if self._blocks and self._known:  # (declared runs count the blocks' events)
            self._settle()
        singles = self._events
        key = (id(singles), self._single_count(), len(self._known))
        if self._columns is not None and self._columns[0] == key:
            return self._columns[1]
        if self._blocks:
            pieces = [
                (p.times, p.deltas, p.categories) if isinstance(p, EventBlock) else event_columns(p)
                for p in SingleEvents(singles, self._blocks).pieces()
            ]
            columns = tuple(np.concatenate(c) for c in zip(*pieces, strict=True))
            self._columns = (key, columns)  # type: ignore[assignment]
            return columns  # type: ignore[return-value]
        times, deltas, cats = [], [], []
        done = 0
        for first, *known in [*self._known, (len(singles), None, None, None)]:
            if first > done or known[0] is None:
                t, d, c = event_columns(singles[done:first])
                times.append(t)
                deltas.append(d)
                cats.append(c)
            if known[0] is not None:
                times.append(known[0])
                deltas.append(known[1])
                cats.append(known[2])
                done = first + len(known[0])
        columns = (np.concatenate(times), np.concatenate(deltas), np.concatenate(cats))
        self._columns = (key, columns)
        return columns

    def _placed_arrays(self) -> tuple[Any, Any, Any]:
        """The placed patterns' events as (times, deltas, categories): grouped by pattern in
        order of first use, each placement's events in its pattern's order, placements in
        recording order (per pattern ``start + offsets`` row by row), built with numpy."""
        placed = self._placed
        kinds, which = numbered_patterns(placed)
        starts = np.fromiter(map(itemgetter(0), placed), dtype=float, count=len(placed))
        # the same patterns at the same starts (to the bit) make the same columns: kept for
        # the next ledgers that place them so (the variants of a plan that walk alike)
        key = (tuple(map(id, kinds)), starts.tobytes(), which.tobytes())
        hit = _PLACED.recent(
            "placed columns",
            key,
            lambda: (tuple(kinds), _pattern_arrays(starts, which, kinds)),
            PLACED_KEPT,
            valid=lambda h: same_objects(h[0], kinds),
        )
        return hit[1]

    def timeline(self) -> list[tuple[float, float]]:
        """Step-wise ``(time_s, bytes in use)`` after each distinct event time."""

        arr = self._arrays()
        if not len(arr.times):
            return []
        last = np.flatnonzero(np.append(arr.times[1:] != arr.times[:-1], True))
        return list(zip(arr.times[last].tolist(), arr.totals[last].tolist()))

    def _counts(self) -> tuple[int, int, int]:
        """How many single events, placed rows and placed columns the ledger holds (what
        the cached arrays and declared peaks hold for)."""
        batched = -1 if self._batch is None else len(self._batch.starts)
        return self._single_count(), len(self._placed), batched

    def _single_count(self) -> int:
        """How many single events the ledger holds (its list's and its blocks')."""
        return len(self._events) + sum(len(b.times) for b in self._blocks)

    def known_peaks(self, peak: MemoryPeak, activations_bytes: float) -> None:
        """Declare :meth:`peak` and ``category_peak("activations")`` of the events recorded
        so far (those of another ledger with the same events, worked out before): they hold
        until another event is recorded."""
        self._peaks = (self._counts(), peak, activations_bytes)

    def peak(self) -> MemoryPeak:
        """Highest total in use (checked after every event) and its category split."""
        known = self._peaks
        if known is not None and known[0] == self._counts():
            return MemoryPeak(known[1].time_s, known[1].total_bytes, dict(known[1].by_category))
        arr = self._arrays()
        current = dict.fromkeys(MEMORY_KEYS, 0.0)
        if not len(arr.totals):
            return MemoryPeak(0.0, 0.0, current)
        top = int(np.argmax(arr.totals))  # first index of the maximum
        total = float(arr.totals[top])
        if total <= 0:
            return MemoryPeak(0.0, 0.0, current)
        # per category, its bytes added one after another in timeline order (``bincount``
        # adds each weight to its bin in index order, as ``cumsum`` of the category would)
        kinds = len(MEMORY_KEYS)
        upto = np.bincount(arr.cats[: top + 1], arr.deltas[: top + 1], kinds).tolist()
        final = np.bincount(arr.cats, arr.deltas, kinds).tolist()
        current = dict(zip(MEMORY_KEYS, upto, strict=True))
        if min(final) < -1e-6 * max(1.0, total):
            left = dict(zip(MEMORY_KEYS, final, strict=True))
            raise SimulationError(f"rank {self.rank}: memory freed more than allocated: {left}")
        return MemoryPeak(float(arr.times[top]), total, current)

    def category_peak(self, category: str) -> float:
        """Highest bytes in use of one category over the step."""
        known = self._peaks
        if category == "activations" and known is not None and known[0] == self._counts():
            return known[2]
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


NUMBERINGS_KEPT = 64
"""Sequences of placed patterns whose numbering :func:`numbered_patterns` keeps (the most
recent): the variants of a program walked in full place the same patterns in the same order."""

_NUMBERINGS = ShapeCache()
"""The numberings of the sequences of patterns placed last (:func:`numbered_patterns`)."""


def numbered_patterns(
    placed: Sequence[tuple[float, MemoryPattern, int, int, int]],
) -> tuple[list[MemoryPattern], Any]:
    """The distinct patterns of placed rows in order of first use (by identity: patterns hash
    so) and, row by row, its pattern's index among them (an integer array). Both are kept
    (:data:`NUMBERINGS_KEPT`) with the sequence of patterns they number, and handed to the
    next caller whose rows place the same patterns in the same order (compared element by
    element, by identity): not to be written."""
    patterns = list(map(itemgetter(1), placed))
    if not patterns:
        return [], np.zeros(0, dtype=np.intp)
    held = _NUMBERINGS.recent(
        "pattern numbers",
        (len(patterns), id(patterns[0]), id(patterns[-1])),
        lambda: (patterns, *_numbered(patterns)),
        NUMBERINGS_KEPT,
        valid=lambda h: h[0] == patterns,  # (held: their identities cannot be reused)
    )
    return held[1], held[2]


def _numbered(patterns: list[MemoryPattern]) -> tuple[list[MemoryPattern], Any]:
    """:func:`numbered_patterns` of a sequence of patterns, made."""
    kinds = list(dict.fromkeys(patterns))
    number = {id(p): i for i, p in enumerate(kinds)}
    which = np.fromiter(map(number.__getitem__, map(id, patterns)), np.intp, len(patterns))
    which.flags.writeable = False
    return kinds, which


def event_columns(events: list[MemoryEvent]) -> tuple[Any, Any, Any]:
    """(times, signed bytes, category numbers in :data:`MEMORY_KEYS` order) of ``events``,
    as arrays (each column read straight into its array: ``numpy.fromiter`` over an
    ``itemgetter`` map, all in C, half the cost of transposing the events with ``zip(*)``)."""
    n = len(events)
    category = map(_CATEGORY_NUMBER.__getitem__, map(itemgetter(1), events))
    return (
        np.fromiter(map(itemgetter(0), events), dtype=float, count=n),
        np.fromiter(map(itemgetter(2), events), dtype=float, count=n),
        np.fromiter(category, dtype=np.int8, count=n),
    )


class _KindColumns(NamedTuple):
    """What :func:`_pattern_arrays` reads of a list of distinct patterns, whatever their
    placements (:func:`_kind_columns`)."""

    kinds: tuple[MemoryPattern, ...]
    """The patterns (held: the key is their identities)."""
    sizes: Any
    """Each pattern's event count."""
    base: Any
    """Each pattern's first event in the columns below."""
    offsets: Any
    deltas: Any
    categories: Any
    """Per event of the patterns one after another: offset, signed bytes, category number."""
    stepped: Any
    """Per pattern, whether it has steps (its events on segment boundaries)."""
    steps: Any
    """Per pattern, a zero then its steps, zeros after its last (a row of the padded grid of
    :func:`_stepped_times`; zeros for a pattern without steps)."""
    at: Any
    """Per event, its boundary (0 for a pattern without steps)."""
    cells: Any
    """Per pattern, its steps plus one (the cells of its own row)."""


PLACED_KEPT = 8
"""Placements whose columns :meth:`MemoryLedger._placed_arrays` keeps (the most recently
made): a plan's variants that walk alike place the same patterns at the same starts, one
after another in a search."""

_PLACED = ShapeCache()
"""The columns of the placements made last (:meth:`MemoryLedger._placed_arrays`)."""

KINDS_KEPT = 256
"""Lists of patterns whose columns :func:`_kind_columns` keeps (the most recently made)."""

_KINDS = ShapeCache()
"""The columns of the lists of patterns placed last (:func:`_kind_columns`)."""


def _kind_columns(kinds: list[MemoryPattern]) -> _KindColumns:
    """The columns of ``kinds`` (:class:`_KindColumns`), kept by the patterns' identities for
    the next ledgers that place the same patterns (the variants of a plan in a search)."""
    hit = _KINDS.recent(
        "pattern columns", tuple(map(id, kinds)), lambda: _made_columns(kinds), KINDS_KEPT
    )
    if not same_objects(hit.kinds, kinds):  # pragma: no cover - other patterns, reused ids
        hit = _made_columns(kinds)
    return hit


def _made_columns(kinds: list[MemoryPattern]) -> _KindColumns:
    """The columns of ``kinds``, made (:func:`_kind_columns`)."""
    sizes = np.array([len(p.events) for p in kinds], dtype=np.intp)
    offsets, deltas = pattern_columns(kinds)
    numbers = np.array([_CATEGORY_NUMBER[p.category] for p in kinds], dtype=np.int8)
    cells = np.array([len(p.steps or ()) + 1 for p in kinds], dtype=np.intp)
    steps = np.zeros((len(kinds), int(cells.max())))
    at = [np.zeros(len(p.events), dtype=np.intp) if p.at is None else p.at for p in kinds]
    for q, pattern in enumerate(kinds):
        if pattern.steps is not None:
            steps[q, 1 : cells[q]] = pattern.steps
    return _KindColumns(
        kinds=tuple(kinds),
        sizes=sizes,
        base=np.cumsum(sizes) - sizes,
        offsets=offsets,
        deltas=deltas,
        categories=np.repeat(numbers, sizes),
        stepped=np.array([p.steps is not None for p in kinds], dtype=bool),
        steps=steps,
        at=np.concatenate(at),
        cells=cells,
    )


def _pattern_arrays(starts: Any, which: Any, kinds: list[MemoryPattern]) -> tuple[Any, Any, Any]:
    """Placed patterns' events as (times, deltas, categories) from each placement's start and
    pattern (``which``: an index into ``kinds``, the distinct patterns in order of first use):
    grouped by pattern, each placement's events in its pattern's order, placements in
    recording order (per pattern ``start + offsets`` row by row, or on the placement's
    boundaries for a stepped pattern: :func:`_stepped_times`), built with numpy. What does
    not depend on the starts is made once per sequence of patterns (:func:`_layout`)."""
    k = _kind_columns(kinds)
    lay = _LAYOUTS.recent(
        "placement layouts",
        (id(k), which.tobytes()),
        lambda: _layout(which, k),
        LAYOUTS_KEPT,
        valid=lambda held: held.kinds is k,
    )
    starts = starts[lay.grouped]
    times = np.repeat(starts, lay.lens) + lay.offsets
    if lay.rows is not None:
        times = _stepped_times(times, starts, lay)
    return times, lay.deltas, lay.categories


class _Layout(NamedTuple):
    """What :func:`_pattern_arrays` reads of a sequence of placed patterns, whatever their
    starts (:func:`_layout`)."""

    kinds: _KindColumns
    """The patterns' columns (held: the key is their identity)."""
    grouped: Any
    """The placements grouped by pattern (a stable sort of the sequence)."""
    which: Any
    lens: Any
    """Per grouped placement, its pattern and its event count."""
    offsets: Any
    deltas: Any
    categories: Any
    """Per event of the grouped placements, its offset, signed bytes and category number."""
    rows: Any
    """The grouped placements of stepped patterns (None: none)."""
    padded: bool
    """Whether one grid for them all would be mostly padding (:data:`PADDING_LIMIT`)."""
    grid: Any
    """Their rows of the grid, starts not yet written (not padded: None)."""
    stepped: Any
    """Which events lie on a stepped placement's boundaries (a mask)."""
    event_rows: Any
    boundaries: Any
    """Per such event, its row in the grid and its boundary."""


LAYOUTS_KEPT = 64
"""Sequences of placed patterns whose layout :func:`_pattern_arrays` keeps (the most recent):
the plans of a search whose walks settle the same ops in the same order place their patterns
alike, at other starts."""

_LAYOUTS = ShapeCache()
"""The layouts of the sequences of patterns placed last (:func:`_layout`)."""


def _layout(which: Any, k: _KindColumns) -> _Layout:
    """The layout of the placed sequence ``which`` of the patterns ``k`` (:class:`_Layout`)."""
    grouped = np.argsort(which, kind="stable")
    which = which[grouped]
    lens = k.sizes[which]
    ends = np.cumsum(lens)
    total = int(ends[-1])
    within = np.arange(total) - np.repeat(ends - lens, lens)
    source = np.repeat(k.base[which], lens) + within
    rows = grid = mine = event_rows = boundaries = None
    padded = False
    if k.stepped.any():
        rows = np.flatnonzero(k.stepped[which])
        width = k.steps.shape[1]
        padded = width * len(rows) > PADDING_LIMIT * int(k.cells[which[rows]].sum())
        if not padded:
            grid = k.steps[which[rows]]
            # each event of a stepped placement: its row in the grid and its boundary
            row_of = np.full(len(which), -1, dtype=np.intp)
            row_of[rows] = np.arange(len(rows))
            event_row = np.repeat(row_of, lens)
            mine = event_row >= 0
            event_rows, boundaries = event_row[mine], k.at[source[mine]]
    deltas, categories = k.deltas[source], k.categories[source]
    for shared in (deltas, categories):  # handed to every ledger placing the sequence
        shared.flags.writeable = False
    return _Layout(
        kinds=k,
        grouped=grouped,
        which=which,
        lens=lens,
        offsets=k.offsets[source],
        deltas=deltas,
        categories=categories,
        rows=rows,
        padded=padded,
        grid=grid,
        stepped=mine,
        event_rows=event_rows,
        boundaries=boundaries,
    )


PADDING_LIMIT = 4
"""How many times the cells of its patterns' own steps one grid for all stepped placements
may hold (:func:`_stepped_times`; padding beyond that is placed pattern by pattern)."""


def _stepped_times(times: Any, starts: Any, lay: _Layout) -> Any:
    """``times`` (per event of the grouped placements, :func:`_pattern_arrays`; changed in
    place) with the events of stepped patterns on their placement's boundaries: one grid for
    all of them, a row per placement, its start then its pattern's steps, zeros after the
    last (:meth:`MemoryPattern.times` row by row: a running sum along a row reads only the
    columns before, so the padding changes none of a pattern's boundaries). Patterns of very
    unequal steps (a grid mostly padding) are placed one pattern at a time instead."""
    k, which = lay.kinds, lay.which
    if lay.padded:
        stepped = np.flatnonzero(k.stepped)
        first = np.searchsorted(which, stepped, side="left")
        last = np.searchsorted(which, stepped, side="right")
        block = np.concatenate(([0], np.cumsum(lay.lens)))
        for q, lo, hi in zip(stepped.tolist(), first.tolist(), last.tolist(), strict=True):
            if hi > lo:
                times[block[lo] : block[hi]] = k.kinds[q].times(starts[lo:hi]).ravel()
        return times
    grid = lay.grid.copy()
    grid[:, 0] = starts[lay.rows]
    np.add.accumulate(grid, axis=1, out=grid)
    times[lay.stepped] = grid[lay.event_rows, lay.boundaries]
    return times


class Timelines(Mapping[int, list[tuple[float, float]]]):
    """Rank -> :meth:`MemoryLedger.timeline`, each built when first read (a step's result
    keeps its ledgers' timelines without paying for the ones nobody draws). Pickles as a
    plain dict."""

    def __init__(self, ledgers: Mapping[int, MemoryLedger]) -> None:
        self._ledgers = dict(ledgers)
        self._built: dict[int, list[tuple[float, float]]] = {}

    def __getitem__(self, rank: int) -> list[tuple[float, float]]:
        hit = self._built.get(rank)
        if hit is None:
            hit = self._built[rank] = self._ledgers[rank].timeline()
        return hit

    def __iter__(self) -> Iterator[int]:
        return iter(self._ledgers)

    def __len__(self) -> int:
        return len(self._ledgers)

    def __repr__(self) -> str:
        return f"Timelines(ranks={sorted(self._ledgers)})"

    def __reduce__(self) -> tuple[Any, ...]:
        return (dict, (dict(self.items()),))
