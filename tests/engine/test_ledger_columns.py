"""A ledger's patterns placed as columns (``MemoryLedger.place_ops``) read as the same placed
row by row: the same events in the same order, peak, split, timeline and category peak; and
single events recorded as a block of columns (``MemoryLedger.add_block``) read as the same
events listed, by the peaks and by the allocator replay's reader."""

from __future__ import annotations

import numpy as np
import pytest

from collsim.step import memory
from collsim.step.memory import (
    MemoryEvent,
    MemoryLedger,
    MemoryPattern,
    PlacedOps,
    event_columns,
    first_uses,
    moved_order,
    numbered_patterns,
    time_order,
)
from collsim.step.replay_events import recording_digest, replay_events
from collsim.step.result import MEMORY_KEYS


def _ledgers() -> tuple[MemoryLedger, MemoryLedger]:
    fwd = MemoryPattern("activations", [(0.0, 4.0, "act", 0), (1.0, 2.0, "act", 1)])
    bwd = MemoryPattern("activations", [(0.5, -4.0, "act", 0), (1.5, -2.0, "act", 1)])
    ops = [(0.0, fwd, 0), (2.0, fwd, 1), (4.0, bwd, 0), (6.0, bwd, 1)]
    rows, columns = MemoryLedger(0), MemoryLedger(0)
    for ledger in (rows, columns):
        ledger.alloc(0.0, "parameters", 8.0, "parameters")
        ledger.alloc(2.0, "buffers", 1.0, "pp recv")
    for t0, pattern, mb in ops:
        rows.place(t0, pattern, mb, 0)
    columns.place_ops(
        PlacedOps(
            starts=np.array([t for t, _, _ in ops]),
            which=np.array([0, 0, 1, 1]),
            kinds=[fwd, bwd],
            microbatches=np.array([mb for _, _, mb in ops]),
            chunks=np.zeros(4, dtype=np.intp),
            before=np.full(4, 2),
        )
    )
    for ledger in (rows, columns):
        ledger.free(7.0, "buffers", 1.0, "pp recv")
    return rows, columns


def test_columns_read_as_rows() -> None:
    rows, columns = _ledgers()
    assert columns.peak() == rows.peak()
    assert columns.timeline() == rows.timeline()
    assert columns.category_peak("activations") == rows.category_peak("activations")
    assert columns.events == rows.events
    assert all(type(e.time_s) is float for e in columns.events)


def test_a_row_after_columns_keeps_the_order() -> None:
    rows, columns = _ledgers()
    late = MemoryPattern("activations", [(0.0, 3.0, "act", 2), (0.5, -3.0, "act", 2)])
    rows.place(8.0, late, 2, 0)
    columns.place(8.0, late, 2, 0)
    assert columns.events == rows.events
    assert columns.peak() == rows.peak()


def test_known_columns_read_as_the_events() -> None:
    rows, columns = _ledgers()
    events = [
        MemoryEvent(8.0, "buffers", 5.0, "pp recv"),
        MemoryEvent(9.0, "buffers", -5.0, "pp recv"),
    ]
    for ledger in (rows, columns):
        ledger.alloc(7.5, "gradients", 1.0)
    columns.known_columns(len(columns.appenders()[0]), event_columns(events))
    for ledger in (rows, columns):
        ledger.appenders()[0].extend(events)
        ledger.alloc(9.5, "gradients", 2.0)
    assert columns.timeline() == rows.timeline()
    assert columns.peak() == rows.peak()
    assert columns.events == rows.events


