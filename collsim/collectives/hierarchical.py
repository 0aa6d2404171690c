"""Hierarchical (two-level) collectives: intra-node, then inter-node, then intra-node.

all_reduce = ring reduce-scatter inside each node, ring all_reduce of each 1/g shard across
nodes among the ranks with the same local index (g rings in parallel, one per rail), then ring
all-gather inside each node (as in Horovod's hierarchical allreduce and NCCL's CollNet
chain). reduce_scatter and all_gather are the corresponding halves. Needs the same number of
group ranks g on every node.
"""

from __future__ import annotations

from collsim.collectives.schedule import Phase, Transfer, make_transfer
from collsim.collectives.types import Algorithm, CollectiveOp, Group
from collsim.errors import ConfigError

__all__ = ["ALGORITHM", "SUPPORTED", "build"]

ALGORITHM = Algorithm.HIERARCHICAL
SUPPORTED = frozenset({CollectiveOp.ALL_REDUCE, CollectiveOp.REDUCE_SCATTER,
                       CollectiveOp.ALL_GATHER})


def _rings(group: Group, orders: list[list[int]]) -> tuple[Transfer, ...]:
    topo = group.topology
    return tuple(make_transfer(topo, o[i], o[(i + 1) % len(o)])
                 for o in orders if len(o) > 1 for i in range(len(o)))


def build(op: CollectiveOp, group: Group) -> list[Phase]:
    """Phases of hierarchical ``op`` on ``group``."""
    if op not in SUPPORTED:
        raise ConfigError(f"hierarchical does not implement {op.value}")
    nodes = [members for _, members in group.by_node()]
    g = len(nodes[0])
    if any(len(m) != g for m in nodes):
        raise ConfigError("hierarchical needs the same number of ranks on every node, got "
                          f"{[len(m) for m in nodes]}")
    num_nodes = len(nodes)
    intra = _rings(group, nodes)
    inter = _rings(group, [[m[j] for m in nodes] for j in range(g)])
    share = (g - 1) / g
    match op:
        case CollectiveOp.ALL_REDUCE:
            return [Phase(intra, share, g - 1, 0),
                    Phase(inter, 2.0 * (num_nodes - 1) / num_nodes / g, 0, 2 * (num_nodes - 1)),
                    Phase(intra, share, g - 1, 0)]
        case CollectiveOp.REDUCE_SCATTER:
            return [Phase(intra, share, g - 1, 0),
                    Phase(inter, (num_nodes - 1) / num_nodes / g, 0, num_nodes - 1)]
        case _:
            return [Phase(inter, (num_nodes - 1) / num_nodes / g, 0, num_nodes - 1),
                    Phase(intra, share, g - 1, 0)]
