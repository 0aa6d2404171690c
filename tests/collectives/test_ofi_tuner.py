"""``auto`` on a P5 topology picks what aws-ofi-nccl's tuner picks (aws/aws-ofi-nccl 2daf7d30,
src/tuner/nccl_ofi_regions.cpp), all_reduce, 1 KiB to 16 GiB, on 2, 4 and 16 nodes.

Worked out by hand from the plugin's P5 / P5e table for 8 ranks per node; a point is (log2 bytes,
log2 ranks), a region holds its edges, the first region in the plugin's order wins:

- 2 nodes: the region tuner returns without a choice on two nodes or fewer
  (``region_get_coll_info_internal_v3``), so NCCL's own tuner decides; by hand from NCCL's table
  with the EFA terms (us, latency + bytes / bw): tree LL to 128 KiB (128 KiB: tree LL 198.5 <
  tree LL128 200.0), tree LL128 from 256 KiB (201.5 < ring LL128 229.7 < tree LL 233.5), ring
  LL128 at 32 MiB (442.3 < tree LL128 452.5), NVLS-tree Simple from 64 MiB (645.4 < ring LL128
  656.6). Tree LL128's latency 14 + 2 x (7 x 1.25 + 8.5 + 75) = 198.5 us, the 75 the latency
  aws-ofi-nccl reports on p5 (src/platform-aws.cpp).
- 4 nodes, 32 ranks (y = 5): tree LL128's polygon reaches x = log2 37748736 (36 MiB) at y = 5
  (vertex (37748736, 32)): 1 KiB .. 32 MiB tree LL128. Ring LL128's left edge is that vertex's
  edge to (31457280, 17); its right edge (1073741824, 17) -> (2147483648, 64) crosses y = 5 at
  x = 30 + (5 - log2 17) / (6 - log2 17) = 30.48: 64 MiB .. 1 GiB ring LL128. Ring Simple's left
  edge (1073741824, 17) -> (1610612736, 32) meets y = 5 at its vertex x = log2 1.5 GiB = 30.58:
  2 GiB .. 16 GiB ring Simple.
- 16 nodes, 128 ranks (y = 7): tree LL128's vertex (301989888, 128) is x = 28.17: 1 KiB ..
  256 MiB tree LL128. Ring LL128 spans y = 7 from that vertex to its vertex (2147483648, 128),
  x = 31, the last on its edge: 512 MiB .. 2 GiB ring LL128. NVLS-tree's bottom edge runs
  (2147483648, 128) -> (6442450944, 128), x 31 .. 32.58: 4 GiB (x = 32) lies on it, NVLS-tree
  Simple. Ring Simple's edge (2684354560, 64) -> (8053063680, 160) crosses y = 7 at x = 32.52:
  8 GiB and 16 GiB ring Simple.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from collsim.cluster.topology import parse_topology, resolve_topology_path
from collsim.collectives import CollectiveOp, Group, cost, tuner
from collsim.collectives.ofi_tuner import inside, region_pick
from collsim.core.vocab import Algorithm, Protocol
from collsim.core.yamlio import parse_yaml_text
from tests.collectives.helpers import topo

# (first log2 size, label), as in test_tuner.CHOICES
P5_CHOICES = {
    2: [(10, "tree/ll"), (18, "tree/ll128"), (25, "ring/ll128"), (26, "nvls_tree/simple")],
    4: [(10, "tree/ll128"), (26, "ring/ll128"), (31, "ring/simple")],
    16: [(10, "tree/ll128"), (29, "ring/ll128"), (32, "nvls_tree/simple"), (33, "ring/simple")],
}


def _expected(ranges: list[tuple[int, str]], log_size: int) -> str:
    label = ranges[0][1]
    for start, name in ranges:
        if log_size >= start:
            label = name
    return label


@pytest.mark.parametrize("nodes", list(P5_CHOICES))
def test_auto_on_p5_follows_the_plugins_tuner(nodes: int) -> None:
    group = Group.all(topo("aws_p5", nodes))
    got = {k: cost("all_reduce", 1 << k, group).label for k in range(10, 35)}
    want = {k: _expected(P5_CHOICES[nodes], k) for k in range(10, 35)}
    assert got == want


def _without_plugin(nodes: int) -> Group:
    text = Path(resolve_topology_path("aws_p5")).read_text()
    text = text.replace("tuner: aws-ofi-nccl", "tuner: nccl")
    return Group.all(parse_topology(parse_yaml_text(text, "p5_nccl.yaml"), nodes=nodes))


# P5en, 8 ranks per node (src/tuner/nccl_ofi_regions.cpp region_init_internal_p5en), by hand:
# tree LL up to x = log2 196608 = 17.58 (128 KiB). 4 nodes (y = 5): tree LL128's right edge
# (13107200, 16) -> (129499136, 127) crosses y = 5 at x = 24.75 (to 16 MiB); ring LL128 to its
# vertex (293601280, 32), x = 28.13 (to 256 MiB); ring Simple from its vertex (509607936, 32),
# x = 28.92 (512 MiB on). 16 nodes (y = 7): tree LL128 to x = 26.95 (64 MiB); at 128 MiB the
# point lies 0.011 above ring LL128's top edge (129499136, 127) -> (549453824, 128), inside
# NVLS-tree; ring Simple's left edge (509607936, 32) -> (7516192768, 256) crosses y = 7 at
# x = 31.51: NVLS-tree to 2 GiB, ring Simple from 4 GiB.
P5EN_CHOICES = {
    4: [(10, "tree/ll"), (18, "tree/ll128"), (25, "ring/ll128"), (29, "ring/simple")],
    16: [(10, "tree/ll"), (18, "tree/ll128"), (27, "nvls_tree/simple"), (32, "ring/simple")],
}


@pytest.mark.parametrize("nodes", list(P5EN_CHOICES))
def test_auto_on_p5en_follows_the_plugins_tuner(nodes: int) -> None:
    group = Group.all(topo("aws_p5en", nodes))
    got = {k: cost("all_reduce", 1 << k, group).label for k in range(10, 35)}
    want = {k: _expected(P5EN_CHOICES[nodes], k) for k in range(10, 35)}
    assert got == want


def test_two_nodes_is_nccls_own_choice_and_more_nodes_is_not() -> None:
    sizes = [1 << k for k in range(10, 35)]
    for nodes, same in ((2, True), (4, False)):
        plugin = Group.all(topo("aws_p5", nodes))
        own = _without_plugin(nodes)
        picks = [tuner.pick(CollectiveOp.ALL_REDUCE, s, plugin) for s in sizes]
        nccl = [tuner.pick(CollectiveOp.ALL_REDUCE, s, own) for s in sizes]
        assert (picks == nccl) is same


def test_ops_without_regions_stay_with_nccl() -> None:
    # the P5 / P5e tables for 8 ranks per node hold all_reduce only
    plugin = Group.all(topo("aws_p5", 4))
    own = _without_plugin(4)
    for op in (CollectiveOp.ALL_GATHER, CollectiveOp.REDUCE_SCATTER):
        for k in range(10, 35, 4):
            assert tuner.pick(op, 1 << k, plugin) == tuner.pick(op, 1 << k, own)


def test_one_rank_per_node_has_its_own_table() -> None:
    # P5 / P5e, 1 rank per node, all_gather: one ring Simple region, (4194304, 2), (MAX_SIZE, 2),
    # the extended point, (8589934592, 2048); its left edge (22, 1) -> (33, 11) in log2 crosses
    # y = 2 (4 ranks) at x = 22 + 11 / 10 = 23.1: 16 MiB is inside, 8 MiB is not (NCCL decides)
    t = topo("aws_p5", 4)
    group = Group(t, tuple(n * t.gpus_per_node for n in range(4)))
    plugin = tuner.pick(CollectiveOp.ALL_GATHER, 16 << 20, group)
    assert plugin == (Algorithm.RING, Protocol.SIMPLE)
    assert region_pick("p5_p5e", CollectiveOp.ALL_GATHER, 8 << 20, 4, 4, lambda a, p: True) is None
    assert region_pick("p5_p5e", CollectiveOp.ALL_GATHER, 16 << 20, 4, 4, lambda a, p: True) == (
        Algorithm.RING,
        Protocol.SIMPLE,
    )


def test_a_disabled_pair_passes_to_the_next_region() -> None:
    # 16 nodes, 4 GiB: NVLS-tree's edge; without NVLS-tree the next region, ring Simple, does
    # not hold x = 32 at y = 7 (its edge is at 32.52), so NCCL decides
    args = ("p5_p5e", CollectiveOp.ALL_REDUCE, 4 << 30, 128, 16)
    assert region_pick(*args, lambda a, p: True) == (Algorithm.NVLS_TREE, Protocol.SIMPLE)
    assert region_pick(*args, lambda a, p: a is not Algorithm.NVLS_TREE) is None


def test_inside_holds_edges_and_vertices() -> None:
    square = [(0.0, 0.0), (2.0, 0.0), (2.0, 2.0), (0.0, 2.0)]
    assert inside((1.0, 1.0), square) == 1
    assert inside((2.0, 1.0), square) == 0
    assert inside((2.0, 2.0), square) == 0
    assert inside((3.0, 1.0), square) == -1
