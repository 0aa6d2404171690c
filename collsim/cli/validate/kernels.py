"""``collsim validate kernels``: a measured device profile against a device's compute model."""

from __future__ import annotations

from pathlib import Path

import click

from collsim.cli.common import OneLineCommand, check_output_path
from collsim.core.errors import ConfigError

__all__ = ["kernels"]


@click.command(cls=OneLineCommand)
@click.argument("profile", type=click.Path(dir_okay=False))
@click.option(
    "--device",
    required=True,
    help="Device whose compute model to compare with: a catalogue key (h200, cpu...) or a "
    "device file.",
)
@click.option(
    "--execution",
    type=click.Choice(["eager", "compiled", "cuda_graphs"]),
    default="eager",
    show_default=True,
    help="Host issue cost per kernel the model charges (as training.execution).",
)
@click.option("--summary", is_flag=True, help="Print only the per-kind summary.")
@click.option(
    "-o",
    "--output",
    type=click.Path(dir_okay=False),
    default=None,
    help="Write every row (measured and modelled rate and time, ratio) as CSV.",
)
def kernels(profile: str, device: str, execution: str, summary: bool, output: str | None) -> None:
    """Compare a measured device profile, kernel by kernel, with a device's compute model:
    measured and modelled time and rate, their ratio, and the median and worst ratio per
    kernel kind (ratio = measured / modelled time)."""
    # start-up: loaded only when this runs (--help and bad input stay fast)
    from collsim.cluster.hardware import get_device, load_device_file
    from collsim.validate.check.kernels import (
        compare_kernels,
        format_rows,
        format_summary,
        summarize,
        write_csv,
    )

    check_output_path(output, "--output", suffixes=(".csv",))
    if not Path(profile).is_file():
        raise ConfigError("no such file", file=profile)
    measured = load_device_file(profile)
    model_device = get_device(device)
    rows, skipped = compare_kernels(measured, model_device, execution=execution)
    if not rows:
        raise ConfigError("no measured kernel the model can price", file=profile)
    header = (
        f"{profile} ({measured.name}) vs the compute model of {model_device.name} "
        f"({execution}); ratio = measured / modelled time"
    )
    click.echo(f"# {header}")
    if not summary:
        click.echo(format_rows(rows))
        click.echo("")
    click.echo(format_summary(summarize(rows)))
    for note in skipped:
        click.echo(f"# not compared: {note}")
    if output:
        write_csv(output, rows, header=[header, *(f"not compared: {n}" for n in skipped)])
        click.echo(f"# wrote {output}", err=True)
