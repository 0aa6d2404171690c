"""NCCL's own cost model and (algorithm, protocol) choice, re-derived from NCCL 2.30.7.

Derivations, measurements and sources: docs/derivations.md, ``collsim.collectives.tuner``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import collsim.collectives.ofi_tuner as ofi_tuner
from collsim.cluster.topology import Topology
from collsim.cluster.transports import EFA_PLATFORMS
from collsim.collectives.channels import (
    NcclGraph,
    arch_of,
    channel_counter,
    channels_for_size,
    graphs_for,
    min_bytes_per_channel,
    node_shape,
    nvls_channels,
    runtime_channels,
)
from collsim.collectives.memo import PerTopology
from collsim.collectives.types import Group
from collsim.core.vocab import Algorithm, CollectiveOp, Interconnect, Protocol

__all__ = [
    "NcclGraph",
    "TunerTable",
    "arch_of",
    "graphs_for",
    "pick",
    "runtime_channels",
    "channel_counter",
    "min_bytes_per_channel",
    "channels_for_size",
    "nvls_channels",
    "node_shape",
    "table_for",
    "NCCL_RELEASE",
]

_TABLES: PerTopology[tuple[int, int, int, int], TunerTable] = PerTopology()
"""NCCL's tuning table per communicator shape (ranks, nodes, GPUs per node, NICs)."""

NCCL_RELEASE = "2.30.7"
"""The NCCL release these rules follow (makefiles/version.mk)."""

_LL, _LL128, _SIMPLE = Protocol.LL, Protocol.LL128, Protocol.SIMPLE
_PROTOS = (_LL, _LL128, _SIMPLE)
_VOLTA, _AMPERE, _HOPPER, _BLACKWELL = 0, 1, 2, 3

# --- src/graph/tuning.cc ncclTunerConstantsDefaults ---------------------------------------
_BASE_US = {
    Algorithm.TREE: (6.8, 14.0, 8.4),
    Algorithm.RING: (6.6, 14.0, 8.4),
    Algorithm.COLLNET_DIRECT: (0.0, 0.0, 0.0),
    Algorithm.COLLNET_CHAIN: (0.0, 0.0, 0.0),
    Algorithm.NVLS: (0.0, 0.0, 0.0),
    Algorithm.NVLS_TREE: (0.0, 0.0, 0.0),
    Algorithm.PAT: (8.0, 8.0, 8.0),
}
_NVLINK_HW, _PCI_HW, _NET_HW = 0, 1, 2
_HW_US = {
    _NVLINK_HW: {
        Algorithm.TREE: (0.6, 1.25, 4.0),
        Algorithm.RING: (0.6, 1.9, 3.4),
        Algorithm.COLLNET_DIRECT: (0.0, 0.0, 3.7),
        Algorithm.COLLNET_CHAIN: (0.0, 0.0, 2.8),
        Algorithm.NVLS: (0.0, 0.0, 25.0),
        Algorithm.NVLS_TREE: (0.0, 0.0, 25.0),
        Algorithm.PAT: (0.0, 0.0, 4.0),
    },
    _PCI_HW: {
        Algorithm.TREE: (1.0, 1.9, 4.0),
        Algorithm.RING: (1.0, 2.5, 5.7),
        Algorithm.COLLNET_DIRECT: (0.0, 0.0, 3.7),
        Algorithm.COLLNET_CHAIN: (0.0, 0.0, 2.8),
        Algorithm.NVLS: (0.0, 0.0, 0.0),
        Algorithm.NVLS_TREE: (0.0, 0.0, 0.0),
        Algorithm.PAT: (0.0, 0.0, 4.0),
    },
    _NET_HW: {
        Algorithm.TREE: (5.0, 8.5, 14.0),
        Algorithm.RING: (2.7, 4.0, 14.0),
        Algorithm.COLLNET_DIRECT: (0.0, 0.0, 31.0),
        Algorithm.COLLNET_CHAIN: (0.0, 0.0, 30.0),
        Algorithm.NVLS: (0.0, 0.0, 18.0),
        Algorithm.NVLS_TREE: (0.0, 0.0, 20.9),
        Algorithm.PAT: (0.0, 0.0, 14.0),
    },
}
# llMaxBws[index1][index2]: index1 = arch on one node, CPU vendor (0 Intel, 1 AMD) across nodes.
_LL_MAX_BW = ((39.0, 39.0, 20.4), (87.7, 22.5, 19.0), (141.0, 45.0, 35.0), (282.0, 90.0, 70.0))
_PER_CH_RING_LL128 = ((20.0,) * 3, (20.0,) * 3, (36.7,) * 3, (40.0,) * 3)
_PER_CH_TREE_LL128 = ((20.0,) * 3, (20.0,) * 3, (36.7, 36.7, 29.0), (55.6, 31.67, 20.0))
_PER_CH_TREE = ((26.5, 18.5, 10.0), (24.0, 23.6, 17.8), (38.7, 41.4, 36.0), (70.0, 42.8, 24.0))
_PER_CH_NVLS_TREE = ((26.5, 18.5, 10.0), (24.0, 23.6, 17.8), (0.0, 57.7, 45.5), (0.0, 96.0, 80.0))
_NVLS_EFFICIENCY = (0.0, 0.0, 0.85, 0.74)
# ncclTopoGetAlgoTime treeCorrectionFactor[protocol][log2(bytes / 64)], 64 B .. 256 MiB.
_TREE_CORRECTION = (
    (1.0, 1.0, 1.0, 1.0, 0.9, 0.8, 0.7, 0.7, 0.7, 0.7, 0.6, 0.5, 0.4, 0.4, 0.5, 0.6, 0.7, 0.8)
    + (0.9, 1.0, 1.0, 1.0, 1.0, 1.0),
    (1.0, 1.0, 1.0, 1.0, 1.0, 0.9, 0.8, 0.8, 0.8, 0.7, 0.6, 0.6, 0.6, 0.6, 0.6, 0.6, 0.8, 0.9)
    + (0.9, 0.9, 0.9, 1.0, 1.0, 1.0),
    (0.9, 0.9, 0.9, 0.9, 0.9, 0.9, 0.9, 0.8, 0.7, 0.6, 0.6, 0.5, 0.5, 0.5, 0.5, 0.6, 0.7, 0.8)
    + (0.7, 0.7, 0.8, 0.9, 0.9, 0.9),
)


