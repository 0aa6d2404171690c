"""Sweeps: one scenario simulated over a grid of GPU counts and scenario keys.

Derivations, measurements and sources: docs/derivations.md, ``collsim.study.sweep``.
"""

from __future__ import annotations

import dataclasses
import itertools
import time
import warnings
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from collsim.cluster.topology import load_topology
from collsim.core.errors import CollsimWarning, ConfigError, InfeasibleError
from collsim.core.jobs import SchedulerLost, Workers
from collsim.core.yamlio import load_yaml
from collsim.study.job import StepInputs, simulate_inputs
from collsim.study.limits import check_plan
from collsim.study.scenario import scenario_from_doc
from collsim.study.sweep_grid import (  # the grid's names are also this module's
    GROW_AXES,
    SweepPoint,
    build_points,
    parse_gpus,
    parse_plan,
    parse_set,
)

if TYPE_CHECKING:  # pragma: no cover
    from collsim.cluster.topology import Topology
    from collsim.step.result import StepResult
    from collsim.study.limits import Limits
    from collsim.study.scenario import Scenario

__all__ = [
    "LimitedSimulate",
    "GROW_AXES",
    "SweepPoint",
    "SweepOutcome",
    "parse_gpus",
    "parse_set",
    "parse_plan",
    "build_points",
    "check_overrides",
    "resolve_point",
    "cluster_for",
    "SweepSource",
    "run_point",
    "run_sweep",
]


Simulate = Callable[..., "StepResult"]


@dataclass(slots=True)
class SweepOutcome:
    """What happened at one point."""

    point: SweepPoint
    result: StepResult | None
    reason: str | None
    """``tag: message`` when the point is infeasible (tag: gpus, config, infeasible, memory)."""
    params: dict[str, Any] = field(default_factory=dict)
    """Resolved coordinates: num_gpus, tp, pp, dp, global_batch, ... and the swept keys."""
    elapsed_s: float = 0.0
    warnings: list[str] = field(default_factory=list)

    @property
    def feasible(self) -> bool:
        return self.result is not None and self.reason is None


# -- the flags checked against the scenario ------------------------------------------------


def check_overrides(
    path: str | Path | SweepSource,
    sets: Sequence[tuple[str, Sequence[str]]],
    *,
    gpus: Sequence[int] | None = None,
    grow: str = "dp",
    plans: Mapping[str, Sequence[str]] | None = None,
) -> None:
    """Load the scenario with each ``--set`` value so that an unknown key or a bad value fails
    before anything runs, with the scenario loader's own one-line error. A value that only
    works together with another swept value (``virtual_stages=2`` with
    ``schedule=interleaved``) is accepted if some combination of the other values loads.

    Raises:
        ConfigError: the first bad key or value (``--set key=value: key.path: message``), an
            unknown ``grow`` axis, a ``--set`` of the axis that ``--gpus`` grows, or a
            topology that does not load.
    """
    if grow not in GROW_AXES:
        raise ConfigError(f"must be one of {', '.join(GROW_AXES)}; got {grow!r}", key_path="--grow")
    for key, _ in sets:
        if gpus and key == f"parallel.{grow}":
            raise ConfigError(
                f"is set by --gpus (the {grow} axis grows with the GPU count); "
                "sweep another key or pick the growing axis with --grow",
                key_path=key,
                file=f"--set {key}",
            )
    source = _source(path)
    base = source.scenario()
    try:
        source.cluster(base.cluster.topology, None, 1)  # an unknown topology is bad input
    except ConfigError as exc:
        if exc.file is not None:
            raise  # a malformed topology file: its line
        raise base.locate(ConfigError(exc.message, key_path="cluster.topology")) from None
    for name, overrides in (plans or {}).items():
        try:
            source.scenario(list(overrides))
        except ConfigError as exc:
            raise ConfigError(f"plan {name!r}: {' '.join(str(exc).split())}") from None
    for index, (key, values) in enumerate(sets):
        others = [[f"{k}={v}" for v in vs] for i, (k, vs) in enumerate(sets) if i != index]
        for value in values:
            mine = f"{key}={value}"
            try:
                source.scenario([mine])
                continue
            except ConfigError as first:
                # A value may need another swept value (virtual_stages=2 with
                # schedule=interleaved): it is bad only if no combination accepts it.
                for combo in itertools.product(*others):
                    try:
                        source.scenario([*combo, mine])
                        break
                    except ConfigError:
                        continue
                else:
                    raise first from None


