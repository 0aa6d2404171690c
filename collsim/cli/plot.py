"""``collsim plot KIND ...``: draw results as PNG or SVG (matplotlib, Agg backend).

Kinds that read a CSV written by another command (no simulation):

- ``scaling SWEEP.csv``: speedup and efficiency vs GPUs per plan (``collsim sweep -o``);
- ``memory SWEEP.csv``: per-GPU memory vs GPUs per plan, stacked, with the HBM line;
- ``breakdown CSV``: step-time parts per plan (a sweep CSV, or a search CSV's estimates);
- ``collectives CSV...``: busbw vs size per algorithm (``collsim collective`` CSV files).

Kinds that simulate a scenario (or evaluate the closed form) first:

- ``timeline SCENARIO``: memory over one step for one rank;
- ``step SCENARIO``: one step at a glance (compute Gantt per stage above, memory below);
- ``pipeline SCENARIO``: Gantt chart per stage for several schedules side by side;
- ``collectives --topology T --gpus N``: busbw vs size from ``collectives.cost``.

Exit codes: 0 written; 1 the scenario is infeasible; 2 bad input (one line naming the key),
the same code ``collsim run`` gives for the same scenario (the plan is built the same way, by
:func:`collsim.study.job.run_job`); errors map to codes once, in ``collsim.cli``.
"""

from __future__ import annotations

import warnings
from pathlib import Path
from typing import TYPE_CHECKING, Any

import click

from collsim.cli.common import (
    OneLineGroup,
    check_output_path,
    limit_options,
    limits_from_options,
)
from collsim.core.errors import CollsimWarning, ConfigError, InfeasibleError
from collsim.core.vocab import ScheduleKind

if TYPE_CHECKING:  # pragma: no cover
    import pandas as pd
    from matplotlib.figure import Figure

__all__ = ["plot"]

_OUTPUT = click.option(
    "-o",
    "--output",
    required=True,
    type=click.Path(dir_okay=False, path_type=Path),
    help="Image to write: .png or .svg.",
)
_SERIES = click.option(
    "--series",
    default="plan",
    show_default=True,
    help="CSV column that names the series (one line / panel each).",
)
_TITLE = click.option("--title", help="Figure title.")


def _check_suffix(path: Path) -> None:
    if path.suffix.lower() not in (".png", ".svg"):
        raise ConfigError(f"image must end in .png or .svg, got {path.name!r}", key_path="--output")
    check_output_path(path, "--output")


def _save(fig: Figure, path: Path) -> None:
    # start-up: loaded only when this runs (--help and bad input stay fast)
    from collsim.report.plots import save_figure

    save_figure(fig, path)
    click.echo(f"wrote {path}", err=True)


def _read_csv(path: Path) -> pd.DataFrame:
    # start-up: loaded only when this runs (--help and bad input stay fast)
    import io

    # start-up: loaded only when this runs (--help and bad input stay fast)
    import pandas as pd

    # start-up: loaded only when this runs (--help and bad input stay fast)
    from collsim.core.yamlio import read_input_text

    text = read_input_text(path, what="CSV file")
    try:
        return pd.read_csv(io.StringIO(text), keep_default_na=True)
    except (OSError, UnicodeDecodeError, pd.errors.ParserError, pd.errors.EmptyDataError) as exc:
        raise ConfigError(
            f"cannot read CSV: {' '.join(str(exc).split())}", file=str(path)
        ) from None


def _sweep_frame(path: Path, series: str) -> pd.DataFrame:
    """A sweep or search CSV as a results frame (search ``est_*`` columns renamed)."""
    frame = _read_csv(path)
    if "compute_s" not in frame.columns and "est_compute_s" in frame.columns:
        renamed = {c: c[4:] for c in frame.columns if c.startswith("est_")}
        frame = frame.rename(columns=renamed)
    if series not in frame.columns:
        raise ConfigError(
            f"no column {series!r} in {path.name}; columns: {', '.join(map(str, frame.columns))}",
            key_path="--series",
        )
    values = frame[series].astype(object)
    frame[series] = values.where(values.notna(), "").astype(str)
    if (frame[series] == "").all():
        frame[series] = path.stem
    return frame


