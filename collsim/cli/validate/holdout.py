"""``collsim validate holdout``: calibrate on some sizes, compare on the sizes held out."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import click

from collsim.cli.common import OneLineCommand, check_output_path
from collsim.cli.validate.shared import _is_fabric, _read_all, _size
from collsim.core.errors import ConfigError

__all__ = ["holdout"]


@click.command(cls=OneLineCommand)
@click.argument("measured", nargs=-1, required=True, type=click.Path(exists=True, dir_okay=False))
@click.option("--min-size", "min_size", default="256K", callback=_size, show_default=True)
@click.option(
    "--target",
    type=click.FloatRange(0, 1),
    default=0.10,
    show_default=True,
    help="Median |error| each checked op must stay within.",
)
@click.option(
    "--ops",
    "check_ops",
    default="all_reduce,all_gather,broadcast",
    show_default=True,
    help="Ops held to the target (the others are reported on their own).",
)
@click.option(
    "--across-runs",
    is_flag=True,
    help="Judge each op at each world size by its typical run (the median over the "
    "files of that world size of their median |error|) instead of every file "
    "on its own.",
)
@click.option(
    "--out-dir",
    type=click.Path(file_okay=False),
    default=None,
    help="Keep the calibrated topologies and plots here.",
)
def holdout(
    measured: tuple[str, ...],
    min_size: int,
    target: float,
    check_ops: str,
    across_runs: bool,
    out_dir: str | None,
) -> None:
    """Calibrate on every other power of two, compare on the others (per measurement file)."""
    # start-up: loaded only when this runs (--help and bad input stay fast)
    from collsim.validate.check.compare import across_runs as group_runs

    held = _held_ops(check_ops)
    files = _read_all(measured)
    present = {op for meas in files for op in meas.ops()}
    if not present & set(held):
        raise click.BadParameter(
            f"none of {', '.join(held)} is in the measurements (they hold "
            f"{', '.join(sorted(present))}): nothing would be checked",
            param_hint="--ops",
        )
    _check_holdout_points(files, held, min_size)
    folder = _holdout_folder(out_dir)
    failures: list[str] = []
    per_run = []
    click.echo(
        f"# calibrate on even powers of two (1K, 4K, ...), compare on odd ones "
        f">= {min_size} B; target median |error| <= {target:.0%} for {', '.join(held)}"
    )
    click.echo(
        f"# {'file':<40} {'n':>2} {'op':<15} {'points':>6} {'median|err|':>11} "
        f"{'p90|err|':>9} {'max|err|':>9}  verdict"
    )
    fabric_path = _holdout_fabric(files, folder) if _is_fabric(files, None) else None
    for path, meas in zip(measured, files):
        summary, knees = _holdout_one(path, meas, fabric_path, folder, min_size)
        per_run.append((meas.world_size, summary))
        failures += _echo_holdout_rows(path, meas, summary, knees, held, target)
    runs = group_runs(per_run)
    if across_runs or any(len(r.run_errors) > 1 for r in runs):
        typical_failures = _echo_across_runs(runs, held, target, across_runs)
        if across_runs:
            failures = typical_failures
    if out_dir is not None:
        click.echo(f"# topologies and plots in {folder}")
    else:
        click.echo("# topologies and plots were temporary (keep them with --out-dir)")
    if failures:
        what = "typical-run " if across_runs else ""
        raise click.ClickException(
            f"{what}median |error| above {target:.0%}: {', '.join(failures)}"
        )


def _check_holdout_points(files: list[Any], held: tuple[str, ...], min_size: int) -> None:
    """Before any fit: every file has sizes to calibrate on (even powers of two) and to compare
    on (odd ones of at least ``min_size``), and the held ops have at least one of the latter."""
    # start-up: loaded only when this runs (--help and bad input stay fast)
    from collsim.validate.fit.calibrate import select_rows

    compared = 0
    for meas in files:
        if not select_rows(meas.rows, "even"):
            raise ConfigError("no even power-of-two sizes to calibrate on", file=meas.path)
        odd = select_rows(meas.rows, "odd", min_bytes=min_size)
        if not odd:
            raise ConfigError(
                f"no odd power-of-two size of at least {min_size} B to compare on "
                "(--min-size): nothing would be checked",
                file=meas.path,
            )
        compared += sum(1 for row in odd if row["op"] in held)
    if not compared:
        raise click.BadParameter(
            f"no odd power-of-two size of at least {min_size} B of {', '.join(held)} in the "
            "measurements: nothing would be checked",
            param_hint="--min-size/--ops",
        )


def _held_ops(check_ops: str) -> tuple[str, ...]:
    """The ops of ``--ops`` (comma-separated), each a canonical op name."""
    # start-up: loaded only when this runs (--help and bad input stay fast)
    from collsim.validate.data.dataset import OPS, canonical_op

    held = tuple(o.strip() for o in check_ops.split(",") if o.strip())
    unknown = [o for o in held if canonical_op(o) != o]
    if unknown or not held:
        raise click.BadParameter(
            f"unknown op(s) {', '.join(unknown) or '(none)'}; choose from {', '.join(OPS)}",
            param_hint="--ops",
        )
    return held


def _holdout_folder(out_dir: str | None) -> Path:
    """``--out-dir`` (created inside an existing, writable folder), else a temporary folder
    removed when the command ends."""
    # start-up: loaded only when this runs (--help and bad input stay fast)
    import tempfile

    if out_dir is not None:
        folder = Path(out_dir)
        if not folder.is_dir():
            check_output_path(folder, "--out-dir")  # inside an existing, writable folder
            folder.mkdir()
    else:
        # removed when the command ends, however it ends (click closes the context)
        ctx = click.get_current_context()
        folder = Path(ctx.with_resource(tempfile.TemporaryDirectory(prefix="collsim-holdout-")))
    return folder


def _holdout_one(
    path: str, meas: Any, fabric_path: Path | None, folder: Path, min_size: int
) -> tuple[list[Any], dict[str, Any]]:
    """One file calibrated on its even sizes (or simulated on the NCCL fit ``fabric_path``),
    compared on its odd ones and plotted: the summary per op, and each op's fit (none with
    the NCCL fit)."""
    # start-up: loaded only when this runs (--help and bad input stay fast)
    from collsim.validate.check.compare import compare as run_compare
    from collsim.validate.check.compare import plot_comparison, summarize, topology_for
    from collsim.validate.fit.calibrate import calibrate as fit
    from collsim.validate.fit.calibrate import write_topology

    stem = Path(path).stem
    knees: dict[str, Any] = {}
    if fabric_path is not None:  # nccl-tests: one NCCL fit on every file's even sizes
        topo = topology_for(fabric_path, meas)
    else:
        cal = fit(meas, subset="even")
        knees = dict(cal.ops)
        topo = topology_for(write_topology(cal, folder / f"{stem}_even.yaml"), meas)
    points = run_compare(meas, topo, subset="odd", min_bytes=min_size)
    plot_comparison(points, topo, folder / f"{stem}_odd.png")
    return summarize(points), knees


def _echo_holdout_rows(
    path: str,
    meas: Any,
    summary: list[Any],
    knees: dict[str, Any],
    held: tuple[str, ...],
    target: float,
) -> list[str]:
    """Print one file's line per op; the ``stem op`` of each held op above ``target``."""
    stem = Path(path).stem
    failures = []
    for s in summary:
        checked = s.op in held
        ok = s.median_abs_error <= target
        verdict = ("PASS" if ok else "FAIL") if checked else "(reported)"
        if checked and not ok:
            failures.append(f"{stem} {s.op}")
        op_fit = knees.get(s.op)
        knee = (
            ""
            if op_fit is None or op_fit.knee_bytes is None
            else f"  (knee at {op_fit.knee_bytes / 2**20:.3g} MiB)"
        )
        click.echo(
            f"  {Path(path).name:<40} {meas.world_size:>2} {s.op:<15} {s.count:>6} "
            f"{s.median_abs_error * 100:>10.1f}% {s.p90_abs_error * 100:>8.1f}% "
            f"{s.max_abs_error * 100:>8.1f}%  {verdict}{knee}"
        )
    return failures


