"""The floors of :class:`collsim.study.search.bounds.Bounds` as they are read off a plan's step
program: the model states its data-parallel rules count over its tensors, the activations its
schedule's order holds, each stage's compute stream from the program's parts placed by the
schedule (:mod:`collsim.study.search.parts`) and the data-parallel calls of the plan's own rules,
each kept per the knobs it depends on so that the plans of one search share them.
"""

from __future__ import annotations

import warnings
from typing import TYPE_CHECKING, Any

import numpy as np

from collsim.core.errors import ConfigError
from collsim.parallel.params import chunk_tensors
from collsim.parallel.pipeline import get_schedule
from collsim.parallel.plan import build_plan
from collsim.parallel.states import rank_model_states
from collsim.step.build import layer_kind_of
from collsim.step.dataparallel import DataParallelRules
from collsim.step.ops import ChunkModel, StageModel
from collsim.step.pricing import ClosedPricer
from collsim.step.stack_work import plan_framework_costs
from collsim.study.search.parts import (
    Layout,
    PlanParts,
    ProgramParts,
    chunk_kinds,
    held_counts,
    place,
)
from collsim.workload.compute import ComputeModel

if TYPE_CHECKING:  # pragma: no cover
    from collsim.cluster.topology import Topology
    from collsim.parallel.config import ParallelConfig, TrainingConfig
    from collsim.step.dataparallel import BytesPer
    from collsim.study.search.space import Candidate
    from collsim.workload.model import TransformerSpec

__all__ = ["ProgramFloors"]


