"""What the closed-form walk (:mod:`collsim.play.walker`) keeps per rank, per op and per call:
a walked rank's streams and account, a stage's pipeline order as arrays, an op's fused block
and a ZeRO-3 segment priced once, the event-firing rule shared with the engine.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, NamedTuple

import numpy as np

from collsim.parallel.pipeline import Phase, PipeOp, flow
from collsim.parallel.plan import Plan, RankCoords
from collsim.step.dataparallel import grad_norm_groups
from collsim.step.memory import MemoryLedger, MemoryPattern
from collsim.step.ops import Segment
from collsim.step.result import BREAKDOWN_KEYS
from collsim.step.stats import CallKey

if TYPE_CHECKING:
    from collsim.step.build import StepSchedule

__all__ = [
    "Issue",
    "Link",
    "OpBody",
    "OpPlan",
    "OpTable",
    "Priced",
    "RankBodies",
    "RankState",
    "Reduction",
    "ReductionColumns",
    "SegStep",
    "SegSums",
    "SettledOp",
    "SharedWalk",
    "TallyAdds",
    "Wire",
    "fires",
    "norm_rounds",
    "op_table",
    "pipeline_links",
    "pipeline_wiring",
    "queue_ends",
    "reduction_arrays",
]


@dataclass(slots=True)
class RankState:
    """One walked rank: its streams' free times, account and ledger."""

    rank: int
    coords: RankCoords
    ledger: MemoryLedger
    breakdown_s: dict[str, float] = field(
        default_factory=lambda: dict.fromkeys(BREAKDOWN_KEYS, 0.0)
    )
    now: float = 0.0
    end_s: float = 0.0
    next_op: int = 0
    pp_free: float = 0.0
    dp_free: float = 0.0
    dp_last_end: float = 0.0
    deferred: list[Reduction] = field(default_factory=list)
    """Bucket reductions issued at the end of the backward (without overlap)."""
    gathered: dict[tuple[int, str | int], float] = field(default_factory=dict)
    """ZeRO-3 units gathered or in flight: (chunk, unit) -> when the gather ends."""
    gathers_made: int = 0
    """How many times the segment loop ran (the only code that changes ``gathered``)."""
    gathers_issued: int = 0
    """How many unit gathers the segment loop issued."""
    settled: list[SettledOp | SegSums] = field(default_factory=list)
    """Settled blocks (and the sums of segment loops none of whose segments waited) run
    since their sums were last added to ``breakdown_s``
    (:meth:`~collsim.play.walker.Walker.add_settled`)."""


Link = tuple[bool, Phase, tuple[int, Phase, int] | None]
"""An op's pipeline links (:meth:`Walker.links`)."""


def norm_rounds(plan: Plan, ranks: list[int]) -> list[dict[tuple[str, tuple[int, ...]], list[int]]]:
    """Per round of the gradient-norm all-reduces (:func:`grad_norm_groups`): the walked ranks
    of each (axis, group)."""
    rounds: list[dict[tuple[str, tuple[int, ...]], list[int]]] = []
    for rank in ranks:
        for i, call in enumerate(grad_norm_groups(plan, rank)):
            while len(rounds) <= i:
                rounds.append({})
            rounds[i].setdefault(call, []).append(rank)
    return rounds


def fires(issued_s: float, end_s: float) -> float:
    """When an event issued at ``issued_s`` to end at ``end_s`` fires in the engine: SimPy
    schedules a timeout of ``end_s - issued_s`` from ``issued_s`` (the same float rounding, so
    that both fidelities record memory at the very same instants)."""
    return issued_s + (end_s - issued_s)


Issue = tuple[tuple[int, str | int], float, str, tuple[Any, ...]]
"""A ZeRO-3 unit's gather issued before a segment: (unit, bytes, label, priced calls)."""


@dataclass(frozen=True, slots=True)
class SegStep:
    """One segment of a ZeRO-3 op as :func:`~collsim.play.walk_zero3.run_segments` runs it,
    the gathers issued before it aside (they depend on the prefetch depth:
    :func:`~collsim.play.walk_zero3.issue_plan`)."""

    seg: Segment
    unit: tuple[int, str | int]
    """(chunk, unit key) of its own unit."""
    duration: float
    compute_s: float
    """``seg.compute_s`` (a sum over its steps), read once."""
    comm_items: tuple[tuple[str, float], ...]
    releases: tuple[bool, bool]
    """Whether its unit is released after it in the last micro-batch, in any other."""
    grad: tuple[float, str, tuple[Any, ...]] | None
    """Backward: (gradient bytes, label, priced reductions)."""
    reshard_bytes: float
    run_key: tuple[int, int]
    """The segment's key in the walk's TP runs (:meth:`Walker.flush_tp`)."""


