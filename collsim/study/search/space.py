"""The plan space of a search: the grid of plans a model can run on N GPUs, and why the others
cannot be built.

:func:`enumerate_plans` walks tp, pp, virtual stages, dp, micro-batch size, schedule, ZeRO stage,
recompute, expert tensor parallelism, the MoE dispatcher and its overlap, the CP algorithm, the
HSDP group, FP8 and the other axes of :class:`SearchSpace`, and counts each plan it drops under
one of :data:`REASONS` (``tp_heads``, ``pp_layers``, ``batch``, ``zero_pp``, ``deepep_nodes``
...).
"""

from __future__ import annotations

import dataclasses
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from collsim.core.errors import ConfigError
from collsim.core.vocab import CPAlgorithm, Dtype, ScheduleKind
from collsim.parallel.config import ParallelConfig as Parallel
from collsim.parallel.config import Recompute
from collsim.parallel.dispatch import (
    DEEPEP_MAX_NVL_PEERS,
    DEEPEP_MAX_RDMA_PEERS,
    STACK_DISPATCHER,
)
from collsim.parallel.pipeline import get_schedule
from collsim.parallel.plan import default_order, grid_rank, rank_axes

if TYPE_CHECKING:  # pragma: no cover
    from collsim.parallel.config import ParallelConfig, TrainingConfig
    from collsim.workload.model import TransformerSpec


