"""ZeRO-3 in the closed-form walk: an op run segment by segment, each waiting for its
gathered unit, its reductions and reshards priced once per (rank, chunk, phase)
(:class:`~collsim.play.walk_tables.SegStep`), its gathers once per prefetch depth, and replayed
by every micro-batch; or, settled, as one block.
"""

from __future__ import annotations

import functools
from typing import TYPE_CHECKING, Any, Protocol

import numpy as np

from collsim.core.errors import SimulationError
from collsim.parallel.fsdp import issue_schedule
from collsim.parallel.pipeline import Phase, PipeOp
from collsim.play.walk_tables import (
    SETTLED_SUMS,
    Issue,
    Priced,
    RankState,
    SegStep,
    SegSums,
    SettledOp,
    SharedWalk,
)
from collsim.step.memory import MemoryEvent, MemoryPattern
from collsim.step.ops import BUFFER_FREE_KIND, BUFFER_KIND, ChunkModel

if TYPE_CHECKING:
    from collsim.step.dataparallel import DataParallelRules, DPCall
    from collsim.step.ops import Segment


class Walker(Protocol):
    """What the segment path reads of :class:`collsim.play.walker.Walker`."""

    rules: DataParallelRules
    runs: dict[tuple[int, int], list[Any]]
    count_runs: bool
    shared: SharedWalk

    def seg_tp_s(self, rank: int, seg: Segment) -> float: ...

    def seg_compute_s(self, rank: int, seg: Segment) -> float: ...

    def seg_comm_s(self, rank: int, seg: Segment) -> dict[str, float]: ...

    def priced_calls(
        self, rank: int, calls: list[DPCall], extra_s: float
    ) -> tuple[Priced, ...]: ...

    def run_priced(self, prog: RankState, calls: tuple[Priced, ...], ready: float) -> float: ...

    def add_settled(self, prog: RankState) -> None: ...


__all__ = ["issue_plan", "run_segments", "seg_issues", "seg_plan", "seg_sums", "settled_op"]


def seg_plan(
    w: Walker, prog: RankState, chunk: ChunkModel, phase: Phase, paired: bool
) -> list[SegStep]:
    """What :func:`run_segments` does per segment of an op, the gathers it issues aside
    (:func:`issue_plan`), priced once per (rank, chunk, phase, paired) in the shared tables
    (a variant's rules change none of it)."""
    key = (prog.rank, chunk.index, phase, paired)
    segs = chunk.segments(phase, paired)
    hit = w.shared.seg_plans.get(key)
    if hit is not None and hit[0] is segs:
        return hit[1]
    rules, rank = w.rules, prog.rank
    backward = phase is Phase.BACKWARD or phase is Phase.BACKWARD_WEIGHT
    forward = phase is Phase.FORWARD
    out = []
    for seg in segs:
        ukey = rules.unit_key(chunk, seg)
        compute = w.seg_compute_s(rank, seg)
        grad: tuple[float, str, tuple[Priced, ...]] | None = None
        if backward:
            gsize = rules.grad_bytes(chunk, ukey)
            red = rules.unit_reductions(chunk, ukey) if rules.reduces_units else []
            grad = (gsize, f"grad {ukey}", w.priced_calls(rank, red, rules.offload_s(gsize)))
        out.append(
            SegStep(
                seg=seg,
                unit=(chunk.index, ukey),
                duration=compute + w.seg_tp_s(rank, seg) + seg.framework_s,
                compute_s=compute,
                comm_items=tuple(w.seg_comm_s(rank, seg).items()),
                releases=(
                    rules.releases(chunk, seg, forward=forward, microbatch=None),
                    rules.releases(chunk, seg, forward=forward, microbatch=0),
                ),
                grad=grad,
                reshard_bytes=rules.gather_bytes(chunk, ukey),
                run_key=(rank, id(seg)),
            )
        )
    w.shared.seg_plans[key] = (segs, out)
    return out