SETTLED_TERMS_KEPT = 4096
"""Runs of settled blocks whose terms :attr:`SharedWalk.settled_terms` keeps (then starts over)."""

SETTLED_SUMS = (
    "compute",
    "framework",
    "tp_exposed",
    "ep_exposed",
    "cp_exposed",
    "dp_exposed",
    "interference",
)
"""The account keys a settled op's segments add to: compute, framework and each exposed
collective's key (:data:`collsim.step.pricing.EXPOSED_KEY`, with ``interference``)."""


class SegSums(NamedTuple):
    """The sums of an op's segment loop none of whose segments waited for its unit, in the
    form of :attr:`SettledOp.sums` (:func:`~collsim.play.walk_zero3.seg_sums`)."""

    sums: Any


class SettledOp(NamedTuple):
    """A ZeRO-3 op whose units are all gathered and ready when it starts and that releases
    none of them (:func:`~collsim.play.walk_zero3.settled_op`): its segments run back to back,
    with no call on the dp stream. Each sum is kept as the terms the segment loop adds one
    after another, so that the block adds them in the same order (the same floats)."""

    needs: tuple[tuple[int, str | int], ...]
    """The units it reads, each gathered and ready by the op's start for the block to hold."""
    steps: tuple[float, ...]
    """Each segment's seconds, in order (the clock's terms)."""
    sums: Any
    """Per key of :data:`SETTLED_SUMS` (rows), what each segment adds to it (columns, in
    order; 0.0 where the segment adds nothing), as a numpy array."""
    pattern: MemoryPattern | None
    """Its segments' activation events on their boundaries (None without any)."""
    runs: tuple[tuple[tuple[int, int], Segment], ...]
    """Each segment's key in the walk's TP runs (:meth:`Walker.flush_tp`), with the segment."""


@dataclass(frozen=True, slots=True)
class OpTable:
    """A stage's pipeline order as arrays (what the walk reads per op, known before it)."""

    links: list[Link]
    """Per op: :meth:`Walker.links`."""
    microbatches: list[int]
    chunks: list[int]
    blocks: list[int]
    """Per op: the index of its block's key in ``keys``."""
    keys: list[tuple[int, Phase, bool]]
    """The distinct (chunk, phase, paired) of the ops, in order of first use."""
    counts: list[int]
    """Ops per key."""
    block_ids: Any
    """``blocks`` as a numpy array."""
    num_mb: int
    firsts: list[int]
    """Per key: its first op."""
    ops_of: list[list[int]]
    """Per key: its ops, in order."""
    receives: bool
    """Whether some op reads a message from another stage."""
    destinations: tuple[int, ...]
    """The stages its ops send to, in order of the first send."""
    microbatch_ids: Any
    chunk_ids: Any
    """``microbatches`` and ``chunks`` as numpy arrays."""


def op_table(
    ops: tuple[PipeOp, ...], links: list[Link], paired: frozenset[int], num_mb: int
) -> OpTable:
    """The :class:`OpTable` of a stage's ops (``links``: :meth:`Walker.links`)."""
    index: dict[tuple[int, Phase, bool], int] = {}
    blocks = [
        index.setdefault((op.chunk, op.phase, i in paired), len(index)) for i, op in enumerate(ops)
    ]
    ops_of: list[list[int]] = [[] for _ in index]
    for i, b in enumerate(blocks):
        ops_of[b].append(i)
    return OpTable(
        links=links,
        microbatches=[op.microbatch for op in ops],
        chunks=[op.chunk for op in ops],
        blocks=blocks,
        keys=list(index),
        counts=[len(ops) for ops in ops_of],
        block_ids=np.asarray(blocks, dtype=np.intp),
        num_mb=num_mb,
        firsts=[ops[0] for ops in ops_of],
        ops_of=ops_of,
        receives=any(link[0] for link in links),
        destinations=tuple(dict.fromkeys(link[2][0] for link in links if link[2] is not None)),
        microbatch_ids=np.asarray([op.microbatch for op in ops], dtype=np.intp),
        chunk_ids=np.asarray([op.chunk for op in ops], dtype=np.intp),
    )


