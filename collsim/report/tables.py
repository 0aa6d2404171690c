"""Plain-text tables and the text report of one simulated training step.

Everything here returns strings and stays under 100 columns; the CLI decides where they go.
No pandas or matplotlib: ``collsim run`` imports this module and must start fast.

Example::

    print(format_table(["op", "time"], [["all_reduce", "1.2 ms"]], align="lr"))
"""

from __future__ import annotations

import math
import textwrap
from collections.abc import Sequence

from collsim.core.units import GB, GiB, format_size
from collsim.step.result import BREAKDOWN_KEYS, MEMORY_KEYS, CollectiveStat, StepResult

__all__ = [
    "format_table",
    "format_seconds",
    "format_gib",
    "format_size_binary",
    "format_bandwidth",
    "format_percent",
    "format_count",
    "breakdown_table",
    "memory_table",
    "collectives_table",
    "merge_collectives",
    "memory_verdict",
    "format_run_report",
    "BREAKDOWN_LABELS",
]

#: How each part of the step time is called in the report.
BREAKDOWN_LABELS: dict[str, str] = {
    "compute": "compute",
    "tp_exposed": "exposed TP comm",
    "pp_exposed": "exposed PP comm",
    "dp_exposed": "exposed DP comm",
    "ep_exposed": "exposed EP comm",
    "cp_exposed": "exposed CP comm",
    "bubble": "pipeline bubble",
    "framework": "framework",
    "interference": "comm interference",
    "optimizer": "optimizer",
}

#: Widest line the report aims for (80-100 column terminals).
_WIDTH = 96

#: Parts that may differ from the step time by this relative amount before "other" is shown.
_BREAKDOWN_SLACK = 1e-3


def format_table(
    headers: Sequence[str],
    rows: Sequence[Sequence[str]],
    *,
    align: str | None = None,
    indent: int = 2,
    gap: int = 2,
) -> str:
    """Columns padded to their widest cell, a dashed rule under the header.

    Args:
        headers: column titles.
        rows: cells as strings, one sequence per row, as many cells as headers.
        align: one letter per column, ``l`` or ``r``; default left for the first, right after.
        indent: spaces before every line.
        gap: spaces between columns.

    Returns:
        The table, lines joined with newlines, no trailing newline.
    """
    ncols = len(headers)
    if align is None:
        align = "l" + "r" * (ncols - 1)
    if len(align) != ncols:
        raise ValueError(f"align has {len(align)} letters for {ncols} columns")
    for row in rows:
        if len(row) != ncols:
            raise ValueError(f"row {list(row)!r} has {len(row)} cells, expected {ncols}")
    widths = [max([len(h)] + [len(r[i]) for r in rows]) for i, h in enumerate(headers)]

    def line(cells: Sequence[str]) -> str:
        parts = [c.ljust(w) if a == "l" else c.rjust(w) for c, w, a in zip(cells, widths, align)]
        return (" " * indent + (" " * gap).join(parts)).rstrip()

    rule = " " * indent + (" " * gap).join("-" * w for w in widths)
    return "\n".join([line(headers), rule] + [line(r) for r in rows])


def format_seconds(time_s: float) -> str:
    """Four significant figures in s, ms, us or ns: ``1.500 s``, ``123.4 ms``, ``56.00 us``."""
    if time_s == 0:
        return "0 s"
    if not math.isfinite(time_s):
        return f"{time_s} s"
    rounded = float(f"{time_s:.4g}")  # so that 999.99 ms is shown as 1.000 s
    for scale, unit in ((1.0, "s"), (1e-3, "ms"), (1e-6, "us"), (1e-9, "ns")):
        if abs(rounded) >= scale or unit == "ns":
            value = rounded / scale
            digits = max(0, 3 - int(math.floor(math.log10(abs(value)))))
            return f"{value:.{digits}f} {unit}"
    raise AssertionError("unreachable")


def format_gib(size_bytes: float) -> str:
    """Bytes as GiB with two decimals: ``format_gib(3 * 2**30) == '3.00'``."""
    return f"{size_bytes / GiB:.2f}"


def format_size_binary(size_bytes: float) -> str:
    """Binary size as nccl-tests prints it on the command line: ``512 KiB``, ``1.5 GiB``."""
    return format_size(size_bytes)


def format_bandwidth(bandwidth_bps: float) -> str:
    """Decimal GB/s, as nccl-tests prints busbw: ``format_bandwidth(232e9) == '232.0'``."""
    return f"{bandwidth_bps / GB:.1f}"