def _blocked() -> tuple[MemoryLedger, MemoryLedger]:
    """Two ledgers of the same events: one with a run of them recorded as a block of columns
    (``MemoryLedger.add_block``, between listed events and before placed patterns that count
    them), the other with every event listed. The block's events tie in time with listed ones
    and share a label with them (order and numbering then matter)."""
    pattern = MemoryPattern("activations", [(0.0, 4.0, "act", 0), (0.5, -4.0, "free", 0)])
    block = [
        MemoryEvent(1.0, "buffers", 2.0, "pp recv"),
        MemoryEvent(1.0, "buffers", 3.0, "zero2 bucket"),
        MemoryEvent(1.5, "buffers", -3.0, "zero2 bucket"),
        MemoryEvent(2.0, "buffers", -2.0, "pp recv"),
        MemoryEvent(2.0, "buffers", 5.0, "zero2 bucket"),
        MemoryEvent(9.0, "buffers", -5.0, "zero2 bucket"),
    ]
    listed, blocked = MemoryLedger(0), MemoryLedger(0)
    for ledger in (listed, blocked):
        ledger.alloc(0.0, "parameters", 8.0, "parameters")
        ledger.alloc(1.0, "buffers", 1.0, "ddp buckets")
    listed.appenders()[0].extend(block)
    labels = ("zero2 bucket", "pp recv")  # (not in order of first use: numbering must not care)
    blocked.add_block(
        np.array([e.time_s for e in block]),
        np.array([e.delta_bytes for e in block]),
        np.full(len(block), MEMORY_KEYS.index("buffers"), dtype=np.int8),
        labels,
        np.array([labels.index(e.label) for e in block]),
    )
    for ledger in (listed, blocked):
        ledger.place_ops(
            PlacedOps(
                starts=np.array([0.5, 3.0]),
                which=np.array([0, 0]),
                kinds=[pattern],
                microbatches=np.array([0, 1]),
                chunks=np.zeros(2, dtype=np.intp),
                before=np.array([2, 8]),
            )
        )
        ledger.free(9.0, "buffers", 1.0, "ddp buckets")
    return listed, blocked


def test_a_block_of_columns_reads_as_its_events_listed() -> None:
    listed, blocked = _blocked()
    assert blocked._counts() == listed._counts()
    assert [c.tolist() for c in blocked.single_columns()] == [
        c.tolist() for c in listed.single_columns()
    ]
    assert blocked.peak() == listed.peak()
    assert blocked.timeline() == listed.timeline()
    view, _ = blocked.recorded_view()
    assert len(view) == 9
    assert [view[i] for i in range(len(view))] == listed.recorded()[0]
    assert view[-1] == listed.recorded()[0][-1] and view[2:4] == listed.recorded()[0][2:4]
    # the allocator replay reads the same sequence with the same label numbers
    a, b = replay_events(listed), replay_events(blocked)
    assert list(a) == list(b)
    assert a.labels == b.labels and a.codes.tolist() == b.codes.tolist()
    assert recording_digest(listed) == recording_digest(blocked)
    assert blocked.events == listed.events  # (the block merged into the list)
    assert blocked._counts() == listed._counts()


def test_events_recorded_after_a_block_come_after_it() -> None:
    listed, blocked = _blocked()
    for ledger in (listed, blocked):
        appended = ledger.appenders()[0]
        appended.append(MemoryEvent(9.5, "buffers", 4.0, "late"))
        ledger.free(9.5, "buffers", 4.0, "late")
    assert blocked.events == listed.events
    assert blocked.sorted_events() == listed.sorted_events()


def test_the_recording_digest_tells_recordings_apart() -> None:
    """Whatever the allocator replay reads changes the digest: a single's time by one ulp,
    its label, a placement's start, a pattern's content."""
    base = recording_digest(_blocked()[0])
    assert base is not None and base == recording_digest(_blocked()[1])
    changed = []
    ledger = _blocked()[0]
    ledger.alloc(float(np.nextafter(9.0, 10.0)), "buffers", 1.0, "late")
    changed.append(ledger)
    ledger = _blocked()[0]
    ledger.alloc(9.0, "buffers", 1.0, "later")
    changed.append(ledger)
    ledger = _blocked()[0]
    ledger.alloc(9.0, "buffers", 1.0, "late")
    changed.append(ledger)
    ledger = _blocked()[0]
    ledger.place(12.0, MemoryPattern("activations", [(0.0, 4.0, "act", 0)]), 2, 0)
    changed.append(ledger)
    ledger = _blocked()[0]
    ledger.place(12.0, MemoryPattern("activations", [(0.0, 4.0, "act", 1)]), 2, 0)
    changed.append(ledger)
    digests = [recording_digest(x) for x in changed]
    assert None not in digests and len({base, *digests}) == len(digests) + 1