@dataclass(frozen=True, slots=True)
class OpBody:
    """What an op's fused block is whatever the plan's DDP buckets (:meth:`Walker.op_body`):
    priced once for the plans that share its segments (:class:`SharedWalk`)."""

    segs: list[Segment]
    windows: tuple[tuple[str | int, float, float, float], ...]
    """In a gradient phase, per segment: (its key, its start in the op, seconds before its
    gradients start, seconds they take), where its buckets become ready."""
    plain: OpPlan
    """The op's block without buckets (read only: the walks that share it keep it; its
    ``comm`` dict is never changed)."""
    shape: int = -1
    """``windows`` with their segments' keys counted from the chunk's first layer, as a
    number (:attr:`SharedWalk.shape_numbers`): ops alike in it place alike buckets alike."""


Priced = tuple[float, float, CallKey]
"""A call priced once: (seconds, busbw, tally key)."""

TallyAdds = tuple[CallKey, int, tuple[float, ...], float, float]
"""What a walk adds to one tally, in order (:meth:`Walker.flush_tp`): (key, calls, the
seconds added one after another, their sum from zero, the last busbw)."""


@dataclass(slots=True)
class SharedWalk:
    """What the walks of programs that share their segments (a program and the variants built
    from it, :func:`collsim.step.build.ddp_variant`) work out once: the same segments
    priced on the same plan layout by a search's one pricer (:meth:`Walker.shared_walk`)."""

    bodies: dict[tuple[int, int, Phase, bool], OpBody] = field(default_factory=dict)
    """:meth:`Walker.op_body` by (rank, chunk, phase, paired)."""
    op_tables: dict[int, tuple[Sequence[PipeOp], Any, OpTable, Any]] = field(default_factory=dict)
    """:meth:`Walker.op_table` by stage: the stage's pipeline ops and the schedule's paired
    ops it was made for (held, checked by identity: the variants share them), the table and
    its shape."""
    messages: dict[int, tuple[Any, tuple[float, tuple[int, ...]], Any]] = field(
        default_factory=dict
    )
    """Per walked rank, what its stage's pipeline messages cost (:func:`collsim.play.
    walk_pipe._messages`): the op table (held), the bytes and walked ranks, the prices."""
    rank_bodies: dict[int, RankBodies] = field(default_factory=dict)
    """:meth:`Walker.rank_bodies` by rank."""
    trace: tuple[tuple[Any, ...], Any, Any] | None = None
    """The last pipeline trace a walk of these programs read (:func:`collsim.play.walk_pipe.
    walk_fused`): the op tables, block seconds and send prices it was read for (held,
    checked by identity), the fold gathers' seconds and the message bytes, the traces."""
    tp_calls: dict[tuple[int, int], tuple[list[Any], list[tuple[CallKey, float, float]]]] = field(
        default_factory=dict
    )
    """:meth:`Walker.tp_adds`' priced calls of a step list by (rank, its identity): the
    list (kept: its identity stays its own) and (tally key, seconds, busbw) per call."""
    bucket_calls: dict[tuple[int, float, bool], tuple[Priced, ...]] = field(default_factory=dict)
    """:meth:`Walker.bucket_calls` by (rank, bucket elements, expert)."""
    reductions: dict[tuple[int, bool, int, Any], tuple[Reduction, ...]] = field(
        default_factory=dict
    )
    """:meth:`Walker.reductions` by (rank, whether buffers are held, the op's body's shape,
    its chunk's bucket shape: :attr:`~collsim.step.ops.ChunkModel.bucket_shape` or
    :meth:`Walker.bucket_shape`)."""
    tally_keys: dict[int, tuple[Sequence[Reduction], list[CallKey]]] = field(default_factory=dict)
    """By the identity of an op's reductions (held: :attr:`reductions`' tuples): the tallies
    their calls add to, in order of first use (:meth:`Walker.open_tallies`)."""
    reduction_columns: dict[int, tuple[Sequence[Reduction], ReductionColumns]] = field(
        default_factory=dict
    )
    """:func:`reduction_arrays` by the identity of an op's reductions (held: :attr:`reductions`'
    tuples, which the variants with the same bucket shape read again)."""
    shape_numbers: dict[Any, int] = field(default_factory=dict)
    """Each distinct shape of a body's windows or a chunk's buckets, numbered in order."""
    call_prices: dict[tuple[int, str, float, str], Priced] = field(default_factory=dict)
    """:meth:`Walker.dp_price` by (rank, op, size, axis)."""
    gather_prices: dict[tuple[int, float, bool], tuple[Priced, ...]] = field(default_factory=dict)
    """:meth:`Walker.gather_prices` of a bucket by (rank, bucket elements, expert)."""
    chunk_gathers: dict[tuple[int, Any], tuple[Priced, ...]] = field(default_factory=dict)
    """:meth:`Walker.gather_prices` of a chunk by (rank, its buckets' shape)."""
    flushes: dict[tuple[Any, ...], tuple[list[Any], list[TallyAdds]]] = field(default_factory=dict)
    """:meth:`Walker.flush_tp`'s tallies by the walk's runs ((run key, count) each, in
    order): the runs' segment lists (kept: their identities stay their own) and the adds."""
    zero3_tp: tuple[Any, Any, Any, tuple[int, ...], list[TallyAdds]] | None = None
    """What :meth:`Walker.flush_tp` added to the tallies after the last ZeRO-3 walk of these
    programs in a search, with what made its runs: its stages, pipeline orders and paired ops
    (kept: their identities stay their own) and the ranks walked. A variant that shares them
    (an FSDP prefetch variant shares its program's) runs the same ops in the same order on
    each rank (the walk resumes a rank when its input is sent, whatever the clock), each
    segment once, settled or not, so it makes the same runs; it adds these without counting
    them."""
    replays: dict[tuple[Any, ...], tuple[Any, Any, Any, Any, Any]] = field(default_factory=dict)
    """The fused walk's replay order (:func:`collsim.play.walk_pipe.replay_order`) by the
    identity of the pipeline traces and what else it reads: the traces (kept), the items, the
    deferred reductions' ops, the ops that run each block's reductions, the overlapped ones."""
    sums: dict[int, tuple[Any, list[Any], dict[str, float]]] = field(default_factory=dict)
    """Per walked rank, its blocks' account added up over the ops (from zero; :func:`collsim.
    play.walk_pipe.add_block_sums`): the op table, the blocks' ``comm`` dicts it was added up
    for (by identity: a block's body), the sums."""
    alike: Any = None
    """The last ZeRO-3 walk in full of these programs, as their prefetch variants replay it
    (:class:`collsim.play.walk_alike.AlikeWalk`; None before one)."""
    mapping: str | None = None
    """The plans' rank layout in words (the DDP knobs place no rank)."""
    peaks: dict[tuple[int, tuple[Any, ...]], tuple[Any, list[Any], Any, float]] = field(
        default_factory=dict
    )
    """Per walked rank and its state allocations (the events before the traced ones), the
    memory peaks of a ledger of the traced events and its blocks' patterns
    (:func:`collsim.play.walk_pipe._shared_peaks`): the trace, the patterns (by identity),
    the peak and the activations' peak; the variants that place the same pattern objects on
    the same trace read them without a key made of every event."""
    placements: dict[tuple[int, int], tuple[Any, list[Any], Any]] = field(default_factory=dict)
    """Per walked rank and count of the events recorded before the first (the variants'
    state allocations differ in number: a DDP bucket buffer or none), its blocks' patterns
    placed on the traced starts (:func:`collsim.play.walk_pipe.placed_ops`, without
    reductions' buffers, which a ZeRO-2 walk adds to its copy): the trace, the patterns (by
    identity), the placement (its events, once sorted, kept in it)."""
    seg_plans: dict[tuple[int, int, Phase, bool], tuple[list[Segment], list[SegStep]]] = field(
        default_factory=dict
    )
    """:func:`collsim.play.walk_zero3.seg_plan` by (rank, chunk, phase, paired): the op's
    segment list (kept: its identity stays its own) and its steps."""
    issue_plans: dict[
        tuple[int, int, Phase, bool, int], tuple[list[Segment], list[tuple[Issue, ...]]]
    ] = field(default_factory=dict)
    """:func:`collsim.play.walk_zero3.issue_plan` by (rank, chunk, phase, paired, prefetch
    depth): the op's segment list (kept: its identity stays its own) and its issues."""
    seg_issues: dict[tuple[int, int, Phase, bool], tuple[list[Segment], list[Issue]]] = field(
        default_factory=dict
    )
    """:func:`collsim.play.walk_zero3.seg_issues` by (rank, chunk, phase, paired): the op's
    segment list (kept) and, per segment, its unit's gather."""
    seg_sums: dict[tuple[int, int, Phase, bool, int], tuple[list[SegStep], SegSums | None]] = field(
        default_factory=dict
    )
    """:func:`collsim.play.walk_zero3.seg_sums` by (rank, chunk, phase, paired, identity of
    the op's segment steps): those steps (held) and their sums."""
    unit_gathers: dict[tuple[int, int, str | int], Issue] = field(default_factory=dict)
    """A ZeRO-3 unit's gather as :func:`collsim.play.walk_zero3.issue_plan` issues it, by
    (rank, chunk, unit)."""
    settled: dict[tuple[int, int, Phase, bool, bool], SettledOp | None] = field(
        default_factory=dict
    )
    """:func:`collsim.play.walk_zero3.settled_op` by (rank, chunk, phase, paired, last
    micro-batch): a settled block reads the segments, their prices and when units are
    released, none of which a variant's knobs change."""
    stage_blocks: dict[tuple[Any, ...], list[SettledOp | bool | None]] = field(default_factory=dict)
    """Per walked rank and pipeline shape (:meth:`Walker.pipeline_shape`), per op of its
    stage: its entry of ``settled`` (False for none; None until a walk asks), so that the
    walks of a plan's variants look each op up once."""
    settled_terms: dict[tuple[int, ...], Any] = field(default_factory=dict)
    """:meth:`Walker.add_settled`'s terms by the identities of the settled blocks it adds (all
    held in ``settled``): each block's sums in turn (read only; the account's start is put
    before them in a new array at each use). The walks of a plan's variants add the same
    runs of blocks between their segment loops (at most :data:`SETTLED_TERMS_KEPT`)."""


