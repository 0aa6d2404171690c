"""What a simulated training step returns: :class:`StepResult` and its records.

The engine fills these; reports, the CLI, sweeps and plots read them. ``StepResult.to_dict()`` is
the JSON that ``collsim run --json`` writes (keys are pinned by a test).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import asdict, dataclass, field
from typing import Any

__all__ = ["BREAKDOWN_KEYS", "MEMORY_KEYS", "CollectiveStat", "TraceEvent", "StepResult"]

#: Parts of the step time, in seconds. They add up to ``step_time_s`` for the critical rank.
BREAKDOWN_KEYS = (
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
)
"""framework: work of the training stack beside the model's kernels (FSDP copy-in and
copy-out, gradient casts, the gradient-norm pass, host time per step; see
:mod:`collsim.workload.framework`); interference: compute slowed while collectives share the
GPU (:mod:`collsim.workload.interference`); ep_exposed: expert-parallel (and expert
tensor-parallel) collectives the compute stream waits for; cp_exposed: context-parallel KV
exchange beyond the attention it overlaps."""

#: Categories of memory per GPU, in bytes, at the moment of the peak.
MEMORY_KEYS = ("parameters", "gradients", "optimizer", "activations", "buffers")


@dataclass(slots=True)
class CollectiveStat:
    """All collectives of one kind issued by the representative ranks in one step."""

    axis: str
    """Parallel axis of the group: ``tp``, ``pp``, ``dp`` (``dp`` covers ZeRO/FSDP too)."""
    op: str
    """Collective op name (``all_reduce``, ``all_gather``, ``send_recv``, ...)."""
    group_size: int
    algorithm: str
    count: int
    """Number of calls per step on one rank."""
    size_bytes: float
    """nccl-tests size of one call."""
    time_s: float
    """Total link time of all calls (not exposed time)."""
    busbw_bps: float
    """Bus bandwidth of one call, nccl-tests convention."""

    @property
    def total_bytes(self) -> float:
        return self.count * self.size_bytes


@dataclass(slots=True)
class TraceEvent:
    """One slice on one stream of one rank, for timelines and Perfetto traces."""

    rank: int
    stream: str
    """``compute``, ``tp``, ``pp``, ``dp`` (``dp`` for FSDP/ZeRO traffic too), ``offload``."""
    name: str
    """What ran: ``fwd mb3 L12``, ``all_reduce bucket 4``, ..."""
    start_s: float
    end_s: float
    args: dict[str, Any] = field(default_factory=dict)
    """Extra facts (bytes, algorithm, micro-batch, layer)."""


@dataclass(slots=True)
class StepResult:
    """The outcome of one simulated training step."""

    step_time_s: float
    tokens_per_s: float
    model_tflops_per_gpu: float
    hardware_tflops_per_gpu: float
    mfu: float
    hfu: float
    breakdown_s: dict[str, float]
    """Keys of :data:`BREAKDOWN_KEYS`, for the rank that sets the step time."""
    memory_peak_bytes: float
    """Peak memory of the most loaded GPU."""
    memory_bytes: dict[str, float]
    """Keys of :data:`MEMORY_KEYS`, on that GPU at its peak."""
    memory_capacity_bytes: float
    fits: bool
    num_gpus: int = 0
    collectives: list[CollectiveStat] = field(default_factory=list)
    warnings: list[str] = field(default_factory=list)
    mapping: str = ""
    """Human-readable rank mapping (which ranks form the tp / pp / dp groups)."""
    memory_timeline: Mapping[int, list[tuple[float, float]]] = field(default_factory=dict)
    """rank -> [(time_s, bytes in use)], step-wise, for simulated ranks."""
    trace_events: list[TraceEvent] = field(default_factory=list)
    details: dict[str, Any] = field(default_factory=dict)
    """Anything else worth keeping (per-stage times, number of micro-batches, ...)."""

    @property
    def num_microbatches(self) -> int:
        """Micro-batches per replica (``details["num_microbatches"]``)."""
        return int(self.details.get("num_microbatches", 0))

    def to_dict(self) -> dict[str, Any]:
        """The JSON-ready summary (no timeline or trace events)."""
        return {
            "step_time_s": self.step_time_s,
            "tokens_per_s": self.tokens_per_s,
            "model_tflops_per_gpu": self.model_tflops_per_gpu,
            "hardware_tflops_per_gpu": self.hardware_tflops_per_gpu,
            "mfu": self.mfu,
            "hfu": self.hfu,
            "breakdown_s": dict(self.breakdown_s),
            "memory_peak_bytes": self.memory_peak_bytes,
            "memory_bytes": dict(self.memory_bytes),
            "memory_capacity_bytes": self.memory_capacity_bytes,
            "fits": self.fits,
            "num_gpus": self.num_gpus,
            "collectives": [
                {**asdict(stat), "total_bytes": stat.total_bytes} for stat in self.collectives
            ],
            "warnings": list(self.warnings),
            "mapping": self.mapping,
            "details": dict(self.details),
        }
