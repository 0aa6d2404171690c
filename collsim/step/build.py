"""The step schedule: built once per plan, played by the engine and walked by the closed form.

:func:`build_schedule` turns (topology, model, training, parallel) into a
:class:`StepSchedule`: per symmetry class (a pipeline stage; every TP rank and DP replica of a
stage runs the same program) the typed operations a rank runs, as data:

- ``stages[s]``: the stage's model chunks, each a list of forward and backward segments
  (embedding, layers, head) whose steps are compute (seconds, from the workload's compute
  model) or blocking tensor-parallel collectives (op, bytes, what compute they overlap);
  the chunk's parameter tensors, DDP buckets (ready at a fraction of a backward segment) and
  FSDP units (:mod:`collsim.step.stage`);
- ``pipeline[s]``: the order of (phase, micro-batch, chunk) ops on the stage's compute stream
  (the plan's :class:`~collsim.parallel.pipeline.PipelineSchedule`); an op waits for its input
  from the stage its schedule's placement names (:meth:`PipelineSchedule.input_of`);
- ``dp``: the data-parallel rules (:class:`~collsim.step.dataparallel.DataParallelRules`):
  which collectives each micro-batch's backward issues, when, and what memory they hold;
- ``optimizer_s[s]``, ``p2p_bytes``: the optimizer step of the stage and the pipeline message.

Both fidelities read only this object: the SimPy engine plays it on streams with shared links
(:mod:`collsim.play.engine`), the closed form walks it with the same rules and closed-form
collective costs (:mod:`collsim.play.walk`). On an uncontended network they agree (a test).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field, fields, replace
from operator import attrgetter
from types import MappingProxyType
from typing import TYPE_CHECKING, Any

from collsim.core.vocab import Dtype
from collsim.parallel.config import FSDPConfig, ParallelConfig, TrainingConfig
from collsim.parallel.dispatch import dispatch_sms_of
from collsim.parallel.layer_comms import layer_comms
from collsim.parallel.pipeline import PipeOp
from collsim.parallel.plan import Plan, build_plan, dp_variant_plan
from collsim.parallel.states import optimizer_state_bytes
from collsim.step.blocks import block_times, memory_bound_share, paced
from collsim.step.dataparallel import BytesPer, DataParallelRules
from collsim.step.fp8_amax import chunk_amax
from collsim.step.ops import BlockTimes, ChunkModel, Segment, StageModel
from collsim.step.shapes import IdentityMemo, ShapeCache, same_objects
from collsim.step.stack_work import framework_work, stage_optimizer_s, stage_weight_cast_s
from collsim.step.stage import LayerKinds, build_stage, rebucket_stage
from collsim.workload.compute import ComputeModel
from collsim.workload.interference import overlap_slowdown
from collsim.workload.kernels import slowest_gpu_factor
from collsim.workload.ops import activation_element_bytes

if TYPE_CHECKING:
    from collsim.cluster.topology import Topology
    from collsim.parallel.layer_comms import LayerComm
    from collsim.workload.model import TransformerSpec

__all__ = [
    "StepSchedule",
    "build_schedule",
    "bytes_per",
    "ddp_variant",
    "same_but_dp_knobs",
    "without_dp_knobs",
    "plan_blocks",
    "layer_kind_of",
]


@dataclass(frozen=True, slots=True, kw_only=True)
class StepSchedule:
    """What every simulated rank of one step runs (see the module docstring)."""

    plan: Plan
    stages: dict[int, StageModel]
    """Per pipeline stage: chunks, segments, tensors, buckets, units."""
    pipeline: dict[int, tuple[PipeOp, ...]]
    """Per pipeline stage: the ops of its compute stream, in order."""
    dp: DataParallelRules
    optimizer_s: dict[int, float]
    """Per pipeline stage: seconds of the optimizer step (on the CPU with offload)."""
    p2p_bytes: float
    """One pipeline message per TP rank: b s h / (t cp) activations (Megatron's
    scatter-gather; each CP rank sends its part of the sequence)."""
    layer: BlockTimes
    """The most common layer kind (see ``layers`` for each kind)."""
    embedding: BlockTimes
    head: BlockTimes
    compute: ComputeModel
    layers: dict[int, BlockTimes] | None = None
    framework_step_s: dict[int, float] = field(default_factory=dict)
    """Per pipeline stage: framework work once per step before the optimizer (gradient-norm
    pass, host time)."""
    interference: bool = False
    """Collectives overlap compute in this plan (ZeRO-3, or overlapped DDP buckets), so the
    compute they overlap runs slower (:meth:`interference_s`)."""
    memory_bound_share: float = 0.0
    """Share of a layer's compute time in memory-bound kernels (for the HBM part of the
    interference)."""
    step_interference: bool = False
    """Compute beside an overlapped segment step (a sequence-parallel re-gather beside its
    dgrad GEMM, a context-parallel KV send beside an attention block, an all-to-all beside
    its EP-overlap piece) runs slower while that collective runs (:meth:`overlap_factor`;
    off when measured op times stand in for the compute)."""
    paired: dict[int, frozenset[int]] = field(default_factory=dict)
    """Per pipeline stage, with ``parallel.ep_overlap``: indices into ``pipeline[s]`` of the
    ops that run their chunk's paired segments (:func:`collsim.parallel.pipeline.paired_ops`)."""

    def segments(self, stage: int, index: int, chunk: ChunkModel) -> list[Segment]:
        """The segments the ``index``-th op of ``stage``'s pipeline runs on ``chunk``."""
        op = self.pipeline[stage][index]
        paired = index in self.paired.get(stage, ())
        return chunk.segments(op.phase, paired)

    def overlap_factor(
        self, op: str, busbw_bps: float, axis: str = "tp", sms: int | None = None
    ) -> float:
        """Factor on the compute beside one overlapped segment step while its collective runs
        (1 when :attr:`step_interference` is off).

        :func:`~collsim.workload.interference.overlap_slowdown` with a memory-bound share of
        0: the compute beside these collectives is GEMMs (dgrad, expert GEMMs) or attention
        blocks, compute-bound kernels, so the factor is the SM term ``1 / (1 - f_sm)``
        (compute.md 4: NCCL's 16 SMs of an 8-NIC node) and the HBM term does not enter. An
        expert all-to-all holds the SMs of its dispatcher's kernels instead
        (:func:`collsim.parallel.dispatch.dispatch_sms_of`: DeepEP's 20); an overlapped
        tensor-parallel chunk the SMs its step names (``sms``: userbuffers' ring exchange 1,
        AsyncTP's copy engines 0; :mod:`collsim.parallel.tp_overlap`).
        """
        if not self.step_interference or busbw_bps <= 0:
            return 1.0

        if sms is None and axis in ("ep", "ep_node", "ep_local"):
            sms = dispatch_sms_of(self.plan)
        return overlap_slowdown(
            self.plan.topology.device,
            busbw_bps=busbw_bps,
            memory_bound_share=0.0,
            nccl_sms=sms,
            reduction=op in ("all_reduce", "reduce_scatter"),
        )

    def interference_s(self, *, dp_link_s: float, busbw_bps: float, compute_s: float) -> float:
        """Seconds the compute of one rank loses to the data-parallel collectives it overlaps.

        First order (``collsim.workload.interference``): while a collective runs, the compute
        beside it runs ``factor`` times slower (NCCL's SMs and HBM traffic,
        :func:`~collsim.workload.interference.overlap_slowdown` at the collectives' bus
        bandwidth); the overlap window is at most the shorter of the rank's data-parallel
        link time and its compute time; so the step grows by ``window x (1 - 1/factor)``.
        Both fidelities add it before the optimizer, from their own call tallies.
        """
        if not self.interference or dp_link_s <= 0 or compute_s <= 0:
            return 0.0

        factor = overlap_slowdown(
            self.plan.topology.device,
            busbw_bps=busbw_bps,
            memory_bound_share=self.memory_bound_share,
        )
        return min(dp_link_s, compute_s) * (1.0 - 1.0 / factor)

    """Block times of each layer kind, by its representative layer index."""

    @property
    def num_microbatches(self) -> int:
        return self.plan.num_microbatches


