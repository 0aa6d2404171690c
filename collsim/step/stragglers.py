"""The ``stragglers`` scenario section: slow GPUs, slow nodes and degraded links on named ranks.

Derivations, measurements and sources: docs/derivations.md, ``collsim.step.stragglers``.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from collsim.core.errors import ConfigError
from collsim.core.schema import (
    ListOf,
    Section,
    Value,
    choice_value,
    non_negative_value,
    read_described,
    text_value,
    values_of,
)
from collsim.core.yamlio import ConfigReader

if TYPE_CHECKING:
    from collsim.cluster.topology import Topology
    from collsim.parallel.plan import Plan
    from collsim.step.build import StepSchedule
    from collsim.step.ops import Segment, StageModel, Step

__all__ = [
    "STRAGGLERS",
    "PORTS",
    "SlowGPU",
    "SlowNode",
    "SlowLink",
    "StragglerConfig",
    "StragglerPlan",
    "read_stragglers",
    "degrade_topology",
    "stretch_stage",
    "stretch_schedule",
]

_PREFIX = "stragglers"

#: The ports of a rank a ``slow_link`` may name: its NIC (tx and rx) or its NVLink port.
PORTS = ("nic", "nvlink")


def _err(message: str, key: str) -> ConfigError:
    return ConfigError(message, key_path=f"{_PREFIX}.{key}")


#: The smallest clock or bandwidth factor: a part at a thousandth of full speed. Below it the
#: step times run to hundreds of digits (1e-300 gives a step of 1e299 s) and say nothing a
#: thousandth does not; a stopped part is a failure (``collsim goodput``), not a straggler.
MIN_FACTOR = 0.001


def _check_factor(value: float, key: str) -> None:
    if not MIN_FACTOR <= value <= 1.0:
        raise _err(f"must be in [{MIN_FACTOR:g}, 1] (1 = full speed), got {value:g}", key)


def _check_indices(values: tuple[int, ...], key: str) -> None:
    if not values:
        raise _err("must name at least one", key)
    for v in values:
        if isinstance(v, bool) or not isinstance(v, int) or v < 0:
            raise _err(f"must be non-negative integers, got {v!r}", key)
    if len(set(values)) != len(values):
        raise _err(f"names an entry twice: {list(values)}", key)


@dataclass(frozen=True, slots=True, kw_only=True)
class SlowGPU:
    """GPUs whose compute runs at ``clock_factor`` of full speed."""

    ranks: tuple[int, ...]
    clock_factor: float

    def __post_init__(self) -> None:
        _check_indices(self.ranks, "slow_gpu.ranks")
        _check_factor(self.clock_factor, "slow_gpu.clock_factor")


@dataclass(frozen=True, slots=True, kw_only=True)
class SlowNode:
    """Nodes whose every GPU computes at ``clock_factor`` of full speed."""

    nodes: tuple[int, ...]
    clock_factor: float

    def __post_init__(self) -> None:
        _check_indices(self.nodes, "slow_node.nodes")
        _check_factor(self.clock_factor, "slow_node.clock_factor")


@dataclass(frozen=True, slots=True, kw_only=True)
class SlowLink:
    """Links at ``bandwidth_factor`` of their capacity: a port of named ranks, or named links."""

    bandwidth_factor: float
    ranks: tuple[int, ...] = ()
    port: str = "nic"
    links: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        _check_factor(self.bandwidth_factor, "slow_link.bandwidth_factor")
        if self.port not in PORTS:
            raise _err(f"must be one of {', '.join(PORTS)}; got {self.port!r}", "slow_link.port")
        if not self.ranks and not self.links:
            raise _err("name ranks (with a port) or links", "slow_link")
        if self.ranks:
            _check_indices(self.ranks, "slow_link.ranks")


@dataclass(frozen=True, slots=True, kw_only=True)
class StragglerPlan:
    """Stragglers resolved against a cluster: per-rank compute factors, per-link bandwidth
    factors (link index -> factor), and the ranks any of them touches."""

    compute_factors: dict[int, float]
    """Rank -> clock factor (< 1 only; ranks at full speed are absent)."""
    link_factors: dict[int, float]
    """Link index -> bandwidth factor (< 1 only)."""
    link_ranks: frozenset[int]
    """Ranks whose own links are degraded (their groups' calls are slower)."""

    @property
    def active(self) -> bool:
        return bool(self.compute_factors or self.link_factors)

    def tp_pace(self, plan: Plan) -> dict[int, float]:
        """Rank -> clock factor of its tensor-parallel group (its slowest member's), for the
        ranks of every group with a straggler."""
        out: dict[int, float] = {}
        for rank in self.compute_factors:
            group = plan.group_of(rank, "tp")
            pace = min(self.compute_factors.get(m, 1.0) for m in group)
            for m in group:
                out[m] = min(out.get(m, 1.0), pace)
        return out

    def stage_factors(self, plan: Plan) -> dict[tuple[int, int], float]:
        """(dp index, stage) -> the clock factor of that pipeline's stage (TP-paced)."""
        out: dict[tuple[int, int], float] = {}
        for rank, f in self.tp_pace(plan).items():
            c = plan.coords(rank)
            key = (c.dp, c.pp)
            out[key] = min(out.get(key, 1.0), f)
        return out


@dataclass(frozen=True, slots=True, kw_only=True)
class StragglerConfig:
    """The ``stragglers`` section."""

    slow_gpu: SlowGPU | None = None
    slow_node: SlowNode | None = None
    slow_link: SlowLink | None = None

    def resolve(self, topology: Topology) -> StragglerPlan:
        """Check ranks, nodes and links against ``topology`` and build the factors.

        Raises:
            ConfigError: a rank, node, link name or port the cluster does not have.
        """
        n = topology.num_ranks
        compute: dict[int, float] = {}
        if self.slow_gpu is not None:
            for r in self.slow_gpu.ranks:
                if r >= n:
                    raise _err(f"rank {r} is not in the cluster (0-{n - 1})", "slow_gpu.ranks")
                compute[r] = compute.get(r, 1.0) * self.slow_gpu.clock_factor
        if self.slow_node is not None:
            for node in self.slow_node.nodes:
                if node >= topology.num_nodes:
                    raise _err(
                        f"node {node} is not in the cluster (nodes 0-{topology.num_nodes - 1})",
                        "slow_node.nodes",
                    )
                for r in range(node * topology.gpus_per_node, (node + 1) * topology.gpus_per_node):
                    compute[r] = compute.get(r, 1.0) * self.slow_node.clock_factor
        links: dict[int, float] = {}
        link_ranks: set[int] = set()
        sl = self.slow_link
        if sl is not None:
            for r in sl.ranks:
                if r >= n:
                    raise _err(f"rank {r} is not in the cluster (0-{n - 1})", "slow_link.ranks")
                if sl.port == "nvlink":
                    owned = [topology.gpu_tx[r], topology.gpu_rx[r]]
                else:
                    if topology.nics is None or not topology.nic_tx:
                        raise _err(f"topology {topology.name} has no NICs", "slow_link.port")
                    node, k = topology.node_of(r), topology.nic_of(r)
                    owned = [topology.nic_tx[node][k], topology.nic_rx[node][k]]
                for link in owned:
                    links[link] = sl.bandwidth_factor
                link_ranks.add(r)
            by_name = {link.name: link.index for link in topology.links}
            for name in sl.links:
                if name not in by_name:
                    sample = ", ".join(list(by_name)[:4])
                    raise _err(
                        f"no link {name!r} in topology {topology.name} (names like {sample})",
                        "slow_link.links",
                    )
                links[by_name[name]] = sl.bandwidth_factor
                link_ranks.update(_ranks_of_link(topology, by_name[name]))
        return StragglerPlan(
            compute_factors={r: f for r, f in compute.items() if f < 1.0},
            link_factors={i: f for i, f in links.items() if f < 1.0},
            link_ranks=frozenset(link_ranks if any(f < 1.0 for f in links.values()) else ()),
        )


def _ranks_of_link(topology: Topology, index: int) -> set[int]:
    """The ranks whose traffic leaves or enters through link ``index`` (its GPU's port, its
    NIC, or every rank behind a leaf uplink)."""
    g = topology.gpus_per_node
    for r in range(topology.num_ranks):
        if index in (topology.gpu_tx[r], topology.gpu_rx[r]):
            return {r}
    for node, (tx, rx) in enumerate(zip(topology.nic_tx, topology.nic_rx)):
        for k, (a, b) in enumerate(zip(tx, rx)):
            if index in (a, b):
                return {r for r in range(node * g, (node + 1) * g) if topology.nic_of(r) == k}
    ranks: set[int] = set()
    for (k, group), link in [*topology.leaf_up.items(), *topology.leaf_down.items()]:
        if link == index:
            per_leaf = topology.fabric.nodes_per_leaf
            for node in range(group * per_leaf, min((group + 1) * per_leaf, topology.num_nodes)):
                for r in range(node * g, (node + 1) * g):
                    if not topology.fabric.rails or topology.nic_of(r) == k:
                        ranks.add(r)
    return ranks


_INDEX_RULE = "must be non-negative integers, got {item!r}"


def _indices(what: str, **kw: Any) -> ListOf:
    """A list of distinct rank or node indices (collsim.step.stragglers)."""
    return ListOf(
        items=non_negative_value("integer", f"A {what}."),
        description=f"{what.capitalize()}s.",
        min_items=1,
        unique=True,
        min_rule="must name at least one",
        item_rule=_INDEX_RULE,
        **kw,
    )


_FACTOR_RULE = "must be in [0.001, 1] (1 = full speed), got {value}"


def _factor(description: str, **kw: Any) -> Value:
    """A straggler's share of full speed, in [:data:`MIN_FACTOR`, 1]."""
    return Value(kind="number", description=description, minimum=MIN_FACTOR, maximum=1, **kw)


STRAGGLERS = Section(
    description="Slow GPUs, nodes and links (collsim run, collsim sweep).",
    fields={
        "slow_gpu": Section(
            description="GPUs whose compute runs slower.",
            fields={
                "ranks": _indices("rank", required=True),
                "clock_factor": _factor("Share of full speed.", required=True, rule=_FACTOR_RULE),
            },
        ),
        "slow_node": Section(
            description="Nodes whose every GPU computes slower.",
            fields={
                "nodes": _indices("node", required=True),
                "clock_factor": _factor("Share of full speed.", required=True, rule=_FACTOR_RULE),
            },
        ),
        "slow_link": Section(
            description="Links at a share of their capacity: a port of named ranks, or links.",
            one_of_required=(("ranks",), ("links",)),
            missing_rule="name ranks (with a port) or links",
            fields={
                "bandwidth_factor": _factor(
                    "Share of the link's capacity left.", required=True, rule=_FACTOR_RULE
                ),
                "ranks": ListOf(
                    items=non_negative_value("integer", "A rank."),
                    description="These ranks' port runs at the factor.",
                    unique=True,
                    item_rule=_INDEX_RULE,
                ),
                "port": choice_value("nic or nvlink.", values_of(PORTS)),
                "links": ListOf(
                    items=text_value("A link name (n1.nic3.tx, rail0.leaf1.up)."),
                    description="Links as the topology names them.",
                ),
            },
        ),
    },
)
"""The ``stragglers`` section of a scenario: what :func:`check` and :func:`read_stragglers`
follow."""

_SECTION_TYPES: dict[str, type[SlowGPU | SlowNode | SlowLink]] = {
    "slow_gpu": SlowGPU,
    "slow_node": SlowNode,
    "slow_link": SlowLink,
}


def read_stragglers(reader: ConfigReader) -> StragglerConfig:
    """Build the section from its reader (``collsim.study.scenario`` calls this), key by key as
    :data:`STRAGGLERS` describes them."""
    out: dict[str, Any] = {}
    for key, spec in STRAGGLERS.fields.items():
        if reader.get(key, dict, default=None) is None:
            continue
        assert isinstance(spec, Section)
        sec = reader.section(key)
        out[key] = _SECTION_TYPES[key](**read_described(sec, spec))
        sec.finish()
    reader.finish()
    return StragglerConfig(**out)


def degrade_topology(topology: Topology, link_factors: dict[int, float]) -> Topology:
    """A copy of ``topology`` whose links ``link_factors`` run at their factor of the line rate
    (closed-form prices and the flow network both read the copy; its caches start empty)."""
    if not link_factors:
        return topology
    capacity_bps = topology.link_capacity_bps.copy()
    for index, factor in link_factors.items():
        capacity_bps[index] *= factor
    return topology.replaced(
        links=[
            dataclasses.replace(link, bandwidth_bps=link.bandwidth_bps * link_factors[link.index])
            if link.index in link_factors
            else link
            for link in topology.links
        ],
        link_capacity_bps=capacity_bps,
        symmetric=False,  # the degraded links make some groups unlike their shifts
        name=f"{topology.name} (degraded links)",
    )


def _stretch_step(step: Step, factor: float) -> Step:
    if step.op:
        return dataclasses.replace(step, overlap_s=step.overlap_s / factor)
    return dataclasses.replace(step, seconds=step.seconds / factor)


def _stretch_segment(seg: Segment, factor: float) -> Segment:
    return dataclasses.replace(
        seg,
        steps=[_stretch_step(s, factor) for s in seg.steps],
        framework_s=seg.framework_s / factor,
    )


def _stretch_list(segs: list[Segment] | None, factor: float) -> list[Segment] | None:
    return None if segs is None else [_stretch_segment(s, factor) for s in segs]


def stretch_stage(stage: StageModel, factor: float) -> StageModel:
    """``stage`` with every compute step lasting ``1 / factor`` as long (TP collectives
    unchanged; the compute an overlapped collective hides behind is stretched too)."""
    if factor >= 1.0:
        return stage
    chunks = [
        dataclasses.replace(
            chunk,
            forward=[_stretch_segment(s, factor) for s in chunk.forward],
            backward=[_stretch_segment(s, factor) for s in chunk.backward],
            paired_forward=_stretch_list(chunk.paired_forward, factor),
            paired_backward=_stretch_list(chunk.paired_backward, factor),
            input_grad=_stretch_list(chunk.input_grad, factor),
            weight_grad=_stretch_list(chunk.weight_grad, factor),
        )
        for chunk in stage.chunks
    ]
    return dataclasses.replace(stage, chunks=chunks)


def stretch_schedule(schedule: StepSchedule, stage_factors: dict[int, float]) -> StepSchedule:
    """``schedule`` with the stages of ``stage_factors`` (stage -> clock factor) slowed: their
    compute steps and optimizer step last ``1 / factor`` as long."""
    stages = {s: stretch_stage(m, stage_factors.get(s, 1.0)) for s, m in schedule.stages.items()}
    optimizer = {s: t / stage_factors.get(s, 1.0) for s, t in schedule.optimizer_s.items()}
    framework = {s: t / stage_factors.get(s, 1.0) for s, t in schedule.framework_step_s.items()}
    return dataclasses.replace(
        schedule, stages=stages, optimizer_s=optimizer, framework_step_s=framework
    )
