"""The search loop: estimate plans best-first by their floors, prune, re-simulate the best.

Plans whose memory floor exceeds the GPU are dropped (``memory_bound``); the others are estimated
by the closed form (:mod:`collsim.play.walk`) in the order of their step-time floor, until no floor
left can beat the best kept (``bound``). The best ``top_k`` are simulated with the discrete-event
engine, which has the last word on step time and memory. Nothing here prints; a callback reports
progress.
"""

from __future__ import annotations

import heapq
import time
import warnings
from collections import Counter
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from collsim.core.errors import CollsimWarning, ConfigError, InfeasibleError
from collsim.core.jobs import SchedulerLost, Workers
from collsim.core.runtime import collector_relaxed
from collsim.play.walk import Estimator
from collsim.study.job import StepInputs, simulate_inputs
from collsim.study.search.bounds import Bounds, memory_limit_bytes
from collsim.study.search.space import Candidate, SearchSpace, enumerate_plans
from collsim.study.search.variants import VariantBounds

if TYPE_CHECKING:  # pragma: no cover
    from collsim.cluster.topology import Topology
    from collsim.parallel.config import ParallelConfig, TrainingConfig
    from collsim.step.result import StepResult
    from collsim.workload.model import TransformerSpec


@dataclass(slots=True)
class Ranked:
    """A plan with its estimate and, for the best few, its simulation."""

    candidate: Candidate
    estimate: StepResult
    result: StepResult | None = None
    reason: str | None = None
    """Why the simulation could not run or the plan does not fit (None when fine)."""
    simulate_s: float = 0.0
    alike: list[Ranked] = field(default_factory=list)
    """Plans collapsed into this row (:func:`collapse`): same shape, estimate within the
    tolerance, other minor knobs."""

    @property
    def step_time_s(self) -> float:
        """The simulated step time when there is one, else the estimate."""
        return self.result.step_time_s if self.result is not None else self.estimate.step_time_s


@dataclass(slots=True)
class SearchResult:
    """What a search found."""

    num_gpus: int
    considered: int
    """Plans of the full grid (buildable + rejected)."""
    ranked: list[Ranked]
    """Feasible plans by estimated step time, best first."""
    simulated: list[Ranked]
    """The re-simulated best plans, by simulated step time (those that fit first)."""
    rejected: Counter[str] = field(default_factory=Counter)
    estimated: int = 0
    """Plans the closed form was evaluated for (buildable, not dropped by a bound)."""
    buildable: int = 0
    """Plans that passed the structural checks (estimated + dropped by a bound)."""
    estimate_s: float = 0.0
    simulate_s: float = 0.0
    rows: list[Ranked] = field(default_factory=list)
    """One row per family of alike plans (:func:`collapse`), best first."""
    tolerance: float = 0.0
    stopped: str | None = None
    """Why the search ended early (Ctrl-C, a lost scheduler); None when it ran to its end."""

    @property
    def best(self) -> Ranked | None:
        fits = [r for r in self.simulated if r.reason is None]
        if fits:
            return fits[0]
        return self.ranked[0] if self.ranked and not self.simulated else None


