"""``collsim validate``: measure with torch.distributed, calibrate a topology, compare.

Thin wrappers over :mod:`collsim.validate`; torch is imported only by the subcommands that run
ranks. A rank that fails ends the command with exit code 1 and a message naming the rank
(:class:`~collsim.validate.measure.launch.RankFailure` carries its code; ``collsim.cli`` maps it). Every
output path is checked before anything is measured; no command creates a folder it was not
given (``holdout --out-dir`` creates that one folder, inside an existing one).
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

import click

from collsim.cli.common import OneLineGroup, check_output_path
from collsim.core.errors import ConfigError

if TYPE_CHECKING:
    from collsim.validate.measure.step import StepConfig

__all__ = ["validate"]


def _size(ctx: click.Context, param: click.Parameter, value: str) -> int:
    # start-up: loaded only when this runs (--help and bad input stay fast)
    from collsim.core.units import parse_size

    try:
        return parse_size(value)
    except ValueError as exc:
        raise click.BadParameter(str(exc)) from None


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


def _world_sizes(ctx: click.Context, param: click.Parameter, value: str) -> list[int]:
    try:
        sizes = [int(s) for s in value.split(",") if s.strip()]
    except ValueError:
        raise click.BadParameter(f"expected comma-separated integers, got {value!r}") from None
    if not sizes or any(n < 1 for n in sizes):
        raise click.BadParameter(f"expected world sizes >= 1, got {value!r}")
    return sizes


@click.group(cls=OneLineGroup)
def validate() -> None:
    """Measure collectives and training steps with torch.distributed and compare with collsim."""


@validate.command()
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


@validate.command()
@_with_options
def ddp(world_size: str, steps: int, timeout_s: float, output: str | None) -> None:
    """DDP from scratch on real gloo ranks: equivalence, sync, AVG vs SUM/N, overlap (timed)."""
    _run_sketch(("ddp", "timing"), int(world_size), steps, timeout_s, output)


@validate.command()
@_with_options
def fsdp(world_size: str, steps: int, timeout_s: float, output: str | None) -> None:
    """FSDP sketch on real gloo ranks: bit-exact round trip, 1/N parameter bytes, shard grads."""
    _run_sketch(("fsdp",), int(world_size), steps, timeout_s, output)


_SUBSET = click.Choice(["all", "even", "odd"])


_FABRIC_KINDS = ("nccl-tests", "nccl-tests-json", "rccl-tests")


def _check_output(path: str | None, hint: str) -> None:
    """An output file's folder must exist (checked before any work; none is created)."""
    if path is not None and not Path(path).resolve().parent.is_dir():
        raise click.BadParameter(
            f"folder {str(Path(path).parent)!r} does not exist", param_hint=hint
        )


#: The most rows one measured file may hold for calibrate, holdout and compare: every row is
#: fitted (a robust line per knee candidate, time linear in the rows) or simulated. A bench of
#: every op and 40 sizes has about 300 rows; 10,000 rows took 17 s to calibrate on 2 cores.
MAX_MEASURED_ROWS = 5_000


def _read_all(paths: tuple[str, ...] | list[str], op: str | None = None) -> list[Any]:
    """The measured files, each of at most :data:`MAX_MEASURED_ROWS` rows (ConfigError)."""
    # start-up: loaded only when this runs (--help and bad input stay fast)
    from collsim.validate.data.dataset import read_measurements

    files = [read_measurements(path, op) for path in paths]
    for meas in files:
        if len(meas.rows) > MAX_MEASURED_ROWS:
            raise ConfigError(
                f"{len(meas.rows):,} measured rows, above the limit of {MAX_MEASURED_ROWS:,} "
                "per file (a bench of every op and size has a few hundred); split the file",
                file=meas.path,
            )
    return files


