"""The fused closed-form walk (each op one block, no ZeRO-3) in two parts: the pipeline part
(:func:`trace_pipeline`: each walked stage's ops in pipeline order, their starts, messages and
the memory events of those messages, the sends and folded gathers counted) depends only on the
stages' op tables, their blocks' durations and the prices of the point-to-point sends and of
the folded gathers, so plans of a search that differ elsewhere (gradient buckets, whether their
reductions overlap) share one :class:`StageTrace` per stage; the data-parallel part
(:func:`walk_fused`) replays each op's bucket reductions at its traced start, in the order the
interleaved walk of both parts runs them, so that every sum, tally and memory event comes out
in the same order and with the same floats as when both parts ran together.
"""

from __future__ import annotations

import itertools
from collections import Counter
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from operator import itemgetter
from typing import TYPE_CHECKING, Any, NamedTuple, Protocol

import numpy as np

from collsim.core.errors import SimulationError
from collsim.core.vocab import ParallelAxis
from collsim.play.walk_tables import Wire, pipeline_wiring, queue_ends
from collsim.step.memory import (
    MemoryEvent,
    MemoryPattern,
    MemoryPeak,
    PlacedOps,
    event_columns,
    first_uses,
)
from collsim.step.result import MEMORY_KEYS
from collsim.step.shapes import same_objects
from collsim.step.stats import CallKey

if TYPE_CHECKING:
    from collections.abc import Hashable

    from collsim.parallel.pipeline import Phase
    from collsim.parallel.plan import Plan
    from collsim.play.walk_tables import (
        OpPlan,
        OpTable,
        RankState,
        Reduction,
        ReductionColumns,
        SharedWalk,
    )
    from collsim.step.build import StepSchedule
    from collsim.step.dataparallel import DataParallelRules
    from collsim.step.ops import ChunkModel
    from collsim.step.pricing import ClosedPricer
    from collsim.step.shapes import ShapeCache
    from collsim.step.stats import CallStats

__all__ = [
    "PEAKS_KEPT",
    "StageTrace",
    "TRACES_KEPT",
    "add_block_sums",
    "trace_pipeline",
    "walk_fused",
]

TP, PP = ParallelAxis.TP, ParallelAxis.PP


class Walker(Protocol):
    """What the fused walk reads of :class:`collsim.play.walker.Walker`."""

    plan: Plan
    schedule: StepSchedule
    rules: DataParallelRules
    pricer: ClosedPricer
    shapes: ShapeCache | None
    stats: CallStats
    programs: dict[int, RankState]
    runs: dict[tuple[int, int], list[Any]]
    gather_pp: bool
    shared: SharedWalk

    def group(self, rank: int, axis: str) -> tuple[int, ...]: ...

    def op_table(self, stage: int) -> tuple[OpTable, Hashable]: ...

    def op_plans(
        self, prog: RankState, chunks: list[ChunkModel], keys: Sequence[tuple[int, Phase, bool]]
    ) -> list[OpPlan]: ...

    def block_lists(
        self, prog: RankState
    ) -> tuple[list[MemoryPattern], list[dict[str, float]]]: ...

    def block_durations(self, prog: RankState) -> tuple[float, ...]: ...

    def open_tallies(self, reductions: Sequence[Reduction]) -> None: ...

    def columns_of(self, reductions: Sequence[Reduction]) -> ReductionColumns: ...

    def run_overlapped(
        self, prog: RankState, ops: Sequence[tuple[float, Sequence[Reduction]]]
    ) -> tuple[list[int], list[MemoryEvent]]: ...

    def run_block_batch(
        self,
        prog: RankState,
        starts: Any,
        which: Any,
        reductions_of: Sequence[Sequence[Reduction]],
    ) -> tuple[list[int], Any, Any]: ...


BUFFER_LABEL = "zero2 bucket"
"""The label of a ZeRO-2 bucket buffer's events (as :meth:`Walker.run_reductions` makes them)."""
BUFFERS_CATEGORY = MEMORY_KEYS.index("buffers")
"""The ``buffers`` category's number in event columns
(:func:`~collsim.step.memory.event_columns`)."""

Mail = tuple[list[list[Wire]], list[float], list[float | None]]
"""A traced pipeline's mail: its :func:`~collsim.play.walk_tables.pipeline_wiring`, and per
message when it was produced and when it is delivered (None until sent)."""

TRACES_KEPT = 2
"""Pipeline traces a search's shape cache keeps (the most recent): the plans that share one
differ in the innermost knobs of a search's order (gradient buckets), so they come together."""


