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
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
import pandas as pd
from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.figure import Figure
from matplotlib.ticker import FuncFormatter

from collsim.core.errors import ConfigError
from collsim.core.units import format_size
from collsim.report.frames import (
    BREAKDOWN_COLUMNS,
    MEMORY_COLUMNS,
    memory_timeline_frame,
    trace_frame,
)
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

IMAGE_SUFFIXES = (".png", ".svg")

#: Line colours for series, in order (colour-blind-safe Okabe-Ito palette).
SERIES_COLORS = (
    "#D55E00",
    "#E69F00",
    "#009E73",
    "#0072B2",
    "#CC79A7",
    "#56B4E9",
    "#F0E442",
    "#000000",
)
SERIES_MARKERS = ("o", "s", "^", "D", "v", "P", "X", "*")
#: Bytes per GiB: memory is drawn in GiB (2**30 bytes), as ``collsim run`` reports it.
GIB = 2**30

#: Fill colour of each memory category and step-time part.
CATEGORY_COLORS = {
    "parameters": "#0072B2",
    "gradients": "#56B4E9",
    "optimizer": "#009E73",
    "activations": "#E69F00",
    "buffers": "#CC79A7",
    "compute": "#0072B2",
    "tp_exposed": "#E69F00",
    "pp_exposed": "#CC79A7",
    "dp_exposed": "#D55E00",
    "ep_exposed": "#F0E442",
    "cp_exposed": "#000000",
    "framework": "#BBBBBB",
    "interference": "#882255",
    "bubble": "#999999",
    "optimizer_step": "#009E73",
}
PHASE_COLORS = {
    "forward": "#56B4E9",
    "backward": "#0072B2",
    "recompute": "#E69F00",
    "optimizer": "#009E73",
    "other": "#CC79A7",
    "bubble": "#DDDDDD",
}
IDEAL_STYLE: dict[str, Any] = {
    "color": "black",
    "linestyle": "--",
    "linewidth": 1.3,
    "zorder": 5,
    "alpha": 0.6,
}
HBM_STYLE: dict[str, Any] = {"color": "#B00020", "linestyle": "--", "linewidth": 1.5}


def _new_figure(width_in: float, height_in: float) -> Figure:
    fig = Figure(figsize=(width_in, height_in), dpi=100, layout="constrained")
    fig.patch.set_facecolor("white")
    return fig


def save_figure(fig: Figure, path: str | Path, *, dpi: int = 150) -> Path:
    """Write ``fig`` as PNG or SVG (by the suffix of ``path``) and return the path.

    Raises:
        ConfigError: the suffix is neither ``.png`` nor ``.svg``, or the file cannot be written.
    """
    path = Path(path)
    suffix = path.suffix.lower()
    if suffix not in IMAGE_SUFFIXES:
        raise ConfigError(f"image must end in .png or .svg, got {path.name!r}", key_path="plot")

    FigureCanvasAgg(fig)  # Agg for PNG; SVG is written by its own backend via savefig
    try:
        fig.savefig(path, dpi=dpi, format=suffix[1:], facecolor="white")
    except OSError as exc:
        raise ConfigError(
            f"cannot write {str(path)!r}: {exc.strerror or exc}", key_path="plot"
        ) from None
    return path


def _need(frame: pd.DataFrame, columns: Sequence[str], what: str) -> None:
    missing = [c for c in columns if c not in frame.columns]
    if missing:
        raise ConfigError(
            f"{what} needs column(s) {', '.join(missing)}; "
            f"have {', '.join(map(str, frame.columns))}",
            key_path="plot",
        )


def _feasible(frame: pd.DataFrame) -> pd.DataFrame:
    if "feasible" in frame.columns:
        frame = frame[frame["feasible"].astype(bool)]
    return frame


def _series_values(frame: pd.DataFrame, series: str) -> list[Any]:
    """Series labels in order of first appearance."""
    return list(dict.fromkeys(frame[series].tolist()))


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


def _gib(values: Any) -> Any:
    """Bytes as GiB (2**30 bytes): the unit of memory in every collsim table and plot."""
    return np.asarray(values, dtype=float) / GIB


def _gbps(values: Any) -> Any:
    """Bytes/s as GB/s (10**9 bytes/s): the unit of bandwidth (nccl-tests' convention)."""
    return np.asarray(values, dtype=float) / 1e9


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


