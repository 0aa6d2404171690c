from __future__ import annotations

import numpy as np
import pytest
import simpy

from collsim.cluster.network import FlowNetwork, load_bound_time_s, max_min_rates
from collsim.cluster.topology import load_topology, parse_topology
from collsim.core.errors import ConfigError
from collsim.core.yamlio import parse_yaml_text

# A 4-rank node: 100 GB/s per direction, 1 us per link, no efficiency loss.
_NODE = """\
name: toy
device: cpu
gpus_per_node: 4
intra_node: {interconnect: nvswitch, bandwidth_gbps: 100, latency_us: 1.0}
nics: {count: 1, rate_gbit: 400, latency_us: 2.0}
collectives: {library: gloo}
"""
GBPS = 100e9


def toy(nodes: int = 1):
    return parse_topology(parse_yaml_text(_NODE, "toy.yaml"), nodes=nodes)


def run(topo, transfers):
    """Start transfers [(start_s, src, dst, size)] and log (label, finish time)."""
    env = simpy.Environment()
    net = FlowNetwork(env, topo)
    log: list[tuple[str, float]] = []

    def one(label: str, start: float, src: int, dst: int, size: float):
        yield env.timeout(start)
        yield net.transfer(src, dst, size)
        log.append((label, env.now))

    for i, (start, src, dst, size) in enumerate(transfers):
        env.process(one(f"f{i}", start, src, dst, size))
    env.run()
    return sorted(log, key=lambda x: x[1]), net


def test_max_min_by_progressive_filling() -> None:
    # links: 0 cap 10, 1 cap 4. flow A on 0; flow B on 0 and 1; flow C on 1.
    # Link 1 saturates first at 2 each (B, C); A takes the rest of link 0: 8.
    flows = np.array([0, 1, 1, 2])
    links = np.array([0, 0, 1, 1])
    rates = max_min_rates(flows, links, 3, np.array([10.0, 4.0]))
    assert rates.tolist() == pytest.approx([8.0, 2.0, 2.0])


def test_single_transfer_is_size_over_bandwidth_plus_latency() -> None:
    log, net = run(toy(), [(0.0, 0, 1, 1e9)])
    # 1 GB at 100 GB/s + tx and rx latency 2 x 1 us
    assert log == [("f0", pytest.approx(0.01 + 2e-6))]
    assert net.bytes_sent[0] == 1e9 and net.bytes_received[1] == 1e9


def test_two_transfers_share_the_sender_link() -> None:
    # both leave rank 0: 50 GB/s each while both run
    log, _ = run(toy(), [(0.0, 0, 1, 1e9), (0.0, 0, 2, 1e9)])
    assert [t for _, t in log] == pytest.approx([0.02 + 2e-6] * 2)


def test_rates_recomputed_when_a_transfer_ends() -> None:
    # f0: 0.5 GB, f1: 1 GB from rank 0. Shared at 50 GB/s until f0 ends at 10 ms
    # (0.5 GB / 50 GB/s); f1 then has 0.5 GB left at 100 GB/s: ends at 15 ms.
    log, net = run(toy(), [(0.0, 0, 1, 0.5e9), (0.0, 0, 2, 1e9)])
    assert log == [("f0", pytest.approx(0.010 + 2e-6)), ("f1", pytest.approx(0.015 + 2e-6))]
    assert net.num_recomputes == 2


def test_rates_recomputed_when_a_transfer_starts() -> None:
    # f0 alone for 5 ms (0.5 GB sent), then shares with f1 (0.5 GB each at 50 GB/s, 10 ms):
    # both end at 15 ms.
    log, _ = run(toy(), [(0.0, 0, 1, 1e9), (0.005, 0, 2, 0.5e9)])
    assert [t for _, t in log] == pytest.approx([0.015 + 2e-6] * 2)


def test_transfers_started_together_are_one_recomputation() -> None:
    topo = toy()
    env = simpy.Environment()
    net = FlowNetwork(env, topo)
    events = [net.transfer(s, d, 1e6) for s in range(4) for d in range(4) if s != d]
    env.run(simpy.AllOf(env, events))
    assert net.num_recomputes == 1  # 12 equal flows all end together
    # each rank sends 3 MB through its 100 GB/s link, plus 2 us of latency
    assert env.now == pytest.approx(3e6 / GBPS + 2e-6)


def test_disjoint_transfers_do_not_interact() -> None:
    log, _ = run(toy(), [(0.0, 0, 1, 1e9), (0.0, 2, 3, 1e9)])
    assert [t for _, t in log] == pytest.approx([0.01 + 2e-6] * 2)


def test_zero_size_and_self_transfer_cost_only_latency() -> None:
    log, _ = run(toy(), [(0.0, 0, 1, 0.0), (0.0, 2, 2, 1e9)])
    assert sorted(t for _, t in log) == pytest.approx([0.0, 2e-6])


