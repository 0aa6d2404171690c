"""NVLS-tree all_reduce across nodes: NVLink SHARP inside each node, double binary trees of
the node heads across nodes (NCCL's NVLS_TREE, src/device/all_reduce.h ``RunWorkColl``
NVLS_TREE; chosen on Hopper and Blackwell when NCCL's tuner prefers it, src/graph/tuning.cc).

Inside a node the switch reduces each GPU's slice (``multimem.ld_reduce``) and multicasts the
result (``multimem.st``), so each GPU port carries (1 + 1/g) M out and in, as for single-node
NVLS (:mod:`collsim.collectives.nvls`). The reduced slice a GPU holds (M/g) goes through that
GPU's NIC into two binary trees over the nodes (NCCL's ``ncclGetDtree``, half the slice each),
up to the roots and back down, pipelined. Per NIC and direction: 2M/g in the interior of the
trees, M/g on two nodes (one edge each way per tree; tuning.cc doubles the network bandwidth
of NVLS_TREE on two nodes for the same reason).

Latency (tuning.cc): base 0 + the NVLS NVLink latency (25 us) + 2 log2(nodes) network hops at
NVLS_TREE's network latency (20.9 us, plus the fabric's per-step latency).

Chunking (src/enqueue.cc ``calcCollChunking``, NVLS_TREE): loops of nChannels x nHeads x
chunk bytes with nChannels = ``nvlsChannels`` (16 on Hopper), chunk = min(NCCL_NVLS_CHUNKSIZE
128 KiB, the tree's maximum: 64 KiB from 4 nodes, else 128 KiB), cut to 64 KiB below 4 x ops x
chunk and to 32 KiB below 1 x ops x chunk; each loop ends in handshakes as NVLS's do.
"""

from __future__ import annotations

from collections.abc import Callable

from collsim.collectives import nvls, tuner
from collsim.collectives.schedule import Phase, Transfer, make_transfer
from collsim.collectives.tree import dtree_parents
from collsim.collectives.types import Algorithm, CollectiveOp, Group
from collsim.errors import ConfigError

__all__ = ["ALGORITHM", "SUPPORTED", "LOOP_STEP_S", "build", "loop_bytes_for", "chunk_bytes"]

ALGORITHM = Algorithm.NVLS_TREE
SUPPORTED = frozenset({CollectiveOp.ALL_REDUCE})
LOOP_STEP_S = nvls.LOOP_STEP_S


def _members(group: Group) -> list[list[int]]:
    topo = group.topology
    if not topo.nvls:
        raise ConfigError(f"topology {topo.name} has no in-switch reduction (intra_node.nvls)")
    if group.num_nodes < 2:
        raise ConfigError("nvls_tree spans nodes; on one node use nvls")
    nodes = [members for _, members in group.by_node()]
    g = len(nodes[0])
    if any(len(m) != g for m in nodes):
        raise ConfigError(
            f"nvls_tree needs the same number of ranks on every node, got {[len(m) for m in nodes]}"
        )
    if g < 2:
        raise ConfigError("nvls_tree needs at least 2 ranks per node (NVLS needs 2 channels)")
    return nodes


def build(op: CollectiveOp, group: Group) -> list[Phase]:
    """One pipelined phase: the GPU ports' NVLS traffic and the trees' NIC traffic."""
    if op not in SUPPORTED:
        raise ConfigError(f"nvls_tree implements all_reduce only, not {op.value}")
    nodes = _members(group)
    topo = group.topology
    g = len(nodes[0])
    port = 1.0 + 1.0 / g
    transfers = [Transfer((topo.gpu_tx[r],), r, None, False, port) for m in nodes for r in m]
    transfers += [Transfer((topo.gpu_rx[r],), None, r, False, port) for m in nodes for r in m]
    share = 0.5 / g  # half of a GPU's M/g slice per tree
    for parents in dtree_parents(len(nodes)):
        for child, parent in enumerate(parents):
            if parent is None:
                continue
            for j in range(g):
                a, b = nodes[child][j], nodes[parent][j]
                for src, dst in ((a, b), (b, a)):
                    t = make_transfer(topo, src, dst)
                    transfers.append(Transfer(t.path, src, dst, True, share))
    log_nodes = len(nodes).bit_length() - 1
    return [Phase(tuple(transfers), 1.0, 1, 2 * log_nodes)]


def chunk_bytes(size_bytes: float, concurrent_ops: int, num_nodes: int) -> int:
    """NCCL's NVLS_TREE chunk (src/enqueue.cc calcCollChunking)."""
    chunk = min(128 << 10, (64 << 10) if num_nodes >= 4 else (128 << 10))
    if size_bytes < 4 * concurrent_ops * chunk and chunk > 65536:
        chunk = 65536
    if size_bytes < 1 * concurrent_ops * chunk and chunk > 32768:
        chunk = 32768
    return chunk


def loop_bytes_for(op: CollectiveOp, group: Group) -> Callable[[float], float]:
    """Bytes of the buffer one loop covers: nvlsChannels x heads (ranks per node) x chunk."""
    per_node = group.size // group.num_nodes
    ops = tuner.nvls_channels(group.topology, group.num_nodes) * per_node
    num_nodes = group.num_nodes

    def bytes_per_loop(size_bytes: float) -> float:
        return float(ops * chunk_bytes(size_bytes, ops, num_nodes))

    return bytes_per_loop