@collector_relaxed()
def search_plans(
    topology: Topology,
    spec: TransformerSpec,
    training: TrainingConfig,
    parallel: ParallelConfig,
    *,
    space: SearchSpace | None = None,
    top_k: int = 10,
    simulate: Callable[..., StepResult] | None = None,
    progress: Callable[[str, int], None] | None = None,
    prune_keep: int = 10,
    jobs: int = 1,
    scheduler: str | None = None,
    tolerance: float = 0.0,
    known: Mapping[str, StepResult] | None = None,
    on_estimate: Callable[[list[Ranked]], None] | None = None,
) -> SearchResult:
    """Enumerate, bound, estimate and rank the plans; re-simulate the ``top_k`` best.

    Plans whose memory floor (model states and the activations held at once,
    :meth:`Bounds.memory_bytes`) exceeds the GPU are dropped before any estimate (counted as
    ``memory_bound``). The rest are estimated best-first by a lower bound on their step
    (:meth:`Bounds.step_s`: the compute stream's own work, the data-parallel calls, their
    interference floor, the optimizer; at the front of the queue a plan's bound is tightened
    by walking its pipeline schedule, :meth:`Bounds.refined_s`); once the front's bound
    cannot beat the ``max(top_k, prune_keep)``-th best estimate, the remaining plans are
    counted as ``bound`` and not estimated. The best ``max(top_k, prune_keep)`` plans are
    exactly those a full enumeration finds (a test checks it); ``prune_keep=0`` estimates
    every plan (no bound of either kind). With a ``tolerance``, plans alike (:func:`collapse`)
    are one row (:attr:`SearchResult.rows`), the bound keeps that many distinct shapes exact
    and the engine re-simulates the best plan of each of the ``top_k`` first rows.

    Ctrl-C (``KeyboardInterrupt``) or a lost Dask scheduler during the estimates ends the
    search with what it has: the plans estimated so far, ranked, none re-simulated, and
    :attr:`SearchResult.stopped` saying why.

    Args:
        topology: the cluster with the GPU count to search (tp x pp x dp = its ranks).
        spec: the model.
        training, parallel: the scenario's sections; the global batch, dtype, optimizer and
            the DDP/FSDP knobs are kept, the plan knobs replaced.
        space: what to vary.
        top_k: how many of the best estimates the engine re-simulates (0: none).
        prune_keep: how many best plans the bound must keep exact (0: no pruning).
        simulate: ``simulate(topology, spec, training, parallel) -> StepResult``; default the
            engine's ``simulate_step``.
        progress: called as ``progress(phase, n)`` with phase ``estimate`` (n plans done since
            the last call), ``bound`` (n plans dropped by a bound) or ``simulate`` (1 per
            simulated plan).
        jobs: processes that estimate and simulate (:class:`collsim.core.jobs.Workers`); with
            more than one, plans are taken from the front of the queue in tasks, each sized by
            the cost of those before it and sent as soon as a process has room
            (:meth:`collsim.core.jobs.Workers.stream`; the best plans are the same, a few more
            may be estimated).
        scheduler: a Dask scheduler's address: the tasks go to its workers instead (the same
            results).
        tolerance: relative step-time difference under which plans alike are one row.
        known: estimates from an earlier run of the same search, by plan label (``--resume``):
            used as they are, not estimated again.
        on_estimate: called with each batch of plans that were estimated and fit (and first
            with the ``known`` ones), as they arrive.
    """

    started = time.perf_counter()
    num_gpus = topology.num_ranks
    rejected: Counter[str] = Counter()
    bounds = VariantBounds(topology, spec, training, parallel)
    dropped: Counter[str] = Counter()
    # 1. cheap bounds for every buildable plan: its memory floor must fit, and the compute
    #    stream's own work is a lower bound on the step
    capacity = memory_limit_bytes(topology.device)
    plans = enumerate_plans(
        spec,
        num_gpus,
        topology.gpus_per_node,
        training.global_batch,
        space,
        dropped,
        base=parallel,
        training=training,
        fp8_capable="fp8" in topology.device.peak_flops,
    )
    candidates, total = _bounded_candidates(
        plans, bounds, capacity if prune_keep > 0 else None, rejected
    )
    if progress is not None and rejected["memory_bound"]:
        progress("bound", rejected["memory_bound"])
    loop = _Loop(
        candidates,
        bounds,
        keep=max(top_k, prune_keep) if prune_keep > 0 else 0,
        tolerance=tolerance,
        progress=progress,
        on_estimate=on_estimate,
    )
    loop.take_known(known or {})
    with Workers(jobs, _SearchContext, (topology, spec), scheduler=scheduler) as workers:
        loop.run(workers, training, parallel)
        structural = sum(dropped.values())
        rejected.update(dropped)
        rejected.update(loop.rejected)
        ranked = sorted(
            loop.ranked, key=lambda r: (r.estimate.step_time_s, r.estimate.memory_peak_bytes)
        )
        rows = collapse(ranked, tolerance)
        estimate_s = time.perf_counter() - started

        sim_started = time.perf_counter()
        simulated = [] if loop.stopped else rows[: max(0, top_k)]
        configs = [entry.candidate.configs(training, parallel) for entry in simulated]
        if simulate is None:
            outcomes = _map_or_stop(workers, configs, loop)
        else:
            own = _SearchContext(topology, spec, simulate)
            outcomes = [_simulate_job(own, c) for c in configs]
    simulated = _record_simulated(simulated[: len(outcomes)], outcomes, rejected, progress)
    return SearchResult(
        num_gpus=num_gpus,
        considered=total + structural,
        ranked=ranked,
        simulated=simulated,
        rejected=rejected,
        estimated=loop.evaluated,
        buildable=total,
        estimate_s=estimate_s,
        simulate_s=time.perf_counter() - sim_started,
        rows=rows,
        tolerance=tolerance,
        stopped=loop.stopped,
    )


