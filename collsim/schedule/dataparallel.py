"""Data-parallel rules of a step: model states, DDP/ZeRO buckets, FSDP units, optimizer.

ZeRO (Rajbhandari et al. 2020) and FSDP (Zhao et al. 2023) over the DP group of size N:
stage 0 is DDP (torch reducer: bucketed all-reduce in the last micro-batch's backward,
``no_sync`` before); stage 1 reduce-scatters buckets after the last micro-batch and
all-gathers the updated parameters after the optimizer (Megatron's distributed optimizer);
stage 2 reduce-scatters buckets in every micro-batch's backward (DeepSpeed keeps only the
reduced partition); stage 3 gathers each unit before its forward and backward and
reduce-scatters its gradient after its backward, in every micro-batch. Model states per GPU
follow: parameters 2 (4 in fp32) bytes per parameter, / N at stage 3; gradients the same, / N
from stage 2; optimizer state K bytes (12 for mixed-precision Adam: fp32 master, m, v), / N
from stage 1. With ``fsdp.offload`` the shards live in host memory: each gather first copies
the shard over PCIe (``topology.host_bandwidth_bps``), each reduce-scatter copies the gradient
shard back, and the optimizer runs on the CPU.

These are plain rules over the schedule's data (no SimPy): the engine's
:class:`~collsim.engine.dataparallel.DataParallel` plays them on the dp stream, the closed form
(:mod:`collsim.estimate`) walks them.
"""

from __future__ import annotations

from dataclasses import dataclass

from collsim.parallel.plan import Plan
from collsim.schedule.ops import ChunkModel, Segment, StageModel

__all__ = ["BytesPer", "DataParallelRules", "StateBytes"]


@dataclass(frozen=True, slots=True, kw_only=True)
class BytesPer:
    """Bytes per parameter of each model state, and per activation element."""

    param: float
    grad: float
    optimizer: float
    activation: float


@dataclass(frozen=True, slots=True, kw_only=True)
class StateBytes:
    """Model states of one rank, allocated for the whole step (bytes)."""

    parameters: float
    gradients: float
    optimizer: float
    ddp_buckets: float


