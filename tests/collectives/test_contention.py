"""The DES shows contention that the closed form cannot: shared links, rails, oversubscription."""

from __future__ import annotations

import pytest

from collsim.cluster.topology import parse_topology
from collsim.collectives import Group, cost
from collsim.core.yamlio import parse_yaml_text
from tests.collectives.helpers import run_des, topo

SIZE = 1 << 30


def test_two_rings_sharing_a_nic_take_twice_as_long() -> None:
    # pcie_8gpu has one NIC per node: rings {0, 8} and {1, 9} both cross it.
    t = topo("pcie_8gpu", 2)
    a, b = Group(t, (0, 8)), Group(t, (1, 9))
    alone, _ = run_des(a, "all_reduce", SIZE, "ring")
    shared, _ = run_des(a, "all_reduce", SIZE, "ring", peers=(b,))
    assert shared.time_s >= 1.8 * alone.time_s
    # the closed form is the uncontended time
    assert cost("all_reduce", SIZE, a, "ring").time_s == pytest.approx(alone.time_s, rel=1e-9)


def _rails(t) -> list[Group]:
    """One group per local index: a ring across the nodes on rail k."""
    return [Group(t, tuple(n * 8 + k for n in range(t.num_nodes))) for k in range(8)]


def test_rail_optimised_rings_do_not_interfere() -> None:
    t = topo("dgx_h100", 4)
    groups = _rails(t)
    alone, _ = run_des(groups[0], "all_reduce", SIZE, "ring")
    together, _ = run_des(groups[0], "all_reduce", SIZE, "ring", peers=tuple(groups[1:]))
    assert together.time_s == pytest.approx(alone.time_s, rel=1e-9)


_TOR = """\
name: tor
device: h100
gpus_per_node: 8
intra_node: {interconnect: nvswitch, bandwidth_gbps: 450, efficiency: 0.824}
nics: {count: 8, rate_gbit: 400, efficiency: 0.96, latency_us: 1.0}
fabric: {kind: fat_tree, rails: false, oversubscription: 4.0, nodes_per_leaf: 1}
"""


def test_oversubscribed_tor_slows_concurrent_rings() -> None:
    # One leaf per node, uplink = 8 NICs x 50 GB/s / 4 = 100 GB/s. One ring gets its NIC's
    # 48 GB/s (0.96 x 50); eight rings share the uplink at 96 / 8 = 12 GB/s each: 4x slower.
    t = parse_topology(parse_yaml_text(_TOR, "tor.yaml"), nodes=4)
    groups = _rails(t)
    alone, _ = run_des(groups[0], "all_reduce", SIZE, "ring")
    together, _ = run_des(groups[0], "all_reduce", SIZE, "ring", peers=tuple(groups[1:]))
    assert together.time_s / alone.time_s == pytest.approx(4.0, rel=0.01)


def test_peers_equal_running_every_group() -> None:
    t = topo("pcie_8gpu", 2)
    a, b = Group(t, (0, 8)), Group(t, (1, 9))
    via_peers, _ = run_des(a, "all_reduce", SIZE, "ring", peers=(b,))
    other, _ = run_des(b, "all_reduce", SIZE, "ring", peers=(a,))
    assert via_peers.time_s == pytest.approx(other.time_s, rel=1e-9)