def bytes_per(training: TrainingConfig) -> BytesPer:
    """Bytes per parameter (ZeRO paper, mixed-precision Adam K = 12) and per activation;
    fp32 gradients for the ``megatron_te`` stack reducing in fp32."""

    dtype = Dtype(training.dtype)
    adam = str(training.optimizer) == "adam"
    if dtype is not Dtype.FP32:
        param = grad = 2.0
        opt = 12.0 if adam else 8.0
        if training.stack == "megatron_te" and str(training.grad_reduce_dtype) == "fp32":
            # Megatron-Core's main_grad buffers are fp32 with grad_reduce_in_fp32
            # (distributed_data_parallel.py at 293e104: grad_dtype = torch.float), so
            # gradients are accumulated, held and reduced in 4 bytes
            grad = 4.0
        own = optimizer_state_bytes(training)  # bf16 parameters without fp32 masters
        opt = opt if own is None else own
    else:
        param = grad = 4.0
        opt = 8.0 if adam else 4.0
    return BytesPer(
        param=param,
        grad=grad,
        optimizer=opt,
        activation=float(activation_element_bytes(dtype.value)),
    )


LAYER_KINDS_KEPT = 8
"""Models whose layer kinds are kept (a search has one; more start the table again)."""
_LAYER_KINDS = IdentityMemo(LAYER_KINDS_KEPT)
""":func:`layer_kind_of` by the model (a search asks for it thousands of times, once for each
plan shape's program and floors, of one model)."""


