"""``collsim validate``: measure with torch.distributed, calibrate a topology, compare.

Thin wrappers over :mod:`collsim.validate`; torch is imported only by the subcommands that run
ranks. A rank that fails ends the command with exit code 1 and a message naming the rank.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any, Callable

import click

from collsim.errors import CollsimError, ConfigError

__all__ = ["validate"]


def _rank_errors(fn: Callable[..., Any]) -> Callable[..., Any]:
    """Turn a RankFailure into a one-line click error (exit 1) instead of a traceback."""
    import functools

    @functools.wraps(fn)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        from collsim.validate.launch import RankFailure

        try:
            return fn(*args, **kwargs)
        except RankFailure as exc:
            raise click.ClickException(str(exc)) from None
    return wrapper


def _size(ctx: click.Context, param: click.Parameter, value: str) -> int:
    from collsim.units import parse_size

    try:
        return parse_size(value)
    except ValueError as exc:
        raise click.BadParameter(str(exc)) from None


def _ops(ctx: click.Context, param: click.Parameter, value: str) -> tuple[str, ...]:
    from collsim.validate.bench import OPS

    ops = tuple(o.strip() for o in value.split(",") if o.strip())
    if ops == ("all",):
        return OPS
    bad = [o for o in ops if o not in OPS]
    if bad or not ops:
        raise click.BadParameter(f"unknown op(s) {', '.join(bad) or '(none)'}; "
                                 f"choose from {', '.join(OPS)} or 'all'")
    return ops


@click.group()
def validate() -> None:
    """Measure collectives and training steps with torch.distributed and compare with collsim."""


@validate.command()
@click.option("--backend", type=click.Choice(["gloo", "nccl"]), default="gloo", show_default=True)
@click.option("--world-size", "-n", type=click.IntRange(1, 1024), default=None,
              help="Local ranks to spawn (default 2); ignored under torchrun.")
@click.option("--ops", default="all_reduce,all_gather,reduce_scatter,broadcast,all_to_all,"
              "send_recv", callback=_ops, show_default=True, help="Comma-separated, or 'all'.")
@click.option("-b", "--minbytes", default="1K", callback=_size, show_default=True)
@click.option("-e", "--maxbytes", default="64M", callback=_size, show_default=True)
@click.option("-f", "--stepfactor", type=click.IntRange(2), default=2, show_default=True)
@click.option("--iters", type=click.IntRange(1), default=20, show_default=True)
@click.option("--warmup", type=click.IntRange(0), default=5, show_default=True)
@click.option("--timeout", "timeout_s", type=click.FloatRange(min=1), default=900.0,
              show_default=True, help="Seconds for the whole run; also the collective timeout.")
@click.option("-o", "--output", type=click.Path(dir_okay=False), default=None,
              help="Write the points and metadata (.csv or .json).")
@_rank_errors
def bench(backend: str, world_size: int | None, ops: tuple[str, ...], minbytes: int,
          maxbytes: int, stepfactor: int, iters: int, warmup: int, timeout_s: float,
          output: str | None) -> None:
    """Time collectives like nccl-tests (median of the slowest rank) and check every result."""
    from collsim.validate.bench import BenchConfig, run_bench, sizes_between
    from collsim.validate.dataset import format_table, write_measurements
    from collsim.validate.launch import in_torchrun

    if world_size is None and not in_torchrun():
        world_size = 2
    sizes = tuple(sizes_between(minbytes, maxbytes, stepfactor))
    config = BenchConfig(ops=ops, sizes_bytes=sizes, iters=iters, warmup=warmup)
    result, is_reporter = run_bench(config, world_size=world_size, backend=backend,
                                    timeout_s=timeout_s)
    if not is_reporter:
        return
    rows = result.rows()
    click.echo(format_table(rows, result.metadata))
    if output:
        path = write_measurements(output, rows, result.metadata)
        click.echo(f"# wrote {path}")
    if any(r["wrong"] for r in rows):
        raise click.ClickException("some results were wrong (see #wrong)")


def _run_sketch(parts: tuple[str, ...], world_size: int, steps: int, timeout_s: float,
                output: str | None) -> None:
    from collsim.validate.sketch import SketchConfig, check_report, run_sketch

    report = run_sketch(SketchConfig(parts=parts, steps=steps), world_size=world_size,
                        timeout_s=timeout_s)
    rows = check_report(report)
    click.echo(f"# {', '.join(parts)} from scratch on {world_size} {report['backend']} ranks")
    for name, ok, figure in rows:
        click.echo(f"{'PASS' if ok else 'FAIL'}  {name}: {figure}")
    report["checks"] = [{"check": n, "passed": ok, "figure": f} for n, ok, f in rows]
    if output:
        Path(output).parent.mkdir(parents=True, exist_ok=True)
        Path(output).write_text(json.dumps(report, indent=1) + "\n")
        click.echo(f"# wrote {output}")
    if not all(ok for _, ok, _ in rows):
        raise click.ClickException("some checks failed")


_SKETCH_OPTIONS = [
    click.option("--world-size", "-n", type=click.Choice(["2", "4"]), default="2",
                  show_default=True),
    click.option("--steps", type=click.IntRange(1), default=5, show_default=True),
    click.option("--timeout", "timeout_s", type=click.FloatRange(min=1), default=300.0,
                 show_default=True),
    click.option("-o", "--output", type=click.Path(dir_okay=False), default=None,
                 help="Write the JSON report here."),
]


def _with_options(fn: Callable[..., Any]) -> Callable[..., Any]:
    for option in reversed(_SKETCH_OPTIONS):
        fn = option(fn)
    return fn


@validate.command()
@_with_options
@_rank_errors
def ddp(world_size: str, steps: int, timeout_s: float, output: str | None) -> None:
    """DDP from scratch on real gloo ranks: equivalence, sync, AVG vs SUM/N, overlap (timed)."""
    _run_sketch(("ddp", "timing"), int(world_size), steps, timeout_s, output)


@validate.command()
@_with_options
@_rank_errors
def fsdp(world_size: str, steps: int, timeout_s: float, output: str | None) -> None:
    """FSDP sketch on real gloo ranks: bit-exact round trip, 1/N parameter bytes, shard grads."""
    _run_sketch(("fsdp",), int(world_size), steps, timeout_s, output)