def _arch_index(arch: int) -> int:
    return _BLACKWELL if arch >= 100 else _HOPPER if arch >= 90 else _AMPERE


@dataclass(frozen=True, slots=True)
class TunerTable:
    """NCCL's latency (us) and bandwidth (GB/s, algorithm bandwidth) per (op, alg, proto);
    a bandwidth of 0 means disabled."""

    latency_us: dict[tuple[CollectiveOp, Algorithm, Protocol], float]
    bandwidth_gbps: dict[tuple[CollectiveOp, Algorithm, Protocol], float]
    bus_bandwidth_gbps: dict[tuple[CollectiveOp, Algorithm, Protocol], float]
    num_nodes: int
    num_ranks: int
    num_channels: int
    arch: int
    _options: dict[CollectiveOp, list[tuple[Algorithm, Protocol]]] = field(
        default_factory=dict, compare=False, repr=False
    )
    _picks: dict[tuple[CollectiveOp, float], tuple[Algorithm, Protocol] | None] = field(
        default_factory=dict, compare=False, repr=False
    )

    def time_us(
        self, op: CollectiveOp, algorithm: Algorithm, protocol: Protocol, size_bytes: float
    ) -> float:
        """``ncclTopoGetAlgoTime`` for one call (numPipeOps = 1); -1 when disabled."""
        key = (op, algorithm, protocol)
        bw = self.bandwidth_gbps.get(key, 0.0)
        if bw <= 0:
            return -1.0
        lat = self.latency_us[key]
        log_size = _log2i(int(size_bytes) >> 6)
        if algorithm is Algorithm.TREE and op is CollectiveOp.ALL_REDUCE and 0 <= log_size < 23:
            bw *= _TREE_CORRECTION[_PROTOS.index(protocol)][log_size]
        # (the NVLS-tree correction applies to Blackwell on x86 only)
        if (
            algorithm is Algorithm.NVLS_TREE
            and op is CollectiveOp.ALL_REDUCE
            and 0 <= log_size < 24
            and self.arch >= 100
        ):
            bw *= _TREE_CORRECTION[_PROTOS.index(protocol)][log_size]
        if (
            algorithm is Algorithm.RING
            and protocol is _SIMPLE
            and self.num_nodes > 1
            and op is CollectiveOp.ALL_REDUCE
            and size_bytes / (self.num_channels * self.num_ranks) >= 64
        ):
            lat *= 1.9 if self.arch < 80 else 1.4  # "plateau effect of ring"
        return lat + size_bytes / (1000.0 * bw)

    def options(self, op: CollectiveOp) -> list[tuple[Algorithm, Protocol]]:
        """The enabled (algorithm, protocol) pairs for ``op``, in NCCL's loop order (made once
        per op: the list is shared, callers only read it)."""
        found = self._options.get(op)
        if found is None:
            found = self._options[op] = [
                (a, p)
                for a in _BASE_US
                for p in _PROTOS
                if self.bandwidth_gbps.get((op, a, p), 0.0) > 0
            ]
        return found


