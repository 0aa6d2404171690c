"""The text of a goodput study: ``collsim goodput``'s report, its table of the plan at the
published fleet failure rates and ``collsim run``'s goodput line, from a
:class:`~collsim.study.goodput.estimate.GoodputResult` and its scenario; memory sizes in binary
units (GiB = 2**30 bytes), token counts with their scale written out (``85.99 billion``)."""

from __future__ import annotations

import math
from typing import TYPE_CHECKING, Any

from collsim.report.tables import format_table

if TYPE_CHECKING:
    from collsim.study.goodput.estimate import GoodputResult, Spread
    from collsim.study.goodput.fleets import Fleet
    from collsim.study.scenario import Scenario

__all__ = ["format_duration", "format_goodput_report", "format_fleet_table", "one_line"]


def format_duration(time_s: float) -> str:
    """Seconds as s, min, h or days with three significant figures."""
    if not math.isfinite(time_s):
        return "inf"
    for scale, unit in ((86400.0, "d"), (3600.0, "h"), (60.0, "min")):
        if abs(time_s) >= 2 * scale:
            return f"{time_s / scale:.3g} {unit}"
    return f"{time_s:.3g} s"


def _tokens(value: float) -> str:
    """A token count with its scale written out (``85.99 billion``): a bare ``B`` would read
    as bytes."""
    for scale, unit in ((1e12, "trillion"), (1e9, "billion"), (1e6, "million")):
        if abs(value) >= scale:
            return f"{value / scale:.4g} {unit}"
    return f"{value:,.0f}"


def _bytes(value: float) -> str:
    """A memory size in binary units, as the README states (GiB = 2**30 bytes)."""
    for scale, unit in ((2.0**40, "TiB"), (2.0**30, "GiB"), (2.0**20, "MiB")):
        if abs(value) >= scale:
            return f"{value / scale:.3g} {unit}"
    return f"{value:,.0f} B"


def format_goodput_report(result: GoodputResult, scenario: Scenario) -> str:
    """The text report of ``collsim goodput``."""

    title = f"collsim goodput: {scenario.name} ({result.days:g} days)"
    lines = [title, "=" * len(title), *_setting_lines(result, scenario), ""]
    lines.append(
        format_table(
            ["over the run", "closed form", "MC mean", "MC 5th pct", "MC 95th pct"],
            _outcome_rows(result, scenario),
            align="lrrrr",
        )
    )
    b, mc = result.best_interval, result.monte_carlo
    if b is not None and mc is not None:
        lines.append("")
        lines.append(
            f"best interval  exact {format_duration(b.closed_form_s)}, Daly (higher order) "
            f"{format_duration(b.daly_s)}, Young (first order) {format_duration(b.young_s)}"
        )
        lines.append(
            f"               Monte Carlo {format_duration(b.monte_carlo_s)}, bootstrap 95 % CI "
            f"{format_duration(b.ci95_low_s)} - {format_duration(b.ci95_high_s)} "
            f"({mc.runs} runs, seed {mc.seed})"
        )
    return "\n".join(lines)


def _setting_lines(result: GoodputResult, scenario: Scenario) -> list[str]:
    """The job, its failure rate, checkpoint, recovery and checkpoint interval, one line each."""
    c = result.costs
    rel = scenario.reliability
    gpus = scenario.parallel.world_size
    lines = [
        f"job          {c.num_nodes} nodes, {gpus:,} GPUs; step {format_duration(c.step_time_s)} "
        f"of {c.tokens_per_step:,.0f} tokens: {_tokens(c.tokens_per_s * 86400)} tokens per day"
    ]
    if rel is not None:
        total = sum(x.per_1000_node_days for x in rel.components) or 1.0
        shares = ", ".join(
            f"{x.name} {100 * x.per_1000_node_days / total:.0f} %" for x in rel.components
        )
        lines.append(
            f"failures     {c.failure_rate_per_s * 86400:.3g} per day (job MTBF "
            f"{format_duration(c.mtbf_s)}): {shares}"
        )
    if c.state is not None and rel is not None:
        mode = "sharded" if rel.checkpoint.sharded else "one writer"
        sync = "async, snapshot" if rel.checkpoint.asynchronous else "sync"
        lines.append(
            f"checkpoint   {_bytes(c.state.total_bytes)} ({_bytes(c.state.max_rank_bytes)} per "
            f"GPU, {mode}); write {format_duration(c.write_s)}, stall "
            f"{format_duration(c.stall_s)} ({sync}); load {format_duration(c.load_s)}"
        )
    lines.append(
        f"recovery     detection {format_duration(c.detection_s)} + restart "
        f"{format_duration(c.restart_s)} (incl. load and warm-up)"
    )
    source = "from the scenario" if result.interval_source == "scenario" else "auto: optimum"
    lines.append(f"interval     {format_duration(result.interval_s)} of training ({source})")
    return lines


