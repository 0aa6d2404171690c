"""One rank's memory events in the order the allocator replay reads them, kept as columns.

:meth:`collsim.step.memory.MemoryLedger.sorted_events` expands every placed pattern into a
labelled event and sorts the lot; the replay (:func:`collsim.step.allocator.replay_ledger`)
then reads a few hundred of them and jumps over the repeats of a pipeline's steady state
(:mod:`collsim.step.replay_period`), after comparing every skipped event with its namesake a
period before. :class:`ReplayEvents` is the same sequence in the same order, sorted with
numpy from the ledger's columns, each event made only when it is read, and the comparison
done on integer columns: the label without its micro-batch as a number, the micro-batch
apart.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from operator import itemgetter
from typing import Any

import numpy as np

from collsim.step.memory import (
    EventBlock,
    MemoryEvent,
    MemoryLedger,
    MemoryPattern,
    PlacedOps,
    SingleEvents,
    pattern_columns,
    time_order,
)
from collsim.step.result import MEMORY_KEYS

__all__ = ["SHIFTING_KINDS", "ReplayEvents", "pattern_digest", "recording_digest", "replay_events"]

SHIFTING_KINDS = ("act", "recompute", "free")
"""Label kinds ``(kind, layer, micro-batch, chunk)`` whose twin a period on is the same label
with its micro-batch shifted (the labelled activations of :class:`MemoryEvent`)."""

_new = tuple.__new__


def _shifts(label: Any) -> bool:
    """Whether ``label`` is ``(kind, layer, micro-batch, chunk)`` of a shifting kind with an
    integer micro-batch."""
    return (
        type(label) is tuple
        and len(label) == 4
        and label[0] in SHIFTING_KINDS
        and type(label[2]) is int
    )


class ReplayEvents(Sequence[MemoryEvent]):
    """:meth:`MemoryLedger.sorted_events` of a ledger as columns (build it with
    :func:`replay_events`). ``self[i]`` is the same event as ``sorted_events()[i]``;
    :meth:`twins_until` answers :func:`collsim.step.replay_period.find_period`'s question on
    the columns."""

    def __init__(
        self,
        singles: Sequence[MemoryEvent],
        placed: PlacedOps,
        flat: list[tuple[float, float, str, Any]],
        columns: dict[str, Any],
    ) -> None:
        self._singles = singles
        self._flat = flat
        """Every pattern's events, one pattern after another."""
        cats = [p.category for p in placed.kinds]
        self._cats = [cats[k] for k in placed.which.tolist()]
        """Each placement's category."""
        self._mbs = list(placed.microbatches)
        self._chunks = list(placed.chunks)
        self._order: list[int] = columns["order"].tolist()
        self._placement: list[int] = columns["placement"].tolist()
        self._source: list[int] = columns["source"].tolist()
        self._built: list[MemoryEvent | None] = [None] * len(self._order)
        self.deltas = columns["deltas"]
        self.categories = columns["categories"]
        self.codes = columns["codes"]
        """The label without its micro-batch, as a number (equal labels, equal numbers)."""
        self.microbatches = columns["microbatches"]
        """The micro-batch of a shifting label (:data:`SHIFTING_KINDS`), else 0."""
        self.shifting = columns["shifting"]
        self.times = columns["times"]
        self.labels: tuple[Any, ...] = columns["labels"]
        """What each label code stands for (:attr:`codes`), in code order."""

    def __len__(self) -> int:
        return len(self._order)

    def __iter__(self) -> Iterator[MemoryEvent]:
        return (self[i] for i in range(len(self._order)))

    def __getitem__(self, i: Any) -> Any:
        if isinstance(i, slice):
            return [self[j] for j in range(*i.indices(len(self._order)))]
        ev = self._built[i]
        if ev is None:
            r = self._order[i]
            singles = len(self._singles)
            if r < singles:
                ev = self._singles[r]
            else:
                p = self._placement[r - singles]
                _, delta, kind, key = self._flat[self._source[r - singles]]
                label = (kind, key, self._mbs[p], self._chunks[p])
                ev = _new(MemoryEvent, (float(self.times[i]), self._cats[p], delta, label))
            self._built[i] = ev
        return ev

    def twins_until(self, x: int, stop: int, period: int, shift: int) -> int:
        """The first ``x' >= x`` (at most ``stop``) where event ``x' + period`` is not event
        ``x'`` with its micro-batch ``shift`` on (:func:`collsim.step.replay_period.
        find_period`'s twins)."""
        stop = min(stop, len(self._order) - period)
        if x >= stop:
            return x
        a, b = slice(x, stop), slice(x + period, stop + period)
        same = self.codes[a] == self.codes[b]
        same &= self.deltas[a] == self.deltas[b]
        same &= self.categories[a] == self.categories[b]
        moved = self.microbatches[b] - self.microbatches[a]
        same &= moved == np.where(self.shifting[a], shift, 0)
        bad = np.flatnonzero(~same)
        return x + int(bad[0]) if len(bad) else stop

    def namesakes(self, s: int) -> Any:
        """Indices after ``s`` of the events whose label is event ``s``'s (a shifting one) with
        a later micro-batch, of its size and category, in order."""
        after = slice(s + 1, None)
        same = self.codes[after] == self.codes[s]
        same &= self.microbatches[after] > self.microbatches[s]
        same &= self.deltas[after] == self.deltas[s]
        same &= self.categories[after] == self.categories[s]
        return np.flatnonzero(same) + (s + 1)