def _log2i(n: int) -> int:
    return n.bit_length() - 1 if n > 0 else -1


def table_for(group: Group) -> TunerTable:
    """The tuning table of ``group``'s communicator (cached on the topology)."""
    topo = group.topology
    gpus, nics = node_shape(topo, group.ranks)
    tables = _TABLES.of(topo)
    key = (group.size, group.num_nodes, gpus, nics)
    found = tables.get(key)
    if found is None:
        found = tables[key] = _tune(topo, group.size, group.num_nodes, gpus, nics)
    return found


def _tune(topo: Topology, num_ranks: int, num_nodes: int, gpus: int, num_nics: int) -> TunerTable:
    """``ncclTopoTuneModel`` (src/graph/tuning.cc) for ``num_ranks`` over ``num_nodes``.

    Stays long: it follows ncclTopoTuneModel's one loop over (op, algorithm, protocol) line by
    line, so that it can be read against tuning.cc and updated with it."""
    arch = arch_of(topo)
    cc = _arch_index(arch)
    graphs = graphs_for(topo, num_nodes, gpus, num_nics)
    fabric = topo.fabric
    amd = topo.host_cpu_vendor == "amd"
    index2 = num_nodes - 1 if num_nodes <= 2 else 2
    index1 = cc if num_nodes == 1 else (1 if amd else 0)
    ll_max = _LL_MAX_BW[index1][index2]
    per_ch_tree = _PER_CH_TREE[cc][index2]
    per_ch_ring_ll128 = _PER_CH_RING_LL128[cc][index2]
    per_ch_tree_ll128 = _PER_CH_TREE_LL128[cc][index2]
    per_ch_nvls_tree = _PER_CH_NVLS_TREE[cc][index2]
    ppn = num_ranks / num_nodes
    nvlink = topo.intra.interconnect is Interconnect.NVSWITCH
    intra_hw = _NVLINK_HW if nvlink else _PCI_HW
    hw = intra_hw if num_nodes == 1 else _NET_HW
    collnet = fabric.collnet and num_nodes > 1
    # graph->latencyInter (the net plugin's), per protocol family: LL / LL128, and Simple
    # (tuning.cc adds it twice for Simple; the fabric gives the sum)
    net_latency = (fabric.net_latency_s * 1e6, fabric.net_simple_latency_s * 1e6)
    lat: dict[tuple[CollectiveOp, Algorithm, Protocol], float] = {}
    bws: dict[tuple[CollectiveOp, Algorithm, Protocol], float] = {}
    bus: dict[tuple[CollectiveOp, Algorithm, Protocol], float] = {}
    ops = (
        CollectiveOp.BROADCAST,
        CollectiveOp.REDUCE,
        CollectiveOp.ALL_GATHER,
        CollectiveOp.REDUCE_SCATTER,
        CollectiveOp.ALL_REDUCE,
    )
    gathers = (CollectiveOp.ALL_GATHER, CollectiveOp.REDUCE_SCATTER)
    pat_enabled = arch >= 60 and num_nodes == num_ranks  # ncclPatEnable: 1 GPU per node only
    for op in ops:
        nsteps = (
            2 * (num_ranks - 1)
            if op is CollectiveOp.ALL_REDUCE
            else num_ranks - 1
            if op in gathers
            else num_ranks
        )
        for a in _BASE_US:
            if op in (CollectiveOp.BROADCAST, CollectiveOp.REDUCE) and a is not Algorithm.RING:
                continue
            if op in gathers and a not in (
                Algorithm.PAT,
                Algorithm.RING,
                Algorithm.NVLS,
                Algorithm.COLLNET_DIRECT,
            ):
                continue
            if op is CollectiveOp.ALL_REDUCE and a is Algorithm.PAT:
                continue
            graph = graphs.get(a)
            if graph is None:
                continue
            for p in _PROTOS:
                if a in (Algorithm.NVLS, Algorithm.NVLS_TREE) and p is not _SIMPLE:
                    continue
                if a is Algorithm.PAT and (p is not _SIMPLE or not pat_enabled):
                    continue
                is_collnet = a in (Algorithm.COLLNET_DIRECT, Algorithm.COLLNET_CHAIN)
                bw = graph.bw_intra_gbps if (num_nodes <= 2 or is_collnet) else graph.bw_inter_gbps
                if a in (Algorithm.NVLS, Algorithm.NVLS_TREE):
                    if graph.num_channels < 2:
                        continue
                    intra_bw = (
                        graph.bw_intra_gbps
                        * _NVLS_EFFICIENCY[cc]
                        * (graph.num_channels - 1)
                        / graph.num_channels
                    )
                    intra_bw *= 2.0 if op is CollectiveOp.ALL_REDUCE else (ppn - 1) / ppn
                    inter_bw = graph.bw_inter_gbps * (
                        2 if (num_nodes <= 2 and a is Algorithm.NVLS_TREE) else 1
                    )
                    bw = min(intra_bw, inter_bw)
                    if a is Algorithm.NVLS_TREE:
                        bw = min(bw, per_ch_nvls_tree)
                bus_bw = graph.num_channels * bw
                if a is Algorithm.RING and p is _LL:
                    bus_bw = min(ll_max, bus_bw * 0.5)
                if a is Algorithm.RING and p is _LL128:
                    bus_bw = min(bus_bw * 0.92, graph.num_channels * per_ch_ring_ll128)
                if a is Algorithm.TREE and op is CollectiveOp.ALL_REDUCE:
                    bus_bw = min(bus_bw * 0.92, graph.num_channels * per_ch_tree)
                if a is Algorithm.TREE and p is _LL:
                    bus_bw = min(bus_bw / 3.8, ll_max)
                if a is Algorithm.TREE and p is _LL128:
                    bus_bw = min(
                        bus_bw * (7.0 / 9.0 if num_nodes == 1 else 120.0 / 128.0),
                        graph.num_channels * per_ch_tree_ll128,
                    )
                if a is Algorithm.PAT:
                    bus_bw *= 0.75
                if is_collnet and p is not _SIMPLE:
                    bus_bw = 0.0
                if a is Algorithm.COLLNET_DIRECT and p is _SIMPLE:
                    if op in gathers:
                        bus_bw = ppn * min(graph.bw_intra_gbps, graph.bw_inter_gbps * 0.9)
                    else:
                        factor = ppn / graph.num_channels
                        factor -= (factor - 1) / 2
                        bus_bw /= factor
                        if arch >= 90:
                            bus_bw *= 0.85
                # all_gather / reduce_scatter through the switch across nodes needs the CollNet
                # plugin's iallgather / ireducescatter (tuning.cc); collsim's CollNet is
                # all_reduce only, so they stay off
                if (
                    a in (Algorithm.NVLS, Algorithm.COLLNET_DIRECT)
                    and op in gathers
                    and num_nodes > 1
                ):
                    bus_bw = 0.0
                # enable / disable (tuning.cc, after the table)
                if a is Algorithm.NVLS_TREE and num_nodes == 1:
                    bus_bw = 0.0
                if not collnet and (is_collnet or (a is Algorithm.NVLS and num_nodes > 1)):
                    bus_bw = 0.0
                if p is _LL128 and not _ll128_enabled(topo, arch, num_nodes):
                    bus_bw = 0.0
                if p is _LL and num_nodes > 1 and not fabric.ll:  # the transport has no LL
                    bus_bw = 0.0
                algo_bw = bus_bw
                if not (a is not Algorithm.RING and op in gathers):
                    ratio = (
                        # one rank has no steps (a local copy): tuning.cc's nRanks / nsteps
                        # would divide by zero; its bandwidth is never used
                        (num_ranks / nsteps if nsteps else 1.0)
                        if a in (Algorithm.RING, Algorithm.NVLS, Algorithm.NVLS_TREE)
                        else 0.5
                    )
                    algo_bw *= ratio
                key = (op, a, p)
                bws[key] = algo_bw
                bus[key] = bus_bw
                lat[key] = _latency_us(
                    op,
                    a,
                    p,
                    nsteps,
                    num_ranks,
                    num_nodes,
                    ppn,
                    intra_hw,
                    hw,
                    net_latency[1] if p is _SIMPLE else net_latency[0],
                    amd,
                )
    return TunerTable(
        lat,
        bws,
        bus,
        num_nodes,
        num_ranks,
        runtime_channels(topo, num_nodes, gpus, num_nics),
        arch,
    )


