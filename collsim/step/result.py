"""What a simulated training step returns: :class:`StepResult` and its records.

The engine fills these; reports, the CLI, sweeps and plots read them. ``StepResult.to_dict()`` is
the JSON that ``collsim run --json`` writes (keys are pinned by a test).
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from dataclasses import asdict, dataclass, field, fields
from typing import Any

__all__ = [
    "BREAKDOWN_KEYS",
    "MEMORY_KEYS",
    "Breakdown",
    "CollectiveStat",
    "ContentionEffect",
    "StragglerReport",
    "TraceEvent",
    "StepResult",
]

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


@dataclass(frozen=True, slots=True)
class Breakdown(Mapping[str, float]):
    """The step time of the rank that sets it, in parts (seconds; :data:`BREAKDOWN_KEYS`, in
    that order), which add up to the step. Reads as a mapping too (``breakdown["compute"]``)."""

    compute: float = 0.0
    tp_exposed: float = 0.0
    pp_exposed: float = 0.0
    dp_exposed: float = 0.0
    ep_exposed: float = 0.0
    cp_exposed: float = 0.0
    bubble: float = 0.0
    framework: float = 0.0
    interference: float = 0.0
    optimizer: float = 0.0

    @classmethod
    def of(cls, parts: Mapping[str, float]) -> Breakdown:
        """The parts of :data:`BREAKDOWN_KEYS` found in ``parts`` (the others 0 s)."""
        if isinstance(parts, Breakdown):
            return parts
        return cls(**{key: float(parts[key]) for key in BREAKDOWN_KEYS if key in parts})

    @property
    def total_s(self) -> float:
        """The parts added up: the step time of the rank they describe."""
        return sum(self[key] for key in BREAKDOWN_KEYS)

    def __getitem__(self, key: str) -> float:
        if key not in BREAKDOWN_KEYS:
            raise KeyError(key)
        value: float = getattr(self, key)
        return value

    def __iter__(self) -> Iterator[str]:
        return iter(BREAKDOWN_KEYS)

    def __len__(self) -> int:
        return len(BREAKDOWN_KEYS)


@dataclass(slots=True)
class StragglerReport:
    """What the stragglers cost and who waited for whom (``collsim run``'s straggler lines)."""

    clock_factors: dict[int, float]
    """Rank -> clock factor of each slowed GPU."""
    tp_paced_ranks: list[int]
    """Ranks whose tensor-parallel group runs at its slowest member's pace."""
    stage_factors: dict[str, float]
    """``dp{d}.pp{s}`` -> the factor that stage's compute runs at."""
    degraded_links: dict[str, float]
    """Link name -> bandwidth factor."""
    baseline_step_time_s: float
    """The step without stragglers."""
    step_time_s: float
    slowdown: float
    """``step_time_s / baseline_step_time_s``."""
    extra_s: float
    critical_rank: int | None
    longest_wait: dict[str, Any] | None
    """The first of ``waits`` (None in closed form)."""
    waits: list[dict[str, Any]]
    """Per stream, the call whose rendezvous waited longest (the engine's
    ``rendezvous_waits``): ``axis, group, call, wait_s, waited_for, waits_s, for_straggler``."""

    def as_dict(self) -> dict[str, Any]:
        """The JSON of ``details["stragglers"]``, fields in order."""
        return {f.name: getattr(self, f.name) for f in fields(self)}


@dataclass(slots=True)
class ContentionEffect:
    """What link sharing on one contended axis adds to the step (the engine's
    ``contention_effects``)."""

    axis: str
    delta_s: float
    """The step with this axis (and those before it) on the flow-level network, minus without."""
    links: list[str]
    """Names of the links a ring step of all its groups oversubscribes."""
    closed_s: float | None = None
    """The closed form's step (first effect only)."""
    des_s: float | None = None
    """The engine's step (first effect only)."""

    def as_dict(self) -> dict[str, Any]:
        """The JSON of one ``details["contention"]`` entry (the step times on the first only)."""
        out: dict[str, Any] = {"axis": self.axis, "delta_s": self.delta_s, "links": self.links}
        if self.closed_s is not None:
            out["closed_s"] = self.closed_s
        if self.des_s is not None:
            out["des_s"] = self.des_s
        return out


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
    breakdown_s: Breakdown
    """The parts of the step (:data:`BREAKDOWN_KEYS`) for the rank that sets the step time; a
    mapping given here is read into a :class:`Breakdown`."""
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
    memory_reserve_bytes: float = 0.0
    """What the device keeps from the framework (CUDA context, NCCL buffers, fragmentation)."""
    memory_datasheet_bytes: float = 0.0
    """The device's memory on its datasheet."""
    num_microbatches: int = 0
    """Micro-batches per data-parallel replica."""
    critical_rank: int = 0
    """The simulated rank that ends last (its parts are :attr:`breakdown_s`)."""
    peak_memory_rank: int = 0
    """The simulated rank with the highest memory peak."""
    fidelity: str = ""
    """``fused``, ``layer`` or ``closed``: how the step was played."""
    contended_axes: list[str] = field(default_factory=list)
    """Axes whose concurrent groups share a link (fidelity ``auto``)."""
    des_axes: list[str] = field(default_factory=list)
    """Axes whose calls ran on the flow-level network."""
    zero_communication: bool = False
    """Every communication was priced at 0 s."""
    simulated_ranks: list[int] = field(default_factory=list)
    stage_end_s: dict[int, float] = field(default_factory=dict)
    """Pipeline stage -> end of the step on its first rank (dp 0, tp 0)."""
    breakdown_by_stage_s: dict[int, dict[str, float]] = field(default_factory=dict)
    """Pipeline stage -> the compute stream's account on its first rank (dp 0, tp 0)."""
    memory_peak_bytes_by_rank: dict[int, float] = field(default_factory=dict)
    activation_peak_bytes_by_rank: dict[int, float] = field(default_factory=dict)
    rank_stages: dict[int, int] = field(default_factory=dict)
    """Simulated rank -> the pipeline stage it runs (:meth:`collsim.parallel.plan.Plan.stage_of`;
    the rows of the step plot)."""
    stragglers: StragglerReport | None = None
    """What the stragglers cost (None without stragglers)."""
    contention: list[ContentionEffect] | None = None
    """What link sharing adds, axis by axis (None unless contended axes ran on the DES)."""
    memory_reserved_bytes: float | None = None
    """Peak memory PyTorch's caching allocator reserves on the most loaded GPU
    (:mod:`collsim.step.allocator`); None where it was not replayed (a search's inner loop,
    a CPU device)."""
    allocator: dict[str, Any] | None = None
    """How the reserved memory was found: ``expandable_segments``, ``limit_bytes`` (what the
    allocator may hold), ``rank``, ``alloc_retries``, ``oom`` and the peaks per rank."""

    @property
    def memory_fragmentation_bytes(self) -> float | None:
        """Peak reserved minus peak allocated: what the allocator holds beyond the tensors
        (None when the replay ran out of memory: its reserved bytes are those at the failure)."""
        if self.memory_reserved_bytes is None or (self.allocator or {}).get("oom"):
            return None
        return self.memory_reserved_bytes - self.memory_peak_bytes

    def __post_init__(self) -> None:
        self.breakdown_s = Breakdown.of(self.breakdown_s)

    @property
    def details(self) -> dict[str, Any]:
        """The facts beside the headline figures, as ``collsim run --json`` writes them under
        ``details`` (a fresh dict; the typed fields are the source)."""
        out: dict[str, Any] = {
            "memory_reserve_bytes": self.memory_reserve_bytes,
            "memory_datasheet_bytes": self.memory_datasheet_bytes,
            "num_microbatches": self.num_microbatches,
            "critical_rank": self.critical_rank,
            "peak_memory_rank": self.peak_memory_rank,
            "fidelity": self.fidelity,
            "contended_axes": list(self.contended_axes),
            "des_axes": list(self.des_axes),
            "zero_communication": self.zero_communication,
            "simulated_ranks": list(self.simulated_ranks),
            "stage_end_s": dict(self.stage_end_s),
            "breakdown_by_stage_s": dict(self.breakdown_by_stage_s),
            "memory_peak_bytes_by_rank": dict(self.memory_peak_bytes_by_rank),
            "activation_peak_bytes_by_rank": dict(self.activation_peak_bytes_by_rank),
        }
        if self.stragglers is not None:
            out["stragglers"] = self.stragglers.as_dict()
        if self.contention is not None:
            out["contention"] = [effect.as_dict() for effect in self.contention]
        if self.allocator is not None:
            out["allocator"] = dict(self.allocator)
        return out

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
            "memory_reserved_bytes": self.memory_reserved_bytes,
            "memory_fragmentation_bytes": self.memory_fragmentation_bytes,
            "memory_bytes": dict(self.memory_bytes),
            "memory_capacity_bytes": self.memory_capacity_bytes,
            "fits": self.fits,
            "num_gpus": self.num_gpus,
            "collectives": [
                {**asdict(stat), "total_bytes": stat.total_bytes} for stat in self.collectives
            ],
            "warnings": list(self.warnings),
            "mapping": self.mapping,
            "details": self.details,
        }