def issue_plan(
    w: Walker, prog: RankState, chunk: ChunkModel, phase: Phase, paired: bool
) -> list[tuple[Issue, ...]]:
    """Per segment of an op, the unit gathers issued before it (``rules.prefetch`` ahead:
    :func:`~collsim.parallel.fsdp.issue_schedule`; none for a weight-gradient op), once per
    (rank, chunk, phase, paired, prefetch depth) in the shared tables (of a variant's knobs
    only the depth changes it); each unit's gather priced once there too."""
    rules, rank = w.rules, prog.rank
    key = (rank, chunk.index, phase, paired, rules.prefetch)
    segs = chunk.segments(phase, paired)
    hit = w.shared.issue_plans.get(key)
    if hit is not None and hit[0] is segs:
        return hit[1]
    if phase is Phase.BACKWARD_WEIGHT:  # dB needs no weight
        out: list[tuple[Issue, ...]] = [() for _ in segs]
    else:
        units = seg_issues(w, prog, chunk, phase, paired, segs)
        out = [tuple([units[j] for j in js]) for js in _issue_schedule(len(segs), rules.prefetch)]
    w.shared.issue_plans[key] = (segs, out)
    return out


@functools.lru_cache(maxsize=256)
def _issue_schedule(count: int, depth: int) -> tuple[tuple[int, ...], ...]:
    """:func:`~collsim.parallel.fsdp.issue_schedule` as tuples, once per (count, depth)."""
    return tuple(tuple(js) for js in issue_schedule(count, depth))


def seg_issues(
    w: Walker,
    prog: RankState,
    chunk: ChunkModel,
    phase: Phase,
    paired: bool,
    segs: list[Segment],
) -> list[Issue]:
    """Per segment of an op (``segs``), the gather of its unit as :func:`issue_plan` issues
    it, once per (rank, chunk, phase, paired) in the shared tables: the same whatever the
    prefetch depth, which only says before which segment each is issued."""
    rules, rank = w.rules, prog.rank
    key = (rank, chunk.index, phase, paired)
    hit = w.shared.seg_issues.get(key)
    if hit is not None and hit[0] is segs:
        return hit[1]
    known = w.shared.unit_gathers
    out = []
    for seg in segs:
        ukey = rules.unit_key(chunk, seg)
        issue = known.get((rank, chunk.index, ukey))
        if issue is None:
            size = rules.gather_bytes(chunk, ukey)
            calls = rules.unit_gathers(chunk, ukey)
            issue = known[(rank, chunk.index, ukey)] = (
                (chunk.index, ukey),
                size,
                f"gathered {ukey}",
                w.priced_calls(rank, calls, rules.offload_s(size)),
            )
        out.append(issue)
    w.shared.seg_issues[key] = (segs, out)
    return out