@click.group(
    name="plot", cls=OneLineGroup, context_settings={"help_option_names": ["-h", "--help"]}
)
def plot() -> None:
    """Draw scaling, memory, timeline, pipeline, breakdown and collective plots."""


@plot.command("scaling", short_help="Speedup and efficiency vs GPUs (sweep CSV).")
@click.argument("csv", type=click.Path(exists=True, dir_okay=False, path_type=Path))
@_OUTPUT
@_SERIES
@_TITLE
def scaling_cmd(csv: Path, output: Path, series: str, title: str | None) -> None:
    """Speedup and scaling efficiency vs GPUs from a `collsim sweep -o` CSV."""
    # start-up: loaded only when this runs (--help and bad input stay fast)
    from collsim.report.plots import plot_scaling

    _check_suffix(output)
    _save(plot_scaling(_sweep_frame(csv, series), series=series, title=title), output)


@plot.command("memory", short_help="Per-GPU memory vs GPUs, HBM line (sweep CSV).")
@click.argument("csv", type=click.Path(exists=True, dir_okay=False, path_type=Path))
@_OUTPUT
@_SERIES
@_TITLE
def memory_cmd(csv: Path, output: Path, series: str, title: str | None) -> None:
    """Per-GPU memory vs GPUs, stacked by category, with the HBM line (sweep CSV)."""
    # start-up: loaded only when this runs (--help and bad input stay fast)
    from collsim.report.plots import plot_memory

    _check_suffix(output)
    _save(plot_memory(_sweep_frame(csv, series), series=series, title=title), output)


@plot.command("breakdown", short_help="Step-time parts per plan (sweep/search CSV).")
@click.argument("csv", type=click.Path(exists=True, dir_okay=False, path_type=Path))
@_OUTPUT
@_SERIES
@_TITLE
@click.option(
    "--limit",
    type=click.IntRange(min=1),
    default=12,
    show_default=True,
    help="At most this many rows (the first ones).",
)
def breakdown_cmd(csv: Path, output: Path, series: str, title: str | None, limit: int) -> None:
    """Stacked bars of compute / exposed comm / bubble / optimizer per plan (sweep or search
    CSV)."""
    # start-up: loaded only when this runs (--help and bad input stay fast)
    from collsim.report.plots import plot_breakdown

    _check_suffix(output)
    frame = _sweep_frame(csv, series)
    if "feasible" in frame.columns:
        frame = frame[frame["feasible"].astype(bool)]
    _save(plot_breakdown(frame.head(limit), series=series, title=title), output)


def _simulate(
    scenario: Path, overrides: list[str], *, trace: bool = True, limits: Any = None
) -> Any:
    """The step as ``collsim run`` simulates it (same checks, same exit codes)."""
    # start-up: loaded only when this runs (--help and bad input stay fast)
    from collsim.study.job import run_job

    return run_job(scenario, overrides, trace=trace, limits=limits).result


@plot.command("timeline", short_help="Memory over one step for one rank.")
@click.argument("scenario", type=click.Path(dir_okay=False, path_type=Path))
@_OUTPUT
@_TITLE
@click.option("--rank", type=int, help="Rank to draw (default: the first simulated rank).")
@click.option(
    "--set", "overrides", multiple=True, metavar="KEY.PATH=VALUE", help="Override a scenario key."
)
@limit_options
def timeline_cmd(
    scenario: Path,
    output: Path,
    title: str | None,
    rank: int | None,
    overrides: tuple[str, ...],
    limit_values: dict[str, Any],
) -> None:
    """Memory in use over one simulated step of SCENARIO for one rank, with the HBM line."""
    # start-up: loaded only when this runs (--help and bad input stay fast)
    from collsim.report.plots import plot_memory_timeline
    from collsim.study.scenario import load_scenario

    _check_suffix(output)
    load_scenario(scenario, list(overrides))  # bad keys: exit 2 before simulating
    result = _simulate(scenario, list(overrides), limits=limits_from_options(limit_values))
    _save(plot_memory_timeline(result, rank=rank, title=title), output)


