"""NCCL's own cost model and (algorithm, protocol) choice, re-derived from NCCL 2.30.7.

Release followed: NVIDIA/nccl 2.30.7 (makefiles/version.mk: NCCL_MAJOR 2, NCCL_MINOR 30,
NCCL_PATCH 7). Every rule below names the file it comes from.

Three steps, as NCCL takes them at communicator init and at each call:

1. **Graphs** (src/graph/search.cc ``ncclTopoCompute``, ``ncclTopoDupChannels``): per algorithm
   pattern (ring, tree, NVLS) a number of channels and a per-channel bandwidth inside the node
   (``bwIntra``) and across it (``bwInter``), chosen from the per-architecture speed arrays
   (``sm90SpeedArrayIntra`` ...) as the largest ``channels x speed`` the links can carry.
   :func:`graphs_for` emulates that search on collsim's node model: a GPU's NVLink bandwidth
   is its link count x NCCL's per-link figure (src/graph/topo.h ``SM80_NVLINK_BW`` 20,
   ``SM90_NVLINK_BW`` 20.6, ``SM100_NVLINK_BW`` 40.1 GB/s), a NIC's is its rate / 8.
   A ring or tree channel uses ``speed`` of every GPU's NVLink and, across nodes, of one NIC;
   an NVLS channel has a head GPU that carries twice (``ncclTopoSearchTryNvls``).
2. **Tuning table** (src/graph/tuning.cc ``ncclTopoTuneModel``): per (op, algorithm,
   protocol) a latency (base + hops x hardware latency per link class) and a bus bandwidth
   (channels x per-channel bandwidth, with the per-protocol caps ``llMaxBws``,
   ``perChMaxRingLL128Bws``, ``perChMaxTreeBws``, ``perChMaxTreeLL128Bws``,
   ``perChMaxNVLSTreeBws``, the NVLS efficiency per architecture, LL's 0.5, LL128's 0.92),
   converted to an algorithm bandwidth. :class:`TunerTable`.
3. **Choice** (src/graph/tuning.cc ``ncclTopoGetAlgoTime``; src/enqueue.cc
   ``topoGetAlgoInfo``): time = latency + bytes / (1000 x bw) [us], with the tree correction
   factors for medium sizes and the ring plateau factor across nodes; the cheapest enabled
   (algorithm, protocol) wins (:func:`pick`). ``topoGetAlgoInfo`` then cuts the channel count
   for small sizes (:func:`runtime_channels`).

What collsim does not emulate: the search's path types beyond NVLink/PCIe/NET (PXN, C2C), the
timeouts, cross-NIC rings, a tuner plugin, user environment overrides and symmetric kernels.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

from collsim.collectives.types import Algorithm, CollectiveOp, Group, Protocol
from collsim.topology import Interconnect, Topology

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
    "table_for",
    "NCCL_RELEASE",
]

NCCL_RELEASE = "2.30.7"
"""The NCCL release these rules follow (makefiles/version.mk)."""

_LL, _LL128, _SIMPLE = Protocol.LL, Protocol.LL128, Protocol.SIMPLE
_PROTOS = (_LL, _LL128, _SIMPLE)
_VOLTA, _AMPERE, _HOPPER, _BLACKWELL = 0, 1, 2, 3

# --- src/graph/search.cc speed arrays (GB/s per channel) ----------------------------------
_SPEED_INTRA = {
    80: (40.0, 30.0, 20.0, 18.0, 15.0, 12.0, 10.0, 9.0, 7.0, 6.0, 5.0, 4.0, 3.0),
    90: (60.0, 50.0, 40.0, 30.0, 24.0, 20.0, 15.0, 12.0, 11.0, 6.0, 3.0),
    100: (90.0, 80.0, 70.0, 60.0, 50.0, 45.0, 40.0, 30.0, 24.0, 20.0, 19.0, 18.0),
}
_SPEED_INTER = {
    80: (48.0, 30.0, 28.0, 24.0, 20.0, 18.0, 15.0, 12.0, 10.0, 9.0, 7.0, 6.0, 5.0, 4.0, 3.0)
    + (2.4, 1.2, 0.24, 0.12),
    90: (48.0, 45.0, 42.0, 40.0, 30.0, 24.0, 22.0, 20.0, 17.5, 15.0, 12.0, 6.0, 3.0, 2.4)
    + (1.2, 0.24, 0.12),
    100: (96.0, 86.0, 80.0, 48.0, 45.1, 42.0, 40.0, 30.0, 24.0, 22.0, 20.0, 17.5, 15.0, 12.0)
    + (6.0, 3.0, 2.4, 1.2, 0.24, 0.12),
}
# src/graph/topo.h: NCCL's achievable bandwidth of one NVLink, GB/s, and the line rate of one
# link of that generation (NVLink3/4: 25 GB/s per direction, NVLink5: 50) to count links.
_NVLINK_BW = {80: 20.0, 90: 20.6, 100: 40.1}
_NVLINK_LINE = {80: 25.0, 90: 25.0, 100: 50.0}
_MAXCHANNELS = 64  # src/include/device.h MAXCHANNELS
_NVLS_ARITY = 32  # src/include/device.h NCCL_MAX_NVLS_ARITY
_DIRECT_ARITY = 7  # src/include/device.h NCCL_MAX_DIRECT_ARITY
_NVLS_CHANNELS = {90: 16, 100: 32}  # src/transport/nvls.cc NVLS_NCHANNELS_SM90 / _SM100
_NVLS_CHANNELS_SM100_NVL = 24  # src/transport/nvls.cc NVLS_NCHANNELS_SM100_NVL (one node)

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
# src/include/comm.h thread thresholds and src/include/device.h maximum threads per protocol.
_THREAD_THRESHOLD = {_LL: 8, _LL128: 8, _SIMPLE: 64}
_MAX_THREADS = {_LL: 512, _LL128: 640, _SIMPLE: 512}

_ARCH = {"a100": 80, "h100": 90, "h200": 90, "b200": 100}
"""Compute capability of the catalogue's GPUs (CUDA: A100 sm80, H100/H200 sm90, B200 sm100)."""


