"""Training and parallel-plan configuration: frozen dataclasses that check themselves.

These are the ``training`` and ``parallel`` sections of a scenario after loading. Values that are
malformed on their own raise :class:`ConfigError` with the key path. Combinations that cannot
work on a cluster (tp x pp x dp != GPUs, heads not divisible by tp, ...) are checked when the plan
is built against a model and a topology, and also raise ConfigError naming the key (exit 2); a
plan that does not fit in memory raises InfeasibleError (exit 1).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import StrEnum

from collsim.errors import ConfigError

__all__ = [
    "Dtype",
    "Optimizer",
    "Recompute",
    "ScheduleKind",
    "TrainingConfig",
    "DDPConfig",
    "FSDPConfig",
    "ParallelConfig",
]


class Dtype(StrEnum):
    BF16 = "bf16"
    FP16 = "fp16"
    FP32 = "fp32"
    FP8 = "fp8"

    @property
    def size_bytes(self) -> int:
        return {"bf16": 2, "fp16": 2, "fp32": 4, "fp8": 1}[self.value]


class Optimizer(StrEnum):
    ADAM = "adam"  # Adam / AdamW: fp32 master + m + v
    SGD = "sgd"  # SGD with momentum: fp32 master + momentum


class Recompute(StrEnum):
    NONE = "none"
    SELECTIVE = "selective"
    FULL = "full"


class ScheduleKind(StrEnum):
    GPIPE = "gpipe"
    ONE_F_ONE_B = "1f1b"
    INTERLEAVED = "interleaved"


def _enum(enum_cls: type[StrEnum], value: object, key: str) -> StrEnum:
    try:
        return enum_cls(str(value).lower())
    except ValueError:
        choices = ", ".join(e.value for e in enum_cls)
        raise ConfigError(f"must be one of {choices}; got {value!r}", key_path=key) from None


def _positive(value: float, key: str) -> None:
    if value <= 0:
        raise ConfigError(f"must be > 0, got {value}", key_path=key)


@dataclass(frozen=True, slots=True, kw_only=True)
class TrainingConfig:
    """The ``training`` section."""

    global_batch: int
    """Sequences per optimizer step, over all data-parallel replicas."""
    micro_batch: int = 1
    """Sequences per micro-batch on one pipeline/data-parallel rank."""
    dtype: Dtype = Dtype.BF16
    """Compute and activation dtype (mixed precision keeps fp32 master weights with Adam)."""
    optimizer: Optimizer = Optimizer.ADAM
    recompute: Recompute = Recompute.NONE

    def __post_init__(self) -> None:
        _positive(self.global_batch, "training.global_batch")
        _positive(self.micro_batch, "training.micro_batch")
        object.__setattr__(self, "dtype", _enum(Dtype, self.dtype, "training.dtype"))
        object.__setattr__(
            self, "optimizer", _enum(Optimizer, self.optimizer, "training.optimizer")
        )
        object.__setattr__(
            self, "recompute", _enum(Recompute, self.recompute, "training.recompute")
        )


@dataclass(frozen=True, slots=True, kw_only=True)
class DDPConfig:
    """``parallel.ddp``: gradient buckets as torch DistributedDataParallel builds them."""

    bucket_mb: float = 25.0
    """Bucket capacity in MB (torch's bucket_cap_mb, 1 MB = 2**20 bytes there)."""
    first_bucket_mb: float = 1.0
    """torch's small first bucket (dist._DEFAULT_FIRST_BUCKET_BYTES = 1 MiB)."""
    overlap: bool = True
    """Launch each bucket's all-reduce as soon as its last gradient is produced."""
    gradient_as_bucket_view: bool = False
    """torch DDP's ``gradient_as_bucket_view`` (default False there too): when False, DDP keeps
    flat bucket tensors beside ``param.grad``, one more copy of the gradients in memory; when
    True, the gradients are views into the buckets."""

    def __post_init__(self) -> None:
        _positive(self.bucket_mb, "parallel.ddp.bucket_mb")
        _positive(self.first_bucket_mb, "parallel.ddp.first_bucket_mb")


@dataclass(frozen=True, slots=True, kw_only=True)
class FSDPConfig:
    """``parallel.fsdp``: per-layer units, prefetch, reshard, offload (ZeRO-3 / FSDP)."""

    prefetch: int = 1
    """How many units ahead the all-gather is issued (0 = no prefetch), forward and backward."""
    reshard_after_forward: bool = True
    offload: bool = False
    """Keep sharded parameters, gradients and optimizer state in CPU memory (PCIe traffic)."""

    def __post_init__(self) -> None:
        if self.prefetch < 0:
            raise ConfigError(
                f"must be >= 0, got {self.prefetch}", key_path="parallel.fsdp.prefetch"
            )


@dataclass(frozen=True, slots=True, kw_only=True)
class ParallelConfig:
    """The ``parallel`` section: TP x PP x DP, schedule, ZeRO stage, DDP and FSDP knobs."""

    tp: int = 1
    pp: int = 1
    dp: int = 1
    schedule: ScheduleKind = ScheduleKind.ONE_F_ONE_B
    virtual_stages: int = 1
    """Model chunks per pipeline stage (interleaved 1F1B); 1 otherwise."""
    sequence_parallel: bool = False
    zero: int = 0
    """0 = DDP, 1 = optimizer states sharded, 2 = + gradients, 3 = + parameters (FSDP full
    shard)."""
    ddp: DDPConfig = field(default_factory=DDPConfig)
    fsdp: FSDPConfig = field(default_factory=FSDPConfig)

    def __post_init__(self) -> None:
        for key in ("tp", "pp", "dp", "virtual_stages"):
            _positive(getattr(self, key), f"parallel.{key}")
        object.__setattr__(
            self, "schedule", _enum(ScheduleKind, self.schedule, "parallel.schedule")
        )
        if self.zero not in (0, 1, 2, 3):
            raise ConfigError(
                f"must be one of 0, 1, 2, 3; got {self.zero!r}", key_path="parallel.zero"
            )
        if self.virtual_stages > 1 and self.schedule is not ScheduleKind.INTERLEAVED:
            raise ConfigError(
                f"virtual_stages > 1 needs schedule: interleaved, got schedule: {self.schedule}",
                key_path="parallel.virtual_stages",
            )

    @property
    def world_size(self) -> int:
        return self.tp * self.pp * self.dp