@plot.command("step", short_help="One step: compute Gantt and memory.")
@click.argument("scenario", type=click.Path(dir_okay=False, path_type=Path))
@_OUTPUT
@_TITLE
@click.option("--rank", type=int, help="Rank whose memory is drawn (default: the first).")
@click.option(
    "--set", "overrides", multiple=True, metavar="KEY.PATH=VALUE", help="Override a scenario key."
)
@limit_options
def step_cmd(
    scenario: Path,
    output: Path,
    title: str | None,
    rank: int | None,
    overrides: tuple[str, ...],
    limit_values: dict[str, Any],
) -> None:
    """One simulated step of SCENARIO: compute Gantt per stage and memory over time."""
    # start-up: loaded only when this runs (--help and bad input stay fast)
    from collsim.report.plots import plot_step
    from collsim.study.job import run_job

    _check_suffix(output)
    limits = limits_from_options(limit_values)
    job = run_job(scenario, list(overrides), trace=True, limits=limits)
    _save(plot_step(job.result, rank=rank, title=title or job.scenario.name), output)


@plot.command("pipeline", short_help="Gantt per stage, schedules side by side.")
@click.argument("scenario", type=click.Path(dir_okay=False, path_type=Path))
@_OUTPUT
@_TITLE
@click.option(
    "--schedules",
    default="gpipe,1f1b,interleaved",
    show_default=True,
    help="Schedules to draw, one panel each.",
)
@click.option(
    "--virtual-stages",
    type=click.IntRange(min=2),
    default=2,
    show_default=True,
    help="Model chunks per stage for the interleaved schedule.",
)
@click.option(
    "--set", "overrides", multiple=True, metavar="KEY.PATH=VALUE", help="Override a scenario key."
)
@limit_options
def pipeline_cmd(
    scenario: Path,
    output: Path,
    title: str | None,
    schedules: str,
    virtual_stages: int,
    overrides: tuple[str, ...],
    limit_values: dict[str, Any],
) -> None:
    """Gantt chart per pipeline stage (forward, backward, bubble) for each schedule."""
    # start-up: loaded only when this runs (--help and bad input stay fast)
    from collsim.report.plots import plot_pipeline
    from collsim.study.scenario import load_scenario

    _check_suffix(output)
    kinds = [s.strip() for s in schedules.split(",") if s.strip()]
    choices = [k.value for k in ScheduleKind]
    bad = [k for k in kinds if k not in choices]
    if bad or not kinds:
        raise ConfigError(
            f"must be some of {', '.join(choices)}; got {schedules!r}",
            key_path="--schedules",
        )
    load_scenario(scenario, list(overrides))  # bad keys: exit 2 before simulating
    results = {}
    for kind in kinds:
        extra = [
            f"parallel.schedule={kind}",
            f"parallel.virtual_stages={virtual_stages if kind == 'interleaved' else 1}",
        ]
        label = kind if kind != "interleaved" else f"interleaved (v={virtual_stages})"
        results[label] = _simulate(
            scenario, [*overrides, *extra], limits=limits_from_options(limit_values)
        )
    _save(plot_pipeline(results, title=title), output)