def _op_option(ctx: click.Context, param: click.Parameter, value: str | None) -> str | None:
    """``--op``: collsim's name of the collective (nccl-tests' spellings accepted)."""
    if value is None:
        return None
    # start-up: loaded only when this runs (--help and bad input stay fast)
    from collsim.validate.data.dataset import OPS, canonical_op

    op = canonical_op(value)
    if op is None:
        raise click.BadParameter(f"unknown op {value!r} (choose from {', '.join(OPS)})")
    return op


_OP_HELP = (
    "The collective of logs that do not say (rccl-tests and older nccl-tests print no "
    "'Collective test starting' line), e.g. all_reduce."
)


@validate.command()
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


def _is_fabric(files: list[Any], base: str | None) -> bool:
    """An NCCL multi-node fit: nccl-tests input, or an NCCL base topology."""
    if any(m.kind in _FABRIC_KINDS for m in files):
        return True
    if base is None:
        return False
    return _library(base) == "nccl"


def _library(base: str) -> str:
    # start-up: loaded only when this runs (--help and bad input stay fast)
    from collsim.cluster.topology import resolve_topology_path
    from collsim.core.yamlio import load_yaml

    doc = load_yaml(resolve_topology_path(base))
    return str((doc.data.get("collectives") or {}).get("library", "nccl"))


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


@validate.command()
@click.argument("measured", nargs=-1, required=True, type=click.Path(exists=True, dir_okay=False))
@click.option("--topology", required=True, help="Topology file or name to simulate on.")
@click.option("--subset", type=_SUBSET, default="all", show_default=True)
@click.option(
    "--min-size",
    "min_size",
    default="0",
    callback=_size,
    show_default=True,
    help="Summarise only sizes >= this.",
)
@click.option(
    "--plot",
    "plot_path",
    type=click.Path(dir_okay=False),
    default=None,
    help="Write the log-log plot here (default: beside each measurement, .png).",
)
@click.option("--json", "json_path", type=click.Path(dir_okay=False), default=None)
@click.option(
    "--csv",
    "csv_path",
    type=click.Path(dir_okay=False),
    default=None,
    help="Write the points in the collective CSV schema, with simulated_us and error.",
)
@click.option("--op", "op", default=None, callback=_op_option, help=_OP_HELP)
def compare(
    measured: tuple[str, ...],
    topology: str,
    subset: str,
    min_size: int,
    plot_path: str | None,
    json_path: str | None,
    csv_path: str | None,
    op: str | None,
) -> None:
    """Simulate exactly the measured points and print the error of each, plus a summary."""
    # start-up: loaded only when this runs (--help and bad input stay fast)
    from collsim.validate.check.compare import compare as run_compare
    from collsim.validate.check.compare import (
        format_comparison,
        plot_comparison,
        summarize,
        topology_for,
    )

    if len(measured) > 1 and (plot_path or json_path or csv_path):
        raise click.BadParameter(
            "give one measurement with --plot, --json or --csv", param_hint="MEASURED"
        )
    check_output_path(csv_path, "--csv", suffixes=(".csv",))
    check_output_path(plot_path, "--plot", suffixes=(".png", ".svg"))
    check_output_path(json_path, "--json", suffixes=(".json",))
    for meas in _read_all(measured, op):
        topo = topology_for(topology, meas)
        points = run_compare(meas, topo, subset=subset, min_bytes=min_size)
        if not points:
            raise ConfigError("no measured points in the selected sizes", file=meas.path)
        summary = summarize(points)
        click.echo(
            format_comparison(
                points,
                summary,
                header=(
                    f"{meas.path} (world size {meas.world_size}, {meas.num_nodes} node(s)) vs "
                    f"{topo.name}, {subset} sizes >= {min_size} B; error = (simulated - "
                    f"measured) / measured"
                ),
            )
        )
        out_plot = plot_path or str(Path(meas.path).with_suffix(".png"))
        plot_comparison(
            points,
            topo,
            out_plot,
            title=f"{Path(meas.path).name} vs {topo.name} (n={meas.world_size})",
        )
        click.echo(f"# wrote {out_plot}", err=True)
        if csv_path:
            _write_compared_csv(csv_path, meas, points, topology)
            click.echo(f"# wrote {csv_path}", err=True)
        if json_path:
            Path(json_path).write_text(
                json.dumps(
                    {
                        "measured": meas.path,
                        "topology": topology,
                        "subset": subset,
                        "min_bytes": min_size,
                        "points": [
                            {
                                "op": p.op,
                                "size_bytes": p.size_bytes,
                                "measured_s": p.measured_s,
                                "simulated_s": p.simulated_s,
                                "error": p.error,
                                "algorithm": p.algorithm,
                            }
                            for p in points
                        ],
                        "summary": [vars_of(s) for s in summary],
                    },
                    indent=1,
                )
                + "\n"
            )
            click.echo(f"# wrote {json_path}", err=True)


