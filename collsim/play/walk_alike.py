"""ZeRO-3 walks that a program's FSDP prefetch variants share: a search walks one variant in
full, recording each segment loop's state on entry and on exit, and walks the next variant of
the same plan (the same configs but the prefetch depth) by running only its segment loops,
each from the recorded clock; when every loop leaves the clock and waits it left, and a dp
stream and gathered units that act alike from then on, the rest of the walk is the recorded
one (nothing else reads the depth), so the variant's result is the recorded walk's with each
loop's memory events its own. Any difference and the variant is walked in full.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Hashable
from typing import TYPE_CHECKING, Any, NamedTuple, Protocol

import numpy as np

from collsim.play.walk_tables import RankState
from collsim.play.walk_zero3 import Walker as LoopWalker
from collsim.play.walk_zero3 import run_segments
from collsim.step.build import without_dp_knobs
from collsim.step.memory import (
    EventBlock,
    MemoryEvent,
    MemoryLedger,
    event_columns,
    moved_order,
    time_order,
)
from collsim.step.stats import CallStats

if TYPE_CHECKING:
    from collsim.parallel.plan import Plan
    from collsim.step.build import StepSchedule
    from collsim.step.dataparallel import DataParallelRules

__all__ = ["AlikeWalk", "LoopRecord", "alike_key", "record_walk", "replay_walk"]


class Walker(LoopWalker, Protocol):
    """What the replay reads and swaps of :class:`collsim.play.walker.Walker` (and what the
    segment loop reads)."""

    schedule: StepSchedule
    rules: DataParallelRules
    programs: dict[int, RankState]
    stats: CallStats
    runs: dict[tuple[int, int], list[Any]]


Placed = tuple[float, Any, int, int, int]


class LoopRecord(NamedTuple):
    """One segment loop of a recorded walk: whose, which op, the state it found and left."""

    rank: int
    stage: int
    op: int
    entry: tuple[float, float, float]
    """The rank's clock, dp stream free and last dp end on entry."""
    gathered_in: dict[tuple[int, str | int], float]
    first: int
    """How many single events the rank had recorded on entry."""
    out: tuple[float, float, float]
    """The rank's clock, dp stream free and last dp end on exit."""
    gathered_out: dict[tuple[int, str | int], float]
    last: int
    waits: list[float] | None
    """Per segment, its wait for its unit (None: none waited)."""
    issued: int
    """How many unit gathers it issued."""


@dataclasses.dataclass(slots=True)
class AlikeWalk:
    """A full ZeRO-3 walk as its prefetch variants replay it."""

    key: Hashable
    """:func:`alike_key` of the walked plan."""
    loops: list[LoopRecord]
    finals: dict[
        int,
        tuple[list[MemoryEvent], list[Placed], list[EventBlock], dict[str, float], float, float],
    ]
    """Per walked rank, at the end of the walk: its single events, placed rows and blocks of
    single events (copies of the lists), its account (a copy), its clock and its end."""
    stats: CallStats
    """The walk's call tallies (read only from then on)."""
    prefetch: int
    """The walked plan's FSDP prefetch depth."""
    ledgers: dict[int, MemoryLedger] | None = None
    """The walk's ledgers, until the first replay reads their columns and order (their peaks
    made them)."""
    columns: dict[int, tuple[Any, Any, Any, Any]] | None = None
    """Per walked rank, its ledger's unsorted columns and their time order
    (:meth:`~collsim.step.memory.MemoryLedger.unsorted_columns`,
    :func:`~collsim.step.memory.time_order`), made at the first replay: a replay moves only
    its loops' events (:func:`~collsim.step.memory.moved_order`)."""


def alike_key(plan: Plan) -> Hashable:
    """The plan's configs with the FSDP prefetch depth left out: the plans that may replay
    one another's walk (equal as the configs with one depth would be:
    :func:`~collsim.step.build.without_dp_knobs` and the DDP config, without making them)."""
    parallel = plan.parallel
    return (plan.training, type(parallel), without_dp_knobs(parallel), parallel.ddp)


def record_walk(w: Walker, key: Hashable, loops: list[LoopRecord]) -> AlikeWalk | None:
    """The record of a walk that has just run in full (None when a rank's ledger holds runs
    declared as columns, which the replay does not copy)."""
    finals = {}
    for rank, prog in w.programs.items():
        rows = prog.ledger.copy_rows()
        if rows is None:
            return None
        finals[rank] = (*rows, dict(prog.breakdown_s), prog.now, prog.end_s)
    ledgers = {rank: prog.ledger for rank, prog in w.programs.items()}
    return AlikeWalk(key, loops, finals, w.stats, w.rules.prefetch, ledgers)


