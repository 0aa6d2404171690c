"""Closed-form prices of the schedule's calls, cached: the one cost cache of a simulation.

A :class:`ClosedPricer` is the context both fidelities price calls through: the closed form
walks the schedule with it, the engine extends it with the DES (``collsim.play.engine.comm``). A
search or sweep keeps one per topology, so a collective priced for one plan is not priced
again for the next; nothing is cached on the topology or at module level.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from collsim.collectives import Group, cost
from collsim.core.vocab import CollectiveOp, ParallelAxis

if TYPE_CHECKING:
    from collections.abc import Callable

    from collsim.cluster.topology import Topology
    from collsim.collectives import Group
    from collsim.parallel.plan import Plan
    from collsim.step.ops import Segment, Step

__all__ = ["CallCost", "ClosedPricer", "EXPOSED_KEY", "HashedRanks", "SegmentPrices"]

EXPOSED_KEY: dict[str, str] = {
    ParallelAxis.TP: "tp_exposed",
    ParallelAxis.EP: "ep_exposed",
    ParallelAxis.ETP: "ep_exposed",
    ParallelAxis.EP_NODE: "ep_exposed",
    ParallelAxis.EP_LOCAL: "ep_exposed",
    ParallelAxis.CP: "cp_exposed",
    ParallelAxis.TP_DP_CP: "dp_exposed",
}
"""The breakdown key a blocking collective of a segment step is exposed in, by its axis
(expert tensor parallelism counts with expert parallelism; a delayed-scaling amax reduction
over a stage's tp x dp x cp ranks with the data-parallel calls)."""


class HashedRanks(tuple[int, ...]):
    """A group's ranks as a tuple that hashes once: the engine looks its groups up in dicts
    (streams, prices, calls) on every call, and a plain tuple hashes all its members each time
    (a data-parallel group of 1,024 ranks: about 1.5 us per lookup). Equal to, and hashing
    like, the plain tuple of the same ranks."""

    _hash: int

    def __new__(cls, ranks: tuple[int, ...]) -> HashedRanks:
        self = super().__new__(cls, ranks)
        self._hash = tuple.__hash__(self)
        return self

    def __hash__(self) -> int:
        return self._hash


_HASH_ONCE = 64
"""Groups larger than this are kept as :class:`HashedRanks` (a smaller tuple hashes faster in C
than a Python ``__hash__`` is called)."""


@dataclass(frozen=True, slots=True)
class CallCost:
    """Closed-form facts of one call: seconds, algorithm, busbw."""

    time_s: float
    algorithm: str
    busbw_bps: float


_NONE = CallCost(0.0, "none", 0.0)


class ClosedPricer:
    """Prices calls with :func:`collsim.collectives.cost` (no contention: each group alone on
    its links).

    Args:
        topology: the cluster.
        zero: price every call at 0 s (an ideal network: pipeline-only studies).
    """

    def __init__(self, topology: Topology, *, zero: bool = False) -> None:
        self.topology = topology
        self.zero = zero
        self._cache: dict[tuple[str, float, tuple[int, ...]], CallCost] = {}
        self._rings: dict[tuple[str, float, tuple[int, ...]], tuple[int, int]] = {}
        self._groups: dict[tuple[int, ...], Group] = {}

    def cost(self, op: str, size_bytes: float, ranks: tuple[int, ...]) -> CallCost:
        """Closed-form cost of ``op`` of ``size_bytes`` on the group ``ranks`` (cached)."""
        key = (op, size_bytes, ranks)
        hit = self._cache.get(key)
        if hit is not None:
            return hit
        if self.zero or len(ranks) < 2 or size_bytes <= 0:
            result = _NONE
        else:
            c = cost(CollectiveOp(op), int(size_bytes), self._group(ranks))
            result = CallCost(float(c.time_s), str(c.algorithm), float(c.busbw_bps))
        self._cache[key] = result
        return result

    def _group(self, ranks: tuple[int, ...]) -> Group:
        """The checked :class:`~collsim.collectives.Group` of ``ranks``, made once (a group is
        priced at several sizes)."""
        found = self._groups.get(ranks)
        if found is None:
            found = self._groups[ranks] = Group(self.topology, ranks)
        return found

    def ring_pair(self, op: str, size_bytes: float, group: tuple[int, ...]) -> tuple[int, int]:
        """The slowest neighbour pair of a ring over ``group`` (a context-parallel KV step: every
        rank sends to the next at once, and the step ends with the slowest transfer)."""
        n = len(group)
        if n < 2:
            return (group[0], group[0]) if group else (0, 0)
        key = ("ring", size_bytes, group)
        hit = self._rings.get(key)
        if hit is None:
            pairs = [(group[i], group[(i + 1) % n]) for i in range(n if n > 2 else 1)]
            hit = max(pairs, key=lambda p: self.cost(op, size_bytes, p).time_s)
            self._rings[key] = hit
        return hit


class SegmentPrices:
    """Closed-form seconds of the schedule's segments on one plan, shared by both fidelities
    (the engine in its closed-form axes, the walk everywhere), cached per rank and segment.

    A step's collective runs on the group of its axis (a ring step, ``send_recv`` on cp: the
    slowest neighbour pair of the ring); the compute stream spends max(collective, the compute
    it overlaps) on it, and the collective is exposed only beyond that compute.
    """

    def __init__(
        self,
        plan: Plan,
        pricer: ClosedPricer,
        slowdown: Callable[[str, float, str, int | None], float] | None = None,
    ) -> None:
        self.plan = plan
        self.pricer = pricer
        self.slowdown = slowdown
        """(op, busbw, axis, SMs held or None) -> the factor on the compute beside an
        overlapped step while its collective runs (``StepSchedule.overlap_factor``); None: no
        slowdown."""
        self._factors: dict[tuple[int, str, str, float, int | None], float] = {}
        self._groups: dict[tuple[int, str], tuple[int, ...]] = {}
        self._step: dict[tuple[int, str, str, float], float] = {}
        self._seg: dict[tuple[int, int], tuple[list[Step], dict[str, float], float, float]] = {}
        """Per (rank, id of a step list): the list, :meth:`seg_comm_s`, :meth:`seg_tp_s`,
        :meth:`seg_compute_s`."""

    def group(self, rank: int, axis: str) -> tuple[int, ...]:
        key = (rank, axis)
        hit = self._groups.get(key)
        if hit is None:
            ranks = self.plan.group_of(rank, axis)
            hit = self._groups[key] = HashedRanks(ranks) if len(ranks) > _HASH_ONCE else ranks
        return hit

    def step_group(self, rank: int, step: Step) -> tuple[int, ...]:
        """The ranks a segment step's collective runs on."""
        group = self.group(rank, step.axis)
        if step.op == "send_recv":
            return self.pricer.ring_pair(step.op, step.size_bytes, group)
        return group

    def collective_s(self, rank: int, step: Step) -> float:
        """Closed-form seconds of a step's collective (cached); with collectives beside it,
        the slowest of them."""
        key = (rank, step.axis, step.op, step.size_bytes)
        hit = self._step.get(key)
        if hit is None:
            hit = self.pricer.cost(step.op, step.size_bytes, self.step_group(rank, step)).time_s
            self._step[key] = hit
        for other in step.beside:
            hit = max(hit, self.collective_s(rank, other))
        return hit

    def overlap_factor(self, rank: int, step: Step) -> float:
        """The slowdown of the compute beside an overlapped step while its collective runs
        (1 for other steps, or without a slowdown), at the collective's closed-form busbw."""
        if self.slowdown is None or not step.op or step.overlap_s <= 0:
            return 1.0
        fkey = (rank, step.axis, step.op, step.size_bytes, step.sms)
        hit = self._factors.get(fkey)
        if hit is None:
            busbw = self.pricer.cost(step.op, step.size_bytes, self.step_group(rank, step))
            hit = self._factors[fkey] = self.slowdown(step.op, busbw.busbw_bps, step.axis, step.sms)
        return hit

    def step_s(self, rank: int, step: Step) -> float:
        """Seconds the compute stream spends on one step.

        An overlapped step (``overlap_s`` = W of compute beside a collective of t seconds)
        takes ``max(t, W)`` with compute at full speed. While the collective runs, the
        compute beside it runs ``f`` times slower (:meth:`overlap_factor`): it does ``t / f``
        of its work by the collective's end and the rest, ``W - t / f``, after it, so the step
        takes ``t + max(0, W - t / f)`` (at least max(t, W) since f >= 1: the excess is the
        interference)."""
        if not step.op:
            return step.seconds
        t = self.collective_s(rank, step)
        w = step.overlap_s
        if w > 0:
            f = self.overlap_factor(rank, step)
            if f > 1.0:
                rest = w - t / f
                return t + rest if rest > 0 else t
        return t if t > w else w

    def seg_comm_s(self, rank: int, seg: Segment) -> dict[str, float]:
        """Exposed collective seconds of one segment by breakdown key (cached per step list:
        the layers of one kind share theirs, :func:`collsim.step.stage.build_stage`; not to
        be changed by the caller): the part of a step beyond its overlapped compute in its
        axis's key, what slowed compute adds to an overlapped step in ``interference``."""
        return self.seg_prices(rank, seg)[1]

    def seg_tp_s(self, rank: int, seg: Segment) -> float:
        """All exposed collective seconds of one segment (cached as :meth:`seg_comm_s`)."""
        return self.seg_prices(rank, seg)[2]

    def seg_compute_s(self, rank: int, seg: Segment) -> float:
        """The segment's compute seconds (``Segment.compute_s``, cached as :meth:`seg_comm_s`)."""
        return self.seg_prices(rank, seg)[3]

    def seg_prices(
        self, rank: int, seg: Segment
    ) -> tuple[list[Step], dict[str, float], float, float]:
        """(step list, :meth:`seg_comm_s`, :meth:`seg_tp_s`, :meth:`seg_compute_s`) of a
        segment, once per step list (the dict not to be changed by the caller)."""
        steps = seg.steps
        key = (rank, id(steps))
        known = self._seg.get(key)
        if known is not None and known[0] is steps:  # (the list kept: its id stays its own)
            return known
        hit: dict[str, float] = {}
        for st in steps:
            if st.op:
                k = EXPOSED_KEY[st.axis]
                t, w = self.collective_s(rank, st), st.overlap_s
                plain = t if t > w else w
                hit[k] = hit.get(k, 0.0) + plain - w
                extra = self.step_s(rank, st) - plain
                if extra > 0:
                    hit["interference"] = hit.get("interference", 0.0) + extra
        known = self._seg[key] = (steps, hit, sum(hit.values()), seg.compute_s)
        return known
