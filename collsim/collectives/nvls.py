"""In-switch reduction (NVLS, NVLink SHARP) inside one NVSwitch node.

Derivations, measurements and sources: docs/derivations.md, ``collsim.collectives.nvls``.
"""

from __future__ import annotations

from collections.abc import Callable

import collsim.collectives.tuner as tuner
from collsim.collectives.transfers import Phase, Transfer
from collsim.collectives.types import Group
from collsim.core.errors import ConfigError
from collsim.core.vocab import Algorithm, CollectiveOp, Protocol

__all__ = [
    "ALGORITHM",
    "SUPPORTED",
    "LOOP_STEP_S",
    "NVLS_CHANNELS",
    "build",
    "chunk_bytes",
    "loop_bytes_for",
]

ALGORITHM = Algorithm.NVLS
SUPPORTED = frozenset(
    {CollectiveOp.ALL_REDUCE, CollectiveOp.REDUCE_SCATTER, CollectiveOp.ALL_GATHER}
)

LOOP_STEP_S = 11.8e-6
"""Handshake that ends each NVLS loop, seconds (fitted; see the module docstring)."""

NVLS_CHANNELS = 16
"""NVLS_NCHANNELS_SM90, Hopper's ``nvlsChannels`` (src/transport/nvls.cc); other
architectures take theirs from :func:`collsim.collectives.tuner.nvls_channels`."""
_MAX_CHUNK = 128 << 10  # NCCL_NVLS_CHUNKSIZE default


def chunk_bytes(size_bytes: float, num_ranks: int, num_channels: int = NVLS_CHANNELS) -> int:
    """NCCL's NVLS chunk for a collective of ``size_bytes`` on ``num_ranks`` heads."""
    ops = num_channels * num_ranks
    chunk = _MAX_CHUNK
    if size_bytes < 64 * ops * chunk and chunk > 65536:
        chunk = 65536
    if size_bytes < 8 * ops * chunk and chunk > 32768:
        chunk = 32768
    if size_bytes < 2 * ops * chunk and chunk > 16384:
        chunk = 16384
    return chunk


def loop_bytes_for(op: CollectiveOp, group: Group) -> Callable[[float], float]:
    """Bytes of the buffer one NVLS loop covers (channels x heads x :func:`chunk_bytes`), as a
    function of the collective's size, with the group's thresholds worked out once (hot path).
    """
    heads = group.size // group.num_nodes  # one head per GPU of a node
    ops = tuner.nvls_channels(group.topology, group.num_nodes) * heads
    biggest = _MAX_CHUNK
    if group.num_nodes > 1:
        # across nodes the chunk is capped at 32 KiB when NVLS's bandwidth in the tuner's
        # table is below 150 GB/s (enqueue.cc calcCollChunking)
        table = tuner.table_for(group)
        key = (CollectiveOp.ALL_REDUCE, Algorithm.NVLS, Protocol.SIMPLE)
        if table.bandwidth_gbps.get(key, 0.0) < 150:
            biggest = 32768
    sizes = [c for c in (16384, 32768, 65536) if c <= biggest]
    thresholds = {16384: 2 * ops * 32768, 32768: 8 * ops * 65536, 65536: 64 * ops * _MAX_CHUNK}
    loops = tuple((thresholds[c], float(ops * c)) for c in sizes if c < biggest)
    largest = float(ops * biggest)

    def bytes_per_loop(size_bytes: float) -> float:
        for threshold, loop in loops:
            if size_bytes < threshold:
                return loop
        return largest

    return bytes_per_loop


def build(op: CollectiveOp, group: Group) -> list[Phase]:
    """Phases of NVLS ``op`` on ``group`` (one phase of port transfers).

    Across nodes NVLS needs in-network reduction (NCCL's NVLS with CollNet, "NVLink SHARP
    within the node and CollNet between nodes"; tuning.cc disables NVLS across nodes without
    CollNet): all_reduce only, each GPU the head of its slice, which goes up its NIC to the
    switch and comes back reduced (M/g per NIC and direction, as for collnet_direct)."""
    topo = group.topology
    if op not in SUPPORTED:
        raise ConfigError(f"nvls does not implement {op.value}")
    if not topo.nvls:
        raise ConfigError(f"topology {topo.name} has no in-switch reduction (intra_node.nvls)")
    multi = group.num_nodes != 1
    if multi and not (topo.fabric.collnet and op is CollectiveOp.ALL_REDUCE):
        raise ConfigError(
            "nvls runs inside one node; this group spans "
            f"{group.num_nodes} nodes (use nvls_tree, hierarchical or ring; across nodes NVLS "
            "needs in-network reduction, fabric.sharp, and all_reduce)"
        )
    n = group.size
    if n < 2:
        return []
    g = n // group.num_nodes
    if multi and any(len(m) != g for _, m in group.by_node()):
        raise ConfigError("nvls across nodes needs the same number of ranks on every node")
    out_w, in_w = {
        CollectiveOp.ALL_REDUCE: (1.0 + 1.0 / g, 1.0 + 1.0 / g),
        CollectiveOp.REDUCE_SCATTER: (1.0, 1.0 / n),
        CollectiveOp.ALL_GATHER: (1.0 / n, 1.0),
    }[op]
    transfers = [Transfer((topo.gpu_tx[r],), r, None, False, out_w) for r in group.ranks]
    transfers += [Transfer((topo.gpu_rx[r],), None, r, False, in_w) for r in group.ranks]
    if multi:
        for r in group.ranks:
            node, nic = topo.node_of(r), topo.nic_of(r)
            path = (topo.nic_tx[node][nic], topo.nic_rx[node][nic])
            transfers.append(Transfer(path, r, r, True, 1.0 / g))
        return [Phase(tuple(transfers), 1.0, 1, 1)]
    return [Phase(tuple(transfers), 1.0, 1, 0)]