@dataclass(slots=True)
class StageTrace:
    """The pipeline part of one walked stage's fused walk."""

    starts: list[float] = field(default_factory=list)
    """Per op: when its block starts."""
    order: list[int] = field(default_factory=list)
    """Per op: its place in the order in which the walk ran the ops of every stage."""
    marks: list[int] = field(default_factory=list)
    """Per op: how many of ``events`` were recorded before its block."""
    events: list[MemoryEvent] = field(default_factory=list)
    """The stage's message buffers (received, freed), in recording order."""
    next_op: int = 0
    now: float = 0.0
    bubble: float = 0.0
    pp_exposed: float = 0.0
    pp_free: float = 0.0
    first_fold: int = -1
    """The first op that folds a gathered message (-1: none)."""
    folds: int = 0
    fold_s: float = 0.0
    """Folded gathers and their seconds added up one after another (as their tally)."""
    start_array: Any = None
    mark_array: Any = None
    """``starts`` and ``marks`` as numpy arrays, once the stage has run."""
    columns: Any = None
    """``events`` as columns (:func:`~collsim.step.memory.event_columns`), once every stage
    has run."""
    labels: Any = None
    """``events``' distinct labels in order of first use and each event's index into them
    (made when a walk records them as a block, :func:`_merged_block`)."""
    sends: dict[int, list[Any]] = field(default_factory=dict)
    """Per tally of the sends, in order of the first send: [first op, sends, their seconds
    added up one after another in op order, the destination of the last]."""


def trace_pipeline(
    tables: list[OpTable],
    durations: list[tuple[float, ...]],
    fold_s: list[float | None],
    send_s: list[dict[int, tuple[float, int]]],
    size: float,
    ranks: list[int],
) -> list[StageTrace]:
    """The pipeline part of the fused walk of every stage (``durations``: per stage, its
    blocks' seconds by block index; ``fold_s``: the seconds of the gather folded into each
    received message, None without one; ``send_s``: per stage, by destination stage, a send's
    seconds and the tally it adds to (sends to two stages may share one); ``size``: bytes per
    message): the stages resumed round-robin, each running its ops while their inputs have
    been sent, as the engine's ranks would.

    Raises:
        SimulationError: some stage waits for an input never sent.
    """
    traces = [StageTrace() for _ in tables]
    wiring, count = pipeline_wiring(tables)
    mail: Mail = (wiring, [0.0] * count, [None] * count)
    clock = itertools.count()
    steppers = [
        _stage_ops(s, tables[s], durations[s], fold_s[s], send_s[s], size, traces, mail, clock)
        for s in range(len(tables))
    ]
    pending = list(range(len(tables)))
    while pending:
        progressed = False
        for s in pending:
            progressed |= next(steppers[s])
        left = [s for s in pending if traces[s].next_op < len(tables[s].blocks)]
        if left and not progressed:
            raise SimulationError(
                f"ranks {[ranks[s] for s in left][:8]} wait for inputs never sent "
                "(the pipeline order has a cycle)"
            )
        pending = left
    for tr in traces:
        tr.columns = event_columns(tr.events)
    return traces


