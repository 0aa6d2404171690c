"""Tables the collectives layer derives from a topology, kept per topology by their owner.

A topology is not changed after it is built, so what a module of this layer derives from it
(NCCL's graphs, its tuning tables, the phases and per-call costs of a group) stays valid for
the topology's life. Each module keeps its own :class:`PerTopology` table; an entry goes when
its topology is collected or when :data:`MAX_TOPOLOGIES` newer topologies have tables (the
tables refer to their topology through the groups they hold, so a topology with a table may
never be collected: the bound keeps a program that builds topology after topology from
growing), and a copy (:func:`collsim.step.stragglers.degrade_topology`) starts empty.
"""

from __future__ import annotations

import weakref
from typing import TYPE_CHECKING, Any, Generic, TypeVar

if TYPE_CHECKING:
    from collsim.cluster.topology import Topology

__all__ = ["MAX_TOPOLOGIES", "PerTopology"]

K = TypeVar("K")
V = TypeVar("V")


MAX_TOPOLOGIES = 8
"""Topologies whose tables a :class:`PerTopology` keeps at once (the least recently used goes
first): a sweep or a notebook that builds a new topology per call holds at most this many. A
choice of collsim."""


class PerTopology(Generic[K, V]):
    """A dictionary per topology, held while the topology lives and is among the
    :data:`MAX_TOPOLOGIES` used last."""

    __slots__ = ("_tables", "_last")

    def __init__(self) -> None:
        self._tables: dict[int, tuple[weakref.ref[Topology], dict[K, V]]] = {}
        """By ``id(topology)``: (a weak reference to it, its table), least recently used
        first."""
        self._last: tuple[weakref.ref[Topology], dict[K, V]] | None = None

    def of(self, topology: Topology) -> dict[K, V]:
        """The table of ``topology`` (empty the first time)."""
        last = self._last
        if last is not None and last[0]() is topology:
            return last[1]  # the hot path: calls come in runs on one topology
        key = id(topology)
        tables = self._tables
        entry = tables.pop(key, None)  # taken out, put back last: the latest used go last
        if entry is not None and entry[0]() is topology:
            tables[key] = entry
        else:  # new, or an id reused
            while len(tables) >= MAX_TOPOLOGIES:
                del tables[next(iter(tables))]

            def gone(_ref: object, key: int = key, tables: dict[int, Any] = tables) -> None:
                hit = tables.get(key)
                if hit is not None and hit[0] is _ref:
                    del tables[key]

            entry = tables[key] = (weakref.ref(topology, gone), {})
        self._last = entry
        return entry[1]