class RankBodies(NamedTuple):
    """A rank's op bodies by a stage's op keys (:meth:`Walker.rank_bodies`), with what the
    walk reads of them as lists kept beside them: the same objects for every variant of the
    programs that share them, which the tables kept by them check by identity."""

    keys: Sequence[tuple[int, Phase, bool]]
    """The op keys they were made for (held)."""
    forward: list[Segment]
    """The first chunk's forward segments they were made for (held)."""
    bodies: list[OpBody]
    patterns: list[MemoryPattern]
    """Each body's pattern (:meth:`Walker.block_lists`)."""
    comms: list[dict[str, float]]
    """Each body's ``comm`` dict (:meth:`Walker.block_lists`)."""
    durations: tuple[float, ...]
    """Each body's seconds (:meth:`Walker.block_durations`)."""


class OpPlan(NamedTuple):
    """An op's fused block (:meth:`Walker.op_plans`; a named tuple: a plan's backward ops
    each make one, a dataclass costs more to make)."""

    segs: list[Segment]
    duration: float
    compute: float
    tp: float
    comm: dict[str, float]
    pattern: MemoryPattern
    comm_items: tuple[tuple[str, float], ...]
    """``comm`` as pairs, in its order."""
    run_key: tuple[int, int]
    """The op's key in the walk's TP runs (:meth:`Walker.flush_tp`)."""
    reductions: tuple[Reduction, ...]
    """Its buckets' reductions with calls, in the order they become ready (:meth:`Walker.
    op_plans`)."""


