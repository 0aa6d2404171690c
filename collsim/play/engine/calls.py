"""The engine's group calls: process groups, their streams, peers and the pricing of a call.

:class:`GroupCalls` is the base of :class:`~collsim.play.engine.core.Engine`: it finds the
group of a rank on an axis, the replica groups that run beside it at the same moment (the DES
``peers`` of symmetry reduction, DESIGN.md), the stream of a group, and issues a priced
collective on that stream (or reserves it there in closed form when nothing waits for it). The
engine's constructor sets every attribute declared here.
"""

from __future__ import annotations

from typing import Any

import simpy

from collsim.core.vocab import DATA_PARALLEL_AXES, ParallelAxis
from collsim.parallel.pipeline import Phase
from collsim.parallel.plan import Plan
from collsim.play.engine.comm import CommPricer, linked_peers
from collsim.play.engine.streams import CallRecord, GroupStream, Mail, RankState
from collsim.step.build import StepSchedule
from collsim.step.pricing import SegmentPrices
from collsim.step.result import TraceEvent
from collsim.step.stats import CallKey, CallStats

__all__ = ["GroupCalls"]

TP, PP, DP = ParallelAxis.TP, ParallelAxis.PP, ParallelAxis.DP


class GroupCalls:
    """Groups, peers, streams and priced calls of one step's engine (set by ``Engine``)."""

    schedule: StepSchedule
    plan: Plan
    env: simpy.Environment
    pricer: CommPricer
    prices: SegmentPrices
    all_ranks: bool
    des_axes: frozenset[str]
    trace_on: bool
    trace_events: list[TraceEvent]
    stats: CallStats
    simulated: set[int]
    representatives: set[int]
    broken: bool
    streams: dict[tuple[str, tuple[int, ...]], GroupStream]
    programs: dict[int, RankState]
    mail: dict[tuple[int, Phase, int, int], Mail]
    _links: dict[tuple[int, int], Any]
    _peers: dict[tuple[int, str], list[tuple[int, ...]]]
    _calls: dict[tuple[Any, ...], tuple[Any, dict[str, Any]]]
    _gathers: dict[int, tuple[float, CallKey | None, float]]
    seg_runs: dict[tuple[int, int], list[Any]]
    _tallied: dict[CallKey, list[Any]]

    def _unsimulated(self, groups: list[tuple[int, ...]]) -> list[tuple[int, ...]]:
        """The groups with no simulated member (the others load the network themselves)."""
        if not self.broken:
            return groups
        return [g for g in groups if not any(r in self.simulated for r in g)]

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
