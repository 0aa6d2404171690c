"""``collsim run SCENARIO``: simulate one training step and report where the time goes.

Data goes to stdout (the report), messages to stderr (warnings, errors, the memory verdict when
the plan does not fit). Exit codes: 0 ok; 1 the plan does not fit in memory (the report is
still printed) or is infeasible; 2 bad input (one line naming the key); 3 a part of collsim
this command needs is not available yet.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

import click

from collsim.cli.common import (
    OneLineCommand,
    check_output_path,
    check_outputs,
    limit_options,
    limits_from_options,
)
from collsim.core.errors import ConfigError, InfeasibleError, UnavailableError
from collsim.core.runtime import collector_paused

if TYPE_CHECKING:
    from collsim.step.result import StepResult
    from collsim.study.job import Job
    from collsim.study.limits import Limits

__all__ = ["run", "run_scenario"]

_EPILOG = """\b
Examples:
  collsim run scenarios/3d_175b.yaml
  collsim run scenarios/3d_175b.yaml --set parallel.dp=8 --set cluster.nodes=64
  collsim run scenarios/ddp_gpt3_1.3b.yaml --json result.json --trace step.json
  collsim run scenarios/pipeline_13b_1f1b.yaml --plot step.png --fidelity layer

Exit status: 0 done, 1 the plan does not fit in memory, 2 bad input (or a plan beyond
a resource limit: the message names the --max-* option that raises it).
"""

TraceWriter = Callable[..., Any]

#: ``--fidelity`` choices (``collsim.study.job.FIDELITIES``, kept here so that ``--help`` does
#: not import the study): the engine's granularities and ``closed``, the closed form of the
#: same schedule (``collsim.play.walk``).
FIDELITY_CHOICES = ("auto", "fused", "layer", "closed")

#: ``--plot`` suffixes (``collsim.report.plots.save_figure`` writes these).
PLOT_SUFFIXES = (".png", ".svg")


@click.command(name="run", epilog=_EPILOG, cls=OneLineCommand)
@click.argument("scenario", type=click.Path(dir_okay=False, path_type=Path))
@click.option(
    "--set",
    "overrides",
    multiple=True,
    metavar="KEY.PATH=VALUE",
    help="Override a scenario key (value read as YAML), e.g. parallel.tp=4. Repeatable.",
)
@click.option(
    "--json",
    "json_path",
    type=click.Path(dir_okay=False, path_type=Path),
    help="Write the result summary as JSON to this file.",
)
@click.option(
    "--all-ranks",
    is_flag=True,
    help="Simulate every rank instead of one per symmetry class (slow on big jobs).",
)
@click.option(
    "--trace",
    "trace_path",
    type=click.Path(dir_okay=False, path_type=Path),
    help="Write a Perfetto / chrome://tracing timeline of the step to this file.",
)
@click.option(
    "--plot",
    "plot_path",
    type=click.Path(dir_okay=False, path_type=Path),
    help="Draw the step (compute streams and memory) to this .png or .svg file.",
)
@click.option(
    "--fidelity",
    type=click.Choice(FIDELITY_CHOICES),
    default="auto",
    show_default=True,
    help="fused: closed-form communication; layer: every layer step and collective "
    "on the flow-level network; auto: layer only where links are shared; closed: the "
    "schedule walked in closed form, without the DES (no contention, no trace).",
)
@limit_options
def run(
    scenario: Path,
    overrides: tuple[str, ...],
    json_path: Path | None,
    all_ranks: bool,
    trace_path: Path | None,
    plot_path: Path | None,
    fidelity: str,
    limit_values: dict[str, int | None],
) -> None:
    """Simulate one training step of SCENARIO (a YAML file) and print the report."""
    run_scenario(
        scenario,
        overrides,
        json_path=json_path,
        all_ranks=all_ranks,
        trace_path=trace_path,
        plot_path=plot_path,
        fidelity=fidelity,
        limits=limits_from_options(limit_values),
    )


@collector_paused()
def run_scenario(
    path: Path,
    overrides: Sequence[str] = (),
    *,
    json_path: Path | None = None,
    all_ranks: bool = False,
    trace_path: Path | None = None,
    plot_path: Path | None = None,
    fidelity: str = "auto",
    limits: Limits | None = None,
) -> None:
    """The body of ``collsim run``: prints the report, writes the files asked for.

    The cyclic collector is paused over it (:func:`collsim.core.runtime.collector_paused`): the
    modules it imports, the scenario and the topology stay alive to the end, as the step does.

    Raises:
        ConfigError: bad input (exit 2), before any simulation.
        InfeasibleError: the plan cannot run, or does not fit in memory (after the report).
        UnavailableError: a part of collsim this command needs is missing (exit 3).
    """
    if plot_path is not None and Path(plot_path).suffix.lower() not in PLOT_SUFFIXES:
        raise ConfigError(
            f"the image must end in .png or .svg, got {Path(plot_path).name!r}", key_path="--plot"
        )
    check_output_path(json_path, "--json")
    check_output_path(trace_path, "--trace")
    check_output_path(plot_path, "--plot")
    check_outputs({"--json": json_path, "--trace": trace_path, "--plot": plot_path}, inputs=[path])
    write_trace = _trace_writer() if trace_path is not None else None
    if trace_path is not None and write_trace is None:
        raise UnavailableError("--trace: the trace writer is not yet available in this version")
    # start-up: loaded only when this runs (--help and bad input stay fast)
    from collsim.study.job import run_job

    job = run_job(
        path,
        list(overrides),
        fidelity=fidelity,
        all_ranks=all_ranks,
        trace=trace_path is not None or plot_path is not None,
        limits=limits,
    )
    scenario, result = job.scenario, job.result

    # start-up: loaded only when this runs (--help and bad input stay fast)
    from collsim.report.run_text import describe_scenario, straggler_lines
    from collsim.report.tables import format_run_report, memory_verdict

    click.echo(
        format_run_report(
            result,
            title=f"collsim run: {scenario.name}",
            context=describe_scenario(scenario, job.topology, result),
        )
    )
    for text in straggler_lines(result):
        click.echo(text)
    if scenario.reliability is not None:
        line = _goodput_line(job)
        if line is not None:
            click.echo(line)
    for message in _warning_messages(job.warnings, result):
        click.echo(f"warning: {message}", err=True)
    if json_path is not None:
        _write_json(json_path, result.to_dict())
        click.echo(f"wrote {json_path}", err=True)
    if write_trace is not None and trace_path is not None:
        write_trace(result, trace_path, name=scenario.name)
        click.echo(f"wrote {trace_path}", err=True)
    if plot_path is not None:
        _write_plot(scenario.name, result, plot_path)
        click.echo(f"wrote {plot_path}", err=True)
    if not result.fits:
        raise InfeasibleError(memory_verdict(result), reason="memory", prefix="")


def _goodput_line(job: Job) -> str | None:
    """The closed-form goodput line of a scenario with a reliability section (None: error shown)."""
    # start-up: loaded only when this runs (--help and bad input stay fast)
    from collsim.report.goodput_text import one_line
    from collsim.study.job_goodput import job_goodput

    try:
        return one_line(job_goodput(job, monte_carlo=False))
    except ConfigError as exc:
        click.echo(f"warning: no goodput estimate: {exc}", err=True)
        return None


def _trace_writer() -> TraceWriter | None:
    """``collsim.report.trace.write_trace`` if that module exists, else None."""
    try:
        # start-up: loaded only when this runs (--help and bad input stay fast)
        from collsim.report import trace
    except ImportError:
        return None
    return getattr(trace, "write_trace", None)


def _write_plot(name: str, result: StepResult, path: Path) -> None:
    """``plot_step`` of the traced result, a row per pipeline stage, saved by suffix."""
    # start-up: loaded only when this runs (--help and bad input stay fast)
    from collsim.report.plots import plot_step, save_figure

    fig = plot_step(result, title=name)
    try:
        save_figure(fig, path)
    except OSError as exc:
        raise ConfigError(f"cannot write: {exc.strerror}", file=str(path)) from None


def _warning_messages(caught: Sequence[str], result: StepResult) -> list[str]:
    """Captured warnings then the result's own, each once, in order.

    When the plan does not fit, the verdict is printed last in its own words; a warning that
    says the same (``does not fit: ...``) is left out so that it is not said twice.
    """
    seen: dict[str, None] = {}
    for message in caught:
        seen.setdefault(" ".join(message.split()), None)
    for message in result.warnings:
        seen.setdefault(" ".join(str(message).split()), None)
    return [m for m in seen if result.fits or not m.startswith("does not fit")]


def _write_json(path: Path, data: dict[str, Any]) -> None:
    import json  # only for --json

    try:
        with Path(path).open("w", encoding="utf-8") as handle:
            json.dump(data, handle, indent=2, default=str)
            handle.write("\n")
    except OSError as exc:
        raise ConfigError(f"cannot write: {exc.strerror}", file=str(path)) from None