def _stage_ops(
    stage: int,
    table: OpTable,
    durations: tuple[float, ...],
    fold_s: float | None,
    send_s: dict[int, tuple[float, int]],
    size: float,
    traces: list[StageTrace],
    mail: Mail,
    clock: Iterator[int],
) -> Iterator[bool]:
    """One stage of :func:`trace_pipeline` as a generator: each resume runs its ops while
    their inputs have been sent and yields whether any ran. A received message waits for its
    delivery (the wait before it is produced is ``bubble``, after it ``pp_exposed``, as in the
    engine's pipeline), its buffer is freed, a folded gather follows it; a sent message goes
    out on the stage's pp stream when the op ends and is delivered when that stream reaches
    it (:func:`~collsim.play.walk_tables.fires`)."""
    tr = traces[stage]
    bids = table.blocks
    wires, produced_of, delivered_of = mail[0][stage], mail[1], mail[2]
    starts, order, marks, events = tr.starts, tr.order, tr.marks, tr.events
    sends = tr.sends
    n = len(bids)
    received, sent = -float(size), float(size)
    new = tuple.__new__
    now = bubble = pp_exposed = pp_free = fold_time = 0.0
    folds = 0
    ran = False
    i = 0
    while i < n:
        read, send, to = wires[i]
        folded = 0.0
        if read >= 0:
            delivered_s = delivered_of[read]
            while delivered_s is None:  # its input is not sent yet: wait for the next round
                tr.next_op = i
                yield ran
                ran = False
                delivered_s = delivered_of[read]
            if delivered_s > now:
                produced = min(max(produced_of[read], now), delivered_s)
                bubble += produced - now
                pp_exposed += delivered_s - produced
                now = delivered_s
            if size:
                events.append(new(MemoryEvent, (now, "buffers", received, "pp recv")))
            if fold_s is not None:
                folded = fold_s
                if folds == 0:
                    tr.first_fold = i
                folds += 1
                fold_time += folded
            now += folded
            pp_exposed += folded
        starts.append(now)
        order.append(next(clock))
        marks.append(len(events))
        now = now + durations[bids[i]]
        if send >= 0:
            t, slot = send_s[to]
            count = sends.get(slot)
            if count is None:
                sends[slot] = [i, 1, 0.0 + t, to]
            else:
                count[1] += 1
                count[2] += t
                count[3] = to
            start = now if now >= pp_free else pp_free
            pp_free = start + t
            delivered = now + (pp_free - now)
            produced_of[send] = now
            delivered_of[send] = delivered
            if size:  # MemoryLedger.alloc
                traces[to].events.append(new(MemoryEvent, (delivered, "buffers", sent, "pp recv")))
        i += 1
        ran = True
    tr.next_op, tr.now, tr.bubble, tr.pp_exposed, tr.pp_free = i, now, bubble, pp_exposed, pp_free
    tr.folds, tr.fold_s = folds, fold_time
    tr.start_array = np.asarray(starts, dtype=float)
    tr.mark_array = np.asarray(marks, dtype=np.intp)
    yield ran
    while True:
        yield False


def walk_fused(w: Walker) -> None:
    """The fused walk of every walked rank (each op one block): the pipeline part traced
    (:func:`trace_pipeline`, kept in the search's shape cache by what it depends on), then the
    rest replayed on it in the order the interleaved walk ran it (:func:`_replay`)."""
    progs = list(w.programs.values())
    size = w.schedule.p2p_bytes
    ranks = [prog.rank for prog in progs]
    tables, table_keys, blocks = [], [], []
    fold_s: list[float | None] = []
    fold_calls: list[tuple[CallKey, float] | None] = []
    send_s: list[dict[int, tuple[float, int]]] = []
    send_calls: list[dict[int, tuple[CallKey, float]]] = []
    for prog in progs:
        stage = prog.coords.pp
        table, table_key = w.op_table(stage)
        chunks = w.schedule.stages[stage].chunks
        tables.append(table)
        table_keys.append(table_key)
        blocks.append(w.op_plans(prog, chunks, table.keys))
        hit = w.shared.messages.get(prog.rank)
        if hit is None or hit[0] is not table or hit[1] != (size, tuple(ranks)):
            hit = w.shared.messages[prog.rank] = (
                table,
                (size, tuple(ranks)),
                _messages(w, prog.rank, table, size, ranks),
            )
        fold_at, fold, seconds, sends = hit[2]
        fold_s.append(fold_at)
        fold_calls.append(fold)
        send_s.append(seconds)
        send_calls.append(sends)
    durations = [w.block_durations(prog) for prog in progs]
    waits = _sync_waits(w, blocks, durations)
    if waits is not None:  # each reducing block ends when its reductions do
        durations = [
            tuple([d + x for d, x in zip(ds, xs, strict=True)])
            for ds, xs in zip(durations, waits, strict=True)
        ]

    def make() -> list[StageTrace]:
        return trace_pipeline(tables, durations, fold_s, send_s, size, ranks)

    if w.shapes is None:
        traces = make()
    else:
        # the variants of a program: the same tables, durations and prices (objects kept
        # with its bodies and message prices), so their trace is found by identity first
        made_of = (*tables, *durations, *send_s)
        held = w.shared.trace
        if held is not None and same_objects(held[0], made_of) and held[1] == (fold_s, size):
            traces = held[2]
        else:
            shape = (
                tuple(table_keys),
                tuple(durations),
                tuple(fold_s),
                tuple(tuple(s.items()) for s in send_s),
                size,
            )
            traces = w.shapes.recent("walk pipeline", shape, make, TRACES_KEPT)
            w.shared.trace = (made_of, (fold_s, size), traces)
    _replay(w, progs, tables, blocks, traces, fold_calls, send_calls)
    if waits is not None:
        for prog, table, xs in zip(progs, tables, waits, strict=True):
            prog.breakdown_s["dp_exposed"] += sum(
                [n * x for n, x in zip(table.counts, xs, strict=True) if x]
            )


