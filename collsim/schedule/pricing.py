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

__all__ = ["CallCost", "ClosedPricer"]


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