def _map_or_stop(
    workers: Any, configs: list[tuple[TrainingConfig, ParallelConfig]], loop: _Loop
) -> list[tuple[StepResult | None, str | None, float]]:
    """The engine's steps of ``configs``; none (and ``loop.stopped`` set) on Ctrl-C or a lost
    scheduler."""

    try:
        return list(workers.map(_simulate_job, configs))
    except KeyboardInterrupt:
        loop.stopped = "interrupted (Ctrl-C) while re-simulating"
    except SchedulerLost as exc:
        loop.stopped = str(exc)
    return []


#: Knobs that make two plans alike when their estimates are within the tolerance: how the
#: data-parallel reduction is bucketed and overlapped, FSDP's prefetch, offload and
#: resharding, sequence parallelism, recompute, the MoE dispatcher and its overlap, the CP
#: algorithm and the HSDP group. The others (tp, cp, pp, dp, ep, etp, micro-batch, schedule,
#: virtual stages, ZeRO stage, dtype) set a plan's shape.
MINOR_KNOBS = (
    "bucket_mb",
    "overlap",
    "bucket_view",
    "prefetch",
    "offload",
    "reshard",
    "sequence_parallel",
    "recompute",
    "dispatcher",
    "ep_overlap",
    "cp_algorithm",
    "shard_group",
)


def shape_of(candidate: Candidate) -> tuple[Any, ...]:
    """The knobs of ``candidate`` that are not in :data:`MINOR_KNOBS`."""
    c = candidate
    return (
        c.tp,
        c.cp,
        c.pp,
        c.dp,
        c.ep,
        c.etp,
        c.micro_batch,
        c.schedule,
        c.virtual_stages,
        c.zero,
        c.dtype,
    )


DEFAULT_TOLERANCE_PCT = 0.5
"""``collsim search``'s ``--tolerance`` (percent) when none is given: plans of one shape
within 0.5 % of each other are one row (:func:`collapse`). A choice of collsim: bucket sizes
and overlap flags move a step by hundredths of a percent, the sizes of one layer kind by
more."""


def collapse(ranked: list[Ranked], tolerance: float) -> list[Ranked]:
    """One row per family of alike plans, best first: walking ``ranked`` (by estimate), a
    plan joins the first row of its shape (:func:`shape_of`) whose best estimate it is within
    ``tolerance`` of (relative), and is listed in that row's :attr:`Ranked.alike`; otherwise
    it starts a row. ``tolerance <= 0``: every plan is a row."""
    for entry in ranked:
        entry.alike = []
    if tolerance <= 0:
        return list(ranked)
    rows: list[Ranked] = []
    open_rows: dict[tuple[Any, ...], list[Ranked]] = {}
    for entry in ranked:
        time_s = entry.estimate.step_time_s
        family = open_rows.setdefault(shape_of(entry.candidate), [])
        for row in family:
            if time_s <= row.estimate.step_time_s * (1 + tolerance):
                row.alike.append(entry)
                break
        else:
            family.append(entry)
            rows.append(entry)
    return rows