def settled_op(
    w: Walker, prog: RankState, chunk: ChunkModel, phase: Phase, paired: bool, last: bool
) -> SettledOp | None:
    """The op as one block when its units are gathered and ready at its start (None when one
    of its segments releases its unit in this micro-batch: ``last``, the last one or not):
    what :func:`run_segments` then does, once per (rank, chunk, phase, paired, last). Its
    events are those of the segment loop, in its order, on the segments' boundaries."""
    key = (prog.rank, chunk.index, phase, paired, last)
    known = w.shared.settled
    if key in known:
        return known[key]
    steps = seg_plan(w, prog, chunk, phase, paired)
    if any(sp.releases[0 if last else 1] for sp in steps):
        known[key] = None
        return None
    forward = phase is Phase.FORWARD
    gathers = phase is not Phase.BACKWARD_WEIGHT
    needs: dict[tuple[int, str | int], None] = {}
    events: list[tuple[float, float, str, object]] = []
    at: list[int] = []
    t = 0.0
    for i, sp in enumerate(steps):
        seg = sp.seg
        if gathers:  # (the op's gathers are all for its segments' units, whatever the prefetch)
            needs[sp.unit] = None
        start = len(events)
        if seg.buffer_bytes:
            events.append((t, float(seg.buffer_bytes), BUFFER_KIND, seg.key))
        if not forward and seg.transient_bytes:
            events.append((t, float(seg.transient_bytes), "recompute", seg.key))
        at += [i] * (len(events) - start)
        t += sp.duration
        start = len(events)
        if seg.buffer_bytes:
            events.append((t, -float(seg.buffer_bytes), BUFFER_FREE_KIND, seg.key))
        if forward:
            if seg.stored_bytes:
                events.append((t, float(seg.stored_bytes), "act", seg.key))
        elif seg.frees and seg.transient_bytes + seg.stored_bytes:
            events.append((t, -float(seg.transient_bytes + seg.stored_bytes), "free", seg.key))
        at += [i + 1] * (len(events) - start)
    durations = tuple(sp.duration for sp in steps)
    sums = _sums_matrix(steps)
    if sums is None:  # pragma: no cover - EXPOSED_KEY names no other
        raise SimulationError("a settled op adds to an account key not in SETTLED_SUMS")
    op = known[key] = SettledOp(
        needs=tuple(needs) if gathers else (),
        steps=durations,
        sums=sums,
        pattern=MemoryPattern("activations", events, durations, at) if events else None,
        runs=tuple((sp.run_key, sp.seg) for sp in steps),
    )
    return op


def _sums_matrix(steps: list[SegStep]) -> Any:
    """Per key of :data:`SETTLED_SUMS` (rows), what each segment of ``steps`` adds to it
    (columns, in order; 0.0 where it adds nothing); None when one adds to another key."""
    sums = np.zeros((len(SETTLED_SUMS), len(steps)))
    row = {k: i for i, k in enumerate(SETTLED_SUMS)}
    sums[row["compute"]] = [sp.compute_s for sp in steps]
    sums[row["framework"]] = [sp.seg.framework_s for sp in steps]
    for i, sp in enumerate(steps):
        for k, v in sp.comm_items:
            if k not in row:
                return None
            sums[row[k], i] = v
    return sums


def seg_sums(
    w: Walker, prog: RankState, chunk: ChunkModel, phase: Phase, paired: bool
) -> SegSums | None:
    """What an op's segment loop adds to the account when no segment waits for its unit
    (:func:`_sums_matrix` of :func:`seg_plan`), as a block for
    :meth:`~collsim.play.walker.Walker.add_settled`; once per (rank, chunk, phase, paired)
    in the shared tables (held there: the walk keys its terms by the block's identity)."""
    steps = seg_plan(w, prog, chunk, phase, paired)
    key = (prog.rank, chunk.index, phase, paired, id(steps))
    hit = w.shared.seg_sums.get(key)
    if hit is not None and hit[0] is steps:
        return hit[1]
    sums = _sums_matrix(steps)
    block = None if sums is None else SegSums(sums)
    w.shared.seg_sums[key] = (steps, block)  # (never replaced: a block's identity stays its own)
    return block


