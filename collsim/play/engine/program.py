"""The program of one simulated rank: its compute stream as a SimPy process.

The compute stream runs the stage's pipeline schedule op by op. An op starts when the stream is
free and its input has arrived (the activation of the previous stage, or the gradient of the
next); it then runs its segments (embedding, layers, head). Communication runs on other streams
(:class:`~collsim.play.engine.streams.GroupStream`): a pipeline send on the rank's pp stream after
each
op; DDP / ZeRO-1/2 gradient buckets on the dp stream, launched at the moment their last gradient
is produced in backward (torch reducer); ZeRO-3 / FSDP all-gathers issued ``prefetch`` units
ahead, reduce-scatters after each unit's backward. Overlap is what falls out.

Fused ops ("simulate few, stand for many"): when tensor-parallel collectives are priced in closed
form (nothing else shares their links), an op's segments are one timeout whose length is the sum
of its compute and blocking TP collectives; layer-level facts (when each layer ends, when each
bucket is ready, when activations are allocated and freed) are derived from the same durations.
ZeRO-3 ops always run segment by segment (compute waits on each gathered unit), and the layer
fidelity runs every step (compute pieces and TP collectives) as its own event.

Time accounting of the compute stream (it is never idle without a reason): compute, TP
collectives (tp_exposed), waits on a pipeline input split into bubble (before the producer
finished its op) and pp_exposed (after: the transfer), waits on DP traffic (dp_exposed), and the
optimizer step.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import simpy

from collsim.parallel.fsdp import issue_schedule
from collsim.parallel.pipeline import GRADIENT_PHASES, Phase, PipeOp
from collsim.play.engine.streams import Mail
from collsim.step.dataparallel import GRAD_NORM_BYTES, grad_norm_groups
from collsim.step.memory import MemoryLedger, MemoryPattern
from collsim.step.ops import BUFFER_FREE_KIND, BUFFER_KIND, ChunkModel, Segment, StageModel
from collsim.step.pricing import EXPOSED_KEY

if TYPE_CHECKING:
    from collsim.play.engine.core import Engine, PipeRoute

__all__ = ["Mail", "RankProgram"]


@dataclass(slots=True)
class _OpPlan:
    """One fused op: total, compute and TP seconds; memory events and bucket launches
    relative to the op's start."""

    segs: list[Segment]
    duration: float = 0.0
    compute: float = 0.0
    tp: float = 0.0
    comm: dict[str, float] = field(default_factory=dict)
    """Exposed collective seconds by breakdown key (tp_exposed, ep_exposed, cp_exposed)."""
    pattern: MemoryPattern = field(default_factory=lambda: MemoryPattern("activations", []))
    """The op's activation events relative to its start, placed at each run's start."""
    buckets: list[tuple[Any, float]] = field(default_factory=list)
    runs: int = 0
    """How many times the op ran (its collectives go to the engine's statistics at the end:
    :meth:`RankProgram._account_fused`)."""