def _write_compared_csv(path: str, meas: Any, points: list[Any], topology: str) -> None:
    """The compared points as schema rows: the measured row, the simulator's choice as
    algorithm/protocol, simulated_us and error."""
    # start-up: loaded only when this runs (--help and bad input stay fast)
    from collsim.validate.data.dataset import write_measurements

    rows = []
    by_key: dict[tuple[str, int], dict[str, Any]] = {}
    for row in meas.rows:
        by_key.setdefault((row["op"], int(row["size_bytes"])), row)
    for p in points:
        row = dict(by_key[(p.op, p.size_bytes)])
        row["time_us"] = p.measured_s * 1e6
        row.update(
            algorithm=p.algorithm,
            protocol=p.protocol,
            simulated_us=p.simulated_s * 1e6,
            error=p.error,
        )
        row.setdefault("nodes", meas.num_nodes)
        rows.append(row)
    metadata = {
        "tool": "collsim validate compare",
        "measured": meas.path,
        "topology": topology,
        "world_size": meas.world_size,
        "ranks_per_node": meas.ranks_per_node,
        "num_nodes": meas.num_nodes,
    }
    if not path.endswith(".csv"):
        raise ConfigError(f"must end in .csv, got {Path(path).name!r}", key_path="--csv")
    write_measurements(path, rows, metadata)


def vars_of(obj: Any) -> dict[str, Any]:
    """A slotted dataclass as a dict."""
    # start-up: loaded only when this runs (--help and bad input stay fast)
    from dataclasses import asdict

    return asdict(obj)


@validate.command()
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