def _sync_waits(
    w: Walker, blocks: list[list[OpPlan]], durations: list[tuple[float, ...]]
) -> list[tuple[float, ...]] | None:
    """Per stage, per block: how long an op of the block waits at its end for the bucket
    reductions it issued, where the step waits for them after every backward
    (:attr:`~collsim.step.dataparallel.DataParallelRules.syncs_each_backward`); None where it
    does not. The stream is free when a reducing op starts (the op before waited for its
    own), so the wait is the block's: its reductions' calls queued on the dp stream from the
    op's start, each ready at its offset (:func:`~collsim.play.walk_tables.queue_ends` of the
    block's columns, kept in the shared tables), less the block's seconds."""
    rules = w.rules
    if not rules.syncs_each_backward or not any(rules.reducing(1)):
        return None
    out = []
    for blks, ds in zip(blocks, durations, strict=True):
        xs = []
        for block, d in zip(blks, ds, strict=True):
            end = 0.0
            if block.reductions:
                c = w.columns_of(block.reductions)
                end = float(queue_ends(c.call_rel, c.seconds, 0.0)[-1])
            xs.append(end - d if end > d else 0.0)
        out.append(tuple(xs))
    return out


def _messages(
    w: Walker, rank: int, table: OpTable, size: float, ranks: list[int]
) -> tuple[
    float | None,
    tuple[CallKey, float] | None,
    dict[int, tuple[float, int]],
    dict[int, tuple[CallKey, float]],
]:
    """What the pipeline messages of ``rank``'s stage cost (``size`` bytes each; ``ranks``:
    the walked rank of each stage): the seconds of the TP gather folded into each received
    message and its (tally key, busbw), None without one; per destination stage, a send's
    seconds and the number of its tally among the stage's sends, and its (tally key, busbw).
    Once per walk's shared tables (the variants' pricer, ranks and messages are the same)."""
    fold_at: float | None = None
    fold: tuple[CallKey, float] | None = None
    if w.gather_pp and table.receives:
        group = w.group(rank, TP)
        cost = w.pricer.cost("all_gather", size * w.plan.tp, group)
        key = CallKey(rank, TP, "all_gather", size * w.plan.tp, len(group), cost.algorithm)
        fold = (key, cost.busbw_bps)
        fold_at = 0.0 + cost.time_s  # Walker.price: extra_s + cost.time_s
    sends: dict[int, tuple[CallKey, float]] = {}
    seconds: dict[int, tuple[float, int]] = {}
    slots: dict[CallKey, int] = {}
    for to in table.destinations:
        pair = (rank, ranks[to])
        cost = w.pricer.cost("send_recv", size, pair)
        key = CallKey(rank, PP, "send_recv", size, 2, cost.algorithm)
        sends[to] = (key, cost.busbw_bps)
        seconds[to] = (0.0 + cost.time_s, slots.setdefault(key, len(slots)))
    return fold_at, fold, seconds, sends


class Inserts(NamedTuple):
    """Where a stage's bucket reductions record their ZeRO-2 buffer events among its traced
    events (:func:`_ledger`): for each op that records any, in op order, the op, how many
    traced events come before its block, and how many buffer events it records (integer
    arrays of one length)."""

    ops: Any
    marks: Any
    counts: Any


NO_INSERTS = Inserts(*(np.zeros(0, dtype=np.intp),) * 3)
"""The :class:`Inserts` of a stage whose ops record no buffer events."""


def _inserts(ops: Any, marks: Any, counts: Any) -> Inserts:
    """The :class:`Inserts` of the ops ``ops`` (op indices) that record ``counts`` buffer
    events each, those that record none left out; ``marks``: every op's traced events
    before its block (:attr:`StageTrace.mark_array`)."""
    some = np.flatnonzero(counts)
    if not len(some):
        return NO_INSERTS
    ops = ops[some]
    return Inserts(ops, marks[ops], counts[some])


