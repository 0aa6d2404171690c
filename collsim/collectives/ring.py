"""Ring algorithms: all_reduce, reduce_scatter, all_gather, and pipelined chains for
broadcast / reduce.

Bytes per rank (Patarasuk & Yuan 2009; nccl-tests doc/PERFORMANCE.md): all_reduce
2(n-1)/n x M, reduce_scatter and all_gather (n-1)/n x M; a pipelined chain forwards M.

Multi-node (NCCL's rings, src/graph/rings.cc and search.cc): NCCL runs one ring per channel and
spreads channels over the node's NICs; each ring enters and leaves every node once. Here a group
with g ranks on each node runs g rings; ring c visits each node's ranks rotated so that it leaves
the node from its c-th rank, through that rank's NIC, onto the same rail of the next node.
Each ring carries 1/g of the data, so the inter-node busbw is g NICs x NIC rate (when a rank
has its own NIC) and the intra-node links carry (g-1)/g of it.

Latency steps (NCCL tuning.cc): all_reduce 2(n-1) steps of which 2(N-1) cross the network;
reduce_scatter / all_gather / broadcast / reduce n-1 steps, N-1 across the network.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from collsim.collectives.memo import PerTopology
from collsim.collectives.transfers import LoadPhase, pairs_phase
from collsim.collectives.types import Group
from collsim.core.errors import ConfigError
from collsim.core.vocab import Algorithm, CollectiveOp

__all__ = ["ALGORITHM", "SUPPORTED", "ring_orders", "build"]

_GATHERS: PerTopology[Group, list[LoadPhase]] = PerTopology()
"""The one phase of a ring reduce-scatter or all-gather per group: both move the same bytes
over the same ring edges."""

ALGORITHM = Algorithm.RING
SUPPORTED = frozenset(
    {
        CollectiveOp.ALL_REDUCE,
        CollectiveOp.REDUCE_SCATTER,
        CollectiveOp.ALL_GATHER,
        CollectiveOp.BROADCAST,
        CollectiveOp.REDUCE,
    }
)


def ring_orders(group: Group) -> list[list[int]]:
    """One rank order per ring (channel); a single ring when the group is on one node."""
    nodes = group.by_node()
    if len(nodes) == 1:
        return [list(group.ranks)]
    width = max(len(members) for _, members in nodes)
    rings = []
    for channel in range(width):
        order: list[int] = []
        for _, members in nodes:
            start = (channel + 1) % len(members)
            order += members[start:] + members[:start]  # leaves the node from members[c]
        rings.append(order)
    return rings


def _edges(
    orders: Sequence[Sequence[int]], *, chain_root: int | None = None, reverse: bool = False
) -> tuple[list[int], list[int]]:
    """(senders, receivers) of every ring edge (or chain edge from ``chain_root``)."""
    src: list[int] = []
    dst: list[int] = []
    for order in orders:
        order = list(order)
        if chain_root is not None:
            at = order.index(chain_root)
            order = order[at:] + order[:at]
            a, b = order[:-1], order[1:]
        else:
            a, b = order, order[1:] + order[:1]
        if reverse:
            a, b = b, a
        src += a
        dst += b
    return src, dst


def build(op: CollectiveOp, group: Group) -> list[LoadPhase]:
    """Phases of ring ``op`` on ``group`` (one pipelined phase)."""
    if op not in SUPPORTED:
        raise ConfigError(
            f"ring does not implement {op.value}; it implements "
            f"{', '.join(sorted(o.value for o in SUPPORTED))}"
        )
    n, num_nodes = group.size, group.num_nodes
    if n < 2:
        return []
    gathers = _GATHERS.of(group.topology)
    if op in (CollectiveOp.REDUCE_SCATTER, CollectiveOp.ALL_GATHER) and group in gathers:
        return list(gathers[group])
    orders = ring_orders(group)
    channels = len(orders)
    match op:
        case CollectiveOp.ALL_REDUCE:
            factor, steps, inter = 2.0 * (n - 1) / n, 2 * (n - 1), 2 * (num_nodes - 1)
            src, dst = _edges(orders)
        case CollectiveOp.REDUCE_SCATTER | CollectiveOp.ALL_GATHER:
            factor, steps, inter = (n - 1) / n, n - 1, num_nodes - 1
            src, dst = _edges(orders)
        case CollectiveOp.BROADCAST | CollectiveOp.REDUCE:
            factor, steps, inter = 1.0, n - 1, num_nodes - 1
            src, dst = _edges(orders, chain_root=group.ranks[0], reverse=op is CollectiveOp.REDUCE)
        case _:
            raise ConfigError(f"ring does not implement {op.value}")
    phases = [
        pairs_phase(group.topology, _ints(src), _ints(dst), factor / channels, steps - inter, inter)
    ]
    if op in (CollectiveOp.REDUCE_SCATTER, CollectiveOp.ALL_GATHER):
        gathers[group] = phases
    return phases


def _ints(values: list[int]) -> np.ndarray:
    """A list of ranks as an int64 array (fromiter: faster than asarray on long lists)."""
    return np.fromiter(values, dtype=np.int64, count=len(values))
