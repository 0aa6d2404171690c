"""Simulate exactly the measured points and report the error of each.

For every measured (op, size) the closed form :func:`collsim.collectives.cost` is evaluated on
the given topology for the same world size (``Group.all`` of the topology sized to the
measurement: ``ranks_per_node`` ranks on ``num_nodes`` nodes). The error is
``(simulated - measured) / measured``; the summary per op gives the median, p90 and max of its
absolute value. The plot is log-log time against size: measured points, simulated lines.
"""

from __future__ import annotations

import math
import statistics
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
from matplotlib.figure import Figure

from collsim.cluster.topology import load_topology
from collsim.collectives import Group, cost
from collsim.core.errors import ConfigError
from collsim.validate.data.dataset import Measurements
from collsim.validate.fit.calibrate import select_rows

__all__ = [
    "ComparedPoint",
    "OpSummary",
    "RunsSummary",
    "compare",
    "summarize",
    "across_runs",
    "format_comparison",
    "plot_comparison",
    "topology_for",
]


@dataclass(frozen=True, slots=True)
class ComparedPoint:
    """One measured point and its simulation."""

    op: str
    size_bytes: int
    measured_s: float
    simulated_s: float
    algorithm: str
    protocol: str = ""
    """The protocol the simulator chose (NCCL: ll, ll128, simple; gloo: simple)."""

    @property
    def error(self) -> float:
        """(simulated - measured) / measured."""
        return (self.simulated_s - self.measured_s) / self.measured_s


@dataclass(frozen=True, slots=True)
class OpSummary:
    """|error| statistics of one op."""

    op: str
    count: int
    median_abs_error: float
    p90_abs_error: float
    max_abs_error: float


def topology_for(spec: str | Path, meas: Measurements) -> Any:
    """The topology ``spec`` sized to the measurement's ranks per node and node count."""

    per_node = meas.ranks_per_node
    return load_topology(spec, nodes=max(1, meas.world_size // per_node), gpus_per_node=per_node)


def compare(
    meas: Measurements,
    topology: Any,
    *,
    subset: str = "all",
    min_bytes: int = 0,
    max_bytes: int | None = None,
    ops: tuple[str, ...] | None = None,
) -> list[ComparedPoint]:
    """Simulate every selected measured point on ``topology``.

    Raises:
        ConfigError: the topology's rank count differs from the measurement's world size, a
            row's ``ranks`` differs from it, or a measured time is not a finite number > 0 (as
            calibrate refuses it).
    """

    if topology.num_ranks != meas.world_size:
        raise ConfigError(
            f"topology {topology.name} has {topology.num_ranks} ranks, the "
            f"measurement {meas.world_size}",
            file=meas.path,
        )
    group = Group.all(topology)
    out = []
    for row in select_rows(meas.rows, subset, min_bytes=min_bytes, max_bytes=max_bytes, ops=ops):
        if int(row.get("world_size", meas.world_size)) != meas.world_size:
            raise ConfigError(
                f"a row of {row['world_size']} ranks ({row['op']} {row['size_bytes']} B) in a "
                f"measurement of {meas.world_size}: one file is simulated at one world size; "
                "put each world size in a file of its own",
                key_path="ranks",
                file=meas.path,
            )
        measured_us = float(row["time_us"])
        if not (math.isfinite(measured_us) and measured_us > 0):
            raise ConfigError(
                f"must be a finite number > 0, got {measured_us} ({row['op']} "
                f"{row['size_bytes']} B)",
                key_path="time_us",
                file=meas.path,
            )
        sim = cost(row["op"], int(row["size_bytes"]), group)
        out.append(
            ComparedPoint(
                row["op"],
                int(row["size_bytes"]),
                float(row["time_us"]) * 1e-6,
                sim.time_s,
                sim.algorithm.value,
                sim.protocol.value,
            )
        )
    return out


def _p90(values: list[float]) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(round(0.9 * (len(ordered) - 1))))]


