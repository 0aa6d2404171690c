"""The seed's checks on real gloo ranks: DDP and FSDP from scratch."""

from __future__ import annotations

import pytest

from collsim.validate.measure.sketch import SketchConfig, check_report, run_sketch


@pytest.mark.torch
def test_ddp_and_fsdp_from_scratch_two_ranks() -> None:
    report = run_sketch(
        SketchConfig(steps=3, timing_iters=3, timing_layers=3, timing_hidden=128),
        world_size=2,
        timeout_s=120,
    )
    rows = check_report(report)
    assert len(rows) == 8 and all(ok for _, ok, _ in rows), rows
    # Replicas start apart (different seeds) and the construction broadcast makes them equal.
    assert report["divergence_before_broadcast"] > 0.01
    assert report["grad_max_abs_diff"] < 1e-3 and report["divergence_max"] < 1e-3
    fsdp = report["fsdp"]
    assert fsdp["round_trip_bit_exact"]
    assert fsdp["resting_parameter_bytes_per_rank"] == fsdp["padded_numel"] // 2 * 4
    assert fsdp["gathered_parameter_bytes_per_rank"] > fsdp["full_parameter_bytes"]
    assert report["timing"]["overlap_vs_sum_div_max_abs_diff"] < 1e-6


@pytest.mark.torch
def test_fsdp_four_ranks_quarter_memory() -> None:
    report = run_sketch(SketchConfig(parts=("fsdp",)), world_size=4, timeout_s=120)
    fsdp = report["fsdp"]
    assert fsdp["round_trip_bit_exact"]
    assert fsdp["resting_fraction"] == pytest.approx(0.25, abs=0.01)
    assert fsdp["shard_grad_max_abs_diff"] < 1e-3


def test_check_report_can_fail() -> None:
    report = {
        "world_size": 2,
        "divergence_before_broadcast": 0.3,
        "divergence_after_broadcast": 0.0,
        "grad_max_abs_diff": 5e-3,
        "divergence_per_step": [0.0, 2e-3],
        "divergence_max": 2e-3,
    }
    verdicts = {name.split(" (")[0]: ok for name, ok, _ in check_report(report)}
    assert verdicts == {
        "broadcast at construction makes replicas equal": True,
        "all-reduced gradient == one process on the N*B batch": False,
        "parameters in sync over 2 steps": False,
    }