def test_first_uses_lists_the_labels_used_in_order_of_first_use() -> None:
    assert first_uses(np.array([2, 2, 0, 2, 0]), 4) == [2, 0]
    assert first_uses(np.array([], dtype=np.intp), 3) == []
    assert first_uses(np.array([1, 0, 3, 2]), 4) == [1, 0, 3, 2]


@pytest.mark.parametrize("seed", range(8))
def test_time_order_is_the_lexsort_permutation(seed: int, monkeypatch: pytest.MonkeyPatch) -> None:
    """Times with many ties (and -0.0 beside 0.0), sizes with ties too (and signed zeros), a
    third key with ties: the permutation of numpy's lexsort, element for element, with and
    without it, from the sort by time with the ties sorted apart (which larger ledgers take:
    every size here is made to take it)."""
    monkeypatch.setattr(memory, "LEXSORT_MAX_EVENTS", 0)
    rng = np.random.default_rng(seed)
    n = int(rng.integers(0, 400))
    times = rng.choice([0.0, -0.0, 1.0, 2.5, 3.0, 7.25], n) + rng.choice([0.0, 1e-9], n)
    deltas = rng.choice([-4.0, -1.0, -0.0, 0.0, 1.0, 4.0], n)
    then = rng.integers(0, 5, n)
    assert time_order(times, deltas).tolist() == np.lexsort((deltas, times)).tolist()
    expected = np.lexsort((then, deltas, times)).tolist()
    assert time_order(times, deltas, then).tolist() == expected


def test_placements_kept_by_their_starts() -> None:
    """Ledgers that place the same patterns at the same starts share their columns; one start
    moved by the least float step reads its own."""
    fwd = MemoryPattern("activations", [(0.0, 4.0, "act", 0), (1.0, -4.0, "act", 0)])
    stepped = MemoryPattern(
        "activations", [(0.0, 2.0, "act", 1), (0.0, -2.0, "free", 1)], steps=(0.25, 0.5), at=[1, 2]
    )
    starts = [0.0, 0.5, 3.0]

    def placed(moved: float) -> MemoryLedger:
        ledger = MemoryLedger(0)
        ledger.alloc(0.0, "parameters", 1.0, "parameters")
        for i, t0 in enumerate(starts):
            ledger.place(t0 + (moved if i == 1 else 0.0), fwd if i != 2 else stepped, i, 0)
        return ledger

    first, again = placed(0.0), placed(0.0)
    moved = placed(np.nextafter(0.5, 1.0) - 0.5)
    assert again.timeline() == first.timeline()
    assert moved.timeline() != first.timeline()
    assert [t for t, _ in moved.timeline()][1:3] == [np.nextafter(0.5, 1.0), 1.0]


def test_a_sequence_of_patterns_is_numbered_once() -> None:
    """``numbered_patterns``: the distinct patterns by first use and each row's index among
    them; rows that place the same patterns in the same order (at other starts) take the
    numbering made for the first, and a sequence with one pattern swapped for an equal one
    (another object) is numbered anew."""
    a, b, c = (MemoryPattern("activations", [(0.0, 1.0, "act", i)]) for i in range(3))
    rows = [(float(i), p, i, 0, 0) for i, p in enumerate([b, a, b, c, a])]
    kinds, which = numbered_patterns(rows)
    assert kinds == [b, a, c] and which.tolist() == [0, 1, 0, 2, 1]
    later = [(t + 9.0, p, mb, ch, n) for t, p, mb, ch, n in rows]
    again = numbered_patterns(later)
    assert again[0] is kinds and again[1] is which and not which.flags.writeable
    twin = MemoryPattern("activations", [(0.0, 1.0, "act", 2)])  # c's content
    swapped = [*rows[:3], (3.0, twin, 3, 0, 0), rows[4]]
    other = numbered_patterns(swapped)
    assert other[1] is not which and other[0] == [b, a, twin]
    assert other[1].tolist() == [0, 1, 0, 2, 1]