def _draw_memory(ax: Any, result: StepResult, rank: int) -> None:
    """Memory in use of ``rank`` over the step (GiB vs ms) with the HBM line, on ``ax``."""

    frame = memory_timeline_frame(result, rank)
    times_ms = np.asarray(frame["time_s"], dtype=float) * 1e3
    values_gb = _gib(frame["memory_bytes"])
    if len(times_ms) and result.step_time_s * 1e3 > times_ms[-1]:
        times_ms = np.append(times_ms, result.step_time_s * 1e3)
        values_gb = np.append(values_gb, values_gb[-1])
    ax.step(
        times_ms,
        values_gb,
        where="post",
        color="#0072B2",
        linewidth=1.6,
        label=f"rank {rank} in use",
    )
    ax.fill_between(times_ms, values_gb, step="post", color="#0072B2", alpha=0.15)
    if result.memory_capacity_bytes:
        ax.axhline(
            result.memory_capacity_bytes / GIB,
            label=f"HBM {result.memory_capacity_bytes / GIB:.1f} GiB",
            **HBM_STYLE,
        )
    ax.set_xlabel("Time in step (ms)")
    ax.set_ylabel("Memory in use (GiB)")
    ax.set_ylim(bottom=0)
    ax.grid(True, alpha=0.25, linestyle="--")
    ax.legend(fontsize=9, loc="center right")


def plot_step(
    result: StepResult,
    *,
    rank: int | None = None,
    title: str | None = None,
    stage_of: Callable[[int], int] | None = None,
    max_rows: int = 16,
    comm: bool = True,
) -> Figure:
    """One simulated step at a glance (what ``collsim run --plot FILE`` draws): the compute
    stream of every simulated rank as a Gantt chart (forward, backward, bubble) on top, with
    a thin lane under each stage for each of its communication streams (``tp``, ``pp``, ``pp
    recv``, ``dp``, ``offload``: when each transfer holds its stream), and the memory in use of
    ``rank`` (default: the first simulated) below, on one time axis.

    Args:
        result: a StepResult simulated with ``trace=True``.
        stage_of: pipeline stage of a rank, for row labels (default: the plan's, as the result
            records it in ``rank_stages``).
        comm: draw the communication lanes (a lane whose transfers all take no time is left
            out).
    """

    frame = trace_frame(result)
    if frame.empty or not (frame["stream"] == "compute").any():
        raise ConfigError(
            "no compute events in the trace (simulate with trace=True)", key_path="plot"
        )
    if rank is None:
        rank = min(result.memory_timeline) if result.memory_timeline else None
    rows = _stage_rows(frame, max_rows, stage_of or _stages_of(result))
    lanes = _comm_lanes(frame, rows) if comm else []
    step_ms = float(result.step_time_s) * 1e3
    height = 2.6 + 0.42 * len(rows) + 0.22 * len(lanes) + (3.0 if rank is not None else 0.0)
    fig = _new_figure(12.0, height)
    if rank is not None:
        ax_gantt, ax_mem = fig.subplots(
            2, 1, sharex=True, height_ratios=[len(rows) + 0.5 * len(lanes) + 1.5, 4.0]
        )
    else:
        ax_gantt, ax_mem = fig.subplots(), None
    row_y, lane_y, ticks, bottom = _lane_layout(rows, lanes)
    share = _draw_gantt(ax_gantt, frame, rows, step_ms, step_ms, row_y=row_y)
    if lanes:
        _draw_comm_lanes(ax_gantt, frame, rows, lanes, lane_y)
        ax_gantt.set_yticks([y for y, _ in ticks], [name for _, name in ticks])
        ax_gantt.set_ylim(bottom - 0.5, -0.5)
    ax_gantt.set_ylabel("Stage / rank")
    ax_gantt.set_title(
        f"step {step_ms:.1f} ms, compute stream idle {share * 100:.0f} % of the step",
        fontsize=10,
        loc="left",
    )
    ax_gantt.legend(fontsize=8, loc="upper left", bbox_to_anchor=(1.0, 1.0))
    if ax_mem is not None and rank is not None:
        _draw_memory(ax_mem, result, rank)
        ax_mem.legend(fontsize=8, loc="upper left", bbox_to_anchor=(1.0, 1.0))
    else:
        ax_gantt.set_xlabel("Time in step (ms)")
    if title:
        fig.suptitle(title)
    return fig


#: Colour of each communication stream's lane in the step chart.
COMM_COLORS = {
    "tp": "#E69F00",
    "pp": "#CC79A7",
    "pp recv": "#F0A8D0",
    "dp": "#D55E00",
    "offload": "#009E73",
}
_COMM_ORDER = ("tp", "pp", "pp recv", "dp", "offload")


