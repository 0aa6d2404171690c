"""CollNet: in-network reduction (SHARP) across nodes, a fabric option (``fabric.sharp``).

NCCL's CollNet algorithms (src/device/all_reduce.h COLLNET_DIRECT / COLLNET_CHAIN; chosen by
src/graph/tuning.cc only when the communicator has CollNet support, here when the topology's
fabric says ``sharp: true``):

- **collnet_direct**: inside the node every GPU scatters its pieces to the heads (one per
  GPU, up to 8, NCCL_MAX_DIRECT_ARITY + 1) and gathers the results back, all to all: per GPU
  port 2(g-1)/g x M each way. Each head sends its reduced slice (M/g) up through its NIC to the
  switch, which reduces it across nodes and returns the sum: M/g per NIC and direction at any
  node count, the network's half of a ring's 2(N-1)/N.
- **collnet_chain**: per channel a chain inside the node reduces up to the channel's head and
  broadcasts back down (g rotations, one head per GPU as for trees, M/g each); each head sends
  and receives M/g through its NIC.

The switch side is modelled at the NIC: a head's slice goes up NIC k and the sum comes back
down NIC k (the reduction tree above the leaves carries one slice per leaf, not per node, and
is not modelled). Latency: NCCL's own (tuning.cc): collnet_direct 2 x (min(1, g-1) x 3.7 us +
(g-1) x 0.4 us arity) + the network's 31 us; collnet_chain 2 (g-1) x 2.8 us + 30 us; plus the
fabric's per-step latency twice (Simple).
"""

from __future__ import annotations

from collections.abc import Callable

import collsim.collectives.tuner as tuner
from collsim.collectives.transfers import Phase, Transfer, make_transfer
from collsim.collectives.types import Group
from collsim.core.errors import ConfigError
from collsim.core.vocab import Algorithm, CollectiveOp, Protocol

__all__ = ["ALGORITHM", "SUPPORTED", "build", "latency_for"]

ALGORITHM = Algorithm.COLLNET_DIRECT
SUPPORTED = frozenset({CollectiveOp.ALL_REDUCE})


def _nodes(group: Group, algorithm: Algorithm) -> list[list[int]]:
    topo = group.topology
    if not topo.fabric.collnet:
        raise ConfigError(f"topology {topo.name} has no in-network reduction (fabric.sharp)")
    if group.num_nodes < 2:
        raise ConfigError(f"{algorithm.value} spans nodes; this group is on one node")
    if topo.nics is None:
        raise ConfigError(f"topology {topo.name} has no NICs")
    nodes = [members for _, members in group.by_node()]
    g = len(nodes[0])
    if any(len(m) != g for m in nodes):
        raise ConfigError(
            f"{algorithm.value} needs the same number of ranks on every node, "
            f"got {[len(m) for m in nodes]}"
        )
    if g > 8:
        raise ConfigError(f"{algorithm.value} supports at most 8 ranks per node, got {g}")
    return nodes


def _switch_round_trip(group: Group, rank: int, weight: float) -> Transfer:
    """A head's slice up its NIC to the switch and the reduced slice back down."""
    topo = group.topology
    node, nic = topo.node_of(rank), topo.nic_of(rank)
    path = (topo.nic_tx[node][nic], topo.nic_rx[node][nic])
    return Transfer(path, rank, rank, True, weight)


def build(op: CollectiveOp, group: Group, algorithm: Algorithm = ALGORITHM) -> list[Phase]:
    """One pipelined phase: the node-local exchange and the heads' switch round trips."""
    if op not in SUPPORTED:
        raise ConfigError(f"{algorithm.value} implements all_reduce only, not {op.value}")
    nodes = _nodes(group, algorithm)
    topo = group.topology
    g = len(nodes[0])
    transfers: list[Transfer] = []
    if algorithm is Algorithm.COLLNET_DIRECT:
        for members in nodes:
            for a in members:
                for b in members:
                    if a != b:
                        t = make_transfer(topo, a, b)
                        transfers.append(Transfer(t.path, a, b, False, 2.0 / g))
        intra_steps = 2 if g > 1 else 0
    elif algorithm is Algorithm.COLLNET_CHAIN:
        for members in nodes:
            for c in range(g):
                chain = members[c:] + members[:c]
                for a, b in zip(chain[:-1], chain[1:]):
                    for src, dst in ((b, a), (a, b)):  # reduce up, broadcast down
                        t = make_transfer(topo, src, dst)
                        transfers.append(Transfer(t.path, src, dst, False, 1.0 / g))
        intra_steps = 2 * (g - 1)
    else:
        raise ConfigError(f"collnet module does not build {algorithm.value}")
    transfers += [_switch_round_trip(group, r, 1.0 / g) for members in nodes for r in members]
    return [Phase(tuple(transfers), 1.0, intra_steps, 1)]


def latency_for(
    op: CollectiveOp, group: Group, algorithm: Algorithm
) -> Callable[[Protocol], float]:
    """NCCL's CollNet latency for the group (tuner table, seconds)."""
    table = tuner.table_for(group)

    def latency_s(protocol: Protocol) -> float:
        return table.latency_us[(op, algorithm, protocol)] * 1e-6

    return latency_s