# -- points ----------------------------------------------------------------------------------


def _grown(
    scenario: Scenario, num_gpus: int, *, grow: str, strong: bool, touched: set[str]
) -> Scenario:
    """``scenario`` on ``num_gpus`` GPUs by changing the ``grow`` axis (``dataclasses.replace``).

    With weak scaling the global batch of the scenario (after its ``--set`` overrides) is the
    batch at the scenario's dp; it is scaled by dp_new / dp.

    Raises:
        InfeasibleError: (reason ``gpus``) the count does not split into the other two axes,
            or the weak-scaled global batch is not a whole number.
        ConfigError: the grown axis is also swept with ``--set``.
    """
    if grow not in GROW_AXES:
        raise ConfigError(f"must be one of {', '.join(GROW_AXES)}; got {grow!r}", key_path="--grow")
    if f"parallel.{grow}" in touched:
        raise ConfigError(
            f"parallel.{grow} is set by --gpus (it grows with the GPU count); "
            "sweep another key or use --grow",
            key_path=f"parallel.{grow}",
        )
    par, train = scenario.parallel, scenario.training
    sizes = {"tp": par.tp, "pp": par.pp, "dp": par.dp}
    others = 1
    for axis, size in sizes.items():
        if axis != grow:
            others *= size
    if num_gpus % others:
        other_text = " x ".join(f"{a} {s}" for a, s in sizes.items() if a != grow)
        raise InfeasibleError(
            f"{num_gpus} GPUs do not split into {other_text} x {grow}", reason="gpus"
        )
    new = num_gpus // others
    if grow == "dp" and not strong:
        batch = train.global_batch * new
        if batch % par.dp:
            raise InfeasibleError(
                f"weak scaling: global batch {train.global_batch} x {new} / {par.dp} is not whole",
                reason="gpus",
            )
        train = dataclasses.replace(train, global_batch=batch // par.dp)
    if grow == "tp":
        par = dataclasses.replace(par, tp=new)
    elif grow == "pp":
        par = dataclasses.replace(par, pp=new)
    else:
        par = dataclasses.replace(par, dp=new)
    return dataclasses.replace(scenario, parallel=par, training=train)


class SweepSource:
    """A scenario file read once: the variants of its points are built from the parsed
    document (``--set`` overrides, :func:`collsim.study.scenario.scenario_from_doc`) and
    ``dataclasses.replace`` (the grown axis), and the clusters are built once per size.

    Args:
        path: the scenario file.
    """

    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)
        self.doc = load_yaml(self.path)
        self.topologies: dict[tuple[str, int, int], Topology] = {}

    def scenario(self, overrides: Sequence[str] = ()) -> Scenario:
        """The scenario with ``overrides`` applied (each a ``key.path=value`` text)."""

        return scenario_from_doc(self.doc, overrides, source=self.path)

    def cluster(self, spec: str, num_gpus: int | None, nodes: int | None) -> Topology:
        """:func:`cluster_for`, built once per (topology, nodes, GPUs per node)."""
        return cluster_for(spec, num_gpus, nodes, cache=self.topologies)


def _source(path: str | Path | SweepSource) -> SweepSource:
    return path if isinstance(path, SweepSource) else SweepSource(path)