def layer_kind_of(spec: TransformerSpec) -> Mapping[int, int]:
    """Each layer index -> the representative layer of its kind (``spec.layer_kinds()``:
    dense / MoE MLP, full / sliding-window attention); read only, kept per model."""

    def make() -> Mapping[int, int]:
        reps = {(spec.is_moe_layer(r), spec.is_window_layer(r)): r for r, _ in spec.layer_kinds()}
        return MappingProxyType(
            {
                i: reps[(spec.is_moe_layer(i), spec.is_window_layer(i))]
                for i in range(spec.num_layers)
            }
        )

    return _LAYER_KINDS.get(spec, (), make)


def build_schedule(
    topology: Topology,
    spec: TransformerSpec,
    training: TrainingConfig,
    parallel: ParallelConfig,
    *,
    op_time_overrides: dict[str, float] | None = None,
    plan: Plan | None = None,
    cache: ShapeCache | None = None,
) -> StepSchedule:
    """The step schedule of a plan (see the module docstring).

    Args:
        topology, spec, training, parallel: the scenario.
        op_time_overrides: measured seconds by workload op name or by block
            (:data:`~collsim.step.blocks.BLOCK_OVERRIDE_KEYS`).
        plan: an already checked plan of the same arguments (skips :func:`build_plan`).
        cache: shape tables shared with other plans of the same model and cluster
            (:class:`~collsim.step.shapes.ShapeCache`; the program is the same without).

    Raises:
        ConfigError: the plan does not match the model or the cluster (see build_plan).
    """
    if plan is None:
        plan = build_plan(topology, spec, training, parallel)
    overrides = dict(op_time_overrides or {})
    layers, emb, head, model = block_times(plan, topology.device, overrides, cache)
    if not overrides:
        # the slowest GPU of a synchronous step sets its pace (compute.md 1a: 5 % MAMF spread)

        pace = slowest_gpu_factor(plan.num_gpus)
        layers = {r: paced(b, pace) for r, b in layers.items()}
        emb, head = paced(emb, pace), paced(head, pace)
    per = bytes_per(training)
    layer, layer_of = _layer_lookup(spec, layers)
    comms_of = _comms_lookup(plan, spec)
    amax = chunk_amax(plan, linears_per_layer=layer.fp8_linears, memory_time_s=model.memory_time_s)
    kinds: LayerKinds = {}  # each layer kind's segments, made once for every stage
    stages = {
        s: build_stage(
            plan,
            s,
            layer=layer,
            embedding=emb,
            head=head,
            grad_bytes=int(per.grad),
            act_element_bytes=int(per.activation),
            layer_of=layer_of,
            comms_of=comms_of,
            cache=cache,
            amax=amax,
            kinds=kinds,
        )
        for s in range(plan.pp)
    }
    pipeline = _pipeline_orders(plan, cache)
    cpu: list[ComputeModel] = []
    rules = _rules(plan, per)
    optimizer_s = {
        s: stage_optimizer_s(plan, st, model, overrides, cpu, rules) for s, st in stages.items()
    }
    framework_step_s = (
        {s: 0.0 for s in stages} if overrides else framework_work(plan, stages, model, rules)
    )
    if not overrides and model.fp8_casts is not None:
        for s in stages:
            framework_step_s[s] += stage_weight_cast_s(
                plan, s, layer_of or (lambda _: layer), model
            )
    # a CP rank sends its s / cp tokens
    p2p = training.micro_batch * spec.seq_len * spec.hidden * per.activation / plan.tp / plan.cp
    return StepSchedule(
        plan=plan,
        stages=stages,
        pipeline=pipeline,
        dp=rules,
        optimizer_s=optimizer_s,
        p2p_bytes=float(p2p),
        layer=layer,
        embedding=emb,
        head=head,
        compute=model,
        layers=layers,
        framework_step_s=framework_step_s,
        interference=not overrides and _dp_interferes(plan),
        memory_bound_share=memory_bound_share(plan, spec, training, parallel, model),
        step_interference=not overrides,
        paired=_paired(plan, parallel, stages, cache),
    )