@validate.command()
@click.option(
    "--world-sizes",
    default="2,4",
    show_default=True,
    callback=_world_sizes,
    help="Comma-separated world sizes to measure and simulate.",
)
@click.option("--backend", type=click.Choice(["gloo", "nccl"]), default="gloo", show_default=True)
@click.option(
    "--topology",
    default=None,
    help="Calibrated topology to simulate on; default: measure collectives at each "
    "world size and calibrate first (in this command).",
)
@click.option("--iters", type=click.IntRange(1), default=10, show_default=True)
@click.option("--warmup", type=click.IntRange(0), default=3, show_default=True)
@click.option("--layers", type=click.IntRange(1), default=4, show_default=True)
@click.option("--hidden", type=click.IntRange(8), default=256, show_default=True)
@click.option("--micro-batch", type=click.IntRange(1), default=2, show_default=True)
@click.option(
    "--target",
    type=click.FloatRange(0, 1),
    default=0.15,
    show_default=True,
    help="|simulated - measured| / measured allowed for DDP steps.",
)
@click.option(
    "--timeout", "timeout_s", type=click.FloatRange(min=1), default=900.0, show_default=True
)
@click.option(
    "-o",
    "--output",
    type=click.Path(dir_okay=False),
    default=None,
    help="JSON report (measured, profiled, simulated).",
)
@click.option(
    "--straggler-rank",
    type=click.IntRange(0),
    default=None,
    help="Slow this rank on purpose: every DDP mode is also timed with it running its "
    "compute --straggler-repeat times, and simulated with that rank at clock 1/repeat.",
)
@click.option("--straggler-repeat", type=click.IntRange(2), default=2, show_default=True)
@click.option(
    "--straggler-delay-ms",
    type=click.FloatRange(min=0),
    default=0.0,
    show_default=True,
    help="Slow the rank with a busy loop of this many ms on the wall clock instead of "
    "repeated compute (0: repeat).",
)
@click.option(
    "--progress",
    "progress_path",
    type=click.Path(dir_okay=False),
    default=None,
    help="Append every iteration's timings to PATH.rank<r>.jsonl as they are taken.",
)
@click.option(
    "--device-profile",
    "device_profile",
    type=click.Path(exists=True, dir_okay=False),
    default=None,
    help="Device profile from `collsim validate compute`: simulate the compute with the "
    "compute model fed by it (no block profile of this model, no scaling to the step).",
)
@click.option(
    "--profile-dir",
    "profile_dir",
    type=click.Path(file_okay=False),
    default=None,
    help="After the timed steps, trace 3 more steps of each mode with the torch profiler "
    "(CPU activities, shapes): DIR/n<N>_<mode>_rank<r>.json.gz, for `validate trace`.",
)
def step(
    world_sizes: list[int],
    backend: str,
    topology: str | None,
    iters: int,
    warmup: int,
    layers: int,
    hidden: int,
    micro_batch: int,
    target: float,
    timeout_s: float,
    output: str | None,
    straggler_rank: int | None,
    straggler_repeat: int,
    straggler_delay_ms: float,
    progress_path: str | None,
    device_profile: str | None,
    profile_dir: str | None,
) -> None:
    """Time real DDP (bucket 1 and 25 MB) and FSDP-sketch steps of a small GPT; simulate them."""
    # start-up: loaded only when this runs (--help and bad input stay fast)
    import tempfile

    # start-up: loaded only when this runs (--help and bad input stay fast)
    from collsim.validate.measure.launch import in_torchrun
    from collsim.validate.measure.step import StepConfig, run_step

    sizes: list[int | None] = list(world_sizes)
    if in_torchrun():
        sizes = [None]  # the job's own world size
    cfg = StepConfig(
        num_layers=layers,
        hidden=hidden,
        ffn_hidden=4 * hidden,
        micro_batch=micro_batch,
        iters=iters,
        warmup=warmup,
        straggler_rank=straggler_rank,
        straggler_repeat=straggler_repeat,
        straggler_delay_s=straggler_delay_ms / 1e3,
        progress_path=progress_path,
        profile_dir=None if profile_dir is None else str(Path(profile_dir).resolve()),
    )
    check_output_path(output, "-o/--output", suffixes=(".json",))
    _check_step_before_work(cfg, [n for n in sizes if n is not None])
    # removed when the command ends, however it ends (click closes the context)
    ctx = click.get_current_context()
    folder = Path(ctx.with_resource(tempfile.TemporaryDirectory(prefix="collsim-step-")))
    reports = []
    failures: list[str] = []
    for n in sizes:
        # Steps and their calibration run under the default policy: with more ranks than
        # cores, SCHED_RR lets a rank keep a core for a whole 100 ms quantum, so the profiled
        # blocks see an unshared core that the real step does not have.
        topo_spec = topology or str(_calibrate_here(n, backend, timeout_s, folder))
        report, is_reporter = run_step(cfg, world_size=n, backend=backend, timeout_s=timeout_s)
        if not is_reporter:
            continue
        n = int(report["world_size"])
        topo, overlap, simulated, other = _simulate_step(report, topo_spec, device_profile)
        _echo_step_notes(report, cfg, topo, topo_spec, overlap, other, device_profile)
        if report.get("traces"):
            shares = ", ".join(f"{m} {v:.2f}" for m, v in report["traces"]["cpu_share"].items())
            click.echo(
                f"# traced {cfg.trace_steps} steps per mode into {profile_dir} (rank 0's thread "
                f"got {shares} of a core over them)"
            )
        failures += _echo_step_modes(report, simulated, target, n)
        failures += _echo_straggler(
            report, cfg, topo, overlap, simulated, target, n, straggler_delay_ms
        )
        failures += _echo_bucket_effect(report, simulated, n)
        reports.append(report)
    if output and reports:
        Path(output).write_text(json.dumps(reports, indent=1) + "\n")
        click.echo(f"# wrote {output}", err=True)
    if failures:
        raise click.ClickException(f"outside the target: {', '.join(failures)}")