Reduction = tuple[float, tuple[Priced, ...], float]
"""A bucket's reduction in an op: (offset of its ready time in the op, its priced calls, bytes
of the ZeRO-2 buffer it holds or 0)."""


def pipeline_links(schedule: StepSchedule, stage: int) -> list[Link]:
    """Per op of ``stage``, in order: whether it reads a message from another stage, the
    direction of that message (:func:`~collsim.parallel.pipeline.flow`) and where its own
    output goes ((stage, direction, chunk) or None), from the schedule's dependencies
    (worked out once per (phase, chunk): the micro-batch passes through)."""
    plan = schedule.plan
    pipeline, p, v = plan.pipeline_schedule, plan.pp, plan.virtual_stages
    shapes: dict[tuple[Phase, int], Link] = {}
    out: list[Link] = []
    for op in schedule.pipeline[stage]:
        shape = shapes.get((op.phase, op.chunk))
        if shape is None:
            src = pipeline.input_of(op, stage=stage, num_stages=p, virtual_stages=v)
            dest = pipeline.output_of(op, stage=stage, num_stages=p, virtual_stages=v)
            shape = shapes[(op.phase, op.chunk)] = (
                src is not None and src[0] != stage,
                flow(op.phase),
                None
                if dest is None or dest[0] == stage
                else (dest[0], dest[1].phase, dest[1].chunk),
            )
        out.append(shape)
    return out


Wire = tuple[int, int, int]
"""An op's messages in a walk's :func:`pipeline_wiring`: the number of the message it reads
(-1: none from another stage), the number of the one it sends and the stage it goes to (-1,
-1: none)."""


