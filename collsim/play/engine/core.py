"""The engine: simulated ranks, their streams, pipeline messages, DP traffic and memory.

Symmetry reduction ("simulate few, stand for many", DESIGN.md): by default one representative
rank per pipeline stage is simulated (tp index 0, dp index 0); its TP peers and DP replicas run
the same program at the same times. Its collectives stand for their whole group, and in the DES
they carry as ``peers`` the groups of the other replicas running at the same moment, so shared
links are still loaded. ``all_ranks=True`` simulates every rank: each group's calls then
rendezvous over all its members (:class:`~collsim.play.engine.streams.GroupStream`).

Stragglers (:mod:`collsim.step.stragglers`) break the symmetry only where they must
(:func:`simulated_ranks`). A straggler's tensor-parallel group runs at its slowest member's pace
(every layer ends in a blocking TP collective that waits for it), so the group's tp-index-0
rank stands for it with its compute stretched; its pipeline (the same dp index, every stage) is
simulated, so that the slowed stage delays the stages downstream and upstream of it; and the
data-parallel streams of every stage then have two or more simulated members, which
rendezvous: the representative pipeline (dp 0) waits there for the slow one. A degraded link
adds the tp indices of the ranks it serves. Replicas that are not simulated run as the
representative does; only the representatives carry DES peers (the other simulated groups load
the network themselves, at their own times). Each stream records the call whose rendezvous
waited longest and who it waited for (:meth:`Engine.rendezvous_waits`).

Data-parallel work (model states, buckets, FSDP units, optimizer) is in
:mod:`collsim.play.engine.dataparallel`.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import simpy

from collsim.core.errors import SimulationError
from collsim.core.vocab import DATA_PARALLEL_AXES, ParallelAxis
from collsim.parallel.pipeline import Phase, PipeOp, flow
from collsim.play.engine.comm import CommPricer, linked_peers
from collsim.play.engine.dataparallel import DataParallel
from collsim.play.engine.streams import CallRecord, GroupStream, Mail, RankState
from collsim.step.build import StepSchedule
from collsim.step.ops import Segment, StageModel, Step
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

RECV_STREAM = "pp recv"
"""Trace stream of a rank's pipeline receives (the same transfers as the sender's ``pp``
slices, seen from the receiver; a thread of its own, as receives overlap the rank's sends)."""


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


TP, PP, DP = ParallelAxis.TP, ParallelAxis.PP, ParallelAxis.DP


ProgramFactory = Callable[["Engine", int, StageModel, list[PipeOp]], RankState]
"""Builds one rank's program from the engine, the rank, its stage and its pipeline ops."""


@dataclass(slots=True)
class PipeRoute:
    """Where a pipeline op's output goes (:meth:`Engine.outbox`)."""

    stage: int
    dst: int
    """The receiving rank (the same grid position on ``stage``)."""
    mail: Mail
    peers: list[tuple[int, ...]]
    """Pairs that share the send's links (DES only)."""
    reserve: tuple[GroupStream, float, CallKey, float] | None = None
    """Closed form on a one-member stream: (stream, seconds, statistics key, busbw)."""


