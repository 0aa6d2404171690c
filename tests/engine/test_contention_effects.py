"""Where the engine and the closed form differ (links shared by concurrent groups), the run
names the effects: which axis, which links, and how much each adds; they add up to the gap."""

from __future__ import annotations

import pytest

from collsim.cluster.topology import load_topology
from collsim.parallel.config import ParallelConfig, TrainingConfig
from collsim.play.engine import simulate_step
from collsim.play.walk import estimate_step
from collsim.workload import get_preset


def test_shared_nic_is_named_and_the_effects_add_up_to_the_gap() -> None:
    # 8 GPUs per node behind one 100 Gb/s NIC: the 16-way DP all-reduces of the two TP ranks
    # of every node share that NIC, which the closed form (each group alone) cannot see.
    topology = load_topology("pcie_8gpu", nodes=4)
    spec = get_preset("gpt3-350m")
    training = TrainingConfig(global_batch=64, micro_batch=2)
    parallel = ParallelConfig(tp=2, dp=16)
    des = simulate_step(topology, spec, training, parallel)
    closed = estimate_step(topology, spec, training, parallel)
    assert des.contended_axes == ["dp"]
    effects = des.contention
    assert [e.axis for e in effects] == ["dp"]
    assert all(".nic" in name for name in effects[0].links)
    gap = des.step_time_s - closed.step_time_s
    assert gap > 0.05 * closed.step_time_s  # the sharing is real
    assert sum(e.delta_s for e in effects) == pytest.approx(gap, rel=0.01)
    assert effects[0].closed_s == pytest.approx(closed.step_time_s, rel=1e-12)


def test_no_contention_no_effects() -> None:
    topology = load_topology("dgx_h100", nodes=2)
    spec = get_preset("gpt3-350m")
    r = simulate_step(
        topology, spec, TrainingConfig(global_batch=32, micro_batch=2), ParallelConfig(tp=2, dp=8)
    )
    assert r.contended_axes == [] and r.contention is None