def _ll128_enabled(topo: Topology, arch: int, num_nodes: int) -> bool:
    """LL128 by default (tuning.cc): NVLink inside the node (typeIntra <= NVB) and a network
    path NCCL accepts (PXN on Hopper+, PXB before); a fabric may turn it off across nodes."""
    if topo.intra.interconnect is not Interconnect.NVSWITCH:
        return False
    if num_nodes > 1 and not topo.fabric.ll128:
        return False
    return arch >= 70


def _latency_us(
    op: CollectiveOp,
    a: Algorithm,
    p: Protocol,
    nsteps: int,
    num_ranks: int,
    num_nodes: int,
    ppn: float,
    intra_hw: int,
    hw: int,
    latency_inter_us: float,
    amd: bool,
) -> float:
    """The latency half of ``ncclTopoTuneModel``."""
    pi = _PROTOS.index(p)
    base = _BASE_US[a][pi]
    intra = _HW_US[intra_hw][a][pi]
    inter = _HW_US[_NET_HW][Algorithm.TREE][pi] if ppn == 1 else _HW_US[_NET_HW][a][pi]
    inter += latency_inter_us  # the transport's, Simple's flush included (see _tune)
    local = num_ranks // num_nodes
    log_nodes = _log2i(num_nodes)
    match a:
        case Algorithm.RING:
            step = _HW_US[hw][a][pi]
            if op in (CollectiveOp.BROADCAST, CollectiveOp.REDUCE):
                return base + step  # sameChannels rings
            net_overhead = 0.0
            if num_nodes > 1:
                net_overhead = 2.0 if amd else 1.0  # getNetOverhead: x86 Intel 1 us, AMD 2 us
                if p is _SIMPLE:
                    net_overhead *= 3
            intra = max(intra, net_overhead)
            inter_steps = (
                0
                if num_nodes == 1
                else 2 * (num_nodes - 1)
                if op is CollectiveOp.ALL_REDUCE
                else num_nodes - 1
            )
            return base + (nsteps - inter_steps) * intra + inter_steps * inter
        case Algorithm.TREE:
            if op is CollectiveOp.ALL_REDUCE:
                return base + 2 * ((local - 1) * intra + log_nodes * inter)
            return base
        case Algorithm.COLLNET_DIRECT:
            return base + 2 * (min(1, local - 1) * intra + (local - 1) * 0.4) + inter
        case Algorithm.COLLNET_CHAIN:
            return base + 2 * (local - 1) * intra + inter
        case Algorithm.NVLS:
            return intra + (inter if num_nodes > 1 else 0.0)
        case Algorithm.NVLS_TREE:
            return base + intra + 2 * log_nodes * inter
        case Algorithm.PAT:
            if op in (CollectiveOp.ALL_GATHER, CollectiveOp.REDUCE_SCATTER):
                return base + log_nodes * (inter / 3.5) + num_ranks * 2.8
            return base
        case _:
            return math.inf