def _replay(
    w: Walker,
    progs: list[RankState],
    tables: list[OpTable],
    blocks: list[list[OpPlan]],
    traces: list[StageTrace],
    fold_calls: list[tuple[CallKey, float] | None],
    send_calls: list[dict[int, tuple[CallKey, float]]],
) -> None:
    """What the fused walk adds beside the pipeline: in the order the interleaved walk ran
    them (op by op, each op's folded gather, first use of its block, bucket reductions and
    first send in that order), the tallies opened, the TP runs registered and the reductions
    run on the dp stream; then each rank's ledger, clock and account as that walk left them."""
    rules = w.rules
    num_mb = max((t.num_mb for t in tables), default=0)
    reduces = rules.reducing(num_mb)
    flags = tuple([tuple([bool(b.reductions) for b in blks]) for blks in blocks])
    memo = w.shared.replays
    shape = (id(traces), flags, reduces, rules.overlap)
    known = memo.get(shape)
    if known is None or known[0] is not traces:
        known = memo[shape] = (
            traces,
            *replay_order(tables, flags, traces, reduces, overlap=rules.overlap),
        )
    _, items, deferred, reducing_ops, overlapped = known
    tally_of = w.stats.tally
    runs = w.runs
    opened: set[int] = set()  # the tuples of reductions whose tallies are open (held: blocks)
    for _, what, s, x in items:
        if what == 0:
            tally_of(fold_calls[s][0])  # type: ignore[index]
        elif what == 1:
            block = blocks[s][x]
            if block.run_key not in runs:
                runs[block.run_key] = [block.segs, 0]
        elif what == 2:  # a block's first reducing op: its tallies open here, its calls below
            reductions = blocks[s][tables[s].blocks[x]].reductions
            if id(reductions) not in opened:  # (alike chunks share one tuple: opened once)
                opened.add(id(reductions))
                w.open_tallies(reductions)
        else:
            tally_of(send_calls[s][x][0])
    # each stage's reductions, in op order (nothing above reads or adds to its dp stream)
    inserts = [NO_INSERTS] * len(progs)
    held_events: list[list[MemoryEvent]] = [[] for _ in progs]
    held_columns: list[tuple[Any, Any] | None] = [None] * len(progs)
    for s, ops in enumerate(overlapped):
        if not ops:
            continue
        starts, blks, bids = traces[s].starts, blocks[s], tables[s].blocks
        at = np.array(ops, dtype=np.intp)
        batch = _batch_groups(blks, reducing_ops[s])
        if batch is not None:
            group_of, groups = batch
            counts, times, deltas = w.run_block_batch(
                progs[s], traces[s].start_array[at], group_of[tables[s].block_ids[at]], groups
            )
            inserts[s] = _inserts(at, traces[s].mark_array, counts)
            held_columns[s] = (times, deltas)
            continue
        per_op, held = w.run_overlapped(
            progs[s], [(starts[x], blks[bids[x]].reductions) for x in ops]
        )
        inserts[s] = _inserts(at, traces[s].mark_array, np.array(per_op, dtype=np.intp))
        held_events[s] = held
    for s, prog in enumerate(progs):
        tr, table, blks = traces[s], tables[s], blocks[s]
        fold = fold_calls[s]
        if fold is not None and tr.folds:
            _set_tally(tally_of(fold[0]), tr.folds, tr.fold_s, fold[1])
        for _, count, time_s, last in tr.sends.values():
            key, busbw = send_calls[s][last]  # the busbw of the last send (CallStats.add)
            _set_tally(tally_of(key), count, time_s, busbw)
        for i in deferred[s]:
            prog.deferred.extend(blks[table.blocks[i]].reductions)
        patterns, comms = w.block_lists(prog)
        _ledger(w.shared, prog, table, patterns, tr, inserts[s], held_events[s], held_columns[s])
        if w.shapes is not None and not len(inserts[s].ops):
            _shared_peaks(w.shapes, w.shared, prog, patterns, tr)
        prog.next_op, prog.now, prog.pp_free = tr.next_op, tr.now, tr.pp_free
        prog.breakdown_s["bubble"], prog.breakdown_s["pp_exposed"] = tr.bubble, tr.pp_exposed
        add_block_sums(w, prog, table, blks, comms)


BATCH_REDUCTIONS = 256
"""A stage whose ops run at least this many bucket reductions in a step runs them as one batch
(:meth:`~collsim.play.walker.Walker.run_block_batch`) if its ops repeat them, each tuple of
reductions (alike chunks share one) on :data:`BATCH_REPEATS` ops or more on average; others
run them op by op. A batch makes a few numpy arrays per tuple, tens of microseconds that a
handful of reductions costs less in the loop. Chosen on the plans of
``benchmarks/bench_closed_form.py``: ZeRO-2, whose every micro-batch reduces, batched; ZeRO-1
pipelines, whose last micro-batch of each chunk reduces, batched where their chunks are alike
and their buckets many (small buckets), op by op where they are few."""
BATCH_REPEATS = 4


def _batches(reductions: int, ops: dict[int, int]) -> bool:
    """Whether a stage whose ops run ``reductions`` bucket reductions (``ops``: how many ops
    run each tuple of reductions, :func:`_reduction_groups`) runs them as one batch
    (:data:`BATCH_REDUCTIONS`)."""
    return reductions >= BATCH_REDUCTIONS and sum(ops.values()) >= BATCH_REPEATS * len(ops)