def _spread(s: Spread | None, fmt: Any) -> list[str]:
    if s is None:
        return ["-", "-", "-"]
    return [fmt(s.mean), fmt(s.p5), fmt(s.p95)]


def _count(v: float) -> str:
    return f"{v:,.1f}"


def _ratio(v: float) -> str:
    return f"{v:.4f}"


def _outcome_rows(result: GoodputResult, scenario: Scenario) -> list[list[str]]:
    """Each outcome over the run: the closed form's expectation, then the Monte Carlo mean,
    5th and 95th percentiles ("-" without a Monte Carlo run)."""
    cf, mc = result.closed_form, result.monte_carlo
    rel = scenario.reliability
    rows = [
        ["interruptions", _count(cf.interruptions)]
        + _spread(mc.interruptions if mc else None, _count),
        ["  struck during a recovery", _count(cf.interruptions_in_recovery)]
        + _spread(mc.interruptions_in_recovery if mc else None, _count),
        ["effective training time ratio", _ratio(cf.effective_training_time_ratio)]
        + _spread(mc.effective_training_time_ratio if mc else None, _ratio),
        ["goodput, tokens per day", _tokens(cf.goodput_tokens_per_day)]
        + _spread(mc.goodput_tokens_per_day if mc else None, _tokens),
        ["training lost to rollbacks", format_duration(cf.lost_s)]
        + _spread(mc.lost_s if mc else None, format_duration),
        ["time checkpointing", format_duration(cf.checkpointing_s)]
        + _spread(mc.checkpointing_s if mc else None, format_duration),
        ["time recovering", format_duration(cf.recovering_s)]
        + _spread(mc.recovering_s if mc else None, format_duration),
    ]
    if mc is not None and rel is not None and rel.spares.nodes is not None:
        rows.append(
            ["waiting for spares (MC only)", "-"] + _spread(mc.spare_wait_s, format_duration)
        )
    return rows


def one_line(result: GoodputResult) -> str:
    """``collsim run``'s goodput line: the closed form's expectations (ETTR = effective training
    time ratio)."""
    cf = result.closed_form
    return (
        f"goodput      {_tokens(cf.goodput_tokens_per_day)} tokens per day, ETTR "
        f"{cf.effective_training_time_ratio:.3f}, {cf.interruptions:,.1f} interruptions in "
        f"{result.days:g} days, checkpoint every {format_duration(result.interval_s)}"
    )


def format_fleet_table(outcomes: list[tuple[str, Fleet, GoodputResult]]) -> str:
    """The plan at each fleet's failure rate: interruptions and effective training time (the
    run's length times the effective training time ratio), closed form and Monte Carlo mean
    with its 5th-95th percentile band."""

    def band(s: Spread | None, fmt: Any, scale: float = 1.0) -> str:
        if s is None:
            return "-"
        return f"{fmt(s.mean * scale)} ({fmt(s.p5 * scale)} - {fmt(s.p95 * scale)})"

    def day(v: float) -> str:
        return f"{v:.2f} d"

    rows = []
    for level, fleet, out in outcomes:
        cf, mc = out.closed_form, out.monte_carlo
        rows.append(
            [
                level,
                fleet.label,
                f"{fleet.per_1000_node_days:.2f}",
                _count(cf.interruptions),
                band(mc.interruptions if mc else None, _count),
                day(cf.effective_training_time_ratio * out.days),
                band(mc.effective_training_time_ratio if mc else None, day, scale=out.days),
            ]
        )
    title = "at the published fleet failure rates (collsim/data/fleet_failure_rates.yaml)"
    return "\n".join(
        [
            title,
            format_table(
                [
                    "rate",
                    "fleet",
                    "per 1,000 node-days",
                    "interruptions",
                    "MC mean (5th - 95th)",
                    "effective training",
                    "MC mean (5th - 95th)",
                ],
                rows,
                align="llrrrrr",
            ),
        ]
    )