@plot.command("collectives", short_help="Bus bandwidth vs size per algorithm.")
@click.argument("csv_files", nargs=-1, type=click.Path(exists=True, dir_okay=False, path_type=Path))
@_OUTPUT
@_TITLE
@click.option("--topology", help="Evaluate the closed form on this topology instead of CSVs.")
@click.option("--gpus", type=int, default=8, show_default=True, help="Group size (closed form).")
@click.option(
    "--op",
    default=None,
    help="Collective op: the one drawn from the files (default: every op they hold, a line "
    "each), or evaluated on --topology (default: all_reduce).",
)
@click.option("-b", "--minbytes", default="1K", show_default=True, help="Smallest size.")
@click.option("-e", "--maxbytes", default="4G", show_default=True, help="Largest size.")
@click.option(
    "--algorithms",
    default="ring,tree,halving_doubling,direct,hierarchical,nvls",
    show_default=True,
    help="Algorithms to draw (closed form; inapplicable ones are left out).",
)
def collectives_cmd(
    csv_files: tuple[Path, ...],
    output: Path,
    title: str | None,
    topology: str | None,
    gpus: int,
    op: str | None,
    minbytes: str,
    maxbytes: str,
    algorithms: str,
) -> None:
    """Bus bandwidth vs message size per algorithm, from collective tables (`collsim collective
    -F csv`, `validate bench`, `validate compare --csv`, nccl-tests logs or -J JSON) or from
    the closed form on --topology."""
    # start-up: loaded only when this runs (--help and bad input stay fast)
    from collsim.report.plots import plot_collectives

    _check_suffix(output)
    if bool(csv_files) == bool(topology):
        raise ConfigError("give either CSV files or --topology", key_path="collectives")
    if csv_files:
        data = _measured_series([(path, collective_frame(path)) for path in csv_files], op)
    else:
        data = _closed_form(
            topology or "", gpus, op or "all_reduce", minbytes, maxbytes, algorithms
        )
    _save(plot_collectives(data, title=title), output)


def _measured_series(frames: list[tuple[Path, pd.DataFrame]], op: str | None) -> pd.DataFrame:
    """The files' rows of ``op`` (all ops when None) with one ``algorithm`` label per (file,
    op, ranks, algorithm): the op and the ranks are named where the files hold more than one,
    the file where two files share a label."""
    # start-up: loaded only when this runs (--help and bad input stay fast)
    import pandas as pd

    # start-up: loaded only when this runs (--help and bad input stay fast)
    from collsim.validate.data.dataset import canonical_op

    parts = []
    for path, frame in frames:
        frame = frame.copy()
        if "op" not in frame.columns:
            frame["op"] = ""
        frame["op"] = [(canonical_op(str(o)) or str(o)) if o else "" for o in frame["op"]]
        if "ranks" not in frame.columns:
            frame["ranks"] = 0
        frame["file"] = path.stem
        parts.append(frame)
    data = pd.concat(parts, ignore_index=True)
    if op is not None:
        wanted = canonical_op(op) or op
        present = sorted({str(o) for o in data["op"] if o})
        data = data[data["op"] == wanted]
        if data.empty:
            raise ConfigError(
                f"no {op} rows in the files (they hold {', '.join(present) or 'no op column'})",
                key_path="--op",
            )
    many_ops = data["op"].nunique() > 1
    many_ranks = data["ranks"].nunique() > 1
    labels = [
        str(a) + (f" {o}" if many_ops and o else "") + (f" n={r}" if many_ranks and r else "")
        for a, o, r in zip(data["algorithm"], data["op"], data["ranks"])
    ]
    data = data.assign(algorithm=labels)
    files_per_label = data.groupby("algorithm")["file"].nunique()
    shared = set(files_per_label[files_per_label > 1].index)
    data["algorithm"] = [
        f"{a} ({f})" if a in shared else a for a, f in zip(data["algorithm"], data["file"])
    ]
    return data.reset_index(drop=True)