def _batch_groups(
    blocks: list[OpPlan], per_block: dict[int, int]
) -> tuple[Any, list[tuple[Reduction, ...]]] | None:
    """For a stage that runs its reductions as one batch (:func:`_batches`; ``per_block``:
    how many ops run each block's), its blocks grouped by their tuple of reductions (alike
    chunks share one, :meth:`~collsim.play.walker.Walker.op_plans`): each block's group (an
    array) and each group's reductions; None for a stage that runs them op by op."""
    total = sum(n * len(blocks[b].reductions) for b, n in per_block.items())
    if total < BATCH_REDUCTIONS:
        return None
    group_of, groups, per_group = _reduction_groups(blocks, per_block)
    return (group_of, groups) if _batches(total, per_group) else None


def _reduction_groups(
    blocks: list[OpPlan], per_block: dict[int, int]
) -> tuple[Any, list[tuple[Reduction, ...]], dict[int, int]]:
    """The stage's blocks grouped by their tuple of reductions: each block's group (an
    array), each group's reductions, and how many ops run each group's (``per_block``: by
    block)."""
    number: dict[int, int] = {}
    groups: list[tuple[Reduction, ...]] = []
    group_of = np.empty(len(blocks), dtype=np.intp)
    for b, block in enumerate(blocks):
        g = number.setdefault(id(block.reductions), len(groups))
        if g == len(groups):
            groups.append(block.reductions)
        group_of[b] = g
    per_group: dict[int, int] = {}
    for b, n in per_block.items():
        g = int(group_of[b])
        per_group[g] = per_group.get(g, 0) + n
    return group_of, groups, per_group


def replay_order(
    tables: list[OpTable],
    reducing: tuple[tuple[bool, ...], ...],
    traces: list[StageTrace],
    reduces: tuple[bool, ...],
    *,
    overlap: bool,
) -> tuple[list[tuple[int, int, int, int]], list[list[int]], list[dict[int, int]], list[list[int]]]:
    """The order in which the interleaved walk ran what :func:`_replay` adds (``reducing``:
    per stage, whether each block has reductions; ``reduces``: whether a micro-batch's
    backward reduces): (place in the walk, what, stage, which) per item, in order (``what``: 0
    the first folded gather, 1 a block's first use, 2 the first op that runs a block's
    reductions, where their tallies open, 3 a first send); per stage the ops whose
    reductions wait for the end of the step (without overlap); per stage how many ops run
    each block's reductions in the step (by block); and per stage the ops that run them
    overlapped, in op order."""
    items: list[tuple[int, int, int, int]] = []
    deferred: list[list[int]] = []
    counts: list[dict[int, int]] = []
    overlapped: list[list[int]] = []
    for s, (table, flags, tr) in enumerate(zip(tables, reducing, traces, strict=True)):
        order = tr.order
        if tr.first_fold >= 0:
            items.append((order[tr.first_fold], 0, s, -1))
        items.extend((order[i], 1, s, bid) for bid, i in enumerate(table.firsts))
        mbs = table.microbatches
        ops = sorted(
            i for bid, has in enumerate(flags) if has for i in table.ops_of[bid] if reduces[mbs[i]]
        )
        if overlap:
            firsts: dict[int, int] = {}  # each block's first reducing op
            for i in ops:
                firsts.setdefault(table.blocks[i], i)
            items.extend((order[i], 2, s, i) for i in firsts.values())
            deferred.append([])
            counts.append(Counter(table.blocks[i] for i in ops))
            overlapped.append(ops)
        else:
            deferred.append(ops)
            counts.append({})
            overlapped.append([])
        items.extend((order[first], 3, s, to) for first, _, _, to in tr.sends.values())
    items.sort()
    return items, deferred, counts, overlapped


def _set_tally(tally: Any, count: int, time_s: float, busbw_bps: float) -> None:
    """A tally opened by :func:`_replay` as the traced calls left it (CallStats.add, then the
    repeats added in place)."""
    tally.count += count
    tally.time_s += time_s
    tally.busbw_bps = busbw_bps


