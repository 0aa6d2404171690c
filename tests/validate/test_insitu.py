"""The collectives timed in a step's own loop, the topology fitted to them, and the CPU-core
rules of the simulated step (collsim.validate.measure.insitu, collsim.validate.measure.step)."""

from __future__ import annotations

import copy
from typing import Any

import pytest

from collsim.cluster.topology import load_topology
from collsim.step.pricing import ClosedPricer
from collsim.validate.check.step import on_these_cores, simulate_modes
from collsim.validate.measure.insitu import (
    insitu_topology,
    probe_points,
    probe_summary,
    sharing_factor,
)
from collsim.validate.measure.step_model import StepConfig

# What step_rank writes (the figures are made up, sizes are those of the default GPT)
PROBE: dict[str, Any] = {
    "ddp_b1": {"all_reduce": {"sizes_bytes": [1051648] * 12 + [1083392], "median_s": 0.0195}},
    "ddp_b25": {"all_reduce": {"sizes_bytes": [13719552], "median_s": 0.0160}},
    "fsdp": {
        "all_gather": {
            "sizes_bytes": [1083392] + [3159040] * 4,
            "call_median_s": [0.0012, 0.0031, 0.0030, 0.0032, 0.0031],
            "median_s": 0.0136,
        },
        "reduce_scatter": {
            "sizes_bytes": [3159040] * 4 + [1083392],
            "call_median_s": [0.0052, 0.0050, 0.0051, 0.0049, 0.0021],
            "median_s": 0.0223,
        },
    },
}


def _report() -> dict[str, Any]:
    cfg = StepConfig(iters=3, warmup=1)
    from dataclasses import asdict

    profile = {
        "embedding.forward": 2e-4,
        "embedding.backward": 3e-4,
        "layer.forward": 2.0e-3,
        "layer.backward": 4.0e-3,
        "head.forward": 1.0e-3,
        "head.backward": 2.0e-3,
        "optimizer": 2.0e-3,
    }
    modes = {
        m: {"median_s": 0.045, "min_s": 0.04, "times_s": [0.045] * 3}
        for m in ("ddp_b1", "ddp_b25", "fsdp")
    }
    return {
        "world_size": 2,
        "local_world_size": 2,
        "cpu_count": 2,
        "threads_per_rank": 1,
        "backend": "gloo",
        "torch_version": "2.13.0+cpu",
        "profile": profile,
        "compute_scale": 1.0,
        "local_step_s": 0.0273,
        "modes": modes,
        "num_parameters": 3429888,
        "config": {k: (list(v) if isinstance(v, tuple) else v) for k, v in asdict(cfg).items()},
        "comm_probe": copy.deepcopy(PROBE),
        "ddp_copies_s": 0.003,
    }


def test_probe_points_are_per_call_times() -> None:
    rows = {(r["mode"], r["op"], r["size_bytes"]): r["time_us"] for r in probe_points(_report())}
    # a DDP mode: its group time over its calls, at the mean bucket size
    mean_b1 = round((12 * 1051648 + 1083392) / 13)
    assert rows[("ddp_b1", "all_reduce", mean_b1)] == pytest.approx(19500 / 13)
    assert rows[("ddp_b25", "all_reduce", 13719552)] == pytest.approx(16000)
    # FSDP: one point per distinct size, the median of its calls
    assert rows[("fsdp", "all_gather", 3159040)] == pytest.approx(3100)
    assert rows[("fsdp", "reduce_scatter", 1083392)] == pytest.approx(2100)
    assert probe_points({"world_size": 2}) == []


def test_insitu_topology_reproduces_the_timed_collectives() -> None:
    """Two sizes per op: the fitted line passes through both, so the simulator prices each
    timed call at what it measured (within the fit's rounding to 6 digits)."""
    topo, text, why = insitu_topology(_report(), "localhost_gloo_n2", nodes=1, gpus_per_node=2)
    assert topo is not None and why == "" and "name: insitu" in text
    pricer = ClosedPricer(topo)
    for row in probe_points(_report()):
        t = pricer.cost(row["op"], row["size_bytes"], (0, 1)).time_s
        assert t == pytest.approx(row["time_us"] * 1e-6, rel=0.02), row
    shipped = load_topology("localhost_gloo_n2", nodes=1, gpus_per_node=2)
    # the step's all-reduce of 13.7 MB costs twice what the SCHED_RR bench priced it at
    base = ClosedPricer(shipped).cost("all_reduce", 13719552, (0, 1)).time_s
    assert pricer.cost("all_reduce", 13719552, (0, 1)).time_s > 1.5 * base
    lines = probe_summary(_report(), shipped)
    assert lines[0].startswith("ddp_b1: all_reduce 13 x 1.05 MB 19.5 ms (topology ")
    assert lines[-1] == "DDP gradient copies 3.0 ms"