#: Copies of the parameters a rank of ``validate step`` holds at once: the parameters, their
#: gradients, DDP's bucket views of them and FSDP's gathered copy (SGD keeps no state).
_STEP_PARAMETER_COPIES = 4


def _check_step_before_work(cfg: Any, world_sizes: list[int]) -> None:
    """What ``validate step`` can refuse before it starts a rank: a slowed rank outside the
    smallest world size, a hidden size the heads do not divide, a model the ranks cannot hold
    in this machine's available memory."""
    # start-up: loaded only when this runs (--help and bad input stay fast)
    from collsim.validate.measure.bench import RANK_BASE_BYTES, available_memory_bytes

    if cfg.straggler_rank is not None and world_sizes and cfg.straggler_rank >= min(world_sizes):
        raise click.BadParameter(
            f"must be < the smallest world size ({min(world_sizes)}), got {cfg.straggler_rank}",
            param_hint="--straggler-rank",
        )
    if cfg.hidden % cfg.num_heads:
        raise click.BadParameter(
            f"must be a multiple of the {cfg.num_heads} heads, got {cfg.hidden}",
            param_hint="--hidden",
        )
    h, ffn = cfg.hidden, cfg.ffn_hidden
    params = (
        cfg.num_layers * (4 * h * h + 2 * h * ffn + 9 * h + ffn) + (cfg.vocab + cfg.seq_len) * h
    )
    per_rank = RANK_BASE_BYTES + _STEP_PARAMETER_COPIES * 4 * params
    need = max(world_sizes, default=1) * per_rank
    have = available_memory_bytes()
    if have is not None and need > have:
        raise click.BadParameter(
            f"a model of {params:,} fp32 parameters needs about {need / 2**30:.1f} GiB on "
            f"{max(world_sizes, default=1)} ranks ({_STEP_PARAMETER_COPIES} copies each), this "
            f"machine has {have / 2**30:.1f} GiB available; use a smaller --hidden or --layers",
            param_hint="--hidden/--layers",
        )


