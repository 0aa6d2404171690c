"""The goodput figure: two panels, the optimum marked inside the interval range."""

from __future__ import annotations

from pathlib import Path

import numpy as np

from collsim.report.goodput_plots import plot_goodput
from collsim.report.plots import save_figure
from collsim.study.goodput.config import ComponentRate, ReliabilityConfig, StorageConfig
from collsim.study.goodput.costs import JobCosts
from collsim.study.goodput.estimate import estimate_goodput


def test_plot_goodput_marks_the_interior_optimum(tmp_path: Path) -> None:
    costs = JobCosts(
        failure_rate_per_s=1 / 7200.0,
        write_s=30.0,
        stall_s=30.0,
        background_s=0.0,
        detection_s=100.0,
        restart_s=500.0,
        load_s=0.0,
        step_time_s=1.0,
        tokens_per_step=1e6,
        num_nodes=1,
        interval_s=None,
    )
    rel = ReliabilityConfig(
        components=(ComponentRate(name="gpu", per_1000_node_days=1.0),),
        storage=StorageConfig(write_bandwidth_gbps=1.0, read_bandwidth_gbps=1.0),
    )
    result = estimate_goodput(costs, rel, days=5, runs=50, seed=0, resamples=20)
    fig = plot_goodput(result, title="t")
    top, bottom = fig.axes
    assert top.get_xscale() == "log"
    star = [line for line in top.get_lines() if line.get_marker() == "*"]
    assert len(star) == 1
    x = float(np.asarray(star[0].get_xdata())[0])
    assert result.best_interval is not None
    grid = result.best_interval.grid_s
    assert grid[0] < x < grid[-1]
    assert x == result.best_interval.closed_form_s
    out = save_figure(fig, tmp_path / "g.svg")
    assert out.read_text().lstrip().startswith("<?xml")