def test_one_size_per_op_follows_the_base_line_through_the_timed_point() -> None:
    report = _report()
    del report["comm_probe"]["ddp_b1"]
    shipped = load_topology("localhost_gloo_n2", nodes=1, gpus_per_node=2)
    topo, copies = on_these_cores(report, shipped)
    assert topo is not shipped and copies == pytest.approx(0.003)
    assert report["insitu_note"] == ""
    fitted, base = ClosedPricer(topo), ClosedPricer(shipped)
    timed = 0.016
    # through the timed point, and at twice the size the base's time x timed / base
    assert fitted.cost("all_reduce", 13719552, (0, 1)).time_s == pytest.approx(timed, rel=0.02)
    scale = timed / base.cost("all_reduce", 13719552, (0, 1)).time_s
    assert fitted.cost("all_reduce", 2 * 13719552, (0, 1)).time_s == pytest.approx(
        scale * base.cost("all_reduce", 2 * 13719552, (0, 1)).time_s, rel=0.02
    )
    old = _report()
    del old["comm_probe"]
    assert on_these_cores(old, shipped) == (shipped, 0.0)
    assert "older report" in old["insitu_note"]


def test_simulated_modes_on_busy_cores() -> None:
    """DDP adds its gradient copies; FSDP exposes every collective (no free core to hide a
    reduce-scatter under backward); both on the fitted topology."""
    shipped = load_topology("localhost_gloo_n2", nodes=1, gpus_per_node=2)
    report = _report()
    sim = simulate_modes(report, shipped)
    plain = simulate_modes(_report(), shipped, insitu=False)
    b25 = sim["ddp_b25"]
    assert b25.breakdown_s["framework"] == pytest.approx(0.003)
    assert plain["ddp_b25"].breakdown_s.get("framework", 0.0) == 0.0
    # the gradients' all-reduce at its timed 16.0 ms (the shipped topology: 8.0), all on the
    # critical path (a quiet host: f = 2, what overlaps costs its whole time)
    on_path = b25.breakdown_s["dp_exposed"] + b25.breakdown_s.get("dp_on_busy_cores", 0.0)
    assert on_path == pytest.approx(0.016, rel=0.05)
    assert plain["ddp_b25"].breakdown_s["dp_exposed"] < 0.010
    fsdp = sim["fsdp"]
    exposed = fsdp.breakdown_s["dp_exposed"] + fsdp.breakdown_s.get("dp_on_busy_cores", 0.0)
    timed = PROBE["fsdp"]["all_gather"]["median_s"] + PROBE["fsdp"]["reduce_scatter"]["median_s"]
    assert exposed == pytest.approx(timed, rel=0.05)
    assert fsdp.step_time_s == pytest.approx(sum(fsdp.breakdown_s.values()), rel=1e-9)
    # with free cores a collective runs beside the compute (the copies stay: compute thread)
    wide = _report()
    wide["cpu_count"] = 8
    free = simulate_modes(wide, shipped)
    assert free["ddp_b25"].breakdown_s["framework"] == pytest.approx(0.003)
    assert "dp_on_busy_cores" not in free["fsdp"].breakdown_s
    # a GPU report: nothing added
    gpu = _report()
    gpu["backend"] = "nccl"
    assert "dp_on_busy_cores" not in simulate_modes(gpu, shipped)["fsdp"].breakdown_s


@pytest.mark.parametrize(
    "cores, ranks, share, autogroup, factor",
    [
        (2, 2, 1.0, True, 2.0),  # quiet, the ranks fill the cores: overlap buys nothing
        (2, 2, 0.25, True, 2.0),  # loaded, one session's share split by its own threads
        (2, 2, 0.5, False, 1.5),  # per thread: 2 others, 4 runnable alone, 6 with comm
        (2, 2, 0.25, False, 1.25),  # 6 others: 8 alone, 10 with
        (8, 2, 1.0, True, 1.0),  # free cores: the comm threads run beside the compute
    ],
)
def test_sharing_factor(
    cores: int, ranks: int, share: float, autogroup: bool, factor: float
) -> None:
    report = {
        "world_size": ranks,
        "cpu_count": cores,
        "threads_per_rank": 1,
        "local_cpu_share": share,
        "sched_autogroup": autogroup,
    }
    assert sharing_factor(report) == pytest.approx(factor, rel=1e-12)


