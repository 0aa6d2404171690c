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
from typing import Any

import click

from collsim.cli.common import OneLineCommand, check_output_path
from collsim.errors import ConfigError

__all__ = ["goodput", "goodput_scenario"]

_EPILOG = """\b
Examples:
  collsim goodput tests/goodput/data/goodput_gpt3_175b_1024.yaml
  collsim goodput SCENARIO --days 54 --runs 2000 --seed 1 --json goodput.json
  collsim goodput SCENARIO --set reliability.checkpoint.interval_s=600 --plot goodput.png

Exit status: 0 done, 1 the plan is infeasible, 2 bad input.
"""

#: Monte Carlo runs when ``--runs`` is not given (``collsim.study.job.DEFAULT_RUNS``, kept
#: here so that ``--help`` does not import the study).
DEFAULT_RUNS = 1000
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
    from collsim.report.goodput_text import format_goodput_report
    from collsim.study.job import job_goodput, load, require_reliability, run_job

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
    estimate = job_goodput(job, days=days, runs=runs, seed=seed)

    click.echo(format_goodput_report(estimate, scenario))
    for message in job.warnings:
        click.echo(f"warning: {' '.join(message.split())}", err=True)
    for message in estimate.warnings:
        click.echo(f"warning: {message}", err=True)
    if not job.result.fits:
        click.echo("warning: the plan does not fit in memory (collsim run says more)", err=True)
    if json_path is not None:
        data = estimate.to_dict()
        data["scenario"] = scenario.name
        _write_json(json_path, data)
        click.echo(f"wrote {json_path}", err=True)
    if plot_path is not None:
        from collsim.report.goodput_plots import plot_goodput
        from collsim.report.plots import save_figure

        fig = plot_goodput(estimate, title=f"{scenario.name}: {estimate.days:g} days")
        save_figure(fig, plot_path)
        click.echo(f"wrote {plot_path}", err=True)
    return 0


def _write_json(path: Path, data: dict[str, Any]) -> None:
    try:
        with Path(path).open("w", encoding="utf-8") as handle:
            json.dump(data, handle, indent=2, default=str)
            handle.write("\n")
    except OSError as exc:
        raise click.FileError(str(path), hint=exc.strerror) from None
