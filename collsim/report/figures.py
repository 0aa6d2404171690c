"""What every figure of :mod:`collsim.report.plots` shares: the colours of series, memory
categories, step-time parts and phases, a fresh :class:`~matplotlib.figure.Figure` (no pyplot,
no global state), writing PNG or SVG by the file suffix on the Agg canvas, the units drawn
(GiB, GB/s), the checks of a frame's columns, and the memory-over-time panel.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd
from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.figure import Figure

from collsim.core.errors import ConfigError
from collsim.report.frames import memory_timeline_frame
from collsim.step.result import StepResult

__all__ = [
    "CATEGORY_COLORS",
    "GIB",
    "HBM_STYLE",
    "IDEAL_STYLE",
    "IMAGE_SUFFIXES",
    "PHASE_COLORS",
    "SERIES_COLORS",
    "SERIES_MARKERS",
    "save_figure",
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


def _gib(values: Any) -> Any:
    """Bytes as GiB (2**30 bytes): the unit of memory in every collsim table and plot."""
    return np.asarray(values, dtype=float) / GIB


def _gbps(values: Any) -> Any:
    """Bytes/s as GB/s (10**9 bytes/s): the unit of bandwidth (nccl-tests' convention)."""
    return np.asarray(values, dtype=float) / 1e9


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


def _present(value: Any) -> bool:
    """Not None, NaN or pandas' NA."""

    return value is not None and not bool(pd.isna(value))