@pytest.mark.parametrize("seed", range(4))
def test_moved_events_take_the_place_a_whole_sort_gives(
    seed: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``moved_order``: some events moved (new times and sizes, many ties), the rest kept in
    their order: the order ``numpy.lexsort`` gives the new columns, from the moved events
    placed among the kept ones (which larger ledgers take: every size here is made to)."""
    monkeypatch.setattr(memory, "LEXSORT_MAX_EVENTS", 0)
    rng = np.random.default_rng(seed)
    for _ in range(300):
        n = int(rng.integers(1, 50))
        times = rng.integers(0, 6, n).astype(float)
        deltas = rng.choice([-2.0, -1.0, 1.0, 3.0], n)
        order = time_order(times, deltas)
        moved = np.sort(rng.choice(n, int(rng.integers(0, n + 1)), replace=False))
        times[moved] = rng.integers(0, 6, len(moved)).astype(float)
        deltas[moved] = rng.choice([-2.0, -1.0, 1.0, 3.0], len(moved))
        assert (
            moved_order(order, moved, times, deltas).tolist()
            == np.lexsort((deltas, times)).tolist()
        )


def _expanded_timeline(ledger: MemoryLedger) -> list[tuple[float, float]]:
    """A ledger's timeline from its events expanded row by row (``MemoryLedger.events``,
    not the columns), sorted as ``time_order`` sorts."""
    events = ledger.events
    times = np.array([e.time_s for e in events])
    deltas = np.array([e.delta_bytes for e in events])
    order = time_order(times, deltas)
    totals = np.cumsum(deltas[order])
    at = times[order]
    last = np.flatnonzero(np.append(at[1:] != at[:-1], True))
    return list(zip(at[last].tolist(), totals[last].tolist(), strict=True))


@pytest.mark.parametrize("uneven", [False, True])
def test_a_sequence_placed_again_reads_its_own_starts(uneven: bool) -> None:
    """Ledgers placing the same patterns in the same order at other starts (a layout kept for
    the sequence, the starts read anew): each reads the events its own placements make, its
    stepped patterns on their own boundaries (one grid for all; ``uneven``: steps so unequal
    that they are placed pattern by pattern)."""
    long_steps = tuple(0.1 * (i + 1) for i in range(40)) if uneven else (0.25, 0.5)
    fwd = MemoryPattern("activations", [(0.0, 4.0, "act", 0), (1.0, -4.0, "act", 0)])
    stepped = MemoryPattern(
        "activations",
        [(0.0, 2.0, "act", 1), (0.0, -2.0, "free", 1)],
        steps=long_steps,
        at=[1, len(long_steps)],
    )
    short = MemoryPattern(
        "activations", [(0.0, 1.0, "act", 2), (0.0, -1.0, "free", 2)], steps=(0.5,), at=[0, 1]
    )
    sequence = [fwd, stepped, fwd, *[short] * 8, stepped]
    rng = np.random.default_rng(3)
    for _ in range(3):
        starts = np.cumsum(rng.uniform(0.5, 3.0, len(sequence))).tolist()
        ledger = MemoryLedger(0)
        ledger.alloc(0.0, "parameters", 1.0, "parameters")
        for i, (t0, pattern) in enumerate(zip(starts, sequence, strict=True)):
            ledger.place(t0, pattern, i, 0)
        assert ledger.timeline() == _expanded_timeline(ledger)
