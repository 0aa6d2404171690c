"""``collsim validate calibrate``: fit a topology to measured collectives."""

from __future__ import annotations

from typing import Any

import click

from collsim.cli.common import OneLineCommand, check_output_path
from collsim.cli.validate.shared import _OP_HELP, _SUBSET, _is_fabric, _op_option, _read_all, _size
from collsim.core.errors import ConfigError

__all__ = ["calibrate"]


@click.command(cls=OneLineCommand)
@click.argument("measured", nargs=-1, required=True, type=click.Path(exists=True, dir_okay=False))
@click.option(
    "-o",
    "--output",
    type=click.Path(dir_okay=False),
    required=True,
    help="Topology file to write (e.g. topologies/my_laptop.yaml).",
)
@click.option(
    "--base",
    default=None,
    help="Topology whose shape is kept (file or name); default: localhost for a gloo bench, "
    "the shipped file of the GPU an nccl-tests log names (dgx_h100, ...).",
)
@click.option("--name", default=None, help="Topology name (default: the file's stem).")
@click.option(
    "--subset",
    type=_SUBSET,
    default="all",
    show_default=True,
    help="Fit on all sizes, or every other power of two (even: 1K, 4K, ...).",
)
@click.option("--min-size", "min_size", default="0", callback=_size, show_default=True)
@click.option(
    "--max-size",
    "max_size",
    default=None,
    callback=lambda c, p, v: None if v is None else _size(c, p, v),
)
@click.option(
    "--algorithm",
    "pins",
    multiple=True,
    metavar="OP=ALG",
    help="Pin an op's algorithm (e.g. broadcast=tree); repeatable (gloo fit).",
)
@click.option(
    "--knees/--no-knees",
    default=True,
    show_default=True,
    help="Let an op have a second regime above a size (kept only when it halves "
    "the line's median |residual|; gloo fit).",
)
@click.option("--op", "op", default=None, callback=_op_option, help=_OP_HELP)
def calibrate(
    measured: tuple[str, ...],
    output: str,
    base: str | None,
    name: str | None,
    subset: str,
    min_size: int,
    max_size: int | None,
    pins: tuple[str, ...],
    knees: bool,
    op: str | None,
) -> None:
    """Fit a topology to measurements: a gloo bench (link latency, bandwidth, per-op
    algorithm/overhead/efficiency), or nccl-tests logs of one and more nodes (NVLink and NIC
    efficiency, latencies, fixed cost of a multi-node NCCL topology)."""
    # start-up: loaded only when this runs (--help and bad input stay fast)
    from collsim.validate.fit.calibrate import calibrate as fit
    from collsim.validate.fit.calibrate import select_rows, write_topology

    check_output_path(output, "-o/--output", suffixes=(".yaml", ".yml"))
    pinned = {}
    for pin in pins:
        op, sep, alg = pin.partition("=")
        if not sep:
            raise click.BadParameter(f"expected OP=ALG, got {pin!r}", param_hint="--algorithm")
        pinned[op.strip()] = alg.strip()
    files = _read_all(measured, op)
    for meas in files:
        meas.rows = select_rows(meas.rows, subset, min_bytes=min_size, max_bytes=max_size)
        if not meas.rows:
            raise ConfigError("no measured points in the selected sizes", file=meas.path)
    base = base or _recorded_base(files)
    if _is_fabric(files, base):
        if pinned:
            raise click.BadParameter(
                "pins are for a gloo fit; an NCCL fit keeps NCCL's own choice",
                param_hint="--algorithm",
            )
        _calibrate_fabric(files, base, output, name)
        return
    if len(files) != 1:
        raise click.BadParameter(
            f"a gloo fit takes one measurement, got {len(files)}", param_hint="MEASURED"
        )
    meas = files[0]
    cal = fit(
        meas,
        base=base or "localhost",
        subset="all",
        algorithms=pinned,
        knees=knees,
    )
    cal.subset = subset
    path = write_topology(cal, output, name)
    click.echo(
        f"# calibrated {meas.metadata.get('backend')} world size {cal.world_size} on "
        f"{subset} sizes: link latency {cal.link_latency_s * 1e6:.1f} us, "
        f"bandwidth {cal.link_bandwidth_bps / 1e9:.3f} GB/s"
    )
    click.echo(
        f"# {'op':<15} {'algorithm':<17} {'a(us)':>8} {'b(ns/B)':>8} "
        f"{'overhead(us)':>12} {'efficiency':>10} {'fit|err|':>8}  kernels"
    )
    for op, f in cal.ops.items():
        click.echo(
            f"  {op:<15} {f.algorithm:<17} {f.intercept_s * 1e6:>8.1f} "
            f"{f.seconds_per_byte * 1e9:>8.3f} {f.overhead_s * 1e6:>12.1f} "
            f"{f.efficiency:>10.3f} {f.fit_median_abs_error * 100:>7.1f}%  "
            f"{', '.join(f.kernels)}"
        )
        if f.knee_bytes is not None and f.knee_efficiency is not None:
            click.echo(
                f"  {'':<15} knee above {f.knee_bytes / 2**20:.3g} MiB: "
                f"+{f.extra_seconds_per_byte * 1e9:.3f} ns/B, efficiency "
                f"{f.knee_efficiency:.3f} (the line alone: median |err| "
                f"{f.line_median_abs_error * 100:.1f}%)"
            )
    for note in cal.notes:
        click.echo(f"# note: {note}")
    click.echo(f"# wrote {path}", err=True)


def _recorded_base(files: list[Any]) -> str | None:
    """The topology a simulated table names (``collective -F csv``, ``compare --csv``)."""
    names = {str(m.metadata["topology"]) for m in files if m.metadata.get("topology")}
    return names.pop() if len(names) == 1 else None


def _calibrate_fabric(files: list[Any], base: str | None, output: str, name: str | None) -> None:
    # start-up: loaded only when this runs (--help and bad input stay fast)
    from collsim.validate.fit.fabric import calibrate_fabric, write_fabric_topology

    cal = calibrate_fabric(files, base=base)
    path = write_fabric_topology(cal, output, name)
    click.echo(
        f"# calibrated {cal.base} on {len(files)} file(s), up to {cal.nodes} nodes x "
        f"{cal.gpus_per_node} GPUs: " + ", ".join(f"{k} {v:.4g}" for k, v in cal.values.items())
    )
    kept = [k for k in cal.fitted if k not in cal.decided]
    click.echo(
        f"# decided by the data: {', '.join(cal.decided) or 'none'}; kept from the base: "
        f"{', '.join(kept) or 'none'}"
    )
    click.echo(
        f"# {'file':<44} {'ranks':>5} {'nodes':>5} {'points':>6} {'base|err|':>9} "
        f"{'fit|err|':>8} {'max|err|':>8}  per algorithm/protocol: points median|err|"
    )
    for f in cal.files:
        choices = ", ".join(f"{k} {n} {e:.1%}" for k, (n, e) in f.by_choice.items())
        click.echo(
            f"  {f.path:<44} {f.ranks:>5} {f.nodes:>5} {f.points:>6} "
            f"{f.median_abs_error_before:>8.1%} {f.median_abs_error:>7.1%} "
            f"{f.max_abs_error:>7.1%}  {choices}"
        )
    for note in cal.notes:
        click.echo(f"# note: {note}")
    click.echo(f"# wrote {path}", err=True)