def _simulate_step(
    report: dict[str, Any], topo_spec: str, device_profile: str | None
) -> tuple[Any, bool, dict[str, Any], dict[str, Any]]:
    """The measured step simulated on ``topo_spec``, DDP's all-reduces overlapping backward
    or not as the cores allow, and the other choice; the report gets what was simulated.

    Returns:
        The topology, whether DDP overlaps, the simulated modes and the other choice's.
    """
    # start-up: loaded only when this runs (--help and bad input stay fast)
    from collsim.cluster.topology import load_topology
    from collsim.validate.check.step import cores_busy, simulate_modes

    n = int(report["world_size"])
    per_node = int(report.get("local_world_size", n))
    topo = load_topology(topo_spec, nodes=max(1, n // per_node), gpus_per_node=per_node)
    overlap = not cores_busy(report)
    simulated = simulate_modes(report, topo, overlap=overlap, device_profile=device_profile)
    other = simulate_modes(report, topo, overlap=not overlap, device_profile=device_profile)
    if device_profile is not None:
        # start-up: loaded only when this runs (--help and bad input stay fast)
        from collsim.validate.check.step import profile_device

        _, share, memory_share = profile_device(report, device_profile)
        report["device_profile"] = device_profile
        report["cpu_share"] = share
        report["cpu_share_memory"] = memory_share
    report["topology"] = topo_spec
    report["ddp_overlap_simulated"] = overlap
    report["simulated"] = {m: vars_of(s) for m, s in simulated.items()}
    report["simulated_other_overlap"] = {m: vars_of(s) for m, s in other.items()}
    return topo, overlap, simulated, other


def _echo_step_notes(
    report: dict[str, Any],
    cfg: StepConfig,
    topo: Any,
    topo_spec: str,
    overlap: bool,
    other: dict[str, Any],
    device_profile: str | None,
) -> None:
    """Print what the simulation assumed: DDP's overlap (or the in-situ CPU sharing), the
    model, the profiled blocks, where the compute comes from and the probes timed alone."""
    n = int(report["world_size"])
    if report.get("insitu_topology_yaml"):
        # start-up: loaded only when this runs (--help and bad input stay fast)
        from collsim.validate.measure.insitu import sharing_factor

        scope = "this session's" if report.get("sched_autogroup") else "every"
        click.echo(
            "# DDP all-reduces simulated overlapping backward; the ranks' CPU is shared by "
            f"{scope} runnable threads: the local step's thread got "
            f"{report.get('local_cpu_share', 1.0):.2f} of a core, so compute and a "
            f"collective beside it each run {sharing_factor(report):.2f}x slower "
            "(collsim.validate.measure.insitu)"
        )
    else:
        click.echo(
            f"# DDP all-reduces simulated {'overlapping' if overlap else 'after'} "
            f"backward ({report['world_size']} ranks x {report.get('threads_per_rank')} "
            f"thread(s) on {report.get('cpu_count')} cores); the other choice gives "
            + ", ".join(
                f"{m} {o.step_time_s * 1e3:.1f} ms" for m, o in other.items() if m.startswith("ddp")
            )
        )
    click.echo(
        f"# world size {n}, {report['num_parameters']} parameters, micro-batch "
        f"{cfg.micro_batch} x seq {cfg.seq_len}, topology {topo_spec}"
    )
    click.echo(
        "# profiled per block (ms): "
        + ", ".join(f"{k} {v * 1e3:.2f}" for k, v in sorted(report["profile"].items()))
    )
    if device_profile is None:
        click.echo(
            f"# a whole step without communication: {report['local_step_s'] * 1e3:.1f} "
            f"ms (slowest rank, median); the profiled blocks add up to "
            f"{report['profile_sum_s'] * 1e3:.1f} ms, so the simulated compute is "
            f"scaled by {report['compute_scale']:.3f}"
        )
    else:
        click.echo(
            f"# compute from the model fed by {device_profile} (rates / CPU share "
            f"{report['cpu_share']:.2f}, memory-bound rates / "
            f"{report.get('cpu_share_memory', report['cpu_share']):.2f}); for reference, a "
            f"whole step without "
            f"communication measured {report['local_step_s'] * 1e3:.1f} ms, the profiled "
            f"blocks {report['profile_sum_s'] * 1e3:.1f} ms (neither used)"
        )
    # start-up: loaded only when this runs (--help and bad input stay fast)
    from collsim.validate.measure.insitu import probe_summary

    lines = probe_summary(report, topo)
    if lines:
        click.echo(
            "# timed alone in the same loop (slowest rank, median): "
            + "; ".join(lines)
            + (
                "; collectives simulated on the topology fitted to these"
                if report.get("insitu_topology_yaml")
                else f" (not used: {report.get('insitu_note')})"
            )
        )


def _echo_step_modes(
    report: dict[str, Any], simulated: dict[str, Any], target: float, n: int
) -> list[str]:
    """Print measured against simulated per mode (each mode's error goes into the report);
    the DDP modes (without a straggler) outside ``target``."""
    click.echo(
        f"# {'mode':<9} {'measured(ms)':>12} {'min(ms)':>8} {'simulated(ms)':>13} "
        f"{'error':>7}  simulated breakdown (ms)"
    )
    failures = []
    for mode, meas in report["modes"].items():
        sim = simulated[mode]
        err = (sim.step_time_s - meas["median_s"]) / meas["median_s"]
        meas["error"] = err
        verdict = ""
        if mode.startswith("ddp") and not mode.endswith("+straggler"):
            verdict = "PASS" if abs(err) <= target else "FAIL"
            if verdict == "FAIL":
                failures.append(f"n={n} {mode}")
        parts = ", ".join(f"{k} {v * 1e3:.1f}" for k, v in sim.breakdown_s.items() if v)
        click.echo(
            f"  {mode:<9} {meas['median_s'] * 1e3:>12.1f} {meas['min_s'] * 1e3:>8.1f} "
            f"{sim.step_time_s * 1e3:>13.1f} {err * 100:>6.1f}%  {verdict:<4} {parts}"
        )
    return failures


def _echo_straggler(
    report: dict[str, Any],
    cfg: StepConfig,
    topo: Any,
    overlap: bool,
    simulated: dict[str, Any],
    target: float,
    n: int,
    straggler_delay_ms: float,
) -> list[str]:
    """Print the straggler slowdowns, measured and simulated (at the slowed rank's measured
    speed and at the nominal one; both go into the report); the ratios outside ``target``."""
    # start-up: loaded only when this runs (--help and bad input stay fast)
    from collsim.validate.check.step import simulate_modes, straggler_ratios

    ratios = straggler_ratios(
        report, simulate_modes(report, topo, overlap=overlap, measured_factor=True)
    )
    nominal = straggler_ratios(report, simulated)
    if ratios:
        report["straggler"] = ratios
        report["straggler_nominal_factor"] = nominal
        click.echo(
            f"# straggler: rank {cfg.straggler_rank} "
            + (
                f"spins {straggler_delay_ms:g} ms before its step; "
                if straggler_delay_ms
                else f"runs its compute {cfg.straggler_repeat}x; "
            )
            + "slowdown = straggler step / normal step of the same iteration (median over "
            "iterations); simulated with the slowed rank at its measured speed, local step "
            "/ (local step + its extra seconds), and at the nominal 1/repeat"
        )
    failures = []
    for base, r in ratios.items():
        ok = abs(r["error"]) <= target
        if not ok:
            failures.append(f"n={n} {base} straggler ratio")
        nom = nominal[base]
        click.echo(
            f"  {base:<9} measured {r['measured_ratio']:.3f}x (iterations "
            f"{r['measured_ratio_min']:.2f}-{r['measured_ratio_max']:.2f}; medians "
            f"{r['measured_straggler_s'] * 1e3:.1f} / {r['measured_normal_s'] * 1e3:.1f} ms;"
            f" extra {r['measured_extra_s'] * 1e3:.1f} ms), simulated "
            f"{r['simulated_ratio']:.3f}x at clock {r['simulated_clock_factor']:.3f}: "
            f"{r['error'] * 100:+.1f}% {'PASS' if ok else 'FAIL'}; at clock "
            f"{nom['simulated_clock_factor']:.3f}: {nom['simulated_ratio']:.3f}x "
            f"({nom['error'] * 100:+.1f}%)"
        )
    return failures


def _echo_bucket_effect(report: dict[str, Any], simulated: dict[str, Any], n: int) -> list[str]:
    """Print whether DDP's 25 MB buckets beat its 1 MB ones alike measured and simulated (into
    the report too); a failure when the signs differ."""
    modes = report["modes"]
    if "ddp_b1" not in modes or "ddp_b25" not in modes:
        return []
    measured_delta = modes["ddp_b25"]["median_s"] - modes["ddp_b1"]["median_s"]
    simulated_delta = simulated["ddp_b25"].step_time_s - simulated["ddp_b1"].step_time_s
    # a difference under the printed 0.1 ms, or under 0.5 % of the step, has no sign
    floor_s = max(BUCKET_EFFECT_FLOOR_S, BUCKET_EFFECT_FLOOR_SHARE * modes["ddp_b1"]["median_s"])
    measured_sign, simulated_sign = _sign(measured_delta, floor_s), _sign(simulated_delta, floor_s)
    same = measured_sign == simulated_sign
    report["bucket_effect"] = {
        "measured_s": measured_delta,
        "simulated_s": simulated_delta,
        "floor_s": floor_s,
        "same_sign": same,
    }
    verdict = "same sign" if same else "OPPOSITE SIGN"
    if not same and 0 in (measured_sign, simulated_sign):
        verdict = f"NOT THE SAME (a difference under {floor_s * 1e3:.2f} ms counts as none)"
    click.echo(
        f"# bucket 25 MB minus bucket 1 MB: measured {measured_delta * 1e3:+.1f} "
        f"ms, simulated {simulated_delta * 1e3:+.1f} ms -> {verdict}"
    )
    return [] if same else [f"n={n} bucket effect sign"]


#: Below this difference of two step times the bucket effect has no sign: the report prints
#: milliseconds to one decimal, so +0.0 ms is not a positive effect (0.1 ms).
BUCKET_EFFECT_FLOOR_S = 1e-4
#: ... nor is a difference under this share of the 1 MB-bucket step (0.5 %, a resolution chosen
#: well under the effect the check is for: the buckets change a gloo step by several percent).
BUCKET_EFFECT_FLOOR_SHARE = 0.005


def _sign(value: float, floor: float) -> int:
    """-1, 0 or +1: the sign of ``value``, 0 within ``floor`` of zero."""
    return 0 if abs(value) < floor else (1 if value > 0 else -1)


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


@validate.command()
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


@validate.command()
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


def _calibrate_here(world_size: int | None, backend: str, timeout_s: float, folder: Path) -> Path:
    """Measure the collectives a step uses at this world size and calibrate a topology."""
    # start-up: loaded only when this runs (--help and bad input stay fast)
    from collsim.validate.data.dataset import read_measurements, write_measurements
    from collsim.validate.fit.calibrate import calibrate as fit
    from collsim.validate.fit.calibrate import write_topology
    from collsim.validate.measure.bench import BenchConfig, run_bench, sizes_between

    config = BenchConfig(
        ops=("all_reduce", "all_gather", "reduce_scatter", "broadcast", "send_recv"),
        sizes_bytes=tuple(sizes_between("64K", "16M", 2)),
        iters=10,
        warmup=2,
        rounds=2,
    )
    result, _ = run_bench(config, world_size=world_size, backend=backend, timeout_s=timeout_s)
    n = result.metadata["world_size"]
    csv_path = write_measurements(folder / f"bench_n{n}.csv", result.rows(), result.metadata)
    cal = fit(read_measurements(csv_path))
    path = write_topology(cal, folder / f"calibrated_n{n}.yaml")
    click.echo(f"# calibrated {path} from {csv_path}")
    return path


# --- validate trace: a PyTorch profiler trace, broken down and compared --------------------


@validate.command("trace")
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
    from collsim.validate.fit.trace_profile import gemm_shapes

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

        learned = profile_from_traces(read, base=base)
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
                f"{len(unseen)} not (priced from the nearest profile row"
                + (f": {', '.join('x'.join(map(str, s)) for s in unseen[:8])}" if unseen else "")
                + ")"
            )
        if trace_out:
            # start-up: loaded only when this runs (--help and bad input stay fast)
            from collsim.validate.check.trace import write_side_by_side

            click.echo(f"# wrote {write_side_by_side(trace_out, read, compared)}", err=True)
