"""``collsim search SCENARIO --gpus N``: find the fastest parallel plan that fits.

Data (the table of best plans) goes to stdout; the progress bar (terminal only), the counts of
plans set aside (infeasible or pruned) by reason and "wrote FILE" lines go to stderr. Exit
codes: 0 a plan was found; 1 no plan fits; 2 bad input. Memory in the table is in GiB (2**30
bytes).
"""

from __future__ import annotations

import dataclasses
import sys
from pathlib import Path
from typing import TYPE_CHECKING, Any

import click

from collsim.cli.common import OneLineCommand, check_frame_path
from collsim.core.errors import ConfigError, InfeasibleError
from collsim.core.vocab import CPAlgorithm, RecomputeMode, ScheduleKind

if TYPE_CHECKING:  # pragma: no cover
    from collections.abc import Callable

    from collsim.study.search import Ranked, SearchResult

__all__ = ["search", "search_table"]

_EPILOG = """\b
Examples:
  collsim search scenarios/3d_175b.yaml --gpus 1024
  collsim search scenarios/3d_175b.yaml --gpus 1024 --top 20 --simulate 5 -o plans.csv
  collsim search scenarios/ddp_gpt3_1.3b.yaml --gpus 64 --zero 0,1 --recompute none
  collsim search scenarios/3d_175b.yaml --gpus 1024 --scheduler tcp://HOST:8786 -o plans.csv
  collsim search scenarios/3d_175b.yaml --gpus 1024 -o plans.csv --resume
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


#: The list options that set an integer axis of the search space: option -> field.
_INT_AXES = {
    "--tp": "tps",
    "--pp": "pps",
    "--cp": "cps",
    "--ep": "eps",
    "--etp": "etps",
    "--hsdp": "shard_groups",
}

#: The list options of the space, in the order ``search`` hands their texts over.
_LIST_OPTIONS = (
    "--micro-batch",
    "--zero",
    "--recompute",
    "--schedule",
    "--tp",
    "--pp",
    "--cp",
    "--cp-algorithm",
    "--ep",
    "--etp",
    "--dispatcher",
    "--ep-overlap",
    "--hsdp",
    "--fp8",
)

#: The list options that take on/off: option -> field.
_SWITCH_AXES = {"--ep-overlap": "ep_overlaps", "--fp8": "fp8s"}


def _words(text: str, key: str, choices: list[str]) -> tuple[str, ...]:
    values = tuple(v.strip() for v in text.split(",") if v.strip())
    if not values or any(v not in choices for v in values):
        raise ConfigError(f"must be some of {', '.join(choices)}; got {text}", key_path=key)
    if len(set(values)) != len(values):
        raise ConfigError(f"values repeat in {text}", key_path=key)
    return values


def _space_options(texts: dict[str, str | None]) -> dict[str, Any]:
    """The SearchSpace fields the list options set (``texts``: option -> its text, None
    when not given), each checked (ConfigError, exit 2)."""
    from collsim.parallel.config import DISPATCHERS  # start-up: loaded when run

    space_kwargs: dict[str, Any] = {}
    if (mbs := _int_list(texts.get("--micro-batch"), "--micro-batch")) is not None:
        if 0 in mbs:
            raise ConfigError("micro-batch sizes must be > 0", key_path="--micro-batch")
        space_kwargs["micro_batches"] = mbs
    zero_text = texts.get("--zero")
    if (zeros := _int_list(zero_text, "--zero")) is not None:
        if any(z > 3 for z in zeros):
            raise ConfigError(f"ZeRO stages are 0-3, got {zero_text}", key_path="--zero")
        space_kwargs["zero_stages"] = zeros
    words: dict[str, tuple[str, list[str]]] = {
        "--recompute": ("recomputes", [m.value for m in RecomputeMode]),
        "--schedule": ("schedules", [m.value for m in ScheduleKind]),
        "--dispatcher": ("dispatchers", list(DISPATCHERS)),
        "--cp-algorithm": ("cp_algorithms", [m.value for m in CPAlgorithm]),
    }
    for name, (key, choices) in words.items():
        if (text := texts.get(name)) is not None:
            space_kwargs[key] = _words(text, name, choices)
    for name, key in _INT_AXES.items():
        text = texts.get(name)
        if (sizes := _int_list(text, name)) is not None:
            if 0 in sizes:
                raise ConfigError(f"sizes must be > 0, got {text}", key_path=name)
            space_kwargs[key] = sizes
    for name, key in _SWITCH_AXES.items():
        if (text := texts.get(name)) is not None:
            space_kwargs[key] = tuple(v == "on" for v in _words(text, name, ["on", "off"]))
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
@click.option("--tp", "tp_text", metavar="LIST", help="Tensor-parallel sizes to try.")
@click.option("--pp", "pp_text", metavar="LIST", help="Pipeline-parallel sizes to try.")
@click.option("--cp", "cp_text", metavar="LIST", help="Context-parallel sizes to try.")
@click.option(
    "--cp-algorithm",
    "cp_algorithm_text",
    metavar="LIST",
    help="Context-parallel KV exchanges to try (ring,all_gather).",
)
@click.option("--ep", "ep_text", metavar="LIST", help="Expert-parallel sizes to try (MoE).")
@click.option("--etp", "etp_text", metavar="LIST", help="Expert tensor-parallel sizes (MoE).")
@click.option(
    "--dispatcher",
    "dispatcher_text",
    metavar="LIST",
    help="MoE token dispatchers to try (alltoall,deepep,hybridep,allgather).",
)
@click.option(
    "--ep-overlap",
    "ep_overlap_text",
    metavar="LIST",
    help="EP all-to-alls hidden behind compute: on, off or on,off (MoE).",
)
@click.option(
    "--hsdp",
    "hsdp_text",
    metavar="LIST",
    help="HSDP shard group sizes to try (a size equal to dp shards over all of it).",
)
@click.option(
    "--fp8", "fp8_text", metavar="LIST", help="FP8 GEMMs: on, off or on,off (FP8 devices)."
)
@click.option(
    "--jobs",
    "-j",
    type=click.IntRange(min=1, max=256),
    default=None,
    help="Processes that estimate and simulate plans (default: the cores this process may use).",
)
@click.option(
    "--space",
    "space_path",
    type=click.Path(dir_okay=False, path_type=Path),
    help="A YAML file of search-space axes (e.g. micro_batches: [1, 2], tps: [4, 8]) that "
    "restrict or extend the default space; the list options above apply after it.",
)
@click.option(
    "--tolerance",
    "tolerance_pct",
    type=click.FloatRange(min=0.0, max=100.0),
    default=0.5,  # collsim.study.search.DEFAULT_TOLERANCE_PCT (not imported at start-up)
    show_default=True,
    help="Plans of one shape whose estimates are within this percentage and that differ "
    "only in bucket, overlap, prefetch, offload, resharding, sp or recompute are one row "
    "(0: every plan a row).",
)
@click.option(
    "--scheduler",
    metavar="ADDRESS",
    help="Estimate and simulate on a Dask cluster (tcp://HOST:8786; needs collsim[cluster]) "
    "instead of this machine's cores.",
)
@click.option(
    "-o",
    "--output",
    type=click.Path(dir_okay=False, path_type=Path),
    help="Write every feasible plan (estimate and simulation columns) to this .csv, .json "
    "or .parquet (needs pyarrow) file; rewritten as plans are estimated and kept on Ctrl-C.",
)
@click.option(
    "--resume",
    is_flag=True,
    help="Continue the search whose -o file an earlier (interrupted) run left: the plans it "
    "holds are not estimated again.",
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
    tp_text: str | None,
    pp_text: str | None,
    cp_text: str | None,
    cp_algorithm_text: str | None,
    ep_text: str | None,
    etp_text: str | None,
    dispatcher_text: str | None,
    ep_overlap_text: str | None,
    hsdp_text: str | None,
    fp8_text: str | None,
    jobs: int | None,
    space_path: Path | None,
    tolerance_pct: float,
    scheduler: str | None,
    output: Path | None,
    resume: bool,
) -> None:
    """Enumerate the plans of SCENARIO's model on --gpus GPUs, rank them, re-simulate the best.

    Ctrl-C stops the estimates and prints the best plans so far (exit 130)."""
    if scheduler is not None:  # first: a wrong address is one line within seconds
        from collsim.core.jobs import check_scheduler  # start-up: loaded when run

        check_scheduler(scheduler)
    from collsim.study.scenario import load_scenario  # start-up: loaded when run
    from collsim.study.search import search_frame, search_plans
    from collsim.study.sweep import cluster_for

    check_frame_path(output, "--output")
    base = load_scenario(scenario, list(overrides))
    texts: tuple[str | None, ...] = (micro_text, zero_text, recompute_text, schedule_text)
    texts += (
        tp_text,
        pp_text,
        cp_text,
        cp_algorithm_text,
        ep_text,
        etp_text,
        dispatcher_text,
        ep_overlap_text,
        hsdp_text,
    )
    space_kwargs = _space_options(dict(zip(_LIST_OPTIONS, (*texts, fp8_text), strict=True)))
    _check_experts(base.model, space_kwargs, ep_text, etp_text)
    if gpus is not None and gpus <= 0:
        raise ConfigError(f"must be > 0, got {gpus}", key_path="--gpus")
    if gpus is not None:
        from collsim.study.limits import check_ranks  # start-up: loaded when run

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

    from collsim.core.jobs import default_jobs  # start-up: loaded when run

    space = _space_of(space_path, space_kwargs)
    known = _known_plans(output) if resume else None
    run = _SearchRun(topology, base, space, output)
    result = run.go(
        search_plans,
        top_k=top_k,
        jobs=jobs or default_jobs(),
        scheduler=scheduler,
        tolerance=tolerance_pct / 100.0,
        known=known,
    )
    click.echo(
        f"collsim search: {base.model.name} on {topology.num_ranks} x "
        f"{topology.device.name} ({topology.name}), global batch "
        f"{base.training.global_batch}"
    )
    click.echo(
        f"  {result.considered:,} plans in the grid, {result.buildable:,} buildable, "
        f"{result.estimated:,} estimated "
        f"({'then stopped' if result.stopped else 'the rest pruned by a bound'}), "
        f"{len(result.ranked):,} fit by estimate ({result.estimate_s:.1f} s), "
        f"{len(result.simulated)} re-simulated ({result.simulate_s:.1f} s)"
    )
    if known:
        click.echo(f"  {len(known):,} plans taken from {output} (--resume)")
    click.echo(search_table(result, top_n))
    _report_rejected(result)
    if output is not None:
        run.journal.build = lambda: search_frame(result)
        run.journal.finish()
        click.echo(f"wrote {output}", err=True)
    _report_stop(result, output)
    best = result.best
    if best is None:
        raise InfeasibleError("no plan fits", reason="memory", prefix="")


def _check_experts(
    model: Any, space_kwargs: dict[str, Any], ep_text: str | None, etp_text: str | None
) -> None:
    """--ep or --etp above 1 on a dense model: one line (ConfigError, exit 2)."""
    for name, key, text in (("--ep", "eps", ep_text), ("--etp", "etps", etp_text)):
        if space_kwargs.get(key, (1,)) != (1,) and not model.num_experts:
            raise ConfigError(
                f"expert parallelism needs a mixture-of-experts model; {model.name} is "
                f"dense (no model.experts), got {text}",
                key_path=name,
            )


def _space_of(space_path: Path | None, space_kwargs: dict[str, Any]) -> Any:
    """The default space, with the axes of the --space file, then of the list options."""
    from collsim.study.search import SearchSpace  # start-up: loaded when run

    space = SearchSpace()
    if space_path is not None:
        from collsim.study.space_file import read_space  # start-up: loaded when run

        space = read_space(space_path, space)
    return dataclasses.replace(space, **space_kwargs)


def _report_stop(result: SearchResult, output: Path | None) -> None:
    """A search that stopped early: one line; exit 130 after Ctrl-C (click's abort), else 1."""
    if result.stopped is None:
        return
    kept = f"; the plans estimated are in {output} (--resume continues)" if output else ""
    line = (
        f"search stopped: {result.stopped}: the best of {len(result.ranked):,} plans "
        f"estimated so far above{kept}"
    )
    if result.stopped.startswith("interrupted"):
        click.echo(line, err=True)
        raise KeyboardInterrupt
    raise InfeasibleError(line, reason="stopped", prefix="")


def _known_plans(output: Path | None) -> dict[str, Any] | None:
    """The estimates an earlier run left in ``output`` (``--resume``), by plan label."""
    from collsim.cli.journal import read_frame  # start-up: loaded when run
    from collsim.study.search import known_from_frame

    if output is None:
        raise ConfigError("needs -o FILE (the search to continue)", key_path="--resume")
    frame = read_frame(output)
    if frame is None or not len(frame):
        return None
    try:
        return known_from_frame(frame)
    except ConfigError as exc:
        raise ConfigError(exc.message, file=str(output), key_path="--resume") from None


class _SearchRun:
    """One search with its -o journal (the plans estimated so far, rewritten as they arrive)
    and, on a terminal, a progress line: plans estimated and pruned, the best so far, and an
    upper bound on the time left (the plans not yet estimated or pruned at the current rate)."""

    def __init__(self, topology: Any, base: Any, space: Any, output: Path | None) -> None:
        from collsim.cli.journal import FrameJournal  # start-up: loaded when run

        self.topology, self.base, self.space = topology, base, space
        self.ranked: list[Ranked] = []
        self.journal = FrameJournal(output, self._frame)
        self.estimated = self.pruned = self.simulated = 0
        self.total = 0
        self.best: Ranked | None = None
        self.started = 0.0
        self.shown = 0.0

    def _frame(self) -> Any:
        from collsim.study.search import SearchResult, search_frame  # start-up: loaded when run

        ranked = sorted(
            self.ranked, key=lambda r: (r.estimate.step_time_s, r.estimate.memory_peak_bytes)
        )
        partial = SearchResult(self.topology.num_ranks, 0, ranked, [])
        return search_frame(partial)

    def arrived(self, entries: list[Ranked]) -> None:
        self.ranked += entries
        for entry in entries:
            if self.best is None or entry.estimate.step_time_s < self.best.estimate.step_time_s:
                self.best = entry
        self.journal.update()

    def progress(self, phase: str, n: int) -> None:
        import time  # start-up: loaded when run

        if phase == "estimate":
            self.estimated += n
        elif phase == "bound":
            self.pruned += n
        else:
            self.simulated += n
        now = time.monotonic()
        if now - self.shown < 0.2 and phase != "simulate":
            return
        self.shown = now
        from collsim.report.tables import format_seconds  # start-up: loaded when run

        best = (
            f", best {format_seconds(self.best.estimate.step_time_s)} ({self.best.candidate.label})"
            if self.best is not None
            else ""
        )
        left = max(0, self.total - self.estimated - self.pruned)
        rate = self.estimated / max(1e-9, now - self.started)
        eta = f", at most {left / rate:.0f} s left" if self.estimated and left else ""
        sim = f", {self.simulated} simulated" if self.simulated else ""
        line = f"search: {self.estimated:,} estimated, {self.pruned:,} pruned{sim}{best}{eta}"
        click.echo("\r" + line[:160].ljust(160), nl=False, err=True)

    def go(self, search_plans: Callable[..., SearchResult], **kwargs: Any) -> SearchResult:
        """The search, with the progress line on a terminal (stderr) only."""
        import time  # start-up: loaded when run

        from collsim.study.search import enumerate_plans  # start-up: loaded when run

        tty = sys.stderr.isatty()
        if tty:
            base = self.base
            self.total = sum(
                1
                for _ in enumerate_plans(
                    base.model,
                    self.topology.num_ranks,
                    self.topology.gpus_per_node,
                    base.training.global_batch,
                    self.space,
                    base=base.parallel,
                    training=base.training,
                    fp8_capable="fp8" in self.topology.device.peak_flops,
                )
            )
        self.started = time.monotonic()
        try:
            return search_plans(
                self.topology,
                self.base.model,
                self.base.training,
                self.base.parallel,
                space=self.space,
                progress=self.progress if tty else None,
                on_estimate=self.arrived,
                **kwargs,
            )
        finally:
            if tty:
                click.echo("", err=True)


def _row(index: int, entry: Ranked) -> list[str]:
    from collsim.report.tables import format_seconds  # start-up: loaded when run

    est = entry.estimate
    res = entry.result
    sim = format_seconds(res.step_time_s) if res is not None else "-"
    mfu = res.mfu if res is not None else est.mfu
    peak = res.memory_peak_bytes if res is not None else est.memory_peak_bytes
    status = "" if res is None else ("simulated" if entry.reason is None else entry.reason)
    estimate = format_seconds(est.step_time_s)
    if entry.alike:
        worst = format_seconds(max(other.estimate.step_time_s for other in entry.alike))
        estimate = estimate if worst == estimate else f"{estimate} - {worst}"
    return [
        str(index),
        entry.candidate.label,
        estimate,
        sim,
        f"{100 * mfu:.1f}",
        f"{peak / 2**30:.1f}",
        alike_text(entry),
        status,
    ]


def alike_text(entry: Ranked) -> str:
    """What the plans collapsed into ``entry`` vary: ``+3: bucket MiB 10-400, overlap on/off``."""
    from collsim.study.search import MINOR_KNOBS  # start-up: loaded when run

    if not entry.alike:
        return ""
    group = [entry, *entry.alike]
    names = {
        "bucket_mb": "bucket MiB",
        "bucket_view": "grad view",
        "sequence_parallel": "sp",
        "ep_overlap": "ep overlap",
        "cp_algorithm": "cp",
        "shard_group": "hsdp group",
    }
    parts = []
    for knob in MINOR_KNOBS:
        name = names.get(knob, knob)
        values = sorted({getattr(e.candidate, knob) for e in group}, key=str)
        if len(values) < 2:
            continue
        if all(isinstance(v, bool) for v in values):
            parts.append(f"{name} on/off")
        elif all(isinstance(v, int | float) for v in values):
            nums = sorted(float(v) for v in values)
            parts.append(f"{name} {nums[0]:g}-{nums[-1]:g}")
        else:
            parts.append(f"{name} {'/'.join(str(v) for v in values)}")
    return f"+{len(entry.alike)}: " + ", ".join(parts)


def search_table(result: SearchResult, top_n: int = 10) -> str:
    """The best plans: re-simulated ones first (by simulated time), then the next estimates;
    one row per family of alike plans (``--tolerance``), with the range of their estimates
    and what they vary."""
    from collsim.report.tables import format_table  # start-up: loaded when run

    shown = list(result.simulated)
    for entry in result.rows or result.ranked:
        if len(shown) >= top_n:
            break
        if entry.result is None and entry not in shown:
            shown.append(entry)
    rows = [_row(i + 1, entry) for i, entry in enumerate(shown[:top_n])]
    return format_table(
        ["#", "plan", "estimate", "simulated", "MFU %", "peak GiB", "alike", "status"],
        rows,
        align="rlrrrrll",
    )


def _report_rejected(result: SearchResult) -> None:
    from collsim.study.search import REASONS  # start-up: loaded when run

    if not result.rejected:
        return
    total = sum(result.rejected.values())
    click.echo(f"plans set aside: {total:,}", err=True)
    for reason, count in result.rejected.most_common():
        click.echo(f"  {count:>8,}  {reason}: {REASONS.get(reason, reason)}", err=True)