def pipeline_wiring(tables: Sequence[OpTable]) -> tuple[list[list[Wire]], int]:
    """Per stage, per op: its :data:`Wire` (``tables``: each stage's :class:`OpTable`), the
    messages numbered by what names one, (receiving stage, direction, micro-batch, chunk);
    and how many there are. The walks keep their mail in lists by these numbers instead of a
    dictionary by those keys."""
    number: dict[tuple[int, Any, int, int], int] = {}
    out = []
    for stage, table in enumerate(tables):
        wires = []
        for (remote, direction, dest), mb, c in zip(
            table.links, table.microbatches, table.chunks, strict=True
        ):
            read = number.setdefault((stage, direction, mb, c), len(number)) if remote else -1
            if dest is None:
                wires.append((read, -1, -1))
                continue
            to, phase, chunk = dest
            sent = number.setdefault((to, phase, mb, chunk), len(number))
            wires.append((read, sent, to))
        out.append(wires)
    return out, len(number)


class ReductionColumns(NamedTuple):
    """What :meth:`~collsim.play.walker.Walker.run_block_batch` reads of an op's
    reductions (:func:`reduction_arrays`)."""

    rel: Any
    """Each reduction's offset in its op."""
    call_rel: Any
    """Per call, in order: its reduction's offset."""
    seconds: Any
    """Per call, in order: its seconds."""
    last_call: Any
    """Each reduction's last call."""
    holds: tuple[Any, list[float], list[float]] | None
    """The held ZeRO-2 buffers: which reductions, their bytes and their negatives (None
    without any)."""
    tally_keys: list[CallKey]
    """The tallies the calls add to, in order of first use."""
    call_slots: Any
    """Per call, in order: the index of its tally in ``tally_keys``."""
    tally_busbw: list[float]
    """Per tally: the busbw of its last call."""


def reduction_arrays(reductions: Sequence[Reduction]) -> ReductionColumns:
    """An op's reductions as :class:`ReductionColumns`, once."""
    rel = np.array([r for r, _, _ in reductions], dtype=float)
    counts = np.array([len(calls) for _, calls, _ in reductions], dtype=np.intp)
    calls = [c for _, cs, _ in reductions for c in cs]
    slots: dict[CallKey, int] = {}
    busbws: list[float] = []
    call_slots = []
    for _, busbw, key in calls:
        slot = slots.get(key)
        if slot is None:
            slot = slots[key] = len(busbws)
            busbws.append(busbw)
        else:
            busbws[slot] = busbw
        call_slots.append(slot)
    which = np.flatnonzero([hold for _, _, hold in reductions])
    holds = None
    if len(which):
        sizes = [float(reductions[i][2]) for i in which.tolist()]
        holds = (which, sizes, [-size for size in sizes])
    return ReductionColumns(
        rel=rel,
        call_rel=np.repeat(rel, counts),
        seconds=np.array([t for t, _, _ in calls], dtype=float),
        last_call=np.cumsum(counts) - 1,
        holds=holds,
        tally_keys=list(slots),
        call_slots=np.array(call_slots, dtype=np.intp),
        tally_busbw=busbws,
    )


def queue_ends(ready_s: Any, seconds: Any, free_s: float) -> Any:
    """When each call ends on one stream, calls in order (``ready_s``, ``seconds``: arrays),
    the stream free at ``free_s``: ``end_j = max(ready_j, end_{j-1}) + seconds_j`` with the
    floats of the call-by-call loop. Every call is first taken to start when ready; then each
    pass computes the recurrence again for the calls whose predecessor's end changed in the
    pass before (all of them at once, as arrays), until no end changes. Each end is the
    maximum and the sum the loop takes, of the same operands once the passes stop (the
    recurrence has one solution), so the ends are the loop's to the bit; the passes are as
    many as the longest run of calls that wait for the one before."""
    n = len(ready_s)
    ends = np.empty(n + 1)  # ends[j + 1]: call j's end; ends[0]: the stream free
    ends[0] = free_s
    np.add(np.maximum(ready_s, free_s), seconds, out=ends[1:])  # (call 0's is final)
    active = np.arange(1, n)
    while len(active):
        new = np.maximum(ready_s[active], ends[active]) + seconds[active]
        changed = new != ends[active + 1]
        active = active[changed]
        ends[active + 1] = new[changed]
        active = active[active < n - 1] + 1
    return ends[1:]
