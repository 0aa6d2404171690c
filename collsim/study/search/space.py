"""The plan space of a search: :func:`enumerate_plans` walks the grid of plans a model can run
on N GPUs (tp, pp, virtual stages, dp, micro-batch size, schedule, ZeRO stage, recompute, expert
tensor parallelism, the MoE dispatcher and its overlap, the CP algorithm, the HSDP group, FP8 and
the other axes of :class:`SearchSpace`, defined with :class:`Candidate` in
:mod:`collsim.study.search.candidate`) and counts each plan it drops under one of
:data:`REASONS` (``tp_heads``, ``pp_layers``, ``batch``, ``zero_pp``, ``deepep_nodes`` ...).
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

from collsim.core.errors import ConfigError
from collsim.parallel.config import ParallelConfig as Parallel
from collsim.parallel.dispatch import (
    DEEPEP_MAX_NVL_PEERS,
    DEEPEP_MAX_RDMA_PEERS,
    STACK_DISPATCHER,
)
from collsim.parallel.pipeline import get_schedule
from collsim.parallel.plan import default_order, grid_rank, rank_axes
from collsim.study.search.candidate import Candidate, DPVariant, Extra, SearchSpace, head_stage
from collsim.workload.memory import balanced_chunk_layers

if TYPE_CHECKING:  # pragma: no cover
    from collsim.parallel.config import ParallelConfig, TrainingConfig
    from collsim.workload.model import TransformerSpec

__all__ = [
    "REASONS",
    "enumerate_plans",
    "SearchSpace",
    "Candidate",
    "DPVariant",
    "Extra",
    "head_stage",
]

REASONS = {
    "tp_heads": "heads, ffn_hidden or the shared-expert ffn not divisible by tp",
    "tp_node": "tp larger than the space's max_tp",
    "pp_layers": "layers not divisible by pp x virtual stages",
    "batch": "global batch not divisible by dp x micro-batch",
    "interleaved_m": "interleaved needs micro-batches divisible by pp",
    "schedule_m": "too few micro-batches for the schedule (DualPipeV: 2 x pp)",
    "zero_pp": "ZeRO-2/3 with pipeline parallelism (left out of this space)",
    "zero2_pp": "ZeRO-2 with pipeline parallelism: no stack runs it (DeepSpeed's pipeline "
    "engine refuses stage 2; the space's zero2_with_pp tries it)",
    "no_dp": "a bucket size other than the first without data parallelism (same plan)",
    "cp_gpus": "cp does not divide the GPUs",
    "cp_seq": "cp (2 x cp with load balancing) does not divide the sequence",
    "ep_experts": "ep does not divide the routed experts",
    "ep_fold": "ep x etp does not divide tp x cp x dp",
    "etp_ffn": "etp does not divide the expert ffn",
    "ep_sp": "tp > 1 with ep > 1 needs sequence parallelism (Megatron-Core)",
    "ep_overlap": "EP overlap with the allgather dispatcher, with full recompute, or with "
    "pp > 1 and one chunk per stage (Megatron-Core's rules)",
    "deepep_nodes": f"deepep: the EP group spans more than {DEEPEP_MAX_RDMA_PEERS} nodes "
    "(DeepEP LEGACY_NUM_MAX_RDMA_PEERS)",
    "deepep_ep": f"deepep: ep above {DEEPEP_MAX_NVL_PEERS} and not a multiple of it "
    "(DeepEP LEGACY_NUM_MAX_NVL_PEERS)",
    "ep_routing": "node-limited routing: more nodes than the EP group spans, or experts not "
    "divisible by them",
    "hsdp_dp": "the HSDP shard group does not divide dp",
    "fp8_device": "FP8 on a device without an FP8 peak",
    "same_plan": "a knob that changes nothing in this plan (dispatcher or EP overlap without "
    "ep, CP algorithm without cp, HSDP group equal to dp or with ZeRO-0): the plan is kept once",
    "memory": "estimated memory exceeds the GPU",
    "memory_bound": "pruned: its memory floor (model states and the activations held at once) "
    "exceeds the GPU",
    "memory (DES)": "simulated memory exceeds the GPU",
    "bound": "pruned: its step-time floor (compute stream, pipeline order, data-parallel calls) "
    "cannot beat the best kept",
}


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def enumerate_plans(
    spec: TransformerSpec,
    num_gpus: int,
    gpus_per_node: int,
    global_batch: int,
    space: SearchSpace | None = None,
    rejected: Counter[str] | None = None,
    *,
    base: ParallelConfig | None = None,
    training: TrainingConfig | None = None,
    fp8_capable: bool = True,
) -> Iterator[Candidate]:
    """Every buildable plan of ``spec`` on ``num_gpus`` GPUs; the others are counted by reason
    in ``rejected`` (one count per plan of the full grid that is dropped). ``base`` (the
    scenario's parallel section) gives the cp, ep, etp, dispatcher, EP overlap, CP algorithm
    and HSDP group the space leaves unset, CP's load balancing, the routing and the rank
    layout; ``training`` (the scenario's) the dtype FP8 is off in and the stack whose
    dispatcher a plan without one runs; ``fp8_capable``: the device has an FP8 peak."""

    space = space or SearchSpace()
    rejected = rejected if rejected is not None else Counter()
    base = base if base is not None else Parallel()
    rules = _Rules(
        spec,
        gpus_per_node,
        base,
        space.extras(base, str(training.dtype) if training is not None else None),
        stack=None if training is None or training.stack is None else str(training.stack),
        fp8_capable=fp8_capable,
    )
    extras = len(rules.extras)
    moe = bool(spec.num_experts)
    cps = space.cps or (base.cp,)
    eps = (space.eps or (base.ep,)) if moe else (1,)
    etps = (space.etps or (base.etp,)) if moe else (1,)
    for cp in cps:
        chunks = 2 * cp if (cp > 1 and base.cp_load_balance) else cp
        grid_gpus = num_gpus // cp if num_gpus % cp == 0 else num_gpus
        for ep in eps:
            for etp in etps:
                reason = None
                if num_gpus % cp or spec.seq_len % chunks:
                    reason = "cp_gpus" if num_gpus % cp else "cp_seq"
                elif spec.num_experts % ep:
                    reason = "ep_experts"
                elif moe and spec.expert_ffn_hidden % etp:
                    reason = "etp_ffn"
                if reason is not None:
                    rejected[reason] += _grid_size(grid_gpus, space) * extras
                    continue
                yield from _grid(
                    spec, num_gpus // cp, global_batch, space, rejected, (cp, ep, etp), rules
                )


class _Rules:
    """The rules of the MoE, CP, HSDP and dtype knobs (:class:`Extra`) for one plan shape,
    kept per shape: which combinations build, which are the same plan as another, and why
    the others do not build (the checks of :func:`collsim.parallel.plan.build_plan` and
    :func:`collsim.parallel.dispatch.check_dispatch`, made here before any plan is built)."""

    def __init__(
        self,
        spec: TransformerSpec,
        gpus_per_node: int,
        base: ParallelConfig,
        extras: list[Extra],
        *,
        stack: str | None,
        fp8_capable: bool,
    ) -> None:
        self.spec, self.gpus_per_node, self.base = spec, gpus_per_node, base
        self.extras = extras
        self.fp8_capable = fp8_capable
        self.implied = STACK_DISPATCHER.get(stack, "alltoall") if stack else "alltoall"
        """The dispatcher of a plan that names none (``dispatch.dispatcher_of``)."""
        self.order = base.order or default_order()
        self.uneven = (
            base.pipeline_split == "balanced"
            and not base.account_for_embedding
            and not base.account_for_loss
            and base.layers_per_stage is None
        )
        """Layers need not divide pp x v: the scenario splits them as evenly as it can."""
        self.offsets = (
            (float(base.account_for_embedding), float(base.account_for_loss))
            if (base.account_for_embedding or base.account_for_loss)
            and base.layers_per_stage is None
            else None
        )
        """The embedding and loss counted as a layer each (Megatron's account-for split):
        the plan builds where :func:`balanced_chunk_layers` splits the layers."""
        self._kept: dict[tuple[Any, ...], tuple[list[Extra], Counter[str]]] = {}

    def ep_nodes(self, tp: int, cp: int, pp: int, dp: int, ep: int, etp: int) -> int:
        """Nodes that rank 0's EP group spans (``dispatch.ep_layout``): its members are the
        stage-0 ranks of expert index (0, i, 0), i < ep, placed by the plan's rank layout."""
        axes = rank_axes(self.order, {"dp": dp, "pp": pp, "cp": cp, "tp": tp})
        ranks = []
        for i in range(ep):
            j = i * etp
            at = {"tp": j % tp, "cp": (j // tp) % cp, "dp": j // (tp * cp), "pp": 0}
            ranks.append(grid_rank(axes, at))
        return len({r // self.gpus_per_node for r in ranks})

    def kept(
        self, shape: tuple[int, ...], v: int, zero: int, recompute: str
    ) -> tuple[list[Extra], Counter[str]]:
        """The combinations of :attr:`extras` that build for the plan shape ``(tp, cp, pp, dp,
        ep, etp)`` at ``v`` chunks per stage, ZeRO ``zero`` and ``recompute``, each once (a
        knob that changes nothing in the plan set to its neutral value), and the others
        counted by reason."""
        key = (shape, v, zero, recompute)
        hit = self._kept.get(key)
        if hit is not None:
            return hit
        tp, cp, pp, dp, ep, etp = shape
        spec, base = self.spec, self.base
        nodes = self.ep_nodes(tp, cp, pp, dp, ep, etp) if ep > 1 else 1
        routing = base.routing_nodes is not None and base.routing_nodes > nodes
        routing = routing or (
            ep > 1 and base.routing == "node_limited" and bool(spec.num_experts % nodes)
        )
        out: list[Extra] = []
        why: Counter[str] = Counter()
        for x in self.extras:
            reason = self._reason(x, shape, v, recompute, nodes, routing and spec.is_moe)
            if reason is not None:
                why[reason] += 1
                continue
            g = x.shard_group
            same = Extra(
                dispatcher=x.dispatcher if ep > 1 else None,
                ep_overlap=x.ep_overlap and ep > 1,
                cp_algorithm=x.cp_algorithm if cp > 1 else "ring",
                shard_group=None if g is None or g == dp or zero == 0 else g,
                dtype=x.dtype,
            )
            if same in out:
                why["same_plan"] += 1
            else:
                out.append(same)
        hit = self._kept[key] = (out, why)
        return hit

    def _reason(
        self,
        x: Extra,
        shape: tuple[int, ...],
        v: int,
        recompute: str,
        nodes: int,
        routing: bool,
    ) -> str | None:
        """Why the combination ``x`` does not build in the plan (None: it builds)."""
        _, _, pp, dp, ep, _ = shape
        if x.dtype == "fp8" and not self.fp8_capable:
            return "fp8_device"
        if x.shard_group is not None and dp % x.shard_group:
            return "hsdp_dp"
        if routing:
            return "ep_routing"
        if ep < 2:
            return None
        name = x.dispatcher or self.implied
        if x.ep_overlap and (name == "allgather" or recompute == "full" or (pp > 1 and v < 2)):
            return "ep_overlap"
        if name == "deepep" and nodes > DEEPEP_MAX_RDMA_PEERS:
            return "deepep_nodes"
        if name == "deepep" and ep > DEEPEP_MAX_NVL_PEERS and ep % DEEPEP_MAX_NVL_PEERS:
            return "deepep_ep"
        return None


def _within(sizes: list[int], allowed: tuple[int, ...] | None) -> list[int]:
    """``sizes`` that the space allows (all when ``allowed`` is None)."""
    return sizes if allowed is None else [n for n in sizes if n in allowed]


def _grid_size(num_gpus: int, space: SearchSpace) -> int:
    """Plans of the tp x pp x dp grid on ``num_gpus`` GPUs, buildable or not (per
    combination of :meth:`SearchSpace.extras`)."""
    per_variant = len(space.dp_variants()) * len(space.recomputes)
    total = 0
    for tp in _divisors(num_gpus):
        sps = len([sp for sp in space.sequence_parallel if tp > 1 or not sp] or [False])
        for pp in _divisors(num_gpus // tp):
            scheds = 1 if pp == 1 else sum(len(_chunk_counts(k, space)) for k in space.schedules)
            total += len(space.micro_batches) * scheds * per_variant * sps
    return total


def _chunk_counts(schedule: str, space: SearchSpace) -> tuple[int, ...]:
    """Chunks per stage tried with ``schedule``: the space's virtual stages where the
    schedule takes them (interleaved), else the schedule's own count."""
    if schedule == "interleaved":
        return space.virtual_stages
    return (get_schedule(schedule).chunks(1),)


def _tp_reason(spec: TransformerSpec, tp: int, pp: int, max_tp: int) -> str | None:
    """Why no plan of tensor-parallel size ``tp`` and ``pp`` stages builds (None: some may)."""
    if tp > max_tp:
        return "tp_node"
    if spec.num_heads % tp or spec.ffn_hidden % tp or spec.shared_ffn_hidden % tp:
        return "tp_heads"
    if pp > spec.num_layers:
        return "pp_layers"
    return None


def _grid(
    spec: TransformerSpec,
    num_gpus: int,
    global_batch: int,
    space: SearchSpace,
    rejected: Counter[str],
    sizes: tuple[int, int, int],
    rules: _Rules,
) -> Iterator[Candidate]:
    """The buildable plans of the tp x pp x dp grid on ``num_gpus`` (the GPUs of one cp
    index) at fixed ``sizes`` (cp, ep, etp); the others counted by reason."""
    cp, ep, etp = sizes
    max_tp = space.max_tp or num_gpus
    variants = space.dp_variants()
    per_variant = len(variants) * len(space.recomputes)
    extras = len(rules.extras)
    for tp in _within(_divisors(num_gpus), space.tps):
        sps = [sp for sp in space.sequence_parallel if tp > 1 or not sp] or [False]
        for pp in _within(_divisors(num_gpus // tp), space.pps):
            dp = num_gpus // (tp * pp)
            scheds: list[tuple[str, int]] = (
                [("1f1b", 1)]
                if pp == 1
                else [(s, v) for s in space.schedules for v in _chunk_counts(s, space)]
            )
            grid = len(space.micro_batches) * len(scheds) * per_variant * len(sps) * extras
            reason = _tp_reason(spec, tp, pp, max_tp)
            if reason is None and (tp * cp * dp) % (ep * etp):
                reason = "ep_fold"
            if reason is not None:
                rejected[reason] += grid
                continue
            shape = (tp, cp, pp, dp, ep, etp)
            for mb in space.micro_batches:
                if global_batch % (dp * mb):
                    rejected["batch"] += grid // len(space.micro_batches)
                    continue
                m = global_batch // (dp * mb)
                for schedule, v in scheds:
                    reason = _schedule_reason(
                        spec, schedule, pp, v, m, rules.uneven, offsets=rules.offsets
                    )
                    if reason is not None:
                        rejected[reason] += per_variant * len(sps) * extras
                        continue
                    yield from _plans(
                        space, rejected, shape, (mb, schedule, v), variants, sps, rules
                    )


def _schedule_reason(
    spec: TransformerSpec,
    schedule: str,
    pp: int,
    v: int,
    m: int,
    uneven: bool,
    *,
    offsets: tuple[float, float] | None = None,
) -> str | None:
    """Why ``schedule`` with ``v`` chunks per stage does not build on ``pp`` stages with
    ``m`` micro-batches (None: it builds). With ``offsets`` (the account-for flags) the
    layers split as :func:`balanced_chunk_layers` does, edge chunks possibly empty."""
    if offsets is not None:
        try:
            balanced_chunk_layers(
                spec.num_layers, pp * v, first_offset=offsets[0], last_offset=offsets[1]
            )
        except ConfigError:
            return "pp_layers"
    elif spec.num_layers % (pp * v) and not (uneven and spec.num_layers >= pp * v):
        return "pp_layers"
    if schedule == "interleaved" and m % pp:
        return "interleaved_m"
    try:
        get_schedule(schedule).check(num_stages=pp, num_microbatches=m, virtual_stages=v)
    except ConfigError:
        return "schedule_m"
    return None


def _plans(
    space: SearchSpace,
    rejected: Counter[str],
    shape: tuple[int, int, int, int, int, int],
    step: tuple[int, str, int],
    variants: list[DPVariant],
    sps: list[bool],
    rules: _Rules,
) -> Iterator[Candidate]:
    """The plans of one shape ``(tp, cp, pp, dp, ep, etp)`` and ``(micro-batch, schedule,
    v)``: every data-parallel variant, recompute, sequence parallelism and
    :class:`Extra` that builds; the others counted by reason."""
    tp, cp, pp, dp, ep, etp = shape
    mb, schedule, v = step
    extras = len(rules.extras)
    first = variants[0]
    for var in variants:
        zero = var.zero
        if zero >= 2 and pp > 1 and not space.zero_with_pp:
            rejected["zero_pp"] += len(space.recomputes) * len(sps) * extras
            continue
        if zero == 2 and pp > 1 and not space.zero2_with_pp:
            rejected["zero2_pp"] += len(space.recomputes) * len(sps) * extras
            continue
        if dp == 1 and (var.bucket_mb, var.overlap, var.bucket_view) != (
            first.bucket_mb,
            first.overlap,
            first.bucket_view,
        ):
            # no data parallelism: buckets and their overlap change nothing
            rejected["no_dp"] += len(space.recomputes) * len(sps) * extras
            continue
        for recompute in space.recomputes:
            kept, why = rules.kept(shape, v, zero, recompute)
            for sp in sps:
                if tp > 1 and ep > 1 and not sp:
                    rejected["ep_sp"] += extras
                    continue
                rejected.update(why)
                for x in kept:
                    yield Candidate(
                        tp=tp,
                        pp=pp,
                        dp=dp,
                        micro_batch=mb,
                        schedule=schedule,
                        virtual_stages=v,
                        zero=zero,
                        recompute=recompute,
                        sequence_parallel=sp,
                        bucket_mb=var.bucket_mb,
                        overlap=var.overlap,
                        bucket_view=var.bucket_view,
                        prefetch=var.prefetch,
                        offload=var.offload,
                        reshard=var.reshard,
                        cp=cp,
                        ep=ep,
                        etp=etp,
                        dispatcher=x.dispatcher,
                        ep_overlap=x.ep_overlap,
                        cp_algorithm=x.cp_algorithm,
                        shard_group=x.shard_group,
                        dtype=x.dtype,
                    )
