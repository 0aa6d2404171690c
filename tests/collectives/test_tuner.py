"""NCCL's (algorithm, protocol) choice, against tables worked out by hand from NCCL 2.30.7.

Every figure below was computed by hand from src/graph/tuning.cc, src/graph/search.cc and
src/enqueue.cc of NCCL 2.30.7 (makefiles/version.mk), not read back from collsim.

Time (us) = latency + bytes / (1000 x bw), bw the tuner's algorithm bandwidth (GB/s);
tree times use treeCorrectionFactor[protocol][log2(bytes / 64)], ring Simple across nodes
multiplies its latency by 1.4 (the "plateau" factor, sm80+).
"""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from collsim.collectives import CollectiveOp, Group, cost, tuner
from collsim.collectives.types import Algorithm
from tests.collectives.helpers import topo

AR = CollectiveOp.ALL_REDUCE


# Graphs (search.cc), NCCL's GPU bandwidth = links x SMxx_NVLINK_BW (topo.h):
#   H100: 18 x 20.6 = 370.8 GB/s. One node: sm90 intra speeds 60, 50, 40, ... -> 6 ch x 60
#     (360, first best; 7 x 50 = 350, 9 x 40 = 360 are not better) -> DupChannels (60 >= 25,
#     not (< 50 and > 4 channels)) -> 12 x 30; pass 2: 12 x 40 = 480 > 370.8, stays.
#     NVLS: 8 heads (minChannels = maxChannels on one node), a head carries twice:
#     (8 + 1) x 40 = 360 <= 370.8 (9 x 50 = 450 no) -> 8 x 40; pass 2 raises bwInter to 60.
#   Across nodes: sm90 inter speeds start at 48 <= 50 GB/s per 400 Gb/s NIC: one channel per
#     NIC -> 8 x 48 (each GPU's NVLink carries 7/8 of them: 336 <= 370.8); no dup (48 < 50
#     with 8 > 4 channels); NVLS: 9 x 48 = 432 > 370.8 -> 8 x 40 (320, better than 7 x 45),
#     bwInter raised to 48 (the NIC).
#   A100: 12 x 20 = 240 GB/s. One node: 6 x 40 = 240 (perfect) -> dup -> 12 x 20. Across
#     nodes: 24 <= 25 GB/s per 200 Gb/s NIC -> 8 x 24, no dup (24 < 25); the tree's bwIntra
#     rises while < 2 x bwInter: 28, 30 (8 x 30 x 7/8 = 210 <= 240; 48 no).
#   Runtime channels (connect.cc): 2 x ring graph = 24 on one node, 16 across nodes.
GRAPHS = [
    # id, topology, nodes, algorithm, channels, bwIntra, bwInter
    ("h100-1-ring", "dgx_h100", 1, Algorithm.RING, 12, 30.0, 30.0),
    ("h100-1-nvls", "dgx_h100", 1, Algorithm.NVLS, 8, 40.0, 60.0),
    ("h100-2-ring", "dgx_h100", 2, Algorithm.RING, 8, 48.0, 48.0),
    ("h100-4-nvls", "dgx_h100", 4, Algorithm.NVLS, 8, 40.0, 48.0),
    ("a100-1-ring", "dgx_a100", 1, Algorithm.RING, 12, 20.0, 20.0),
    ("a100-2-ring", "dgx_a100", 2, Algorithm.RING, 8, 24.0, 24.0),
    ("a100-4-tree", "dgx_a100", 4, Algorithm.TREE, 8, 30.0, 24.0),
]


@pytest.mark.parametrize(
    ("name", "nodes", "algorithm", "channels", "bw_intra", "bw_inter"),
    [g[1:] for g in GRAPHS],
    ids=[g[0] for g in GRAPHS],
)
def test_graph_search_gives_nccls_channels_and_speeds(
    name: str, nodes: int, algorithm: Algorithm, channels: int, bw_intra: float, bw_inter: float
) -> None:
    graph = tuner.graphs_for(topo(name, nodes), nodes)[algorithm]
    assert (graph.num_channels, graph.bw_intra_gbps, graph.bw_inter_gbps) == (
        channels,
        bw_intra,
        bw_inter,
    )


@pytest.mark.parametrize(("name", "nodes", "channels"), [("dgx_h100", 1, 24), ("dgx_a100", 4, 16)])
def test_runtime_channels_are_twice_the_ring_graph(name: str, nodes: int, channels: int) -> None:
    assert tuner.runtime_channels(topo(name, nodes), nodes) == channels


