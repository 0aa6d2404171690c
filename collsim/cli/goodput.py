"""``collsim goodput SCENARIO``: how much a long run really trains, given failures and checkpoints.

The step is simulated as ``collsim run`` does (step time, tokens per step); the scenario's
``reliability`` section gives failure rates, restart costs, spares and checkpointing. The report
sets the closed form (exact renewal ratio, Young / Daly intervals) beside a seeded Monte Carlo
of the job's timeline, with its 5th and 95th percentiles. The fleet's failure rate matters most
and published fleets differ about 3x: unless ``--fleet`` picks one, the report adds the outcome
at the lowest, the middle and the highest published rate (:mod:`collsim.study.goodput.fleets`),
each with its Monte Carlo band. Memory sizes are in GiB / TiB (2**30 / 2**40 bytes), token counts
with their scale written out (``85.99 billion``). Exit codes: 0 ok; 1 the plan is infeasible or
does not fit in memory (after the report); 2 bad input (one line naming the key); 3 a needed
part is not available.
"""

from __future__ import annotations

import dataclasses
import json
import math
from pathlib import Path
from typing import TYPE_CHECKING, Any

import click

from collsim.cli.common import OneLineCommand, check_output_path
from collsim.errors import ConfigError

if TYPE_CHECKING:
    from collsim.scenario import Scenario
    from collsim.schedule.result import StepResult
    from collsim.study.goodput.costs import JobCosts
    from collsim.study.goodput.estimate import GoodputResult, Spread
    from collsim.topology import Topology

__all__ = ["goodput", "goodput_scenario", "scenario_costs", "format_goodput_report", "one_line"]

_EPILOG = """\b
Examples:
  collsim goodput tests/goodput/data/goodput_gpt3_175b_1024.yaml
  collsim goodput SCENARIO --days 54 --runs 2000 --seed 1 --json goodput.json
  collsim goodput SCENARIO --set reliability.checkpoint.interval_s=600 --plot goodput.png
  collsim goodput SCENARIO --fleet meta_rsc2

Exit status: 0 done, 1 the plan is infeasible, 2 bad input.
"""

#: Monte Carlo runs when ``--runs`` is not given.
DEFAULT_RUNS = 1000
#: The most Monte Carlo runs ``--runs`` takes: the samples of every run are held at once, and
#: 1,000,000 runs of the 16,384-GPU Llama 3 scenario (about 720 interruptions each) took 49 s
#: and 6.8 GB (issue 27); this bound keeps such a run under about 0.7 GB per rate.
MAX_RUNS = 100_000
#: Run length when neither ``--days`` nor ``reliability.duration_days`` is given (issue 14).
DEFAULT_DAYS = 30.0
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
@click.option(
    "--seed",
    type=click.IntRange(min=0),
    default=0,
    show_default=True,
    help="Monte Carlo seed (>= 0).",
)
@click.option(
    "--runs",
    type=click.IntRange(min=1, max=MAX_RUNS),
    default=DEFAULT_RUNS,
    show_default=True,
    help=f"Monte Carlo runs (at most {MAX_RUNS:,}).",
)
@click.option(
    "--fleet",
    metavar="NAME|FILE",
    help="Put the plan at one fleet's failure rate (meta_rsc2, meta_rsc1, crusoe_h200, or a "
    "YAML file of fleets: NAME: {per_1000_node_days: X}); default: the scenario's rate, and "
    "the outcome at the low, central and high published rates.",
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
    fleet: str | None,
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
        fleet=fleet,
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
    fleet: str | None = None,
) -> int:
    """The body of ``collsim goodput``; returns 0 (errors raise: ConfigError exit 2,
    InfeasibleError exit 1, mapped once by the command group)."""
    from collsim.cli.run import _load_topology, _simulate_capturing
    from collsim.study.goodput.fleets import find_fleets, published_fleets

    if not 1 <= runs <= MAX_RUNS:
        raise ConfigError(f"must be 1-{MAX_RUNS:,}, got {runs:,}", key_path="--runs")
    if seed < 0:
        raise ConfigError(f"must be >= 0, got {seed}", key_path="--seed")
    fleets = find_fleets(fleet) if fleet is not None else published_fleets()

    if plot_path is not None and Path(plot_path).suffix.lower() not in PLOT_SUFFIXES:
        raise ConfigError(
            f"the image must end in .png or .svg, got {Path(plot_path).name!r}",
            key_path="--plot",
        )
    check_output_path(json_path, "--json")
    check_output_path(plot_path, "--plot")
    from collsim.scenario import load_scenario

    scenario = load_scenario(path, list(overrides))
    if scenario.reliability is None:
        raise ConfigError(
            "missing required section (collsim goodput needs it)",
            key_path="reliability",
            file=str(path),
        )
    if len(fleets) == 1:
        from collsim.study.goodput.fleets import at_rate

        rel = at_rate(scenario.reliability, fleets[0].per_1000_node_days)
        scenario = dataclasses.replace(scenario, reliability=rel)
    topology = _load_topology(scenario)
    result, caught = _simulate_capturing(scenario, topology, all_ranks=False, trace=False)
    costs = scenario_costs(scenario, topology, result)
    reliability = scenario.reliability
    if reliability is None:  # pragma: no cover - checked above, kept by the replace
        raise ConfigError("missing required section", key_path="reliability")
    run_days = days or reliability.duration_days or DEFAULT_DAYS
    from collsim.study.goodput.estimate import estimate_goodput

    estimate = estimate_goodput(costs, reliability, days=run_days, runs=runs, seed=seed)
    at_fleets = (
        _fleet_outcomes(fleets, scenario, topology, result, days=run_days, runs=runs, seed=seed)
        if len(fleets) > 1
        else []
    )

    click.echo(format_goodput_report(estimate, scenario, topology))
    if at_fleets:
        click.echo("")
        click.echo(format_fleet_table(at_fleets))
    for w in caught:
        click.echo(f"warning: {' '.join(str(w.message).split())}", err=True)
    for message in estimate.warnings:
        click.echo(f"warning: {message}", err=True)
    if json_path is not None:
        data = estimate.to_dict()
        data["scenario"] = scenario.name
        if len(fleets) == 1:
            data["fleet"] = fleets[0].to_dict()
        data["fleets"] = [
            {"level": level, **fleet_.to_dict(), **outcome.to_dict()}
            for level, fleet_, outcome in at_fleets
        ]
        _write_json(json_path, data)
        click.echo(f"wrote {json_path}", err=True)
    if plot_path is not None:
        from collsim.report.goodput_plots import plot_goodput
        from collsim.report.plots import save_figure

        fig = plot_goodput(estimate, title=f"{scenario.name}: {run_days:g} days")
        save_figure(fig, plot_path)
        click.echo(f"wrote {plot_path}", err=True)
    _check_fits(result)
    return 0