def collective_frame(path: Path) -> pd.DataFrame:
    """A collective table as the plot's frame (``op, size_bytes, time_s, algbw_bps,
    busbw_bps, algorithm, protocol``), whatever wrote it: the CSV schema, a bench CSV, an
    nccl-tests or rccl-tests log, -J JSON (told apart by content), or a ``collective -F csv``
    file from before the schema. A measurement without an algorithm is one series named
    after the file ("... measured").

    Raises:
        ConfigError: the file cannot be read, or a value is bad (``file:line: column: ...``).
    """
    # start-up: loaded only when this runs (--help and bad input stay fast)
    import pandas as pd

    # start-up: loaded only when this runs (--help and bad input stay fast)
    from collsim.validate.data.dataset import read_measurements, read_text, sniff

    text = read_text(path)
    if sniff(text) == "csv":
        header = next(
            (line for line in text.splitlines() if line.strip() and not line.startswith("#")), ""
        )
        if "op" not in [c.strip() for c in header.split(",")]:
            # start-up: loaded only when this runs (--help and bad input stay fast)
            from collsim.report.frames import read_collective_csv

            return read_collective_csv(path)  # `collective -F csv` before the schema
    meas = read_measurements(path)
    # start-up: loaded only when this runs (--help and bad input stay fast)
    from collsim.validate.data.nccltests import bus_factor

    records = []
    for row in meas.rows:
        time_s = float(row["time_us"]) * 1e-6
        algbw = float(row.get("algbw_gbps", row["size_bytes"] / time_s / 1e9)) * 1e9
        busbw = row.get("busbw_gbps")
        busbw_bps = (
            float(busbw) * 1e9
            if busbw is not None
            else algbw * bus_factor(row["op"], int(row["world_size"]))
        )
        records.append(
            {
                "op": row["op"],
                "size_bytes": int(row["size_bytes"]),
                "time_s": time_s,
                "algbw_bps": algbw,
                "busbw_bps": busbw_bps,
                "algorithm": row.get("algorithm") or f"{path.stem} measured",
                "protocol": row.get("protocol", ""),
                "ranks": int(row.get("world_size") or 0),
            }
        )
    return pd.DataFrame.from_records(records)


def _closed_form(
    topology: str, gpus: int, op: str, minbytes: str, maxbytes: str, algorithms: str
) -> pd.DataFrame:
    # start-up: loaded only when this runs (--help and bad input stay fast)
    from collsim.collectives import Group
    from collsim.core.units import parse_size
    from collsim.core.vocab import Algorithm, CollectiveOp
    from collsim.report.frames import collective_cost_frame
    from collsim.study.sweep import cluster_for

    try:
        low, high = parse_size(minbytes), parse_size(maxbytes)
    except ValueError as exc:
        raise ConfigError(str(exc), key_path="--minbytes/--maxbytes") from None
    if low <= 0 or high < low:
        raise ConfigError(
            f"need 0 < minbytes <= maxbytes, got {minbytes}, {maxbytes}",
            key_path="--minbytes/--maxbytes",
        )
    try:
        CollectiveOp(op)
    except ValueError:
        raise ConfigError(
            f"must be one of {', '.join(o.value for o in CollectiveOp)}; got {op!r}",
            key_path="--op",
        ) from None
    names = [a.strip() for a in algorithms.split(",") if a.strip()]
    for name in names:
        try:
            Algorithm(name)
        except ValueError:
            raise ConfigError(
                f"must be one of {', '.join(a.value for a in Algorithm)}; got {name!r}",
                key_path="--algorithms",
            ) from None
    # start-up: loaded only when this runs (--help and bad input stay fast)
    from collsim.study.limits import check_ranks

    check_ranks(gpus, key_path="--gpus", option=None)
    try:
        topo = cluster_for(topology, gpus, None)
    except InfeasibleError as exc:
        raise ConfigError(str(exc), key_path="--gpus") from None
    sizes = []
    size = low
    while size <= high:
        sizes.append(size)
        size *= 2
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", CollsimWarning)
        frame = collective_cost_frame(op, sizes, Group.all(topo), names)
    if frame.empty:
        raise ConfigError(
            f"none of {algorithms} applies to {op} on {topo.name}", key_path="--algorithms"
        )
    return frame