def summarize(points: list[ComparedPoint]) -> list[OpSummary]:
    """Per op (first-seen order), then ``all``: median, p90 and max of |error|."""
    ops: list[str] = []
    for p in points:
        if p.op not in ops:
            ops.append(p.op)
    out = []
    for op in ops + ["all"]:
        errs = [abs(p.error) for p in points if op in ("all", p.op)]
        if errs:
            out.append(OpSummary(op, len(errs), statistics.median(errs), _p90(errs), max(errs)))
    return out


@dataclass(frozen=True, slots=True)
class RunsSummary:
    """One op at one world size over repeated measurement runs (one median |error| per run)."""

    world_size: int
    op: str
    run_errors: tuple[float, ...]

    @property
    def median(self) -> float:
        """The typical run: median of the per-run median |error| (benchmark convention)."""
        return statistics.median(self.run_errors)

    @property
    def worst(self) -> float:
        return max(self.run_errors)

    def passing(self, target: float) -> int:
        """Runs whose median |error| is within ``target``."""
        return sum(e <= target for e in self.run_errors)


def across_runs(per_run: list[tuple[int, list[OpSummary]]]) -> list[RunsSummary]:
    """Group per-run summaries by (world size, op), in first-seen order; ``all`` is left out.

    Args:
        per_run: for each measurement file, its world size and :func:`summarize` output.
    """
    grouped: dict[tuple[int, str], list[float]] = {}
    for world_size, summary in per_run:
        for s in summary:
            if s.op != "all":
                grouped.setdefault((world_size, s.op), []).append(s.median_abs_error)
    return [RunsSummary(n, op, tuple(errs)) for (n, op), errs in grouped.items()]


def format_comparison(
    points: list[ComparedPoint], summary: list[OpSummary], header: str = ""
) -> str:
    """Table of measured vs simulated per point, then the summary."""
    lines = [f"# {header}"] if header else []
    lines.append(
        f"# {'op':<15} {'size(B)':>12} {'measured(us)':>13} {'simulated(us)':>14} "
        f"{'error':>8}  algorithm"
    )
    for p in points:
        lines.append(
            f"  {p.op:<15} {p.size_bytes:>12} {p.measured_s * 1e6:>13.1f} "
            f"{p.simulated_s * 1e6:>14.1f} {p.error * 100:>7.1f}%  {p.algorithm}"
        )
    lines.append("#")
    lines.append(f"# {'op':<15} {'points':>6} {'median|err|':>12} {'p90|err|':>9} {'max|err|':>9}")
    for s in summary:
        lines.append(
            f"  {s.op:<15} {s.count:>6} {s.median_abs_error * 100:>11.1f}% "
            f"{s.p90_abs_error * 100:>8.1f}% {s.max_abs_error * 100:>8.1f}%"
        )
    return "\n".join(lines)


def plot_comparison(
    points: list[ComparedPoint], topology: Any, path: str | Path, title: str = ""
) -> Path:
    """Log-log time vs size: measured points, simulated lines (one colour per op)."""

    group = Group.all(topology)
    fig = Figure(figsize=(7, 5))  # no pyplot: no global state, no backend to pick
    ax = fig.subplots()
    ops: list[str] = []
    for p in points:
        if p.op not in ops:
            ops.append(p.op)
    for i, op in enumerate(ops):
        color = f"C{i % 10}"
        # a log axis has no place for an empty message: those rows stay in the table only
        pts = [p for p in points if p.op == op and p.size_bytes > 0]
        if not pts:
            continue
        ax.plot(
            [p.size_bytes for p in pts],
            [p.measured_s * 1e6 for p in pts],
            "o",
            color=color,
            label=f"{op} measured",
        )
        grid = np.geomspace(min(p.size_bytes for p in pts), max(p.size_bytes for p in pts), 64)
        ax.plot(
            grid,
            [cost(op, float(s), group).time_s * 1e6 for s in grid],
            "-",
            color=color,
            label=f"{op} simulated",
        )
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_xlabel("size (bytes)")
    ax.set_ylabel("time (us)")
    ax.set_title(title or f"measured vs simulated on {topology.name}")
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=7, ncol=2)
    out = Path(path)
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=110, bbox_inches="tight")
    return out
