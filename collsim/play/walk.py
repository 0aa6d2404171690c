"""The closed form of a step: the schedule walked as a critical path, without SimPy
(:class:`collsim.play.walker.Walker`), and the entry points that build and walk it.

Derivations, measurements and sources: docs/derivations.md, ``collsim.play.walk``.
"""

from __future__ import annotations

import dataclasses
import warnings
from collections import OrderedDict
from collections.abc import Hashable
from typing import TYPE_CHECKING

from collsim.core.errors import CollsimWarning, ConfigError
from collsim.core.runtime import collector_paused
from collsim.parallel.config import DDPConfig
from collsim.parallel.describe import describe_mapping
from collsim.play.walker import Walker
from collsim.step.assemble import assemble
from collsim.step.build import build_schedule, ddp_variant, without_dp_knobs
from collsim.step.pricing import ClosedPricer
from collsim.step.result import StepResult, StragglerReport
from collsim.step.shapes import ShapeCache
from collsim.step.stragglers import stretch_schedule

if TYPE_CHECKING:
    from collsim.cluster.topology import Topology
    from collsim.parallel.config import ParallelConfig, TrainingConfig
    from collsim.parallel.plan import Plan
    from collsim.play.walk_tables import SharedWalk
    from collsim.step.build import StepSchedule
    from collsim.step.stragglers import StragglerConfig
    from collsim.workload.model import TransformerSpec

__all__ = ["MAPPINGS_KEPT", "Estimator", "estimate_step", "walk"]


def walk(
    schedule: StepSchedule,
    pricer: ClosedPricer | None = None,
    *,
    timeline: bool = True,
    shapes: ShapeCache | None = None,
) -> StepResult:
    """The closed form of one step (see docs/derivations.md).

    Args:
        schedule: the step schedule.
        pricer: the closed-form price cache to use (a new one by default; share one across
            the plans of a search).
        timeline: keep each rank's memory timeline in the result (a search does not).
        shapes: the shape cache the schedule was built with, to keep each pipeline shape's
            op arrays across the plans of a search.
    """
    plan = schedule.plan
    if pricer is None:
        pricer = ClosedPricer(plan.topology)

    with collector_paused():
        w = Walker(schedule, pricer, shapes)
        w.run()
        result = assemble(
            plan,
            w,
            fidelity="closed",
            contended=[],
            zero_communication=pricer.zero,
            timeline=timeline,
            mapping=None if shapes is None else _mapping(plan, shapes, w.shared),
            shapes=shapes,
        )
        # freed by reference counting while the collector is still off: the walk's many
        # small objects would otherwise be scanned by the first collection after it
        del w
    return result


MAPPINGS_KEPT = 64
"""Rank layouts in words a search's shape cache keeps (the most recent; :func:`_mapping`)."""


def _mapping(plan: Plan, shapes: ShapeCache, shared: SharedWalk) -> str:
    """:func:`~collsim.parallel.describe.describe_mapping` of ``plan``, kept in a search's
    shape cache by the plan's configs without DDP's (its buckets and overlap place no rank
    and no layer; the cache's plans share one cluster and one model), and in the walks'
    shared tables (the plans that share a program differ only in their DDP knobs)."""
    if shared.mapping is None:
        parallel = dataclasses.replace(plan.parallel, ddp=DDPConfig())
        shared.mapping = shapes.recent(
            "mapping", (parallel, plan.training), lambda: describe_mapping(plan), MAPPINGS_KEPT
        )
    return shared.mapping


def estimate_step(
    topology: Topology,
    spec: TransformerSpec,
    training: TrainingConfig,
    parallel: ParallelConfig,
    *,
    op_time_overrides: dict[str, float] | None = None,
    zero_communication: bool = False,
    stragglers: StragglerConfig | None = None,
) -> StepResult:
    """``simulate_step``'s closed-form twin: build the schedule, walk it (the slowed pipeline's
    when ``stragglers`` slow some GPUs; see docs/derivations.md).

    Raises:
        ConfigError: stragglers the closed form cannot walk (degraded links, slowed stages in
            pipelines that differ), or a bad plan.
    """

    schedule = build_schedule(
        topology, spec, training, parallel, op_time_overrides=op_time_overrides
    )
    pricer = ClosedPricer(topology, zero=zero_communication)
    if stragglers is None:
        return walk(schedule, pricer)
    slowed = _straggler_schedule(schedule, stragglers)
    if slowed is schedule:
        return walk(schedule, pricer)
    baseline = walk(schedule, pricer)
    result = walk(slowed, pricer)
    resolved = stragglers.resolve(topology)
    result.stragglers = StragglerReport(
        clock_factors=dict(sorted(resolved.compute_factors.items())),
        tp_paced_ranks=sorted(resolved.tp_pace(schedule.plan)),
        stage_factors={
            f"dp{d}.pp{s}": f for (d, s), f in sorted(resolved.stage_factors(schedule.plan).items())
        },
        degraded_links={},
        baseline_step_time_s=baseline.step_time_s,
        step_time_s=result.step_time_s,
        slowdown=result.step_time_s / baseline.step_time_s,
        extra_s=result.step_time_s - baseline.step_time_s,
        critical_rank=result.critical_rank,
        longest_wait=None,
        waits=[],
    )
    return result


