"""The closed form of a step: the step program walked as a critical path, without SimPy.

One representative rank per pipeline stage runs its ops in pipeline order; each op's block
(:class:`~collsim.play.walk_tables.OpPlan`) and each ZeRO-3 segment
(:class:`~collsim.play.walk_tables.SegStep`) is priced once (per walk, or in the tables the
walks of a search share) and reused by every micro-batch. Derivations: docs/derivations.md.
"""

from __future__ import annotations

from collections.abc import Hashable, Iterator, Sequence
from functools import reduce
from itertools import islice
from operator import add, itemgetter
from typing import TYPE_CHECKING, Any

import numpy as np

from collsim.core.errors import SimulationError
from collsim.core.vocab import ParallelAxis
from collsim.parallel.buckets import Bucket
from collsim.parallel.pipeline import GRADIENT_PHASES, Phase
from collsim.play.walk_alike import LoopRecord, alike_key, record_walk, replay_walk
from collsim.play.walk_pipe import BUFFER_LABEL, walk_fused
from collsim.play.walk_tables import (
    SETTLED_SUMS,
    SETTLED_TERMS_KEPT,
    Link,
    OpBody,
    OpPlan,
    OpTable,
    Priced,
    RankBodies,
    RankState,
    Reduction,
    ReductionColumns,
    SettledOp,
    SharedWalk,
    TallyAdds,
    Wire,
    fires,
    norm_rounds,
    op_table,
    pipeline_links,
    pipeline_wiring,
    queue_ends,
    reduction_arrays,
)
from collsim.play.walk_zero3 import run_segments, settled_op
from collsim.step.dataparallel import GRAD_NORM_BYTES, DPCall
from collsim.step.memory import MemoryEvent, MemoryLedger, MemoryPattern
from collsim.step.ops import ChunkModel, Segment, StageModel, Step
from collsim.step.pricing import ClosedPricer, SegmentPrices
from collsim.step.result import MEMORY_KEYS, TraceEvent
from collsim.step.shapes import ShapeCache
from collsim.step.stats import CallKey, CallStats, CallTally, dp_links

if TYPE_CHECKING:
    from collsim.step.build import StepSchedule

__all__ = ["Walker"]

TP, PP, DP = ParallelAxis.TP, ParallelAxis.PP, ParallelAxis.DP
_new = tuple.__new__  # MemoryEvent without its keyword-argument layer
_SECONDS = itemgetter(0)
"""A priced call's seconds."""


RECORDED_LOOPS_SHARE = 1 / 8
"""A search's ZeRO-3 walk is recorded for its prefetch variants (:mod:`collsim.play.walk_alike`)
while its segment loops are at most this share of its ops: a replay runs every loop that
gathers, so a walk of loops throughout (units resharded after forward) gains little from one,
and its record costs (a random sample of Qwen3-30B plans, ZeRO-3 ones resharding every op: 7.3
ms a plan walked without records, 11-13 with every walk recorded; the CP search's plans that
keep their units run 2-4 % of their ops as loops). A walk without prefetch is not recorded:
each of its segments that gathers waits for its own unit, which a variant prefetching ahead
issues a segment earlier, so no variant walks as it did (the CP search's 124 variants of depth
1 each failed to replay the walk of depth 0 before it; recording and trying cost 0.1-0.4 ms
a variant)."""

SHARED_KEPT = 16
"""Families of programs whose :class:`SharedWalk` a search's shape cache keeps (the most
recently made: :meth:`Walker.shared_walk`): as many as the programs an estimator keeps
(:data:`collsim.play.walk.PROGRAMS_KEPT`), so that a program a search comes back to finds its
walks' tables too."""