class _Loop:
    """The best-first estimate loop of :func:`search_plans`: estimate in increasing lower
    bound; once the bound cannot beat the keep-th best estimate (of distinct shapes when plans
    alike collapse), no later plan can (branch and bound: same top plans as estimating all of
    them). A plan reaching the front is first given its tighter bound (the pipeline schedule
    walked) and put back; it is estimated when it is still ahead."""

    def __init__(
        self,
        candidates: list[tuple[float, int, Candidate]],
        bounds: Bounds,
        *,
        keep: int,
        tolerance: float,
        progress: Callable[[str, int], None] | None,
        on_estimate: Callable[[list[Ranked]], None] | None,
    ) -> None:
        heapq.heapify(candidates)
        self.candidates = candidates
        self.bounds = bounds
        self.keep, self.tolerance = keep, tolerance
        self.progress, self.on_estimate = progress, on_estimate
        self.refined: set[int] = set()
        self.best: list[float] = []  # the keep best step times, max-heap by negation
        self.shapes: dict[tuple[Any, ...], float] = {}  # best step time per shape
        self.ranked: list[Ranked] = []
        self.rejected: Counter[str] = Counter()
        self.evaluated = 0
        self.stopped: str | None = None

    def take_known(self, known: Mapping[str, StepResult]) -> None:
        """Rank the plans of an earlier run (by label) without estimating them again."""
        if not known:
            return
        kept, taken = [], []
        for item in self.candidates:
            estimate = known.get(item[2].label)
            if estimate is None:
                kept.append(item)
            else:
                taken.append(item[2])
        heapq.heapify(kept)
        self.candidates[:] = kept
        self._record(taken, [(known[c.label], None) for c in taken], report=False)

    def run(self, workers: Any, training: TrainingConfig, parallel: ParallelConfig) -> None:
        """Estimate until the bound stops it, the plans run out, Ctrl-C or a lost scheduler."""

        def feed(size: int) -> tuple[list[Candidate], list[Any]] | None:
            # the next plans from the front, by the bound as the estimates so far set it
            batch = _next_batch(
                self.candidates,
                self.refined,
                self._threshold(),
                self.bounds,
                size,
                refine=self.keep > 0,
            )
            return (batch, [c.configs(training, parallel) for c in batch]) if batch else None

        try:
            for batch, estimates in workers.stream(_estimate_job, feed):
                self.evaluated += len(batch)
                self._record(batch, estimates)
            if self.candidates:
                self.rejected["bound"] += len(self.candidates)
                if self.progress is not None:
                    self.progress("bound", len(self.candidates))
        except KeyboardInterrupt:
            self.stopped = "interrupted (Ctrl-C)"
        except SchedulerLost as exc:
            self.stopped = str(exc)

    def _threshold(self) -> float | None:
        """The step time a plan's bound must beat to be estimated (None: no bound yet)."""
        if not self.keep:
            return None
        if self.tolerance > 0:
            if len(self.shapes) < self.keep:
                return None
            return heapq.nsmallest(self.keep, self.shapes.values())[-1]
        return -self.best[0] if len(self.best) >= self.keep else None

    def _record(
        self,
        batch: list[Candidate],
        estimates: list[tuple[StepResult | None, str | None]],
        *,
        report: bool = True,
    ) -> None:
        fresh = len(self.ranked)
        _record_estimates(batch, estimates, self.ranked, self.rejected, self.best, self.keep)
        for entry in self.ranked[fresh:]:
            shape = shape_of(entry.candidate)
            time_s = entry.estimate.step_time_s
            self.shapes[shape] = min(time_s, self.shapes.get(shape, time_s))
        if self.on_estimate is not None and len(self.ranked) > fresh:
            self.on_estimate(self.ranked[fresh:])
        if report and self.progress is not None:
            self.progress("estimate", len(batch))


def _bounded_candidates(
    plans: Iterable[Candidate],
    bounds: Bounds,
    capacity_bytes: float | None,
    rejected: Counter[str],
) -> tuple[list[tuple[float, int, Candidate]], int]:
    """(step lower bound, order, plan) of every plan whose memory floor fits in
    ``capacity_bytes`` (None: no memory bound), and the number of plans; the others are
    counted as ``memory_bound``."""
    candidates: list[tuple[float, int, Candidate]] = []
    total = 0
    for candidate in plans:
        total += 1
        if capacity_bytes is not None and bounds.memory_bytes(candidate) > capacity_bytes:
            rejected["memory_bound"] += 1
            continue
        candidates.append((bounds.step_s(candidate), total, candidate))
    return candidates, total