def test_measured_overlap_cost_sets_the_factor() -> None:
    report = {"world_size": 2, "cpu_count": 2, "threads_per_rank": 1, "sched_autogroup": True}
    assert sharing_factor(report) == pytest.approx(2.0)
    # the collectives (20 ms alone) added 5 ms to a 40 ms compute they ran beside
    report["overlap_probe"] = {"compute_s": 0.040, "comm_s": 0.020, "both_s": 0.045}
    assert sharing_factor(report) == pytest.approx(1.25)
    report["overlap_probe"] = {"compute_s": 0.040, "comm_s": 0.020, "both_s": 0.039}
    assert sharing_factor(report) == pytest.approx(1.0)  # never below: nothing is gained


def test_peer_idle_boost_and_straggler_span() -> None:
    from collsim.validate.measure.insitu import peer_idle_boost, straggler_span_s

    report = {"world_size": 2, "cpu_count": 2, "threads_per_rank": 1, "sched_autogroup": True}
    assert peer_idle_boost({**report, "local_cpu_share": 1.0}) == 1.0  # its own core already
    assert peer_idle_boost({**report, "local_cpu_share": 0.5}) == pytest.approx(2.0)
    assert peer_idle_boost({**report, "local_cpu_share": 0.7}) == pytest.approx(1 / 0.7)
    assert peer_idle_boost({**report, "local_cpu_share": 0.2}) == pytest.approx(2.0)  # R = 2
    # a 100 ms spin, then a 60 ms local step's compute, all of it after the peer finished
    assert straggler_span_s(0.060, 0.100, 2.0) == pytest.approx(0.100 + 0.030)
    # a 200 ms local step: the peer computes until 200 ms, the last 100 ms of work go 2x
    assert straggler_span_s(0.200, 0.100, 2.0) == pytest.approx(0.200 + 0.050)
    assert straggler_span_s(0.200, 0.100, 1.0) == pytest.approx(0.300)  # no boost: the sum


def test_profile_path_simulates_straggler_modes_on_the_fitted_topology(tmp_path) -> None:
    """With a device profile (compute from the model): the in-situ topology and the copies
    from the profile's memory-bound rate; a ``+straggler`` mode relative to the simulated
    compute of its normal mode."""
    from collsim.validate.measure.compute import write_profile

    # a synthetic profile, rates that do not depend on shape (as in test_compute_profile)
    measured = {
        "gemm": [
            [m, n, k, "fp32", 0.05] for m in (64, 4096) for n in (64, 4096) for k in (64, 4096)
        ],
        "attention": [["flash2", True, 64, s, 0.02, 0.02] for s in (128, 4096)],
        "bandwidth": [[65536.0, 10.0], [268435456.0, 10.0]],
        "optimizer_bytes_per_s": 1e10,
        "launch_us": 0.0,
        "host_us": 0.0,
        "notes": {"threads": 1, "torch": "none", "device": "cpu", "measured_at_utc": "-"},
    }
    path = write_profile(tmp_path / "p.yaml", measured)
    shipped = load_topology("localhost_gloo_n2", nodes=1, gpus_per_node=2)
    report = _report()
    report["config"].update(straggler_rank=1, straggler_delay_s=0.1)
    report["modes"]["ddp_b25+straggler"] = {"median_s": 0.15, "extra_median_s": 0.1}
    sim = simulate_modes(report, shipped, device_profile=str(path))
    plain = simulate_modes(report, shipped, device_profile=str(path), insitu=False)
    # the copies: 16 B per parameter at the profile's 10 GB/s, beside the engine's own
    # framework costs (its host step)
    copies = sim["ddp_b25"].breakdown_s["framework"] - plain["ddp_b25"].breakdown_s["framework"]
    assert copies == pytest.approx(16 * 3429888 / 10e9, rel=1e-6)
    assert sim["ddp_b25"].step_time_s > plain["ddp_b25"].step_time_s
    slowed = sim["ddp_b25+straggler"]
    parts = sim["ddp_b25"].breakdown_s
    local = parts["compute"] + parts["optimizer"]
    assert slowed.clock_factor == pytest.approx(local / (local + 0.1), rel=1e-9)  # quiet
    assert slowed.step_time_s > sim["ddp_b25"].step_time_s + 0.09