def _rules(plan: Plan, per: BytesPer) -> DataParallelRules:
    """The plan's data-parallel rules (:meth:`DataParallelRules.from_plan`)."""
    rules = DataParallelRules.from_plan(plan, per, host_bps=float(plan.topology.host_bandwidth_bps))
    par = plan.parallel
    if (
        par.zero == 3
        and par.fsdp.reduce_dtype is None
        and str(plan.training.grad_reduce_dtype) == "fp32"
    ):
        # FSDP's default mixed precision reduces gradients in fp32 (twice the bytes)
        rules = replace(rules, reduce_element_bytes=4.0)
    return rules


def _dp_interferes(plan: Plan) -> bool:
    """:attr:`StepSchedule.interference` of a plan priced from its compute model."""
    return plan.dp > 1 and (plan.parallel.zero == 3 or plan.parallel.ddp.overlap)


_COMPARED = attrgetter(
    *[f.name for f in fields(ParallelConfig) if f.compare and f.name not in ("ddp", "fsdp")]
)
"""The parallel config's compared fields but ``ddp`` and ``fsdp``, in order."""
_FSDP_COMPARED = attrgetter(
    *[f.name for f in fields(FSDPConfig) if f.compare and f.name != "prefetch"]
)
"""The FSDP config's compared fields but ``prefetch``, in order."""


def without_dp_knobs(parallel: ParallelConfig) -> tuple[Any, ...]:
    """What of ``parallel`` the plans :func:`ddp_variant` serves share: its compared fields
    but the knobs it takes over (``ddp``, ``fsdp.prefetch``), as a tuple (equal and hashed as
    the config with those knobs at one value would be, without making one)."""
    return (_COMPARED(parallel), _FSDP_COMPARED(parallel.fsdp))


def same_but_dp_knobs(a: ParallelConfig, b: ParallelConfig) -> bool:
    """Whether two plans' parallel configs differ at most in the knobs :func:`ddp_variant`
    takes over: ``ddp`` and ``fsdp.prefetch``."""
    return type(a) is type(b) and without_dp_knobs(a) == without_dp_knobs(b)


def ddp_variant(
    schedule: StepSchedule, parallel: ParallelConfig, cache: ShapeCache | None = None
) -> StepSchedule:
    """The program :func:`build_schedule` makes for ``parallel``, a plan that differs from
    ``schedule``'s only in data-parallel knobs that leave the segments alone (``parallel.ddp``:
    bucket sizes, overlap; ``parallel.fsdp.prefetch``: how far ahead ZeRO-3 gathers, which
    only its data-parallel rules read), built from ``schedule`` (with or without op-time
    overrides, as it was built): the same stages with each chunk's DDP buckets made anew
    (:func:`~collsim.step.stage.rebucket_stage`), the data-parallel rules and whether the DP
    calls interfere with compute made for the new plan; everything else (segments, pipeline
    orders, optimizer and framework seconds) depends on none of those knobs and is shared. A
    search's plans come in such runs (they are its innermost axes).

    Raises:
        ConfigError: the plan does not match the model or the cluster (see build_plan).
        ValueError: the plans differ in another knob.
    """
    old = schedule.plan
    plan = dp_variant_plan(old, parallel)
    if not same_but_dp_knobs(plan.parallel, old.parallel):
        raise ValueError(
            "ddp_variant: the plans differ in more than their DDP knobs and FSDP prefetch"
        )
    return replace(
        schedule,
        plan=plan,
        stages=_variant_stages(schedule, plan, cache),
        dp=_variant_rules(schedule.dp, parallel),
        interference=schedule.step_interference and _dp_interferes(plan),
    )


