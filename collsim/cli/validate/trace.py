"""``collsim validate trace``: read profiler traces, break them down, compare with a scenario."""

from __future__ import annotations

import click

from collsim.cli.common import OneLineCommand, check_output_path
from collsim.core.errors import ConfigError

__all__ = ["trace_command"]


@click.command("trace", cls=OneLineCommand)
@click.argument("traces", nargs=-1, required=True, type=click.Path(dir_okay=False))
@click.option(
    "--scenario",
    default=None,
    type=click.Path(dir_okay=False),
    help="Compare each traced step, per op kind, with this scenario's simulated step.",
)
@click.option(
    "--trace-out",
    default=None,
    type=click.Path(dir_okay=False),
    help="With --scenario: one Perfetto JSON with the traced and the simulated step side by side.",
)
@click.option(
    "--profile-out",
    default=None,
    type=click.Path(dir_okay=False),
    help="Write a device profile (the `validate compute` schema) learned from the traced kernels.",
)
@click.option(
    "--base",
    default=None,
    help="With --profile-out: the device (catalogue key or profile) whose figures serve where "
    "the trace saw nothing (default: cpu for a CPU trace, else h100).",
)
@click.option(
    "--pinned",
    multiple=True,
    type=click.Path(dir_okay=False),
    help="With --profile-out: the same step traced with more ranks per core (validate step "
    "under taskset -c 0); the profile learns the time-sharing slowdown from them (repeatable).",
)
@click.option(
    "--pinned-reference",
    multiple=True,
    type=click.Path(dir_okay=False),
    help="With --pinned: the traces of that step on one core per rank (default: TRACES).",
)
@click.option(
    "--reader",
    type=click.Choice(["json", "orjson", "ijson"]),
    default=None,
    help="JSON parser (default: orjson where installed, else json; ijson streams).",
)
@click.option("--top", type=click.IntRange(0), default=8, show_default=True)
def trace_command(
    traces: tuple[str, ...],
    scenario: str | None,
    trace_out: str | None,
    profile_out: str | None,
    base: str | None,
    pinned: tuple[str, ...],
    pinned_reference: tuple[str, ...],
    reader: str | None,
    top: int,
) -> None:
    """Read PyTorch profiler (Kineto) traces, one per rank: steps, kernels by kind, collectives."""
    # start-up: loaded only when this runs (--help and bad input stay fast)
    from collsim.validate.data.kineto import read_traces
    from collsim.validate.measure.traces.breakdown import breakdown, summarise
    from collsim.validate.measure.traces.report import format_summary

    if trace_out and not scenario:
        raise ConfigError("--trace-out needs --scenario (the simulated step to set beside)")
    check_output_path(trace_out, "--trace-out", suffixes=(".json", ".gz"))
    check_output_path(profile_out, "--profile-out", suffixes=(".yaml", ".yml"))
    if (pinned or pinned_reference) and not profile_out:
        raise ConfigError("--pinned and --pinned-reference need --profile-out")
    if pinned_reference and not pinned:
        raise ConfigError("--pinned-reference needs --pinned")
    loaded = None
    if scenario:
        # start-up: loaded only when this runs (--help and bad input stay fast)
        from collsim.api import load

        loaded = load(scenario)
    read = read_traces(traces, reader=reader)
    steps = [b for t in read for b in breakdown(t)]
    if not steps:
        raise ConfigError("no step holds any activity", file=read[0].path)
    summary = summarise(steps)
    click.echo(format_summary(read, summary, top=top))
    # start-up: loaded only when this runs (--help and bad input stay fast)
    from collsim.validate.fit.trace_rates import gemm_shapes

    shapes = gemm_shapes(read)
    if shapes:
        per_step = len(summary.steps)
        click.echo("# GEMMs by shape (m x n x k, from the launching op's input dims), per step")
        click.echo(f"{'shape':<22} {'dtype':>6} {'calls':>6} {'ms':>10} {'TFLOP/s':>9}")
        for m, n, k, dtype, calls, time_s, rate in shapes[: max(top, 1)]:
            click.echo(
                f"{f'{m} x {n} x {k}':<22} {dtype:>6} {calls / per_step:>6.0f} "
                f"{time_s / per_step * 1e3:>10.3f} {rate:>9.4f}"
            )
    if profile_out:
        # start-up: loaded only when this runs (--help and bad input stay fast)
        from collsim.validate.fit.trace_profile import profile_from_traces, write_trace_profile

        learned = profile_from_traces(
            read,
            base=base,
            pinned=read_traces(pinned, reader=reader) if pinned else None,
            pinned_reference=read_traces(pinned_reference, reader=reader)
            if pinned_reference
            else None,
        )
        path = write_trace_profile(profile_out, learned)
        click.echo(learned.describe())
        click.echo(f"# wrote {path}", err=True)
    if loaded is not None:
        # start-up: loaded only when this runs (--help and bad input stay fast)
        from collsim.validate.check.trace import compare_steps, format_comparison

        assert scenario is not None
        compared = compare_steps(summary, loaded)
        click.echo(format_comparison(compared))
        if profile_out:
            # start-up: loaded only when this runs (--help and bad input stay fast)
            from collsim.validate.fit.trace_profile import gemm_coverage

            seen, unseen = gemm_coverage(learned.measured["gemm"][: learned.traced_gemm], loaded)
            click.echo(
                f"# the scenario's GEMM shapes: {len(seen)} within 2x of a traced shape, "
                f"{len(unseen)} not (priced from the base's rows within 2x, else by the "
                f"figures of the base device {learned.base}"
                + (f": {', '.join('x'.join(map(str, s)) for s in unseen[:8])}" if unseen else "")
                + ")"
            )
        if trace_out:
            # start-up: loaded only when this runs (--help and bad input stay fast)
            from collsim.validate.check.trace import write_side_by_side

            click.echo(f"# wrote {write_side_by_side(trace_out, read, compared)}", err=True)