class Walker:
    """The closed-form walk of one schedule (representative rank per stage)."""

    def __init__(
        self, schedule: StepSchedule, pricer: ClosedPricer, shapes: ShapeCache | None = None
    ) -> None:
        self.schedule = schedule
        self.shapes = shapes
        self.plan = schedule.plan
        self.rules = schedule.dp
        self.pricer = pricer
        self.stats = CallStats()
        self.des_axes: frozenset[str] = frozenset()
        self.trace_events: list[TraceEvent] = []
        plan = self.plan
        self.programs: dict[int, RankState] = {}
        for st in range(plan.pp):
            r = plan.rank(dp=0, pp=st, tp=0)
            self.programs[r] = RankState(r, plan.coords(r), MemoryLedger(r))
        self.by_stage = {p.coords.pp: p for p in self.programs.values()}
        self.received: dict[int, tuple[list[float], list[float]]] = {
            r: ([], []) for r in self.programs
        }
        """Per walked rank, when the ZeRO-3 walk freed and allocated its pipeline receive
        buffers (the schedule's ``p2p_bytes`` each, ``"pp recv"``): recorded as one block of
        columns at the end of the walk (:meth:`record_messages`), no event made."""
        self.wiring: list[list[Wire]] = []
        """Per stage, per op: its messages' numbers (ZeRO-3 walk, :meth:`wire`)."""
        self.mail_produced: list[float] = []
        self.mail_delivered: list[float | None] = []
        """Per message (its number in :attr:`wiring`): when it was produced and when it is
        delivered (None until sent)."""
        self.prices = SegmentPrices(
            self.plan, pricer, schedule.overlap_factor if schedule.step_interference else None
        )
        self.step_s = self.prices.step_s
        self.seg_comm_s = self.prices.seg_comm_s
        self.seg_tp_s = self.prices.seg_tp_s
        self.seg_compute_s = self.prices.seg_compute_s
        self.shared = SharedWalk() if shapes is None else self.shared_walk(shapes)
        """What this walk prices once; in a search, shared with the walks of the programs
        that share this one's segments and pricer (:meth:`shared_walk`)."""
        self.gather_pp = plan.tp > 1 and not plan.parallel.sequence_parallel
        self._links: dict[int, list[Link]] = {}
        self._fold: dict[int, tuple[CallKey, float, float]] = {}
        self._bucket_shapes: dict[int, tuple[Sequence[Bucket], int]] = {}
        """:meth:`bucket_shape` by the identity of a chunk's bucket list (kept)."""
        self.runs: dict[tuple[int, int], list[Any]] = {}
        self.count_runs = True
        """Whether the walk counts its TP runs (a search's ZeRO-3 variants add the runs their
        programs' walk counted: ``SharedWalk.zero3_tp``)."""
        self._blocks: dict[int, list[SettledOp | bool | None]] = {}
        """Per stage, per op: its settled block, False when it has none, None until asked
        (the list the plan's variants share, ``SharedWalk.stage_blocks``)."""
        self._settled_runs: dict[int, list[Any]] = {}
        """Per settled block run in this walk (by identity): [the block, its runs after the
        first], for :meth:`add_settled_runs`."""
        self._needs_met: dict[int, int] = {}
        """Per settled block (by identity; the walk's blocks outlive it): the rank's
        ``gathers_made`` when its units were last all gathered and ready."""
        self.loop_limit = 0
        """The most segment loops a recorded walk may run (:data:`RECORDED_LOOPS_SHARE`)."""
        self.loops: list[LoopRecord] | None = None
        """The segment loops run, recorded when a search's variants may replay this walk
        (:mod:`collsim.play.walk_alike`); None when not recorded."""
        self._windows: dict[tuple[int, int, int], tuple[float, float]] = {}
        """:meth:`grad_window` by (rank, id of a segment's step list, where its gradients
        start); the lists live as long as the walk's schedule."""

    def shared_walk(self, shapes: ShapeCache) -> SharedWalk:
        """The :class:`SharedWalk` of the programs in ``shapes`` that share this one's
        segments and are priced by this walk's pricer (its tables hold that pricer's prices),
        by the identities of the first segment list and of the pricer, which the entry holds
        (so that they stay their own)."""
        first = self.schedule.stages[0].chunks[0].forward
        pricer = self.pricer
        held, held_pricer, shared = shapes.recent(
            "shared walks",
            (id(first), id(pricer)),
            lambda: (first, pricer, SharedWalk()),
            SHARED_KEPT,
        )
        if held is not first or held_pricer is not pricer:  # pragma: no cover - reused ids
            return SharedWalk()
        out: SharedWalk = shared
        return out

    def stat_items(self) -> Iterator[tuple[CallKey, CallTally]]:
        return self.stats.items()

    # ---- prices -------------------------------------------------------------------------------
    def group(self, rank: int, axis: str) -> tuple[int, ...]:
        return self.prices.group(rank, axis)

    def price(
        self, rank: int, axis: str, op: str, size: float, ranks: tuple[int, ...], extra_s: float
    ) -> float:
        """Seconds of one call, tallied as the engine tallies it."""
        key, time_s, busbw = self.call_price(rank, axis, op, size, ranks)
        time_s += extra_s
        self.stats.add(key, time_s, busbw)
        return time_s

    def call_price(
        self, rank: int, axis: str, op: str, size: float, ranks: tuple[int, ...]
    ) -> tuple[CallKey, float, float]:
        """(tally key, seconds, busbw) of one call of ``rank`` on ``ranks``."""
        cost = self.pricer.cost(op, size, ranks)
        key = CallKey(rank, axis, op, size, len(ranks), cost.algorithm)
        return key, 0.0 + cost.time_s, cost.busbw_bps

    def flush_tp(self) -> list[TallyAdds]:
        """Tally the TP collectives of every run of ops (:attr:`runs`): per run and step
        call, ``runs`` calls of its closed-form time (:meth:`tp_adds`, once per walk's runs in
        the shared tables; :meth:`add_tp`). Returns what it added."""
        runs = self.runs
        shape = tuple([(key, slot[1]) for key, slot in runs.items()])
        known = self.shared.flushes.get(shape)
        if known is None:
            held = [slot[0] for slot in runs.values()]  # their ids are in the shape
            known = self.shared.flushes[shape] = (held, self.tp_adds())
        runs.clear()
        self.add_tp(known[1])
        return known[1]

    def known_tp(self) -> list[TallyAdds] | None:
        """What a search's ZeRO-3 walk of this program added to the TP tallies, when this walk
        makes the same runs (``SharedWalk.zero3_tp``); None: it counts its own."""
        held = self.shared.zero3_tp
        if held is None:
            return None
        sch = self.schedule
        if held[0] is sch.stages and held[1] is sch.pipeline and held[2] is sch.paired:
            return held[4] if held[3] == tuple(self.programs) else None
        return None

    def add_tp(self, adds_of: list[TallyAdds]) -> None:
        """Add each tally's TP calls (:meth:`tp_adds`): a tally this adds to first is set to
        the sum at once."""
        tally_of = self.stats.tally
        for key, count, adds, total_s, busbw in adds_of:
            tally = tally_of(key)
            if tally.count == 0 and tally.time_s == 0.0:
                tally.time_s = total_s
            else:
                for add in adds:
                    tally.time_s += add
            tally.count += count
            tally.busbw_bps = busbw

    def tp_adds(self) -> list[TallyAdds]:
        """What :meth:`flush_tp` adds, per tally in the order the runs first reach it: each
        distinct call priced once, a step list's priced calls listed once per rank (the layers
        of a kind share their list)."""
        priced: dict[tuple[int, str, str, float], tuple[CallKey, float, float] | None] = {}
        listed = self.shared.tp_calls
        out: dict[CallKey, list[Any]] = {}
        for (rank, _), (segs, runs) in self.runs.items():
            for seg in segs:
                known = listed.get((rank, id(seg.steps)))
                if known is None or known[0] is not seg.steps:
                    hits = []
                    for step in (c for st in seg.steps for c in st.calls() if c.op):
                        shape = (rank, step.axis, step.op, step.size_bytes)  # what it reads
                        if shape in priced:
                            hit = priced[shape]
                        else:
                            hit = priced[shape] = self.tp_call(rank, step)
                        if hit is not None:
                            hits.append(hit)
                    known = listed[(rank, id(seg.steps))] = (seg.steps, hits)
                for key, time_s, busbw in known[1]:  # CallStats.add, count=runs
                    entry = out.get(key)
                    if entry is None:
                        entry = out[key] = [0, [], 0.0, 0.0]
                    entry[0] += runs
                    entry[1].append(runs * time_s)
                    entry[2] += runs * time_s
                    entry[3] = busbw
        return [(key, n, tuple(adds), total, busbw) for key, (n, adds, total, busbw) in out.items()]

    def tp_call(self, rank: int, step: Step) -> tuple[CallKey, float, float] | None:
        """(tally key, seconds, busbw) of a segment step's call, None on a group of one."""
        group = self.prices.step_group(rank, step)
        if len(group) < 2:
            return None
        cost = self.pricer.cost(step.op, step.size_bytes, group)
        key = CallKey(rank, step.axis, step.op, step.size_bytes, len(group), cost.algorithm)
        return key, cost.time_s, cost.busbw_bps

    def grad_window(self, rank: int, seg: Segment) -> tuple[float, float]:
        """(seconds before the segment's gradients start, seconds they take), once per step
        list (the layers of a kind share theirs, and a list is never changed in place)."""
        shape = (rank, id(seg.steps), seg.grad_from)
        hit = self._windows.get(shape)
        if hit is None:
            off = sum(self.step_s(rank, s) for s in seg.steps[: seg.grad_from])
            dur = sum(self.step_s(rank, s) for s in seg.steps[seg.grad_from :])
            hit = self._windows[shape] = (off, dur)
        return hit

    # ---- the walk -----------------------------------------------------------------------------
    def run(self) -> None:
        searched = self.rules.zero == 3 and self.shapes is not None  # variants may replay
        known_tp = None
        if searched:
            key = alike_key(self.plan)
            held = self.shared.alike
            if held is not None and held.key == key and replay_walk(self, held):
                return
            known_tp = self.known_tp()
            self.count_runs = known_tp is None
            self.loops = [] if self.rules.prefetch else None
            ops = sum(len(self.schedule.pipeline[p.coords.pp]) for p in self.programs.values())
            self.loop_limit = int(ops * RECORDED_LOOPS_SHARE)
        for prog in self.programs.values():
            st = self.rules.state_bytes(prog_stage := self.schedule.stages[prog.coords.pp])
            del prog_stage
            prog.ledger.alloc(0.0, "parameters", st.parameters, "parameters")
            prog.ledger.alloc(0.0, "gradients", st.gradients, "gradients")
            prog.ledger.alloc(0.0, "optimizer", st.optimizer, "optimizer state")
            prog.ledger.alloc(0.0, "buffers", st.ddp_buckets, "ddp buckets")
        if self.rules.zero != 3:
            walk_fused(self)
            pending = []
        else:
            pending = list(self.programs.values())
            self.wire()
        ops_of = {prog.rank: len(self.schedule.pipeline[prog.coords.pp]) for prog in pending}
        steppers = {prog.rank: self.advance(prog) for prog in pending}
        while pending:  # the ranks resumed round-robin, each running while its inputs are sent
            progressed = False
            for prog in pending:
                progressed |= next(steppers[prog.rank])
            left = [p for p in pending if p.next_op < ops_of[p.rank]]
            if left and not progressed:
                raise SimulationError(
                    f"ranks {[p.rank for p in left][:8]} wait for inputs never sent "
                    "(the pipeline order has a cycle)"
                )
            pending = left
        for prog in self.programs.values():
            self.add_settled(prog)
        self.add_settled_runs()
        self.finish()
        for prog in self.programs.values():
            self.record_messages(prog)
        if known_tp is not None:  # (nothing counted)
            self.add_tp(known_tp)
        else:
            adds = self.flush_tp()
            if searched:
                sch = self.schedule
                ranks = tuple(self.programs)
                self.shared.zero3_tp = (sch.stages, sch.pipeline, sch.paired, ranks, adds)
        if self.loops is not None:
            self.shared.alike = record_walk(self, key, self.loops)

    def links(self, stage: int) -> list[Link]:
        """:func:`~collsim.play.walk_tables.pipeline_links` of ``stage``: once per walk, and in
        a search once per pipeline shape (the stage's ops are those of its schedule, stage
        count, micro-batches and virtual stages; as :meth:`op_table`)."""
        hit = self._links.get(stage)
        if hit is None:
            if self.shapes is None:
                hit = pipeline_links(self.schedule, stage)
            else:
                hit = self.shapes.get(
                    "walk links",
                    self.pipeline_shape(stage),
                    lambda: pipeline_links(self.schedule, stage),
                )
            self._links[stage] = hit
        return hit

    def wire(self) -> None:
        """The walk's :attr:`wiring` (:func:`~collsim.play.walk_tables.pipeline_wiring`, in a
        search once per pipeline shape) and its empty mail lists."""

        def make() -> tuple[list[list[Wire]], int]:
            return pipeline_wiring([self.op_table(s)[0] for s in range(self.plan.pp)])

        if self.shapes is None:
            self.wiring, count = make()
        else:  # (stage -1: every stage's ops)
            self.wiring, count = self.shapes.get("walk wiring", self.pipeline_shape(-1), make)
        self.mail_produced = [0.0] * count
        self.mail_delivered = [None] * count

    def pipeline_shape(self, stage: int) -> tuple[str, int, int, int, int]:
        """What the stage's pipeline ops are made of: the schedule, the stage count, the
        micro-batches, the virtual stages and the stage."""
        plan = self.plan
        return (
            str(plan.parallel.schedule),
            plan.pp,
            plan.num_microbatches,
            plan.virtual_stages,
            stage,
        )

    def advance(self, prog: RankState) -> Iterator[bool]:
        """The rank's ops as a generator (ZeRO-3: segment by segment, or as one block when
        settled: :func:`~collsim.play.walk_zero3.settled_op`): each resume runs them while
        their inputs have been sent and yields whether any ran (its clock, stream and next op
        written back to ``prog`` first; its bubble and pp wait when it is done).

        An op runs as its settled block if every unit it reads is gathered and ready at its
        start: the clock adds the segments' seconds term by term (``reduce`` adds left to
        right), the account waits for :meth:`add_settled`, its pattern is placed at its start
        (:meth:`MemoryLedger.place`) and its TP runs counted (:meth:`add_settled_runs`). Its
        output goes out on the pp stream when it ends (priced once, :meth:`send_slot`), and
        is delivered when that stream reaches it. Messages are read and written by their
        numbers (:func:`~collsim.play.walk_tables.pipeline_wiring`) in the walk's mail lists.

        Stays long: the ZeRO-3 walk's loop over every op of every rank, its steps written in
        line (a call per op cost more than the op's own work)."""
        stage = prog.coords.pp
        ops = self.schedule.pipeline[stage]
        wires = self.wiring[stage]
        chunks = self.schedule.stages[stage].chunks
        paired_ops = self.schedule.paired.get(stage, ())
        blocks = self.stage_blocks(prog, stage, len(ops))
        fold = self.fold_price(prog.rank) if self.gather_pp else None
        mine: list[Any] = [None] * self.plan.pp  # the rank's sends by receiving stage
        table = self.op_table(stage)[0]
        mbs, op_chunks = table.microbatches, table.chunks
        produced_of, delivered_of = self.mail_produced, self.mail_delivered
        size = self.schedule.p2p_bytes
        breakdown = prog.breakdown_s
        events, placed = prog.ledger.appenders()
        recv_frees = self.received[prog.rank][0]
        last_mb = self.rules.num_microbatches - 1
        gathered, checked = prog.gathered, self._needs_met
        made = prog.gathers_made  # (only the segment loop changes it)
        settled, settled_runs = prog.settled, self._settled_runs
        counting = self.count_runs
        units: dict[tuple[int, str | int], float] | None = None  # (gathered: only loops change it)
        ran = False
        i, n = prog.next_op, len(ops)
        now, pp_free = prog.now, prog.pp_free  # (written back before anything reads them)
        bubble, pp_exposed = breakdown["bubble"], breakdown["pp_exposed"]  # (as those)
        while i < n:
            read, send, to = wires[i]
            if read >= 0:
                delivered_s = delivered_of[read]
                while delivered_s is None:  # its input is not sent yet: the next round
                    prog.next_op, prog.now, prog.pp_free = i, now, pp_free
                    yield ran
                    ran = False
                    delivered_s = delivered_of[read]
                if delivered_s > now:
                    produced_s = produced_of[read]
                    produced = min(max(produced_s, now), delivered_s)
                    bubble += produced - now
                    pp_exposed += delivered_s - produced
                    now = delivered_s
                if size:  # MemoryLedger.free (record_messages)
                    recv_frees.append(now)
                if fold is not None:
                    self.stats.add(*fold)
                    now += fold[1]
                    pp_exposed += fold[1]
            block = blocks[i]
            if block is None:  # once per op of the walk: settled or not (False)
                op = ops[i]
                last = op.microbatch < 0 or op.microbatch >= last_mb
                paired = i in paired_ops
                block = settled_op(self, prog, chunks[op.chunk], op.phase, paired, last) or False
                blocks[i] = block
            if block is not False:
                key = id(block)
                if checked.get(key) != made:
                    for unit in block.needs:
                        ready = gathered.get(unit)
                        if ready is None or ready > now:
                            block = False  # (this time: its units are not all there)
                            break
                    else:  # they stay ready (the clock only moves on) until the segments run
                        checked[key] = made
            if block is False:
                op = ops[i]
                prog.now, prog.pp_free = now, pp_free
                loops = self.loops
                if loops is None:
                    run_segments(self, prog, op, chunks[op.chunk], i in paired_ops)
                else:  # recorded for the variants that may replay this walk (walk_alike)
                    entry = (now, prog.dp_free, prog.dp_last_end)
                    first, issued = len(events), prog.gathers_issued
                    if units is None:  # (after that, what the rank's last loop left)
                        units = dict(gathered)
                    waits = run_segments(self, prog, op, chunks[op.chunk], i in paired_ops)
                    left = (prog.now, prog.dp_free, prog.dp_last_end)
                    held, units = units, dict(gathered)
                    loops.append(
                        LoopRecord(
                            prog.rank,
                            stage,
                            i,
                            entry,
                            held,
                            first,
                            left,
                            units,
                            len(events),
                            waits,
                            prog.gathers_issued - issued,
                        )
                    )
                    if len(loops) > self.loop_limit:  # too many to gain by a replay
                        self.loops = None
                now, made = prog.now, prog.gathers_made
            else:
                start = now
                now = reduce(add, block.steps, start)
                settled.append(block)  # its sums: add_settled
                if block.pattern is not None:  # MemoryLedger.place
                    placed.append((start, block.pattern, mbs[i], op_chunks[i], len(events)))
                if counting:
                    seen = settled_runs.get(key)
                    if seen is not None:  # its run keys are made: counted by add_settled_runs
                        seen[1] += 1
                    else:
                        self.first_settled_run(block)
            if send >= 0:  # its output sent on the pp stream
                slot = mine[to]
                if slot is None:
                    slot = mine[to] = self.send_slot(prog, to)
                t, busbw, tally, dst_allocs = slot
                tally.count += 1  # CallStats.add
                tally.time_s += t
                tally.busbw_bps = busbw
                pp_free = (now if now >= pp_free else pp_free) + t  # max(now, pp_free) + t
                delivered = now + (pp_free - now)  # fires(now, pp_free)
                produced_of[send] = now
                delivered_of[send] = delivered
                if size:  # MemoryLedger.alloc (record_messages)
                    dst_allocs.append(delivered)
            i += 1
            ran = True
        prog.next_op, prog.now, prog.pp_free = i, now, pp_free
        breakdown["bubble"], breakdown["pp_exposed"] = bubble, pp_exposed
        yield ran
        while True:
            yield False

    def stage_blocks(self, prog: RankState, stage: int, count: int) -> list[Any]:
        """Per op of the stage: its settled block, False when it has none, None until asked
        (the list the plan's variants share, ``SharedWalk.stage_blocks``; ``count`` ops)."""
        blocks = self._blocks.get(stage)
        if blocks is None:
            key = (prog.rank, *self.pipeline_shape(stage))
            blocks = self.shared.stage_blocks.get(key)
            if blocks is None:  # (the shape says the stage's ops, so their count too)
                blocks = self.shared.stage_blocks[key] = [None] * count
            self._blocks[stage] = blocks
        return blocks

    def first_settled_run(self, block: SettledOp) -> None:
        """Register the TP runs of a settled block's first run in the walk (its later runs
        are counted, and added by :meth:`add_settled_runs`)."""
        self._settled_runs[id(block)] = [block, 0]
        runs = self.runs
        for run_key, seg in block.runs:
            slot = runs.get(run_key)
            if slot is None:
                runs[run_key] = [[seg], 1]
            else:
                slot[1] += 1

    def add_settled(self, prog: RankState) -> None:
        """Add the sums of the settled blocks ``prog`` ran since the last call to its
        account (:data:`SETTLED_SUMS`): each key's terms one after another, in the order the
        blocks ran, as one ``np.add.accumulate`` (which adds left to right: the floats of
        adding each block's terms at once). Called before anything else adds to those keys
        (the segment loop) and at the end of the walk."""
        blocks = prog.settled
        if not blocks:
            return
        breakdown = prog.breakdown_s
        known = self.shared.settled_terms
        key = tuple(map(id, blocks))
        terms = known.get(key)
        if terms is None:
            if len(known) >= SETTLED_TERMS_KEPT:
                known.clear()
            terms = known[key] = np.concatenate([b.sums for b in blocks], axis=1)
        start = np.array([[breakdown[k]] for k in SETTLED_SUMS])
        # (a new array: the kept terms are never written, whoever else reads them)
        totals = np.add.accumulate(np.concatenate((start, terms), axis=1), axis=1)[:, -1]
        for k, total in zip(SETTLED_SUMS, totals.tolist(), strict=True):
            breakdown[k] = total
        blocks.clear()

    def add_settled_runs(self) -> None:
        """Count the repeated runs of each settled block in the walk's TP runs (a block's
        first run made its keys; the counts are whole numbers, added in any order)."""
        runs = self.runs
        for block, repeats in self._settled_runs.values():
            if repeats:
                for run_key, _ in block.runs:
                    runs[run_key][1] += repeats
        self._settled_runs.clear()

    def fold_price(self, rank: int) -> tuple[CallKey, float, float]:
        """(tally key, seconds, busbw) of the TP all-gather folded into each message the rank
        receives (without sequence parallelism), priced once per walk."""
        hit = self._fold.get(rank)
        if hit is None:
            size = self.schedule.p2p_bytes * self.plan.tp
            hit = self._fold[rank] = self.call_price(
                rank, TP, "all_gather", size, self.group(rank, TP)
            )
        return hit

    def op_table(self, stage: int) -> tuple[OpTable, Hashable]:
        """The stage's ops as arrays (:class:`OpTable`), once per pipeline shape in a
        search's shape cache, and that shape."""
        plan = self.plan
        ops_of, pairs_of = self.schedule.pipeline, self.schedule.paired
        mine = self.shared.op_tables.get(stage)  # (the variants share the pipeline's lists)
        if mine is not None and mine[0] is ops_of[stage] and mine[1] is pairs_of:
            return mine[2], mine[3]
        paired = frozenset(pairs_of.get(stage, ()))

        def make() -> OpTable:
            ops = self.schedule.pipeline[stage]
            return op_table(ops, self.links(stage), paired, plan.num_microbatches)

        key = (*self.pipeline_shape(stage), paired)
        if self.shapes is None:
            return make(), key
        table = self.shapes.get("walk ops", key, make)
        self.shared.op_tables[stage] = (ops_of[stage], pairs_of, table, key)
        return table, key

    def op_plans(
        self, prog: RankState, chunks: list[ChunkModel], keys: Sequence[tuple[int, Phase, bool]]
    ) -> list[OpPlan]:
        """The fused blocks of the rank's ops by (chunk, phase, paired) ``keys``: each one's
        body (:meth:`op_body`, shared by the plans that share its segments) and its buckets'
        reductions (their calls on the dp stream, a ZeRO-2 buffer held until they end), each
        ready at its offset in the op. Chunks alike in what the reductions read
        (:meth:`bucket_shape`, the body's :attr:`OpBody.shape`) share one tuple of them, made
        once in the shared tables."""
        rank = prog.rank
        known = self.shared.reductions
        holds = self.rules.holds_bucket_buffer
        out: list[OpPlan] = []
        for (c, _, _), body in zip(keys, self.rank_bodies(prog, chunks, keys), strict=True):
            chunk = chunks[c]
            if not (body.windows and chunk.buckets):
                out.append(body.plain)
                continue
            shape = chunk.bucket_shape
            alike = (rank, holds, body.shape, self.bucket_shape(chunk) if shape is None else shape)
            reductions = known.get(alike)
            if reductions is None:
                reductions = known[alike] = self.reductions(rank, chunk, body, holds)
            out.append(_new(OpPlan, (*body.plain[:-1], reductions)))  # (OpPlan's own fields)
        return out

    def rank_bodies(
        self, prog: RankState, chunks: list[ChunkModel], keys: Sequence[tuple[int, Phase, bool]]
    ) -> list[OpBody]:
        """The bodies (:meth:`op_body`) of the rank's ops by ``keys``, once per list of keys in
        the shared tables: the programs that share them share every chunk's segment lists
        (:meth:`shared_walk`), and the entry holds the lists it was made for (checked by
        identity, the first chunk's forward)."""
        hit = self.shared.rank_bodies.get(prog.rank)
        if hit is not None and hit.keys is keys and hit.forward is chunks[0].forward:
            return hit.bodies
        bodies = self.shared.bodies
        out = []
        for c, phase, paired in keys:
            chunk = chunks[c]
            segs = chunk.segments(phase, paired)
            key = (prog.rank, c, phase, paired)
            body = bodies.get(key)
            if body is None or body.segs is not segs:
                body = bodies[key] = self.op_body(prog.rank, segs, phase, chunk.layers.start)
            out.append(body)
        self.shared.rank_bodies[prog.rank] = RankBodies(
            keys=keys,
            forward=chunks[0].forward,
            bodies=out,
            patterns=[body.plain.pattern for body in out],
            comms=[body.plain.comm for body in out],
            durations=tuple([body.plain.duration for body in out]),
        )
        return out

    def block_lists(self, prog: RankState) -> tuple[list[MemoryPattern], list[dict[str, float]]]:
        """The patterns and the ``comm`` dicts of the rank's blocks (:meth:`op_plans` makes
        each block from its body's, so they are the bodies'), as lists kept with the bodies
        (:meth:`rank_bodies`): the same list objects for every variant, which the tables kept
        by them check by identity first."""
        hit = self.shared.rank_bodies[prog.rank]
        return hit.patterns, hit.comms

    def block_durations(self, prog: RankState) -> tuple[float, ...]:
        """The seconds of the rank's blocks (:meth:`op_plans` makes each block from its
        body, so its seconds are the body's), as a tuple kept with the bodies."""
        return self.shared.rank_bodies[prog.rank].durations

    def bucket_shape(self, chunk: ChunkModel) -> int:
        """What :meth:`reductions` reads of ``chunk``'s buckets (each one's elements, bytes,
        ready fraction, expert kind and ready segment, a layer's counted from the chunk's first
        layer) as a number, the same for alike buckets (once per walk per bucket list), for a
        chunk built without its :attr:`~collsim.step.ops.ChunkModel.bucket_shape` (an int:
        never equal to one, a tuple)."""
        buckets = chunk.buckets
        known = self._bucket_shapes.get(id(buckets))
        if known is None or known[0] is not buckets:
            start = chunk.layers.start
            shape = tuple(
                [
                    (
                        b.numel,
                        b.size_bytes,
                        b.ready_fraction,
                        b.expert,
                        _relative(b.ready_segment, start),
                    )
                    for b in buckets
                ]
            )
            numbers = self.shared.shape_numbers
            known = self._bucket_shapes[id(buckets)] = (
                buckets,
                numbers.setdefault(shape, len(numbers)),
            )
        return known[1]

    def reductions(
        self, rank: int, chunk: ChunkModel, body: OpBody, holds: bool
    ) -> tuple[Reduction, ...]:
        """The reductions of ``chunk``'s buckets in an op of ``body``: each bucket's calls
        (priced once by what they read of it), ready at its segment's start in the op plus
        the time before its gradients start and its ready fraction of their seconds, and the
        ZeRO-2 buffer it holds (``holds``)."""
        ready_at: dict[Any, list[Bucket]] = {}  # the buckets by the segment they wait for
        for bucket in chunk.buckets:
            ready_at.setdefault(bucket.ready_segment, []).append(bucket)
        priced = self.shared.bucket_calls
        reductions: list[Reduction] = []
        for seg_key, t, off, gdur in body.windows:
            for bucket in ready_at.get(seg_key, ()):
                calls = priced.get((rank, bucket.numel, bucket.expert))
                if calls is None:
                    calls = self.bucket_calls(rank, bucket)
                if calls:  # (rel: where in the op it is ready)
                    rel = t + off + bucket.ready_fraction * gdur
                    reductions.append((rel, calls, float(bucket.size_bytes) if holds else 0.0))
        return tuple(reductions)

    def op_body(self, rank: int, segs: list[Segment], phase: Phase, first_layer: int = 0) -> OpBody:
        """An op's segments run back to back: their seconds, account and activation events,
        and in a gradient phase where each segment's gradients are made (:meth:`grad_window`)."""
        forward = phase is Phase.FORWARD
        gradients = phase in GRADIENT_PHASES
        mem: list[tuple[float, float, str, str | int]] = []
        windows: list[tuple[str | int, float, float, float]] = []
        comm: dict[str, float] = {}
        prices = self.prices.seg_prices
        t = total_compute = total_tp = 0.0
        for seg in segs:
            _, seg_comm, d_tp, compute = prices(rank, seg)
            framework = seg.framework_s
            dur = compute + d_tp + framework
            total_compute += compute
            total_tp += d_tp
            for k, v in seg_comm.items():
                comm[k] = comm.get(k, 0.0) + v
            if framework:
                comm["framework"] = comm.get("framework", 0.0) + framework
            mem += seg.activation_events(t, t + dur, forward=forward)
            if gradients:
                windows.append((seg.key, t, *self.grad_window(rank, seg)))
            t += dur
        plain = OpPlan(
            segs,
            duration=t,
            compute=total_compute,
            tp=total_tp,
            comm=comm,
            pattern=MemoryPattern("activations", mem),
            comm_items=tuple(comm.items()),
            run_key=(rank, id(segs[0]) if len(segs) == 1 else id(segs)),
            reductions=(),
        )
        numbers = self.shared.shape_numbers
        shape = tuple([(_relative(k, first_layer), *rest) for k, *rest in windows])
        return OpBody(
            segs,
            windows=tuple(windows),
            plain=plain,
            shape=numbers.setdefault(("windows", shape), len(numbers)),
        )

    def bucket_calls(self, rank: int, bucket: Bucket) -> tuple[Priced, ...]:
        """The calls of ``bucket``'s reduction on the dp stream (:meth:`priced_calls`), priced
        once in the shared tables by what ``bucket_calls`` reads of it."""
        shape = (rank, bucket.numel, bucket.expert)
        calls = self.shared.bucket_calls.get(shape)
        if calls is None:
            calls = self.shared.bucket_calls[shape] = self.priced_calls(
                rank, self.rules.bucket_calls(bucket), 0.0
            )
        return calls

    def gather_prices(self, rank: int, stage: StageModel) -> list[Priced]:
        """ZeRO-1/2: the gathers of the updated parameters after the optimizer
        (:meth:`~collsim.step.dataparallel.DataParallelRules.gathers_after_optimizer`) as
        priced calls, each bucket's priced once in the shared tables by what its gathers read
        of it, and a chunk's once by its buckets' shape where it has one
        (:attr:`~collsim.step.ops.ChunkModel.bucket_shape`: alike buckets gather alike)."""
        rules = self.rules
        if not rules.gathers_after_step:
            return []
        by_chunk = self.shared.chunk_gathers
        out: list[Priced] = []
        for chunk in stage.chunks:
            shape = chunk.bucket_shape
            if shape is None:
                out += self.bucket_gathers(rank, chunk.buckets)
                continue
            priced = by_chunk.get((rank, shape))
            if priced is None:
                priced = by_chunk[(rank, shape)] = tuple(self.bucket_gathers(rank, chunk.buckets))
            out += priced
        return out

    def bucket_gathers(self, rank: int, buckets: Sequence[Bucket]) -> list[Priced]:
        """The priced gathers of ``buckets`` in order (:meth:`gather_prices`), each bucket's
        priced once in the shared tables by what its gathers read of it."""
        rules, memo = self.rules, self.shared.gather_prices
        out: list[Priced] = []
        for bucket in buckets:
            shape = (rank, bucket.numel, bucket.expert)
            priced = memo.get(shape)
            if priced is None:
                priced = memo[shape] = tuple(
                    self.dp_price(rank, c) for c in rules.bucket_gathers(bucket)
                )
            out += priced
        return out

    def dp_price(self, rank: int, call: DPCall) -> Priced:
        """One call on the rank's dp stream, on its axis's group: (seconds, busbw, tally key),
        priced once in the shared tables by what it reads."""
        memo = self.shared.call_prices
        shape = (rank, call.op, call.size_bytes, call.axis)
        hit = memo.get(shape)
        if hit is None:
            group = self.group(rank, call.axis)
            cost = self.pricer.cost(call.op, call.size_bytes, group)
            key = CallKey(rank, DP, call.op, call.size_bytes, len(group), cost.algorithm)
            hit = memo[shape] = (0.0 + cost.time_s, cost.busbw_bps, key)
        return hit

    def priced_calls(
        self, rank: int, calls: list[DPCall], extra_s: float
    ) -> tuple[tuple[float, float, CallKey], ...]:
        """The prices of ``calls`` on the rank's dp stream (:meth:`dp_price`), the offload
        copy ``extra_s`` added to the first."""
        out = [self.dp_price(rank, c) for c in calls]
        if extra_s and out:
            t, busbw, key = out[0]
            out[0] = (extra_s + t, busbw, key)
        return tuple(out)

    def run_priced(
        self,
        prog: RankState,
        calls: tuple[tuple[float, float, CallKey], ...] | list[Priced],
        ready: float,
        issued: float | None = None,
    ) -> float:
        """Calls priced by :meth:`priced_calls` one after another on the rank's dp stream,
        ready at ``ready`` and issued at ``issued`` (default ``ready``): when the last one's
        event fires (``ready`` when there is none).

        Each call starts at ``max(ready, dp_free)``: past the first, the stream is busy past
        ``ready`` (no call's seconds are negative), so the clock adds the seconds one after
        another, and the calls fire in order (``fires`` rounds monotonically): the last one's
        is the latest. A list with a negative term takes the call-by-call recurrence."""
        issued = ready if issued is None else issued
        if not calls:
            return ready
        if len(calls) > 1 and min(map(_SECONDS, calls)) < 0.0:
            return self._run_each(prog, calls, ready, issued)
        dp_free = prog.dp_free
        dp_free = ready if ready >= dp_free else dp_free  # max(ready, dp_free)
        stats = self.stats
        known = stats.tallies.get
        for t, busbw, key in calls:
            dp_free += t
            tally = known(key) or stats.tally(key)
            tally.count += 1
            tally.time_s += t
            tally.busbw_bps = busbw
        fired = issued + (dp_free - issued)  # fires(issued, dp_free)
        prog.dp_free = dp_free
        if fired > prog.dp_last_end:
            prog.dp_last_end = fired
        return fired

    def _run_each(
        self, prog: RankState, calls: Sequence[Priced], ready: float, issued: float
    ) -> float:
        """:meth:`run_priced` call by call: each at ``max(ready, dp_free)``, firing at
        ``fires(issued, its end)``."""
        fired = ready
        dp_free, dp_last = prog.dp_free, prog.dp_last_end
        stats = self.stats
        for t, busbw, key in calls:
            dp_free = (ready if ready >= dp_free else dp_free) + t  # max(ready, dp_free) + t
            fired = issued + (dp_free - issued)  # fires(issued, dp_free)
            if fired > dp_last:
                dp_last = fired
            stats.add(key, t, busbw)
        prog.dp_free, prog.dp_last_end = dp_free, dp_last
        return fired

    def run_reductions(
        self,
        prog: RankState,
        reductions: Sequence[Reduction],
        t0: float,
        *,
        deferred: bool = False,
    ) -> list[MemoryEvent]:
        """Bucket reductions (:meth:`op_plans`) one after another on the rank's dp stream,
        issued at ``t0`` and each ready at ``t0`` plus its offset in its op (``deferred``: at
        ``t0``, the step's end without overlap): returns the ZeRO-2 bucket buffers' events
        (held until the reduction ends), for the caller to record."""
        held: list[MemoryEvent] = []
        if deferred and not any(hold for _, _, hold in reductions):
            # all ready and issued at t0: one run of their calls, one after another
            self.run_priced(prog, [c for _, calls, _ in reductions for c in calls], t0, t0)
            return held
        new = tuple.__new__
        for rel, calls, hold in reductions:
            ready = t0 if deferred else t0 + rel
            fired = self.run_priced(prog, calls, ready, t0)
            if hold:
                held.append(new(MemoryEvent, (ready, "buffers", hold, BUFFER_LABEL)))
                held.append(new(MemoryEvent, (fired, "buffers", -hold, BUFFER_LABEL)))
        return held

    def run_overlapped(
        self, prog: RankState, ops: Sequence[tuple[float, Sequence[Reduction]]]
    ) -> tuple[list[int], list[MemoryEvent]]:
        """:meth:`run_reductions` of several ops one after another (op by op, each issued
        at its start ``t0``, overlapped; their tallies opened, :meth:`open_tallies`) in one
        loop: per op how many ZeRO-2 bucket buffer events it makes, and those events in
        order. The same floats as the op-by-op calls: the dp stream's clock call by call,
        each tally's seconds added one after another in call order at the end (no other
        call adds to this rank's tallies in between), its busbw its last call's."""
        dp_free, dp_last = prog.dp_free, prog.dp_last_end
        terms: dict[CallKey, list[Any]] = {}  # per tally: [last busbw, seconds, ...]
        held: list[MemoryEvent] = []
        counts: list[int] = []
        new = tuple.__new__
        for t0, reductions in ops:
            before = len(held)
            for rel, calls, hold in reductions:
                ready = fired = t0 + rel
                for t, busbw, key in calls:
                    dp_free = (ready if ready >= dp_free else dp_free) + t  # run_priced
                    fired = t0 + (dp_free - t0)  # fires(t0, dp_free)
                    if fired > dp_last:
                        dp_last = fired
                    entry = terms.get(key)
                    if entry is None:
                        terms[key] = [busbw, t]
                    else:
                        entry[0] = busbw
                        entry.append(t)
                if hold:
                    held.append(new(MemoryEvent, (ready, "buffers", hold, BUFFER_LABEL)))
                    held.append(new(MemoryEvent, (fired, "buffers", -hold, BUFFER_LABEL)))
            counts.append(len(held) - before)
        prog.dp_free, prog.dp_last_end = dp_free, dp_last
        known, tally_of = self.stats.tallies.get, self.stats.tally
        for key, entry in terms.items():
            tally = known(key) or tally_of(key)
            tally.count += len(entry) - 1
            tally.time_s = reduce(add, islice(entry, 1, None), tally.time_s)
            tally.busbw_bps = entry[0]
        return counts, held

    def open_tallies(self, reductions: Sequence[Reduction]) -> None:
        """Open the tallies of ``reductions``' calls in the order the calls use them (as
        :meth:`run_reductions` would on its way)."""
        known = self.shared.tally_keys.get(id(reductions))
        if known is None or known[0] is not reductions:
            keys = list(dict.fromkeys([key for _, calls, _ in reductions for _, _, key in calls]))
            known = self.shared.tally_keys[id(reductions)] = (reductions, keys)
        tallies, tally = self.stats.tallies, self.stats.tally
        for key in known[1]:  # (each tally first used by one of the calls, in that order)
            if key not in tallies:
                tally(key)

    def columns_of(self, reductions: Sequence[Reduction]) -> ReductionColumns:
        """:func:`reduction_arrays` of an op's reductions, once per program and its variants
        (by their identity: :attr:`SharedWalk.reduction_columns` holds them)."""
        kept = self.shared.reduction_columns
        known = kept.get(id(reductions))
        if known is None or known[0] is not reductions:
            known = kept[id(reductions)] = (
                reductions,
                reduction_arrays(reductions),
            )
        return known[1]

    def run_block_batch(
        self,
        prog: RankState,
        starts: Any,
        which: Any,
        reductions_of: Sequence[Sequence[Reduction]],
    ) -> tuple[Any, Any, Any]:
        """:meth:`run_reductions` of several ops one after another (op ``i`` issued at its
        start ``starts[i]``, overlapped, running the reductions ``reductions_of[which[i]]``;
        their tallies opened, :meth:`open_tallies`) as one queue over all their calls
        (:func:`~collsim.play.walk_tables.queue_ends`): per op how many ZeRO-2 bucket buffer
        events it makes, and the times and signed bytes of them all in order (arrays; the
        events :meth:`run_reductions` makes, without their category ``buffers`` and label
        :data:`~collsim.play.walk_pipe.BUFFER_LABEL`). The same floats as the op-by-op
        calls: each call ready at its op's ``t0`` plus its offset, each tally's seconds added
        one after another in call order (a cumulative sum is sequential), its busbw its last
        call's."""
        ops_of = np.bincount(which, minlength=len(reductions_of))  # each block's ops
        columns = {b: self.columns_of(reductions_of[b]) for b in np.flatnonzero(ops_of).tolist()}
        calls_of = np.zeros(len(reductions_of), dtype=np.intp)
        held_of = np.zeros(len(reductions_of), dtype=np.intp)
        for b, c in columns.items():
            calls_of[b] = len(c.seconds)
            held_of[b] = 0 if c.holds is None else len(c.holds[0])
        counts, holding = calls_of[which], held_of[which]
        first_call, first_held = np.cumsum(counts) - counts, np.cumsum(holding) - holding
        total, total_held = int(counts.sum()), int(holding.sum())
        ready, seconds = np.empty(total), np.empty(total)
        slots = np.empty(total, dtype=np.intp)  # per call: its tally, numbered in `keys`
        begins, sizes = np.empty(total_held), np.empty(total_held)
        last = np.empty(total_held, dtype=np.intp)  # each buffer's reduction's last call
        keys: dict[CallKey, int] = {}
        last_use: dict[int, tuple[int, float]] = {}  # per tally: (its last op, that busbw)
        by_block = np.argsort(which, kind="stable")  # each block's ops, in op order
        bounds = np.cumsum(ops_of)
        for b, c in columns.items():  # each block's calls, all its ops at once
            op = by_block[bounds[b] - ops_of[b] : bounds[b]]
            at = first_call[op][:, None] + np.arange(len(c.seconds))  # (op, call)
            ready[at] = starts[op][:, None] + c.call_rel  # t0 + offset, each
            seconds[at] = c.seconds  # (the rows broadcast)
            mine = np.array([keys.setdefault(k, len(keys)) for k in c.tally_keys], np.intp)
            slots[at] = mine[c.call_slots]
            end = int(op[-1])
            for slot, busbw in zip(mine.tolist(), c.tally_busbw, strict=True):
                if slot not in last_use or last_use[slot][0] < end:
                    last_use[slot] = (end, busbw)
            if c.holds is not None:
                held, size, _ = c.holds
                at = first_held[op][:, None] + np.arange(len(held))
                begins[at] = starts[op][:, None] + c.rel[held]
                last[at] = first_call[op][:, None] + c.last_call[held]
                sizes[at] = size
        ends = queue_ends(ready, seconds, prog.dp_free)
        issued = np.repeat(starts, counts)
        fired = issued + (ends - issued)  # fires(t0, end), element by element
        prog.dp_free = float(ends[-1])
        latest = float(fired.max())
        if latest > prog.dp_last_end:
            prog.dp_last_end = latest
        tallies = self.stats.tallies
        # each tally's seconds added to it one after another in call order: ``bincount``
        # adds each weight to its bin in index order (from zero, then the tally's seconds so
        # far, then its calls'), the floats of the call-by-call loop
        so_far_s = [tallies[key].time_s for key in keys]
        first = np.arange(len(keys))
        sums = np.bincount(
            np.concatenate((first, slots)), np.concatenate((so_far_s, seconds)), len(keys)
        ).tolist()
        calls = np.bincount(slots, minlength=len(keys)).tolist()
        for key, slot in keys.items():
            tally = tallies[key]
            tally.time_s = sums[slot]
            tally.count += calls[slot]
            tally.busbw_bps = last_use[slot][1]
        # the held buffers: each allocated when its reduction is ready, freed when it ends
        times, deltas = np.empty(2 * total_held), np.empty(2 * total_held)
        times[0::2], times[1::2] = begins, fired[last]
        deltas[0::2], deltas[1::2] = sizes, -sizes
        return 2 * holding, times, deltas

    def send_slot(self, prog: RankState, stage: int) -> tuple[Any, ...]:
        """What a send from ``prog`` to ``stage`` reads (:meth:`advance` asks once per walk,
        and opens its tally at the first send, as CallStats.add): its seconds, busbw, tally
        and the receiver's list of receive buffers allocated (:meth:`record_messages`)."""
        dst = self.by_stage[stage]
        size = self.schedule.p2p_bytes
        key, t, busbw = self.call_price(prog.rank, PP, "send_recv", size, (prog.rank, dst.rank))
        return (t, busbw, self.stats.tally(key), self.received[dst.rank][1])

    def record_messages(self, prog: RankState) -> None:
        """Record the rank's pipeline receive buffers (:attr:`received`: the schedule's
        ``p2p_bytes`` each, ``"buffers"``, ``"pp recv"``) in its ledger as one block of
        columns after its other single events (:meth:`MemoryLedger.add_block`): the frees,
        then the allocations. The peaks read events sorted by time, then signed size: only
        the order among events equal in both changes, which moves no running total and no
        category split at a peak (a peak never falls inside a run of equal allocations or
        equal frees). A walk receives about a thousand messages a rank, which would
        otherwise be as many event objects."""
        frees, allocs = self.received[prog.rank]
        if not frees and not allocs:
            return
        size = float(self.schedule.p2p_bytes)
        times = np.array(frees + allocs)
        deltas = np.full(len(times), size)
        deltas[: len(frees)] = -size
        cats = np.full(len(times), MEMORY_KEYS.index("buffers"), dtype=np.int8)
        prog.ledger.add_block(times, deltas, cats, ("pp recv",), np.zeros(len(times), np.intp))
        self.received[prog.rank] = ([], [])

    def grad_norm(self) -> None:
        """The clipping's norm all-reduces, as the engine plays them: the walked members of a
        group rendezvous (the early ones wait: ``bubble``), then the call (``dp_exposed``)."""
        for groups in norm_rounds(self.plan, list(self.programs)):
            for (axis, group), members in groups.items():
                progs = [self.programs[r] for r in members]
                start = max(prog.now for prog in progs)
                for prog in progs:
                    t = self.price(prog.rank, axis, "all_reduce", GRAD_NORM_BYTES, group, 0.0)
                    end = fires(start, start + t)
                    prog.breakdown_s["bubble"] += start - prog.now
                    prog.breakdown_s["dp_exposed"] += end - start
                    prog.now = end

    def finish(self) -> None:
        """Deferred buckets, the dp wait, the embedding sync, the gradient norm, the
        optimizer, ZeRO-1/2 gathers."""
        plan = self.plan
        for prog in self.programs.values():
            held = self.run_reductions(prog, prog.deferred, prog.now, deferred=True)
            if held:  # MemoryLedger.alloc, then .free, of each
                prog.ledger.appenders()[0].extend(held)
            prog.deferred = []
            if prog.dp_last_end > prog.now:
                prog.breakdown_s["dp_exposed"] += prog.dp_last_end - prog.now
                prog.now = prog.dp_last_end
        head = plan.head_stage
        if head != 0 and plan.spec.tied_embeddings:
            first, last = self.by_stage[0], self.by_stage[head]
            size = plan.spec.vocab / plan.tp * plan.spec.hidden * self.rules.bytes_per.grad
            pair = (first.rank, last.rank)
            t = self.pricer.cost("all_reduce", size, pair)
            for prog in (first, last):
                self.stats.add(
                    CallKey(prog.rank, PP, "all_reduce", size, 2, t.algorithm),
                    t.time_s,
                    t.busbw_bps,
                )
            end = max(first.now, last.now) + t.time_s
            for prog in (first, last):
                prog.breakdown_s["pp_exposed"] += end - prog.now
                prog.now = end
        links = dp_links(self.stats.items())  # (nothing below adds a dp call before the loop)
        for prog in self.programs.values():
            framework = self.schedule.framework_step_s.get(prog.coords.pp, 0.0)
            link, busbw = links.get(prog.rank, (0.0, 0.0))
            interference = self.schedule.interference_s(
                dp_link_s=link, busbw_bps=busbw, compute_s=prog.breakdown_s["compute"]
            )
            prog.now += framework + interference
            prog.breakdown_s["framework"] += framework
            prog.breakdown_s["interference"] += interference
        self.grad_norm()
        for prog in self.programs.values():
            stage = self.schedule.stages[prog.coords.pp]
            opt = self.schedule.optimizer_s[prog.coords.pp]
            prog.now += opt
            prog.breakdown_s["optimizer"] += opt
            calls = self.gather_prices(prog.rank, stage)
            if calls:
                t0 = prog.now
                end = self.run_priced(prog, calls, prog.now)
                prog.breakdown_s["dp_exposed"] += end - t0
                prog.now = end
            prog.end_s = prog.now


def _relative(segment: str | int, first_layer: int) -> str | int:
    """A segment key as :meth:`Walker.bucket_shape` counts it: a layer's from the chunk's
    first layer, a named one (embedding, head) as it is."""
    return segment - first_layer if type(segment) is int else segment
