"""NCCL's channels: the graph search and the channel count of a call, from NCCL 2.30.7.

- **Graphs** (src/graph/search.cc ``ncclTopoCompute``, ``ncclTopoDupChannels``): per algorithm
  pattern (ring, tree, NVLS) a number of channels and a per-channel bandwidth inside the node
  (``bwIntra``) and across it (``bwInter``), chosen from the per-architecture speed arrays
  (``sm90SpeedArrayIntra`` ...) as the largest ``channels x speed`` the links can carry.
  :func:`graphs_for` emulates that search on collsim's node model: a GPU's NVLink bandwidth is
  its link count x NCCL's per-link figure (src/graph/topo.h ``SM80_NVLINK_BW`` 20,
  ``SM90_NVLINK_BW`` 20.6, ``SM100_NVLINK_BW`` 40.1 GB/s), a NIC's is its rate / 8. A ring or
  tree channel uses ``speed`` of every GPU's NVLink (7/8 of them across nodes, where channels
  enter and leave through NICs) and, across nodes, of one NIC; an NVLS channel has a head GPU
  that carries twice (``ncclTopoSearchTryNvls``). Not emulated: path types beyond
  NVLink / PCIe / NET (PXN, C2C), search timeouts, cross-NIC rings.
- **Runtime channels** (src/graph/connect.cc): twice the ring graph's, doubled again on Hopper
  and later across nodes for fast rings; ``nvlsChannels`` (src/transport/nvls.cc).
- **Channels of a call** (src/enqueue.cc ``topoGetAlgoInfo``): rings and trees drop channels
  while bytes < channels x threads x threshold.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np

from collsim.cluster.topology import Topology
from collsim.collectives.memo import PerTopology
from collsim.core.vocab import Algorithm, Interconnect, Protocol

__all__ = [
    "NcclGraph",
    "arch_of",
    "graphs_for",
    "node_shape",
    "runtime_channels",
    "nvls_channels",
    "channels_for_size",
    "channel_counter",
    "min_bytes_per_channel",
]

_GRAPHS: PerTopology[tuple[int, int, int], dict[Algorithm, NcclGraph]] = PerTopology()
"""NCCL's ring / tree / NVLS graphs per (nodes, GPUs per node, NICs per node)."""
_NODE_SHAPES: PerTopology[tuple[int, ...], tuple[int, int]] = PerTopology()
"""(GPUs per node, NICs per node) a communicator over these ranks sees."""

_LL, _LL128, _SIMPLE = Protocol.LL, Protocol.LL128, Protocol.SIMPLE

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

# src/include/comm.h thread thresholds and src/include/device.h maximum threads per protocol.
_THREAD_THRESHOLD = {_LL: 8, _LL128: 8, _SIMPLE: 64}
_MAX_THREADS = {_LL: 512, _LL128: 640, _SIMPLE: 512}

_ARCH = {"a100": 80, "h100": 90, "h200": 90, "b200": 100}
"""Compute capability of the catalogue's GPUs (CUDA: A100 sm80, H100/H200 sm90, B200 sm100)."""


def arch_of(topology: Topology) -> int:
    """Compute capability x 10 of the topology's GPU (80 for an unknown device)."""
    return _ARCH.get(topology.device.key, 80)


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
    topology: Topology,
    pattern: Algorithm,
    max_channels: int,
    multi_node: bool,
    gpus: int,
    num_nics: int,
) -> NcclGraph:
    """Emulation of ``ncclTopoCompute`` pass 1, ``ncclTopoDupChannels`` and pass 2 for a
    communicator with ``gpus`` GPUs on each node, reaching ``num_nics`` NICs.

    Stays long: the three passes share the search state (speed index, best channels, the two
    bandwidths) in the order src/graph/search.cc runs them, which one function keeps visible."""
    arch = arch_of(topology)
    gpu_bw = _gpu_bw_gbps(topology)
    nics = topology.nics
    nic_bw = nics.bandwidth_bps / 1e9 if (multi_node and nics is not None) else None
    speeds = _speeds(arch, multi_node)
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


def node_shape(topology: Topology, ranks: Sequence[int]) -> tuple[int, int]:
    """(GPUs per node, NICs per node) a communicator over ``ranks`` sees: the most ranks it
    has on a node, and the distinct NICs nearest to that node's ranks (kept per ranks in the
    topology's memo)."""
    key = tuple(ranks)
    memo = _NODE_SHAPES.of(topology)
    hit = memo.get(key)
    if hit is None:
        hit = memo[key] = _node_shape(topology, key)
    return hit


