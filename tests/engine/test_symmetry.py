"""Symmetry reduction: one representative per stage (with its peers' traffic) = every rank.

On a DGX A100 pair nothing contends (rails: one NIC per GPU), so the closed form holds. On two
PCIe servers with one NIC each, the data-parallel groups of a stage share the NIC: the engine
detects it (``auto`` -> layer fidelity on the FlowNetwork) and the representative, carrying
its peer groups, must still match the simulation of every rank.
"""

from __future__ import annotations

import pytest

from collsim.parallel.config import ParallelConfig, TrainingConfig
from collsim.play.engine import simulate_step

from .conftest import topology

JOBS = [  # (topology, nodes, tp, pp, dp, zero)
    ("dgx_a100", 1, 2, 2, 2, 0),  # 8 GPUs, DDP
    ("dgx_a100", 2, 2, 2, 4, 1),  # 16 GPUs, ZeRO-1
    ("dgx_a100", 2, 4, 2, 2, 3),  # 16 GPUs, FSDP
    ("pcie_8gpu", 1, 2, 2, 2, 1),  # 8 GPUs on PCIe
    ("pcie_8gpu", 2, 2, 2, 4, 0),  # 16 GPUs, one NIC per node: dp contends
    ("pcie_8gpu", 2, 2, 4, 2, 3),  # 16 GPUs, FSDP over a shared NIC
    ("pcie_8gpu", 2, 1, 4, 4, 0),  # 4 stages per node: their dp groups share the NIC
]


@pytest.mark.parametrize("fidelity", ["auto", "layer"])
@pytest.mark.parametrize(
    "name, nodes, tp, pp, dp, zero",
    JOBS,
    ids=[f"{j[0]}-{j[2]}x{j[3]}x{j[4]}-z{j[5]}" for j in JOBS],
)
def test_representatives_match_all_ranks(
    small_spec, fidelity: str, name: str, nodes: int, tp: int, pp: int, dp: int, zero: int
) -> None:
    topo = topology(name, nodes)
    tr = TrainingConfig(global_batch=4 * dp, micro_batch=1, recompute="selective")
    par = ParallelConfig(tp=tp, pp=pp, dp=dp, zero=zero, sequence_parallel=zero == 1)
    few = simulate_step(topo, small_spec, tr, par, fidelity=fidelity)
    every = simulate_step(topo, small_spec, tr, par, fidelity=fidelity, all_ranks=True)
    assert len(every.simulated_ranks) == tp * pp * dp
    assert len(few.simulated_ranks) == pp
    assert few.step_time_s == pytest.approx(every.step_time_s, rel=0.01)
    assert few.memory_peak_bytes == every.memory_peak_bytes
    for key, value in few.breakdown_s.items():
        assert value == pytest.approx(every.breakdown_s[key], rel=0.01, abs=1e-6)


def test_shared_nic_is_detected_and_slows_the_step(small_spec) -> None:
    topo = topology("pcie_8gpu", 2)
    tr = TrainingConfig(global_batch=16, micro_batch=1)
    # dp outermost: each node holds both stages, and the dp groups cross the nodes
    par = ParallelConfig(tp=2, pp=2, dp=4, zero=0, order="tp-cp-ep-pp-dp")
    closed = simulate_step(topo, small_spec, tr, par, fidelity="fused")
    auto = simulate_step(topo, small_spec, tr, par)
    assert auto.contended_axes == ["dp"] == auto.des_axes
    assert auto.fidelity == "fused"  # only the dp calls run on the DES
    # two data-parallel groups of a stage share one NIC: their all-reduces take longer
    assert auto.breakdown_s["dp_exposed"] > 1.5 * closed.breakdown_s["dp_exposed"]
    rail = simulate_step(topology("dgx_a100", 2), small_spec, tr, par)
    assert rail.contended_axes == [] and rail.fidelity == "fused"
    # one group per stage, but the stages of a node share its NIC at the end of the step
    deep = simulate_step(topo, small_spec, tr, ParallelConfig(pp=8, dp=2, order="tp-cp-ep-pp-dp"))
    assert deep.des_axes == ["dp"]


@pytest.mark.parametrize("schedule, v", [("1f1b", 1), ("interleaved", 2), ("gpipe", 1)])
@pytest.mark.parametrize("zero, sp", [(0, False), (1, True), (3, False)])
def test_fused_and_layer_engines_agree(
    small_spec, schedule: str, v: int, zero: int, sp: bool
) -> None:
    """Fused ops (closed-form TP inside one timeout) against every layer step as an event with
    every collective and transfer on the FlowNetwork, on an uncontended cluster."""
    topo = topology("dgx_a100", 2)
    tr = TrainingConfig(global_batch=32, micro_batch=2, recompute="full")
    par = ParallelConfig(
        tp=4, pp=2, dp=2, zero=zero, schedule=schedule, virtual_stages=v, sequence_parallel=sp
    )
    fused = simulate_step(topo, small_spec, tr, par, fidelity="fused")
    layer = simulate_step(topo, small_spec, tr, par, fidelity="layer")
    assert fused.fidelity == "fused" and layer.fidelity == "layer"
    assert layer.step_time_s == pytest.approx(fused.step_time_s, rel=0.01)
    assert layer.memory_peak_bytes == pytest.approx(fused.memory_peak_bytes, rel=0.01)
    for key in ("tp_exposed", "dp_exposed", "bubble"):
        assert layer.breakdown_s[key] == pytest.approx(
            fused.breakdown_s[key], rel=0.05, abs=0.002 * fused.step_time_s
        )
