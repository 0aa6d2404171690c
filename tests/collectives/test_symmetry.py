"""Groups that a shift by whole nodes maps onto each other share one closed-form cost table
(``Topology.symmetry_key``): the shared table must price every call as the group's own would."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from collsim.cluster.topology import load_topology
from collsim.collectives.select import COSTS, SHARED_COSTS, cost
from collsim.collectives.types import Group
from collsim.step.stragglers import degrade_topology

OPS = ("all_reduce", "all_gather", "reduce_scatter", "all_to_all", "send_recv", "broadcast")
SIZES = (1024.0, 2.0**20, 48e6, 2.0**30)


def _alone(name: str, nodes: int, op: str, size: float, ranks: tuple[int, ...]) -> object:
    """The cost on a topology of its own (nothing shared with another group)."""
    topo = load_topology(name, nodes=nodes)
    return cost(op, size, Group(topo, ranks))


@settings(max_examples=25, deadline=None)
@given(
    name=st.sampled_from(["dgx_a100", "dgx_h100"]),
    local=st.lists(st.integers(0, 7), min_size=1, max_size=4, unique=True),
    node_offsets=st.lists(st.integers(0, 30), min_size=1, max_size=4, unique=True),
    shift=st.integers(1, 40),
    op=st.sampled_from(OPS),
)
def test_a_shared_table_prices_every_call_as_the_groups_own(
    name: str, local: list[int], node_offsets: list[int], shift: int, op: str
) -> None:
    nodes = 80  # dgx_a100: 4 leaves of 20; dgx_h100: 2 full leaves of 32 and one of 16
    ranks = tuple(off * 8 + g for off in node_offsets for g in local)
    if op == "send_recv":
        ranks = ranks[:2] if len(ranks) >= 2 else (0, 8)
    shifted = tuple(r + shift * 8 for r in ranks)
    if max(shifted) >= nodes * 8:
        return
    topo = load_topology(name, nodes=nodes)
    same = topo.symmetry_key(ranks) == topo.symmetry_key(shifted)
    for size in SIZES:
        first = cost(op, size, Group(topo, ranks))
        second = cost(op, size, Group(topo, shifted))  # from the shared table when ``same``
        assert first == _alone(name, nodes, op, size, ranks)
        assert second == _alone(name, nodes, op, size, shifted)
        if same:
            assert second.time_s == first.time_s


def test_a_shift_across_a_leaf_boundary_is_not_alike() -> None:
    topo = load_topology("dgx_a100", nodes=80)  # 20 nodes per rail leaf
    inside = tuple(8 * n for n in range(16))  # nodes 0..15: one leaf
    shifted = tuple(r + 8 * 20 for r in inside)  # nodes 20..35: one leaf
    straddle = tuple(r + 8 * 10 for r in inside)  # nodes 10..25: two leaves
    assert topo.symmetry_key(inside) == topo.symmetry_key(shifted)
    assert topo.symmetry_key(inside) != topo.symmetry_key(straddle)
    # the straddling group's transfers use the leaves' uplinks, the others' do not
    uplinks = set(topo.leaf_up.values())
    assert any(set(topo.path(a, b)) & uplinks for a, b in zip(straddle, straddle[1:]))
    assert not any(set(topo.path(a, b)) & uplinks for a, b in zip(shifted, shifted[1:]))


def test_a_short_last_leaf_is_not_alike_to_a_full_one() -> None:
    topo = load_topology("dgx_h100", nodes=80)  # leaves of 32, 32 and 16 nodes
    full = (0, 8 * 31 + 0, 8 * 32)  # nodes 0, 31 | 32: across leaves 0 and 1
    short = tuple(r + 8 * 32 for r in full)  # nodes 32, 63 | 64: leaf 2 holds 16 nodes
    assert topo.symmetry_key(full) != topo.symmetry_key(short)


def test_degraded_links_break_the_symmetry() -> None:
    topo = load_topology("dgx_h100", nodes=4)
    slow = degrade_topology(topo, {topo.path(0, 8)[0]: 0.5})
    assert topo.symmetry_key((0, 8)) is not None
    assert slow.symmetry_key((0, 8)) is None
    # the degraded pair is slower than its shift, which the healthy topology prices alike
    size = 2.0**28
    assert cost("send_recv", size, Group(slow, (0, 8))).time_s > (
        cost("send_recv", size, Group(slow, (8, 16))).time_s
    )


def test_stages_of_a_pipeline_share_their_data_parallel_tables() -> None:
    topo = load_topology("dgx_h100", nodes=128)  # four full leaves of 32 nodes
    stage0 = tuple(8 * n for n in range(16))  # nodes 0..15
    stage2 = tuple(r + 8 * 32 for r in stage0)  # nodes 32..47: the next leaf, alike
    assert topo.symmetry_key(stage0) == topo.symmetry_key(stage2)
    for op in ("reduce_scatter", "all_gather", "all_reduce"):
        for size in SIZES:
            cost(op, size, Group(topo, stage0))
            assert cost(op, size, Group(topo, stage2)) == _alone("dgx_h100", 128, op, size, stage2)
    assert len(SHARED_COSTS.of(topo)) == 3  # one table per op for both groups
    assert len(COSTS.of(topo)) == 6


def test_one_leaf_keys_on_local_ranks_and_relative_nodes() -> None:
    topo = load_topology("dgx_h100", nodes=2)
    assert topo.symmetry_key((8, 9, 10, 11)) == topo.symmetry_key((0, 1, 2, 3))
    assert topo.symmetry_key((4, 5, 6, 7)) != topo.symmetry_key((0, 1, 2, 3))
    assert topo.symmetry_key((0, 8)) != topo.symmetry_key((0, 1))
    assert topo.symmetry_key((0, 8)) != topo.symmetry_key((8, 0))
    assert topo.symmetry_key((0, 8)) != topo.symmetry_key((1, 9))  # another GPU, another rail


def test_a_one_rank_group_costs_nothing_on_a_multi_node_topology() -> None:
    # PAT's latency asks NCCL's tuning table of a one-rank communicator (no steps)
    topo = load_topology("dgx_a100", nodes=80)
    for op in ("all_gather", "reduce_scatter", "all_reduce"):
        assert cost(op, 2.0**20, Group(topo, (0,))).time_s == 0.0