def _straggler_schedule(schedule: StepSchedule, stragglers: StragglerConfig) -> StepSchedule:
    """The schedule of the slowed pipeline (stages stretched), or a ConfigError."""

    plan = schedule.plan
    resolved = stragglers.resolve(plan.topology)
    if resolved.link_factors:
        raise ConfigError(
            "the closed form prices one representative group per axis and cannot place a "
            "degraded link; use --fidelity auto, fused or layer",
            key_path="stragglers.slow_link",
        )
    pipelines: dict[int, dict[int, float]] = {}
    for (d, s), f in resolved.stage_factors(plan).items():
        pipelines.setdefault(d, {})[s] = f
    patterns = {tuple(sorted(p.items())) for p in pipelines.values()}
    if len(patterns) > 1:
        raise ConfigError(
            "the closed form walks one slowed pipeline; these stragglers slow different stages "
            f"in data-parallel replicas {sorted(pipelines)}; use --fidelity auto, fused or layer",
            key_path="stragglers",
        )
    if not patterns:
        return schedule
    return stretch_schedule(schedule, dict(patterns.pop()))


PROGRAMS_KEPT = 16
"""Programs an :class:`Estimator` keeps to build a plan's variants from (the least recently
used dropped first). A search varies the bucket size innermost but its other DDP knobs
(overlap, bucket views) and the FSDP prefetch further out, so it comes back to a program after
others: after up to 14 in the searches of ``benchmarks/bench_closed_form.py`` (3d_175b, the
Qwen3-30B ``--ep`` and the Llama 3 70B ``--cp`` searches), which rebuilt 6, 16 and 2 programs
when 4 were kept."""


class Estimator:
    """Closed-form estimates of many plans of one model on one cluster, sharing one price cache.

    Args:
        topology: the cluster (its GPU count is the plans' tp x pp x dp).
        spec: the model.
    """

    def __init__(self, topology: Topology, spec: TransformerSpec) -> None:
        self.topology = topology
        self.spec = spec
        self.pricer = ClosedPricer(topology)
        self.shapes = ShapeCache()
        self._recent: OrderedDict[Hashable, StepSchedule] = OrderedDict()
        """The programs :meth:`schedule` built last (:data:`PROGRAMS_KEPT`), by their configs
        less the knobs :func:`~collsim.step.build.ddp_variant` takes over."""

    def estimate(self, training: TrainingConfig, parallel: ParallelConfig) -> StepResult:
        """The closed form of one plan.

        Raises:
            ConfigError: the plan does not match the model or the cluster (see build_plan).
        """

        return self.walk(self.schedule(training, parallel))

    def schedule(self, training: TrainingConfig, parallel: ParallelConfig) -> StepSchedule:
        """The step program of one plan (the first half of :meth:`estimate`).

        Raises:
            ConfigError: the plan does not match the model or the cluster (see build_plan).
        """
        key: Hashable | None = (training, without_dp_knobs(parallel))
        try:
            known = self._recent.get(key)
        except TypeError:  # a config that does not hash: built anew, not kept
            key, known = None, None
        with warnings.catch_warnings():  # kept in the plan's warnings, not raised per plan
            warnings.simplefilter("ignore", CollsimWarning)
            if known is not None:
                # a recent plan with the same configs but (maybe) its DDP knobs or FSDP
                # prefetch (a search's innermost axes): its program, the buckets and
                # data-parallel rules made anew
                schedule = ddp_variant(known, parallel, self.shapes)
            else:
                schedule = build_schedule(
                    self.topology, self.spec, training, parallel, cache=self.shapes
                )
        if key is not None:
            self._recent[key] = schedule
            self._recent.move_to_end(key)
            while len(self._recent) > PROGRAMS_KEPT:
                self._recent.popitem(last=False)
        return schedule

    def walk(self, schedule: StepSchedule) -> StepResult:
        """The closed form of a step program from :meth:`schedule` (no memory timeline)."""
        return walk(schedule, self.pricer, timeline=False, shapes=self.shapes)