def _node_shape(topology: Topology, ranks: tuple[int, ...]) -> tuple[int, int]:
    local = (
        _fullest_node_python(topology, ranks)
        if len(ranks) <= _SMALL_GROUP
        else _fullest_node_arrays(topology, ranks)
    )
    if topology.nics is None:
        return len(local), 0
    gpn = topology.gpus_per_node
    nics = len({g * topology.nics.count // gpn for g in local})
    return len(local), nics


_SMALL_GROUP = 64
"""Ranks up to which :func:`_node_shape` counts in Python (numpy's unique and lexsort cost more
on a tensor- or data-parallel group of a few dozen)."""


def _fullest_node_python(topology: Topology, ranks: tuple[int, ...]) -> list[int]:
    """The in-node indices of the ranks on the fullest node; among equals the node met first
    in ``ranks`` (a dict keeps the order of first appearance, max the first of equals)."""
    gpn = topology.gpus_per_node
    counts: dict[int, int] = {}
    for r in ranks:
        counts[r // gpn] = counts.get(r // gpn, 0) + 1
    best = max(counts, key=counts.__getitem__)
    return [r % gpn for r in ranks if r // gpn == best]


def _fullest_node_arrays(topology: Topology, ranks: tuple[int, ...]) -> list[int]:
    """:func:`_fullest_node_python` with array operations (large groups)."""
    gpn = topology.gpus_per_node
    members = np.asarray(ranks, dtype=np.int64)
    nodes = members // gpn
    found, first, counts = np.unique(nodes, return_index=True, return_counts=True)
    best = int(np.lexsort((first, -counts))[0])
    local: list[int] = (members[nodes == found[best]] % gpn).tolist()
    return local


def graphs_for(
    topology: Topology,
    num_nodes: int,
    gpus: int | None = None,
    num_nics: int | None = None,
) -> dict[Algorithm, NcclGraph]:
    """Ring, tree and NVLS graphs NCCL builds for a communicator of ``gpus`` GPUs (default:
    all) on each of ``num_nodes`` nodes, reaching ``num_nics`` NICs per node (default: all).

    Ring first with ``maxChannels = MAXCHANNELS / 2``; tree with at most the ring's channels;
    NVLS with at most ``min(NCCL_MAX_NVLS_ARITY, GPUs)`` (src/init.cc graph setup).
    """
    gpus = topology.gpus_per_node if gpus is None else gpus
    if num_nics is None:
        num_nics = topology.nics.count if topology.nics is not None else 0
    cache = _GRAPHS.of(topology)
    key = (num_nodes, gpus, num_nics)
    found = cache.get(key)
    if found is not None:
        return dict(found)
    multi = num_nodes > 1
    ring = _search(topology, Algorithm.RING, _MAXCHANNELS // 2, multi, gpus, num_nics)
    tree = _search(topology, Algorithm.TREE, ring.num_channels, multi, gpus, num_nics)
    graphs = {Algorithm.RING: ring, Algorithm.TREE: tree, Algorithm.PAT: tree}
    graphs[Algorithm.COLLNET_CHAIN] = tree
    if topology.nvls and arch_of(topology) >= 90 and gpus > 1:
        nvls = _search(topology, Algorithm.NVLS, min(_NVLS_ARITY, gpus), multi, gpus, num_nics)
        graphs[Algorithm.NVLS] = nvls
        graphs[Algorithm.NVLS_TREE] = nvls
    if topology.intra.interconnect is Interconnect.NVSWITCH:
        graphs[Algorithm.COLLNET_DIRECT] = NcclGraph(
            min(_DIRECT_ARITY + 1, gpus), tree.bw_intra_gbps, tree.bw_inter_gbps
        )
    cache[key] = graphs
    return dict(graphs)


def runtime_channels(
    topology: Topology, num_nodes: int, gpus: int | None = None, num_nics: int | None = None
) -> int:
    """``comm->nChannels``: twice the ring graph's channels (src/graph/connect.cc), doubled
    again on Hopper+ across nodes when the ring runs above 45 GB/s with fewer than 16."""
    ring = graphs_for(topology, num_nodes, gpus, num_nics)[Algorithm.RING]
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
    gpus: int | None = None,
    num_nics: int | None = None,
) -> int:
    """Channels a call of ``size_bytes`` runs on (src/enqueue.cc ``topoGetAlgoInfo``): ring and
    tree drop channels while bytes < channels x threads x threshold; NVLS runs
    ``nvlsChannels``."""
    nc = runtime_channels(topology, num_nodes, gpus, num_nics)
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
    gpus: int | None = None,
    num_nics: int | None = None,
) -> Callable[[float], int]:
    """:func:`channels_for_size` as a closed form for ring and tree: the loop "drop a channel
    while bytes < channels x threads x threshold" ends at clamp(bytes // (threads x
    threshold), 1, channels)."""
    full = runtime_channels(topology, num_nodes, gpus, num_nics)
    threshold = _THREAD_THRESHOLD[protocol]
    if algorithm is Algorithm.RING and protocol is _LL:
        threshold *= num_ranks
    per_channel = _MAX_THREADS[protocol] * threshold

    def channels(size_bytes: float) -> int:
        nc = int(size_bytes // per_channel)
        return full if nc >= full else nc if nc > 1 else 1

    return channels
