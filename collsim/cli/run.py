"""``collsim run SCENARIO``: simulate one training step and report where the time goes.

Data goes to stdout (the report), messages to stderr (warnings, errors, the memory verdict when
the plan does not fit). Exit codes: 0 ok; 1 the plan does not fit in memory (the report is
still printed) or is infeasible; 2 bad input (one line naming the key); 3 a part of collsim
this command needs is not available yet.
"""

from __future__ import annotations

import warnings
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
from collsim.errors import CollsimWarning, ConfigError, InfeasibleError, UnavailableError
from collsim.runtime import collector_paused

if TYPE_CHECKING:
    from collsim.limits import Limits
    from collsim.scenario import Scenario
    from collsim.schedule.result import StepResult
    from collsim.topology import Topology

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

#: ``--fidelity`` choices: the engine's granularities (``collsim.engine.step.FIDELITIES``, kept
#: here so that ``--help`` does not import the engine) and ``closed``, the closed form of the
#: same schedule (``collsim.estimate``).
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

    The cyclic collector is paused over it (:func:`collsim.runtime.collector_paused`): the
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
    from collsim.limits import check_scenario
    from collsim.scenario import load_scenario

    scenario = load_scenario(path, overrides)
    check_scenario(scenario, limits, all_ranks=all_ranks)
    topology = _load_topology(scenario)
    result, caught = _simulate_capturing(
        scenario,
        topology,
        all_ranks=all_ranks,
        trace=trace_path is not None or plot_path is not None,
        fidelity=fidelity,
    )

    from collsim.report.tables import format_run_report, memory_verdict

    click.echo(
        format_run_report(
            result,
            title=f"collsim run: {scenario.name}",
            context=describe_scenario(scenario, topology),
        )
    )
    for text in straggler_lines(result):
        click.echo(text)
    if scenario.reliability is not None:
        line = _goodput_line(scenario, topology, result)
        if line is not None:
            click.echo(line)
    for message in _warning_messages(caught, result):
        click.echo(f"warning: {message}", err=True)
    if json_path is not None:
        _write_json(json_path, result.to_dict())
        click.echo(f"wrote {json_path}", err=True)
    if write_trace is not None and trace_path is not None:
        write_trace(result, trace_path, name=scenario.name)
        click.echo(f"wrote {trace_path}", err=True)
    if plot_path is not None:
        _write_plot(scenario, result, plot_path)
        click.echo(f"wrote {plot_path}", err=True)
    if not result.fits:
        raise InfeasibleError(memory_verdict(result), reason="memory", prefix="")


# -- steps (module-level so tests can stand in for layers that are not there) ---------------------


def _goodput_line(scenario: Scenario, topology: Topology, result: StepResult) -> str | None:
    """The closed-form goodput line of a scenario with a reliability section (None: error shown)."""
    from collsim.cli.goodput import DEFAULT_DAYS, one_line, scenario_costs
    from collsim.study.goodput.estimate import estimate_goodput

    reliability = scenario.reliability
    if reliability is None:
        return None
    try:
        costs = scenario_costs(scenario, topology, result)
        days = reliability.duration_days or DEFAULT_DAYS
        return one_line(estimate_goodput(costs, reliability, days=days, monte_carlo=False))
    except ConfigError as exc:
        click.echo(f"warning: no goodput estimate: {exc}", err=True)
        return None


def _trace_writer() -> TraceWriter | None:
    """``collsim.report.trace.write_trace`` if that module exists, else None."""
    try:
        from collsim.report import trace
    except ImportError:
        return None
    return getattr(trace, "write_trace", None)


def _load_topology(scenario: Scenario) -> Topology:
    """The scenario's cluster; topology errors without a file are pointed at ``cluster``."""
    try:
        return scenario.cluster.load()
    except ConfigError as exc:
        if exc.file is not None:
            raise
        key = exc.key_path or ""
        if not key.startswith("cluster."):
            key = "cluster.nodes" if key.endswith("nodes") else "cluster.topology"
        raise scenario.locate(ConfigError(exc.message, key_path=key)) from None


def _simulate(
    scenario: Scenario,
    topology: Topology,
    *,
    all_ranks: bool,
    trace: bool,
    fidelity: str = "auto",
) -> StepResult:
    if fidelity == "closed":
        if all_ranks or trace:
            raise ConfigError(
                "the closed form walks one rank per stage and keeps no trace; use --fidelity "
                "auto, fused or layer with --all-ranks, --trace or --plot",
                key_path="--fidelity",
            )
        from collsim.estimate import estimate_step

        return estimate_step(
            topology,
            scenario.model,
            scenario.training,
            scenario.parallel,
            stragglers=scenario.stragglers,
        )
    from collsim.engine import simulate_step

    return simulate_step(
        topology,
        scenario.model,
        scenario.training,
        scenario.parallel,
        all_ranks=all_ranks,
        trace=trace,
        fidelity=fidelity,
        stragglers=scenario.stragglers,
    )


