"""The engine: simulated ranks, their streams, pipeline messages, DP traffic and memory. By
default it simulates one representative rank per pipeline stage whose collectives stand for
their whole group and carry the other replicas' groups as DES ``peers`` ("simulate few, stand
for many", DESIGN.md); ``all_ranks=True`` simulates every rank, and stragglers break the
symmetry only where they must (:func:`simulated_ranks`; the rules in docs/derivations.md,
``collsim.play.engine.core``). Data-parallel work is in :mod:`~collsim.play.engine.dataparallel`;
the groups, streams and priced calls in :mod:`~collsim.play.engine.calls`, the collectives
inside segments in :mod:`~collsim.play.engine.segments` and the pipeline messages in
:mod:`~collsim.play.engine.pipe` (the engine's base classes, in that order).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import simpy

from collsim.core.errors import SimulationError
from collsim.parallel.pipeline import Phase, PipeOp
from collsim.play.engine.comm import CommPricer
from collsim.play.engine.dataparallel import DataParallel
from collsim.play.engine.pipe import RECV_STREAM, PipeMessages, PipeRoute
from collsim.play.engine.streams import GroupStream, Mail, RankState
from collsim.step.build import StepSchedule
from collsim.step.ops import StageModel
from collsim.step.pricing import SegmentPrices
from collsim.step.result import TraceEvent
from collsim.step.stats import CallKey, CallStats, CallTally, dp_link
from collsim.step.stragglers import StragglerPlan, stretch_stage

__all__ = [
    "Engine",
    "EngineOptions",
    "PipeRoute",
    "ProgramFactory",
    "RECV_STREAM",
    "simulated_ranks",
]


@dataclass(frozen=True, slots=True, kw_only=True)
class EngineOptions:
    """How the engine plays a schedule."""

    all_ranks: bool = False
    """Simulate every rank (else one representative per pipeline stage)."""
    layer_mode: bool = False
    """Run every layer step as its own event (TP collectives on the tp stream)."""
    des_axes: frozenset[str] = frozenset()
    """Axes whose calls run on the FlowNetwork DES (with peers) instead of the closed form:
    all of them at layer fidelity, the contended ones under ``auto``; none: every call is
    priced in closed form (no contention), as the closed form prices it."""
    trace: bool = False
    """Record one trace event per op and per communication call."""
    contended: tuple[str, ...] = ()
    """The axes found contended (reported in ``StepResult.details``)."""
    zero_communication: bool = False
    """Communication is priced at 0 s (reported in the details)."""
    stragglers: StragglerPlan | None = None
    """Slow ranks and degraded links (the topology already carries the degraded links)."""


def simulated_ranks(plan: Any, stragglers: StragglerPlan | None) -> list[int]:
    """The ranks the engine simulates without ``all_ranks`` (see the module docstring).

    Without stragglers: one per pipeline stage, (dp 0, tp 0). With them: every stage of the
    pipelines D = {0} + the dp indices of the slowed TP groups and of the ranks behind degraded
    links (+ the first unaffected dp index when dp 0 is itself affected, so that an unaffected
    replica's waits are seen), at the tp indices T = {0} + the tp indices of the ranks behind
    degraded links.
    """
    if stragglers is None or not stragglers.active:
        return [plan.rank(dp=0, pp=s, tp=0) for s in range(plan.pp)]
    paced = stragglers.tp_pace(plan)
    dps = (
        {0}
        | {plan.coords(r).dp for r in paced}
        | {plan.coords(r).dp for r in stragglers.link_ranks if r < plan.num_gpus}
    )
    tps = {0} | {plan.coords(r).tp for r in stragglers.link_ranks if r < plan.num_gpus}
    spare = [d for d in range(plan.dp) if d not in dps]
    if spare and 0 in {plan.coords(r).dp for r in paced} | {
        plan.coords(r).dp for r in stragglers.link_ranks if r < plan.num_gpus
    }:
        dps.add(spare[0])
    return sorted(
        plan.rank(dp=d, pp=s, tp=t) for d in sorted(dps) for s in range(plan.pp) for t in tps
    )


ProgramFactory = Callable[["Engine", int, StageModel, list[PipeOp]], RankState]
"""Builds one rank's program from the engine, the rank, its stage and its pipeline ops."""


class Engine(PipeMessages):
    """Wires rank programs, streams and mailboxes for one step, and runs it.

    Args:
        schedule: the step schedule (what every rank runs).
        pricer: communication pricing.
        options: how to play it.
        program: builds each simulated rank's program
            (:class:`collsim.play.engine.program.RankProgram`).
        env: the simulation environment (a new one by default).
    """

    def __init__(
        self,
        schedule: StepSchedule,
        pricer: CommPricer,
        options: EngineOptions,
        *,
        program: ProgramFactory,
        env: simpy.Environment | None = None,
    ) -> None:
        plan = schedule.plan
        self.schedule = schedule
        self.plan = plan
        self.options = options
        self.env = env if env is not None else simpy.Environment()
        pricer.env = self.env
        self.stages = schedule.stages
        self.pricer = pricer
        self.all_ranks = options.all_ranks
        self.layer_mode = options.layer_mode
        self.des_axes = options.des_axes
        self.trace_on = options.trace
        self.contended = list(options.contended)
        self.zero_communication = options.zero_communication
        self.zero = schedule.dp.zero
        self.prefetch = schedule.dp.prefetch
        self.dp = DataParallel(plan, schedule.dp, self, self.env)
        self.trace_events: list[TraceEvent] = []
        self.stats = CallStats()
        self.mail: dict[tuple[int, Phase, int, int], Mail] = {}
        self.stragglers = options.stragglers
        self.pace = self.stragglers.tp_pace(plan) if self.stragglers is not None else {}
        """Rank -> clock factor of its TP group (only the slowed ones)."""
        if self.all_ranks:
            ranks = list(range(plan.num_gpus))
        else:
            ranks = simulated_ranks(plan, self.stragglers)
        self.simulated = set(ranks)
        self.representatives = {plan.rank(dp=0, pp=s, tp=0) for s in range(plan.pp)}
        self.broken = not self.all_ranks and self.simulated != self.representatives
        """Symmetry broken by stragglers: more than one simulated rank per stage."""
        self._stretched: dict[tuple[int, float], Any] = {}
        self.streams: dict[tuple[str, tuple[int, ...]], GroupStream] = {}
        self.programs: dict[int, RankState] = {}
        for rank in ranks:
            s = plan.coords(rank).pp
            self.programs[rank] = program(
                self, rank, self.stage_model(rank), list(schedule.pipeline[s])
            )
        self._links: dict[tuple[int, int], Any] = {}
        """Per (sending rank, receiving stage): :meth:`_pipe_link`."""
        self._peers: dict[tuple[int, str], list[tuple[int, ...]]] = {}
        self._calls: dict[tuple[Any, ...], tuple[Any, dict[str, Any]]] = {}
        self._gathers: dict[int, tuple[float, CallKey | None, float]] = {}
        """Per rank: the closed-form pipeline gather's seconds, statistics key and busbw."""
        self.prices = SegmentPrices(
            plan, pricer, schedule.overlap_factor if schedule.step_interference else None
        )
        self.seg_runs: dict[tuple[int, int], list[Any]] = {}
        self._tallied: dict[CallKey, list[Any]] = {}

    def stat_items(self) -> Iterator[tuple[CallKey, CallTally]]:
        return self.stats.items()

    def interference_s(self, prog: RankState) -> float:
        """The schedule's first-order interference for this rank, from its data-parallel call
        tallies so far (every gradient reduction has ended when this is asked)."""
        link, busbw = dp_link(self.stats.items(), prog.rank)
        return self.schedule.interference_s(
            dp_link_s=link, busbw_bps=busbw, compute_s=prog.breakdown_s["compute"]
        )

    # ---- stragglers -------------------------------------------------------------------------
    def stage_model(self, rank: int) -> Any:
        """The stage ``rank`` runs: the schedule's, with compute stretched by its TP group's
        clock factor when the group has a straggler (one stretched copy per stage and factor)."""
        s = self.plan.coords(rank).pp
        factor = self.pace.get(rank, 1.0)
        if factor >= 1.0:
            return self.stages[s]
        key = (s, factor)
        found = self._stretched.get(key)
        if found is None:
            found = self._stretched[key] = stretch_stage(self.stages[s], factor)
        return found

    def framework_step_s(self, rank: int) -> float:
        """Seconds of ``rank``'s per-step framework work (stretched like its compute)."""
        stage = self.plan.coords(rank).pp
        return self.schedule.framework_step_s.get(stage, 0.0) / self.pace.get(rank, 1.0)

    def optimizer_s(self, rank: int) -> float:
        """Seconds of ``rank``'s optimizer step (stretched like its compute)."""
        return self.schedule.optimizer_s[self.plan.coords(rank).pp] / self.pace.get(rank, 1.0)

    def rendezvous_waits(self) -> list[dict[str, Any]]:
        """Per stream with two or more simulated members: the call whose rendezvous waited
        longest, who it waited for and how long each member waited; longest first."""
        out = []
        for (axis, group), stream in self.streams.items():
            hit = stream.longest
            if hit is None or len(stream.members) < 2:
                continue
            out.append(
                {
                    "axis": axis,
                    "group": list(group),
                    "call": hit.call,
                    "wait_s": hit.wait_s,
                    "waited_for": hit.waited_for,
                    "waits_s": dict(hit.waits_s),
                    "total_wait_s": {m: w for m, w in stream.wait_s.items() if w},
                }
            )
        return sorted(out, key=lambda w: (-w["wait_s"], w["axis"], w["group"]))

    # ---- run --------------------------------------------------------------------------------
    def release(self) -> None:
        """Drop what ties the engine to its programs, streams and messages once the step's
        result is taken (the result keeps the ledgers it reads): without these cycles the
        step's objects are freed as their last reference goes, not by a collection of the
        cyclic garbage collector over every one of them (3d_175b: 17,441 objects of cyclic
        garbage before, 30 after; the time of the collections in docs/derivations.md,
        measurements). The engine cannot run again after it."""
        if not hasattr(self, "dp"):
            return  # released already
        self.programs = {}
        self.streams = {}
        self.mail = {}
        self._links = {}
        self.dp.unit_events = {}
        del self.dp

    def run(self) -> None:
        procs = [self.env.process(prog.run()) for prog in self.programs.values()]
        try:
            self.env.run(self.env.all_of(procs))
        except RuntimeError as exc:  # SimPy: no events left, some rank still waiting
            stuck = [
                prog.rank for prog, proc in zip(self.programs.values(), procs) if not proc.processed
            ]
            raise SimulationError(
                f"ranks {stuck[:8]} never finished the step ({exc}): a "
                "dependency or rendezvous was never satisfied"
            ) from exc
        self.flush_tp_stats()
