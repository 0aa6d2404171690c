"""Lower bounds of a plan's step time and memory, cheap enough to order and prune a search.

The search (:mod:`collsim.study.search.loop`) estimates plans best-first by these floors and stops
when no floor left can beat the best kept; a bound that is not a bound would drop the best plan.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from collsim.parallel.config import ParallelConfig as Parallel
from collsim.parallel.pipeline import Phase, flow, get_schedule
from collsim.parallel.plan import default_order, grid_rank, rank_axes
from collsim.step.build import bytes_per
from collsim.step.pricing import ClosedPricer as Pricer
from collsim.study.search.program_floors import ProgramFloors
from collsim.study.search.space import Candidate, head_stage
from collsim.workload.compute import ComputeModel
from collsim.workload.interference import overlap_slowdown
from collsim.workload.memory import layer_parameters_per_rank, layers_per_stage, parameters_per_rank

if TYPE_CHECKING:  # pragma: no cover
    from collsim.cluster.topology import Topology
    from collsim.parallel.config import ParallelConfig, TrainingConfig
    from collsim.step.pricing import ClosedPricer
    from collsim.workload.model import TransformerSpec


class Bounds(ProgramFloors):
    """Cheap bounds of a candidate from the workload layer alone (no schedule).

    ``states_bytes``: the model states every rank holds for the whole step (ZeRO table; the
    schedule allocates them at time 0, so the peak is at least this). ``step_s``: the compute
    stream's own work on the busiest stage, m micro-batches x (layers x (forward + backward +
    recompute) + embedding / head), plus its optimizer step; the stream runs them one after
    another, so no plan's step is shorter (communication, bubble and waits only add).
    """

    def __init__(
        self,
        topology: Topology,
        spec: TransformerSpec,
        training: TrainingConfig,
        parallel: ParallelConfig | None = None,
    ):
        base = parallel if parallel is not None else Parallel()
        self.base = base
        self.etp = base.etp
        self.order = base.order or default_order()
        """The plans' rank layout (the scenario's ``parallel.order``): it places the dp
        groups whose calls the bound prices."""
        self.topology = topology
        self.spec = spec
        self.training = training
        self.per = bytes_per(training)
        self._models: dict[str, Any] = {}
        self._pricer: ClosedPricer | None = None
        self._step: dict[tuple[Any, ...], float] = {}
        self._dp: dict[tuple[Any, ...], tuple[list[float], list[float]]] = {}
        self._params: dict[tuple[int, int], list[float]] = {}
        self._acts: dict[tuple[Any, ...], float] = {}
        self._moe_states: dict[tuple[Any, ...], list[float]] = {}
        self._moe_comms: dict[tuple[Any, ...], tuple[float, float]] = {}
        self._refined: dict[tuple[Any, ...], float] = {}
        self._pipes: dict[tuple[Any, ...], list[float]] = {}
        self._init_program()

    def _stage_params(self, c: Candidate) -> list[float]:
        """Parameters per rank of the first and the last stage (the others hold fewer)."""

        key = (c.tp, c.pp)
        hit = self._params.get(key)
        if hit is None:
            hit = self._params[key] = [
                float(parameters_per_rank(self.spec, tp=c.tp, pp=c.pp, stage=s))
                for s in sorted({0, c.pp - 1})
            ]
        if c.pp > 1 and head_stage(c) != c.pp - 1:
            # a V: the head sits on the first stage; the last holds its layers only
            head = parameters_per_rank(self.spec, tp=c.tp, pp=c.pp, stage=c.pp - 1, stage_layers=[])
            return [hit[0], hit[1] - float(head)]
        return hit

    def _states(self, c: Candidate) -> list[float]:
        """Model-state bytes per rank of the first and the last stage (ZeRO table)."""
        if c.offload:
            return [0.0] * len(self._stage_params(c))  # the shards live in host memory
        n, per = float(c.dp * c.cp), self.per  # Megatron shards over the dp x cp ranks
        out = []
        for numel in self._stage_params(c):
            params = numel * per.param / (n if c.zero >= 3 else 1.0)
            grads = numel * per.grad / (n if c.zero >= 2 else 1.0)
            states = numel * per.optimizer / (n if c.zero >= 1 else 1.0)
            out.append(params + grads + states)
        return out

    def states_bytes(self, c: Candidate) -> float:
        return max(self._states(c)) * (1 - 1e-9)

    def memory_bytes(self, c: Candidate) -> float:
        """A lower bound on the peak: the model states plus the activations that are held at
        once. A stage keeps every layer's activations of a micro-batch from its forward to its
        backward; GPipe runs all m forwards first, 1F1B (Narayanan 2021, sec. 2.2) runs
        ``min(pp - s, m)`` forwards on stage s before its first backward, and interleaving
        runs more chunk forwards than that (warm-up ``2 (pp - s - 1) + (v - 1) pp`` chunks of
        ``layers / (pp v)``), so ``min(pp - s, m)`` stage-sets of activations is a floor for
        both. Transient buffers and gathered ZeRO-3 units only add."""
        key: tuple[Any, ...] = (c.tp, c.pp, c.dp, c.micro_batch, c.schedule, c.zero)
        key += (c.recompute, c.sequence_parallel, c.offload, c.reshard, c.cp, c.ep)
        key += (c.virtual_stages,)
        hit = self._acts.get(key)
        if hit is not None:
            return hit

        if self._programmed(c):
            hit = self._acts[key] = self._program_floor(c)
            return hit
        states = self._states(c)
        model = self._model()
        mb, sp = c.micro_batch, c.sequence_parallel and c.tp > 1
        per_layer = model.layer_times(
            self.spec,
            micro_batch=mb,
            tp=c.tp,
            sequence_parallel=sp,
            recompute=c.recompute,
            cp=c.cp,
        ).activation_bytes
        emb = head = 0.0  # with context parallelism: a floor without them
        if c.cp == 1:
            emb = model.embedding_times(
                self.spec, micro_batch=mb, tp=c.tp, sequence_parallel=sp
            ).activation_bytes
            head = model.head_times(
                self.spec, micro_batch=mb, tp=c.tp, sequence_parallel=sp
            ).activation_bytes
        counts = layers_per_stage(self.spec.num_layers, c.pp)
        m = self.training.global_batch // (mb * c.dp)
        gathered = 0.0
        if c.zero == 3 and not c.reshard and c.dp > 1:
            # kept after forward: every layer unit stays gathered until its backward (the
            # gather dtype may be fp8: one byte per element at least)
            unit = float(layer_parameters_per_rank(self.spec, c.tp))
            gathered = unit * min(self.per.param, 1.0)
        out = 0.0
        for state, s in zip(states, sorted({0, c.pp - 1}), strict=True):
            held = m if c.schedule == "gpipe" else min(c.pp - s, m)
            acts = counts[s] * per_layer + (emb if s == 0 else 0.0)
            acts += head if s == c.pp - 1 else 0.0
            out = max(out, state + held * acts + counts[s] * gathered)
        hit = self._acts[key] = out * (1 - 1e-9)
        return hit

    def _model(self) -> Any:
        # the kernels the schedule prices (collsim.step.build._blocks): attention kernel,
        # execution mode and fused kernels change every block's seconds, so the floor uses them
        tr = self.training
        dtype = str(tr.dtype)
        model = self._models.get(dtype)
        if model is None:
            model = self._models[dtype] = ComputeModel(
                self.topology.device,
                dtype,
                attention_kernel=tr.attention_kernel,
                execution=str(tr.execution),
                fused_kernels=bool(tr.fused_kernels),
            )
        return model

    def step_s(self, c: Candidate) -> float:
        """A lower bound on the step (seconds): the largest :meth:`stage_bounds`."""
        key: tuple[Any, ...] = (c.tp, c.pp, c.dp, c.micro_batch, c.schedule, c.virtual_stages)
        key += (c.zero, c.recompute, c.sequence_parallel, c.overlap, c.reshard, c.offload)
        key += (c.cp, c.ep)
        hit = self._step.get(key)
        if hit is None:
            hit = self._step[key] = max(self.stage_bounds(c)) * (1 - 1e-9)
        return hit

    def refined_s(self, c: Candidate) -> float:
        """A tighter lower bound (seconds): :meth:`stage_bounds` with the compute stream's
        end taken from a walk of the pipeline schedule itself (:meth:`_pipeline_ends`)."""
        key: tuple[Any, ...] = (c.tp, c.pp, c.dp, c.micro_batch, c.schedule, c.virtual_stages)
        key += (c.zero, c.recompute, c.sequence_parallel, c.overlap, c.reshard, c.offload)
        key += (c.cp, c.ep)
        hit = self._refined.get(key)
        if hit is None:
            stream = self._pipeline_ends(c)
            hit = self._refined[key] = max(self.stage_bounds(c, stream)) * (1 - 1e-9)
        return hit

    def _pipeline_ends(self, c: Candidate) -> list[float]:
        """When the first and the last stage finish their last op, walking the schedule's op
        order (:meth:`collsim.parallel.pipeline.PipelineSchedule.order`) with each op's own work
        (blocks and blocking TP collectives of its chunk, as in :meth:`_compute`), each op
        starting after the op before it on its stage and after the op whose output it reads
        (:meth:`~collsim.parallel.pipeline.PipelineSchedule.input_of`); sends take no time.
        Both fidelities run these ops in this order with these dependencies and more work, so
        they end later."""

        p = c.pp
        v = c.virtual_stages
        m = self.training.global_batch // (c.micro_batch * c.dp)
        fwd, bwd, emb, head = self._block_work(c)
        counts = layers_per_stage(self.spec.num_layers, p)
        key = (p, v, m, c.schedule, fwd, bwd, emb, head)
        hit = self._pipes.get(key)
        if hit is not None:
            return hit
        pipeline = get_schedule(c.schedule)
        durations = self._op_work(c, counts, pipeline)
        orders = [
            pipeline.order(num_stages=p, num_microbatches=m, stage=s, virtual_stages=v)
            for s in range(p)
        ]
        done: list[dict[Any, float]] = [{} for _ in range(p)]
        clock = [0.0] * p
        at = [0] * p
        remaining = sum(len(o) for o in orders)
        while remaining:
            moved = 0
            for s in range(p):
                order, mine = orders[s], done[s]
                i, now = at[s], clock[s]
                while i < len(order):
                    op = order[i]
                    src = pipeline.input_of(op, stage=s, num_stages=p, virtual_stages=v)
                    if src is not None:
                        ready = done[src[0]].get(src[1])
                        if ready is None:
                            break
                        now = max(now, ready)
                    now += durations[(s, op.phase, op.chunk)]
                    mine[op._replace(phase=flow(op.phase))] = now
                    i += 1
                moved += i - at[s]
                at[s], clock[s] = i, now
            if not moved:  # pragma: no cover - every schedule here is deadlock free
                raise RuntimeError(f"pipeline walk stalled for {c.label}")
            remaining -= moved
        hit = self._pipes[key] = [clock[s] for s in sorted({0, p - 1})]
        return hit

    def _op_work(
        self, c: Candidate, counts: list[int], pipeline: Any
    ) -> dict[tuple[int, Phase, int], float]:
        """Each (stage, phase, chunk) op's own work for :meth:`_pipeline_ends`: its share of
        the stage's layers, and the embedding or the head where the schedule places the first
        or the last model part; a split backward as its input-gradient part (the backward
        less the largest weight-gradient time) and its weight-gradient part (the smallest),
        each a floor of what the schedule builds (schedule.ops._split_backward)."""
        p, v = c.pp, c.virtual_stages
        fwd, bwd, emb, head = self._block_work(c)
        w_min, w_max, w_head = self._wgrad_work(c)
        out: dict[tuple[int, Phase, int], float] = {}
        for s in range(p):
            for k in range(v):
                part = pipeline.part_of(s, k, p, v)
                n = counts[s] / v
                first, last = part == 0, part == p * v - 1
                e = emb if first else (0.0, 0.0)
                h = head if last else (0.0, 0.0)
                hw = w_head if last else 0.0
                out[(s, Phase.FORWARD, k)] = n * fwd + e[0] + h[0]
                out[(s, Phase.BACKWARD, k)] = n * bwd + e[1] + h[1]
                out[(s, Phase.BACKWARD_INPUT, k)] = n * max(0.0, bwd - w_max) + max(0.0, h[1] - hw)
                out[(s, Phase.BACKWARD_WEIGHT, k)] = n * w_min + e[1] + min(hw, h[1])
        return out

    def _wgrad_work(self, c: Candidate) -> tuple[float, float, float]:
        """Weight-gradient seconds of one micro-batch: the smallest and the largest of a
        layer's kinds, and the head's (compute model, :attr:`LayerTimes.wgrad_s`; a plan
        read off its program: its parts')."""
        if self._programmed(c):
            plan = self._plan_of(c)
            if plan is None:
                return 0.0, 0.0, 0.0
            parts = self._parts_of(c, plan)
            low, high = parts.wgrad_range()
            return low, high, parts.head.wgrad_s
        model = self._model()
        spec, mb, sp = self.spec, c.micro_batch, c.sequence_parallel and c.tp > 1
        lt = model.layer_times(
            spec, micro_batch=mb, tp=c.tp, sequence_parallel=sp, recompute=c.recompute
        )
        ht = model.head_times(spec, micro_batch=mb, tp=c.tp, sequence_parallel=sp)
        return lt.wgrad_s, lt.wgrad_s, ht.wgrad_s

    def stage_bounds(self, c: Candidate, stream: list[float] | None = None) -> list[float]:
        """Per stage (the first and the last), a floor on when its rank ends the step.

        The rank's compute stream runs its work one piece after another (:meth:`_compute`),
        and its data-parallel calls one after another (:meth:`_dp_stage`); without overlap
        the last gradient reduction starts after the last backward. After the walk both
        fidelities add the interference of the overlapped data-parallel calls,
        ``min(dp link, compute) x (1 - 1/factor)`` (:meth:`StepSchedule.interference_s`),
        whose factor is at least its SM term ``(1 - m) / (1 - f_sm) + m`` (the HBM term only
        adds, :func:`collsim.workload.interference.overlap_slowdown`), then the optimizer
        step and ZeRO-1/2's all-gathers of the updated parameters. Without overlap every
        reduction waits for the end of the rank's whole backward (``launch_deferred``)."""
        floor, busy, share, opts = self._compute(c)
        stream = (
            floor if stream is None else [max(a, b) for a, b in zip(floor, stream, strict=True)]
        )
        before, after = self._dp_stage(c)
        serial = c.zero < 3 and not c.overlap
        interferes = c.dp > 1 and (c.zero == 3 or c.overlap)
        factor = 1.0
        busbw = self._busbw_floor(c) if interferes else 0.0
        if busbw > 0:
            # a bus bandwidth no higher than the walk's (its highest data-parallel call's)
            factor = overlap_slowdown(self.topology.device, busbw_bps=busbw,
                                      memory_bound_share=share)  # fmt: skip
        elif interferes:
            # the SM term alone: busbw -> 0+ leaves f_hbm -> 0 (formula above)
            device = self.topology.device
            sms = int(getattr(device, "sm_count", None) or 108)
            f_sm = min(0.9, max(0.0, getattr(device, "nccl_sms", 16) / sms))
            factor = (1.0 - share) / (1.0 - f_sm) + share
        out = []
        for i in range(len(stream)):
            walk = stream[i] + before[i] if serial else max(stream[i], before[i])
            interference = min(before[i], busy[i]) * (1.0 - 1.0 / factor) if interferes else 0.0
            out.append(walk + interference + opts[i] + after[i])
        return out

    def _reductions(self, c: Candidate) -> int:
        """Gradient reductions per step: ZeRO-2 reduces per micro-batch, ZeRO-0/1 once."""
        return self.training.global_batch // (c.micro_batch * c.dp) if c.zero == 2 else 1

    def dp_stream_s(self, c: Candidate) -> float:
        """The data-parallel stream's own work on the busiest stage (see :meth:`_dp_stage`)."""
        before, after = self._dp_stage(c)
        return max(b + a for b, a in zip(before, after, strict=True)) * (1 - 1e-9)

    def _dp_stage(self, c: Candidate) -> tuple[list[float], list[float]]:
        """Per stage (first, last): the data-parallel calls' seconds before the optimizer and
        after it. Every gradient reduction: one call of all the stage's gradients bounds the
        bucketed ones from below (a collective's closed form is latency plus bytes over
        bandwidth, sub-additive in the bytes); with ZeRO-3 every unit's gathers and
        reduce-scatters of every micro-batch; after the optimizer, ZeRO-1/2's all-gather of
        the updated parameters."""
        if self._programmed(c):
            program = self._program_dp(c)
            return program[0], program[1]
        params = self._stage_params(c)
        if c.dp < 2:
            return [0.0] * len(params), [0.0] * len(params)
        key = (c.tp, c.pp, c.dp, c.micro_batch, c.zero, c.reshard, c.offload)
        cached = self._dp.get(key)
        if cached is not None:
            return cached

        if self._pricer is None:
            self._pricer = Pricer(self.topology)
        per = self.per
        m = self.training.global_batch // (c.micro_batch * c.dp)
        cost = self._pricer.cost
        before: list[float] = []
        after: list[float] = []
        counts = layers_per_stage(self.spec.num_layers, c.pp)
        for numel, s in zip(params, sorted({0, c.pp - 1}), strict=True):
            group = self._dp_group(c, s)
            if c.zero == 3:
                unit = float(layer_parameters_per_rank(self.spec, c.tp))
                gathers = 2 if c.reshard else 1
                per_mb = counts[s] * (
                    gathers * cost("all_gather", unit * per.param, group).time_s
                    + cost("reduce_scatter", unit * per.grad, group).time_s
                )
                before.append(m * per_mb)
                after.append(0.0)
                continue
            op = "all_reduce" if c.zero == 0 else "reduce_scatter"
            before.append(self._reductions(c) * cost(op, numel * per.grad, group).time_s)
            gather = cost("all_gather", numel * per.param, group).time_s if c.zero else 0.0
            after.append(gather)
        self._dp[key] = (before, after)
        return before, after

    def _dp_group(self, c: Candidate, stage: int) -> tuple[int, ...]:
        """The data-parallel group of stage ``stage``'s first tp rank (the plan's mapping,
        :meth:`collsim.parallel.plan.Plan.rank`)."""

        axes = rank_axes(self.order, {"dp": c.dp, "pp": c.pp, "cp": c.cp, "tp": c.tp})
        return tuple(grid_rank(axes, {"dp": d, "pp": stage}) for d in range(c.dp))

    def _block_work(
        self, c: Candidate
    ) -> tuple[float, float, tuple[float, float], tuple[float, float]]:
        """Compute-stream seconds of one micro-batch: a layer's forward and backward (with
        recompute and the blocking TP collectives), the embedding's and the head's
        (forward, backward). :meth:`_wgrad_work` gives the weight-gradient parts. A plan read
        off its program (:meth:`_programmed`): the cheapest layer of its parts (every kind
        on every stage, its EP / CP collectives at their least exposed), 0 when no plan
        builds."""
        if self._programmed(c):
            plan = self._plan_of(c)
            if plan is None:
                return 0.0, 0.0, (0.0, 0.0), (0.0, 0.0)
            parts = self._parts_of(c, plan)
            low = parts.cheapest()
            e, h = parts.embedding, parts.head
            return (
                low.forward_s,
                low.backward_s,
                (e.forward_s, e.backward_s),
                (
                    h.forward_s,
                    h.backward_s,
                ),
            )
        model = self._model()
        spec, mb, sp = self.spec, c.micro_batch, c.sequence_parallel and c.tp > 1
        lt = model.layer_times(
            spec, micro_batch=mb, tp=c.tp, sequence_parallel=sp, recompute=c.recompute
        )
        et = model.embedding_times(spec, micro_batch=mb, tp=c.tp, sequence_parallel=sp)
        ht = model.head_times(spec, micro_batch=mb, tp=c.tp, sequence_parallel=sp)
        fwd = lt.forward_s + self._tp_s(c, 2)
        calls = 4 if c.recompute == "full" else 2
        bwd = lt.backward_s + lt.recompute_s + self._tp_s(c, calls)
        return fwd, bwd, (et.forward_s, et.backward_s), (ht.forward_s, ht.backward_s)

    def _compute(self, c: Candidate) -> tuple[list[float], list[float], float, list[float]]:
        """Per stage (first, last): the compute stream's own work (blocks and blocking TP
        collectives of every micro-batch, and for the last stage the pipeline fill and drain
        of the stages before it), the compute seconds alone, the memory-bound share of a
        layer, and the optimizer step."""

        model = self._model()
        spec, mb, sp = self.spec, c.micro_batch, c.sequence_parallel and c.tp > 1
        counts = layers_per_stage(spec.num_layers, c.pp)
        m = self.training.global_batch // (mb * c.dp)
        v = c.virtual_stages
        pipeline = get_schedule(c.schedule)
        head_at = head_stage(c)
        fwd, bwd, emb, head = self._block_work(c)
        sums = self._stage_sums(c) if self._programmed(c) else None
        if sums is not None:  # each stage's own layers, as its program prices them
            layer_s, share = 0.0, self._parts_of(c).memory_bound_share
        else:
            lt = model.layer_times(
                spec, micro_batch=mb, tp=c.tp, sequence_parallel=sp, recompute=c.recompute
            )
            layer_s = lt.forward_s + lt.backward_s + lt.recompute_s
            share = min(1.0, lt.memory_bound_s / layer_s) if layer_s > 0 else 0.0

        def work(s: int) -> tuple[float, float]:
            f, b = (counts[s] * fwd, counts[s] * bwd) if sums is None else sums[s][:2]
            if s == 0:
                f, b = f + emb[0], b + emb[1]
            if s == head_at:
                f, b = f + head[0], b + head[1]
            return f, b

        def busy(s: int) -> float:
            out: float = counts[s] * layer_s if sums is None else sums[s][2]
            out += emb[0] + emb[1] if s == 0 else 0.0
            out += head[0] + head[1] if s == head_at else 0.0
            return m * out

        stages = sorted({0, c.pp - 1})
        # with offload the step runs on the host, slower than this GPU floor
        optimizer = str(self.training.optimizer)
        implementation = str(self.training.optimizer_implementation)
        opts = [
            model.optimizer_time_s(n / (c.dp if c.zero >= 1 else 1), optimizer, implementation)
            for n in self._stage_params(c)
        ]
        if sums is not None:
            opts = [
                model.optimizer_time_s(n, optimizer, implementation) for n in self._program_dp(c)[2]
            ]
        # the last stage starts when the first micro-batch's first chunk has crossed the
        # stages before it (fill), and stage 0 ends after the last micro-batch's last backward
        # chunk has crossed them back (drain); a chunk is 1/v of a stage's layers
        last = c.pp - 1
        f_last, b_last = work(last)
        fill = sum(work(r)[0] for r in range(last)) / v
        drain = sum(work(r)[1] for r in range(last)) / v
        f0, b0 = work(0)
        if pipeline.splits_backward or head_at != last or (sums is not None and v > 1):
            # weight-gradient ops may run after the last stage's last backward, and a V
            # places the stages' chunks otherwise: each stage's own work only (the walk of
            # the schedule, :meth:`_pipeline_ends`, adds the fill and the drain); a program's
            # chunks of one stage may hold layers of other kinds (not 1/v of its work)
            fill = drain = 0.0
        stream = [max(m * (f0 + b0), fill + m * (f_last + b_last) + drain)]
        if last:
            stream.append(fill + m * (f_last + b_last))
        return stream, [busy(s) for s in stages], share, opts

    def _tp_s(self, c: Candidate, calls: int) -> float:
        """Blocking TP collectives of one layer's forward or backward (closed form)."""
        if c.tp < 2:
            return 0.0
        if self._pricer is None:
            self._pricer = Pricer(self.topology)
        size = float(
            c.micro_batch * (self.spec.seq_len // c.cp) * self.spec.hidden * self.per.activation
        )
        group = tuple(range(c.tp))
        if c.sequence_parallel:
            one = (
                self._pricer.cost("all_gather", size, group).time_s
                + self._pricer.cost("reduce_scatter", size, group).time_s
            )
        else:
            one = self._pricer.cost("all_reduce", size, group).time_s
        # the SP re-gathers in backward overlap their dgrad GEMMs: counted once per half
        return calls * one