def format_percent(fraction: float) -> str:
    """``0.4812`` -> ``48.1 %``."""
    return f"{100.0 * fraction:.1f} %"


def format_count(value: float) -> str:
    """Thousands separated, no decimals: ``254823.7`` -> ``254,824``."""
    return f"{value:,.0f}"


def breakdown_table(result: StepResult) -> str:
    """Parts of the step time with their share of it; a total row; ``other`` if they fall short."""
    step = result.step_time_s
    rows: list[list[str]] = []
    total = 0.0
    names = list(BREAKDOWN_KEYS) + [k for k in result.breakdown_s if k not in BREAKDOWN_KEYS]
    for key in names:
        value = float(result.breakdown_s.get(key, 0.0))
        total += value
        rows.append([BREAKDOWN_LABELS.get(key, key), format_seconds(value), _share(value, step)])
    if step > 0 and abs(step - total) > _BREAKDOWN_SLACK * step:
        rows.append(
            ["other (unaccounted)", format_seconds(step - total), _share(step - total, step)]
        )
    rows.append(["step time", format_seconds(step), _share(step, step)])
    return format_table(["time per step", "time", "share"], rows)


def memory_table(result: StepResult) -> str:
    """Memory of the most loaded GPU at its peak, by category, in GiB and as a share of HBM."""
    capacity = result.memory_capacity_bytes
    rows: list[list[str]] = []
    names = list(MEMORY_KEYS) + [k for k in result.memory_bytes if k not in MEMORY_KEYS]
    for key in names:
        value = float(result.memory_bytes.get(key, 0.0))
        rows.append([key, format_gib(value), _share(value, capacity)])
    rows.append(
        ["peak", format_gib(result.memory_peak_bytes), _share(result.memory_peak_bytes, capacity)]
    )
    reserved = result.memory_reserved_bytes
    if reserved is not None and result.fits:  # out of memory: no peak to compare
        frag = reserved - result.memory_peak_bytes
        rows.append(["peak reserved", format_gib(reserved), _share(reserved, capacity)])
        rows.append(["fragmentation", format_gib(frag), _share(frag, capacity)])
    rows.append(["HBM capacity", format_gib(capacity), _share(capacity, capacity)])
    return format_table(["memory per GPU (at peak)", "GiB", "of HBM"], rows)


def merge_collectives(stats: Sequence[CollectiveStat]) -> list[CollectiveStat]:
    """One row per (axis, op, algorithm, group size), in first-seen order.

    The engine keeps one record per distinct message size (a bucket, a unit); the text report
    merges them. Counts, bytes and link times add; ``size_bytes`` becomes the mean size of a
    call; ``busbw_bps`` becomes factor x total bytes / total time, i.e. the time-weighted mean
    of the calls' bus bandwidths (busbw_i x time_i = factor x bytes_i, nccl-tests convention).
    """
    merged: dict[tuple[str, str, str, int], list[CollectiveStat]] = {}
    for stat in stats:
        merged.setdefault((stat.axis, stat.op, stat.algorithm, stat.group_size), []).append(stat)
    out: list[CollectiveStat] = []
    for (axis, op, algorithm, group_size), group in merged.items():
        count = sum(s.count for s in group)
        total_bytes = sum(s.total_bytes for s in group)
        time_s = sum(s.time_s for s in group)
        busbw = (
            sum(s.busbw_bps * s.time_s for s in group) / time_s
            if time_s > 0
            else max(s.busbw_bps for s in group)
        )
        out.append(
            CollectiveStat(
                axis=axis,
                op=op,
                algorithm=algorithm,
                group_size=group_size,
                count=count,
                size_bytes=total_bytes / count if count else 0.0,
                time_s=time_s,
                busbw_bps=busbw,
            )
        )
    return out


def collectives_table(stats: Sequence[CollectiveStat]) -> str:
    """One row per kind of collective on one rank per step (nccl-tests units).

    Records of the same axis, op, algorithm and group size are merged (:func:`merge_collectives`):
    ``size`` is the mean nccl-tests size of one call, ``total`` the bytes of all calls, ``time``
    the total link time of all calls (not the exposed time), ``busbw`` in GB/s.
    """
    rows = [
        [
            s.axis,
            s.op,
            s.algorithm,
            str(s.group_size),
            format_count(s.count),
            format_size_binary(s.size_bytes),
            format_size_binary(s.total_bytes),
            format_seconds(s.time_s),
            format_bandwidth(s.busbw_bps),
        ]
        for s in merge_collectives(stats)
    ]
    return format_table(
        [
            "axis",
            "op",
            "algorithm",
            "ranks",
            "calls",
            "size/call",
            "total",
            "link time",
            "busbw GB/s",
        ],
        rows,
        align="lllrrrrrr",
    )