def recording_digest(ledger: MemoryLedger) -> bytes | None:
    """A SHA-256 digest of what ``ledger`` recorded, or None where :func:`replay_events`
    gives the sorted list (then nothing is kept by it): the single events in recording order
    (times, bytes, categories, labels numbered as :class:`ReplayEvents` numbers them, with
    their micro-batches) and the placed patterns (each placement's start, pattern, micro-batch,
    chunk and place among the singles; each pattern by its content,
    :func:`pattern_digest`). The events the allocator replays are these sorted, and the sort
    is a function of them: equal digests, equal events (two recordings that differ share a
    digest with odds of 2**-256), without sorting them. SHA-256: where the CPU has SHA
    instructions (x86 SHA-NI, Armv8 SHA2) OpenSSL hashes a megabyte of columns in about
    half BLAKE2b's time."""
    import hashlib  # OpenSSL's bindings, 2-5 ms of start-up: only a search digests

    singles, placed = ledger.recorded_view()
    if placed is None:
        return None
    read = _labelled(singles, placed, ledger.single_columns)
    if read is None:
        return None
    mbs, chunks, numbers, single = read
    h = hashlib.sha256()
    h.update(len(singles).to_bytes(8, "little"))
    for name in ("times", "deltas", "categories", "codes", "microbatches", "shifting"):
        h.update(np.ascontiguousarray(single[name]).tobytes())
    h.update(repr(tuple(numbers)).encode())
    h.update(len(placed.which).to_bytes(8, "little"))
    h.update(np.asarray(placed.starts, dtype=float).tobytes())
    h.update(np.asarray(placed.which, dtype=np.intp).tobytes())
    h.update(np.asarray(mbs, dtype=np.int64).tobytes())
    h.update(np.asarray(chunks, dtype=np.int64).tobytes())
    h.update(np.asarray(placed.before, dtype=np.intp).tobytes())
    for pattern in placed.kinds:
        h.update(pattern_digest(pattern))
    return h.digest()


def _labelled(
    singles: SingleEvents,
    placed: PlacedOps,
    single_columns: Callable[[], tuple[Any, Any, Any]],
) -> tuple[list[int], list[int], dict[Any, int], dict[str, Any]] | None:
    """The placements' micro-batches and chunks as integers, the label numbers and the
    singles' columns (:func:`_single_columns`), or None where the columns cannot say what the
    labels say (a pattern kind that does not shift, a micro-batch or chunk that is not an
    integer, a label that does not hash)."""
    if not all(_shifting_pattern(p) for p in placed.kinds):
        return None
    mbs, chunks = _integers(placed.microbatches), _integers(placed.chunks)
    if mbs is None or chunks is None or min(chunks) < 0:
        return None
    numbers: dict[Any, int] = {}
    try:
        return mbs, chunks, numbers, _single_columns(singles, single_columns(), numbers)
    except TypeError:  # an unhashable label
        return None


def _shifting_pattern(pattern: MemoryPattern) -> bool:
    """Whether every event kind of ``pattern`` shifts (:data:`SHIFTING_KINDS`)."""
    return all(ev[2] in SHIFTING_KINDS for ev in pattern.events)