def _echo_across_runs(
    runs: list[Any], held: tuple[str, ...], target: float, across_runs: bool
) -> list[str]:
    """Print the across-runs table (per world size and op); with ``across_runs`` (the typical
    run is the verdict), the ``n=N op`` of each held op whose typical run is above target."""
    click.echo(
        f"# across runs: per world size and op, the median |error| of each file, "
        f"their median (the typical run){' = the verdict' if across_runs else ''}, "
        f"and the runs within {target:.0%}"
    )
    click.echo(
        f"# {'n':>2} {'op':<15} {'runs':>4} {'median':>7} {'worst':>7} {'within':>6}  per run (%)"
    )
    typical_failures = []
    for r in runs:
        checked = r.op in held
        ok = r.median <= target
        if across_runs and checked and not ok:
            typical_failures.append(f"n={r.world_size} {r.op}")
        verdict = ""
        if across_runs:
            verdict = ("PASS" if ok else "FAIL") if checked else "(reported)"
        click.echo(
            f"  {r.world_size:>2} {r.op:<15} {len(r.run_errors):>4} "
            f"{r.median * 100:>6.1f}% {r.worst * 100:>6.1f}% "
            f"{r.passing(target):>3}/{len(r.run_errors):<2}  "
            + " ".join(f"{e * 100:.1f}" for e in r.run_errors)
            + (f"  {verdict}" if verdict else "")
        )
    return typical_failures


def _holdout_fabric(files: list[Any], folder: Path) -> Path:
    """The NCCL fit (calibrate_fabric) of every file's even powers of two, written to folder."""
    # start-up: loaded only when this runs (--help and bad input stay fast)
    import copy

    # start-up: loaded only when this runs (--help and bad input stay fast)
    from collsim.validate.fit.calibrate import select_rows
    from collsim.validate.fit.fabric import calibrate_fabric, write_fabric_topology

    evens = []
    for meas in files:
        even = copy.copy(meas)
        even.rows = select_rows(meas.rows, "even")
        if not even.rows:
            raise ConfigError("no even power-of-two sizes to calibrate on", file=meas.path)
        evens.append(even)
    return write_fabric_topology(calibrate_fabric(evens), folder / "nccl_even.yaml")