def straggler_lines(result: StepResult) -> list[str]:
    """The report lines of a straggler step: its cost against the step without stragglers,
    and the rendezvous that waited longest (``details["stragglers"]``; none without it)."""
    st = result.details.get("stragglers")
    if not st:
        return []
    # the slowest first (the one a user slowed on purpose among jittered ones), four of each
    clocks = sorted(st["clock_factors"].items(), key=lambda kv: (kv[1], str(kv[0])))
    links = sorted(st["degraded_links"].items(), key=lambda kv: (kv[1], str(kv[0])))
    what = [f"rank {r} at {f:g}x clock" for r, f in clocks[:4]]
    what += [f"... {len(clocks) - 4} more ranks"] if len(clocks) > 4 else []
    what += [f"{name} at {f:g}x bandwidth" for name, f in links[:4]]
    what += [f"... {len(links) - 4} more links"] if len(links) > 4 else []
    lines = [
        f"stragglers: {', '.join(what)}",
        f"  step {st['step_time_s'] * 1e3:.2f} ms vs {st['baseline_step_time_s'] * 1e3:.2f} ms "
        f"without stragglers: {st['slowdown']:.4f}x (+{st['extra_s'] * 1e3:.2f} ms); "
        f"critical rank {st['critical_rank']}",
    ]
    if st["tp_paced_ranks"]:
        lines.append(
            f"  TP groups at their slowest member's pace: ranks {_ranks(st['tp_paced_ranks'])}"
        )
    for wait in st["waits"][:3]:
        waiting = ", ".join(f"{r} {w * 1e3:.2f} ms" for r, w in sorted(wait["waits_s"].items()))
        lines.append(
            f"  {wait['axis']} group {_ranks(wait['group'])}: {wait['call']!r} waited "
            f"{wait['wait_s'] * 1e3:.2f} ms for rank {wait['waited_for']} (waiting: {waiting})"
        )
    if result.details.get("fidelity") == "closed":
        lines.append("  closed form: the slowed pipeline's critical path (waits: use the DES)")
    return lines


def _ranks(ranks: Sequence[int]) -> str:
    shown = ", ".join(str(r) for r in list(ranks)[:8])
    return f"[{shown}{', ...' if len(ranks) > 8 else ''}]"


def _write_plot(scenario: Scenario, result: StepResult, path: Path) -> None:
    """``plot_step`` of the traced result, rows labelled by pipeline stage, saved by suffix."""
    from collsim.report.plots import plot_step, save_figure

    par = scenario.parallel
    fig = plot_step(result, title=scenario.name, stage_of=lambda r: (r // par.tp) % par.pp)
    try:
        save_figure(fig, path)
    except OSError as exc:
        raise ConfigError(f"cannot write: {exc.strerror}", file=str(path)) from None


def _simulate_capturing(
    scenario: Scenario,
    topology: Topology,
    *,
    all_ranks: bool,
    trace: bool,
    fidelity: str = "auto",
) -> tuple[StepResult, list[warnings.WarningMessage]]:
    """Run the engine, collecting the CollsimWarnings it raises (other warnings pass through).

    Plan errors come back from the engine with a key path only; they are located in the
    scenario file (or at the ``--set`` that set the key).
    """
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always", CollsimWarning)
        try:
            result = _simulate(
                scenario, topology, all_ranks=all_ranks, trace=trace, fidelity=fidelity
            )
        except ConfigError as exc:
            raise scenario.locate(exc) from None
    ours = [w for w in caught if issubclass(w.category, CollsimWarning)]
    for other in caught:
        if not issubclass(other.category, CollsimWarning):
            warnings.warn_explicit(other.message, other.category, other.filename, other.lineno)
    return result, ours


def _warning_messages(caught: Sequence[warnings.WarningMessage], result: StepResult) -> list[str]:
    """Captured warnings then the result's own, each once, in order.

    When the plan does not fit, the verdict is printed last in its own words; a warning that
    says the same (``does not fit: ...``) is left out so that it is not said twice.
    """
    seen: dict[str, None] = {}
    for w in caught:
        seen.setdefault(" ".join(str(w.message).split()), None)
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


# -- report context ------------------------------------------------------------------------------


def describe_scenario(scenario: Scenario, topology: Topology) -> list[tuple[str, str]]:
    """Label/text lines that say what was simulated: model, cluster, plan, batch."""
    spec, train, par = scenario.model, scenario.training, scenario.parallel
    params_b = spec.num_parameters() / 1e9
    kv = f" ({spec.kv_heads} kv)" if spec.kv_heads != spec.num_heads else ""
    model = (
        f"{spec.name}: {params_b:.2f} B params, {spec.num_layers} layers, hidden "
        f"{spec.hidden}, {spec.num_heads} heads{kv}, seq {spec.seq_len}"
    )
    device = getattr(getattr(topology, "device", None), "name", "GPU")
    gpus = topology.num_ranks
    cluster = (
        f"{topology.num_nodes} x {topology.gpus_per_node} {device} = {gpus} GPUs ({topology.name})"
    )
    plan = f"tp {par.tp} x pp {par.pp} x dp {par.dp}"
    if par.pp > 1:
        plan += f", {par.schedule}"
        if par.virtual_stages > 1:
            plan += f" (virtual stages {par.virtual_stages})"
    if par.sequence_parallel:
        plan += ", sequence parallel"
    if par.zero == 0:
        plan += f", DDP buckets {par.ddp.bucket_mb:g} MiB, overlap {_on(par.ddp.overlap)}"
        if par.ddp.gradient_as_bucket_view:
            plan += ", gradients as bucket views"
    elif par.zero in (1, 2):
        plan += f", ZeRO-{par.zero}, buckets {par.ddp.bucket_mb:g} MiB"
    else:
        plan += (
            f", ZeRO-3/FSDP, prefetch {par.fsdp.prefetch}, reshard "
            f"{_on(par.fsdp.reshard_after_forward)}, offload {_on(par.fsdp.offload)}"
        )
    micro = train.global_batch // (train.micro_batch * par.dp) if par.dp else 0
    batch = (
        f"global {train.global_batch} = dp {par.dp} x {micro} micro-batches x "
        f"{train.micro_batch}; {train.dtype}, {train.optimizer}, recompute "
        f"{train.recompute}"
    )
    return [("model", model), ("cluster", cluster), ("plan", plan), ("batch", batch)]


def _on(flag: bool) -> str:
    return "on" if flag else "off"