def _comm_lanes(frame: pd.DataFrame, rows: list[tuple[str, int]]) -> list[tuple[int, str]]:
    """(row index, stream) of each communication lane: the streams other than compute that
    the row's rank used for some time, in a fixed order (tp, pp, pp recv, dp, offload, others)."""
    comm = frame[(frame["stream"] != "compute") & (frame["end_s"] > frame["start_s"])]
    lanes: list[tuple[int, str]] = []
    for index, (_, rank) in enumerate(rows):
        streams = set(comm.loc[comm["rank"] == rank, "stream"].astype(str))
        ordered = [s for s in _COMM_ORDER if s in streams] + sorted(streams - set(_COMM_ORDER))
        lanes += [(index, stream) for stream in ordered]
    return lanes


def _lane_layout(
    rows: list[tuple[str, int]], lanes: list[tuple[int, str]]
) -> tuple[list[float], list[float], list[tuple[float, str]], float]:
    """y of each compute row, y of each lane, the tick labels, and the bottom of the chart.

    A compute row is 1 high; each of its lanes, under it, 0.55.
    """
    row_y: list[float] = []
    lane_y: list[float] = []
    ticks: list[tuple[float, str]] = []
    y = 0.0
    for index, (name, _) in enumerate(rows):
        row_y.append(y)
        ticks.append((y, name))
        y += 1.0
        for lane_index, stream in lanes:
            if lane_index == index:
                lane_y.append(y - 0.15)
                ticks.append((y - 0.15, f"  {stream}"))
                y += 0.55
    return row_y, lane_y, ticks, y


def _draw_comm_lanes(
    ax: Any,
    frame: pd.DataFrame,
    rows: list[tuple[str, int]],
    lanes: list[tuple[int, str]],
    lane_y: list[float],
) -> None:
    """Each lane's transfers as thin bars (one colour per stream), at ``lane_y``."""
    seen: set[str] = set()
    timed = frame[frame["end_s"] > frame["start_s"]]
    for (index, stream), y_pos in zip(lanes, lane_y):
        rank = rows[index][1]
        part = timed[(timed["rank"] == rank) & (timed["stream"] == stream)]
        bars = [
            (float(start) * 1e3, (float(end) - float(start)) * 1e3)
            for start, end in zip(part["start_s"], part["end_s"])
        ]
        ax.broken_barh(
            bars,
            (y_pos - 0.2, 0.4),
            facecolors=COMM_COLORS.get(stream, "#777777"),
            label=f"{stream} comm" if stream not in seen else None,
        )
        seen.add(stream)


def _stages_of(result: StepResult) -> Callable[[int], int] | None:
    """The pipeline stage of each simulated rank as the result records it (None: not recorded)."""
    if not result.rank_stages:
        return None
    return result.rank_stages.__getitem__


def _stage_rows(
    frame: pd.DataFrame, max_rows: int, stage_of: Callable[[int], int] | None = None
) -> list[tuple[str, int]]:
    """(label, rank) of the rows of a Gantt chart: one rank per pipeline stage.

    The stage of a rank comes from the events' ``stage`` arg, else from ``stage_of(rank)``;
    without either, every simulated rank gets a row labelled by its rank.
    """
    compute = frame[frame["stream"] == "compute"]
    ranks = sorted(set(int(r) for r in compute["rank"]))
    if "stage" in compute.columns and compute["stage"].notna().any():
        first = compute.dropna(subset=["stage"]).groupby("stage")["rank"].min()
        rows = [(f"stage {int(s)}", int(r)) for s, r in zip(first.index.tolist(), first.tolist())]
    elif stage_of is not None:
        seen: dict[int, int] = {}
        for rank in ranks:
            seen.setdefault(int(stage_of(rank)), rank)
        rows = [(f"stage {s} (rank {r})", r) for s, r in sorted(seen.items())]
    else:
        rows = [(f"rank {r}", r) for r in ranks]
    return rows[:max_rows]