def _ledger(
    shared: SharedWalk,
    prog: RankState,
    table: OpTable,
    patterns: list[MemoryPattern],
    tr: StageTrace,
    inserts: Inserts,
    held_events: list[MemoryEvent],
    held_columns: tuple[Any, Any] | None = None,
) -> None:
    """The rank's events and placed patterns in the order the interleaved walk recorded them:
    the traced message events with the reductions' buffers between them (where:
    :class:`Inserts`; the buffers as ``held_events``, in order, or as the times and signed
    bytes of them all, ``held_columns``), each op's pattern placed at its start (as columns,
    :meth:`MemoryLedger.place_ops`; kept in ``shared`` for the walks that place the same
    patterns on the same trace, the buffers before each added to a copy). Without buffers
    the traced events are listed with their columns declared
    (:meth:`MemoryLedger.known_columns`); with buffers as columns, the traced events and the
    buffers are one block of columns (:meth:`MemoryLedger.add_block`, no event made).
    ``patterns``: the blocks' patterns, by block, as a list kept with their bodies
    (:meth:`~collsim.play.walker.Walker.block_lists`)."""
    ledger = prog.ledger
    events = ledger.appenders()[0]
    base = len(events)
    inserting = len(inserts.ops) > 0
    if not inserting:
        ledger.known_columns(base, tr.columns)
        events.extend(tr.events)
    elif held_columns is not None:
        ledger.add_block(*_merged_block(tr, inserts, held_columns))
    else:
        done, at = 0, 0
        for mark, count in zip(inserts.marks.tolist(), inserts.counts.tolist(), strict=True):
            events.extend(tr.events[done:mark])
            events.extend(held_events[at : at + count])
            done, at = mark, at + count
        events.extend(tr.events[done:])
    known = shared.placements.get((prog.rank, base))
    if known is None or known[0] is not tr or not same_objects(known[1], patterns):
        known = shared.placements[(prog.rank, base)] = (
            tr,
            patterns,
            placed_ops(table, patterns, tr, base),
        )
    placed = known[2]
    if placed is None:
        return
    if inserting:  # the buffers recorded by the ops before each placement
        held_before = np.concatenate(([0], np.cumsum(inserts.counts)))
        where = np.searchsorted(inserts.ops, placed.ops, side="left")
        placed = placed._replace(before=placed.before + held_before[where])
    ledger.place_ops(placed)


def _merged_block(
    tr: StageTrace, inserts: Inserts, held: tuple[Any, Any]
) -> tuple[Any, Any, Any, tuple[Any, ...], Any]:
    """The traced events (``tr``) with the buffers (``held``: times and signed bytes, category
    ``buffers``, label :data:`BUFFER_LABEL`) placed between them as :func:`_ledger` records
    them, each insert's after the first ``mark`` traced events: times, signed bytes, category
    numbers, the distinct labels in order of first use and each event's index into them
    (:class:`~collsim.step.memory.EventBlock`)."""
    t_times, t_deltas, t_cats = tr.columns
    if tr.labels is None:  # (the trace is shared by the walks that replay it)
        names = dict.fromkeys(map(itemgetter(3), tr.events))
        index = {label: i for i, label in enumerate(names)}
        tr.labels = (
            tuple(names),
            np.fromiter(map(index.__getitem__, map(itemgetter(3), tr.events)), np.intp),
        )
    labels, traced_label = tr.labels
    counts, marks = inserts.counts, inserts.marks
    n_held, n_traced = len(held[0]), len(t_times)
    at_held = np.repeat(marks, counts) + np.arange(n_held)
    total = n_traced + n_held
    # the traced events fill the other places, in order
    at_traced = np.ones(total, dtype=bool)
    at_traced[at_held] = False
    times, deltas = np.empty(total), np.empty(total)
    cats = np.empty(total, dtype=np.int8)
    label_of = np.empty(total, dtype=np.intp)
    times[at_traced], deltas[at_traced], cats[at_traced] = t_times, t_deltas, t_cats
    times[at_held], deltas[at_held] = held
    cats[at_held] = BUFFERS_CATEGORY
    if BUFFER_LABEL in labels:
        table = labels
        label_of[at_held] = labels.index(BUFFER_LABEL)
    else:
        table = (*labels, BUFFER_LABEL)
        label_of[at_held] = len(labels)
    label_of[at_traced] = traced_label
    # the labels in order of first use (as a list of the events would number them)
    used = first_uses(label_of, len(table))
    rank = np.zeros(len(table), dtype=np.intp)
    rank[used] = np.arange(len(used))
    return times, deltas, cats, tuple(table[i] for i in used), rank[label_of]


