"""matplotlib figures of simulated results: scaling, memory, timelines, pipelines, collectives.

Every function takes tidy frames (:mod:`collsim.report.frames`) or StepResults, draws on a fresh
:class:`matplotlib.figure.Figure` (no pyplot, no global state, never ``show()``), and returns it;
:func:`save_figure` writes PNG or SVG chosen by the file suffix. The Agg canvas is used, so no
display is needed.

- :func:`plot_scaling`: speedup and scaling efficiency vs GPUs, one line per plan, ideal dashed
  (the simulated version of the classic DDP / FSDP / DDP-with-overlap chart);
- :func:`plot_memory`: per-GPU memory vs GPUs, one panel per plan, stacked by category, HBM line;
- :func:`plot_memory_timeline`: memory in use over one step for one rank, HBM line;
- :func:`plot_pipeline`: Gantt chart of the compute stream of each stage (forward, backward,
  bubble), one panel per schedule;
- :func:`plot_breakdown`: stacked bars of the step-time parts per plan;
- :func:`plot_collectives`: bus bandwidth vs message size, one line per algorithm.

The shared colours and helpers are in :mod:`collsim.report.figures`, the step and pipeline
Gantt charts in :mod:`collsim.report.gantt` (re-exported here).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import numpy as np
import pandas as pd
from matplotlib.figure import Figure
from matplotlib.ticker import FuncFormatter

from collsim.core.errors import ConfigError
from collsim.core.units import format_size
from collsim.report.figures import (
    CATEGORY_COLORS,
    GIB,
    HBM_STYLE,
    IDEAL_STYLE,
    IMAGE_SUFFIXES,
    SERIES_COLORS,
    SERIES_MARKERS,
    _draw_memory,
    _feasible,
    _gbps,
    _gib,
    _need,
    _new_figure,
    _series_values,
    save_figure,
)
from collsim.report.frames import BREAKDOWN_COLUMNS, MEMORY_COLUMNS
from collsim.report.gantt import plot_pipeline, plot_step
from collsim.step.result import BREAKDOWN_KEYS, MEMORY_KEYS, StepResult

if TYPE_CHECKING:  # pragma: no cover
    import pandas as pd
    from matplotlib.figure import Figure

__all__ = [
    "IMAGE_SUFFIXES",
    "save_figure",
    "scaling_table",
    "plot_scaling",
    "plot_memory",
    "plot_memory_timeline",
    "plot_step",
    "plot_pipeline",
    "plot_breakdown",
    "plot_collectives",
]


def scaling_table(
    frame: pd.DataFrame,
    *,
    series: str = "plan",
    x: str = "num_gpus",
    throughput: str = "tokens_per_s",
) -> pd.DataFrame:
    """Speedup and efficiency per series and GPU count (what :func:`plot_scaling` draws).

    Speedup at N GPUs is throughput(N) / throughput(N0), times N_first / N0 where N0 is the
    smallest GPU count in the frame and N_first the series' smallest feasible count (so a series
    that cannot run at N0 starts on the ideal line, and says so in ``from_gpus``). Efficiency =
    speedup / (N / N0). With weak scaling (the global batch grows with the data-parallel size)
    this is the usual throughput speedup; with strong scaling it is the step-time speedup.

    Returns:
        ``series, num_gpus, throughput, speedup, ideal, efficiency, from_gpus``.
    """

    _need(frame, [series, x, throughput], "scaling plot")
    data = _feasible(frame).dropna(subset=[throughput])
    data = data[data[throughput] > 0]
    if data.empty:
        raise ConfigError("no feasible point to plot", key_path="plot")
    base_gpus = float(data[x].min())
    rows = []
    for label in _series_values(data, series):
        part = data[data[series] == label].sort_values(x)
        first_gpus = float(part[x].iloc[0])
        first_rate = float(part[throughput].iloc[0])
        for gpus, rate in zip(part[x].astype(float), part[throughput].astype(float)):
            speedup = rate / first_rate * first_gpus / base_gpus
            ideal = gpus / base_gpus
            rows.append(
                {
                    "series": label,
                    "num_gpus": gpus,
                    "throughput": rate,
                    "speedup": speedup,
                    "ideal": ideal,
                    "efficiency": speedup / ideal,
                    "from_gpus": first_gpus,
                }
            )
    return pd.DataFrame.from_records(rows)


def plot_scaling(
    frame: pd.DataFrame,
    *,
    series: str = "plan",
    x: str = "num_gpus",
    throughput: str = "tokens_per_s",
    title: str | None = None,
) -> Figure:
    """Speedup (left) and scaling efficiency in percent (right) vs GPUs, one line per series.

    The ideal (linear speedup, 100 % efficiency) is a dashed black line labelled ``ideal`` on
    both panels. Axes are log2 in GPUs (and in speedup). See :func:`scaling_table` for the
    definitions.

    Args:
        frame: a results frame (``collsim sweep -o``): one row per (series, GPU count).
        series: column that names the plan of each row (``plan``, ``parallel.zero`` ...).
    """
    table = scaling_table(frame, series=series, x=x, throughput=throughput)
    base = float(table["num_gpus"].min())
    fig = _new_figure(12.0, 4.8)
    ax_speed, ax_eff = fig.subplots(1, 2)
    gpus = np.array(sorted(set(table["num_gpus"])))
    ax_speed.plot(gpus, gpus / base, label="ideal (linear)", **IDEAL_STYLE)
    ax_eff.plot(gpus, np.full(len(gpus), 100.0), label="ideal (100 %)", **IDEAL_STYLE)
    for index, label in enumerate(_series_values(table, "series")):
        part = table[table["series"] == label]
        style = {
            "color": SERIES_COLORS[index % len(SERIES_COLORS)],
            "marker": SERIES_MARKERS[index % len(SERIES_MARKERS)],
            "linewidth": 2,
            "markersize": 6,
        }
        ax_speed.plot(part["num_gpus"], part["speedup"], label=str(label), **style)
        ax_eff.plot(part["num_gpus"], part["efficiency"] * 100.0, label=str(label), **style)
    base_text = f"{int(base)} GPU" + ("s" if base != 1 else "")
    ax_speed.set_xlabel("Number of GPUs")
    ax_speed.set_ylabel(f"Speedup (x vs {base_text})")
    ax_speed.set_title("Training speedup vs GPU count")
    ax_speed.set_xscale("log", base=2)
    ax_speed.set_yscale("log", base=2)

    ax_speed.yaxis.set_major_formatter(FuncFormatter(lambda value, _: f"{value:g}"))
    ax_eff.set_xlabel("Number of GPUs")
    ax_eff.set_ylabel("Scaling efficiency (%)")
    ax_eff.set_title("Scaling efficiency")
    ax_eff.set_xscale("log", base=2)
    top = max(110.0, float(table["efficiency"].max()) * 100.0 + 5.0)
    ax_eff.set_ylim(0, top)
    for ax in (ax_speed, ax_eff):
        ax.set_xticks(gpus, [str(int(g)) for g in gpus])
        ax.grid(True, alpha=0.25, linestyle="--", which="both")
    ax_speed.legend(fontsize=9, loc="upper left")
    ax_eff.legend(fontsize=9, loc="lower left")
    if title:
        fig.suptitle(title)
    return fig


def plot_memory(
    frame: pd.DataFrame,
    *,
    series: str = "plan",
    x: str = "num_gpus",
    capacity_bytes: float | None = None,
    title: str | None = None,
) -> Figure:
    """Per-GPU memory at the peak vs GPUs: one panel per series (DDP, ZeRO-1/2/3 ...), bars
    stacked by category (parameters, gradients, optimizer, activations, buffers) and the HBM
    capacity as a dashed red line (``capacity_bytes``, default ``memory_capacity_bytes``).

    Infeasible points that were simulated (``fits`` False) are drawn too, marked "does not fit":
    that is the point of the HBM line. Points without numbers (the plan could not be built) are
    left out.
    """

    _need(frame, [series, x, *MEMORY_COLUMNS.values()], "memory plot")
    data = frame.dropna(subset=list(MEMORY_COLUMNS.values()))
    if data.empty:
        raise ConfigError("no point with memory figures to plot", key_path="plot")
    if capacity_bytes is None and "memory_capacity_bytes" in data.columns:
        capacity_bytes = float(data["memory_capacity_bytes"].max())
    labels = _series_values(data, series)
    fig = _new_figure(max(5.0, 3.3 * len(labels)) + 1.5, 4.8)
    axes = np.atleast_1d(fig.subplots(1, len(labels), sharey=True, squeeze=False)[0])
    all_gpus = sorted(set(data[x].astype(int)))
    for ax, label in zip(axes, labels):
        part = data[data[series] == label].sort_values(x)
        positions = [all_gpus.index(int(g)) for g in part[x]]
        bottom = np.zeros(len(part))
        for key in MEMORY_KEYS:
            heights = _gib(part[MEMORY_COLUMNS[key]])
            ax.bar(
                positions,
                heights,
                bottom=bottom,
                width=0.7,
                label=key,
                color=CATEGORY_COLORS[key],
                edgecolor="white",
                linewidth=0.5,
            )
            bottom = bottom + heights
        if capacity_bytes:
            ax.axhline(
                capacity_bytes / GIB, label=f"HBM {capacity_bytes / GIB:.1f} GiB", **HBM_STYLE
            )
            for x_pos, top in zip(positions, bottom):
                if top * GIB > capacity_bytes:
                    ax.text(
                        x_pos,
                        top,
                        "does not fit",
                        ha="center",
                        va="bottom",
                        fontsize=7,
                        color=HBM_STYLE["color"],
                    )
        ax.set_xticks(range(len(all_gpus)), [str(g) for g in all_gpus])
        ax.set_title(str(label))
        ax.set_xlabel("Number of GPUs")
        ax.grid(True, axis="y", alpha=0.25, linestyle="--")
    y_max = max(
        float(_gib(data["memory_peak_bytes"]).max()) if "memory_peak_bytes" in data else 0.0,
        (capacity_bytes or 0.0) / GIB,
    )
    if y_max > 0:
        axes[0].set_ylim(0, y_max * 1.12)
    axes[0].set_ylabel("Peak memory per GPU (GiB)")
    handles, names = axes[0].get_legend_handles_labels()
    fig.legend(handles, names, loc="outside right center", fontsize=9)
    if title:
        fig.suptitle(title)
    return fig


def plot_memory_timeline(
    result: StepResult, *, rank: int | None = None, title: str | None = None
) -> Figure:
    """Memory in use over one step for ``rank`` (default: the first simulated rank), as a step
    line in GiB over milliseconds, with the HBM capacity dashed."""
    if rank is None:
        if not result.memory_timeline:
            raise ConfigError(
                "the result has no memory timeline (simulate with trace=True)", key_path="plot"
            )
        rank = min(result.memory_timeline)
    fig = _new_figure(9.0, 4.2)
    ax = fig.subplots()
    _draw_memory(ax, result, rank)
    ax.set_title(title or f"Memory over one step, rank {rank}")
    return fig


def plot_breakdown(
    frame: pd.DataFrame, *, series: str = "plan", title: str | None = None
) -> Figure:
    """Stacked horizontal bars of the step time per plan: compute, exposed TP / PP / DP
    communication, pipeline bubble, optimizer (in ms, or in s when a step takes 10 s or more).
    One bar per row of ``frame``."""

    _need(frame, [series, *BREAKDOWN_COLUMNS.values()], "breakdown plot")
    data = frame.dropna(subset=list(BREAKDOWN_COLUMNS.values()))
    if data.empty:
        raise ConfigError("no point with a step-time breakdown to plot", key_path="plot")
    labels = [str(v) for v in data[series]]
    fig = _new_figure(12.0, 1.8 + 0.5 * len(labels))
    ax = fig.subplots()
    positions = np.arange(len(labels))
    left = np.zeros(len(labels))
    totals_s = sum(np.asarray(data[c], dtype=float) for c in BREAKDOWN_COLUMNS.values())
    scale, unit = (1.0, "s") if float(np.max(totals_s)) >= 10.0 else (1e3, "ms")
    names = {
        "compute": "compute",
        "tp_exposed": "TP comm (exposed)",
        "pp_exposed": "PP comm (exposed)",
        "dp_exposed": "DP comm (exposed)",
        "ep_exposed": "EP comm (exposed)",
        "cp_exposed": "CP comm (exposed)",
        "bubble": "pipeline bubble",
        "framework": "framework",
        "interference": "comm interference",
        "optimizer": "optimizer",
    }
    for key in BREAKDOWN_KEYS:
        widths = np.asarray(data[BREAKDOWN_COLUMNS[key]], dtype=float) * scale
        color = CATEGORY_COLORS["optimizer_step" if key == "optimizer" else key]
        ax.barh(
            positions,
            widths,
            left=left,
            height=0.65,
            color=color,
            label=names[key],
            edgecolor="white",
            linewidth=0.5,
        )
        left = left + widths
    ax.set_yticks(positions, labels)
    ax.invert_yaxis()
    ax.set_xlabel(f"Step time ({unit})")
    ax.set_ylabel("Plan")
    ax.set_title(title or "Where the step time goes")
    ax.grid(True, axis="x", alpha=0.25, linestyle="--")
    handles, names_ = ax.get_legend_handles_labels()
    fig.legend(handles, names_, loc="outside right center", fontsize=9)
    return fig


def plot_collectives(
    frame: pd.DataFrame,
    *,
    series: str = "algorithm",
    title: str | None = None,
    reference_bps: float | None = None,
) -> Figure:
    """Bus bandwidth (GB/s) vs message size, one line per algorithm (nccl-tests convention,
    log2 size axis). ``reference_bps`` draws a dashed line (a link's rate) for comparison.

    Args:
        frame: ``size_bytes, busbw_bps, algorithm`` (:func:`~collsim.report.frames.
            read_collective_csv` or :func:`~collsim.report.frames.collective_cost_frame`).
    """
    _need(frame, ["size_bytes", "busbw_bps", series], "collectives plot")
    if frame.empty:
        raise ConfigError("no collective measurement to plot", key_path="plot")
    fig = _new_figure(8.5, 4.8)
    ax = fig.subplots()
    for index, label in enumerate(_series_values(frame, series)):
        part = frame[frame[series] == label].sort_values("size_bytes")
        style: dict[str, Any] = {
            # past the 8 colours the marker shifts: 64 series have a (colour, marker) each
            "color": SERIES_COLORS[index % len(SERIES_COLORS)],
            "marker": SERIES_MARKERS[(index + index // len(SERIES_COLORS)) % len(SERIES_MARKERS)],
            "markersize": 4,
            "linewidth": 1.8,
        }
        if "measured" in str(label):  # measurements stand out by a heavier line, own colour
            style.update(markersize=3, linewidth=2.4)
        ax.plot(part["size_bytes"], _gbps(part["busbw_bps"]), label=str(label), **style)
    if reference_bps:
        ax.axhline(reference_bps / 1e9, label=f"link {reference_bps / 1e9:.0f} GB/s", **IDEAL_STYLE)
    ax.set_xscale("log", base=2)
    sizes = sorted(set(frame["size_bytes"].astype(float)))
    ticks = [s for s in sizes if s > 0 and np.log2(s) % 4 == 0] or sizes

    ax.set_xticks(ticks, [format_size(t).replace(" ", "") for t in ticks])
    ax.set_xlabel("Message size (bytes, nccl-tests size)")
    ax.set_ylabel("Bus bandwidth (GB/s)")
    op = ""
    if "op" in frame.columns and frame["op"].nunique() == 1:
        op = str(frame["op"].iloc[0]) + ": "
    ax.set_title(title or f"{op}bus bandwidth vs size")
    ax.grid(True, alpha=0.25, linestyle="--", which="both")
    ax.legend(fontsize=9, loc="upper left")
    return fig