class ProgramFloors:
    """The program-read floors of :class:`~collsim.study.search.bounds.Bounds` (a base class:
    the bounds set the attributes below and call :meth:`_init_program`)."""

    topology: Topology
    spec: TransformerSpec
    training: TrainingConfig
    base: ParallelConfig
    per: BytesPer
    _pricer: ClosedPricer | None

    def _init_program(self) -> None:
        self.program = ProgramParts()
        """The plans' step-program parts (shared by the bounds of every knob combination)."""
        self._layouts: dict[tuple[Any, ...], Layout | None] = {}
        self._program_dps: dict[tuple[Any, ...], tuple[list[float], ...]] = {}
        self._busbw: dict[tuple[Any, ...], list[float]] = {}
        self._frameworks: dict[tuple[Any, ...], list[float]] = {}
        self._fw_model: ComputeModel | None = None
        self._fw_costs: dict[tuple[Any, ...], Any] = {}
        self._units: dict[int, dict[float, int]] = {}
        self._mem_states: dict[tuple[Any, ...], np.ndarray] = {}
        self._mem_acts: dict[tuple[Any, ...], np.ndarray] = {}
        self._tensors: dict[tuple[Any, ...], StageModel] = {}
        self._numels: dict[tuple[Any, ...], dict[str, tuple[float, float]]] = {}
        self._groups: dict[tuple[Any, ...], tuple[int, ...]] = {}
        self._placements: dict[tuple[Any, ...], Any] = {}
        self._last_plan: tuple[Candidate | None, Any] = (None, None)
        self._one_kind = len(set(layer_kind_of(self.spec).values())) == 1

    def _floor_stages(self, c: Candidate) -> list[int]:
        """The stages whose memory :meth:`_program_floor` reads (a floor over some stages is
        a floor of the fullest): with one layer kind, the first (the embedding, and the most
        micro-batches in flight in a one-way pipeline) and the last (the head); with several
        kinds, every stage (a stage of other kinds may be the fullest)."""
        return sorted({0, c.pp - 1}) if self._one_kind else list(range(c.pp))

    def _busbw_floor(self, c: Candidate) -> float:
        """A bus bandwidth at or below the highest of the plan's data-parallel calls (a
        ZeRO-3 plan's layer-unit gather, :meth:`_unit_busbw`, on its least stage); 0 when
        unknown."""
        if c.zero != 3:
            return 0.0
        self._program_dp(c)
        return min(self._busbw.get(self._dp_key(c)) or [0.0])

    def _program_floor(self, c: Candidate) -> float:
        """The memory floor of a plan read off its step program: per stage, the model states
        as the stage builder allocates them for the whole step (the program's data-parallel
        rules over its tensors: dense states over the dp x cp shard group, routed experts
        over the expert data-parallel one, the FP8 weight copies, the DDP buckets; none with
        offload, whose shards live in host memory; ZeRO-3's parameters kept gathered from
        forward to backward, :func:`collsim.parallel.states.rank_model_states`) plus the
        activations its schedule holds at the end of a forward op (:func:`held_counts` of
        the chunks' kept activations, :attr:`Layout.stored_bytes`). The fullest stage bounds
        the peak; 0 when no plan builds."""
        states = self._states_of(c)
        acts = self._acts_of(c)
        if states is None or acts is None:
            return 0.0
        return float(np.max(states + acts)) * (1 - 1e-9)

    def _states_of(self, c: Candidate) -> np.ndarray | None:
        """Per stage, the model states :meth:`_program_floor` counts; None when no plan
        builds."""
        kept = c.zero == 3 and not c.reshard and c.dp > 1
        fp8 = str(self.training.dtype) == "fp8"
        key: tuple[Any, ...] = (c.tp, c.cp, c.pp, c.dp, c.ep, c.etp, c.zero, c.offload, kept)
        key += (fp8, c.schedule, c.virtual_stages, c.dtype, c.shard_group, c.bucket_view)
        hit = self._mem_states.get(key)
        if hit is not None or key in self._mem_states:
            return hit
        plan = self._plan_of(c)
        if plan is None:
            self._mem_states[key] = None  # type: ignore[assignment]
            return None
        rules = DataParallelRules.from_plan(
            plan, self.per, host_bps=float(self.topology.host_bandwidth_bps)
        )
        states = []
        for s in self._floor_stages(c):
            sb = rules.state_bytes(self._stage_tensors(plan, s))
            state = sb.parameters + sb.gradients + sb.optimizer + sb.ddp_buckets
            if kept:
                # gathered for the step (with offload, on the GPU as well: at least the
                # gathered parameters less the shard the rules count)
                state += rank_model_states(plan, s).kept_gathered_bytes
            states.append(state)
        hit = self._mem_states[key] = np.array(states)
        return hit

    def _acts_of(self, c: Candidate) -> np.ndarray | None:
        """Per stage, the largest activations its schedule holds at once (see
        :meth:`_program_floor`); None when no plan builds."""
        key = self._layout_key(c)
        hit = self._mem_acts.get(key)
        if hit is not None or key in self._mem_acts:
            return hit
        layout = self._layout(c)
        if layout is None:
            self._mem_acts[key] = None  # type: ignore[assignment]
            return None
        m = self.training.global_batch // (c.micro_batch * c.dp)
        acts = []
        for s in self._floor_stages(c):
            counts = held_counts(c.schedule, pp=c.pp, m=m, v=c.virtual_stages, stage=s)
            acts.append(float(np.max(counts @ np.array(layout.stored_bytes[s]))))
        hit = self._mem_acts[key] = np.array(acts)
        return hit

    def _parts_key(self, c: Candidate) -> tuple[Any, ...]:
        """The knobs a plan's segments depend on: not the data-parallel knobs (but the ZeRO
        stage of an FP8 plan, whose weight casts it sets) nor the schedule."""
        fp8 = str(self.training.dtype) == "fp8"
        key: tuple[Any, ...] = (c.tp, c.cp, c.pp, c.dp, c.ep, c.etp, c.micro_batch, c.recompute)
        key += (c.sequence_parallel, c.dispatcher, c.ep_overlap, c.cp_algorithm, c.dtype)
        return key + (c.zero if fp8 else None, id(self.training), id(self.base))

    def _layout_key(self, c: Candidate) -> tuple[Any, ...]:
        return self._parts_key(c) + (c.schedule, c.virtual_stages)

    def _parts_of(self, c: Candidate, plan: Any = None) -> PlanParts:
        """The step-program parts of ``c``'s plan (:class:`ProgramParts`), shared by the plans
        of one :meth:`_parts_key`."""
        key = self._parts_key(c)
        hit = self.program._parts.get(key)
        if hit is not None:
            return hit
        if plan is None:
            plan = self._plan_of(c)
        return self.program.of(plan, key)

    def _layout(self, c: Candidate) -> Layout | None:
        """The parts of ``c``'s plan placed by its schedule (:func:`place`); None when no
        plan builds."""
        key = self._layout_key(c)
        if key in self._layouts:
            return self._layouts[key]
        plan = self._plan_of(c)
        if plan is None:
            self._layouts[key] = None
            return None
        wkey = (c.pp, c.virtual_stages, c.schedule)
        where = self._placements.get(wkey)
        if where is None:
            where = self._placements[wkey] = chunk_kinds(plan)
        hit = self._layouts[key] = place(self._parts_of(c, plan), where)
        return hit

    def _dp_key(self, c: Candidate) -> tuple[Any, ...]:
        key: tuple[Any, ...] = (c.tp, c.cp, c.pp, c.dp, c.ep, c.etp, c.micro_batch, c.zero)
        return key + (c.reshard, c.offload, c.schedule, c.virtual_stages)

    def _program_dp(self, c: Candidate) -> tuple[list[float], list[float], list[float]]:
        """Per stage (first, last): the data-parallel calls' seconds before the optimizer and
        after it, and the parameters its optimizer steps, from the plan's own data-parallel
        rules (:class:`collsim.step.dataparallel.DataParallelRules`: their groups, shard
        sizes and calls; dense and routed-expert parameters apart). Each kind's reduction as
        one call of all the stage's gradients (bucketed calls cost more: a collective's
        closed form is sub-additive in the bytes); ZeRO-2 reduces every micro-batch, ZeRO-0/1
        once; ZeRO-1/2 gather the updated parameters after the optimizer. ZeRO-3: the stage's
        layer units gathered once per micro-batch (once per step when they stay gathered:
        kept after forward and gradients synced once per step) and reduced once per
        micro-batch (once per step when synced once), and gathered again in every whole
        backward when resharded after forward; the embedding and the head left out. Zeros
        when no plan builds."""
        key = self._dp_key(c)
        hit = self._program_dps.get(key)
        if hit is not None:
            return hit[0], hit[1], hit[2]
        stages = sorted({0, c.pp - 1})
        plan = self._plan_of(c)
        zeros = [0.0] * len(stages)
        if plan is None:
            self._program_dps[key] = (zeros, zeros, zeros)
            return zeros, zeros, zeros
        if self._pricer is None:
            self._pricer = ClosedPricer(self.topology)
        rules = DataParallelRules.from_plan(
            plan, self.per, host_bps=float(self.topology.host_bandwidth_bps)
        )
        m = plan.num_microbatches
        before: list[float] = []
        after: list[float] = []
        local: list[float] = []
        busbw: list[float] = []
        pricer = self._pricer
        for s in stages:
            rank = plan.rank(dp=0, pp=s, tp=0)

            def price(calls: list[Any], r: int = rank) -> float:
                return float(
                    sum(pricer.cost(x.op, x.size_bytes, self._group(plan, r, x.axis)).time_s
                        for x in calls)
                )  # fmt: skip

            numel = self._stage_numel(plan, s)
            n, n_e = rules.shard_sizes
            dense, expert = numel["all"]
            local.append(dense / n + expert / n_e if c.zero >= 1 else dense + expert)
            if c.zero == 3:
                busbw.append(self._unit_busbw(plan, s, rules, rank))
                dense_l, expert_l = numel["layers"]
                gathers = price(rules.gather_calls(dense_l, expert=False))
                gathers += price(rules.gather_calls(expert_l, expert=True))
                reduces = price(rules.reduce_calls(dense_l, expert=False, shard=True))
                reduces += price(rules.reduce_calls(expert_l, expert=True, shard=True))
                once = rules.sync_once
                # a unit is gathered where it is not held: in every forward unless a
                # backward kept it (synced once: only the first); resharded after forward,
                # again in every whole backward (DataParallelRules.releases)
                times = 1 if once else m
                if c.reshard and not get_schedule(c.schedule).splits_backward:
                    times += m
                before.append(times * gathers + (1 if once else m) * reduces)
                after.append(0.0)
                continue
            times = m if c.zero == 2 else 1
            if rules.any_group < 2:
                before.append(0.0)
            else:
                reduce = price(rules.reduce_calls(dense, expert=False, shard=c.zero >= 1))
                reduce += price(rules.reduce_calls(expert, expert=True, shard=c.zero >= 1))
                before.append(times * reduce)
            gather = 0.0
            if c.zero in (1, 2):
                gather = price(rules.gather_calls(dense, expert=False))
                gather += price(rules.gather_calls(expert, expert=True))
            after.append(gather)
        self._program_dps[key] = (before, after, local)
        self._busbw[key] = busbw
        self._frameworks[key] = [self._framework_s(plan, s, rules) for s in stages]
        return before, after, local

    def _framework_floor(self, c: Candidate) -> list[float]:
        """Per stage (first, last), the training stack's own work on the compute stream
        (:meth:`_framework_s`); zeros when no plan builds."""
        self._program_dp(c)
        return self._frameworks.get(self._dp_key(c)) or [0.0] * len(sorted({0, c.pp - 1}))

    def _framework_s(self, plan: Any, stage: int, rules: DataParallelRules) -> float:
        """The stack's own work the program puts on ``stage``'s compute stream
        (:func:`collsim.step.stack_work.framework_work` over
        :func:`collsim.workload.framework.framework_costs`): the per-step part (the
        gradient-norm pass of the clipping, the host time of a step) and, under ZeRO-3 with
        data parallelism, each layer unit's copy-in / copy-out where it is gathered (every
        forward unless gathered once per step, again in backward when resharded) and its
        gradient cast and copy-out where it is reduced (every micro-batch, or once); the
        root unit (embedding, head) left out."""
        par = plan.parallel
        model = self._framework_model()
        numel = self._stage_numel(plan, stage)["all"]
        local = sum(numel) / (plan.dp if par.zero >= 1 else 1)

        def costs(unit: float) -> Any:
            key = (unit, local, plan.dp, par.zero)
            hit = self._fw_costs.get(key)
            if hit is not None:
                return hit
            hit = self._fw_costs[key] = plan_framework_costs(model, plan, unit, local)
            return hit

        whole = costs(0.0)
        out = float(whole.grad_clip_s + whole.host_step_s)
        if par.zero != 3 or plan.dp < 2:
            return out
        m = plan.num_microbatches
        once = rules.sync_once
        gather_once = once and not rules.reshard_after_forward
        tensors = self._stage_tensors(plan, stage)
        units = self._units.get(id(tensors))
        if units is None:  # the layer units' sizes, and how many of each (per stage shape)
            units = self._units[id(tensors)] = {}
            for chunk in tensors.chunks:
                for i in chunk.layers:
                    unit = rules.unit_numel(chunk, i)
                    units[unit] = units.get(unit, 0) + 1
        for unit, count in units.items():
            fw = costs(unit)
            gather = fw.fsdp_copy_in_s + fw.fsdp_copy_out_s
            grad = fw.fsdp_grad_cast_s + fw.fsdp_grad_copy_out_s
            per_mb = (0.0 if gather_once else gather) + (0.0 if once else grad)
            per_mb += gather if rules.reshard_after_forward else 0.0
            per_step = (gather if gather_once else 0.0) + (grad if once else 0.0)
            out += count * (m * per_mb + per_step)
        return float(out)

    def _framework_model(self) -> ComputeModel:
        """The compute model the program prices the stack's work with (its device, dtype and
        kernel settings)."""
        model = self._fw_model
        if model is None:
            tr = self.training
            model = self._fw_model = ComputeModel(
                self.topology.device,
                str(tr.dtype),
                attention_kernel=tr.attention_kernel,
                execution=str(tr.execution),
                fused_kernels=bool(tr.fused_kernels),
            )
        return model

    def _unit_busbw(self, plan: Any, stage: int, rules: DataParallelRules, rank: int) -> float:
        """The bus bandwidth of one call the stage's rank makes under ZeRO-3: the gathers of
        the stage's first layer unit (its dense part, then its routed experts, as
        :meth:`DataParallelRules.unit_gathers`); the highest of them (the walk's interference
        takes the highest of all its data-parallel calls, so this is no more). 0 when
        none."""
        layers = plan.stage_layers(stage)
        if not layers:
            return 0.0
        # the first chunk that holds a layer (an embedding-only chunk holds none)
        chunk = next(c for c in self._stage_tensors(plan, stage).chunks if len(c.layers))
        first = [t for t in chunk.tensors if t.segment == chunk.layers.start]
        dense = sum(t.numel for t in first if not t.expert)
        expert = sum(t.numel for t in first if t.expert)
        calls = rules.gather_calls(dense, expert=False) + rules.gather_calls(expert, expert=True)
        assert self._pricer is not None
        return max(
            (
                self._pricer.cost(x.op, x.size_bytes, plan.group_of(rank, x.axis)).busbw_bps
                for x in calls
            ),
            default=0.0,
        )

    def _stage_tensors(self, plan: Any, stage: int) -> StageModel:
        """A stage's chunks with the parameter tensors its program gives them
        (:func:`collsim.parallel.params.chunk_tensors`, as :func:`collsim.step.ops.build_stage`
        places the embedding and the head) and no segments; kept per shape (the model and the
        layer split are the search's)."""
        key: tuple[Any, ...] = (plan.tp, plan.pp, plan.ep, plan.etp, plan.virtual_stages)
        key += (plan.head_stage,)
        key += (str(plan.parallel.schedule), stage)
        hit = self._tensors.get(key)
        if hit is not None:
            return hit
        v = plan.virtual_stages
        pp = plan.pp if plan.head_stage != 0 else 1  # a tied head on the embedding's stage
        chunks = []
        for k in range(v):
            part = plan.pipeline_schedule.part_of(stage, k, plan.pp, v)
            layers = plan.chunk_layers(stage, k)
            tensors = chunk_tensors(
                self.spec,
                layers,
                tp=plan.tp,
                first=part == 0,
                last=part == plan.pp * v - 1,
                pp=pp,
                ep=plan.ep,
                etp=plan.etp,
            )
            chunks.append(ChunkModel(k, layers, tensors, [], []))
        hit = self._tensors[key] = StageModel(stage, chunks)
        return hit

    def _group(self, plan: Any, rank: int, axis: Any) -> tuple[int, ...]:
        """``plan.group_of(rank, axis)``, kept per grid (the rank order is the search's)."""
        key: tuple[Any, ...] = (plan.tp, plan.cp, plan.pp, plan.dp, plan.ep, plan.etp)
        key += (plan.parallel.fsdp.shard_group_size, rank, axis)
        hit = self._groups.get(key)
        if hit is None:
            hit = self._groups[key] = plan.group_of(rank, axis)
        return hit

    def _stage_numel(self, plan: Any, stage: int) -> dict[str, tuple[float, float]]:
        """A stage's parameters on one rank (dense, routed experts): all of them, and its
        layers' alone (:meth:`_stage_tensors`)."""
        key: tuple[Any, ...] = (plan.tp, plan.pp, plan.ep, plan.etp, plan.virtual_stages)
        key += (plan.head_stage, str(plan.parallel.schedule), stage)
        hit = self._numels.get(key)
        if hit is None:
            hit = self._numels[key] = self._count_numel(plan, stage)
        return hit

    def _count_numel(self, plan: Any, stage: int) -> dict[str, tuple[float, float]]:
        dense = expert = dense_l = expert_l = 0.0
        for chunk in self._stage_tensors(plan, stage).chunks:
            for t in chunk.tensors:
                layer = isinstance(t.segment, int)
                if t.expert:
                    expert += t.numel
                    expert_l += t.numel if layer else 0.0
                else:
                    dense += t.numel
                    dense_l += t.numel if layer else 0.0
        return {"all": (dense, expert), "layers": (dense_l, expert_l)}

    def _plan_states(self, c: Candidate) -> list[float]:
        """The model states per stage as the stage builder allocates them
        (:func:`collsim.parallel.states.rank_model_states`); empty when no plan builds or the
        states live in host memory (offload)."""
        plan = None if c.offload else self._plan_of(c)
        return (
            []
            if plan is None
            else [rank_model_states(plan, s).states.total for s in range(plan.pp)]
        )

    def _plan_of(self, c: Candidate) -> Any:
        """The checked plan of ``c`` (``collsim.parallel.plan.Plan``; its warnings
        silenced), or None when it does not build; the last one is kept (the memory and the
        step floors of a plan ask for it in turn)."""
        last, plan = self._last_plan
        if last is c:
            return plan
        try:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                plan = build_plan(self.topology, self.spec, *c.configs(self.training, self.base))
        except ConfigError:
            plan = None
        self._last_plan = (c, plan)
        return plan