def cluster_for(
    spec: str,
    num_gpus: int | None,
    nodes: int | None,
    *,
    cache: dict[tuple[str, int, int], Topology] | None = None,
) -> Topology:
    """The cluster for ``num_gpus`` GPUs: whole nodes, or one partly used node below a node.

    ``cache`` (owned by the caller, e.g. :class:`SweepSource`) keeps the topologies built,
    by (spec, nodes, GPUs per node): a 512-node fat tree takes a while to build and is
    read-only.
    """

    cache = {} if cache is None else cache
    probe = cache.get((spec, 0, 0))
    if probe is None:
        probe = cache[(spec, 0, 0)] = load_topology(spec, nodes=1)
    per_node = probe.gpus_per_node
    if num_gpus is None:
        count_nodes, count_gpn = (nodes or 1), per_node
    elif num_gpus < per_node:
        count_nodes, count_gpn = 1, num_gpus
    elif num_gpus % per_node:
        raise InfeasibleError(
            f"{num_gpus} GPUs is not a whole number of {per_node}-GPU nodes", reason="gpus"
        )
    else:
        count_nodes, count_gpn = num_gpus // per_node, per_node
    key = (spec, count_nodes, count_gpn)
    if key not in cache:
        cache[key] = load_topology(
            spec, nodes=count_nodes, gpus_per_node=None if count_gpn == per_node else count_gpn
        )
    return cache[key]


def resolve_point(
    path: str | Path | SweepSource, point: SweepPoint, *, grow: str = "dp", strong: bool = False
) -> tuple[Scenario, Topology, dict[str, Any]]:
    """The scenario, cluster and coordinates of one point.

    Raises:
        InfeasibleError: the GPU count does not fit the plan (reason ``gpus``).
        ConfigError: a bad override (located at its ``--set``).
    """
    source = _source(path)
    scenario = source.scenario(point.overrides)
    if point.num_gpus is not None:
        touched = {text.partition("=")[0].strip() for text in point.overrides}
        scenario = _grown(scenario, point.num_gpus, grow=grow, strong=strong, touched=touched)
    topology = source.cluster(scenario.cluster.topology, point.num_gpus, scenario.cluster.nodes)
    par, train = scenario.parallel, scenario.training
    params: dict[str, Any] = {
        "plan": point.label,
        "num_gpus": topology.num_ranks,
        "tp": par.tp,
        "pp": par.pp,
        "dp": par.dp,
        "schedule": str(par.schedule),
        "virtual_stages": par.virtual_stages,
        "zero": par.zero,
        "sequence_parallel": par.sequence_parallel,
        "global_batch": train.global_batch,
        "micro_batch": train.micro_batch,
        "recompute": str(train.recompute),
    }
    for key, value in point.values:
        params[key] = value
    return scenario, topology, params


def _default_simulate(
    topology: Topology, scenario: Scenario, *, trace: bool = False, all_ranks: bool = False
) -> StepResult:
    """The point's step as every caller simulates one (:mod:`collsim.study.job`)."""
    return simulate_inputs(StepInputs.of(scenario, topology), all_ranks=all_ranks, trace=trace)


class LimitedSimulate:
    """The step of a point behind a resource check: a point beyond a limit is infeasible (its
    reason is the limit's message) instead of running for hours
    (:func:`collsim.study.limits.check_plan`). A class, not a closure, so that worker processes can
    receive it.

    Args:
        limits: the resource limits (:class:`collsim.study.limits.Limits`; None: the defaults).
    """

    def __init__(self, limits: Limits | None) -> None:
        self.limits = limits

    def __call__(
        self,
        topology: Topology,
        scenario: Scenario,
        *,
        trace: bool = False,
        all_ranks: bool = False,
    ) -> StepResult:
        check_plan(scenario, self.limits, gpus=topology.num_ranks, all_ranks=all_ranks)
        return _default_simulate(topology, scenario, trace=trace, all_ranks=all_ranks)


def _scenario_gpus(source: SweepSource) -> int | None:
    """tp x pp x dp of the scenario as written (for rows of points that could not be built)."""
    try:
        return source.scenario().parallel.world_size
    except ConfigError:
        return None