def _draw_gantt(
    ax: Any,
    frame: pd.DataFrame,
    rows: list[tuple[str, int]],
    step_ms: float,
    end_ms: float,
    row_y: list[float] | None = None,
) -> float:
    """Draw the compute stream of each row's rank on ``ax``; return the idle share of the step.

    Row ``i`` is drawn at y = ``row_y[i]`` (default ``i``).

    Bubble: every moment of the step the stage's compute stream is idle (before its first op,
    between ops, after its last op), drawn grey.
    """
    compute = frame[frame["stream"] == "compute"]
    idle_total = busy_total = 0.0
    for index, (_, rank) in enumerate(rows):
        y = row_y[index] if row_y is not None else float(index)
        ops = compute[compute["rank"] == rank].sort_values("start_s")
        start_ms = ops["start_s"].to_numpy(dtype=float) * 1e3
        stop_ms = ops["end_s"].to_numpy(dtype=float) * 1e3
        gaps = []
        cursor = 0.0
        for s, e in zip(start_ms, stop_ms):
            if s > cursor:
                gaps.append((cursor, s - cursor))
            cursor = max(cursor, e)
        if step_ms > cursor:
            gaps.append((cursor, step_ms - cursor))
        idle_total += sum(width for _, width in gaps)
        busy_total += step_ms
        ax.broken_barh(
            gaps,
            (y - 0.4, 0.8),
            facecolors=PHASE_COLORS["bubble"],
            label="bubble (idle)" if index == 0 else None,
        )
        for phase in ("forward", "backward", "recompute", "optimizer", "other"):
            sel = (ops["phase"] == phase).to_numpy()
            if not sel.any():
                continue
            bars = list(zip(start_ms[sel], (stop_ms - start_ms)[sel]))
            ax.broken_barh(
                bars,
                (y - 0.4, 0.8),
                facecolors=PHASE_COLORS[phase],
                edgecolor="white",
                linewidth=0.4,
                label=phase if index == 0 else None,
            )
            if len(rows) <= 8 and len(bars) <= 64:
                for (s, w), mb in zip(bars, ops.loc[sel, "microbatch"]):
                    if _present(mb) and w > end_ms / 80:
                        ax.text(
                            s + w / 2,
                            y,
                            str(mb),
                            ha="center",
                            va="center",
                            fontsize=6,
                            color="white" if phase == "backward" else "black",
                        )
    ys = row_y if row_y is not None else [float(i) for i in range(len(rows))]
    ax.set_yticks(ys, [name for name, _ in rows])
    ax.set_ylim(ys[-1] + 0.5 if ys else 0.5, -0.5)
    ax.set_xlim(0, end_ms)
    ax.grid(True, axis="x", alpha=0.25, linestyle="--")
    return idle_total / busy_total if busy_total else 0.0


def plot_pipeline(
    results: Mapping[str, StepResult],
    *,
    max_stages: int = 16,
    title: str | None = None,
    stage_of: Callable[[int], int] | None = None,
) -> Figure:
    """Gantt chart of the compute stream of each pipeline stage, one panel per schedule
    (GPipe, 1F1B, interleaved side by side, top to bottom), on a common time axis.

    Forward and backward slices are coloured by phase and labelled with their micro-batch when
    the engine recorded it; the time a stage's compute stream is idle during the step is the
    bubble, drawn grey. Panel titles give its share of the stage time.

    Args:
        results: schedule label -> StepResult simulated with ``trace=True``.
        stage_of: pipeline stage of a rank, for row labels when the trace events carry no
            ``stage`` (default: the plan's, as each result records it in ``rank_stages``).
    """

    if not results:
        raise ConfigError("no schedule to draw", key_path="plot")
    frames = {label: trace_frame(result) for label, result in results.items()}
    for label, frame in frames.items():
        if frame.empty or not (frame["stream"] == "compute").any():
            raise ConfigError(
                f"{label}: no compute events in the trace (simulate with trace=True)",
                key_path="plot",
            )
    end_ms = max(float(r.step_time_s) for r in results.values()) * 1e3
    stages = {label: stage_of or _stages_of(result) for label, result in results.items()}
    heights = [len(_stage_rows(f, max_stages, stages[label])) for label, f in frames.items()]
    fig = _new_figure(12.0, 1.2 + sum(0.42 * h + 0.9 for h in heights))
    axes = np.atleast_1d(
        fig.subplots(
            len(frames), 1, sharex=True, squeeze=False, height_ratios=[h + 1.5 for h in heights]
        )[:, 0]
    )
    for ax, (label, frame) in zip(axes, frames.items()):
        rows = _stage_rows(frame, max_stages, stages[label])
        share = _draw_gantt(ax, frame, rows, float(results[label].step_time_s) * 1e3, end_ms)
        ax.set_title(
            f"{label}: step {results[label].step_time_s * 1e3:.1f} ms, "
            f"idle {share * 100:.0f} % of stage time",
            fontsize=10,
            loc="left",
        )
        ax.set_ylabel("Pipeline stage")
    axes[-1].set_xlabel("Time in step (ms)")
    handles, names = axes[0].get_legend_handles_labels()
    fig.legend(handles, names, loc="outside right center", fontsize=9)
    if title:
        fig.suptitle(title)
    return fig


def _present(value: Any) -> bool:
    """Not None, NaN or pandas' NA."""

    return value is not None and not bool(pd.isna(value))


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