def arch_of(topology: Topology) -> int:
    """Compute capability x 10 of the topology's GPU (80 for an unknown device)."""
    return _ARCH.get(topology.device.key, 80)


def _arch_index(arch: int) -> int:
    return _BLACKWELL if arch >= 100 else _HOPPER if arch >= 90 else _AMPERE


@dataclass(frozen=True, slots=True)
class NcclGraph:
    """One search result (src/graph/search.cc ``struct ncclTopoGraph``)."""

    num_channels: int
    bw_intra_gbps: float
    bw_inter_gbps: float


def _speeds(arch: int, inter: bool) -> tuple[float, ...]:
    key = 100 if arch >= 100 else 90 if arch >= 90 else 80
    return (_SPEED_INTER if inter else _SPEED_INTRA)[key]


def _fit(
    speed: float,
    *,
    gpu_bw: float,
    nic_bw: float | None,
    num_nics: int,
    max_channels: int,
    nvls: bool,
    min_channels: int = 1,
    gpus: int = 1,
) -> int:
    """Channels of ``speed`` the links can carry (0 if fewer than ``min_channels``)."""
    if nvls:  # every GPU carries one share per channel and its head channel twice
        channels = min(max_channels, int(gpu_bw / speed + 1e-9) - 1)
    elif nic_bw is not None and gpus > 1:
        # across nodes a channel enters and leaves the node through NICs (PCIe), so each
        # GPU's NVLink carries (g-1)/g of the channels
        channels = min(max_channels, int(gpu_bw / (speed * (gpus - 1) / gpus) + 1e-9))
    else:
        channels = min(max_channels, int(gpu_bw / speed + 1e-9))
    if nic_bw is not None:
        per_nic = int(nic_bw / speed + 1e-9)
        channels = min(channels, num_nics * per_nic)
    return channels if channels >= min_channels else 0