class RankProgram:
    """One simulated rank. The :class:`~collsim.play.engine.core.Engine` wires the streams."""

    def __init__(self, engine: Engine, rank: int, stage: StageModel, ops: list[PipeOp]) -> None:
        self.engine = engine
        self.env: simpy.Environment = engine.env
        self.rank = rank
        self.coords = engine.plan.coords(rank)
        self.stage = stage
        self.ops = ops
        self.ledger = MemoryLedger(rank)
        self.breakdown_s = dict.fromkeys(
            (
                "compute",
                "tp_exposed",
                "pp_exposed",
                "dp_exposed",
                "ep_exposed",
                "cp_exposed",
                "bubble",
                "framework",
                "interference",
                "optimizer",
            ),
            0.0,
        )
        self.dp_events: list[simpy.Event] = []
        self.dp_done_s = 0.0
        """When the last reserved data-parallel call ends (:meth:`DataParallel.reserve`)."""
        self.end_s = 0.0
        self.deferred: list[Any] = []
        self._plans: dict[tuple[int, Phase, bool], _OpPlan] = {}
        self._tp_traced: dict[Any, list[Any]] = {}

    # ---- helpers ----------------------------------------------------------------------------
    def _trace(self, stream: str, name: str, start: float, end: float, **args: Any) -> None:
        if self.engine.trace_on:
            self.engine.add_trace(self.rank, stream, name, start, end, args)

    def _seg_tp_s(self, seg: Segment) -> float:
        return self.engine.seg_tp_s(self.rank, seg)

    def _seg_duration(self, seg: Segment) -> float:
        return seg.compute_s + self._seg_tp_s(seg) + seg.framework_s

    def _grad_window(self, seg: Segment) -> tuple[float, float]:
        """(offset, duration) of the gradient-producing steps of a backward segment."""
        pre = seg.steps[: seg.grad_from]
        post = seg.steps[seg.grad_from :]
        step_s, rank = self.engine.step_s, self.rank
        off = sum(step_s(rank, s) for s in pre)
        dur = sum(step_s(rank, s) for s in post)
        return off, dur

    def _trace_tp(self, segs: list[Segment], t0: float, cache_key: Any = None) -> None:
        """TP collectives priced inside fused segments, as slices on the tp stream."""
        slices = self._tp_traced.get(cache_key) if cache_key is not None else None
        if slices is None:
            slices = self.engine.tp_slices(self.rank, segs)
            if cache_key is not None:
                self._tp_traced[cache_key] = slices
        add = self.engine.add_trace
        for start, end, name, args, axis in slices:
            add(self.rank, axis, name, t0 + start, t0 + end, args)

    # ---- the process ------------------------------------------------------------------------
    def run(self) -> Any:
        """The rank's SimPy process: its ops in pipeline order, then the step's end.

        Stays long: one generator on the engine's hot path (every op of every rank passes
        here); each ``yield from`` helper split out would add a generator frame per op.
        """
        engine, env = self.engine, self.env
        engine.dp.allocate_states(self)
        breakdown_s = self.breakdown_s
        by_segment = engine.zero == 3 or engine.layer_mode
        syncs = engine.dp.rules.syncs_each_backward
        chunks = self.stage.chunks
        paired_ops = engine.schedule.paired.get(self.stage.stage, frozenset())
        inboxes, outboxes = engine.routes(self)
        folded_s = 0.0  # closed-form pipeline gathers, in pp_exposed
        gather = None if by_segment or engine.trace_on else engine.pp_gather_cost(self)
        if gather is not None:
            yield from self._play_fused(inboxes, outboxes, gather)
        else:
            for index, op in enumerate(self.ops):
                paired = index in paired_ops
                mail = inboxes[index]
                if mail is not None:  # wait for the previous / next stage's output
                    if not mail.processed:
                        w0 = env.now
                        yield mail
                        w1 = env.now
                        produced = min(max(mail.produced_s, w0), w1)
                        breakdown_s["bubble"] += produced - w0
                        breakdown_s["pp_exposed"] += w1 - produced
                    self.ledger.free(env.now, "buffers", mail.size_bytes, "pp recv")
                    # the receiving TP group assembles the message (Megatron's scatter/gather):
                    # in closed form folded into a fused op's timeout, else on the tp stream
                    folded = None if by_segment else engine.pp_gather_s(self, op)
                    if folded is None:
                        gathering = engine.pp_gather(self, op)
                        if gathering is not None:
                            t0 = env.now
                            yield gathering
                            breakdown_s["pp_exposed"] += env.now - t0
                        folded = 0.0
                else:
                    folded = 0.0
                chunk = chunks[op.chunk]
                start = env.now + folded
                issued = len(self.dp_events)
                if by_segment:
                    yield from self._run_segments(op, chunk, paired)
                else:
                    plan = self._plans.get((op.chunk, op.phase, paired)) or self._op_plan(
                        chunk, op.phase, paired
                    )
                    self._fused_facts(op, chunk, plan, start)
                    yield env.timeout(folded + plan.duration)
                    folded_s += folded
                if engine.trace_on:
                    self._trace(
                        "compute",
                        f"{op.phase.value} mb{op.microbatch} c{op.chunk}",
                        start,
                        env.now,
                        microbatch=op.microbatch,
                        chunk=op.chunk,
                    )
                if syncs and len(self.dp_events) > issued:
                    yield from self._drain_reductions(issued)
                route = outboxes[index]
                if route is not None:
                    engine.send_output(self, op, route)
            self._account_fused(folded_s)
        engine.dp.launch_deferred(self)
        # wait for every gradient reduction, then the optimizer step
        pending = [ev for ev in self.dp_events if not ev.processed]
        if pending or self.dp_done_s > env.now:
            t0 = env.now
            if pending:
                yield env.all_of(pending)
            if self.dp_done_s > env.now:
                yield env.timeout(self.dp_done_s - env.now)
            self.breakdown_s["dp_exposed"] += env.now - t0
        sync = engine.dp.embedding_sync(self)
        if sync is not None:
            t0 = env.now
            yield sync
            self.breakdown_s["pp_exposed"] += env.now - t0
        framework = engine.framework_step_s(self.rank)
        interference = engine.interference_s(self)
        if framework + interference > 0:
            yield env.timeout(framework + interference)
            self.breakdown_s["framework"] += framework
            self.breakdown_s["interference"] += interference
        # the clipping's global norm: every model-parallel rank waits for the others
        for axis, group in grad_norm_groups(engine.plan, self.rank):
            t0 = env.now
            record = yield engine.call(
                self.rank,
                axis,
                "all_reduce",
                GRAD_NORM_BYTES,
                group,
                "all_reduce grad norm",
                peers=[],
                stream_group=group,
            )
            self.breakdown_s["bubble"] += record.start_s - t0
            self.breakdown_s["dp_exposed"] += env.now - record.start_s
        t0 = env.now
        yield env.timeout(engine.optimizer_s(self.rank))
        self.breakdown_s["optimizer"] += env.now - t0
        if engine.trace_on:
            self._trace("compute", "optimizer", t0, env.now)
        last = engine.dp.after_optimizer(self)
        if last is not None:
            t0 = env.now
            yield env.timeout(last - t0) if isinstance(last, float) else last
            self.breakdown_s["dp_exposed"] += env.now - t0
        self.end_s = env.now

    # ---- fused: one timeout per op ---------------------------------------------------------
    def _play_fused(
        self,
        inboxes: list[Mail | None],
        outboxes: list[PipeRoute | None],
        gather: tuple[float, Any, float],
    ) -> Any:
        """The ops of :meth:`run` when they are fused, untraced and their pipeline gathers
        priced in closed form (``gather``: :meth:`Engine.pp_gather_cost`): what ``run`` does op
        by op, with each op's plan, mailbox and route looked up once."""
        engine, env, breakdown_s = self.engine, self.env, self.breakdown_s
        chunks = self.stage.chunks
        paired_ops = engine.schedule.paired.get(self.stage.stage, frozenset())
        plans = [
            self._plans.get((op.chunk, op.phase, i in paired_ops))
            or self._op_plan(chunks[op.chunk], op.phase, i in paired_ops)
            for i, op in enumerate(self.ops)
        ]
        gather_s, gather_key, gather_busbw = gather
        rules = engine.dp.rules
        buckets_on, syncs = rules.uses_buckets, rules.syncs_each_backward
        free, place = self.ledger.free, self.ledger.place
        timeout, send = env.timeout, engine.send_output
        received = 0
        for op, mail, plan, route in zip(self.ops, inboxes, plans, outboxes):
            folded = 0.0
            if mail is not None:  # wait for the previous / next stage's output
                if not mail.processed:
                    w0 = env.now
                    yield mail
                    w1 = env.now
                    produced = min(max(mail.produced_s, w0), w1)
                    breakdown_s["bubble"] += produced - w0
                    breakdown_s["pp_exposed"] += w1 - produced
                free(env.now, "buffers", mail.size_bytes, "pp recv")
                folded = gather_s
                received += 1
            start = env.now + folded
            place(start, plan.pattern, op.microbatch, op.chunk)
            issued = len(self.dp_events)
            if plan.buckets and buckets_on and rules.reduces_in(op.microbatch):
                for bucket, rel in plan.buckets:
                    engine.dp.launch_bucket(self, op, chunks[op.chunk], bucket, start + rel)
            plan.runs += 1
            yield timeout(folded + plan.duration)
            if syncs and len(self.dp_events) > issued:
                yield from self._drain_reductions(issued)
            if route is not None:
                send(self, op, route)
        if gather_key is not None and received:
            engine.tally(gather_key, received * gather_s, gather_busbw, count=received)
        self._account_fused(received * gather_s)

    def _drain_reductions(self, first: int) -> Any:
        """The end of a backward that reduced under ZeRO-2 with overlap
        (:attr:`~collsim.step.dataparallel.DataParallelRules.syncs_each_backward`): wait
        for the reductions it issued (``self.dp_events[first:]``; those of earlier ops were
        waited for at their end), exposed on the dp account."""
        pending = [ev for ev in self.dp_events[first:] if not ev.processed]
        if pending:
            t0 = self.env.now
            yield self.env.all_of(pending)
            self.breakdown_s["dp_exposed"] += self.env.now - t0

    def _account_fused(self, folded_s: float) -> None:
        """The fused ops' seconds by breakdown key (runs x each op's parts), the pipeline
        gathers folded into their timeouts, and the ops' runs counted for the engine's
        statistics of their collectives."""
        breakdown_s = self.breakdown_s
        breakdown_s["pp_exposed"] += folded_s
        for plan in self._plans.values():
            runs = plan.runs
            if not runs:
                continue
            self.engine.count_op(self.rank, plan, runs=runs)
            breakdown_s["compute"] += runs * plan.compute
            for k, v in plan.comm.items():
                breakdown_s[k] += runs * v

    def _op_plan(self, chunk: ChunkModel, phase: Phase, paired: bool = False) -> _OpPlan:
        """Durations and relative times of one (chunk, phase) op, computed once per rank
        (``paired``: a steady-state op under EP overlap)."""
        key = (chunk.index, phase, paired)
        plan = self._plans.get(key)
        if plan is not None:
            return plan
        forward = phase is Phase.FORWARD
        gradients = phase in GRADIENT_PHASES
        segs = chunk.segments(phase, paired)
        plan = _OpPlan(segs=segs)
        mem: list[tuple[float, float, str, str | int]] = []
        t = 0.0
        for seg in segs:
            d_tp = self._seg_tp_s(seg)
            dur = seg.compute_s + d_tp + seg.framework_s
            plan.compute += seg.compute_s
            plan.tp += d_tp
            for k, v in self.engine.seg_comm_s(self.rank, seg).items():
                plan.comm[k] = plan.comm.get(k, 0.0) + v
            if seg.framework_s:
                plan.comm["framework"] = plan.comm.get("framework", 0.0) + seg.framework_s
            mem += seg.activation_events(t, t + dur, forward=forward)
            if gradients:
                off, gdur = self._grad_window(seg)
                for bucket in chunk.buckets:
                    if bucket.ready_segment == seg.key:
                        plan.buckets.append((bucket, t + off + bucket.ready_fraction * gdur))
            t += dur
        plan.duration = t
        plan.pattern = MemoryPattern("activations", mem)
        self._plans[key] = plan
        return plan

    def _fused_facts(self, op: PipeOp, chunk: ChunkModel, plan: _OpPlan, t0: float) -> None:
        """Memory events and bucket launches of a fused op starting at ``t0`` (now or later)."""
        engine = self.engine
        mb, c = op.microbatch, op.chunk
        self.ledger.place(t0, plan.pattern, mb, c)
        if plan.buckets and engine.dp.rules.uses_buckets and engine.dp.rules.reduces_in(mb):
            for bucket, rel in plan.buckets:
                engine.dp.launch_bucket(self, op, chunk, bucket, t0 + rel)
        plan.runs += 1
        if engine.trace_on:
            self._trace_tp(plan.segs, t0, (c, op.phase, id(plan.segs)))

    def _segment_start(self, op: PipeOp, chunk: ChunkModel, seg: Segment) -> None:
        """At a segment's start: rebuilt activations, and DP launches at their ready times
        (planned from the segment's closed-form durations)."""
        start = self.env.now
        if seg.buffer_bytes:
            label = (BUFFER_KIND, seg.key, op.microbatch, op.chunk)
            self.ledger.alloc(start, "activations", seg.buffer_bytes, label)
        if op.phase is Phase.FORWARD:
            return
        self.ledger.alloc(
            start,
            "activations",
            seg.transient_bytes,
            ("recompute", seg.key, op.microbatch, op.chunk),
        )
        rules = self.engine.dp.rules
        if rules.uses_buckets and rules.reduces_in(op.microbatch) and op.phase in GRADIENT_PHASES:
            off, gdur = self._grad_window(seg)
            for bucket in chunk.buckets:
                if bucket.ready_segment == seg.key:
                    self.engine.dp.launch_bucket(
                        self, op, chunk, bucket, start + off + bucket.ready_fraction * gdur
                    )

    def _segment_end(self, op: PipeOp, seg: Segment) -> None:
        """At a segment's end: keep its activations (forward) or free them (backward)."""
        label = (seg.key, op.microbatch, op.chunk)
        if seg.buffer_bytes:
            free = (BUFFER_FREE_KIND, *label)
            self.ledger.free(self.env.now, "activations", seg.buffer_bytes, free)
        if op.phase is Phase.FORWARD:
            self.ledger.alloc(self.env.now, "activations", seg.stored_bytes, ("act",) + label)
        elif seg.frees:
            self.ledger.free(
                self.env.now,
                "activations",
                seg.transient_bytes + seg.stored_bytes,
                ("free",) + label,
            )

    # ---- segment by segment (ZeRO-3 units, layer fidelity) ---------------------------------
    def _run_segments(self, op: PipeOp, chunk: ChunkModel, paired: bool = False) -> Any:
        env, engine = self.env, self.engine
        segs = chunk.segments(op.phase, paired)
        # ZeRO-3: every op but a weight-gradient one gathers its units (dB needs no weight)
        gathers = engine.zero == 3 and op.phase is not Phase.BACKWARD_WEIGHT
        issue = issue_schedule(len(segs), engine.prefetch) if gathers else None
        for i, seg in enumerate(segs):
            if issue is not None:
                for j in issue[i]:
                    engine.dp.gather_unit(self, op, chunk, segs[j])
                ev = engine.dp.unit_ready(self, chunk, seg)
                if ev is not None and not ev.processed:
                    t0 = env.now
                    yield ev
                    self.breakdown_s["dp_exposed"] += env.now - t0
            start = env.now
            self._segment_start(op, chunk, seg)
            if engine.layer_mode:
                for step in seg.steps:
                    t0 = env.now
                    if step.op and step.overlap_s:  # the collective beside its compute
                        factor = engine.prices.overlap_factor(self.rank, step)
                        if factor > 1.0:  # slowed while the collective runs (step_s)
                            yield engine.step_call(self, step)
                            t_c = env.now - t0
                            rest = step.overlap_s - t_c / factor
                            if rest > 0:
                                yield env.timeout(rest)
                            plain = max(t_c, step.overlap_s)
                            self.breakdown_s["interference"] += env.now - t0 - plain
                            exposed = plain - step.overlap_s
                        else:
                            yield env.all_of(
                                [engine.step_call(self, step), env.timeout(step.overlap_s)]
                            )
                            exposed = env.now - t0 - step.overlap_s
                        self.breakdown_s["compute"] += step.overlap_s
                        self.breakdown_s[EXPOSED_KEY[step.axis]] += exposed
                    elif step.op:
                        yield engine.step_call(self, step)
                        self.breakdown_s[EXPOSED_KEY[step.axis]] += env.now - t0
                    else:
                        yield env.timeout(step.seconds)
                        self.breakdown_s["compute"] += step.seconds
                if seg.framework_s:
                    yield env.timeout(seg.framework_s)
                    self.breakdown_s["framework"] += seg.framework_s
            else:
                dur = self._seg_duration(seg)
                engine.count_op(self.rank, seg)
                if engine.trace_on:
                    self._trace_tp([seg], start, (op.chunk, op.phase, id(seg)))
                yield env.timeout(dur)
                self.breakdown_s["compute"] += seg.compute_s
                self.breakdown_s["framework"] += seg.framework_s
                for k, v in self.engine.seg_comm_s(self.rank, seg).items():
                    self.breakdown_s[k] += v
            self._segment_end(op, seg)
            if self.engine.trace_on:
                self._trace(
                    "compute",
                    f"{op.phase.value} mb{op.microbatch} {seg.key}",
                    start,
                    env.now,
                    microbatch=op.microbatch,
                    chunk=op.chunk,
                    segment=seg.key,
                )
            if engine.zero == 3:
                engine.dp.release_unit(self, op, chunk, seg)
