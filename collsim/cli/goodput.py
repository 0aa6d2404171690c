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

import json
from pathlib import Path
from typing import TYPE_CHECKING, Any

import click

from collsim.cli.common import OneLineCommand, check_output_path
from collsim.core.errors import ConfigError

if TYPE_CHECKING:
    from collsim.step.result import StepResult

__all__ = ["goodput", "goodput_scenario"]

_EPILOG = """\b
Examples:
  collsim goodput tests/goodput/data/goodput_gpt3_175b_1024.yaml
  collsim goodput SCENARIO --days 54 --runs 2000 --seed 1 --json goodput.json
  collsim goodput SCENARIO --set reliability.checkpoint.interval_s=600 --plot goodput.png
  collsim goodput SCENARIO --fleet meta_rsc2

Exit status: 0 done, 1 the plan is infeasible, 2 bad input.
"""

#: Monte Carlo runs when ``--runs`` is not given (``collsim.study.job_goodput.DEFAULT_RUNS``, kept
#: here so that ``--help`` does not import the study).
DEFAULT_RUNS = 1000
#: The most Monte Carlo runs ``--runs`` takes: the samples of every run are held at once, so
#: memory grows with the runs (docs/derivations.md, measurements: a million runs of the
#: 16,384-GPU Llama 3 scenario); this bound keeps such a run under about 0.7 GB per rate.
MAX_RUNS = 100_000
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
    # start-up: loaded only when this runs (--help and bad input stay fast)
    from collsim.report.goodput_text import format_fleet_table, format_goodput_report
    from collsim.study.goodput.fleets import find_fleets, published_fleets
    from collsim.study.job import load, run_job
    from collsim.study.job_goodput import (
        job_at_rate,
        job_fleet_goodput,
        job_goodput,
        require_reliability,
    )

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
    scenario = load(path, list(overrides))
    require_reliability(scenario)
    job = run_job(scenario)
    if len(fleets) == 1:
        job = job_at_rate(job, fleets[0].per_1000_node_days)
    scenario = job.scenario
    estimate = job_goodput(job, days=days, runs=runs, seed=seed)
    at_fleets = (
        job_fleet_goodput(job, fleets, days=days, runs=runs, seed=seed) if len(fleets) > 1 else []
    )

    click.echo(format_goodput_report(estimate, scenario))
    if at_fleets:
        click.echo("")
        click.echo(format_fleet_table(at_fleets))
    for message in job.warnings:
        click.echo(f"warning: {' '.join(message.split())}", err=True)
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
        # start-up: loaded only when this runs (--help and bad input stay fast)
        from collsim.report.goodput_plots import plot_goodput
        from collsim.report.plots import save_figure

        fig = plot_goodput(estimate, title=f"{scenario.name}: {estimate.days:g} days")
        save_figure(fig, plot_path)
        click.echo(f"wrote {plot_path}", err=True)
    _check_fits(job.result)
    return 0


def _check_fits(result: StepResult) -> None:
    """An InfeasibleError (exit 1) when the plan does not fit in memory."""
    if not result.fits:
        # start-up: loaded only when this runs (--help and bad input stay fast)
        from collsim.core.errors import InfeasibleError

        raise InfeasibleError(
            f"does not fit: {result.memory_peak_bytes / 2**30:.1f} GiB needed of "
            f"{result.memory_capacity_bytes / 2**30:.1f} GiB (collsim run says more)",
            reason="memory",
        )


def _write_json(path: Path, data: dict[str, Any]) -> None:
    try:
        with Path(path).open("w", encoding="utf-8") as handle:
            json.dump(data, handle, indent=2, default=str)
            handle.write("\n")
    except OSError as exc:
        raise click.FileError(str(path), hint=exc.strerror) from None