def _search(
    topology: Topology, pattern: Algorithm, max_channels: int, multi_node: bool
) -> NcclGraph:
    """Emulation of ``ncclTopoCompute`` pass 1, ``ncclTopoDupChannels`` and pass 2."""
    arch = arch_of(topology)
    gpu_bw = _gpu_bw_gbps(topology)
    nics = topology.nics
    nic_bw = nics.bandwidth_bps / 1e9 if (multi_node and nics is not None) else None
    num_nics = nics.count if nics is not None else 0
    speeds = _speeds(arch, multi_node)
    gpus = topology.gpus_per_node
    nvls = pattern is Algorithm.NVLS
    # NVLS inside one node pulls evenly from every GPU (minChannels = maxChannels).
    min_channels = max_channels if (nvls and not multi_node) else 1
    max_bw = gpu_bw if nic_bw is None else min(gpu_bw, nic_bw)
    total_bw = gpu_bw
    index = 0
    while index < len(speeds) - 1 and (
        speeds[index] > max_bw or speeds[index] * min_channels > total_bw
    ):
        index += 1
    best: tuple[int, float] | None = None
    while True:
        speed = speeds[index]
        channels = _fit(
            speed,
            gpu_bw=gpu_bw,
            nic_bw=nic_bw,
            num_nics=num_nics,
            max_channels=max_channels,
            nvls=nvls,
            min_channels=min_channels,
            gpus=gpus,
        )
        if channels and (best is None or channels * speed > best[0] * best[1]):
            best = (channels, speed)
        if best is not None and best[0] * best[1] >= total_bw:
            break  # "optimal solution, stop here"
        nxt = index + 1
        if nxt >= len(speeds) or (best is not None and speeds[nxt] / best[1] <= 0.49):
            break
        index = nxt
    if best is None:
        return NcclGraph(1, 0.1, 0.1)  # "falling back to simple order"
    channels, speed = best
    bw_intra = bw_inter = speed
    # ncclTopoDupChannels: double the channels at half the bandwidth, unless slow, or on
    # Hopper and later below 50 GB/s with more than 4 channels.
    if bw_intra >= 25.0 and not (arch > 80 and bw_intra < 50.0 and channels > 4):
        dup = min(channels * 2, max_channels)
        factor = -(-dup // channels)
        bw_intra /= factor
        bw_inter /= factor
        channels = dup
    # Pass 2: raise the bandwidth with the channel count fixed.
    up = [s for s in speeds if s > bw_inter]
    up.reverse()  # ascending
    if pattern is Algorithm.RING:
        for s in up:
            if _fit(
                s,
                gpu_bw=gpu_bw,
                nic_bw=nic_bw,
                num_nics=num_nics,
                max_channels=channels,
                nvls=False,
                min_channels=channels,
                gpus=gpus,
            ):
                bw_intra = bw_inter = s
            else:
                break
    elif nvls:
        for s in up:
            if bw_inter >= 2 * bw_intra:
                break
            ok = nic_bw is None or _fit(
                s,
                gpu_bw=1e12,
                nic_bw=nic_bw,
                num_nics=num_nics,
                max_channels=channels,
                nvls=False,
                min_channels=channels,
            )
            if not ok:
                break
            bw_inter = s
    else:  # trees: raise bwIntra while below twice bwInter
        for s in [s for s in reversed(speeds) if s > bw_intra]:
            per_gpu = channels * s * ((gpus - 1) / gpus if multi_node and gpus > 1 else 1.0)
            if bw_intra >= 2 * bw_inter or per_gpu > gpu_bw + 1e-9:
                break
            bw_intra = s
    return NcclGraph(channels, bw_intra, bw_inter)


def _gpu_bw_gbps(topology: Topology) -> float:
    """NCCL's view of a GPU's bandwidth to the node's switch, GB/s."""
    intra = topology.intra
    line_gbps = intra.bandwidth_bps / 1e9
    if intra.interconnect is Interconnect.NVSWITCH:
        arch = arch_of(topology)
        key = 100 if arch >= 100 else 90 if arch >= 90 else 80
        links = round(line_gbps / _NVLINK_LINE[key])
        return links * _NVLINK_BW[key]
    return line_gbps * intra.efficiency


def graphs_for(topology: Topology, num_nodes: int) -> dict[Algorithm, NcclGraph]:
    """Ring, tree and NVLS graphs NCCL builds for ``num_nodes`` nodes of this topology.

    Ring first with ``maxChannels = MAXCHANNELS / 2``; tree with at most the ring's channels;
    NVLS with at most ``min(NCCL_MAX_NVLS_ARITY, GPUs)`` (src/init.cc graph setup).
    """
    cache = topology.cache
    key = ("nccl-graphs", num_nodes)
    found = cache.get(key)
    if found is not None:
        return dict(found)
    multi = num_nodes > 1
    ring = _search(topology, Algorithm.RING, _MAXCHANNELS // 2, multi)
    tree = _search(topology, Algorithm.TREE, ring.num_channels, multi)
    graphs = {Algorithm.RING: ring, Algorithm.TREE: tree, Algorithm.PAT: tree}
    graphs[Algorithm.COLLNET_CHAIN] = tree
    gpus = topology.gpus_per_node
    if topology.nvls and arch_of(topology) >= 90:
        nvls = _search(topology, Algorithm.NVLS, min(_NVLS_ARITY, gpus), multi)
        graphs[Algorithm.NVLS] = nvls
        graphs[Algorithm.NVLS_TREE] = nvls
    if topology.intra.interconnect is Interconnect.NVSWITCH:
        graphs[Algorithm.COLLNET_DIRECT] = NcclGraph(
            min(_DIRECT_ARITY + 1, gpus), tree.bw_intra_gbps, tree.bw_inter_gbps
        )
    cache[key] = graphs
    return dict(graphs)


def runtime_channels(topology: Topology, num_nodes: int) -> int:
    """``comm->nChannels``: twice the ring graph's channels (src/graph/connect.cc), doubled
    again on Hopper+ across nodes when the ring runs above 45 GB/s with fewer than 16."""
    ring = graphs_for(topology, num_nodes)[Algorithm.RING]
    channels = min(_MAXCHANNELS, 2 * ring.num_channels)
    if arch_of(topology) >= 90 and num_nodes > 1 and ring.bw_intra_gbps > 45.0 and channels < 16:
        channels *= 2
    return channels


def nvls_channels(topology: Topology, num_nodes: int) -> int:
    """``comm->nvlsChannels`` (src/transport/nvls.cc ``ncclNvlsTuning``)."""
    arch = arch_of(topology)
    if arch >= 100:
        return _NVLS_CHANNELS[100] if num_nodes > 1 else _NVLS_CHANNELS_SM100_NVL
    return _NVLS_CHANNELS[90]


def channels_for_size(
    topology: Topology,
    num_nodes: int,
    algorithm: Algorithm,
    protocol: Protocol,
    size_bytes: float,
    num_ranks: int,
) -> int:
    """Channels a call of ``size_bytes`` runs on (src/enqueue.cc ``topoGetAlgoInfo``): ring and
    tree drop channels while bytes < channels x threads x threshold; NVLS runs
    ``nvlsChannels``."""
    nc = runtime_channels(topology, num_nodes)
    if algorithm in (Algorithm.NVLS, Algorithm.NVLS_TREE):
        nvls = nvls_channels(topology, num_nodes)
        return min(nvls, nc) if (num_nodes > 1 and algorithm is Algorithm.NVLS) else nvls
    if algorithm in (Algorithm.RING, Algorithm.TREE):
        threshold = _THREAD_THRESHOLD[protocol]
        if algorithm is Algorithm.RING and protocol is _LL:
            threshold *= num_ranks
        nt = _MAX_THREADS[protocol]
        while size_bytes < nc * nt * threshold and nc > 1:
            nc -= 1
    return nc


def min_bytes_per_channel(algorithm: Algorithm, protocol: Protocol, num_ranks: int) -> float:
    """Bytes per channel below which ``topoGetAlgoInfo`` drops a channel (ring and tree):
    maximum threads x thread threshold, the ring's LL threshold x ranks (src/enqueue.cc,
    src/graph/tuning.cc threadThresholds)."""
    threshold = _THREAD_THRESHOLD[protocol]
    if algorithm is Algorithm.RING and protocol is _LL:
        threshold *= num_ranks
    return float(_MAX_THREADS[protocol] * threshold)


def channel_counter(
    topology: Topology,
    num_nodes: int,
    algorithm: Algorithm,
    protocol: Protocol,
    num_ranks: int,
) -> Callable[[float], int]:
    """:func:`channels_for_size` as a closed form for ring and tree: the loop "drop a channel
    while bytes < channels x threads x threshold" ends at clamp(bytes // (threads x
    threshold), 1, channels)."""
    full = runtime_channels(topology, num_nodes)
    threshold = _THREAD_THRESHOLD[protocol]
    if algorithm is Algorithm.RING and protocol is _LL:
        threshold *= num_ranks
    per_channel = _MAX_THREADS[protocol] * threshold

    def channels(size_bytes: float) -> int:
        nc = int(size_bytes // per_channel)
        return full if nc >= full else nc if nc > 1 else 1

    return channels


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
        """The enabled (algorithm, protocol) pairs for ``op``, in NCCL's loop order."""
        return [
            (a, p)
            for a in _BASE_US
            for p in _PROTOS
            if self.bandwidth_gbps.get((op, a, p), 0.0) > 0
        ]


def _log2i(n: int) -> int:
    return n.bit_length() - 1 if n > 0 else -1


def table_for(group: Group) -> TunerTable:
    """The tuning table of ``group``'s communicator (cached on the topology)."""
    topo = group.topology
    key = ("nccl-tuner", group.size, group.num_nodes)
    found = topo.cache.get(key)
    if found is None:
        found = topo.cache[key] = _tune(topo, group.size, group.num_nodes)
    return found


def _tune(topo: Topology, num_ranks: int, num_nodes: int) -> TunerTable:
    """``ncclTopoTuneModel`` (src/graph/tuning.cc) for ``num_ranks`` over ``num_nodes``."""
    arch = arch_of(topo)
    cc = _arch_index(arch)
    graphs = graphs_for(topo, num_nodes)
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
                algo_bw = bus_bw
                if not (a is not Algorithm.RING and op in gathers):
                    ratio = (
                        num_ranks / nsteps
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
    return TunerTable(lat, bws, bus, num_nodes, num_ranks, runtime_channels(topo, num_nodes), arch)


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
    best: tuple[Algorithm, Protocol] | None = None
    best_us = math.inf
    for a, p in table.options(op):
        t = table.time_us(op, a, p, size_bytes)
        if 0 <= t < best_us:
            best, best_us = (a, p), t
    return best
