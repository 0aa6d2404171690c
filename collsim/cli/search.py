"""``collsim search SCENARIO --gpus N``: find the fastest parallel plan that fits.

Data (the table of best plans) goes to stdout; the progress bar (terminal only), the counts of
plans set aside (infeasible or pruned) by reason and "wrote FILE" lines go to stderr. Exit
codes: 0 a plan was found; 1 no plan fits; 2 bad input. Memory in the table is in GiB (2**30
bytes).
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import TYPE_CHECKING, Any

import click

from collsim.cli.common import OneLineCommand, check_frame_path, write_frame
from collsim.errors import ConfigError, InfeasibleError
from collsim.vocab import RecomputeMode, ScheduleKind

if TYPE_CHECKING:  # pragma: no cover
    from collections.abc import Callable

    from collsim.search import Ranked, SearchResult

__all__ = ["search", "search_table"]

_EPILOG = """\b
Examples:
  collsim search scenarios/3d_175b.yaml --gpus 1024
  collsim search scenarios/3d_175b.yaml --gpus 1024 --top 20 --simulate 5 -o plans.csv
  collsim search scenarios/ddp_gpt3_1.3b.yaml --gpus 64 --zero 0,1 --recompute none
"""


def _int_list(text: str | None, key: str) -> tuple[int, ...] | None:
    if text is None:
        return None
    try:
        values = tuple(int(v) for v in text.split(",") if v.strip())
    except ValueError:
        raise ConfigError(
            f"expected comma-separated integers, got {text!r}", key_path=key
        ) from None
    if not values or any(v < 0 for v in values):
        raise ConfigError(f"expected non-negative integers, got {text!r}", key_path=key)
    return values


def _space_options(
    micro_text: str | None,
    zero_text: str | None,
    recompute_text: str | None,
    schedule_text: str | None,
    cp_text: str | None,
    ep_text: str | None,
) -> dict[str, Any]:
    """The SearchSpace fields the list options set, each checked (ConfigError, exit 2)."""
    space_kwargs: dict[str, Any] = {}
    if (mbs := _int_list(micro_text, "--micro-batch")) is not None:
        if 0 in mbs:
            raise ConfigError("micro-batch sizes must be > 0", key_path="--micro-batch")
        space_kwargs["micro_batches"] = mbs
    if (zeros := _int_list(zero_text, "--zero")) is not None:
        if any(z > 3 for z in zeros):
            raise ConfigError(f"ZeRO stages are 0-3, got {zero_text}", key_path="--zero")
        space_kwargs["zero_stages"] = zeros
    for text, enum, name, key in (
        (recompute_text, RecomputeMode, "--recompute", "recomputes"),
        (schedule_text, ScheduleKind, "--schedule", "schedules"),
    ):
        if text is not None:
            values = tuple(v.strip() for v in text.split(",") if v.strip())
            choices = [member.value for member in enum]
            if not values or any(v not in choices for v in values):
                raise ConfigError(
                    f"must be some of {', '.join(choices)}; got {text}", key_path=name
                )
            space_kwargs[key] = values
    for text, name, key in ((cp_text, "--cp", "cps"), (ep_text, "--ep", "eps")):
        if (sizes := _int_list(text, name)) is not None:
            if 0 in sizes:
                raise ConfigError(f"sizes must be > 0, got {text}", key_path=name)
            space_kwargs[key] = sizes
    return space_kwargs


@click.command(name="search", epilog=_EPILOG, cls=OneLineCommand)
@click.argument("scenario", type=click.Path(dir_okay=False, path_type=Path))
@click.option("--gpus", type=int, help="GPU count to plan for (default: the scenario's).")
@click.option(
    "--set",
    "overrides",
    multiple=True,
    metavar="KEY.PATH=VALUE",
    help="Override a scenario key first (e.g. training.global_batch=1024).",
)
@click.option(
    "--top",
    "top_n",
    type=click.IntRange(min=1),
    default=10,
    show_default=True,
    help="How many plans to print.",
)
@click.option(
    "--simulate",
    "top_k",
    type=click.IntRange(min=0),
    default=10,
    show_default=True,
    help="How many of the best estimates to re-simulate with the engine.",
)
@click.option("--micro-batch", "micro_text", metavar="LIST", help="Micro-batch sizes to try.")
@click.option("--zero", "zero_text", metavar="LIST", help="ZeRO stages to try (0-3).")
@click.option(
    "--recompute",
    "recompute_text",
    metavar="LIST",
    help="Recompute modes to try (none,selective,full).",
)
@click.option(
    "--schedule",
    "schedule_text",
    metavar="LIST",
    help="Pipeline schedules to try (gpipe,1f1b,interleaved,zb_h1,dualpipev).",
)
@click.option("--cp", "cp_text", metavar="LIST", help="Context-parallel sizes to try.")
@click.option("--ep", "ep_text", metavar="LIST", help="Expert-parallel sizes to try (MoE).")
@click.option(
    "--jobs",
    "-j",
    type=click.IntRange(min=1, max=256),
    default=None,
    help="Processes that estimate and simulate plans (default: the cores this process may use).",
)
@click.option(
    "-o",
    "--output",
    type=click.Path(dir_okay=False, path_type=Path),
    help="Write every feasible plan (estimate and simulation columns) to this .csv, .json "
    "or .parquet (needs pyarrow) file.",
)
def search(
    scenario: Path,
    gpus: int | None,
    overrides: tuple[str, ...],
    top_n: int,
    top_k: int,
    micro_text: str | None,
    zero_text: str | None,
    recompute_text: str | None,
    schedule_text: str | None,
    cp_text: str | None,
    ep_text: str | None,
    jobs: int | None,
    output: Path | None,
) -> None:
    """Enumerate the plans of SCENARIO's model on --gpus GPUs, rank them, re-simulate the best."""
    from collsim.scenario import load_scenario
    from collsim.search import SearchSpace, search_frame, search_plans
    from collsim.study.sweep import cluster_for

    check_frame_path(output, "--output")
    base = load_scenario(scenario, list(overrides))
    space_kwargs = _space_options(
        micro_text, zero_text, recompute_text, schedule_text, cp_text, ep_text
    )
    if gpus is not None and gpus <= 0:
        raise ConfigError(f"must be > 0, got {gpus}", key_path="--gpus")
    if gpus is not None:
        from collsim.limits import check_ranks

        check_ranks(gpus, key_path="--gpus", option=None)
    try:
        topology = (
            cluster_for(base.cluster.topology, gpus, None)
            if gpus is not None
            else base.cluster.load()
        )
    except InfeasibleError as exc:
        raise ConfigError(str(exc), key_path="--gpus") from None
    except ConfigError as exc:
        if exc.file is not None:
            raise  # a malformed topology file: its line
        raise base.locate(ConfigError(exc.message, key_path="cluster.topology")) from None

    from collsim.jobs import default_jobs

    space = SearchSpace(**space_kwargs)
    result = _run_with_progress(topology, base, space, top_k, search_plans, jobs or default_jobs())
    click.echo(
        f"collsim search: {base.model.name} on {topology.num_ranks} x "
        f"{topology.device.name} ({topology.name}), global batch "
        f"{base.training.global_batch}"
    )
    click.echo(
        f"  {result.considered:,} plans in the grid, {result.buildable:,} buildable, "
        f"{result.estimated:,} estimated (the rest pruned by a bound), "
        f"{len(result.ranked):,} fit by estimate ({result.estimate_s:.1f} s), "
        f"{len(result.simulated)} re-simulated ({result.simulate_s:.1f} s)"
    )
    click.echo(search_table(result, top_n))
    _report_rejected(result)
    if output is not None:
        write_frame(search_frame(result), output)
        click.echo(f"wrote {output}", err=True)
    best = result.best
    if best is None:
        raise InfeasibleError("no plan fits", reason="memory", prefix="")


