"""Tables the collectives layer derives from a topology, kept per topology by their owner.

A topology is not changed after it is built, so what a module of this layer derives from it
(NCCL's graphs, its tuning tables, the phases and per-call costs of a group) stays valid for
the topology's life. Each module keeps its own :class:`PerTopology` table; an entry goes when
its topology is collected, and a copy (:func:`collsim.step.stragglers.degrade_topology`) starts
empty.
"""

from __future__ import annotations

import weakref
from typing import TYPE_CHECKING, Generic, TypeVar

if TYPE_CHECKING:
    from collsim.cluster.topology import Topology

__all__ = ["PerTopology"]

K = TypeVar("K")
V = TypeVar("V")


class PerTopology(Generic[K, V]):
    """A dictionary per topology, held as long as the topology lives."""

    __slots__ = ("_tables", "_last")

    def __init__(self) -> None:
        self._tables: weakref.WeakKeyDictionary[Topology, dict[K, V]] = weakref.WeakKeyDictionary()
        self._last: tuple[weakref.ref[Topology], dict[K, V]] | None = None

    def of(self, topology: Topology) -> dict[K, V]:
        """The table of ``topology`` (empty the first time)."""
        last = self._last
        if last is not None and last[0]() is topology:
            return last[1]  # the hot path: calls come in runs on one topology
        table = self._tables.get(topology)
        if table is None:
            table = self._tables[topology] = {}
        self._last = (weakref.ref(topology), table)
        return table