def pattern_digest(pattern: MemoryPattern) -> bytes:
    """A SHA-256 digest of ``pattern``'s content (category, events, steps, boundaries), made
    once per pattern (kept on it: a pattern is not changed once made)."""
    known = pattern.digest
    if known is None:
        import hashlib  # OpenSSL's bindings, 2-5 ms of start-up: only a search digests

        at = None if pattern.at is None else pattern.at.tolist()
        text = repr((pattern.category, pattern.events, pattern.steps, at))
        known = pattern.digest = hashlib.sha256(text.encode()).digest()
    return known


def replay_events(ledger: MemoryLedger) -> Sequence[MemoryEvent]:
    """``ledger``'s events in :meth:`~MemoryLedger.sorted_events` order: a
    :class:`ReplayEvents` when the ledger has placed patterns whose kinds all shift and whose
    micro-batches and chunks are integers, else the sorted list itself."""
    singles, placed = ledger.recorded_view()
    built = None if placed is None else _build(singles, placed, ledger.single_columns)
    return ledger.sorted_events() if built is None else built


def _build(
    singles: SingleEvents,
    placed: PlacedOps,
    single_columns: Callable[[], tuple[Any, Any, Any]],
) -> ReplayEvents | None:
    """:class:`ReplayEvents` of the recorded events (``single_columns``: gives the singles'
    times, deltas and categories, :meth:`MemoryLedger.single_columns`, read once the columns
    are known to do), or None where the columns cannot say what the labels say (a kind that
    does not shift, a micro-batch or chunk that is not an integer, a label that does not
    hash)."""
    read = _labelled(singles, placed, single_columns)
    if read is None:
        return None
    mbs, chunks, numbers, single = read
    flat = [ev for pattern in placed.kinds for ev in pattern.events]
    pattern = _pattern_columns(placed, flat, numbers)
    count = len(singles)
    times = np.concatenate([single["times"], pattern["times"]])
    deltas = np.concatenate([single["deltas"], pattern["deltas"]])
    # by time, then signed size, then recording order (as sorted_events' two stable sorts)
    order = time_order(times, deltas, _recording_rank(count, pattern))
    columns = {
        "order": order,
        "placement": pattern["placement"],
        "source": pattern["source"],
        "deltas": deltas[order],
        "times": times[order],
        "labels": tuple(numbers),  # the label of each code, in code order
    }
    for name in ("categories", "codes", "microbatches", "shifting"):
        columns[name] = np.concatenate([single[name], pattern[name]])[order]
    return ReplayEvents(singles, placed._replace(microbatches=mbs, chunks=chunks), flat, columns)


def _recording_rank(count: int, pattern: dict[str, Any]) -> Any:
    """Each event's place in recording order, singles first then the patterns' events
    (``pattern``: :func:`_pattern_columns`): placement p's events come after the singles
    recorded before it (``before[p]``), in pattern order, and placements in their order. With
    the placements' ``before`` never decreasing (a ledger records them in order) the place of
    the k-th pattern event is ``before + k`` and that of single r is r plus the pattern events
    recorded before it; else the ranks of a sort by (before, singles after patterns,
    placement, pattern order)."""
    before = pattern["before"]
    singles = np.arange(count)
    if len(before) < 2 or bool((before[1:] >= before[:-1]).all()):
        return np.concatenate(
            [
                singles + np.searchsorted(before, singles, side="right"),
                before + np.arange(len(before)),
            ]
        )
    record = np.concatenate([singles, before])
    after_singles = np.concatenate([np.ones(count, np.int8), np.zeros(len(before), np.int8)])
    place = np.concatenate([np.zeros(count, np.intp), pattern["placement"]])
    within = np.concatenate([np.zeros(count, np.intp), pattern["within"]])
    ranks = np.empty(count + len(before), dtype=np.intp)
    ranks[np.lexsort((within, place, after_singles, record))] = np.arange(len(ranks))
    return ranks


def _integers(values: Any) -> list[int] | None:
    """``values`` (an array or a list) as a list of Python integers, or None when they are
    not all integers (the labels the ledger makes of them: ``tolist()`` of an array)."""
    if isinstance(values, np.ndarray):
        return values.tolist() if values.dtype.kind in "iu" else None
    values = list(values)
    return values if all(type(v) is int for v in values) else None


