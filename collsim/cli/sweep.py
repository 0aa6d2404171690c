"""``collsim sweep SCENARIO``: simulate a scenario over GPU counts and scenario keys.

Data (the table) goes to stdout; the progress bar (only on a terminal), the list of infeasible
points and "wrote FILE" lines go to stderr. Exit codes: 0 at least one point ran and fits;
1 no point could run; 2 bad input (one line naming the key). Memory in the table is in GiB
(2**30 bytes), as ``collsim run`` reports it; ``-o`` writes bytes and seconds.
"""

from __future__ import annotations

import math
import sys
from pathlib import Path
from typing import TYPE_CHECKING, Any

import click

from collsim.cli.common import (
    OneLineCommand,
    check_frame_path,
    check_output_path,
    limit_options,
    limits_from_options,
)
from collsim.cli.journal import FrameJournal
from collsim.core.errors import ConfigError, InfeasibleError

if TYPE_CHECKING:  # pragma: no cover
    from collections.abc import Callable

    import pandas as pd
    from matplotlib.figure import Figure

    from collsim.study.sweep import SweepOutcome

__all__ = ["sweep", "sweep_table", "progress_reporter"]

_EPILOG = """\b
Examples:
  collsim sweep scenarios/3d_175b.yaml --gpus 64,128,...,4096 -o sweep.csv --plot scaling.png
  collsim sweep scenarios/3d_175b.yaml --gpus 512,1024,2048 --strong
  collsim sweep scenarios/ddp_gpt3_1.3b.yaml --gpus 8,16,...,256 --set parallel.zero=0,1,2,3
  collsim sweep scenarios/pipeline_13b_1f1b.yaml --set parallel.schedule=gpipe,1f1b
  collsim sweep scenarios/ddp_gpt3_1.3b.yaml --gpus 1,2,...,512 --plot scaling.png \\
      --plan 'DDP: parallel.zero=0, parallel.ddp.overlap=false' \\
      --plan 'FSDP / ZeRO-3: parallel.zero=3' \\
      --plan 'DDP + overlap: parallel.zero=0, parallel.ddp.overlap=true'
"""


