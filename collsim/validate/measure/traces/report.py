"""The text `collsim validate trace` prints for a set of traces: what was read, the steps found,
each op kind's kernels, busy and exclusive time per step and share of the step, the collectives
by name and size, the idle time, and the names no rule classified."""

from __future__ import annotations

from collections import defaultdict

from collsim.validate.data.kineto import Trace
from collsim.validate.measure.traces.breakdown import IDLE, Summary

__all__ = ["format_summary", "classified_share"]


def _size(size_bytes: int | None) -> str:
    if size_bytes is None:
        return "?"
    for unit, scale in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if size_bytes >= scale:
            return f"{size_bytes / scale:.2f} {unit}"
    return f"{size_bytes} B"


def classified_share(summary: Summary) -> tuple[int, float, float]:
    """(kernels or ops per step, share of them classified by count, by busy time)."""
    count = summary.mean("count")
    busy = summary.mean("busy_s")
    total = sum(count.values())
    total_s = sum(busy.values())
    known = total - count.get("unclassified", 0.0)
    known_s = total_s - busy.get("unclassified", 0.0)
    return round(total), known / total if total else 1.0, known_s / total_s if total_s else 1.0


def format_summary(traces: list[Trace], summary: Summary, *, top: int = 8) -> str:
    lines: list[str] = []
    first = traces[0]
    where = "GPU" if first.on_gpu else "CPU-only"
    devices = sorted({d for t in traces for d in t.devices if d})
    world = f" of world size {first.world_size}" if first.world_size else ""
    backend = f", {first.backend}" if first.backend else ""
    ranks = ", ".join(t.label for t in traces)
    lines.append(
        f"# {len(traces)} trace(s): {ranks}{world}{backend}; {where}"
        + (f" ({', '.join(devices)})" if devices else "")
    )
    per_rank: dict[str, list[str]] = defaultdict(list)
    for b in summary.steps:
        per_rank[b.rank].append(f"{b.step.removeprefix('ProfilerStep')} {b.step_s * 1e3:.2f}")
    for rank, found in per_rank.items():
        lines.append(f"# steps found, {rank} (ms): {', '.join(found)}")
    span = "first kernel to the next step's first kernel" if first.on_gpu else "host annotation"
    lines.append(
        f"# per step, mean over {len(summary.steps)} step(s) of all ranks; the step's span: {span}"
    )
    busy = summary.mean("busy_s")
    excl = summary.mean("exclusive_s")
    count = summary.mean("count")
    step_s = summary.step_s
    unit = "kernels" if first.on_gpu else "ops"
    lines.append(
        f"{'kind':<14} {unit + '/step':>12} {'busy ms':>10} {'exclusive ms':>13} {'share':>7}"
    )
    for kind in summary.kinds():
        lines.append(
            f"{kind:<14} {count.get(kind, 0.0):>12.0f} "
            f"{busy.get(kind, 0.0) * 1e3:>10.3f} {excl.get(kind, 0.0) * 1e3:>13.3f} "
            f"{excl.get(kind, 0.0) / step_s:>7.1%}"
        )
    total = sum(excl.values())
    lines.append(
        f"{'sum':<14} {sum(count.values()):>12.0f} {sum(busy.values()) * 1e3:>10.3f} "
        f"{total * 1e3:>13.3f} {total / step_s:>7.1%}  (step {step_s * 1e3:.3f} ms, "
        f"{(total - step_s) / step_s:+.2%})"
    )
    n, by_count, by_time = classified_share(summary)
    lines.append(
        f"# {n} {unit} per step, classified: {by_count:.1%} by count, {by_time:.1%} by time; "
        f"idle {excl.get(IDLE, 0.0) * 1e3:.3f} ms ({excl.get(IDLE, 0.0) / step_s:.1%})"
    )
    comms = summary.comm_table()
    if comms:
        lines.append("# communication per step, by collective and size (busy time)")
        lines.append(f"{'collective':<16} {'size':>11} {'group':>6} {'calls':>6} {'ms':>10}")
        for name, size, group, calls, time_s in comms[: max(top, 1) * 2]:
            ranks = "?" if group is None else str(group)
            lines.append(
                f"{name:<16} {_size(size):>11} {ranks:>6} {calls:>6} {time_s * 1e3:>10.3f}"
            )
        if len(comms) > 2 * max(top, 1):
            lines.append(f"# ... {len(comms) - 2 * max(top, 1)} more (collective, size) rows")
    unknown = summary.unclassified()
    if unknown:
        lines.append(
            f"# unclassified: {len(unknown)} name(s), {busy.get('unclassified', 0.0) * 1e3:.3f} "
            f"ms per step; the largest:"
        )
        for name, time_s in unknown[:top]:
            lines.append(f"#   {time_s * 1e3:9.3f} ms  {name[:100]}")
    return "\n".join(lines)