def _single_columns(
    singles: SingleEvents, columns: tuple[Any, Any, Any], numbers: dict[Any, int]
) -> dict[str, Any]:
    """The single events' columns (``columns``: their times, deltas and categories); their
    labels numbered in ``numbers``. Each distinct label (by equality, in order of first use:
    thousands of events share a few bucket and message labels, an activation's label is used
    twice) is numbered once, then every event's code and whether its label shifts are read
    from those numbers in one pass each (a block's from its distinct labels, as arrays)."""
    times, deltas, categories = columns
    code_of: dict[Any, int] = {}
    shifts: dict[Any, bool] = {}

    def number(label: Any) -> None:
        if label not in code_of:
            shift = type(label) is tuple and _shifts(label)
            key = ("s", label[0], label[1], label[3]) if shift else ("n", label)
            code_of[label] = numbers.setdefault(key, len(numbers))
            shifts[label] = shift

    codes, shifting, microbatches = [], [], []
    for piece in singles.pieces():  # in order: labels numbered in order of first use
        if isinstance(piece, EventBlock):
            for i in piece.first_uses():
                number(piece.labels[i])
            table = piece.labels
            # (a label no event uses: -1, never read)
            codes.append(np.array([code_of.get(x, -1) for x in table], np.int64)[piece.label_of])
            shift = np.array([shifts.get(x, False) for x in table], dtype=bool)
            mbs = np.array([x[2] if shifts.get(x) else 0 for x in table], dtype=np.int64)
            shifting.append(shift[piece.label_of])
            microbatches.append(mbs[piece.label_of])
            continue
        labels = list(map(itemgetter(3), piece))
        for label in dict.fromkeys(labels):
            number(label)
        n = len(labels)
        shift = np.fromiter(map(shifts.__getitem__, labels), dtype=bool, count=n)
        at = np.flatnonzero(shift).tolist()
        mbs = np.zeros(n, dtype=np.int64)
        mbs[at] = [labels[i][2] for i in at]
        codes.append(np.fromiter(map(code_of.__getitem__, labels), dtype=np.int64, count=n))
        shifting.append(shift)
        microbatches.append(mbs)
    empty = [np.zeros(0, dtype=np.int64)]
    return {
        "times": times,
        "deltas": deltas,
        "categories": categories,
        "codes": np.concatenate(codes or empty),
        "microbatches": np.concatenate(microbatches or empty),
        "shifting": np.concatenate(shifting or [np.zeros(0, dtype=bool)]),
    }


def _pattern_columns(
    placed: PlacedOps, flat: list[tuple[float, float, str, Any]], numbers: dict[Any, int]
) -> dict[str, Any]:
    """The placed patterns' events' columns, placement after placement in recording order,
    each placement's events in its pattern's order; labels numbered in ``numbers``."""
    kinds = placed.kinds
    sizes = np.array([len(p.events) for p in kinds], dtype=np.intp)
    base = np.cumsum(sizes) - sizes
    which = np.asarray(placed.which, dtype=np.intp)
    lens = sizes[which]
    ends = np.cumsum(lens)
    total = int(ends[-1]) if len(ends) else 0
    placement = np.repeat(np.arange(len(which)), lens)
    within = np.arange(total) - np.repeat(ends - lens, lens)
    source = base[which][placement] + within
    offsets, deltas = pattern_columns(kinds)
    chunks = np.asarray(placed.chunks, dtype=np.int64)[placement]
    width = int(chunks.max()) + 1 if total else 1
    pairs, inverse = np.unique(source * width + chunks, return_inverse=True)
    table = np.empty(len(pairs), dtype=np.int64)
    for u, pair in enumerate(pairs.tolist()):
        src, chunk = divmod(pair, width)
        _, _, kind, key = flat[src]
        table[u] = numbers.setdefault(("s", kind, key, chunk), len(numbers))
    index = {k: i for i, k in enumerate(MEMORY_KEYS)}
    categories = np.array([index[p.category] for p in kinds], dtype=np.int8)
    starts = np.asarray(placed.starts, dtype=float)
    times = starts[placement] + offsets[source]
    for q, pattern in enumerate(kinds):
        if pattern.steps is not None:  # its boundaries added up as a clock would
            mine = which == q
            times[np.repeat(mine, lens)] = pattern.times(starts[mine]).ravel()
    return {
        "before": np.asarray(placed.before, dtype=np.intp)[placement],
        "placement": placement,
        "within": within,
        "source": source,
        "times": times,
        "deltas": deltas[source],
        "categories": categories[which][placement],
        "codes": table[inverse.reshape(-1)],
        "microbatches": np.asarray(placed.microbatches, dtype=np.int64)[placement],
        "shifting": np.ones(total, dtype=bool),
    }