@click.command(name="sweep", epilog=_EPILOG, cls=OneLineCommand)
@click.argument("scenario", type=click.Path(dir_okay=False, path_type=Path))
@click.option(
    "--gpus",
    "gpus_text",
    metavar="LIST",
    help="GPU counts, e.g. 64,128,...,4096 (a literal ... continues the doubling).",
)
@click.option(
    "--strong",
    is_flag=True,
    help="Strong scaling: keep the global batch (default: weak, it grows with dp).",
)
@click.option(
    "--grow",
    type=click.Choice(["dp", "tp", "pp"]),
    default="dp",
    show_default=True,
    help="The parallel axis that grows with the GPU count.",
)
@click.option(
    "--set",
    "set_texts",
    multiple=True,
    metavar="KEY.PATH=V1,V2,...",
    help="Sweep a scenario key over values, e.g. parallel.zero=0,1,2,3. Repeatable: "
    "the product is taken.",
)
@click.option(
    "--plan",
    "plan_texts",
    multiple=True,
    metavar="'NAME: KEY=V, KEY=V'",
    help="A named plan (a series in tables and plots), e.g. 'DDP + overlap: "
    "parallel.zero=0, parallel.ddp.overlap=true'. Repeatable; crossed with --set.",
)
@click.option(
    "-o",
    "--output",
    type=click.Path(dir_okay=False, path_type=Path),
    help="Write every result field of every point (seconds, bytes) to this .csv, .json "
    "(records) or .parquet (needs pyarrow) file.",
)
@click.option(
    "--plot",
    "plot_path",
    type=click.Path(dir_okay=False, path_type=Path),
    help="Draw the sweep (PNG or SVG): scaling when GPUs vary, else the breakdown.",
)
@click.option(
    "--plot-kind",
    type=click.Choice(["auto", "scaling", "memory", "breakdown"]),
    default="auto",
    show_default=True,
    help="What --plot draws.",
)
@click.option("--all-ranks", is_flag=True, help="Simulate every rank (slow on big jobs).")
@click.option(
    "--jobs",
    "-j",
    type=click.IntRange(min=1, max=256),
    default=None,
    help="Processes that simulate points (default: the cores this process may use).",
)
@click.option(
    "--scheduler",
    metavar="ADDRESS",
    help="Run the points on a Dask cluster (tcp://HOST:8786; needs collsim[cluster]) "
    "instead of this machine's cores.",
)
@click.option(
    "--resume",
    is_flag=True,
    help="Finish the sweep whose -o file an earlier run left (interrupted): its rows are "
    "kept as they are and the points after them are run.",
)
@limit_options
def sweep(
    scenario: Path,
    gpus_text: str | None,
    strong: bool,
    grow: str,
    set_texts: tuple[str, ...],
    plan_texts: tuple[str, ...],
    output: Path | None,
    plot_path: Path | None,
    plot_kind: str,
    all_ranks: bool,
    jobs: int | None,
    scheduler: str | None,
    resume: bool,
    limit_values: dict[str, Any],
) -> None:
    """Simulate SCENARIO at every GPU count of --gpus and every --set combination.

    With -o, the file is rewritten as points finish (at most once a second) and kept on
    Ctrl-C; --resume continues it."""
    if scheduler is not None:  # first: a wrong address is one line within seconds
        from collsim.core.jobs import check_scheduler  # start-up: loaded when run

        check_scheduler(scheduler)
    from collsim.core.jobs import default_jobs  # start-up: loaded when run
    from collsim.study.sweep import LimitedSimulate, check_overrides, run_sweep
    from collsim.study.sweep_grid import build_points, parse_gpus, parse_plan, parse_set

    gpus = parse_gpus(gpus_text) if gpus_text else None
    sets = [parse_set(text) for text in set_texts]
    plans = dict(parse_plan(text) for text in plan_texts) or None
    if plot_path is not None and plot_path.suffix.lower() not in (".png", ".svg"):
        raise ConfigError(
            f"image must end in .png or .svg, got {plot_path.name!r}", key_path="--plot"
        )
    check_frame_path(output, "--output")
    check_output_path(plot_path, "--plot")
    limits = limits_from_options(limit_values)
    from collsim.study.limits import check_ranks  # start-up: loaded when run

    for count in gpus or ():
        check_ranks(count, limits, key_path="--gpus")
    check_overrides(scenario, sets, gpus=gpus, grow=grow, plans=plans)
    points = build_points(gpus=gpus, sets=sets, plans=plans)
    prior = _resume_rows(output, points) if resume else None
    done = 0 if prior is None else len(prior)
    outcomes: list[SweepOutcome] = []
    stopped: list[str] = []
    journal = FrameJournal(output, lambda: _joined(prior, outcomes))
    with progress_reporter(len(points) - done, "sweep") as tick:

        def arrived(outcome: SweepOutcome) -> None:
            outcomes.append(outcome)
            journal.update()
            tick(outcome)

        run_sweep(
            scenario,
            points[done:],
            grow=grow,
            strong=strong,
            all_ranks=all_ranks,
            progress=arrived,
            simulate=LimitedSimulate(limits),
            jobs=jobs or default_jobs(),
            scheduler=scheduler,
            on_stop=stopped.append,
        )
    frame = _joined(prior, outcomes)
    journal.finish(rows=len(frame) > 0)
    if len(frame):
        click.echo(sweep_table(frame))
    _report_infeasible(outcomes)
    _stop_line(stopped, done + len(outcomes), len(points), output)
    if output is not None:
        click.echo(f"wrote {output}", err=True)
    if plot_path is not None:
        from collsim.report import plots  # start-up: matplotlib loads only for --plot

        kind = plot_kind
        if kind == "auto":
            kind = "scaling" if gpus and len(gpus) > 1 else "breakdown"
        drawers: dict[str, Callable[[pd.DataFrame], Figure]] = {
            "scaling": plots.plot_scaling,
            "memory": plots.plot_memory,
            "breakdown": plots.plot_breakdown,
        }
        figure = drawers[kind](_with_plan_labels(frame, scenario.stem))
        plots.save_figure(figure, plot_path)
        click.echo(f"wrote {plot_path}", err=True)
    _raise_stopped(stopped)
    if "feasible" not in frame or not frame["feasible"].astype(bool).any():
        raise InfeasibleError("no point of the sweep can run", reason="sweep", prefix="")


def _joined(prior: pd.DataFrame | None, outcomes: list[SweepOutcome]) -> pd.DataFrame:
    """The rows of an earlier run (``--resume``) followed by this run's."""
    import pandas as pd  # start-up: loaded when run

    from collsim.report.frames import sweep_frame  # start-up: loaded when run

    frame = sweep_frame(outcomes) if outcomes else pd.DataFrame()
    if prior is None or not len(prior):
        return frame
    if not len(frame):
        return prior
    return pd.concat([prior, frame], ignore_index=True)


def _resume_rows(output: Path | None, points: list[Any]) -> pd.DataFrame | None:
    """The rows the -o file of an interrupted run holds, checked against this sweep's first
    points (same series label and GPU count, in order); None when there is no file yet.

    Raises:
        ConfigError: no -o, or a file that is not the start of this sweep (exit 2).
    """
    from collsim.cli.journal import read_frame  # start-up: loaded when run

    if output is None:
        raise ConfigError("needs -o FILE (the sweep to finish)", key_path="--resume")
    prior = read_frame(output)
    if prior is None or not len(prior):
        return None
    if len(prior) > len(points):
        raise ConfigError(
            f"has {len(prior)} rows, this sweep has {len(points)} points (use the same "
            "options, or another -o)",
            file=str(output),
            key_path="--resume",
        )
    for index, (row, point) in enumerate(zip(prior.to_dict("records"), points)):
        label = "" if row.get("plan") is None or row.get("plan") != row.get("plan") else row["plan"]
        gpus: Any = row.get("num_gpus")
        same_gpus = point.num_gpus is None or (gpus == gpus and int(gpus) == point.num_gpus)
        if str(label) != point.label or not same_gpus:
            raise ConfigError(
                f"row {index + 1} ({label or 'scenario'}, {gpus} GPUs) is not this sweep's "
                f"point {index + 1} ({point.label or 'scenario'}, {point.num_gpus} GPUs): use "
                "the same options, or another -o",
                file=str(output),
                key_path="--resume",
            )
    return prior