def test_efficiency_slows_the_wire_but_counts_payload() -> None:
    env = simpy.Environment()
    net = FlowNetwork(env, toy())
    env.run(net.transfer(0, 1, 1e9, efficiency=0.5, latency_s=0.0))
    assert env.now == pytest.approx(0.02)
    assert net.bytes_sent[0] == 1e9
    assert net.link_bytes[net.topology.gpu_tx[0]] == 1e9


def test_inter_node_transfer_uses_the_nic() -> None:
    log, net = run(toy(2), [(0.0, 1, 5, 1e9)])
    # NIC 400 Gb/s = 50 GB/s; latency 2 x 2 us
    assert log == [("f0", pytest.approx(1e9 / 50e9 + 4e-6))]


def test_load_bound_matches_the_simulation_for_equal_flows() -> None:
    topo = load_topology("dgx_h100", nodes=2)
    pairs = [(s, (s + 1) % 16) for s in range(16)] + [(s, (s + 9) % 16) for s in range(16)]
    capacity = np.array([link.capacity_bps for link in topo.links])
    bound = load_bound_time_s([topo.path(s, d) for s, d in pairs], capacity)
    env = simpy.Environment()
    net = FlowNetwork(env, topo)
    env.run(simpy.AllOf(env, [net.transfer(s, d, 1e8, latency_s=0.0) for s, d in pairs]))
    assert env.now == pytest.approx(1e8 * bound, rel=1e-9)


def test_bad_arguments() -> None:
    net = FlowNetwork(simpy.Environment(), toy())
    with pytest.raises(ConfigError, match="size_bytes must be >= 0"):
        net.transfer(0, 1, -1.0)
    with pytest.raises(ConfigError, match="efficiency must be in"):
        net.transfer(0, 1, 1.0, efficiency=0.0)


def test_many_small_transfers_at_a_large_clock_all_complete() -> None:
    # Clock round-off at t = 12345 s must not strand a completion (flows end in ns).
    import random

    env = simpy.Environment(initial_time=12345.678)
    net = FlowNetwork(env, load_topology("dgx_h100", nodes=2))
    rng = random.Random(1)
    sent = []

    def worker():
        for _ in range(100):
            yield env.timeout(rng.random() * 1e-7)
            pairs = [(rng.randrange(16), rng.randrange(16), rng.random() * 1e3) for _ in range(5)]
            sent.extend(size for s, d, size in pairs if s != d)
            yield simpy.AllOf(env, [net.transfer(s, d, size) for s, d, size in pairs])

    env.run(simpy.AllOf(env, [env.process(worker()) for _ in range(4)]))
    assert net.active_flows == 0
    assert sum(net.bytes_sent.values()) == pytest.approx(sum(sent))


def test_a_flow_of_multiplicity_k_is_k_identical_flows() -> None:
    # links: 0 cap 10, 1 cap 4. A (x3) on 0; B on 0 and 1; C on 1. One by one: link 1 gives
    # B and C 2 each, the three A's share the remaining 8 of link 0: 8/3 each, 8 together.
    flows = np.array([0, 1, 1, 2])
    links = np.array([0, 0, 1, 1])
    rates = max_min_rates(flows, links, 3, np.array([10.0, 4.0]), np.array([3.0, 1.0, 1.0]))
    assert rates.tolist() == pytest.approx([8.0, 2.0, 2.0])
    # and with the three A's as separate flows
    split = max_min_rates(
        np.array([0, 1, 2, 3, 3, 4]), np.array([0, 0, 0, 0, 1, 1]), 5, np.array([10.0, 4.0])
    )
    assert sum(split[:3]) == pytest.approx(rates[0]) and split[3] == pytest.approx(rates[1])


def test_send_all_matches_one_transfer_per_flow() -> None:
    # Four equal transfers 0->1 (two of them as one flow of count 2) and 2->1: link rx of
    # rank 1 is shared by all, so they finish together at 5 x size / 100 GB/s.
    topo = toy()
    env = simpy.Environment()
    net = FlowNetwork(env, topo)
    size = 1e9
    path01, path21 = topo.path(0, 1), topo.path(2, 1)
    done = net.send_all(
        [(path01, size, 0, 1, 2), (path01, size, 0, 1, 1), (path21, size, 2, 1, 1)]
        + [(path01, size, 0, 1, 1), ((), size, 3, 3, 1)],
    )
    env.run(done)
    assert env.now == pytest.approx(5 * size / GBPS)
    assert net.bytes_sent[0] == pytest.approx(4 * size)
    assert net.bytes_received[1] == pytest.approx(5 * size)
    assert net.link_bytes[topo.gpu_rx[1]] == pytest.approx(5 * size)
    assert net.bytes_sent.get(3, 0.0) == 0.0  # a rank to itself is no traffic
    with pytest.raises(ConfigError, match="count >= 1, got 1000000000.0 and 0"):
        net.send_all([(path01, size, 0, 1, 0)])