VARIANT_STAGES_KEPT = 64
"""Stages cut for one bucket size that a search's shape cache keeps (the most recently made;
:func:`_variant_stages`): a plan's DDP variants run through its bucket sizes, then again with
the other knobs (overlap, bucket views), which cut the same buckets."""


def _variant_stages(
    schedule: StepSchedule, plan: Plan, cache: ShapeCache | None
) -> dict[int, StageModel]:
    """The stages of :func:`ddp_variant`'s program for ``plan``: ``schedule``'s when the two
    cut their buckets alike (the same bucket and first-bucket sizes; the knobs that differ,
    overlap, bucket views, FSDP prefetch, read no chunk), else each stage with its buckets cut
    anew (:func:`~collsim.step.stage.rebucket_stage`). With a ``cache``, the stages cut for
    each bucket size of a program are kept (:data:`VARIANT_STAGES_KEPT`) by the plan less its
    DDP knobs, and found again only with the very segments they were cut for (another build of
    the program cuts its own, in their place)."""
    old = schedule.plan

    def cuts(p: Plan) -> tuple[float, float]:
        return p.parallel.ddp.bucket_mb, p.parallel.ddp.first_bucket_mb

    if cuts(plan) == cuts(old):
        return schedule.stages

    def make() -> dict[int, StageModel]:
        grad_bytes = int(bytes_per(plan.training).grad)
        return {
            s: rebucket_stage(plan, st, grad_bytes=grad_bytes, cache=cache)
            for s, st in schedule.stages.items()
        }

    if cache is None:
        return make()
    segments = [st.chunks[0].forward if st.chunks else None for st in schedule.stages.values()]
    family = (old.training, without_dp_knobs(old.parallel))

    def mine(entry: tuple[list[Any], dict[int, StageModel]]) -> bool:
        return same_objects(entry[0], segments)  # (not another build's)

    table, kept = "variant stages", VARIANT_STAGES_KEPT
    cache.recent(table, (family, cuts(old)), lambda: (segments, schedule.stages), kept, mine)
    return cache.recent(table, (family, cuts(plan)), lambda: (segments, make()), kept, mine)[1]


def _variant_rules(rules: DataParallelRules, parallel: ParallelConfig) -> DataParallelRules:
    """The data-parallel rules :func:`_rules` makes for a plan that differs from ``rules``'
    in the knobs :func:`ddp_variant` takes over alone: ``rules`` with those knobs replaced
    (the rest reads the plan's shape, model, states and dtypes), and tables of calls of its
    own to fill."""
    return replace(
        rules,
        overlap=parallel.ddp.overlap,
        gradient_as_bucket_view=parallel.ddp.gradient_as_bucket_view,
        prefetch=parallel.fsdp.prefetch,
        _units={},
        _bucket_calls={},
        _bucket_gathers={},
    )


def plan_blocks(
    plan: Plan, cache: ShapeCache | None = None
) -> tuple[dict[int, BlockTimes], BlockTimes, BlockTimes, dict[int, list[LayerComm]], float]:
    """The parts :func:`build_schedule` puts in a plan's program without building it: each
    layer kind's block times (by its representative layer, paced by the slowest GPU), the
    embedding's and the head's, and each kind's EP / CP collectives (empty without EP, ETP
    or CP), and the memory-bound share the program's interference takes
    (:attr:`StepSchedule.memory_bound_share`). What a search's bounds read per layer kind
    (:mod:`collsim.study.search.parts`)."""
    layers, emb, head, model = block_times(plan, plan.topology.device, {}, cache)
    pace = slowest_gpu_factor(plan.num_gpus)
    layers = {r: paced(b, pace) for r, b in layers.items()}
    comms_of = _comms_lookup(plan, plan.spec)
    kinds = layer_kind_of(plan.spec)
    comms = {r: comms_of(r) if comms_of is not None else [] for r in set(kinds.values())}
    share = memory_bound_share(plan, plan.spec, plan.training, plan.parallel, model)
    return layers, paced(emb, pace), paced(head, pace), comms, share


