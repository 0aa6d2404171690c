"""matplotlib figures of goodput: tokens per day against the checkpoint interval, one timeline.

:func:`plot_goodput` takes a :class:`collsim.study.goodput.estimate.GoodputResult` and returns a
fresh :class:`matplotlib.figure.Figure` (no pyplot, Agg canvas, nothing shown); write it
with :func:`collsim.report.plots.save_figure`.

- top: goodput (tokens per day) against the checkpoint interval, closed form as a line and the
  Monte Carlo mean as points, the exact optimum marked, Young's and Daly's estimates and the
  Monte Carlo best interval with its bootstrap 95 % interval shaded;
- bottom: one sampled run: elapsed time minus the training kept (it climbs by each stall,
  each rollback and each recovery), the periods the job was down shaded, each failure a tick.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np
from matplotlib.figure import Figure

from collsim.core.errors import ConfigError
from collsim.study.goodput.closed_form import effective_training_time_ratio

if TYPE_CHECKING:  # pragma: no cover
    from matplotlib.figure import Figure

    from collsim.study.goodput.estimate import GoodputResult

__all__ = ["plot_goodput"]

_DAY_S = 86_400.0


def plot_goodput(result: GoodputResult, *, title: str = "") -> Figure:
    """Goodput against the checkpoint interval (interior optimum marked) and a sampled timeline.

    Raises:
        ConfigError: the result has no Monte Carlo (nothing to draw against the interval).
    """

    best, run = result.best_interval, result.timeline
    if best is None or run is None:
        raise ConfigError("the goodput result has no Monte Carlo to draw", key_path="plot")
    per_day = result.costs.tokens_per_s * _DAY_S
    fig = Figure(figsize=(9.0, 7.5), layout="constrained")
    top, bottom = fig.subplots(2, 1)

    grid = np.asarray(best.grid_s)
    fine = np.geomspace(grid[0], grid[-1], 200)

    closed = np.array([effective_training_time_ratio(result.costs, float(t)) for t in fine])
    top.plot(fine, closed * per_day, color="C0", label="closed form (renewal, exact)")
    top.plot(
        grid,
        np.asarray(best.monte_carlo_ettr) * per_day,
        "o",
        color="C1",
        markersize=4,
        label="Monte Carlo mean",
    )
    peak = effective_training_time_ratio(result.costs, best.closed_form_s) * per_day
    top.plot([best.closed_form_s], [peak], "*", color="C3", markersize=14, label="optimum")
    top.axvspan(best.ci95_low_s, best.ci95_high_s, color="C1", alpha=0.2, label="MC best, 95 % CI")
    top.axvline(best.young_s, color="0.5", linestyle=":", label="Young (first order)")
    top.axvline(
        best.daly_s, color="0.3", linestyle="--", linewidth=0.8, label="Daly (higher order)"
    )
    top.set_xscale("log")
    top.set_xlabel("checkpoint interval (s of training between checkpoints)")
    top.set_ylabel("goodput (tokens per day)")
    top.set_title(title or "goodput against checkpoint interval")
    top.legend(fontsize=7, loc="lower center", ncol=3)
    top.grid(True, which="both", alpha=0.3)

    t_days = run.progress_time_s / _DAY_S
    deficit_h = (run.progress_time_s - run.progress_useful_s) / 3600.0
    bottom.plot(t_days, deficit_h, color="C0", label="elapsed minus training kept")
    downs: list[tuple[float, float]] = []
    cursor = 0.0
    for start, end in run.up_periods_s:
        if start > cursor:
            downs.append((cursor, start))
        cursor = end
    if cursor < run.horizon_s:
        downs.append((cursor, run.horizon_s))
    for i, (a, b) in enumerate(downs):
        bottom.axvspan(
            a / _DAY_S,
            b / _DAY_S,
            color="C3",
            alpha=0.25,
            linewidth=0,
            label="down (detect, restart)" if i == 0 else None,
        )
    if run.failure_times_s:
        bottom.plot(
            np.asarray(run.failure_times_s) / _DAY_S,
            np.zeros(len(run.failure_times_s)),
            "|",
            color="C3",
            markersize=8,
            label=f"failures ({len(run.failure_times_s)})",
        )
    bottom.set_xlabel("elapsed (days)")
    bottom.set_ylabel("time not training (h)")
    bottom.set_title(f"one sampled run, checkpoint every {run.interval_s:.0f} s")
    bottom.legend(fontsize=8, loc="upper left")
    bottom.grid(True, alpha=0.3)
    return fig