def placed_ops(
    table: OpTable, patterns: list[MemoryPattern], tr: StageTrace, base: int
) -> PlacedOps | None:
    """Each op's pattern (``patterns``: by block) placed at its traced start, after ``base``
    events and the traced events recorded before it (:func:`_ledger`, which adds the
    reductions' buffers); None when no block has events."""
    kinds = [p for p in patterns if p.events]
    if not kinds:
        return None
    has = np.asarray([bool(p.events) for p in patterns])
    ids = table.block_ids
    ops = np.flatnonzero(has[ids])
    return PlacedOps(
        starts=tr.start_array[ops],
        which=(np.cumsum(has) - 1)[ids[ops]],
        kinds=kinds,
        microbatches=table.microbatch_ids[ops],
        chunks=table.chunk_ids[ops],
        before=base + tr.mark_array[ops],
        ops=ops,
        kept=[None],
    )


PEAKS_KEPT = 64
"""Stages' memory peaks a search's shape cache keeps (the most recent; :func:`_shared_peaks`)."""


def _shared_peaks(
    shapes: ShapeCache,
    shared: SharedWalk,
    prog: RankState,
    patterns: list[MemoryPattern],
    tr: StageTrace,
) -> None:
    """Declare the rank's memory peaks (:meth:`MemoryLedger.known_peaks`) as worked out for
    an earlier plan whose ledger holds the same events, else work them out and keep them: the
    events are the rank's state allocations, the stage's traced messages and its blocks'
    patterns placed at the traced starts, so the trace (by identity: it is kept in the same
    cache, and the entry holds it) and those allocations and patterns (by value) say them
    all. Plans that differ only in their gradient buckets share them (without ZeRO-2 buffers:
    the caller passes ledgers without reductions' buffers); the walks of one program's
    variants find them in ``shared`` by the identity of the trace and of ``patterns`` (the
    blocks' patterns, a list kept with their bodies) first."""
    ledger = prog.ledger
    singles = ledger.recorded()[0]  # (appenders() would turn the placed columns into rows)
    base = len(singles) - len(tr.events)
    state = tuple(singles[:base])
    # the program's variants: the same trace and pattern objects
    mine = shared.peaks.get((prog.rank, state))
    if mine is not None and mine[0] is tr and same_objects(mine[1], patterns):
        ledger.known_peaks(mine[2], mine[3])
        return
    key = (id(tr), state, tuple([(p.category, tuple(p.events)) for p in patterns]))

    def make() -> tuple[StageTrace, MemoryPeak, float]:
        return tr, ledger.peak(), ledger.category_peak("activations")

    held, peak, activations = shapes.recent("walk peaks", key, make, PEAKS_KEPT)
    if held is not tr:  # pragma: no cover - another trace at a reused address
        held, peak, activations = make()
    ledger.known_peaks(peak, activations)
    shared.peaks[(prog.rank, state)] = (tr, patterns, peak, activations)


def add_block_sums(
    w: Walker,
    prog: RankState,
    table: OpTable,
    blocks: list[OpPlan],
    comms: list[dict[str, float]],
) -> None:
    """Add what every op of the stage adds whatever its start: its block's compute and
    exposed collectives to the account (one after another in op order, as the ops ran:
    ``numpy.add.accumulate`` adds left to right; the sums from zero kept in ``w.shared`` for
    the walks of the same blocks, known by their ``comm`` dicts: ``comms``, a list kept with
    their bodies, :meth:`~collsim.play.walker.Walker.block_lists`), its runs to the TP
    tallies."""
    breakdown = prog.breakdown_s
    if not len(table.block_ids):
        return
    known = w.shared.sums.get(prog.rank)
    if known is None or known[0] is not table or not same_objects(known[1], comms):
        known = w.shared.sums[prog.rank] = (table, comms, _block_sums(table, blocks, {}))
    sums = known[2]
    if any(breakdown[k] for k in sums):  # an account that does not start from zero
        sums = _block_sums(table, blocks, breakdown)
    breakdown.update(sums)
    for b, count in zip(blocks, table.counts, strict=True):
        w.runs[b.run_key][1] += count


def _block_sums(table: OpTable, blocks: list[OpPlan], start: dict[str, float]) -> dict[str, float]:
    """Per account key of the blocks, ``start``'s value (0 if none) and each op's block's
    seconds added one after another in op order."""
    ids = table.block_ids
    columns: dict[str, list[float]] = {"compute": [b.compute for b in blocks]}
    for k in dict.fromkeys(k for b in blocks for k, _ in b.comm_items):
        columns[k] = [b.comm.get(k, 0.0) for b in blocks]
    out = {}
    for k, column in columns.items():
        per_op = np.asarray(column, dtype=float)[ids]
        per_op[0] += start.get(k, 0.0)  # the account before the first op, added first
        out[k] = float(np.add.accumulate(per_op)[-1])
    return out
