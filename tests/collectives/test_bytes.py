"""Bytes on the wire, read from the simulation's network counters."""

from __future__ import annotations

import pytest

from collsim.collectives import Group
from tests.collectives.helpers import run_des, topo

M = float(1 << 26)


@pytest.mark.parametrize(
    ("name", "nodes"),
    [("dgx_h100", 1), ("dgx_a100", 2), ("localhost", 1)],
    ids=["8r-1node", "16r-2nodes", "4r-loopback"],
)
@pytest.mark.parametrize(
    ("op", "factor"),
    [
        ("all_reduce", lambda n: 2 * (n - 1) / n),
        ("reduce_scatter", lambda n: (n - 1) / n),
        ("all_gather", lambda n: (n - 1) / n),
    ],
    ids=["all_reduce", "reduce_scatter", "all_gather"],
)
def test_ring_bytes_per_rank(name: str, nodes: int, op: str, factor) -> None:
    group = Group.all(topo(name, nodes))
    n = group.size
    _, net = run_des(group, op, M, "ring")
    for rank in group.ranks:
        assert net.bytes_sent[rank] == pytest.approx(factor(n) * M, rel=1e-12)
        assert net.bytes_received[rank] == pytest.approx(factor(n) * M, rel=1e-12)


def test_multi_node_ring_puts_one_ring_per_nic() -> None:
    # 2 nodes x 8: 8 rings, each crossing every NIC pair once: every NIC carries 1/8 of the
    # ring bytes 2(n-1)/n x M.
    t = topo("dgx_a100", 2)
    _, net = run_des(Group.all(t), "all_reduce", M, "ring")
    expected = 2 * 15 / 16 * M / 8
    for node in range(2):
        for k in range(8):
            assert net.link_bytes[t.nic_tx[node][k]] == pytest.approx(expected, rel=1e-12)


def test_nvls_port_carries_one_plus_one_over_n() -> None:
    t = topo("dgx_h100")
    _, net = run_des(Group.all(t), "all_reduce", M, "nvls")
    for rank in range(8):
        assert net.link_bytes[t.gpu_tx[rank]] == pytest.approx((1 + 1 / 8) * M)
        assert net.link_bytes[t.gpu_rx[rank]] == pytest.approx((1 + 1 / 8) * M)


@pytest.mark.parametrize(
    "algorithm", ["ring", "tree", "halving_doubling", "direct", "hierarchical"]
)
def test_bytes_sent_equal_bytes_received(algorithm: str) -> None:
    group = Group.all(topo("dgx_a100", 2))
    _, net = run_des(group, "all_reduce", M, algorithm)
    assert sum(net.bytes_sent.values()) == pytest.approx(sum(net.bytes_received.values()))


def test_send_recv_between_two_ranks_is_one_message() -> None:
    t = topo("dgx_h100", 2)
    result, net = run_des(Group(t, (3, 11)), "send_recv", M, "direct")
    assert dict(net.bytes_sent) == {3: M} and dict(net.bytes_received) == {11: M}
    # one NIC at 400 Gb/s x 0.96, plus the Simple network hop (14 us) and base latency (8.4 us)
    assert result.time_s == pytest.approx(M / (50e9 * 0.96) + 14e-6 + 8.4e-6, rel=1e-6)


def test_nvls_tree_bytes_on_ports_and_nics() -> None:
    # Per GPU port (1 + 1/g) M each way; two nodes: each NIC sends and receives M/g (one edge
    # per tree, half the GPU's M/g slice each way per tree).
    t = topo("dgx_h100", 2)
    _, net = run_des(Group.all(t), "all_reduce", M, "nvls_tree")
    for rank in range(16):
        assert net.link_bytes[t.gpu_tx[rank]] == pytest.approx((1 + 1 / 8) * M)
    for node in range(2):
        for k in range(8):
            assert net.link_bytes[t.nic_tx[node][k]] == pytest.approx(M / 8, rel=1e-12)
            assert net.link_bytes[t.nic_rx[node][k]] == pytest.approx(M / 8, rel=1e-12)


@pytest.mark.parametrize("algorithm", ["collnet_direct", "collnet_chain", "nvls"])
def test_in_network_reduction_sends_each_slice_up_once(algorithm: str) -> None:
    # With SHARP the switch reduces across nodes: every NIC carries M/g up and M/g down, at any
    # node count (the network half of a ring's 2(N-1)/N x M/g).
    t = topo("dgx_h100+sharp", 4)
    _, net = run_des(Group.all(t), "all_reduce", M, algorithm)
    for node in range(4):
        for k in range(8):
            assert net.link_bytes[t.nic_tx[node][k]] == pytest.approx(M / 8, rel=1e-12)
            assert net.link_bytes[t.nic_rx[node][k]] == pytest.approx(M / 8, rel=1e-12)


@pytest.mark.parametrize("op", ["all_gather", "reduce_scatter"])
@pytest.mark.parametrize("nodes", [4, 6])
def test_pat_moves_what_a_ring_moves(op: str, nodes: int) -> None:
    # (n-1)/n x M per rank in ceil(log2 n) steps, one rank per node (NCCL 2.30.7's scope).
    t = topo("dgx_h100", nodes)
    group = Group(t, tuple(8 * k for k in range(nodes)))
    _, net = run_des(group, op, M, "pat")
    for rank in group.ranks:
        assert net.bytes_sent[rank] == pytest.approx((nodes - 1) / nodes * M, rel=1e-12)
        assert net.bytes_received[rank] == pytest.approx((nodes - 1) / nodes * M, rel=1e-12)
