"""Closed-form prices of the schedule's calls, cached: the one cost cache of a simulation.

A :class:`ClosedPricer` is the context both fidelities price calls through: the closed form
walks the schedule with it, the engine extends it with the DES (``collsim.engine.comm``). A
search or sweep keeps one per topology, so a collective priced for one plan is not priced
again for the next; nothing is cached on the topology or at module level.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from collsim.topology import Topology

__all__ = ["CallCost", "ClosedPricer", "EXPOSED_KEY"]

EXPOSED_KEY = {"tp": "tp_exposed", "ep": "ep_exposed", "etp": "ep_exposed", "cp": "cp_exposed"}
"""The breakdown key a blocking collective of a segment step is exposed in, by its axis
(expert tensor parallelism counts with expert parallelism)."""


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

    def cost(self, op: str, size_bytes: float, ranks: tuple[int, ...]) -> CallCost:
        """Closed-form cost of ``op`` of ``size_bytes`` on the group ``ranks`` (cached)."""
        key = (op, size_bytes, ranks)
        hit = self._cache.get(key)
        if hit is not None:
            return hit
        if self.zero or len(ranks) < 2 or size_bytes <= 0:
            result = _NONE
        else:
            from collsim.collectives import CollectiveOp, Group, cost

            c = cost(CollectiveOp(op), int(size_bytes), Group(self.topology, ranks))
            result = CallCost(float(c.time_s), str(c.algorithm), float(c.busbw_bps))
        self._cache[key] = result
        return result

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