def memory_verdict(result: StepResult) -> str:
    """``fits: 35.20 GiB of 74.51 GiB`` or ``does not fit: 104.31 GiB needed of 74.51 GiB``;
    with the caching allocator replayed, the reserved memory against what it may hold."""
    alloc = result.allocator
    if alloc is not None and result.memory_reserved_bytes is not None:
        allocated = format_gib(result.memory_peak_bytes)
        limit = format_gib(float(alloc["limit_bytes"]))
        mode = " (expandable)" if alloc["expandable_segments"] else ""
        if result.fits:
            reserved = format_gib(result.memory_reserved_bytes)
            return f"fits: {reserved} GiB reserved, {allocated} allocated, of {limit} GiB{mode}"
        return f"does not fit: {allocated} GiB allocated, out of memory in {limit} GiB"
    needed = format_gib(result.memory_peak_bytes)
    capacity = format_gib(result.memory_capacity_bytes)
    reserve = float(result.memory_reserve_bytes)
    usable = f" usable ({format_gib(reserve)} GiB reserved)" if reserve > 0 else ""
    if result.fits:
        return f"fits: {needed} GiB of {capacity} GiB{usable}"
    return f"does not fit: {needed} GiB needed of {capacity} GiB{usable}"


def format_run_report(
    result: StepResult,
    *,
    title: str = "",
    context: Sequence[tuple[str, str]] = (),
    max_mapping_lines: int = 8,
) -> str:
    """The text report of ``collsim run``.

    Args:
        result: the simulated step.
        title: first line (scenario name).
        context: (label, text) lines printed under the title: model, cluster, plan.
        max_mapping_lines: lines of the rank mapping to show before eliding the rest.

    Returns:
        The report, no trailing newline; every line under 100 columns for usual inputs.
    """
    out: list[str] = []
    if title:
        out += [title, "=" * min(len(title), _WIDTH)]
    if context:
        width = max(len(label) for label, _ in context)
        out += [f"{label.ljust(width)}  {text}" for label, text in context]
    if out:
        out.append("")

    gpus = result.num_gpus
    per_gpu = f"  ({format_count(result.tokens_per_s / gpus)} per GPU)" if gpus else ""
    summary = [
        ("step time", format_seconds(result.step_time_s)),
        ("tokens/s", format_count(result.tokens_per_s) + per_gpu),
        (
            "model TFLOP/s per GPU",
            f"{result.model_tflops_per_gpu:.1f}   MFU {format_percent(result.mfu)}",
        ),
        (
            "hardware TFLOP/s per GPU",
            f"{result.hardware_tflops_per_gpu:.1f}   HFU {format_percent(result.hfu)}",
        ),
        ("memory", memory_verdict(result)),
    ]
    width = max(len(label) for label, _ in summary)
    out += [f"{label.ljust(width)}  {text}" for label, text in summary]

    out += ["", breakdown_table(result)]
    effects = result.contention or []
    if effects:
        first = effects[0]
        closed_s = float(first.closed_s or 0.0)
        gap = float(first.des_s or 0.0) - closed_s
        out.append(
            f"  link sharing adds {format_seconds(gap)} to the closed form's "
            f"{format_seconds(closed_s)}:"
        )
        for eff in effects:
            names = [str(n) for n in eff.links]
            more = f" and {len(names) - 3} more" if len(names) > 3 else ""
            listed = ", ".join(names[:3]) + more
            out.append(
                f"    {eff.axis:<3} {format_seconds(float(eff.delta_s)):>10}"
                f"  (shared: {listed or 'none found by a ring step'})"
            )
    out += ["", memory_table(result)]
    if result.collectives:
        out += [
            "",
            "collectives per rank per step (link time of all calls, not exposed time)",
            collectives_table(result.collectives),
        ]
    if result.mapping:
        lines = result.mapping.rstrip("\n").splitlines()
        shown = lines[:max_mapping_lines]
        out += ["", "rank mapping"]
        for line in shown:
            out += textwrap.wrap(
                line, width=_WIDTH, initial_indent="  ", subsequent_indent="      "
            ) or [""]
        hidden = len(lines) - len(shown)
        if hidden:
            out.append(f"  ... ({hidden} more line{'s' if hidden > 1 else ''} in --json 'mapping')")
    return "\n".join(out)


def _share(value: float, whole: float) -> str:
    return format_percent(value / whole) if whole > 0 else "-"
