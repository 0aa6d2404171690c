"""``collsim validate ddp`` and ``fsdp``: data parallelism from scratch on real ranks, checked."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import click

from collsim.cli.common import OneLineCommand, check_output_path

__all__ = ["ddp", "fsdp"]


def _run_sketch(
    parts: tuple[str, ...], world_size: int, steps: int, timeout_s: float, output: str | None
) -> None:
    # start-up: loaded only when this runs (--help and bad input stay fast)
    from collsim.validate.measure.sketch import SketchConfig, check_report, run_sketch

    check_output_path(output, "-o/--output")
    report = run_sketch(
        SketchConfig(parts=parts, steps=steps), world_size=world_size, timeout_s=timeout_s
    )
    rows = check_report(report)
    click.echo(f"# {', '.join(parts)} from scratch on {world_size} {report['backend']} ranks")
    for name, ok, figure in rows:
        click.echo(f"{'PASS' if ok else 'FAIL'}  {name}: {figure}")
    report["checks"] = [{"check": n, "passed": ok, "figure": f} for n, ok, f in rows]
    if output:
        Path(output).write_text(json.dumps(report, indent=1) + "\n")
        click.echo(f"# wrote {output}", err=True)
    if not all(ok for _, ok, _ in rows):
        raise click.ClickException("some checks failed")


_SKETCH_OPTIONS = [
    click.option("--world-size", type=click.Choice(["2", "4"]), default="2", show_default=True),
    click.option("--steps", type=click.IntRange(1), default=5, show_default=True),
    click.option(
        "--timeout", "timeout_s", type=click.FloatRange(min=1), default=300.0, show_default=True
    ),
    click.option(
        "-o",
        "--output",
        type=click.Path(dir_okay=False),
        default=None,
        help="Write the JSON report here.",
    ),
]


def _with_options(fn: Callable[..., Any]) -> Callable[..., Any]:
    for option in reversed(_SKETCH_OPTIONS):
        fn = option(fn)
    return fn


@click.command(cls=OneLineCommand)
@_with_options
def ddp(world_size: str, steps: int, timeout_s: float, output: str | None) -> None:
    """DDP from scratch on real gloo ranks: equivalence, sync, AVG vs SUM/N, overlap (timed)."""
    _run_sketch(("ddp", "timing"), int(world_size), steps, timeout_s, output)


@click.command(cls=OneLineCommand)
@_with_options
def fsdp(world_size: str, steps: int, timeout_s: float, output: str | None) -> None:
    """FSDP sketch on real gloo ranks: bit-exact round trip, 1/N parameter bytes, shard grads."""
    _run_sketch(("fsdp",), int(world_size), steps, timeout_s, output)
