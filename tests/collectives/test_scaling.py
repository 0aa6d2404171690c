"""Large groups: analytic per-link loads equal the enumerated ones, the closed form of
thousands of ranks completes and matches hand-derived bottlenecks, and the DES of a large group
(transfers merged by path) stays within 1% of the closed form."""

from __future__ import annotations

import numpy as np
import pytest

from collsim.cluster.topology import Topology, parse_topology
from collsim.collectives import Algorithm, CollectiveOp, Group, cost, phases_for
from collsim.collectives.direct import EXACT_PAIRS_UP_TO, all_pairs_load
from collsim.collectives.transfers import (
    AGGREGATE_ABOVE,
    Phase,
    aggregate_transfers,
    equal_weights_per_link,
    make_transfer,
    pair_load,
    phase_load,
)
from collsim.core.yamlio import parse_yaml_text
from tests.collectives.helpers import run_des, topo

_FABRIC = """\
name: small_leaves
device: h100
gpus_per_node: 4
intra_node: {{interconnect: nvswitch, bandwidth_gbps: 450, efficiency: 0.824, latency_us: 0.25}}
nics: {{count: {nics}, rate_gbit: 400, efficiency: 0.96, latency_us: 1.0}}
fabric: {{kind: fat_tree, rails: {rails}, oversubscription: 2.0, nodes_per_leaf: 2,
         latency_us: 0.3}}
"""


def _fabric(rails: bool, nics: int) -> Topology:
    text = _FABRIC.format(rails=str(rails).lower(), nics=nics)
    return parse_topology(parse_yaml_text(text, "small_leaves.yaml"), nodes=5)


def _as_dict(index: np.ndarray, weight: np.ndarray) -> dict[int, float]:
    return {int(i): float(w) for i, w in zip(index, weight)}


def _enumerated(t: Topology, pairs: list[tuple[int, int]]):
    return phase_load(Phase(tuple(make_transfer(t, s, d) for s, d in pairs), 1.0, 0, 1), t)


# groups: whole cluster, uneven ranks per node in a scrambled order, one node, two leaves
GROUPS = [tuple(range(20)), (19, 0, 1, 2, 5, 9, 10, 11, 12, 17, 6), (4, 5, 6, 7), (0, 1, 8, 13)]


@pytest.mark.parametrize("rails", [True, False])
@pytest.mark.parametrize("nics", [1, 2, 4])
@pytest.mark.parametrize("ranks", GROUPS)
def test_analytic_all_pairs_load_equals_enumeration(
    rails: bool, nics: int, ranks: tuple[int, ...]
) -> None:
    t = _fabric(rails, nics)
    pairs = [(s, d) for s in ranks for d in ranks if s != d]
    want = _enumerated(t, pairs)
    got = all_pairs_load(Group(t, ranks))
    assert _as_dict(got.link_index, got.link_weight) == _as_dict(want.link_index, want.link_weight)
    assert got.intra_latency_s == pytest.approx(want.intra_latency_s, rel=1e-12)
    assert got.inter_latency_s == pytest.approx(want.inter_latency_s, rel=1e-12)
    assert got.intra_kinds == want.intra_kinds


@pytest.mark.parametrize("num_pairs", [5, 300], ids=["counted-in-python", "numpy-unique"])
@pytest.mark.parametrize("rails", [True, False])
def test_vectorised_pair_load_equals_paths(rails: bool, num_pairs: int) -> None:
    t = _fabric(rails, 2)
    rng = np.random.default_rng(7)
    src = rng.integers(0, t.num_ranks, num_pairs)
    dst = rng.integers(0, t.num_ranks, num_pairs)
    keep = src != dst
    pairs = list(zip(src[keep].tolist(), dst[keep].tolist()))
    want = _enumerated(t, pairs)
    got = pair_load(t, src[keep], dst[keep])
    assert _as_dict(got.link_index, got.link_weight) == _as_dict(want.link_index, want.link_weight)
    assert (np.diff(got.link_index) > 0).all()  # ascending, each link once
    assert got.link_index.dtype == np.int64 and got.link_weight.dtype == np.float64
    assert got.inter_latency_s == pytest.approx(want.inter_latency_s, rel=1e-12)


