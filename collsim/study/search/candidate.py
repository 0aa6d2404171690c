"""What a search varies and what one plan is: :class:`SearchSpace` (the axes and the values
tried on each), :class:`Candidate` (one plan's knobs, its label and the scenario sections it
runs with), and the combinations of the data-parallel knobs (:class:`DPVariant`) and of the
MoE, CP, HSDP and dtype knobs (:class:`Extra`) that :mod:`collsim.study.search.space` walks.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from collsim.core.vocab import CPAlgorithm, Dtype, ScheduleKind
from collsim.parallel.config import Recompute
from collsim.parallel.pipeline import get_schedule
from collsim.step.shapes import IdentityMemo

if TYPE_CHECKING:  # pragma: no cover
    from collsim.parallel.config import ParallelConfig, TrainingConfig

__all__ = ["SearchSpace", "DPVariant", "Extra", "Candidate", "head_stage"]


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
    """Try ZeRO-2/3 with pipeline parallelism (the engine reduces per micro-batch; ZeRO-2
    only where :attr:`zero2_with_pp` says so too)."""
    zero2_with_pp: bool = False
    """Try ZeRO-2 with pipeline parallelism. Off by default: no stack runs it. DeepSpeed's
    pipeline engine asserts a ZeRO stage below 2 (deepspeed/runtime/pipe/engine.py at
    edaa722) and Megatron-Core has no ZeRO-2 (its distributed optimizer keeps the whole
    gradient buffer: ZeRO-1 here); ZeRO-3 with pipelines is torchtitan's FSDP2 with
    pipelining (``zero_with_pp``)."""
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
        training = _CONFIGS.get(
            base_training,
            (self.micro_batch, self.recompute, dtype),
            lambda: dataclasses.replace(
                base_training,
                micro_batch=self.micro_batch,
                recompute=Recompute(self.recompute),
                dtype=dtype,
                fp8_recipe=base_training.fp8_recipe if fp8 else None,
            ),
        )
        ddp, fsdp = base_parallel.ddp, base_parallel.fsdp
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
            ddp=_CONFIGS.get(
                ddp,
                (self.bucket_mb, self.overlap, self.bucket_view),
                lambda: dataclasses.replace(
                    ddp,
                    bucket_mb=self.bucket_mb,
                    overlap=self.overlap,
                    gradient_as_bucket_view=self.bucket_view,
                ),
            ),
            fsdp=_CONFIGS.get(
                fsdp,
                (self.prefetch, self.offload, self.reshard, self.shard_group, fp8),
                lambda: dataclasses.replace(
                    fsdp,
                    prefetch=self.prefetch,
                    offload=self.offload,
                    reshard_after_forward=self.reshard,
                    shard_group_size=self.shard_group,
                    fp8_all_gather=fsdp.fp8_all_gather and fp8,
                ),
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


def head_stage(c: Candidate) -> int:
    """The stage where ``c``'s schedule places the last model part (the head)."""
    v = c.virtual_stages
    return get_schedule(c.schedule).where(c.pp * v - 1, c.pp, v)[0]


CONFIGS_KEPT = 4096
"""Sections kept (a search has a few hundred; more start the table again)."""
_CONFIGS = IdentityMemo(CONFIGS_KEPT)
""":meth:`Candidate.configs`' sections by the scenario's section and the plan's knobs that
replace its fields (the sections are frozen, so plans with the same knobs share one)."""
