"""How the engine prices communication: closed form, or the flow-level DES with peers.

Two fidelities share one vocabulary (DESIGN.md): the closed form ``collectives.cost`` (no
contention: the group alone on its links) and the DES ``collectives.simulate`` on the
:class:`~collsim.cluster.network.FlowNetwork`, where the representative's group carries its
``peers`` —
the groups that run the same collective at the same time — so that shared links are accounted.

Whether the closed form is exact for an axis is decided from the topology and the mapping
(:func:`axis_contends`): one ring step of the representative's group and of all its peers is
laid on the links; if every flow still gets the bandwidth it would get alone (max-min fair
shares, as :func:`collsim.cluster.network.max_min_rates` computes them: equivalently, no link
carries
more than its capacity at the flows' solo rates), nothing contends and the closed form holds.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import numpy as np
import simpy

from collsim.collectives import Group, simulate
from collsim.collectives.direct import all_pairs_load
from collsim.core.errors import SimulationError
from collsim.core.vocab import CollectiveOp
from collsim.play.engine.streams import Work
from collsim.step.pricing import CallCost, ClosedPricer

if TYPE_CHECKING:
    from collsim.cluster.network import FlowNetwork
    from collsim.cluster.topology import Topology

__all__ = [
    "CallCost",
    "CommPricer",
    "all_to_all_contends",
    "axis_contends",
    "linked_peers",
    "shared_links",
]


def _ring_steps(groups: Sequence[tuple[int, ...]] | np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(senders, receivers) of one ring step of every group (a sequence of groups, or an array
    with a group per row): rank[i] -> rank[i+1]; a two-rank group sends once."""
    if isinstance(groups, np.ndarray):
        sizes = {groups.shape[1]} if groups.ndim == 2 and len(groups) else set()
    else:
        sizes = {len(g) for g in groups}
    if len(sizes) == 1:  # groups of one size (every axis's groups): as an array
        n = sizes.pop()
        grid = np.asarray(groups, dtype=np.int64).reshape(len(groups), n)
        if n == 2:
            return grid[:, 0].copy(), grid[:, 1].copy()
        if n < 2:
            return np.zeros(0, np.int64), np.zeros(0, np.int64)
        return grid.ravel(), np.roll(grid, -1, axis=1).ravel()
    src: list[int] = []
    dst: list[int] = []
    for group in groups:
        n = len(group)
        if n == 2:
            src.append(group[0])
            dst.append(group[1])
        elif n > 2:
            src.extend(group)
            dst.extend(group[1:])
            dst.append(group[0])
    return np.asarray(src, dtype=np.int64), np.asarray(dst, dtype=np.int64)


def _solo_loads(
    topology: Topology,
    groups: Sequence[tuple[int, ...]] | np.ndarray,
    capacity: np.ndarray | None,
) -> tuple[np.ndarray, np.ndarray, np.ndarray] | None:
    """The links one ring step of ``groups`` uses, each one's load when every flow runs at its
    solo rate (its path's slowest link), and their capacities, as three arrays over the used
    links only (a step of a 65,536-GPU cluster's groups touches a few thousand of its 268,704
    links); None with fewer than two flows."""
    src, dst = _ring_steps(groups)
    links = topology.path_links(src, dst)
    links = links[(links >= 0).any(axis=1)]  # flows to oneself move nothing
    if len(links) < 2:
        return None
    if capacity is None:
        capacity = topology.link_capacity_bps
    on = links >= 0
    caps = np.where(on, capacity[np.where(on, links, 0)], np.inf)
    solo = caps.min(axis=1)
    used, slot = np.unique(links[on], return_inverse=True)
    load = np.bincount(slot, weights=np.broadcast_to(solo[:, None], links.shape)[on])
    return used, load, capacity[used]


def axis_contends(
    topology: Topology,
    groups: Sequence[tuple[int, ...]] | np.ndarray,
    *,
    capacity: np.ndarray | None = None,
) -> bool:
    """True when one ring step of ``groups`` (run together) slows some flow below its solo rate.

    Each group contributes the flows rank[i] -> rank[i+1] (a ring step; for two ranks, one
    send). A flow's solo rate is its path's slowest link; its shared rate comes from max-min
    fair sharing of every link by all flows of all groups. Max-min fair shares give every flow
    its solo rate exactly when no link carries more than its capacity at solo rates (an
    oversubscribed link cannot; otherwise the solo rates are feasible, and a flow below its
    solo rate would need a saturated bottleneck link on which some other flow exceeds its own
    solo rate, which no flow can).
    """
    loads = _solo_loads(topology, groups, capacity)
    if loads is None:
        return False
    _, load, cap = loads
    return bool(np.any(load > cap * (1 + 1e-9)))


