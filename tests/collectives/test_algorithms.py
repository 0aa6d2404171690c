"""Structure of each algorithm: ring channels, NCCL's double binary tree, halving-doubling
steps, hierarchical phases, and one golden time worked out by hand."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from collsim.collectives import (
    CollectiveOp,
    Group,
    cost,
    halving_doubling,
    hierarchical,
    phases_for,
    ring,
    supported,
    tree,
)
from collsim.core.errors import ConfigError
from tests.collectives.helpers import run_des, topo


def test_ring_channels_leave_each_node_from_a_different_rank() -> None:
    t = topo("dgx_h100", 2)
    group = Group(t, (0, 1, 2, 8, 9, 10))
    assert ring.ring_orders(group) == [
        [1, 2, 0, 9, 10, 8],  # channel 0 leaves node 0 from rank 0, node 1 from rank 8
        [2, 0, 1, 10, 8, 9],
        [0, 1, 2, 8, 9, 10],
    ]
    assert ring.ring_orders(Group(t, (4, 2, 7))) == [[4, 2, 7]]  # one node: one ring


def test_nccl_double_binary_tree() -> None:
    # ncclGetBtree for 4 ranks: 1 and 3 hang off 2, 2 off the root 0; tree 1 mirrors it.
    tree0, tree1 = tree.dtree_parents(4)
    assert tree0 == [None, 2, 0, 2]
    assert tree1 == [1, 3, 1, None]
    # every rank is interior in at most one of the two trees
    for r in range(4):
        assert not (r in tree0 and r in tree1)
    # odd sizes shift instead of mirroring: tree 1's parent of r is tree 0's parent of r-1,
    # plus one: r=0 -> p0(2)+1 = 1; r=1 -> p0(0) = root; r=2 -> p0(1)+1 = 3 mod 3 = 0.
    assert tree.dtree_parents(3) == ([None, 2, 0], [1, None, 0])


def test_halving_doubling_steps() -> None:
    group = Group(topo("dgx_h100", 2), tuple(range(16)))
    phases = halving_doubling.build(CollectiveOp.ALL_REDUCE, group)
    assert [p.size_factor for p in phases] == [
        1 / 2,
        1 / 4,
        1 / 8,
        1 / 16,
        1 / 16,
        1 / 8,
        1 / 4,
        1 / 2,
    ]
    # distances 1, 2, 4 stay inside a node; distance 8 crosses: the small blocks go on the NICs
    assert [p.inter_steps for p in phases] == [0, 0, 0, 1, 1, 0, 0, 0]
    assert {(t.src, t.dst) for t in phases[1].transfers} == {(r, r ^ 2) for r in range(16)}


def test_hierarchical_phases() -> None:
    group = Group.all(topo("dgx_a100", 4))
    phases = hierarchical.build(CollectiveOp.ALL_REDUCE, group)
    # intra reduce-scatter 7/8, inter all_reduce of 1/8 over 4 nodes, intra all-gather 7/8
    assert [p.size_factor for p in phases] == pytest.approx([7 / 8, 2 * 3 / 4 / 8, 7 / 8])
    assert [(p.intra_steps, p.inter_steps) for p in phases] == [(7, 0), (0, 6), (7, 0)]
    assert len(phases[1].transfers) == 8 * 4  # 8 rail rings of 4 nodes


def test_golden_loopback_ring_time() -> None:
    # localhost (gloo): 4 ranks, 3 GB/s per direction, 15 us per link (30 us per message),
    # 20 us overhead. Ring all_reduce of 1 MB: each rank sends 2 x 3/4 x 1e6 = 1.5e6 B in
    # 1.5e6 / 3e9 = 500 us; 2(n-1) = 6 steps x 30 us = 180 us; + 20 us = 700 us.
    group = Group.all(topo("localhost", 1, 4))
    assert cost("all_reduce", 1e6, group, "ring").time_s == pytest.approx(700e-6)
    simulated, net = run_des(group, "all_reduce", 1e6, "ring")
    assert simulated.time_s == pytest.approx(700e-6)
    assert dict(net.bytes_sent) == pytest.approx({r: 1.5e6 for r in range(4)})


_ALL = [(op, alg) for op in CollectiveOp for alg in supported(op)]


@settings(max_examples=40, deadline=None)
@given(
    pair=st.sampled_from(_ALL),
    first=st.integers(0, 62),
    count=st.integers(2, 64),
    size=st.integers(1 << 10, 1 << 30),
)
def test_des_matches_closed_form_on_random_groups(pair, first: int, count: int, size: int) -> None:
    # Any contiguous run of 2..64 ranks of an 8-node DGX H100, any size 1 KiB..1 GiB.
    op, algorithm = pair
    ranks = tuple(range(first, min(64, first + count)))
    if len(ranks) < 2:
        return
    group = Group(topo("dgx_h100", 8), ranks)
    try:
        phases_for(op, group, algorithm)
    except ConfigError:
        return  # not applicable to this group (asserted elsewhere)
    closed = cost(op, size, group, algorithm)
    simulated, _ = run_des(group, op, size, algorithm)
    assert simulated.time_s == pytest.approx(closed.time_s, rel=1e-9)
