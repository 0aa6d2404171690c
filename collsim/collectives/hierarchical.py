"""Hierarchical (two-level) collectives: intra-node, then inter-node, then intra-node.

all_reduce = ring reduce-scatter inside each node, ring all_reduce of each 1/g shard across
nodes among the ranks with the same local index (g rings in parallel, one per rail), then ring
all-gather inside each node (as in Horovod's hierarchical allreduce and NCCL's CollNet
chain). reduce_scatter and all_gather are the corresponding halves. Needs the same number of
group ranks g on every node.
"""

from __future__ import annotations

import numpy as np

from collsim.collectives.transfers import LoadPhase, pairs_phase
from collsim.collectives.types import Group
from collsim.core.errors import ConfigError
from collsim.core.vocab import Algorithm, CollectiveOp

__all__ = ["ALGORITHM", "SUPPORTED", "build"]

ALGORITHM = Algorithm.HIERARCHICAL
SUPPORTED = frozenset(
    {CollectiveOp.ALL_REDUCE, CollectiveOp.REDUCE_SCATTER, CollectiveOp.ALL_GATHER}
)


def _rings(
    group: Group, orders: list[list[int]], size_factor: float, intra_steps: int, inter_steps: int
) -> LoadPhase:
    src = [r for o in orders if len(o) > 1 for r in o]
    dst = [r for o in orders if len(o) > 1 for r in o[1:] + o[:1]]
    return pairs_phase(
        group.topology,
        np.asarray(src, dtype=np.int64),
        np.asarray(dst, dtype=np.int64),
        size_factor,
        intra_steps,
        inter_steps,
    )


def build(op: CollectiveOp, group: Group) -> list[LoadPhase]:
    """Phases of hierarchical ``op`` on ``group``."""
    if op not in SUPPORTED:
        raise ConfigError(f"hierarchical does not implement {op.value}")
    nodes = [members for _, members in group.by_node()]
    g = len(nodes[0])
    if any(len(m) != g for m in nodes):
        raise ConfigError(
            "hierarchical needs the same number of ranks on every node, got "
            f"{[len(m) for m in nodes]}"
        )
    num_nodes = len(nodes)
    rails = [[m[j] for m in nodes] for j in range(g)]
    intra = _rings(group, nodes, (g - 1) / g, g - 1, 0)
    match op:
        case CollectiveOp.ALL_REDUCE:
            return [
                intra,
                _rings(group, rails, 2.0 * (num_nodes - 1) / num_nodes / g, 0, 2 * (num_nodes - 1)),
                intra,
            ]
        case CollectiveOp.REDUCE_SCATTER:
            return [intra, _rings(group, rails, (num_nodes - 1) / num_nodes / g, 0, num_nodes - 1)]
        case _:
            return [_rings(group, rails, (num_nodes - 1) / num_nodes / g, 0, num_nodes - 1), intra]