def replay_walk(w: Walker, held: AlikeWalk) -> bool:
    """Walk ``w`` as ``held`` walked, running only its segment loops (on scratch ranks, each
    from the recorded clock with the dp stream and gathered units its own previous loop left):
    True when every loop left a state that acts as the recorded one (:func:`_alike`), the
    ranks then set to the recorded ends with the loops' own events in place of the recorded
    ones; False (and ``w`` untouched) at the first that did not.

    A recorded loop that issued no gather, found a state that acts as the recorded one, and
    whose variant prefetches at least as deep, is not run: every unit it would issue is then
    gathered already (the depth only issues the same gathers earlier, and without a gather
    the units only go), so it runs as recorded, its events and what it leaves included."""
    schedule = w.schedule
    stats, runs = w.stats, w.runs
    deeper = w.rules.prefetch >= held.prefetch
    made: list[tuple[int, int, list[MemoryEvent]]] = []
    left: dict[int, tuple[float, float, dict[tuple[int, str | int], float]]] = {}
    w.stats, w.runs = CallStats(), {}  # (the loops' tallies and TP runs are the recorded ones)
    try:
        for rec in held.loops:
            before = left.get(rec.rank)  # its own previous loop's; at first, the recorded entry
            if before is None:
                before = (rec.entry[1], rec.entry[2], rec.gathered_in)
            if deeper and not rec.issued and _alike(before, rec.entry, rec.gathered_in):
                left[rec.rank] = (rec.out[1], rec.out[2], rec.gathered_out)
                continue
            prog = RankState(rec.rank, w.programs[rec.rank].coords, MemoryLedger(rec.rank))
            prog.now = rec.entry[0]
            prog.dp_free, prog.dp_last_end = before[0], before[1]
            prog.gathered = dict(before[2])  # (a recorded dict stays as recorded)
            op = schedule.pipeline[rec.stage][rec.op]
            chunk = schedule.stages[rec.stage].chunks[op.chunk]
            waits = run_segments(w, prog, op, chunk, rec.op in schedule.paired.get(rec.stage, ()))
            events = prog.ledger.appenders()[0]
            mine = (prog.dp_free, prog.dp_last_end, prog.gathered)
            if (
                prog.now != rec.out[0]
                or waits != rec.waits
                or prog.gathers_issued != rec.issued
                or len(events) != rec.last - rec.first
                or not _alike(mine, rec.out, rec.gathered_out)
            ):
                return False
            made.append((rec.rank, rec.first, events))
            left[rec.rank] = mine
    finally:
        w.stats, w.runs = stats, runs
    if held.columns is None:
        ledgers, held.ledgers = held.ledgers or {}, None
        held.columns = {
            rank: _ordered(rank, final[0], final[1], final[2], ledgers.get(rank))
            for rank, final in held.finals.items()
        }
    lists = {rank: list(final[0]) for rank, final in held.finals.items()}
    spans: dict[int, list[tuple[int, list[MemoryEvent]]]] = {}
    for rank, first, events in made:
        lists[rank][first : first + len(events)] = events
        spans.setdefault(rank, []).append((first, events))
    for rank, (_, placed, blocks, breakdown, now, end_s) in held.finals.items():
        prog = w.programs[rank]
        prog.ledger = MemoryLedger(rank, lists[rank], list(placed))
        prog.ledger.add_blocks(blocks)  # (a loop's events count as recorded: they stay put)
        prog.ledger.known_order(*_moved(held.columns[rank], spans.get(rank, [])))
        prog.breakdown_s = dict(breakdown)
        prog.now, prog.end_s = now, end_s
    w.stats = held.stats
    return True


def _ordered(
    rank: int,
    events: list[MemoryEvent],
    placed: list[Placed],
    blocks: list[EventBlock],
    ledger: MemoryLedger | None,
) -> tuple[Any, ...]:
    """A recorded rank's unsorted columns and their time order: those its ledger's peak
    made when they hold for the recorded events, else made."""
    made = None if ledger is None else ledger.ordered_columns()
    counted = len(events) + sum(len(b.times) for b in blocks)
    if made is not None and made[0] == (counted, len(placed), -1):
        return made[1:]
    remade = MemoryLedger(rank, events, placed)
    remade.add_blocks(blocks)
    t, d, c = remade.unsorted_columns()
    return t, d, c, time_order(t, d)


def _moved(
    recorded: tuple[Any, ...], spans: list[tuple[int, list[MemoryEvent]]]
) -> tuple[Any, ...]:
    """A replayed rank's unsorted columns and their time order: the recorded rank's with each
    loop's events (``spans``: where each run loop's events start, in order) in their place."""
    if not spans:
        return recorded
    times, deltas, cats, order = recorded
    times, deltas, cats = times.copy(), deltas.copy(), cats.copy()
    moved = []
    for first, events in spans:
        end = first + len(events)
        times[first:end], deltas[first:end], cats[first:end] = event_columns(events)
        moved.append(np.arange(first, end))
    return times, deltas, cats, moved_order(order, np.concatenate(moved), times, deltas)


def _alike(
    mine: tuple[float, float, dict[tuple[int, str | int], float]],
    clocks: tuple[float, float, float],
    units: dict[tuple[int, str | int], float],
) -> bool:
    """Whether a rank's dp stream (free, last end) and gathered units (``mine``) act as the
    recorded ones (``clocks``: the clock, then those two; ``units``) from the clock on: each
    value equal, or both at or before the clock. Later calls start at ``max(ready,
    dp_free)`` with ``ready`` at or after the clock; the last dp end is only maxed and
    compared with a later clock; a unit's ready time only compared with a later clock. So
    both give the same later walk to the bit."""
    now = clocks[0]
    for x, y in ((mine[0], clocks[1]), (mine[1], clocks[2])):
        if x != y and (x > now or y > now):
            return False
    held = mine[2]
    if held is units or held == units:  # (a loop's units are the ones its predecessor left)
        return True
    if held.keys() != units.keys():
        return False
    for unit, x in held.items():
        y = units[unit]
        if x != y and (x > now or y > now):
            return False
    return True