# Tuning table entries (all_reduce), by hand:
#   H100 1 node: ring LL lat 6.6 + 14 x 0.6 = 15.0, bus min(llMaxBws[Hopper][N1] 141,
#     12 x 30 x 0.5) = 141, algbw x 8/14 = 80.57; NVLS lat 25 (NVLink hop; base not added),
#     bus 8 x min(40 x 0.85 x 7/8 x 2 = 59.5, 60) = 476, x 8/14 = 272.0.
#   H100 2 nodes: tree LL lat 6.8 + 2 x (7 x 0.6 + 1 x 5.0) = 25.2, bus min(8 x 48 x 0.92,
#     8 x 41.4) = 331.2 -> /3.8 -> min(.., llMaxBws[Intel][N2] 39) = 39, x 0.5 = 19.5;
#     tree LL128 lat 14 + 2 x (7 x 1.25 + 8.5) = 48.5, bus min(331.2 x 120/128,
#     8 x 36.7) = 293.6, x 0.5 = 146.8; ring LL lat 6.6 + 28 x max(0.6, 1.0 net overhead)
#     + 2 x 2.7 = 40.0, bus 39, x 16/30 = 20.8; NVLS-tree lat 25 + 2 x 20.9 = 66.8, bus
#     8 x min(59.5, 2 x 48, 57.7) = 461.6, x 16/30 = 246.19.
#   H100 4 nodes: ring Simple lat 8.4 + 56 x max(3.4, 3 x 1.0) + 6 x 14 = 282.8 (x 1.4
#     plateau = 395.9), bus 8 x 48 = 384, x 32/62 = 198.19; NVLS-tree lat 25 + 4 x 20.9 =
#     108.6, bus 8 x min(59.5, 48, 45.5) = 364, x 32/62 = 187.87.
#   A100 1 node: ring LL 15.0 / min(87.7, 120) x 8/14 = 50.11; LL128 lat 14 + 14 x 1.9 =
#     40.6, bus min(240 x 0.92, 12 x 20) = 220.8, x 8/14 = 126.17; Simple lat 8.4 + 14 x 3.4 =
#     56.0, bus 240, x 8/14 = 137.14.
#   A100 2 nodes (AMD CPUs: net overhead 2 us, llMaxBws[AMD][N2] 22.5): ring Simple lat
#     8.4 + 28 x max(3.4, 6) + 2 x 14 = 204.4 (x 1.4 = 286.2), bus 8 x 24 = 192, x 16/30 =
#     102.4; ring LL128 lat 14 + 28 x max(1.9, 2) + 2 x 4 = 78.0, bus min(176.6, 8 x 20) =
#     160, x 16/30 = 85.33; tree LL128 lat 48.5, bus min(8 x 30 x 0.92 -> 8 x 23.6 = 188.8,
#     x 120/128 = 177, 8 x 20 = 160) = 160, x 0.5 = 80.
TABLE = [
    # id, topology, nodes, op, algorithm, protocol, latency us, bandwidth GB/s
    ("h100-1-ring-ll", "dgx_h100", 1, "ring", "ll", 15.0, 80.571),
    ("h100-1-nvls", "dgx_h100", 1, "nvls", "simple", 25.0, 272.0),
    ("h100-2-tree-ll", "dgx_h100", 2, "tree", "ll", 25.2, 19.5),
    ("h100-2-tree-ll128", "dgx_h100", 2, "tree", "ll128", 48.5, 146.8),
    ("h100-2-ring-ll", "dgx_h100", 2, "ring", "ll", 40.0, 20.8),
    ("h100-2-nvls_tree", "dgx_h100", 2, "nvls_tree", "simple", 66.8, 246.187),
    ("h100-4-ring-simple", "dgx_h100", 4, "ring", "simple", 282.8, 198.194),
    ("h100-4-nvls_tree", "dgx_h100", 4, "nvls_tree", "simple", 108.6, 187.871),
    ("a100-1-ring-ll128", "dgx_a100", 1, "ring", "ll128", 40.6, 126.171),
    ("a100-1-ring-simple", "dgx_a100", 1, "ring", "simple", 56.0, 137.143),
    ("a100-2-ring-simple", "dgx_a100", 2, "ring", "simple", 204.4, 102.4),
    ("a100-2-ring-ll128", "dgx_a100", 2, "ring", "ll128", 78.0, 85.333),
    ("a100-2-tree-ll128", "dgx_a100", 2, "tree", "ll128", 48.5, 80.0),
]


