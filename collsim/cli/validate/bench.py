"""``collsim validate bench``: time collectives the way nccl-tests does, and check them."""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

import click

from collsim.cli.common import OneLineCommand, check_output_path
from collsim.cli.validate.shared import _size

__all__ = ["bench"]


def _ops(ctx: click.Context, param: click.Parameter, value: str) -> tuple[str, ...]:
    # start-up: loaded only when this runs (--help and bad input stay fast)
    from collsim.validate.measure.bench import OPS

    ops = tuple(o.strip() for o in value.split(",") if o.strip())
    if ops == ("all",):
        return OPS
    bad = [o for o in ops if o not in OPS]
    if bad or not ops:
        raise click.BadParameter(
            f"unknown op(s) {', '.join(bad) or '(none)'}; choose from {', '.join(OPS)} or 'all'"
        )
    return ops


def _realtime(ctx: click.Context, param: click.Parameter, value: bool) -> bool:
    if value:
        # start-up: loaded only when this runs (--help and bad input stay fast)
        from collsim.validate.measure.launch import realtime_problem

        problem = realtime_problem()
        if problem:
            raise click.BadParameter(problem)
    return value


@click.command(cls=OneLineCommand)
@click.option("--backend", type=click.Choice(["gloo", "nccl"]), default="gloo", show_default=True)
@click.option(
    "--world-size",
    type=click.IntRange(1, 1024),
    default=None,
    help="Local ranks to spawn (default 2); ignored under torchrun.",
)
@click.option(
    "--ops",
    default="all_reduce,all_gather,reduce_scatter,broadcast,all_to_all,send_recv",
    callback=_ops,
    show_default=True,
    help="Comma-separated, or 'all'.",
)
@click.option("-b", "--minbytes", default="1K", callback=_size, show_default=True)
@click.option("-e", "--maxbytes", default="64M", callback=_size, show_default=True)
@click.option("-f", "--stepfactor", type=click.IntRange(2), default=2, show_default=True)
@click.option(
    "-n", "--iters", type=click.IntRange(1), default=20, show_default=True, help="As nccl-tests -n."
)
@click.option(
    "-w",
    "--warmup",
    type=click.IntRange(0),
    default=5,
    show_default=True,
    help="Warm-up iterations, as nccl-tests -w.",
)
@click.option(
    "--rounds",
    type=click.IntRange(1),
    default=1,
    show_default=True,
    help="Sweep everything this many times, iters/rounds timed iterations each "
    "(spreads bursts of load from other processes over many points).",
)
@click.option(
    "--back-to-back",
    is_flag=True,
    help="One barrier, then back-to-back timed iterations (default: a barrier before each).",
)
@click.option(
    "--realtime",
    is_flag=True,
    callback=_realtime,
    help="Run the ranks under SCHED_RR (Linux; root or CAP_SYS_NICE): a woken rank "
    "thread no longer waits out another thread's time slice, which on a small "
    "shared machine adds milliseconds to some iterations.",
)
@click.option(
    "--timeout",
    "timeout_s",
    type=click.FloatRange(min=1),
    default=900.0,
    show_default=True,
    help="Seconds for the whole run; also the collective timeout.",
)
@click.option(
    "-o",
    "--output",
    type=click.Path(dir_okay=False),
    default=None,
    help="Write the points and metadata (.csv or .json). A .csv gets each point as soon as "
    "it is measured, so a bench that is stopped keeps what it finished.",
)
@click.option(
    "--resume",
    is_flag=True,
    help="Measure only the points the -o CSV does not have yet (same options as the run "
    "that wrote it), then rewrite it whole.",
)
def bench(
    backend: str,
    world_size: int | None,
    ops: tuple[str, ...],
    minbytes: int,
    maxbytes: int,
    stepfactor: int,
    iters: int,
    warmup: int,
    rounds: int,
    back_to_back: bool,
    realtime: bool,
    timeout_s: float,
    output: str | None,
    resume: bool,
) -> None:
    """Time collectives like nccl-tests (median of the slowest rank) and check every result."""
    # start-up: loaded only when this runs (--help and bad input stay fast)
    from collsim.validate.data.dataset import format_table
    from collsim.validate.measure.bench import BenchConfig, resume_state, run_bench, sizes_between
    from collsim.validate.measure.launch import in_torchrun

    check_output_path(output, "-o/--output", suffixes=(".csv", ".json"))
    if resume and (output is None or not output.lower().endswith(".csv")):
        raise click.BadParameter("needs -o FILE.csv (the file to finish)", param_hint="--resume")

    if world_size is None and not in_torchrun():
        world_size = 2
    try:
        sizes = tuple(sizes_between(minbytes, maxbytes, stepfactor))
    except ValueError as exc:
        raise click.BadParameter(str(exc), param_hint="-b/--minbytes, -e/--maxbytes") from None
    if rounds > iters:
        raise click.BadParameter(
            f"must be <= --iters ({iters}), got {rounds}", param_hint="--rounds"
        )
    config = BenchConfig(
        ops=ops,
        sizes_bytes=sizes,
        iters=iters,
        warmup=warmup,
        rounds=rounds,
        barrier_each=not back_to_back,
        output=output if output is not None and output.lower().endswith(".csv") else None,
        progress=True,
    )
    earlier: list[dict[str, Any]] = []
    if resume and output is not None:
        skip, earlier = resume_state(output, config, backend=backend, world_size=world_size)
        config = dataclasses.replace(config, skip=skip)
        if skip:
            click.echo(f"# resuming {output}: {len(skip)} point(s) already measured", err=True)
    result, is_reporter = run_bench(
        config, world_size=world_size, backend=backend, timeout_s=timeout_s, realtime=realtime
    )
    if not is_reporter:
        return
    if config.skip:
        result.metadata["resumed"] = f"{len(config.skip)} point(s) measured by an earlier run"
    rows = _in_order(earlier + result.rows(), ops)
    click.echo(format_table(rows, result.metadata))
    if output:
        path = _replace_file(output, rows, result.metadata)
        click.echo(f"# wrote {path}", err=True)
    if any(r["wrong"] for r in rows):
        raise click.ClickException("some results were wrong (see #wrong)")


def _in_order(rows: list[dict[str, Any]], ops: tuple[str, ...]) -> list[dict[str, Any]]:
    """Rows by op (in --ops order), then size; a point measured twice keeps the later row."""
    latest = {(r["op"], int(r["size_bytes"])): r for r in rows}
    rank = {op: i for i, op in enumerate(ops)}
    return sorted(latest.values(), key=lambda r: (rank.get(r["op"], len(rank)), r["size_bytes"]))


def _replace_file(output: str, rows: list[dict[str, Any]], metadata: dict[str, Any]) -> Path:
    """Write the finished measurement beside ``output``, then move it over (atomic on POSIX):
    the partial file stays whole until the complete one is there."""
    # start-up: loaded only when this runs (--help and bad input stay fast)
    import os

    # start-up: loaded only when this runs (--help and bad input stay fast)
    from collsim.validate.data.dataset import write_measurements

    target = Path(output)
    tmp = target.with_name(f".{target.stem}.writing{target.suffix}")
    try:
        write_measurements(tmp, rows, metadata)
        os.replace(tmp, target)
    finally:
        tmp.unlink(missing_ok=True)
    return target
