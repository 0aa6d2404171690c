"""The plan space of a search: the grid of plans a model can run on N GPUs, and why the others
cannot be built.

:func:`enumerate_plans` walks tp, pp, virtual stages, dp, micro-batch size, schedule, ZeRO stage,
recompute and the other axes of :class:`SearchSpace`, and counts each plan it drops under one of
:data:`REASONS` (``tp_heads``, ``pp_layers``, ``batch``, ``zero_pp`` ...).
"""

from __future__ import annotations

import dataclasses
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from collsim.core.errors import ConfigError
from collsim.core.vocab import ScheduleKind
from collsim.parallel.config import ParallelConfig as Parallel
from collsim.parallel.config import Recompute
from collsim.parallel.pipeline import get_schedule

if TYPE_CHECKING:  # pragma: no cover
    from collsim.parallel.config import ParallelConfig, TrainingConfig
    from collsim.workload.model import TransformerSpec


REASONS = {
    "tp_heads": "heads or ffn_hidden not divisible by tp",
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

    @property
    def label(self) -> str:
        """``tp8 pp8 dp16 mb1 interleaved v2 zero1 rc=full sp``, plus the non-default
        bucket size (``b100``), prefetch depth (``pf2``) or ``offload``."""
        parts = [f"tp{self.tp}"] + ([f"cp{self.cp}"] if self.cp > 1 else [])
        parts += [f"pp{self.pp}", f"dp{self.dp}"] + ([f"ep{self.ep}"] if self.ep > 1 else [])
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

        training = dataclasses.replace(
            base_training, micro_batch=self.micro_batch, recompute=Recompute(self.recompute)
        )
        parallel = dataclasses.replace(
            base_parallel,
            tp=self.tp,
            pp=self.pp,
            dp=self.dp,
            cp=self.cp,
            ep=self.ep,
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
) -> Iterator[Candidate]:
    """Every buildable plan of ``spec`` on ``num_gpus`` GPUs; the others are counted by reason
    in ``rejected`` (one count per plan of the full grid that is dropped). ``base`` (the
    scenario's parallel section) gives the cp and ep sizes the space leaves unset, the
    expert tensor-parallel size and CP's load balancing."""

    space = space or SearchSpace()
    rejected = rejected if rejected is not None else Counter()
    base = base if base is not None else Parallel()
    cps = space.cps or (base.cp,)
    eps = (space.eps or (base.ep,)) if spec.num_experts else (1,)
    for cp in cps:
        chunks = 2 * cp if (cp > 1 and base.cp_load_balance) else cp
        for ep in eps:
            if num_gpus % cp or spec.seq_len % chunks:
                rejected["cp_gpus" if num_gpus % cp else "cp_seq"] += _grid_size(
                    num_gpus // cp if num_gpus % cp == 0 else num_gpus, space
                )
                continue
            if spec.num_experts % ep:
                rejected["ep_experts"] += _grid_size(num_gpus // cp, space)
                continue
            yield from _grid(spec, num_gpus // cp, global_batch, space, rejected, cp, ep, base)


def _within(sizes: list[int], allowed: tuple[int, ...] | None) -> list[int]:
    """``sizes`` that the space allows (all when ``allowed`` is None)."""
    return sizes if allowed is None else [n for n in sizes if n in allowed]


def _grid_size(num_gpus: int, space: SearchSpace) -> int:
    """Plans of the tp x pp x dp grid on ``num_gpus`` GPUs, buildable or not."""
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


def _grid(
    spec: TransformerSpec,
    num_gpus: int,
    global_batch: int,
    space: SearchSpace,
    rejected: Counter[str],
    cp: int,
    ep: int,
    base: ParallelConfig,
) -> Iterator[Candidate]:
    """The buildable plans of the tp x pp x dp grid on ``num_gpus`` (the GPUs of one cp
    index) at fixed cp and ep; the others counted by reason."""
    max_tp = space.max_tp or num_gpus
    variants = space.dp_variants()
    per_variant = len(variants) * len(space.recomputes)
    for tp in _within(_divisors(num_gpus), space.tps):
        sps = [sp for sp in space.sequence_parallel if tp > 1 or not sp] or [False]
        for pp in _within(_divisors(num_gpus // tp), space.pps):
            dp = num_gpus // (tp * pp)
            scheds: list[tuple[str, int]] = (
                [("1f1b", 1)]
                if pp == 1
                else [(s, v) for s in space.schedules for v in _chunk_counts(s, space)]
            )
            grid = len(space.micro_batches) * len(scheds) * per_variant * len(sps)
            if tp > max_tp:
                rejected["tp_node"] += grid
                continue
            if spec.num_heads % tp or spec.ffn_hidden % tp:
                rejected["tp_heads"] += grid
                continue
            if pp > spec.num_layers:
                rejected["pp_layers"] += grid
                continue
            if (tp * cp * dp) % (ep * base.etp):
                rejected["ep_fold"] += grid
                continue
            for mb in space.micro_batches:
                per_mb = len(scheds) * per_variant * len(sps)
                if global_batch % (dp * mb):
                    rejected["batch"] += per_mb
                    continue
                m = global_batch // (dp * mb)
                for schedule, v in scheds:
                    per_sched = per_variant * len(sps)
                    if spec.num_layers % (pp * v):
                        rejected["pp_layers"] += per_sched
                        continue
                    if schedule == "interleaved" and m % pp:
                        rejected["interleaved_m"] += per_sched
                        continue
                    pipeline = get_schedule(schedule)
                    try:
                        pipeline.check(num_stages=pp, num_microbatches=m, virtual_stages=v)
                    except ConfigError:
                        rejected["schedule_m"] += per_sched
                        continue
                    for var in variants:
                        zero = var.zero
                        if zero >= 2 and pp > 1 and not space.zero_with_pp:
                            rejected["zero_pp"] += len(space.recomputes) * len(sps)
                            continue
                        if dp == 1 and (var.bucket_mb, var.overlap, var.bucket_view) != (
                            variants[0].bucket_mb,
                            variants[0].overlap,
                            variants[0].bucket_view,
                        ):
                            # no data parallelism: buckets and their overlap change nothing
                            rejected["no_dp"] += len(space.recomputes) * len(sps)
                            continue
                        for recompute in space.recomputes:
                            for sp in sps:
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
                                )