def _pipeline_orders(plan: Plan, cache: ShapeCache | None) -> dict[int, tuple[PipeOp, ...]]:
    """Per stage, the ops of its compute stream in the plan's schedule (once per schedule
    shape in a ``cache``)."""

    def make() -> dict[int, tuple[PipeOp, ...]]:
        order = plan.pipeline_schedule.order
        return {
            s: tuple(
                order(
                    num_stages=plan.pp,
                    num_microbatches=plan.num_microbatches,
                    stage=s,
                    virtual_stages=plan.virtual_stages,
                )
            )
            for s in range(plan.pp)
        }

    if cache is None:
        return make()
    key = (str(plan.parallel.schedule), plan.pp, plan.num_microbatches, plan.virtual_stages)
    return dict(cache.get("pipeline", key, make))


def _layer_lookup(
    spec: TransformerSpec, layers: dict[int, BlockTimes]
) -> tuple[BlockTimes, Callable[[int], BlockTimes] | None]:
    """The representative layer's block times and, with several layer kinds, the block times
    of each layer index (None when every layer is the same)."""
    if len(layers) == 1:
        return next(iter(layers.values())), None
    kind_of = layer_kind_of(spec)
    by_index = {i: layers[r] for i, r in kind_of.items()}
    return layers[kind_of[spec.num_layers // 2]], by_index.__getitem__


def _comms_lookup(plan: Plan, spec: TransformerSpec) -> Callable[[int], list[LayerComm]] | None:
    """The EP / CP collectives of each layer index (None without EP, ETP or CP)."""
    if not (plan.cp > 1 or plan.ep > 1 or plan.etp > 1):
        return None

    kinds = layer_kind_of(spec)
    by_kind = {r: _imbalanced(spec, layer_comms(plan, r)) for r in set(kinds.values())}

    def comms_of(index: int) -> list[LayerComm]:
        return by_kind[kinds[index]]

    return comms_of


def _imbalanced(spec: TransformerSpec, comms: list[LayerComm]) -> list[LayerComm]:
    """The EP all-to-alls under a routing imbalance: the busiest rank receives
    ``load_imbalance`` times the balanced share and every rank of the group waits for it, so
    the call is priced at that many times its balanced buffer (the balanced bytes are what
    :mod:`collsim.parallel.moe` counts; with 1, the default, nothing changes)."""
    k = spec.load_imbalance
    if k == 1.0:
        return comms

    return [replace(c, size_bytes=c.size_bytes * k) if c.op == "all_to_all" else c for c in comms]


def _paired(
    plan: Plan,
    parallel: ParallelConfig,
    stages: dict[int, StageModel],
    cache: ShapeCache | None = None,
) -> dict[int, frozenset[int]]:
    """With EP overlap, per stage the ops that run paired (:func:`paired_ops`); the paired
    segments do the same framework work as the plain ones."""
    paired: dict[int, frozenset[int]] = {}
    if not parallel.ep_overlap:
        return paired
    for s, st in stages.items():
        for chunk in st.chunks:
            for normal, alt in (
                (chunk.forward, chunk.paired_forward),
                (chunk.backward, chunk.paired_backward),
            ):
                for a, b in zip(normal, alt or (), strict=False):
                    b.framework_s = a.framework_s
        paired[s] = _paired_ops(plan, s, cache)
    return paired


def _paired_ops(plan: Plan, stage: int, cache: ShapeCache | None) -> frozenset[int]:
    """The schedule's paired ops of ``stage`` (once per schedule shape in a ``cache``)."""

    def make() -> frozenset[int]:
        return plan.pipeline_schedule.paired(
            num_stages=plan.pp,
            num_microbatches=plan.num_microbatches,
            stage=stage,
            virtual_stages=plan.virtual_stages,
        )

    if cache is None:
        return make()
    key = (str(plan.parallel.schedule), plan.pp, plan.num_microbatches, plan.virtual_stages, stage)
    return cache.get("paired", key, make)
