"""Direct algorithms: every rank sends to every peer at once (one step).

Derivations, measurements and sources: docs/derivations.md, ``collsim.collectives.direct``.
"""

from __future__ import annotations

import numpy as np

from collsim.cluster.topology import Topology
from collsim.collectives.transfers import (
    LoadPhase,
    Phase,
    PhaseLoad,
    Transfer,
    equal_weights_per_link,
    make_transfer,
    one_step_phase,
)
from collsim.collectives.types import Group
from collsim.core.vocab import Algorithm, CollectiveOp, LinkKind

__all__ = ["ALGORITHM", "SUPPORTED", "EXACT_PAIRS_UP_TO", "build", "all_pairs_load"]

ALGORITHM = Algorithm.DIRECT
SUPPORTED = frozenset(CollectiveOp)

EXACT_PAIRS_UP_TO = 64
"""Groups up to this many ranks run every (src, dst) pair as its own flow in the DES."""


def _layout(group: Group) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Ranks, their nodes and their NICs (0 without NICs) as arrays."""
    topo = group.topology
    ranks = np.asarray(group.ranks, dtype=np.int64)
    nodes = ranks // topo.gpus_per_node
    if topo.nics is None:
        nics = np.zeros_like(ranks)
    else:
        nics = (ranks % topo.gpus_per_node) * topo.nics.count // topo.gpus_per_node
    return ranks, nodes, nics


def all_pairs_load(group: Group) -> PhaseLoad:
    """Per-link load (transfers per link) of every rank sending to every other, analytically.

    See the module docstring for the formulas; O(ranks + links), no pair is enumerated.
    """
    topo = group.topology
    n = group.size
    ranks, nodes, nics = _layout(group)
    index: list[np.ndarray] = []
    weight: list[np.ndarray] = []
    m = np.bincount(nodes, minlength=topo.num_nodes)
    intra = (m[nodes] - 1).astype(float)
    index += [topo.gpu_tx_index[ranks], topo.gpu_rx_index[ranks]]
    weight += [intra, intra]
    intra_latency = inter_latency = 0.0
    kinds: frozenset[LinkKind] = frozenset()
    multi = np.flatnonzero(m >= 2)
    if len(multi):
        a = ranks[nodes == multi[0]][:2]
        path = topo.path(int(a[0]), int(a[1]))
        intra_latency = topo.path_latency_s(path)
        kinds = frozenset(topo.links[i].kind for i in path)
    used_nodes = np.flatnonzero(m)
    if len(used_nodes) > 1:
        assert topo.nics is not None  # Topology refuses several nodes without NICs
        k_count = topo.nics.count
        c = np.bincount(nodes * k_count + nics, minlength=topo.num_nodes * k_count)
        c = c.reshape(topo.num_nodes, k_count).astype(float)
        c_k = c.sum(axis=0)
        nic_tx, nic_rx = topo.nic_tx_index, topo.nic_rx_index
        sub = c[used_nodes]
        index += [nic_tx[used_nodes].ravel(), nic_rx[used_nodes].ravel()]
        weight += [
            (sub * (n - m[used_nodes])[:, None]).ravel(),
            (m[used_nodes][:, None] * (c_k[None, :] - sub)).ravel(),
        ]
        per_leaf = topo.fabric.nodes_per_leaf
        leaf_of_rank = nodes // per_leaf
        num_leaves = -(-topo.num_nodes // per_leaf)
        big_m = np.bincount(leaf_of_rank, minlength=num_leaves).astype(float)
        crossing = np.count_nonzero(big_m) > 1
        if crossing:
            used_leaves = np.flatnonzero(big_m)
            if topo.fabric.rails:
                s = np.bincount(
                    leaf_of_rank * k_count + nics, minlength=num_leaves * k_count
                ).reshape(num_leaves, k_count)
                s = s[used_leaves].astype(float)
                up = s * (n - big_m[used_leaves])[:, None]
                down = (c_k[None, :] - s) * big_m[used_leaves][:, None]
                rails = range(k_count)
            else:
                mg = big_m[used_leaves]
                up = (mg * (n - mg))[:, None]
                down = up
                rails = range(1)
            index += [
                np.array([[topo.leaf_up[(k, int(g))] for k in rails] for g in used_leaves]).ravel(),
                np.array(
                    [[topo.leaf_down[(k, int(g))] for k in rails] for g in used_leaves]
                ).ravel(),
            ]
            weight += [up.ravel(), down.ravel()]
        # the longest inter-node path: one that crosses leaves if any does
        first = int(ranks[0])
        if crossing:
            other = int(ranks[np.flatnonzero(leaf_of_rank != leaf_of_rank[0])[0]])
        else:
            other = int(ranks[np.flatnonzero(nodes != nodes[0])[0]])
        inter_latency = topo.path_latency_s(topo.path(first, other))
    all_index = np.concatenate(index)
    all_weight = np.concatenate(weight)
    keep = all_weight > 0
    return PhaseLoad(all_index[keep], all_weight[keep], intra_latency, inter_latency, kinds)


def all_pairs_transfers(group: Group) -> list[Transfer]:
    """The DES flows of the all-pairs pattern: every pair for small groups; for large ones,
    one flow per distinct path (intra-node pairs, and (node A, NIC k) -> node B), weighted by
    the number of pairs it stands for, when the merged flows carry equal bytes on every link they
    share (as with the same ranks on every node); otherwise every pair."""
    topo = group.topology
    ranks = group.ranks
    if len(ranks) > EXACT_PAIRS_UP_TO:
        merged = _aggregated_pairs(group, topo)
        if equal_weights_per_link(merged, len(topo.links)):
            return merged
    return [make_transfer(topo, s, d) for s in ranks for d in ranks if s != d]


def _aggregated_pairs(group: Group, topo: Topology) -> list[Transfer]:
    by_node = group.by_node()
    out: list[Transfer] = []
    for _, members in by_node:
        out += [make_transfer(topo, s, d) for s in members for d in members if s != d]
    if len(by_node) < 2:
        return out
    senders: list[tuple[int, int, int]] = []  # (node, nic, senders behind it)
    for node, members in by_node:
        per_nic: dict[int, int] = {}
        for r in members:
            per_nic[topo.nic_of(r)] = per_nic.get(topo.nic_of(r), 0) + 1
        senders += [(node, k, count) for k, count in per_nic.items()]
    for node_a, k, count in senders:
        for node_b, members in by_node:
            if node_b != node_a:
                out.append(
                    Transfer(
                        topo.net_path(node_a, node_b, k),
                        None,
                        None,
                        True,
                        float(count * len(members)),
                    )
                )
    return out


def build(op: CollectiveOp, group: Group) -> list[Phase | LoadPhase]:
    """Phases of direct ``op`` on ``group``."""
    ranks, topo = group.ranks, group.topology
    n = len(ranks)
    if n < 2:
        return []
    root = ranks[0]
    match op:
        case CollectiveOp.ALL_TO_ALL | CollectiveOp.REDUCE_SCATTER | CollectiveOp.ALL_GATHER:
            return [_all_pairs_phase(group)]
        case CollectiveOp.ALL_REDUCE:  # reduce-scatter, then all-gather
            return [_all_pairs_phase(group)] * 2
        case CollectiveOp.BROADCAST:
            return [one_step_phase(topo, [(root, d) for d in ranks[1:]], 1.0)]
        case CollectiveOp.REDUCE:
            return [one_step_phase(topo, [(s, root) for s in ranks[1:]], 1.0)]
        case CollectiveOp.SEND_RECV:
            pairs = [(ranks[i], ranks[(i + 1) % n]) for i in range(n if n > 2 else 1)]
            return [one_step_phase(topo, pairs, 1.0)]
        case _:
            raise AssertionError(op)


def _all_pairs_phase(group: Group) -> LoadPhase:
    inter = group.num_nodes > 1
    return LoadPhase(
        load=all_pairs_load(group),
        size_factor=1.0 / group.size,
        intra_steps=0 if inter else 1,
        inter_steps=1 if inter else 0,
        make_transfers=lambda: all_pairs_transfers(group),
    )