@pytest.mark.parametrize(
    ("name", "nodes", "algorithm", "protocol", "latency_us", "bandwidth_gbps"),
    [t[1:] for t in TABLE],
    ids=[t[0] for t in TABLE],
)
def test_tuning_table_entries(
    name: str, nodes: int, algorithm: str, protocol: str, latency_us: float, bandwidth_gbps: float
) -> None:
    table = tuner.table_for(Group.all(topo(name, nodes)))
    key = (AR, Algorithm(algorithm), tuner.Protocol(protocol))
    assert table.latency_us[key] == pytest.approx(latency_us, abs=1e-3)
    assert table.bandwidth_gbps[key] == pytest.approx(bandwidth_gbps, abs=1e-3)


# The choice per size, all_reduce, powers of two from 8 B to 16 GiB: (first log2 size, label).
# Boundaries by hand (us), from the table above:
#   H100 1 node: 1 MiB ring LL 15 + 13.01 = 28.0 < NVLS 25 + 3.86 = 28.9; 2 MiB NVLS 32.7 <
#     ring LL 41.0.
#   H100 2 nodes: 128 KiB tree LL 25.2 + 131072 / (19.5 x 0.5 corr) / 1e3 = 38.6 < tree LL128
#     48.5 + 131072 / (146.8 x 0.6) / 1e3 = 50.0; 256 KiB tree LL128 51.5 < ring LL 52.6 <
#     tree LL 58.8 (corr 0.4); 2 MiB tree LL128 72.3 (corr 0.6) < NVLS-tree 75.3; 4 MiB
#     NVLS-tree 83.8 < tree LL128 84.2 (corr 0.8).
#   H100 4 nodes: tree LL to 128 KiB, tree LL128 from 256 KiB; 16 MiB NVLS-tree 197.9 <
#     tree LL128 226.2; 1 GiB ring Simple 395.9 + 5417.7 = 5813.6 < NVLS-tree 5823.9
#     (512 MiB: 3104.7 > 2966.3).
#   A100 1 node: 4 MiB ring LL128 73.8 < ring LL 98.7; 32 MiB ring Simple 56 + 244.7 =
#     300.7 < LL128 306.5 (16 MiB: 178.3 > 173.6).
#   A100 2 nodes: 256 KiB tree LL128 54.0 < tree LL 83.5; 16 MiB ring LL128 274.6 < tree
#     LL128 281.5; 128 MiB ring Simple 286.2 + 1310.7 = 1596.9 < ring LL128 1650.9.
#   A100 4 nodes: 256 KiB tree LL128 72.0; 32 MiB ring LL128 556.3 < tree LL128 624.0;
#     256 MiB ring Simple 599.8 + 2708.8 = 3308.6 < ring LL128 3400.6.
CHOICES = {
    ("dgx_h100", 1): [(3, "ring/ll"), (21, "nvls/simple")],
    ("dgx_h100", 2): [(3, "tree/ll"), (18, "tree/ll128"), (22, "nvls_tree/simple")],
    ("dgx_h100", 4): [
        (3, "tree/ll"),
        (18, "tree/ll128"),
        (24, "nvls_tree/simple"),
        (30, "ring/simple"),
    ],
    ("dgx_a100", 1): [(3, "ring/ll"), (22, "ring/ll128"), (25, "ring/simple")],
    ("dgx_a100", 2): [(3, "tree/ll"), (18, "tree/ll128"), (24, "ring/ll128"), (27, "ring/simple")],
    ("dgx_a100", 4): [(3, "tree/ll"), (18, "tree/ll128"), (25, "ring/ll128"), (28, "ring/simple")],
}


def _expected(ranges: list[tuple[int, str]], log_size: int) -> str:
    label = ranges[0][1]
    for start, name in ranges:
        if log_size >= start:
            label = name
    return label


@pytest.mark.parametrize("key", list(CHOICES), ids=[f"{n}-{k}nodes" for n, k in CHOICES])
def test_auto_picks_as_nccls_tuner_by_size(key: tuple[str, int]) -> None:
    name, nodes = key
    group = Group.all(topo(name, nodes))
    got = {k: cost("all_reduce", 1 << k, group).label for k in range(3, 35)}
    want = {k: _expected(CHOICES[key], k) for k in range(3, 35)}
    assert got == want


def test_pat_only_with_one_rank_per_node() -> None:
    # ncclPatEnable (tuning.cc, 2.30.7): PAT needs nNodes == nRanks. With 8 nodes x 1 GPU the
    # all_gather candidates are ring and PAT; PAT's latency 8 + log2(8) x 14 / 3.5 + 8 x 2.8 =
    # 42.4 us beats the ring's 8.4 + 7 x 14 = 106.4 us at small sizes.
    one_per_node = Group(topo("dgx_h100", 8), tuple(8 * k for k in range(8)))
    assert cost("all_gather", 1 << 16, one_per_node).label == "pat/simple"
    full = Group.all(topo("dgx_h100", 8))
    assert cost("all_gather", 1 << 16, full).algorithm is Algorithm.RING