def _run_with_progress(
    topology: Any,
    base: Any,
    space: Any,
    top_k: int,
    search_plans: Callable[..., SearchResult],
    jobs: int,
) -> SearchResult:
    """Run the search with a progress bar on a terminal (plans estimated, then simulated)."""
    from collsim.search import enumerate_plans

    if not sys.stderr.isatty():
        return search_plans(
            topology, base.model, base.training, base.parallel, space=space, top_k=top_k, jobs=jobs
        )
    total = sum(
        1
        for _ in enumerate_plans(
            base.model,
            topology.num_ranks,
            topology.gpus_per_node,
            base.training.global_batch,
            space,
            base=base.parallel,
        )
    )
    with click.progressbar(
        length=total + top_k, label="search", file=sys.stderr, show_pos=True
    ) as bar:

        def progress(phase: str, n: int) -> None:
            bar.update(n)

        return search_plans(
            topology,
            base.model,
            base.training,
            base.parallel,
            space=space,
            top_k=top_k,
            progress=progress,
            jobs=jobs,
        )


def _row(index: int, entry: Ranked) -> list[str]:
    from collsim.report.tables import format_seconds

    est = entry.estimate
    res = entry.result
    sim = format_seconds(res.step_time_s) if res is not None else "-"
    mfu = res.mfu if res is not None else est.mfu
    peak = res.memory_peak_bytes if res is not None else est.memory_peak_bytes
    status = "" if res is None else ("simulated" if entry.reason is None else entry.reason)
    return [
        str(index),
        entry.candidate.label,
        format_seconds(est.step_time_s),
        sim,
        f"{100 * mfu:.1f}",
        f"{peak / 2**30:.1f}",
        status,
    ]


def search_table(result: SearchResult, top_n: int = 10) -> str:
    """The best plans: re-simulated ones first (by simulated time), then the next estimates."""
    from collsim.report.tables import format_table

    shown = list(result.simulated)
    for entry in result.ranked:
        if len(shown) >= top_n:
            break
        if entry.result is None and entry not in shown:
            shown.append(entry)
    rows = [_row(i + 1, entry) for i, entry in enumerate(shown[:top_n])]
    return format_table(
        ["#", "plan", "estimate", "simulated", "MFU %", "peak GiB", "status"], rows, align="rlrrrrl"
    )


def _report_rejected(result: SearchResult) -> None:
    from collsim.search import REASONS

    if not result.rejected:
        return
    total = sum(result.rejected.values())
    click.echo(f"plans set aside: {total:,}", err=True)
    for reason, count in result.rejected.most_common():
        click.echo(f"  {count:>8,}  {reason}: {REASONS.get(reason, reason)}", err=True)