def test_4096_ranks_closed_form_matches_per_link_expectation() -> None:
    t = topo("dgx_h100", 512)  # 4,096 GPUs, 16 leaf groups per rail
    group = Group.all(t)
    n, g = t.num_ranks, t.gpus_per_node
    nic_bps = t.links[t.nic_tx[0][0]].capacity_bps
    gpu_bps = t.links[t.gpu_tx[0]].capacity_bps
    up_bps = t.links[t.leaf_up[(0, 0)]].capacity_bps
    per_leaf = t.fabric.nodes_per_leaf

    # all_to_all (direct): every rank sends M/n to each of the n - g ranks off its node through
    # its own NIC, and to g - 1 ranks over NVLink; a rail leaf's uplink carries its 32 senders'
    # blocks to every rank outside the leaf group.
    a2a = phases_for(CollectiveOp.ALL_TO_ALL, group, Algorithm.DIRECT)
    load = a2a.phases[0].load
    loads = _as_dict(load.link_index, load.link_weight)
    assert loads[t.nic_tx[3][5]] == n - g
    assert loads[t.nic_rx[7][2]] == n - g
    assert loads[t.gpu_tx[9]] == g - 1
    assert loads[t.leaf_up[(4, 2)]] == per_leaf * (n - per_leaf * g)
    expected = max((n - g) / nic_bps, (g - 1) / gpu_bps, per_leaf * (n - per_leaf * g) / up_bps) / n
    assert a2a.phase_s_per_byte[0] == pytest.approx(expected, rel=1e-12)
    size = 1 << 30
    result = cost("all_to_all", size, group)
    timing = a2a.timing(result.protocol)
    assert result.time_s == pytest.approx(
        timing.latency_s + size * expected / timing.efficiency, rel=1e-12
    )

    # all_reduce ring: g rings, each rank sends 2(n-1)/n x M/g per ring; a rank's NVLink tx
    # carries g - 1 rings, each node's NIC k one (ring k leaves the node there).
    ring = phases_for(CollectiveOp.ALL_REDUCE, group, Algorithm.RING)
    share = 2 * (n - 1) / n / g
    assert ring.phase_s_per_byte[0] == pytest.approx(
        share * max(1 / nic_bps, (g - 1) / gpu_bps), rel=1e-12
    )
    # auto takes NCCL's pick (tuning.cc, 512 nodes): the ring's 8190 steps cost NCCL's model
    # ~50 ms of latency, its tree runs at 8 channels x 36 GB/s x 0.92 / 2, NVLS-tree at
    # 8 x min(40 x 0.85 x 7/8 x 2, 48, 45.5) GB/s x 4096/8190: NVLS-tree.
    auto = cost("all_reduce", size, group)
    assert auto.label == "nvls_tree/simple"
    nvls_tree = phases_for(CollectiveOp.ALL_REDUCE, group, Algorithm.NVLS_TREE)
    # per GPU port (1 + 1/g) M each way; per NIC and direction 2 M / g in the trees' interior
    assert nvls_tree.phase_s_per_byte[0] == pytest.approx(
        max((1 + 1 / g) / gpu_bps, 2 / g / nic_bps), rel=1e-12
    )


@pytest.mark.parametrize(
    "ranks",
    [
        tuple(range(128)),
        tuple(r for r in range(128) if r % 8 not in (3, 6)),
        tuple(r for r in range(128) if r < 64 or r % 8 < 4),
    ],
)
def test_large_direct_des_within_one_percent(ranks: tuple[int, ...]) -> None:
    # Above EXACT_PAIRS_UP_TO ranks the DES merges the pairs that share a path into one flow.
    t = topo("dgx_h100", 16)
    group = Group(t, ranks)
    assert group.size > EXACT_PAIRS_UP_TO
    size = 1 << 30
    closed = cost("all_to_all", size, group)
    simulated, net = run_des(group, "all_to_all", size)
    assert simulated.time_s == pytest.approx(closed.time_s, rel=0.01)
    n = group.size
    delivered = float(net.link_bytes[[link for node in t.nic_tx for link in node]].sum())
    per_node = np.bincount(np.asarray(ranks) // 8)
    per_node = per_node[per_node > 0]
    off_node_pairs = float((per_node * (n - per_node)).sum())
    assert delivered == pytest.approx(size / n * off_node_pairs, rel=1e-9)


def test_merging_is_refused_when_it_would_unbalance_a_link() -> None:
    # A tree's chain edges repeat over channels a different number of times than its
    # inter-node edges, so merged flows would share links with unequal bytes.
    t = topo("dgx_h100", 8)
    group = Group.all(t)
    schedule = phases_for(CollectiveOp.ALL_REDUCE, group, Algorithm.TREE)
    transfers = schedule.phases[0].transfers
    assert not equal_weights_per_link(aggregate_transfers(transfers), len(t.links))
    ring = phases_for(CollectiveOp.ALL_REDUCE, group, Algorithm.RING).phases[0].transfers
    assert equal_weights_per_link(aggregate_transfers(ring), len(t.links))
    assert len(aggregate_transfers(ring)) < len(ring)


def test_large_ring_des_merged_within_one_percent() -> None:
    t = topo("dgx_h100", 512)  # 4,096 GPUs: 32,768 ring transfers, merged
    group = Group.all(t)
    schedule = phases_for(CollectiveOp.ALL_REDUCE, group, Algorithm.RING)
    assert len(schedule.phases[0].transfers) > AGGREGATE_ABOVE
    assert len(schedule.des_transfers(schedule.phases[0])) < len(schedule.phases[0].transfers)
    size = 1 << 30
    closed = cost("all_reduce", size, group, "ring")
    simulated, _ = run_des(group, "all_reduce", size, "ring")
    assert simulated.time_s == pytest.approx(closed.time_s, rel=0.01)
