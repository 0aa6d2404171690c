"""The collectives' tables are kept per topology, by the module that derives them."""

from __future__ import annotations

import gc

from collsim.cluster.topology import load_topology
from collsim.collectives.memo import PerTopology
from collsim.collectives.select import COSTS, cost
from collsim.collectives.types import Group
from collsim.step.stragglers import degrade_topology


def test_a_topology_s_tables_are_its_own_and_go_with_it() -> None:
    tables: PerTopology[str, int] = PerTopology()
    first, second = load_topology("dgx_h100", nodes=1), load_topology("dgx_h100", nodes=1)
    tables.of(first)["x"] = 1
    assert tables.of(first) == {"x": 1} and tables.of(second) == {}
    assert tables.of(first) is tables.of(first)
    del first
    gc.collect()
    assert len(tables._tables) == 1  # only the second topology's table is left


def test_a_degraded_copy_prices_afresh() -> None:
    topo = load_topology("dgx_h100", nodes=2)
    group = Group.all(topo)
    fast = cost("all_reduce", 1 << 30, group).time_s
    assert COSTS.of(topo)
    slow_links = {link.index: 0.5 for link in topo.links if link.tier == 1}
    degraded = degrade_topology(topo, slow_links)
    assert COSTS.of(degraded) == {}
    assert cost("all_reduce", 1 << 30, Group.all(degraded)).time_s > fast
    assert cost("all_reduce", 1 << 30, group).time_s == fast


def test_tables_that_refer_to_their_topology_are_bounded() -> None:
    # a cost table holds groups, and a group holds its topology: such a topology is never
    # collected, so a program that builds one topology after another keeps at most
    # MAX_TOPOLOGIES of them
    from collsim.collectives.memo import MAX_TOPOLOGIES

    before = {id(t) for t in gc.get_objects() if type(t).__name__ == "Topology"}
    for _ in range(MAX_TOPOLOGIES + 4):
        topo = load_topology("dgx_h100", nodes=1)
        cost("all_reduce", 1 << 20, Group.all(topo))
        del topo
    gc.collect()
    alive = [t for t in gc.get_objects() if type(t).__name__ == "Topology"]
    assert 0 < len([t for t in alive if id(t) not in before]) <= MAX_TOPOLOGIES
    assert len(COSTS._tables) <= MAX_TOPOLOGIES