@dataclass(frozen=True, slots=True, kw_only=True)
class DataParallelRules:
    """What the data-parallel dimension adds to a rank's step (see the module docstring)."""

    dp: int
    zero: int
    overlap: bool
    """DDP / ZeRO-1/2 buckets reduce as their gradients are ready (else after backward)."""
    prefetch: int
    """ZeRO-3: units gathered ahead of the one computing."""
    reshard_after_forward: bool
    offload: bool
    gradient_as_bucket_view: bool
    num_microbatches: int
    bytes_per: BytesPer
    host_bps: float

    @classmethod
    def from_plan(cls, plan: Plan, bytes_per: BytesPer, *, host_bps: float) -> DataParallelRules:
        par = plan.parallel
        return cls(
            dp=plan.dp,
            zero=par.zero,
            overlap=par.ddp.overlap,
            prefetch=par.fsdp.prefetch,
            reshard_after_forward=par.fsdp.reshard_after_forward,
            offload=par.zero == 3 and par.fsdp.offload,
            gradient_as_bucket_view=par.ddp.gradient_as_bucket_view,
            num_microbatches=plan.num_microbatches,
            bytes_per=bytes_per,
            host_bps=host_bps,
        )

    # ---- memory ------------------------------------------------------------------------------
    def state_bytes(self, stage: StageModel) -> StateBytes:
        n = float(self.dp)
        numel = float(stage.numel)
        b = self.bytes_per
        params = numel * b.param / (n if self.zero >= 3 else 1.0)
        grads = numel * b.grad / (n if self.zero >= 2 else 1.0)
        states = numel * b.optimizer / (n if self.zero >= 1 else 1.0)
        if self.offload:
            params = grads = states = 0.0
        return StateBytes(
            parameters=params,
            gradients=grads,
            optimizer=states,
            ddp_buckets=self.ddp_bucket_bytes(stage),
        )

    def ddp_bucket_bytes(self, stage: StageModel) -> float:
        """Bytes of torch DDP's flat bucket tensors kept beside ``param.grad``.

        torch ``DistributedDataParallel`` (C++ ``Reducer::initialize_buckets``) allocates one
        flat gradient tensor per bucket for the life of the model; with
        ``gradient_as_bucket_view=False`` (torch's default) ``param.grad`` is a separate tensor,
        so the gradients are held twice; with True, ``param.grad`` is a view into its bucket
        and nothing is added. Only plain DDP (ZeRO 0) over more than one replica builds them.
        """
        if self.zero != 0 or self.dp < 2 or self.gradient_as_bucket_view:
            return 0.0
        return float(stage.numel) * self.bytes_per.grad

    # ---- buckets (ZeRO 0-2) ------------------------------------------------------------------
    @property
    def uses_buckets(self) -> bool:
        return self.zero in (0, 1, 2)

    def reduces_in(self, microbatch: int) -> bool:
        """Does this micro-batch's backward reduce gradients? (no_sync before the last)."""
        if self.dp < 2:
            return False
        return self.zero == 2 or microbatch == self.num_microbatches - 1

    @property
    def bucket_op(self) -> str:
        return "all_reduce" if self.zero == 0 else "reduce_scatter"

    @property
    def holds_bucket_buffer(self) -> bool:
        """ZeRO-2 keeps a reduced bucket's buffer until its reduce-scatter ends."""
        return self.zero == 2

    def gathers_after_optimizer(self, stage: StageModel) -> list[float]:
        """ZeRO-1/2: the all-gathers of the updated parameters, bucket by bucket (bytes)."""
        if self.zero not in (1, 2) or self.dp < 2:
            return []
        return [
            bucket.numel * self.bytes_per.param
            for chunk in stage.chunks
            for bucket in chunk.buckets
        ]

    # ---- FSDP units (ZeRO 3) -----------------------------------------------------------------
    @staticmethod
    def unit_key(chunk: ChunkModel, seg: Segment) -> str | int:
        """FSDP unit of a segment. With the embedding and the head in one chunk, both belong
        to the root unit (torch FSDP: the root holds the non-wrapped, possibly tied,
        parameters; it is gathered for the whole forward and backward, never resharded after
        forward, and reduce-scattered at the end of backward)."""
        if seg.key in ("embedding", "head") and chunk.has_root:
            return "root"
        return seg.key

    @staticmethod
    def unit_numel(chunk: ChunkModel, key: str | int) -> float:
        keys = ("embedding", "head") if key == "root" else (key,)
        return float(sum(t.numel for t in chunk.tensors if t.segment in keys))

    def gather_bytes(self, chunk: ChunkModel, key: str | int) -> float:
        return self.unit_numel(chunk, key) * self.bytes_per.param

    def grad_bytes(self, chunk: ChunkModel, key: str | int) -> float:
        return self.unit_numel(chunk, key) * self.bytes_per.grad

    def offload_s(self, size_bytes: float) -> float:
        """PCIe copy of this rank's shard of ``size_bytes`` before a gather / after a
        reduce-scatter (FSDP CPU offload), else 0."""
        return size_bytes / self.dp / self.host_bps if self.offload else 0.0

    def releases(self, chunk: ChunkModel, seg: Segment, *, forward: bool) -> bool:
        """Is the unit of ``seg`` released after it (resharded, and reduced in backward)?"""
        ukey = self.unit_key(chunk, seg)
        if ukey == "root" and (forward or seg.key != "embedding"):
            return False  # the root stays gathered until its last backward segment
        return not (forward and not self.reshard_after_forward)

    @property
    def reduces_units(self) -> bool:
        """ZeRO-3 reduce-scatters a unit's gradient (or copies it to the host with offload)."""
        return self.dp > 1 or self.offload