def _next_batch(
    candidates: list[tuple[float, int, Candidate]],
    refined: set[int],
    threshold: float | None,
    bounds: Bounds,
    batch_size: int,
    *,
    refine: bool = True,
) -> list[Candidate]:
    """Up to ``batch_size`` plans popped from the front of the heap ``candidates``; a plan
    reaching the front for the first time is given its tighter bound and put back, and none
    is taken once the front's bound cannot beat ``threshold`` (the keep-th best estimate;
    None: no pruning yet, or none at all); ``refine=False`` (no pruning) takes them as they
    are."""
    batch: list[Candidate] = []
    while candidates and len(batch) < batch_size:
        bound, order, candidate = candidates[0]
        if threshold is not None and bound >= threshold:
            break
        if refine and order not in refined:
            refined.add(order)
            tight = bounds.refined_s(candidate)
            heapq.heapreplace(candidates, (tight, order, candidate))
            continue
        heapq.heappop(candidates)
        batch.append(candidate)
    return batch


def _record_estimates(
    batch: list[Candidate],
    estimates: list[tuple[StepResult | None, str | None]],
    ranked: list[Ranked],
    rejected: Counter[str],
    best: list[float],
    keep: int,
) -> None:
    """Rank the plans that were built and fit, count the others in ``rejected`` by why, and
    keep the ``keep`` best step times in ``best``."""
    for candidate, (estimate, reason) in zip(batch, estimates, strict=True):
        if estimate is None:
            rejected[reason or "config"] += 1
        elif not estimate.fits:
            rejected["memory"] += 1
        else:
            ranked.append(Ranked(candidate, estimate))
            if keep:
                heapq.heappush(best, -estimate.step_time_s)
                if len(best) > keep:
                    heapq.heappop(best)


def _record_simulated(
    simulated: list[Ranked],
    outcomes: list[tuple[StepResult | None, str | None, float]],
    rejected: Counter[str],
    progress: Callable[[str, int], None] | None,
) -> list[Ranked]:
    """The simulated plans with their engine results, those that ran first and by step time;
    plans the engine found out of memory are counted as ``memory (DES)``."""
    for entry, (result, reason, seconds) in zip(simulated, outcomes, strict=True):
        entry.result, entry.reason, entry.simulate_s = result, reason, seconds
        if progress is not None:
            progress("simulate", 1)
    for entry in simulated:
        if entry.reason and entry.reason.startswith("memory"):
            rejected["memory (DES)"] += 1
    return sorted(simulated, key=lambda r: (r.reason is not None, r.step_time_s))


class _SearchContext:
    """What a search worker keeps: the cluster, the model, one estimator (its price cache)."""

    def __init__(
        self,
        topology: Topology,
        spec: TransformerSpec,
        simulate: Callable[..., StepResult] | None = None,
    ) -> None:
        self.topology = topology
        self.spec = spec
        self.estimator = Estimator(topology, spec)
        self.simulate = simulate or _simulate


def _estimate_job(
    ctx: _SearchContext, configs: tuple[TrainingConfig, ParallelConfig]
) -> tuple[StepResult | None, str | None]:
    """The closed form of one plan, or why it cannot be built."""
    try:
        return ctx.estimator.estimate(*configs), None
    except (InfeasibleError, ConfigError) as exc:
        return None, str(getattr(exc, "reason", "config"))


def _simulate_job(
    ctx: _SearchContext, configs: tuple[TrainingConfig, ParallelConfig]
) -> tuple[StepResult | None, str | None, float]:
    """The engine's step of one plan: (result, why it failed or does not fit, seconds)."""
    t0 = time.perf_counter()
    result: StepResult | None = None
    reason: str | None = None
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", CollsimWarning)
            result = ctx.simulate(ctx.topology, ctx.spec, *configs)
        if not result.fits:
            reason = "memory (DES)"
    except (InfeasibleError, ConfigError) as exc:
        reason = f"{getattr(exc, 'reason', 'config')}: {exc}"
    return result, reason, time.perf_counter() - t0


def _simulate(
    topology: Topology, spec: TransformerSpec, training: TrainingConfig, parallel: ParallelConfig
) -> StepResult:
    """The engine's step of one candidate, as every caller simulates one
    (:mod:`collsim.study.job`; no stragglers: the candidates are the plans, not the job)."""
    return simulate_inputs(StepInputs(topology, spec, training, parallel))