def test_collnet_only_where_the_fabric_reduces() -> None:
    # CollNet is disabled unless the communicator has CollNet support (tuning.cc); with it,
    # CollNet-direct's bus bandwidth on 2 H100 nodes is 8 x 48 / (1 - 0/2) x 0.85 = 326.4 and
    # its latency 2 x (3.7 + 7 x 0.4) + 31 = 44 us.
    plain = tuner.table_for(Group.all(topo("dgx_h100", 2)))
    assert plain.bandwidth_gbps[(AR, Algorithm.COLLNET_DIRECT, tuner.Protocol.SIMPLE)] == 0
    sharp = tuner.table_for(Group.all(topo("dgx_h100+sharp", 2)))
    key = (AR, Algorithm.COLLNET_DIRECT, tuner.Protocol.SIMPLE)
    assert sharp.bus_bandwidth_gbps[key] == pytest.approx(326.4)
    assert sharp.latency_us[key] == pytest.approx(44.0)


def test_small_calls_run_on_fewer_channels() -> None:
    # topoGetAlgoInfo (enqueue.cc): ring LL drops channels while bytes < nc x 512 threads x
    # (8 x nranks) -> 256 KiB on 8 ranks: 262144 / 32768 = 8 channels; 16 KiB: 1.
    t = topo("dgx_h100")
    for size, channels in [(1 << 18, 8), (1 << 14, 1), (1 << 30, 24)]:
        got = tuner.channels_for_size(t, 1, Algorithm.RING, tuner.Protocol.LL, size, 8)
        assert got == channels
        count = tuner.channel_counter(t, 1, Algorithm.RING, tuner.Protocol.LL, 8)
        assert count(size) == channels


@pytest.mark.parametrize(
    "name",
    ["dgx_a100", "dgx_h100", "dgx_b200", "dgx_h100+sharp", "gcp_a3_mega", "pcie_8gpu"],
)
def test_every_pick_of_the_tuner_has_a_schedule(name: str) -> None:
    # auto reports the tuner's pick itself, never a fallback, on every shipped node type.
    for nodes in (1, 2, 16):
        group = Group.all(topo(name, nodes))
        for op in ("all_reduce", "all_gather", "reduce_scatter", "broadcast", "reduce"):
            for k in range(3, 35, 3):
                picked = tuner.pick(CollectiveOp(op), 1 << k, group)
                result = cost(op, 1 << k, group)
                assert picked == (result.algorithm, result.protocol), (nodes, op, k)


def test_a_communicator_sees_only_its_own_gpus_and_nics() -> None:
    # One GPU per node (a data-parallel group of a TP x DP plan): the search has one NIC
    # (50 GB/s) per node: 1 channel x 48 first, then DupChannels (48 >= 25 and only 1 channel)
    # -> 2 x 24; NCCL's ring bus bandwidth is 48 GB/s, not the full node's 8 x 48 = 384.
    t = topo("dgx_h100", 4)
    dp = Group(t, (0, 8, 16, 24))
    assert tuner.node_shape(t, dp.ranks) == (1, 1)
    ring = tuner.graphs_for(t, 4, 1, 1)[Algorithm.RING]
    assert (ring.num_channels, ring.bw_intra_gbps) == (2, 24.0)
    table = tuner.table_for(dp)
    assert table.bus_bandwidth_gbps[(AR, Algorithm.RING, tuner.Protocol.SIMPLE)] == 48.0
    # 4 GPUs of one node (a TP group): NVLS with 4 heads, (4 + 1) x 60 = 300 <= 370.8
    tp = Group(topo("dgx_h100"), (0, 1, 2, 3))
    nvls = tuner.graphs_for(tp.topology, 1, *tuner.node_shape(tp.topology, tp.ranks))
    assert (nvls[Algorithm.NVLS].num_channels, nvls[Algorithm.NVLS].bw_intra_gbps) == (4, 60.0)


@settings(max_examples=60, deadline=None)
@given(ranks=st.lists(st.integers(0, 63), min_size=1, max_size=40, unique=True))
def test_fullest_node_counted_in_python_as_with_arrays(ranks: list[int]) -> None:
    """A small group's fullest node (counted in Python) is the one the array path gives: the
    most ranks on one node, the first met among equals, in the order given."""
    from collsim.collectives import channels

    t = topo("dgx_h100", 8)
    got = channels._fullest_node_python(t, tuple(ranks))
    assert got == channels._fullest_node_arrays(t, tuple(ranks))
    assert len(got) == max(sum(1 for r in ranks if r // 8 == n) for n in range(8))