def _raise_stopped(stopped: list[str]) -> None:
    """A sweep that stopped early ends so: Ctrl-C as click's abort (exit 130), a lost
    scheduler as an error line (exit 1)."""
    if not stopped:
        return
    if stopped[0].startswith("interrupted"):
        raise KeyboardInterrupt
    raise InfeasibleError(stopped[0], reason="stopped", prefix="sweep stopped: ")


def _stop_line(stopped: list[str], done: int, total: int, output: Path | None) -> None:
    """A sweep that stopped early: ``stopped[0]`` becomes its line (why, what it kept, how to
    go on), printed here after Ctrl-C; a lost scheduler's is the error line."""
    if not stopped:
        return
    kept = f"; kept in {output} (--resume continues)" if output is not None else ""
    stopped[0] = f"{stopped[0]}: {done} of {total} points done{kept}"
    if stopped[0].startswith("interrupted"):
        click.echo(f"sweep stopped: {stopped[0]}", err=True)


def _with_plan_labels(frame: pd.DataFrame, name: str) -> pd.DataFrame:
    """A sweep without --set has one series with an empty label: name it after the scenario."""
    out = frame.copy()
    out["plan"] = [label or name for label in out["plan"]]
    return out


class _Progress:
    """A click progress bar on stderr when it is a terminal; nothing otherwise."""

    def __init__(self, total: int, label: str) -> None:
        self.bar: Any = None
        if sys.stderr.isatty():
            self.bar = click.progressbar(
                length=total, label=label, file=sys.stderr, show_pos=True, show_eta=True
            )

    def __enter__(self) -> Any:
        if self.bar is not None:
            self.bar.__enter__()
        return self.tick

    def tick(self, *_: Any) -> None:
        if self.bar is not None:
            self.bar.update(1)

    def __exit__(self, *exc: Any) -> None:
        if self.bar is not None:
            self.bar.__exit__(*exc)


def progress_reporter(total: int, label: str) -> _Progress:
    """Context manager yielding a ``tick(...)`` callback: a progress bar on a terminal only."""
    return _Progress(total, label)


def _fmt(value: Any, kind: str) -> str:
    if value is None or (isinstance(value, float) and math.isnan(value)):
        return "-"
    from collsim.report.tables import format_count, format_seconds  # start-up: loaded when run

    match kind:
        case "time":
            return format_seconds(float(value))
        case "count":
            return format_count(float(value))
        case "pct":
            return f"{100 * float(value):.1f}"
        case "gib":
            return f"{float(value) / 2**30:.1f}"
        case "int":
            return str(int(value))
        case _:
            return str(value)


def sweep_table(frame: pd.DataFrame) -> str:
    """The sweep as a text table: one row per point, a status column (ok or the reason tag)."""
    from collsim.report.tables import format_table  # start-up: loaded when run

    show_plan = frame["plan"].astype(str).str.len().gt(0).any()
    headers = (["plan"] if show_plan else []) + [
        "GPUs",
        "tp",
        "pp",
        "dp",
        "batch",
        "step time",
        "tokens/s",
        "MFU %",
        "peak GiB",
        "status",
    ]
    rows = []
    for r in frame.to_dict("records"):
        status = "ok" if r["feasible"] else str(r["reason"]).split(":", 1)[0]
        rows.append(
            ([str(r["plan"])] if show_plan else [])
            + [
                _fmt(r["num_gpus"], "count"),
                _fmt(r.get("tp"), "int"),
                _fmt(r.get("pp"), "int"),
                _fmt(r.get("dp"), "int"),
                _fmt(r.get("global_batch"), "int"),
                _fmt(r["step_time_s"], "time"),
                _fmt(r["tokens_per_s"], "count"),
                _fmt(r["mfu"], "pct"),
                _fmt(r["memory_peak_bytes"], "gib"),
                status,
            ]
        )
    align = ("l" if show_plan else "") + "r" * 9 + "l"
    return format_table(headers, rows, align=align)


def _report_infeasible(outcomes: list[SweepOutcome]) -> None:
    bad = [o for o in outcomes if not o.feasible]
    if not bad:
        return
    click.echo(f"infeasible points: {len(bad)} of {len(outcomes)}", err=True)
    for o in bad:
        gpus = o.params.get("num_gpus")
        where = ", ".join(p for p in (o.point.label, f"{gpus} GPUs" if gpus else "") if p)
        click.echo(f"  {where}: {o.reason}", err=True)