def run_segments(
    w: Walker, prog: RankState, op: PipeOp, chunk: ChunkModel, paired: bool
) -> list[float] | None:
    """ZeRO-3: segment by segment, each waiting for its gathered unit (:func:`seg_plan`).
    The walk runs a settled op (:func:`settled_op`) as one block instead of calling this.
    Memory events are appended as :meth:`MemoryLedger.alloc` / ``free`` would record them
    (known categories; none for a size of zero). Returns each segment's wait for its unit
    (None when none waited)."""
    prog.gathers_made += 1  # it may issue and release gathers
    forward = op.phase is Phase.FORWARD
    gathers = op.phase is not Phase.BACKWARD_WEIGHT
    weight = op.phase is Phase.BACKWARD_WEIGHT
    last = op.microbatch < 0 or op.microbatch >= w.rules.num_microbatches - 1
    gathered, breakdown = prog.gathered, prog.breakdown_s
    events = prog.ledger.appenders()[0]
    new = tuple.__new__  # MemoryEvent without its keyword-argument layer
    runs, mb, c = w.runs if w.count_runs else None, op.microbatch, op.chunk
    now = prog.now  # (written back at the end: nothing else reads it before)
    waits: list[float] | None = None  # per segment, its wait for its unit (when one waits)
    steps = seg_plan(w, prog, chunk, op.phase, paired)
    for j, (sp, issues) in enumerate(
        zip(steps, issue_plan(w, prog, chunk, op.phase, paired), strict=True)
    ):
        seg = sp.seg
        for unit, size, label, calls in issues:
            if unit in gathered:
                continue
            if size:
                events.append(new(MemoryEvent, (now, "parameters", float(size), label)))
            gathered[unit] = w.run_priced(prog, calls, now)
            prog.gathers_issued += 1
        ready = gathered.get(sp.unit)
        if gathers and ready is not None and ready > now:
            if waits is None:
                waits = [0.0] * len(steps)
            waits[j] = ready - now
            now = ready
        key = seg.key  # labels as the engine's: (kind, segment, micro-batch, chunk)
        if seg.buffer_bytes:
            size = float(seg.buffer_bytes)
            events.append(new(MemoryEvent, (now, "activations", size, (BUFFER_KIND, key, mb, c))))
        if not forward and seg.transient_bytes:
            size = float(seg.transient_bytes)
            events.append(new(MemoryEvent, (now, "activations", size, ("recompute", key, mb, c))))
        if runs is not None:  # a run of its TP collectives (flush_tp)
            slot = runs.get(sp.run_key)
            if slot is None:
                runs[sp.run_key] = [[seg], 1]
            else:
                slot[1] += 1
        now += sp.duration
        if seg.buffer_bytes:
            size, free = -float(seg.buffer_bytes), (BUFFER_FREE_KIND, key, mb, c)
            events.append(new(MemoryEvent, (now, "activations", size, free)))
        if forward:
            if seg.stored_bytes:
                size = float(seg.stored_bytes)
                events.append(new(MemoryEvent, (now, "activations", size, ("act", key, mb, c))))
        elif seg.frees and seg.transient_bytes + seg.stored_bytes:
            size = -float(seg.transient_bytes + seg.stored_bytes)
            events.append(new(MemoryEvent, (now, "activations", size, ("free", key, mb, c))))
        if not sp.releases[0 if last else 1]:
            continue  # kept gathered (and its gradient unreduced)
        if sp.grad is not None:
            gsize, label, calls = sp.grad
            end = w.run_priced(prog, calls, now) if calls else now
            if gsize:
                events.append(new(MemoryEvent, (now, "buffers", float(gsize), label)))
                events.append(new(MemoryEvent, (end, "buffers", -float(gsize), label)))
        if weight:
            continue
        del gathered[sp.unit]
        if sp.reshard_bytes:
            size = -float(sp.reshard_bytes)
            events.append(new(MemoryEvent, (now, "parameters", size, "reshard")))
    prog.now = now
    block = seg_sums(w, prog, chunk, op.phase, paired) if waits is None else None
    if block is not None:  # added with the settled blocks around it (add_settled)
        prog.settled.append(block)
        return None
    w.add_settled(prog)  # the settled blocks' sums first, as they ran
    _add_terms(breakdown, steps, waits)
    return waits


def _add_terms(
    breakdown: dict[str, float], steps: list[SegStep], waits: list[float] | None
) -> None:
    """A segment loop's terms added to the account, each key's in the segments' order, each
    wait for a unit before its segment's terms."""
    compute, framework = breakdown["compute"], breakdown["framework"]
    for j, sp in enumerate(steps):
        if waits is not None and waits[j]:
            breakdown["dp_exposed"] += waits[j]
        compute += sp.compute_s
        framework += sp.seg.framework_s
        for k, v in sp.comm_items:  # (no comm key is "compute" or "framework")
            breakdown[k] += v
    breakdown["compute"], breakdown["framework"] = compute, framework
