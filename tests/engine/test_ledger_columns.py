"""A ledger's patterns placed as columns (``MemoryLedger.place_ops``) read as the same placed
row by row: the same events in the same order, peak, split, timeline and category peak."""

from __future__ import annotations

import numpy as np

from collsim.step.memory import (
    MemoryEvent,
    MemoryLedger,
    MemoryPattern,
    PlacedOps,
    event_columns,
)


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