def all_to_all_contends(
    topology: Topology,
    groups: Sequence[tuple[int, ...]] | np.ndarray,
    *,
    capacity: np.ndarray | None = None,
) -> bool:
    """True when the all-to-alls of ``groups`` (run together, as the EP groups of a stage do)
    slow one another down.

    A ring step says little about an all-to-all, whose every rank sends to every other at
    once. Each group's per-link load is the direct algorithm's all-pairs load
    (:func:`collsim.collectives.direct.all_pairs_load`, equal transfers); alone, a group
    takes as long as its busiest link (load / capacity), which its closed form prices. The
    axis contends when some link a group uses carries, with every group's load on it, more
    than that group's own busiest link: then the peers, not the group, set its time.
    """
    if len(groups) < 2:
        return False
    if capacity is None:
        capacity = topology.link_capacity_bps
    loads = []
    total = np.zeros(len(capacity))
    for group in groups:
        if len(group) < 2:
            continue
        load = all_pairs_load(Group(topology, tuple(group)))
        loads.append(load)
        np.add.at(total, load.link_index, load.link_weight)
    for load in loads:
        own = float(np.max(load.link_weight / capacity[load.link_index]))
        shared = float(np.max(total[load.link_index] / capacity[load.link_index]))
        if shared > own * (1 + 1e-9):
            return True
    return False


def shared_links(topology: Topology, groups: Sequence[tuple[int, ...]] | np.ndarray) -> list[str]:
    """Names of the links that one ring step of ``groups`` (run together) oversubscribes.

    A set of flows gets its solo rates (each its path's slowest link) at once exactly when no
    link carries more than its capacity in solo rates (then that vector is feasible and
    max-min fair); so the links where the solo rates add up beyond the capacity are the ones
    whose sharing slows the step.
    """
    loads = _solo_loads(topology, groups, None)
    if loads is None:
        return []
    used, load, cap = loads
    over = used[load > cap * (1 + 1e-9)]
    return sorted({topology.links[int(i)].name for i in over})


def _group_links(topology: Topology, group: tuple[int, ...]) -> set[int]:
    """Links any transfer between two members of ``group`` may use (all ordered pairs)."""
    links: set[int] = set()
    for src in group:
        for dst in group:
            if src != dst:
                links.update(topology.path(src, dst))
    return links


def linked_peers(
    topology: Topology, group: tuple[int, ...], peers: Sequence[tuple[int, ...]]
) -> list[tuple[int, ...]]:
    """The peers that can affect ``group``: those connected to it through shared links.

    Max-min fair shares only couple flows that share links, directly or through a chain of
    other flows; peers in other components of that sharing graph (e.g. data-parallel replicas
    on other nodes and rails) cannot change the group's times, so the DES leaves them out.
    """
    if not peers:
        return []
    links = {g: _group_links(topology, g) for g in [group, *peers]}
    reached = set(links[group])
    todo = list(peers)
    kept: list[tuple[int, ...]] = []
    changed = True
    while changed:
        changed = False
        rest = []
        for g in todo:
            if links[g] & reached:
                kept.append(g)
                reached |= links[g]
                changed = True
            else:
                rest.append(g)
        todo = rest
    return [g for g in peers if g in set(kept)]


class CommPricer(ClosedPricer):
    """Prices TP, DP and pipeline calls for the engine: the closed form of
    :class:`~collsim.step.pricing.ClosedPricer`, or the flow-level DES with peers.

    Args:
        topology: the cluster.
        zero: price every call at 0 s (an ideal network: pipeline-only studies).
        network: the FlowNetwork when the DES is used for some axes (None: closed form only).
    """

    def __init__(
        self,
        topology: Topology,
        *,
        zero: bool = False,
        network: FlowNetwork | None = None,
        env: simpy.Environment | None = None,
    ) -> None:
        super().__init__(topology, zero=zero)
        self.network = network
        self.env = env

    def work(
        self,
        op: str,
        size_bytes: float,
        ranks: tuple[int, ...],
        *,
        peers: Sequence[tuple[int, ...]] = (),
        des: bool = False,
        extra_s: float = 0.0,
    ) -> Work:
        """What a stream runs for this call: a duration, or a DES process factory.

        Args:
            op: collective op name (``send_recv`` for pipeline transfers).
            size_bytes: nccl-tests size.
            ranks: the group (for send_recv: (src, dst)).
            peers: groups running the same call at the same time (DES only).
            des: simulate on the FlowNetwork instead of the closed form.
            extra_s: seconds added before the call (offload copies over PCIe).
        """
        if not des or self.zero or self.network is None or len(ranks) < 2 or size_bytes <= 0:
            return extra_s + self.cost(op, size_bytes, ranks).time_s
        env, net, topo = self.env, self.network, self.topology
        if env is None:
            raise SimulationError("CommPricer: the DES needs the simulation environment (env)")

        def run() -> Any:
            def body() -> Any:
                if extra_s:
                    yield env.timeout(extra_s)
                value = yield simulate(
                    env,
                    net,
                    CollectiveOp(op),
                    int(size_bytes),
                    Group(topo, ranks),
                    peers=[Group(topo, p) for p in peers],
                )
                return value

            return env.process(body())

        return run
