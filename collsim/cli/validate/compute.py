"""``collsim validate compute``: time a generic kernel grid and write a device profile."""

from __future__ import annotations

from typing import Any

import click

from collsim.cli.common import OneLineCommand, check_output_path
from collsim.core.errors import ConfigError

__all__ = ["compute"]


@click.command(cls=OneLineCommand)
@click.option(
    "-o",
    "--output",
    type=click.Path(dir_okay=False),
    required=True,
    help="Device profile to write (device schema; name it in a scenario's cluster.device).",
)
@click.option("--device", default="cpu", show_default=True, help="torch device: cpu or cuda.")
@click.option("--quick", is_flag=True, help="The small test grid (seconds, not minutes).")
@click.option(
    "--threads",
    type=click.IntRange(1),
    default=1,
    show_default=True,
    help="torch threads to time with (validate step's ranks run with 1).",
)
def compute(output: str, device: str, quick: bool, threads: int) -> None:
    """Time a generic kernel grid (GEMMs, attention, memory-bound ops, optimizer) on the local
    device and write a device profile that `collsim run` can use in place of the catalogue."""
    # start-up: loaded only when this runs (--help and bad input stay fast)
    import dataclasses

    # start-up: loaded only when this runs (--help and bad input stay fast)
    from collsim.validate.measure.compute import ComputeGrid, measure_profile, write_profile

    check_output_path(output, "-o/--output", suffixes=(".yaml", ".yml"))
    try:
        # start-up: loaded only when this runs (--help and bad input stay fast)
        import torch
    except ImportError:
        raise click.ClickException("validate compute needs torch (pip install torch)") from None
    if device.startswith("cuda") and not torch.cuda.is_available():
        raise ConfigError(f"torch {torch.__version__} sees no CUDA device", key_path="--device")
    grid = ComputeGrid.quick() if quick else ComputeGrid.full(device)
    grid = dataclasses.replace(grid, threads=threads)

    def checkpoint(partial: dict[str, Any]) -> None:
        # each section is on disk before the next starts: a run that is stopped keeps them
        write_profile(output, partial, device=device)
        click.echo(f"# {partial['notes']['sections']} written to {output}", err=True)

    measured = measure_profile(grid, device, on_section=checkpoint)
    path = write_profile(output, measured, device=device)
    best = max(r[4] for r in measured["gemm"])
    click.echo(
        f"# {len(measured['gemm'])} GEMMs (best {best * 1e3:.1f} GFLOP/s), "
        f"{len(measured['attention'])} attention points, {len(measured['bandwidth'])} "
        f"bandwidth points (best {max(r[1] for r in measured['bandwidth']):.1f} GB/s), "
        f"{len(measured.get('activation') or [])} activation points, "
        f"host {measured['host_us']:.2f} us per op, {threads} thread(s)"
    )
    click.echo(f"# wrote {path}", err=True)
