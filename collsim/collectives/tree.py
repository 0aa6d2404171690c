"""Double binary tree all_reduce, as NCCL builds it (src/graph/trees.cc, Sanders et al. 2009).

Inside a node the ranks form a chain; across nodes, two binary trees over the nodes in which
(most) interior nodes of one are leaves of the other. Each tree carries half of the data; the
reduction goes up and the broadcast comes down, pipelined, so at flow level every tree edge
carries its share in each direction at once. As for rings, NCCL runs one tree pair per channel
and spreads channels over the node's NICs: with g group ranks per node there are g channels,
channel c's chain starts at the node's c-th rank (whose NIC links it to the other nodes) and
carries M/g. Per NIC and direction: interior in one tree (3 x M/2g) plus leaf in the other
(1 x M/2g) = 2M/g, the same as a ring.

Latency (NCCL tuning.cc): base + 2 x ((ranks per node - 1) x intra hop + log2(nodes) x net hop).
"""

from __future__ import annotations

import numpy as np

from collsim.collectives.transfers import LoadPhase, pairs_phase
from collsim.collectives.types import Group
from collsim.core.errors import ConfigError
from collsim.core.vocab import Algorithm, CollectiveOp

__all__ = ["ALGORITHM", "SUPPORTED", "btree_parent", "dtree_parents", "build"]

ALGORITHM = Algorithm.TREE
SUPPORTED = frozenset({CollectiveOp.ALL_REDUCE})


def btree_parent(n: int, rank: int) -> int | None:
    """Parent of ``rank`` in NCCL's binary tree over ``n`` ranks (ncclGetBtree); root 0."""
    if rank == 0:
        return None
    bit = rank & -rank
    up = (rank ^ bit) | (bit << 1)
    if up >= n:
        up = rank ^ bit
    return up


def dtree_parents(n: int) -> tuple[list[int | None], list[int | None]]:
    """Parents in NCCL's two trees (ncclGetDtree): tree 1 mirrors (n even) or shifts (n odd)."""
    tree0 = [btree_parent(n, r) for r in range(n)]
    tree1: list[int | None] = []
    for r in range(n):
        if n % 2 == 0:
            p = btree_parent(n, n - 1 - r)
            tree1.append(None if p is None else n - 1 - p)
        else:
            p = btree_parent(n, (r - 1) % n)
            tree1.append(None if p is None else (p + 1) % n)
    return tree0, tree1


def build(op: CollectiveOp, group: Group) -> list[LoadPhase]:
    """Phases of tree ``op`` on ``group`` (one pipelined phase, both trees)."""
    if op not in SUPPORTED:
        raise ConfigError(f"tree implements all_reduce only, not {op.value}")
    if group.size < 2:
        return []
    nodes = [members for _, members in group.by_node()]
    src: list[int] = []
    dst: list[int] = []
    parents = dtree_parents(len(nodes))
    tree_edges = [
        [(child, parent) for child, parent in enumerate(parent_of) if parent is not None]
        for parent_of in parents
    ]
    per_node = max(len(m) for m in nodes)
    channels = per_node if len(nodes) > 1 else 1
    for channel in range(channels):
        chains = [m[channel % len(m) :] + m[: channel % len(m)] for m in nodes]
        heads = [chain[0] for chain in chains]
        chain_up: list[int] = []  # b -> a along every chain (a before b)
        chain_down: list[int] = []
        for chain in chains:
            chain_up += chain[1:]
            chain_down += chain[:-1]
        for edges in tree_edges:
            src += chain_up
            dst += chain_down
            src += chain_down
            dst += chain_up
            for child, parent in edges:
                src += [heads[child], heads[parent]]
                dst += [heads[parent], heads[child]]
    log_nodes = len(nodes).bit_length() - 1
    return [
        pairs_phase(
            group.topology,
            _ints(src),
            _ints(dst),
            0.5 / channels,
            2 * (per_node - 1),
            2 * log_nodes,
        )
    ]


def _ints(values: list[int]) -> np.ndarray:
    """A list of ranks as an int64 array (fromiter: faster than asarray on long lists)."""
    return np.fromiter(values, dtype=np.int64, count=len(values))
