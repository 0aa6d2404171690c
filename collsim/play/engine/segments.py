"""The engine's segment collectives: the tp, ep, etp and cp calls inside a stage's layers.

:class:`SegmentCalls` prices the collectives of a segment's steps for the engine: in closed
form inside a fused op (their seconds, trace slices and statistics, counted per run and turned
into per-collective statistics at the end), or as calls on the stream of their axis at layer
fidelity.
"""

from __future__ import annotations

from typing import Any

import simpy

from collsim.core.vocab import ParallelAxis
from collsim.play.engine.calls import GroupCalls
from collsim.play.engine.comm import linked_peers
from collsim.play.engine.streams import RankState
from collsim.step.ops import Segment, Step
from collsim.step.stats import CallKey

__all__ = ["SegmentCalls"]

TP = ParallelAxis.TP


class SegmentCalls(GroupCalls):
    """Closed-form and layer-fidelity pricing of segment collectives."""

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
