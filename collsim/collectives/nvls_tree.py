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

import numpy as np

import collsim.collectives.nvls as nvls
import collsim.collectives.tuner as tuner
from collsim.collectives.transfers import LoadPhase, PhaseLoad, Transfer, make_transfer, pair_load
from collsim.collectives.tree import dtree_parents
from collsim.collectives.types import Group
from collsim.core.errors import ConfigError
from collsim.core.vocab import Algorithm, CollectiveOp

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


def build(op: CollectiveOp, group: Group) -> list[LoadPhase]:
    """One pipelined phase: the GPU ports' NVLS traffic and the trees' NIC traffic.

    The load is worked out with array operations (ports: one weight per GPU link; trees:
    :func:`~collsim.collectives.transfers.pair_load` over the head pairs); the transfers are
    built only when the DES runs the phase."""
    if op not in SUPPORTED:
        raise ConfigError(f"nvls_tree implements all_reduce only, not {op.value}")
    nodes = _members(group)
    topo = group.topology
    g = len(nodes[0])
    port = 1.0 + 1.0 / g
    share = 0.5 / g  # half of a GPU's M/g slice per tree
    members = np.asarray(nodes, dtype=np.int64)  # [node, local]
    src_parts, dst_parts = [], []
    for parents in dtree_parents(len(nodes)):
        child = np.asarray([c for c, p in enumerate(parents) if p is not None], dtype=np.int64)
        parent = np.asarray([p for p in parents if p is not None], dtype=np.int64)
        a, b = members[child].ravel(), members[parent].ravel()
        src_parts += [a, b]
        dst_parts += [b, a]
    src = np.concatenate(src_parts)
    dst = np.concatenate(dst_parts)
    tree = pair_load(topo, src, dst)
    ranks = members.ravel()
    ports = np.concatenate([topo.gpu_tx_index[ranks], topo.gpu_rx_index[ranks]])
    latency = topo.link_latency_s
    load = PhaseLoad(
        np.concatenate([ports, tree.link_index]),
        np.concatenate([np.full(len(ports), port), tree.link_weight * share]),
        float(latency[ports].max()),
        tree.inter_latency_s,
        topo.kinds_of(ports),
    )

    def make() -> list[Transfer]:
        out = [Transfer((topo.gpu_tx[r],), r, None, False, port) for r in ranks.tolist()]
        out += [Transfer((topo.gpu_rx[r],), None, r, False, port) for r in ranks.tolist()]
        for s_rank, d_rank in zip(src.tolist(), dst.tolist()):
            t = make_transfer(topo, s_rank, d_rank)
            out.append(Transfer(t.path, s_rank, d_rank, True, share))
        return out

    log_nodes = len(nodes).bit_length() - 1
    return [
        LoadPhase(
            load=load,
            size_factor=1.0,
            intra_steps=1,
            inter_steps=2 * log_nodes,
            make_transfers=make,
        )
    ]


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
