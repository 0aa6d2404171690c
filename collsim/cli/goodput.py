"""``collsim goodput SCENARIO``: how much a long run really trains, given failures and checkpoints.

The step is simulated as ``collsim run`` does (step time, tokens per step); the scenario's
``reliability`` section gives failure rates, restart costs, spares and checkpointing. The report
sets the closed form (exact renewal ratio, Young / Daly intervals) beside a seeded Monte Carlo
of the job's timeline, with its 5th and 95th percentiles. Exit codes: 0 ok; 1 the plan is
infeasible; 2 bad input (one line naming the key); 3 a needed part is not available.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import TYPE_CHECKING, Any

import click

from collsim.cli.common import (
    DEFAULT_DAYS,
    OneLineCommand,
    check_output_path,
    format_duration,
    format_tokens,
    scenario_costs,
)
from collsim.errors import ConfigError

if TYPE_CHECKING:
    from collsim.scenario import Scenario
    from collsim.study.goodput.estimate import GoodputResult, Spread
    from collsim.topology import Topology

__all__ = ["goodput", "goodput_scenario", "format_goodput_report"]

_EPILOG = """\b
Examples:
  collsim goodput tests/goodput/data/goodput_gpt3_175b_1024.yaml
  collsim goodput SCENARIO --days 54 --runs 2000 --seed 1 --json goodput.json
  collsim goodput SCENARIO --set reliability.checkpoint.interval_s=600 --plot goodput.png

Exit status: 0 done, 1 the plan is infeasible, 2 bad input.
"""

#: Monte Carlo runs when ``--runs`` is not given.
DEFAULT_RUNS = 1000
#: Run length when neither ``--days`` nor ``reliability.duration_days`` is given (issue 14).
PLOT_SUFFIXES = (".png", ".svg")


@click.command(name="goodput", epilog=_EPILOG, cls=OneLineCommand)
@click.argument("scenario", type=click.Path(dir_okay=False, path_type=Path))
@click.option(
    "--days",
    type=click.FloatRange(min=0.0, min_open=True),
    default=None,
    help="Length of the run (default: reliability.duration_days, else 30).",
)
@click.option(
    "--json",
    "json_path",
    type=click.Path(dir_okay=False, path_type=Path),
    help="Write the result as JSON to this file.",
)
@click.option(
    "--plot",
    "plot_path",
    type=click.Path(dir_okay=False, path_type=Path),
    help="Draw goodput against the checkpoint interval and one sampled timeline (.png/.svg).",
)
@click.option("--seed", type=int, default=0, show_default=True, help="Monte Carlo seed.")
@click.option(
    "--runs",
    type=click.IntRange(min=1),
    default=DEFAULT_RUNS,
    show_default=True,
    help="Monte Carlo runs.",
)
@click.option(
    "--set",
    "overrides",
    multiple=True,
    metavar="KEY.PATH=VALUE",
    help="Override a scenario key (value read as YAML). Repeatable.",
)
def goodput(
    scenario: Path,
    days: float | None,
    json_path: Path | None,
    plot_path: Path | None,
    seed: int,
    runs: int,
    overrides: tuple[str, ...],
) -> None:
    """Expected interruptions, effective training time and goodput of SCENARIO over a run."""
    goodput_scenario(
        scenario,
        overrides,
        days=days,
        json_path=json_path,
        plot_path=plot_path,
        seed=seed,
        runs=runs,
    )


def goodput_scenario(
    path: Path,
    overrides: tuple[str, ...] | list[str] = (),
    *,
    days: float | None = None,
    json_path: Path | None = None,
    plot_path: Path | None = None,
    seed: int = 0,
    runs: int = DEFAULT_RUNS,
) -> int:
    """The body of ``collsim goodput``; returns 0 (errors raise: ConfigError exit 2,
    InfeasibleError exit 1, mapped once by the command group)."""
    # start-up: loaded only when this runs (--help and bad input stay fast)
    from collsim.cli.run import _load_topology, _simulate_capturing

    if plot_path is not None and Path(plot_path).suffix.lower() not in PLOT_SUFFIXES:
        raise ConfigError(
            f"the image must end in .png or .svg, got {Path(plot_path).name!r}",
            key_path="--plot",
        )
    check_output_path(json_path, "--json")
    check_output_path(plot_path, "--plot")
    # start-up: loaded only when this runs (--help and bad input stay fast)
    from collsim.scenario import load_scenario

    scenario = load_scenario(path, list(overrides))
    if scenario.reliability is None:
        raise ConfigError(
            "missing required section (collsim goodput needs it)",
            key_path="reliability",
            file=str(path),
        )
    topology = _load_topology(scenario)
    result, caught = _simulate_capturing(scenario, topology, all_ranks=False, trace=False)
    costs = scenario_costs(scenario, topology, result)
    run_days = days or scenario.reliability.duration_days or DEFAULT_DAYS
    # start-up: loaded only when this runs (--help and bad input stay fast)
    from collsim.study.goodput.estimate import estimate_goodput

    estimate = estimate_goodput(costs, scenario.reliability, days=run_days, runs=runs, seed=seed)

    click.echo(format_goodput_report(estimate, scenario, topology))
    for w in caught:
        click.echo(f"warning: {' '.join(str(w.message).split())}", err=True)
    for message in estimate.warnings:
        click.echo(f"warning: {message}", err=True)
    if not result.fits:
        click.echo("warning: the plan does not fit in memory (collsim run says more)", err=True)
    if json_path is not None:
        data = estimate.to_dict()
        data["scenario"] = scenario.name
        _write_json(json_path, data)
        click.echo(f"wrote {json_path}", err=True)
    if plot_path is not None:
        # start-up: loaded only when this runs (--help and bad input stay fast)
        from collsim.report.goodput_plots import plot_goodput
        from collsim.report.plots import save_figure

        fig = plot_goodput(estimate, title=f"{scenario.name}: {run_days:g} days")
        save_figure(fig, plot_path)
        click.echo(f"wrote {plot_path}", err=True)
    return 0


# -- text ----------------------------------------------------------------------------------------


def _bytes(value: float) -> str:
    for scale, unit in ((1e12, "TB"), (1e9, "GB"), (1e6, "MB")):
        if abs(value) >= scale:
            return f"{value / scale:.3g} {unit}"
    return f"{value:,.0f} B"


def format_goodput_report(result: GoodputResult, scenario: Scenario, topology: Topology) -> str:
    """The text report of ``collsim goodput``."""
    # start-up: loaded only when this runs (--help and bad input stay fast)
    from collsim.report.tables import format_table

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
        f"of {c.tokens_per_step:,.0f} tokens: "
        f"{format_tokens(c.tokens_per_s * 86400)} tokens per day"
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
        ["goodput, tokens per day", format_tokens(cf.goodput_tokens_per_day)]
        + _spread(mc.goodput_tokens_per_day if mc else None, format_tokens),
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


def _write_json(path: Path, data: dict[str, Any]) -> None:
    try:
        with Path(path).open("w", encoding="utf-8") as handle:
            json.dump(data, handle, indent=2, default=str)
            handle.write("\n")
    except OSError as exc:
        raise click.FileError(str(path), hint=exc.strerror) from None