REASONS = {
    "tp_heads": "heads, ffn_hidden or the shared-expert ffn not divisible by tp",
    "tp_node": "tp larger than the space's max_tp",
    "pp_layers": "layers not divisible by pp x virtual stages",
    "batch": "global batch not divisible by dp x micro-batch",
    "interleaved_m": "interleaved needs micro-batches divisible by pp",
    "schedule_m": "too few micro-batches for the schedule (DualPipeV: 2 x pp)",
    "zero_pp": "ZeRO-2/3 with pipeline parallelism (left out of this space)",
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


@dataclass(frozen=True, slots=True, kw_only=True)
class SearchSpace:
    """What the search varies. Defaults cover what Megatron-LM and DeepSpeed offer."""

    micro_batches: tuple[int, ...] = (1, 2, 4, 8, 16, 32, 64)
    schedules: tuple[str, ...] = ("gpipe", "1f1b", "interleaved")
    """Pipeline schedules tried (``zb_h1`` and ``dualpipev`` too when named)."""
    virtual_stages: tuple[int, ...] = (2, 3, 4, 6, 8, 12, 16, 24)
    """Chunks per stage tried with the interleaved schedule."""
    zero_stages: tuple[int, ...] = (0, 1, 2, 3)
    recomputes: tuple[str, ...] = ("none", "selective", "full")
    sequence_parallel: tuple[bool, ...] = (False, True)
    bucket_mbs: tuple[float, ...] = (10.0, 25.0, 100.0, 400.0)
    """DDP / ZeRO-1/2 bucket sizes tried (MiB; torch's default is 25)."""
    overlaps: tuple[bool, ...] = (True, False)
    """DDP / ZeRO-1/2 gradient reduction overlapped with backward, or after it."""
    bucket_views: tuple[bool, ...] = (False, True)
    """DDP (ZeRO 0): torch's ``gradient_as_bucket_view`` (gradients not held twice)."""
    prefetches: tuple[int, ...] = (0, 1, 2, 4)
    """ZeRO-3 / FSDP prefetch depths tried."""
    offloads: tuple[bool, ...] = (False, True)
    """ZeRO-3 with and without CPU offload of the shards."""
    reshards: tuple[bool, ...] = (True, False)
    """ZeRO-3 parameters resharded after forward (FULL_SHARD) or kept (SHARD_GRAD_OP)."""
    max_tp: int | None = None
    """Largest tp; None = any (TP across nodes is tried too; the network prices it)."""
    zero_with_pp: bool = True
    """Try ZeRO-2/3 with pipeline parallelism (the engine reduces per micro-batch)."""
    cps: tuple[int, ...] | None = None
    """Context-parallel sizes tried (None: the scenario's)."""
    eps: tuple[int, ...] | None = None
    """Expert-parallel sizes tried (None: the scenario's; MoE models only)."""
    tps: tuple[int, ...] | None = None
    """Tensor-parallel sizes tried (None: every divisor of the GPUs); others are outside the
    space, not counted."""
    pps: tuple[int, ...] | None = None
    """Pipeline-parallel sizes tried (None: every divisor); others are outside the space."""
    etps: tuple[int, ...] | None = None
    """Expert tensor-parallel sizes tried (None: the scenario's; MoE models only)."""
    dispatchers: tuple[str, ...] | None = None
    """MoE token dispatchers tried (``alltoall``, ``deepep``, ``hybridep``, ``allgather``;
    None: the scenario's); plans without expert parallelism have none."""
    ep_overlaps: tuple[bool, ...] | None = None
    """EP all-to-alls hidden behind compute (Megatron-Core
    ``--overlap-moe-expert-parallel-comm``) or not (None: the scenario's)."""
    cp_algorithms: tuple[str, ...] | None = None
    """Context-parallel KV exchanges tried (``ring``, ``all_gather``; None: the scenario's)."""
    shard_groups: tuple[int, ...] | None = None
    """HSDP shard group sizes tried (ranks of the data-parallel group that shard; a size equal
    to dp shards over all of it; None: the scenario's ``parallel.fsdp.shard_group_size``)."""
    fp8s: tuple[bool, ...] | None = None
    """FP8 GEMMs on (``dtype: fp8``, the scenario's recipe) or off (its dtype, bf16 if that
    is fp8); None: the scenario's dtype. On is tried only where the device has an FP8 peak."""

    def extras(self, base: ParallelConfig, dtype: str | None = None) -> list[Extra]:
        """Every combination of the MoE, CP, HSDP and dtype knobs (``base``: the scenario's
        parallel section, for the axes the space leaves unset; ``dtype``: the scenario's)."""
        off = "bf16" if dtype in (None, "fp8") else dtype
        dtypes: tuple[str | None, ...] = (
            (None,) if self.fp8s is None else tuple("fp8" if f else off for f in self.fp8s)
        )
        return [
            Extra(
                dispatcher=d,
                ep_overlap=o,
                cp_algorithm=a,
                shard_group=g,
                dtype=t,
            )
            for d in (self.dispatchers or (base.dispatcher,))
            for o in (self.ep_overlaps or (bool(base.ep_overlap),))
            for a in (self.cp_algorithms or (str(base.cp_algorithm),))
            for g in (self.shard_groups or (base.fsdp.shard_group_size,))
            for t in dtypes
        ]

    def dp_variants(self) -> list[DPVariant]:
        """Data-parallel knob combinations: buckets and overlap for ZeRO 0-2, prefetch,
        offload and resharding for ZeRO-3."""
        out: list[DPVariant] = []
        for zero in self.zero_stages:
            if zero < 3:
                out += [
                    DPVariant(zero=zero, bucket_mb=b, overlap=o, bucket_view=view)
                    for b in self.bucket_mbs
                    for o in self.overlaps
                    for view in (self.bucket_views if zero == 0 else (False,))
                ]
            else:
                out += [
                    DPVariant(zero=zero, prefetch=p, offload=f, reshard=r)
                    for p in self.prefetches
                    for f in self.offloads
                    for r in self.reshards
                ]
        return out


@dataclass(frozen=True, slots=True)
class DPVariant:
    """One combination of the data-parallel knobs."""

    zero: int
    bucket_mb: float = 25.0
    overlap: bool = True
    bucket_view: bool = False
    prefetch: int = 1
    offload: bool = False
    reshard: bool = True


@dataclass(frozen=True, slots=True, kw_only=True)
class Extra:
    """One combination of the MoE, CP, HSDP and dtype knobs (None: the scenario's)."""

    dispatcher: str | None = None
    ep_overlap: bool = False
    cp_algorithm: str = "ring"
    shard_group: int | None = None
    dtype: str | None = None


@dataclass(frozen=True, slots=True, kw_only=True)
class Candidate:
    """One plan: the knobs the search turns."""

    tp: int
    pp: int
    dp: int
    micro_batch: int
    schedule: str
    virtual_stages: int
    zero: int
    recompute: str
    sequence_parallel: bool
    bucket_mb: float = 25.0
    overlap: bool = True
    bucket_view: bool = False
    prefetch: int = 1
    offload: bool = False
    reshard: bool = True
    cp: int = 1
    ep: int = 1
    etp: int = 1
    dispatcher: str | None = None
    """None: the stack's (``collsim.parallel.dispatch.dispatcher_of``)."""
    ep_overlap: bool = False
    cp_algorithm: str = "ring"
    shard_group: int | None = None
    """HSDP shard group size (None: the whole data-parallel group)."""
    dtype: str | None = None
    """``fp8`` or the dtype FP8 is off in (None: the scenario's)."""

    @property
    def label(self) -> str:
        """``tp8 pp8 dp16 mb1 interleaved v2 zero1 rc=full sp``, plus the non-default
        bucket size (``b100``), prefetch depth (``pf2``) or ``offload``, and for MoE, CP,
        HSDP and dtype plans ``etp2``, the dispatcher, ``ep-overlap``, ``cp=all_gather``,
        ``hsdp8`` and the dtype where set."""
        parts = [f"tp{self.tp}"] + ([f"cp{self.cp}"] if self.cp > 1 else [])
        parts += [f"pp{self.pp}", f"dp{self.dp}"] + ([f"ep{self.ep}"] if self.ep > 1 else [])
        parts += [f"etp{self.etp}"] if self.etp > 1 else []
        parts += [self.dispatcher] if self.dispatcher is not None else []
        parts += ["ep-overlap"] if self.ep_overlap else []
        parts += [f"cp={self.cp_algorithm}"] if self.cp > 1 and self.cp_algorithm != "ring" else []
        parts += [f"hsdp{self.shard_group}"] if self.shard_group is not None else []
        parts += [self.dtype] if self.dtype is not None else []
        parts.append(f"mb{self.micro_batch}")
        if self.pp > 1:
            interleaved = self.schedule == "interleaved" and self.virtual_stages > 1
            parts.append(self.schedule + (f" v{self.virtual_stages}" if interleaved else ""))
        parts += [f"zero{self.zero}", f"rc={self.recompute}"]
        if self.sequence_parallel:
            parts.append("sp")
        if self.zero < 3 and self.bucket_mb != 25.0:
            parts.append(f"b{self.bucket_mb:g}")
        if self.zero < 3 and not self.overlap:
            parts.append("no-overlap")
        if self.bucket_view:
            parts.append("grad-view")
        if self.zero == 3 and self.prefetch != 1:
            parts.append(f"pf{self.prefetch}")
        if self.offload:
            parts.append("offload")
        if self.zero == 3 and not self.reshard:
            parts.append("keep-params")
        return " ".join(parts)

    def configs(
        self, base_training: TrainingConfig, base_parallel: ParallelConfig
    ) -> tuple[TrainingConfig, ParallelConfig]:
        """The scenario's training and parallel sections with this plan's knobs."""

        dtype = base_training.dtype if self.dtype is None else Dtype(self.dtype)
        fp8 = str(dtype) == "fp8"
        training = dataclasses.replace(
            base_training,
            micro_batch=self.micro_batch,
            recompute=Recompute(self.recompute),
            dtype=dtype,
            fp8_recipe=base_training.fp8_recipe if fp8 else None,
        )
        overlap = (
            base_parallel.ep_overlap_mode
            if self.ep_overlap == base_parallel.ep_overlap
            else self.ep_overlap
        )
        parallel = dataclasses.replace(
            base_parallel,
            tp=self.tp,
            pp=self.pp,
            dp=self.dp,
            cp=self.cp,
            ep=self.ep,
            etp=self.etp,
            dispatcher=self.dispatcher,
            ep_overlap=overlap,
            cp_algorithm=CPAlgorithm(self.cp_algorithm),
            schedule=ScheduleKind(self.schedule),
            virtual_stages=self.virtual_stages,
            zero=self.zero,
            sequence_parallel=self.sequence_parallel,
            ddp=dataclasses.replace(
                base_parallel.ddp,
                bucket_mb=self.bucket_mb,
                overlap=self.overlap,
                gradient_as_bucket_view=self.bucket_view,
            ),
            fsdp=dataclasses.replace(
                base_parallel.fsdp,
                prefetch=self.prefetch,
                offload=self.offload,
                reshard_after_forward=self.reshard,
                shard_group_size=self.shard_group,
                fp8_all_gather=base_parallel.fsdp.fp8_all_gather and fp8,
            ),
        )
        return training, parallel

    def as_dict(self) -> dict[str, Any]:
        return {
            "plan": self.label,
            "tp": self.tp,
            "pp": self.pp,
            "dp": self.dp,
            "micro_batch": self.micro_batch,
            "schedule": self.schedule,
            "virtual_stages": self.virtual_stages,
            "zero": self.zero,
            "recompute": self.recompute,
            "sequence_parallel": self.sequence_parallel,
            "bucket_mb": self.bucket_mb,
            "overlap": self.overlap,
            "gradient_as_bucket_view": self.bucket_view,
            "prefetch": self.prefetch,
            "offload": self.offload,
            "reshard_after_forward": self.reshard,
            "cp": self.cp,
            "ep": self.ep,
            "etp": self.etp,
            "dispatcher": self.dispatcher or "",
            "ep_overlap": self.ep_overlap,
            "cp_algorithm": self.cp_algorithm,
            "shard_group": self.shard_group or 0,
            "dtype": self.dtype or "",
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


def head_stage(c: Candidate) -> int:
    """The stage where ``c``'s schedule places the last model part (the head)."""
    v = c.virtual_stages
    return get_schedule(c.schedule).where(c.pp * v - 1, c.pp, v)[0]


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
                    reason = _schedule_reason(spec, schedule, pp, v, m, rules.uneven)
                    if reason is not None:
                        rejected[reason] += per_variant * len(sps) * extras
                        continue
                    yield from _plans(
                        space, rejected, shape, (mb, schedule, v), variants, sps, rules
                    )


def _schedule_reason(
    spec: TransformerSpec, schedule: str, pp: int, v: int, m: int, uneven: bool
) -> str | None:
    """Why ``schedule`` with ``v`` chunks per stage does not build on ``pp`` stages with
    ``m`` micro-batches (None: it builds)."""
    if spec.num_layers % (pp * v) and not (uneven and spec.num_layers >= pp * v):
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