def pick(op: CollectiveOp, size_bytes: float, group: Group) -> tuple[Algorithm, Protocol] | None:
    """NCCL's choice for one call (``topoGetAlgoInfo``: the least ``ncclTopoGetAlgoTime``,
    first in (algorithm, protocol) order on ties); None if NCCL has nothing for ``op``."""
    table = table_for(group)
    key = (op, size_bytes)
    if key in table._picks:  # the choice depends on the table only: groups alike share it
        return table._picks[key]
    best = _plugin_pick(op, size_bytes, group, table)
    best_us = math.inf
    for a, p in table.options(op) if best is None else ():
        t = table.time_us(op, a, p, size_bytes)
        if 0 <= t < best_us:
            best, best_us = (a, p), t
    if len(table._picks) >= _PICKS_KEPT:
        table._picks.clear()
    table._picks[key] = best
    return best


def _plugin_pick(
    op: CollectiveOp, size_bytes: float, group: Group, table: TunerTable
) -> tuple[Algorithm, Protocol] | None:
    """The transport plugin's choice where the topology follows one (``fabric.tuner:
    aws-ofi-nccl`` on a platform it has regions for), else None (NCCL decides)."""
    fabric = group.topology.fabric
    if fabric.tuner != "aws-ofi-nccl" or fabric.platform is None:
        return None
    platform = EFA_PLATFORMS[fabric.platform].tuner_platform
    if platform is None:
        return None
    return ofi_tuner.region_pick(
        platform,
        op,
        size_bytes,
        table.num_ranks,
        table.num_nodes,
        lambda a, p: table.bandwidth_gbps.get((op, a, p), 0.0) > 0,
    )


_PICKS_KEPT = 4096
"""Choices a table remembers (by op and size; a sweep of sizes starts again after this)."""