class Engine:
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
            dp_link_s=link, busbw_bps=busbw, compute_s=prog.acct["compute"]
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

    def _unsimulated(self, groups: list[tuple[int, ...]]) -> list[tuple[int, ...]]:
        """The groups with no simulated member (the others load the network themselves)."""
        if not self.broken:
            return groups
        return [g for g in groups if not any(r in self.simulated for r in g)]

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

    # ---- groups, peers and streams ----------------------------------------------------------
    def group(self, rank: int, axis: str) -> tuple[int, ...]:
        return self.prices.group(rank, axis)

    def peers(self, rank: int, axis: str, *, pairs: bool = False) -> list[tuple[int, ...]]:
        """Groups of the replicas of ``rank``'s group that run at the same time (symmetry):
        the other groups of ``axis`` among the ranks of the same pipeline stage (for tp: one
        per dp and cp index; for dp: one per tp and cp index). ``pairs``: their ring pairs
        (context-parallel ring steps)."""
        gate = DP if axis in DATA_PARALLEL_AXES else axis
        if self.all_ranks or gate not in self.des_axes:
            return []
        if self.broken and rank not in self.representatives:
            # the group's calls carry the peers its representative gives them (whichever
            # member issues first); groups without one load the network only themselves
            rep = next((r for r in self.group(rank, axis) if r in self.representatives), None)
            return [] if rep is None else self.peers(rep, axis, pairs=pairs)
        key = (rank, axis if not pairs else axis + " pairs")
        found = self._peers.get(key)
        if found is not None:
            return found
        p, c = self.plan, self.plan.coords(rank)
        own = self.group(rank, axis)
        seen = set(own)
        others: list[tuple[int, ...]] = []
        for r in p.stage_ranks(c.pp):
            if r in seen:
                continue
            g = p.group_of(r, axis)
            seen.update(g)
            if pairs:
                n = len(g)
                others += [(g[i], g[(i + 1) % n]) for i in range(n if n > 2 else 1)]
            else:
                others.append(g)
        if pairs:
            found = self._peers[key] = self._unsimulated(others)
        else:
            found = self._peers[key] = linked_peers(p.topology, own, self._unsimulated(others))
        return found

    def stream(self, rank: int, axis: str, group: tuple[int, ...] | None = None) -> GroupStream:
        """The stream of ``rank``'s group on ``axis`` (pp: the rank's own send stream; an
        explicit ``group`` for other groups, e.g. the embedding group)."""
        if group is None:
            group = (rank,) if axis == PP else self.group(rank, axis)
        key = (axis, group)
        found = self.streams.get(key)
        if found is None:
            members = tuple(r for r in group if r in self.simulated)
            found = GroupStream(self.env, members, axis, on_done=self._on_done(axis))
            self.streams[key] = found
        return found

    def _on_done(self, axis: str) -> Any:
        def done(members: list[int], record: CallRecord) -> None:
            args = record.args
            result = args.pop("result", None)
            algorithm = str(getattr(result, "algorithm", args.get("algorithm", "none")))
            busbw = float(getattr(result, "busbw_bps", args.get("busbw_bps", 0.0)))
            duration = record.end_s - record.start_s
            for m in members:
                key = CallKey(
                    m, axis, args["op"], args["size_bytes"], args["group_size"], algorithm
                )
                self.stats.add(key, duration, busbw)
                if self.trace_on:
                    self.add_trace(m, axis, record.name, record.start_s, record.end_s, args)

        return done

    def add_trace(
        self, rank: int, stream: str, name: str, start: float, end: float, args: dict[str, Any]
    ) -> None:
        self.trace_events.append(TraceEvent(rank, stream, name, start, end, dict(args)))

    def pair_peers(
        self, pair: tuple[int, int], peers: list[tuple[int, ...]]
    ) -> list[tuple[int, ...]]:
        """Peers of a pair on the pp axis that share its links (none unless pp is on the DES)."""
        if self.all_ranks or PP not in self.des_axes:
            return []
        if self.broken and not set(pair) & self.representatives:
            return []
        return linked_peers(self.plan.topology, pair, self._unsimulated(peers))

    def call(
        self,
        rank: int,
        axis: str,
        op: str,
        size: float,
        ranks: tuple[int, ...],
        name: str,
        *,
        ready_s: float | None = None,
        extra_s: float = 0.0,
        peers: list[tuple[int, ...]] | None = None,
        stream_group: tuple[int, ...] | None = None,
    ) -> simpy.Event:
        work, args = self._priced(
            op, size, ranks, des=axis in self.des_axes, extra_s=extra_s, peers=peers
        )
        return self.stream(rank, axis, stream_group).submit(
            rank, name, work, ready_s=ready_s, args=args
        )

    def reserve(
        self,
        rank: int,
        axis: str,
        op: str,
        size: float,
        ranks: tuple[int, ...],
        *,
        ready_s: float,
        stream_group: tuple[int, ...] | None = None,
    ) -> float | None:
        """A call that nothing waits for until later, when it can be priced in closed form on
        a one-member stream without a trace: reserved on the stream (no event, no record) and
        added to the statistics as :meth:`call` adds it when it ends; its end in seconds.
        None when it must be issued with :meth:`call` (the DES, a rendezvous, a trace)."""
        if self.trace_on or axis in self.des_axes:
            return None
        stream = self.stream(rank, axis, stream_group)
        if not stream.solo:
            return None
        work, args = self._priced(op, size, ranks)
        start, end = stream.reserve_from(ready_s, float(work))
        key = CallKey(rank, axis, op, size, len(ranks), args["algorithm"])
        self.stats.add(key, end - start, args["busbw_bps"])
        return end

    def _priced(
        self,
        op: str,
        size: float,
        ranks: tuple[int, ...],
        *,
        des: bool = False,
        extra_s: float = 0.0,
        peers: list[tuple[int, ...]] | None = None,
    ) -> tuple[Any, dict[str, Any]]:
        """A call's work (seconds, or a DES process factory) and its statistics and trace
        facts; cached per (op, size, ranks, extra) when priced in closed form."""
        key = (op, size, ranks, extra_s)
        hit = None if des else self._calls.get(key)
        if hit is None:
            cost = self.pricer.cost(op, size, ranks)
            work = self.pricer.work(
                op, size, ranks, des=des, extra_s=extra_s, peers=peers if peers is not None else []
            )
            hit = (
                work,
                {
                    "op": op,
                    "size_bytes": size,
                    "bytes": size,
                    "group_size": len(ranks),
                    "algorithm": cost.algorithm,
                    "busbw_bps": cost.busbw_bps,
                },
            )
            if not des:
                self._calls[key] = hit
        return hit

    # ---- segment collectives (tp, ep, etp, cp) -----------------------------------------------
    def step_group(self, rank: int, step: Step) -> tuple[int, ...]:
        return self.prices.step_group(rank, step)

    def tp_time(self, rank: int, op: str, size: float) -> float:
        return self.prices.collective_s(rank, Step(op=op, size_bytes=size))

    def step_s(self, rank: int, step: Step) -> float:
        return self.prices.step_s(rank, step)

    def seg_comm_s(self, rank: int, seg: Segment) -> dict[str, float]:
        return self.prices.seg_comm_s(rank, seg)

    def seg_tp_s(self, rank: int, seg: Segment) -> float:
        return self.prices.seg_tp_s(rank, seg)

    def step_args(self, rank: int, step: Step) -> dict[str, Any]:
        """Trace args of a closed-form segment collective (what ``call`` records)."""
        group = self.step_group(rank, step)
        cost = self.pricer.cost(step.op, step.size_bytes, group)
        return {
            "op": step.op,
            "size_bytes": step.size_bytes,
            "bytes": step.size_bytes,
            "group_size": len(group),
            "algorithm": cost.algorithm,
            "busbw_bps": cost.busbw_bps,
        }

    def tp_args(self, rank: int, op: str, size: float) -> dict[str, Any]:
        return self.step_args(rank, Step(op=op, size_bytes=size))

    def tp_slices(
        self, rank: int, segs: list[Segment]
    ) -> list[tuple[float, float, str, dict[str, Any], str]]:
        """The collectives inside fused segments run back to back from time 0, as
        (start_s, end_s, name, args, axis): each at its exact offset, lasting its link time (an
        overlapped one starts with the compute it overlaps). Only for traces."""
        out = []
        t = 0.0
        for seg in segs:
            for step in seg.steps:
                if step.op:
                    link = self.prices.collective_s(rank, step)
                    if link > 0:
                        args = self.step_args(rank, step)
                        if step.overlap_s:
                            args["overlapped_compute_s"] = step.overlap_s
                        where = f"L{seg.key}" if isinstance(seg.key, int) else seg.key
                        out.append((t, t + link, f"{step.op} {step.axis} {where}", args, step.axis))
                t += self.step_s(rank, step)
        return out

    def count_op(self, rank: int, work: Any, *, runs: int = 1) -> None:
        """Count ``runs`` runs of a fused op (or segment): its collectives, for
        flush_tp_stats."""
        key = (rank, id(work))
        slot = self.seg_runs.get(key)
        if slot is None:
            self.seg_runs[key] = [work, runs]
        else:
            slot[1] += runs

    def tally(self, key: CallKey, time_s: float, busbw_bps: float, *, count: int = 1) -> None:
        """``count`` closed-form calls lasting ``time_s`` in all, for the statistics, added to
        them by :meth:`flush_tp_stats` (pipeline sends and gathers: the same few keys,
        thousands of times)."""
        slot = self._tallied.get(key)
        if slot is None:
            self._tallied[key] = [count, time_s, busbw_bps]
        else:
            slot[0] += count
            slot[1] += time_s

    def flush_tp_stats(self) -> None:
        """Turn the counted fused-segment runs and the tallied calls into per-collective
        statistics."""
        for key, (count, time_s, busbw) in self._tallied.items():
            self.stats.add(key, time_s, busbw, count=count)
        self._tallied.clear()
        for (rank, _), (work, runs) in self.seg_runs.items():
            segs = work.segs if hasattr(work, "segs") else [work]
            for step in (c for seg in segs for st in seg.steps for c in st.calls()):
                if step.op:
                    group = self.step_group(rank, step)
                    if len(group) < 2:
                        continue
                    cost = self.pricer.cost(step.op, step.size_bytes, group)
                    key = CallKey(
                        rank, step.axis, step.op, step.size_bytes, len(group), cost.algorithm
                    )
                    self.stats.add(key, runs * cost.time_s, cost.busbw_bps, count=runs)
        self.seg_runs.clear()

    def step_call(self, prog: RankState, step: Step) -> simpy.Event:
        """A segment step's collective on the stream of its axis (layer fidelity); with
        collectives beside it, all of them at once."""
        if step.beside:
            calls = [self._step_call(prog, c) for c in step.calls()]
            return self.env.all_of(calls)
        return self._step_call(prog, step)

    def _step_call(self, prog: RankState, step: Step) -> simpy.Event:
        axis = step.axis
        group = self.step_group(prog.rank, step)
        if step.op == "send_recv":
            ring = self.group(prog.rank, axis)
            n = len(ring)
            others = [(ring[i], ring[(i + 1) % n]) for i in range(n if n > 2 else 1)]
            peers = [p for p in others if p != group] + self.peers(prog.rank, axis, pairs=True)
            peers = self.pair_peers_of(axis, group, peers)
        else:
            peers = self.peers(prog.rank, axis)
        return self.call(
            prog.rank,
            axis,
            step.op,
            step.size_bytes,
            group,
            f"{step.op} {axis}",
            peers=peers,
            stream_group=self.group(prog.rank, axis),
        )

    def pair_peers_of(
        self, axis: str, pair: tuple[int, ...], peers: list[tuple[int, ...]]
    ) -> list[tuple[int, ...]]:
        if self.all_ranks or axis not in self.des_axes:
            return []
        return linked_peers(self.plan.topology, pair, peers)

    def tp_call(
        self, prog: RankState, op: str, size: float, name: str | None = None
    ) -> simpy.Event:
        group = self.group(prog.rank, TP)
        return self.call(
            prog.rank, TP, op, size, group, name or f"{op} tp", peers=self.peers(prog.rank, TP)
        )

    def pp_gather(self, prog: RankState, op: PipeOp) -> simpy.Event | None:
        """The all-gather that completes a received pipeline message (None when there is none).

        Megatron's scatter/gather optimisation (Narayanan et al. 2021, section 4.1): each TP
        rank sends only 1/t of the ``b x s x h`` activation (or gradient) over the network;
        the receiving stage all-gathers the pieces over its TP group (NVLink) before the op
        can start. With sequence parallelism the tensors are already sequence-sharded and
        Megatron sends the shards as they are: no gather.
        """
        if self.plan.tp < 2 or self.plan.parallel.sequence_parallel:
            return None
        name = (
            f"all_gather pp recv {op.phase.value} mb{op.microbatch} c{op.chunk}"
            if self.trace_on
            else "all_gather pp recv"
        )
        return self.tp_call(prog, "all_gather", self._p2p_size * self.plan.tp, name)

    def pp_gather_cost(self, prog: RankState) -> tuple[float, CallKey | None, float] | None:
        """The closed-form pipeline gather of ``prog``'s received messages: (seconds,
        statistics key or None when there is no gather, busbw); None when it must run on the tp
        stream (all ranks simulated, whose members rendezvous, or a tp axis on the DES)."""
        if self.plan.tp < 2 or self.plan.parallel.sequence_parallel:
            return 0.0, None, 0.0
        if self.all_ranks or TP in self.des_axes:
            return None
        if self.broken and len(self.stream(prog.rank, TP).members) > 1:
            return None  # simulated TP peers: they rendezvous on the tp stream
        hit = self._gathers.get(prog.rank)
        if hit is None:
            size = self._p2p_size * self.plan.tp
            group = self.group(prog.rank, TP)
            cost = self.pricer.cost("all_gather", size, group)
            key = CallKey(prog.rank, TP, "all_gather", size, len(group), cost.algorithm)
            hit = self._gathers[prog.rank] = (cost.time_s, key, cost.busbw_bps)
        return hit

    def pp_gather_s(self, prog: RankState, op: PipeOp) -> float | None:
        """The pipeline gather of :meth:`pp_gather` in closed form, starting now: its seconds
        (0 when there is none), recorded in the statistics and the trace as the tp stream
        would record it; None when it must run on the tp stream (:meth:`pp_gather_cost`). A
        fused op then starts after it, in the same timeout: the tp stream of a fused
        representative runs nothing else."""
        found = self.pp_gather_cost(prog)
        if found is None:
            return None
        time_s, key, busbw = found
        if key is None:
            return 0.0
        self.tally(key, time_s, busbw)
        if self.trace_on:
            now = self.env.now
            size = self._p2p_size * self.plan.tp
            self.add_trace(
                prog.rank,
                TP,
                f"all_gather pp recv {op.phase.value} mb{op.microbatch} c{op.chunk}",
                now,
                now + time_s,
                self.tp_args(prog.rank, "all_gather", size),
            )
        return time_s

    # ---- pipeline ---------------------------------------------------------------------------
    def _stage_rank(self, rank: int, stage: int) -> int:
        c = self.plan.coords(rank)
        return self.plan.rank(dp=c.dp, pp=stage, tp=c.tp, cp=c.cp)

    @property
    def _p2p_size(self) -> float:
        """Per TP rank: b s h / t activations (Megatron's scatter-gather of pipeline sends)."""
        return self.schedule.p2p_bytes

    def routes(self, prog: RankState) -> tuple[list[Mail | None], list[PipeRoute | None]]:
        """Per op of ``prog``, in order: the mailbox its input arrives in (None: it reads
        nothing from another stage, the schedule's
        :meth:`~collsim.parallel.pipeline.PipelineSchedule.input_of`) and where its output goes
        (None: to no other stage, :meth:`~collsim.parallel.pipeline.PipelineSchedule.output_of`).
        The output route also carries the pairs that share the
        send's links and, for a send priced in closed form on a one-member stream without a
        trace, that stream with the send's seconds and statistics key (the send is then
        reserved on it, not played).

        One pass over the ops (the engine's per-op set-up: 1,536 ops per 3d_175b step)."""
        p, v = self.plan.pp, self.plan.virtual_stages
        input_of = self.plan.pipeline_schedule.input_of
        output_of = self.plan.pipeline_schedule.output_of
        s, rank = prog.coords.pp, prog.rank
        mail, env, links = self.mail, self.env, self._links
        inboxes: list[Mail | None] = []
        outboxes: list[PipeRoute | None] = []
        # where an op's input comes from and its output goes depend on its phase and chunk
        # only (the micro-batch passes through): worked out once per (phase, chunk)
        # (a backward's message is named by its direction, flow(): I sends what B sends)
        shapes: dict[tuple[Phase, int], tuple[Phase | None, tuple[int, Phase, int] | None]] = {}
        for op in prog.ops:
            shape = shapes.get((op.phase, op.chunk))
            if shape is None:
                src = input_of(op, stage=s, num_stages=p, virtual_stages=v)
                dest = output_of(op, stage=s, num_stages=p, virtual_stages=v)
                shape = shapes[(op.phase, op.chunk)] = (
                    flow(op.phase) if src is not None and src[0] != s else None,
                    None
                    if dest is None or dest[0] == s
                    else (dest[0], dest[1].phase, dest[1].chunk),
                )
            direction, out = shape
            if direction is not None:
                key = (rank, direction, op.microbatch, op.chunk)
                box = mail.get(key)
                if box is None:
                    box = mail[key] = Mail(env)
                inboxes.append(box)
            else:
                inboxes.append(None)
            if out is None:
                outboxes.append(None)
                continue
            stage, dst_phase, dst_chunk = out
            link = links.get((rank, stage))
            if link is None:
                link = links[(rank, stage)] = self._pipe_link(prog, stage)
            dst, peers, reserve = link
            key = (dst, dst_phase, op.microbatch, dst_chunk)
            box = mail.get(key)
            if box is None:
                box = mail[key] = Mail(env)
            outboxes.append(PipeRoute(stage, dst, box, peers, reserve))
        return inboxes, outboxes

    def _pipe_link(
        self, prog: RankState, stage: int
    ) -> tuple[int, list[tuple[int, ...]], tuple[GroupStream, float, CallKey, float] | None]:
        """What every send of ``prog`` to ``stage`` shares (:class:`PipeRoute`): the receiving
        rank, the pairs on its links, and the closed-form reservation when there is one."""
        src, dst = prog.rank, self._stage_rank(prog.rank, stage)
        size = self._p2p_size
        pairs: list[tuple[int, ...]] = (
            []
            if self.all_ranks
            or PP not in self.des_axes
            or (self.broken and prog.rank not in self.representatives)
            else [
                (
                    self.plan.rank(dp=d, pp=prog.coords.pp, tp=t, cp=k),
                    self.plan.rank(dp=d, pp=stage, tp=t, cp=k),
                )
                for d in range(self.plan.dp)
                for k in range(self.plan.cp)
                for t in range(self.plan.tp)
                if d or t or k
            ]
        )
        peers = linked_peers(self.plan.topology, (src, dst), self._unsimulated(pairs))
        reserve = None
        if not self.trace_on and PP not in self.des_axes:
            stream = self.stream(src, PP)
            if stream.solo:
                work, args = self._priced("send_recv", size, (src, dst), peers=peers)
                call = CallKey(src, PP, "send_recv", size, 2, str(args["algorithm"]))
                reserve = (stream, float(work), call, float(args["busbw_bps"]))
        return dst, peers, reserve

    def send_output(self, prog: RankState, op: PipeOp, route: PipeRoute) -> None:
        """Send ``op``'s output along ``route`` (:meth:`outbox`) on the rank's pp stream."""
        src, dst, stage = prog.rank, route.dst, route.stage
        size = self._p2p_size
        mail = route.mail
        now = self.env.now
        mail.produced_s = now
        mail.size_bytes = size
        receiver = self.programs.get(dst)
        if route.reserve is not None:
            stream, work_s, call, busbw = route.reserve
            end = stream.reserve(work_s)
            self.tally(call, work_s, busbw)
            if receiver is not None:
                receiver.ledger.alloc(end, "buffers", size, "pp recv")
            mail.fire_in(end - now)
            return
        name = (
            f"send {op.phase.value} mb{op.microbatch} c{op.chunk} -> stage {stage}"
            if self.trace_on
            else "send"
        )
        done = self.call(src, PP, "send_recv", size, (src, dst), name, peers=route.peers)

        def deliver(ev: simpy.Event) -> None:
            if receiver is not None:
                receiver.ledger.alloc(self.env.now, "buffers", size, "pp recv")
                record = ev.value
                if self.trace_on and isinstance(record, CallRecord):
                    self.add_trace(
                        dst,
                        RECV_STREAM,
                        f"recv {op.phase.value} mb{op.microbatch} c{op.chunk} "
                        f"<- stage {prog.coords.pp}",
                        record.start_s,
                        record.end_s,
                        {**record.args, "src_rank": src},
                    )
            mail.succeed()

        done.callbacks.append(deliver)

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