def _check_fits(result: StepResult) -> None:
    """An InfeasibleError (exit 1) when the plan does not fit in memory."""
    if not result.fits:
        from collsim.errors import InfeasibleError

        raise InfeasibleError(
            f"does not fit: {result.memory_peak_bytes / 2**30:.1f} GiB needed of "
            f"{result.memory_capacity_bytes / 2**30:.1f} GiB (collsim run says more)",
            reason="memory",
        )


def _fleet_outcomes(
    fleets: list[Any],
    scenario: Scenario,
    topology: Topology,
    result: StepResult,
    *,
    days: float,
    runs: int,
    seed: int,
) -> list[tuple[str, Any, GoodputResult]]:
    """(level, fleet, goodput) of the plan at each fleet's rate (:func:`levels`)."""
    from collsim.study.goodput.estimate import estimate_goodput
    from collsim.study.goodput.fleets import at_rate, levels

    assert scenario.reliability is not None
    out = []
    for level, fleet in levels(fleets):
        rel = at_rate(scenario.reliability, fleet.per_1000_node_days)
        at = dataclasses.replace(scenario, reliability=rel)
        costs = scenario_costs(at, topology, result)
        out.append((level, fleet, estimate_goodput(costs, rel, days=days, runs=runs, seed=seed)))
    return out


def format_fleet_table(outcomes: list[tuple[str, Any, GoodputResult]]) -> str:
    """The plan at each fleet's failure rate: interruptions and effective training time (the
    run's length times the effective training time ratio), closed form and Monte Carlo mean
    with its 5th-95th percentile band."""
    from collsim.report.tables import format_table

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


def scenario_costs(scenario: Scenario, topology: Topology, result: StepResult) -> JobCosts:
    """The job's goodput inputs: the reliability section, the plan's state, the simulated step.

    Raises:
        ConfigError: no reliability section, or an interval shorter than a checkpoint write
            (located in the scenario file).
    """
    from collsim.study.goodput.costs import checkpoint_state, job_costs

    reliability = scenario.reliability
    if reliability is None:
        raise scenario.locate(ConfigError("missing required section", key_path="reliability"))
    gpus_per_node = max(1, int(topology.gpus_per_node))
    num_nodes = math.ceil(scenario.parallel.world_size / gpus_per_node)
    try:
        return job_costs(
            reliability,
            state=checkpoint_state(scenario.model, scenario.training, scenario.parallel),
            num_nodes=num_nodes,
            step_time_s=result.step_time_s,
            tokens_per_step=float(scenario.training.global_batch * scenario.model.seq_len),
        )
    except ConfigError as exc:
        raise scenario.locate(exc) from None


# -- text ----------------------------------------------------------------------------------------


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


def format_goodput_report(result: GoodputResult, scenario: Scenario, topology: Topology) -> str:
    """The text report of ``collsim goodput``."""
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


def _write_json(path: Path, data: dict[str, Any]) -> None:
    try:
        with Path(path).open("w", encoding="utf-8") as handle:
            json.dump(data, handle, indent=2, default=str)
            handle.write("\n")
    except OSError as exc:
        raise click.FileError(str(path), hint=exc.strerror) from None