def run_point(
    path: str | Path | SweepSource,
    point: SweepPoint,
    *,
    grow: str = "dp",
    strong: bool = False,
    trace: bool = False,
    all_ranks: bool = False,
    simulate: Simulate | None = None,
) -> SweepOutcome:
    """Resolve and simulate one point; infeasibility becomes the outcome's reason."""
    started = time.perf_counter()
    simulate = simulate or _default_simulate
    source = _source(path)

    def failed(reason: str) -> SweepOutcome:
        # The point's own coordinates; the GPU count as written when --gpus did not set it.
        params: dict[str, Any] = {"plan": point.label, "num_gpus": point.num_gpus}
        params.update(dict(point.values))
        if point.num_gpus is None:
            params["num_gpus"] = _scenario_gpus(source)
        return SweepOutcome(point, None, reason, params, time.perf_counter() - started)

    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always", CollsimWarning)
            scenario, topology, params = resolve_point(source, point, grow=grow, strong=strong)
            result = simulate(topology, scenario, trace=trace, all_ranks=all_ranks)
    except InfeasibleError as exc:
        return failed(f"{exc.reason}: {' '.join(str(exc).split())}")
    except ConfigError as exc:
        # Every --set value was checked alone (check_overrides): what fails here is a
        # combination that cannot be built (virtual stages without interleaving, heads % tp).
        return failed(f"config: {' '.join(str(exc).split())}")
    messages = [str(w.message) for w in caught if issubclass(w.category, CollsimWarning)]
    for other in caught:  # not ours: pass it on as it came
        if not issubclass(other.category, CollsimWarning):
            warnings.warn_explicit(other.message, other.category, other.filename, other.lineno)
    reason = None
    if not result.fits:
        reason = (
            f"memory: peak {result.memory_peak_bytes / 1e9:.1f} GB > "
            f"{result.memory_capacity_bytes / 1e9:.1f} GB"
        )
    return SweepOutcome(point, result, reason, params, time.perf_counter() - started, messages)


def run_sweep(
    path: str | Path | SweepSource,
    points: Sequence[SweepPoint],
    *,
    grow: str = "dp",
    strong: bool = False,
    trace: bool = False,
    all_ranks: bool = False,
    simulate: Simulate | None = None,
    progress: Callable[[SweepOutcome], None] | None = None,
    jobs: int = 1,
    scheduler: str | None = None,
    on_stop: Callable[[str], None] | None = None,
) -> list[SweepOutcome]:
    """Simulate every point; ``progress`` is called after each one, in the points' order.

    The scenario file is read once (:class:`SweepSource`). ``jobs`` processes run the points
    (:class:`collsim.core.jobs.Workers`; each keeps its own source and clusters), or the workers of
    the Dask cluster at ``scheduler`` (the source goes to them read, so they need only the
    files the scenario names); the outcomes are the same as with one.

    With ``on_stop``, Ctrl-C (``KeyboardInterrupt``) or a lost Dask scheduler ends the sweep
    early: ``on_stop(why)`` is called and the outcomes so far are returned.

    Check the overrides first with :func:`check_overrides`: here a point whose overrides do not
    combine is recorded as infeasible (reason ``config``), not raised.
    """
    options = dict(grow=grow, strong=strong, trace=trace, all_ranks=all_ranks, simulate=simulate)
    source: str | SweepSource = path if isinstance(path, SweepSource) else str(path)
    if scheduler is not None and not isinstance(source, SweepSource):
        source = SweepSource(source)
    outcomes: list[SweepOutcome] = []
    jobs = min(jobs, max(1, len(points)))
    try:
        with Workers(jobs, _SweepContext, (source, options), scheduler=scheduler) as workers:
            for outcome in workers.imap(_run_point_job, points):
                outcomes.append(outcome)
                if progress is not None:
                    progress(outcome)
    except KeyboardInterrupt:
        if on_stop is None:
            raise
        on_stop("interrupted (Ctrl-C)")
    except SchedulerLost as exc:
        if on_stop is None:
            raise
        on_stop(str(exc))
    return outcomes


class _SweepContext:
    """What a sweep worker keeps: the scenario source and the point options."""

    def __init__(self, source: str | SweepSource, options: dict[str, Any]) -> None:
        self.source = source if isinstance(source, SweepSource) else SweepSource(source)
        self.options = options


def _run_point_job(ctx: _SweepContext, point: SweepPoint) -> SweepOutcome:
    return run_point(ctx.source, point, **ctx.options)
