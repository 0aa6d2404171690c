"""The parallel plan: checks a TP x PP x DP combination and maps ranks onto the cluster.

Rank layout follows Megatron-LM's default order (Narayanan et al. 2021, section 3.3: "tensor
model parallelism within a multi-GPU server, pipeline model parallelism across servers"):
tensor parallel is innermost (consecutive ranks, inside a node), then pipeline, then data
parallel outermost::

    rank = dp_index * (pp * tp) + pp_index * tp + tp_index

With interleaved 1F1B each stage holds ``virtual_stages`` model chunks; chunk ``c`` of stage
``s`` is virtual stage ``c * pp + s`` and holds the contiguous layers of that virtual stage
(Megatron's ``get_num_layers_to_build`` with a virtual pipeline).
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass, field
from enum import StrEnum
from typing import TYPE_CHECKING

from collsim.errors import CollsimWarning, ConfigError
from collsim.parallel.config import ParallelConfig, ScheduleKind, TrainingConfig

if TYPE_CHECKING:
    from collsim.topology import Topology
    from collsim.workload.model import TransformerSpec

__all__ = ["ParallelAxis", "RankCoords", "Plan", "build_plan"]


class ParallelAxis(StrEnum):
    """A parallelism axis (``dp`` also carries ZeRO / FSDP traffic)."""

    TP = "tp"
    PP = "pp"
    DP = "dp"


@dataclass(frozen=True, slots=True)
class RankCoords:
    """Where a rank sits in the TP x PP x DP grid."""

    dp: int
    pp: int
    tp: int


@dataclass(frozen=True, slots=True, kw_only=True)
class Plan:
    """A checked plan: sizes, micro-batches, layer split and the rank mapping.

    Build it with :func:`build_plan`; the engine and the reports read it.
    """

    topology: Topology
    """The cluster (``collsim.topology.Topology``)."""
    spec: TransformerSpec
    """The model (``collsim.workload.TransformerSpec``)."""
    training: TrainingConfig
    parallel: ParallelConfig
    num_microbatches: int
    """Micro-batches per step on one data-parallel replica: global / (micro x dp)."""
    warnings: tuple[str, ...] = field(default=())

    @property
    def tp(self) -> int:
        return self.parallel.tp

    @property
    def pp(self) -> int:
        return self.parallel.pp

    @property
    def dp(self) -> int:
        return self.parallel.dp

    @property
    def virtual_stages(self) -> int:
        return self.parallel.virtual_stages

    @property
    def num_gpus(self) -> int:
        return self.tp * self.pp * self.dp

    @property
    def layers_per_chunk(self) -> int:
        return self.spec.num_layers // (self.pp * self.virtual_stages)

    @property
    def layers_per_stage(self) -> int:
        return self.spec.num_layers // self.pp

    # ---- mapping ---------------------------------------------------------------------------
    def rank(self, *, dp: int, pp: int, tp: int) -> int:
        """Global rank of grid position (dp, pp, tp)."""
        return (dp * self.pp + pp) * self.tp + tp

    def coords(self, rank: int) -> RankCoords:
        """Grid position of a global rank."""
        tp = rank % self.tp
        pp = (rank // self.tp) % self.pp
        dp = rank // (self.tp * self.pp)
        return RankCoords(dp=dp, pp=pp, tp=tp)

    def group_of(self, rank: int, axis: ParallelAxis | str) -> tuple[int, ...]:
        """The ranks of ``rank``'s group along ``axis``, in group order."""
        c = self.coords(rank)
        match ParallelAxis(axis):
            case ParallelAxis.TP:
                return tuple(self.rank(dp=c.dp, pp=c.pp, tp=i) for i in range(self.tp))
            case ParallelAxis.PP:
                return tuple(self.rank(dp=c.dp, pp=i, tp=c.tp) for i in range(self.pp))
            case ParallelAxis.DP:
                return tuple(self.rank(dp=i, pp=c.pp, tp=c.tp) for i in range(self.dp))
            case _:  # pragma: no cover - StrEnum conversion already rejects others
                raise ConfigError(f"unknown axis {axis!r}")

    def groups(self, axis: ParallelAxis | str) -> list[tuple[int, ...]]:
        """All groups along ``axis``, each once, ordered by their first rank."""
        axis = ParallelAxis(axis)
        tp, pp, dp = self.tp, self.pp, self.dp
        firsts = [
            self.rank(dp=d, pp=s, tp=t)
            for d in range(dp)
            for s in range(pp)
            for t in range(tp)
            if (axis is ParallelAxis.TP and t == 0)
            or (axis is ParallelAxis.PP and s == 0)
            or (axis is ParallelAxis.DP and d == 0)
        ]
        return sorted((self.group_of(r, axis) for r in firsts), key=lambda g: g[0])

    def stage_ranks(self, stage: int) -> list[int]:
        """All ranks that run pipeline stage ``stage`` (every tp and dp index)."""
        return [self.rank(dp=d, pp=stage, tp=t) for d in range(self.dp) for t in range(self.tp)]

    def chunk_layers(self, stage: int, chunk: int) -> range:
        """Global layer indices of model chunk ``chunk`` on ``stage`` (virtual stage c*pp+s)."""
        first = (chunk * self.pp + stage) * self.layers_per_chunk
        return range(first, first + self.layers_per_chunk)

    def describe_mapping(self) -> str:
        """A readable account of the rank layout and of one group of each axis."""
        topo = self.topology
        gpn = topo.gpus_per_node

        def nodes(ranks: tuple[int, ...] | list[int]) -> str:
            ids = sorted({r // gpn for r in ranks})
            return _span(ids)

        lines = [
            f"{self.num_gpus} GPUs = tp {self.tp} x pp {self.pp} x dp {self.dp} "
            f"on {topo.num_nodes} node{'s' if topo.num_nodes != 1 else ''} x {gpn} GPUs",
            f"rank = dp_index * {self.pp * self.tp} + pp_index * {self.tp} + tp_index "
            "(tp innermost, then pp, dp outermost)",
        ]
        for axis in ParallelAxis:
            groups = self.groups(axis)
            g = groups[0]
            lines.append(
                f"{axis.value} groups: {len(groups)} of {len(g)}; first {_ranks(g)} "
                f"on node(s) {nodes(g)}"
            )
        for stage in range(self.pp):
            ranks = self.stage_ranks(stage)
            layers = [list(self.chunk_layers(stage, c)) for c in range(self.virtual_stages)]
            spans = ", ".join(f"{ls[0]}-{ls[-1]}" for ls in layers)
            lines.append(
                f"stage {stage}: layers {spans}; ranks {_ranks(ranks[: self.tp])}"
                f"{' + dp replicas' if self.dp > 1 else ''}; nodes {nodes(ranks)}"
            )
        return "\n".join(lines)


def _span(ids: list[int]) -> str:
    if len(ids) == 1:
        return str(ids[0])
    if ids == list(range(ids[0], ids[-1] + 1)):
        return f"{ids[0]}-{ids[-1]}"
    if len(ids) <= 8:
        return ",".join(map(str, ids))
    return f"{','.join(map(str, ids[:4]))},...,{ids[-1]} ({len(ids)})"


def _ranks(ranks: tuple[int, ...] | list[int]) -> str:
    ranks = list(ranks)
    if len(ranks) <= 8:
        return "[" + ", ".join(map(str, ranks)) + "]"
    return f"[{ranks[0]}, {ranks[1]}, ..., {ranks[-1]}]"


def build_plan(
    topology: Topology, spec: TransformerSpec, training: TrainingConfig, parallel: ParallelConfig
) -> Plan:
    """Check a plan against the model and the cluster, and map its ranks.

    Raises:
        ConfigError: tp x pp x dp is not the cluster's GPU count (``parallel``), heads not
            divisible by tp (``parallel.tp``), layers not divisible by pp x virtual_stages
            (``parallel.pp``), global batch not divisible by micro_batch x dp
            (``training.global_batch``), interleaving with a micro-batch count that is not a
            multiple of pp (``parallel.schedule``, Megatron's rule).

    Warns:
        CollsimWarning: tp larger than a node; fewer micro-batches than stages (bubble).
    """
    tp, pp, dp, v = parallel.tp, parallel.pp, parallel.dp, parallel.virtual_stages
    gpus = topology.num_ranks
    if tp * pp * dp != gpus:
        raise ConfigError(
            f"tp x pp x dp = {tp} x {pp} x {dp} = {tp * pp * dp} must equal the GPUs of the "
            f"cluster (cluster.nodes x gpus per node = {topology.num_nodes} x "
            f"{topology.gpus_per_node} = {gpus})",
            key_path="parallel",
        )
    if spec.num_heads % tp:
        raise ConfigError(
            f"model heads ({spec.num_heads}) must be divisible by tp, got {tp}",
            key_path="parallel.tp",
        )
    if spec.ffn_hidden % tp:
        raise ConfigError(
            f"model ffn_hidden ({spec.ffn_hidden}) must be divisible by tp, got {tp}",
            key_path="parallel.tp",
        )
    if spec.num_layers % (pp * v):
        key = "parallel.virtual_stages" if v > 1 else "parallel.pp"
        raise ConfigError(
            f"model layers ({spec.num_layers}) must be divisible by "
            f"pp x virtual_stages = {pp} x {v}",
            key_path=key,
        )
    if training.global_batch % (training.micro_batch * dp):
        raise ConfigError(
            f"global batch ({training.global_batch}) must be divisible by micro_batch x dp = "
            f"{training.micro_batch} x {dp}",
            key_path="training.global_batch",
        )
    m = training.global_batch // (training.micro_batch * dp)
    if parallel.schedule is ScheduleKind.INTERLEAVED and pp > 1 and m % pp:
        raise ConfigError(
            f"interleaved 1F1B needs the number of micro-batches ({m}) divisible by pp ({pp})",
            key_path="parallel.schedule",
        )
    notes: list[str] = []
    if tp > topology.gpus_per_node:
        notes.append(
            f"tp ({tp}) is larger than a node ({topology.gpus_per_node} GPUs): "
            "tensor-parallel collectives cross the network"
        )
    if m < pp:
        notes.append(
            f"fewer micro-batches ({m}) than pipeline stages ({pp}): most of the step "
            "is pipeline bubble"
        )
    for note in notes:
        warnings.warn(note, CollsimWarning, stacklevel=2)
    return Plan(
        topology=topology,
        spec=spec,
        training=training,
        parallel=parallel,
        num_microbatches=m,
        warnings=tuple(notes),
    )
