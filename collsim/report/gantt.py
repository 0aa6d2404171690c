"""The step as a Gantt chart: the compute stream of every simulated rank (forward, backward,
bubble) one row per pipeline stage, a lane under each stage for each communication stream,
and the memory in use below (:func:`plot_step`, what ``collsim run --plot`` draws); and the
compute streams of several pipeline schedules side by side (:func:`plot_pipeline`).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

import numpy as np
import pandas as pd
from matplotlib.figure import Figure

from collsim.core.errors import ConfigError
from collsim.report.figures import PHASE_COLORS, _draw_memory, _new_figure, _present
from collsim.report.frames import trace_frame
from collsim.step.result import StepResult

__all__ = ["COMM_COLORS", "plot_pipeline", "plot_step"]


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
