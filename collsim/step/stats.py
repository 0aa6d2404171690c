"""Per-call statistics of a run: how often each collective ran and for how long.

A typed accumulator in place of positional lists: one :class:`CallTally` per
(issuing rank, axis, op, size, group size, algorithm).
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from typing import NamedTuple

from collsim.core.vocab import DATA_PARALLEL_AXES

__all__ = ["CallKey", "CallStats", "CallTally", "dp_link", "dp_links"]


class CallKey(NamedTuple):
    """What a tally counts: one (issuing rank, axis, op, size, group size, algorithm) (a tuple:
    made and hashed once per simulated call)."""

    rank: int
    axis: str
    op: str
    size_bytes: float
    group_size: int
    algorithm: str


@dataclass(slots=True)
class CallTally:
    count: int = 0
    time_s: float = 0.0
    busbw_bps: float = 0.0


class CallStats:
    """Tallies by :class:`CallKey`."""

    def __init__(self) -> None:
        self._tallies: dict[CallKey, CallTally] = {}

    def add(
        self,
        key: CallKey,
        time_s: float,
        busbw_bps: float,
        *,
        count: int = 1,
    ) -> None:
        """Record ``count`` calls of ``key`` lasting ``time_s`` in all."""
        tally = self._tallies.get(key)
        if tally is None:
            tally = self._tallies[key] = CallTally()
        tally.count += count
        tally.time_s += time_s
        tally.busbw_bps = busbw_bps

    def tally(self, key: CallKey) -> CallTally:
        """The tally of ``key`` (a new, empty one at the end of the order if none yet): a
        caller that repeats one call adds to it in place, as :meth:`add` would."""
        tally = self._tallies.get(key)
        if tally is None:
            tally = self._tallies[key] = CallTally()
        return tally

    @property
    def tallies(self) -> dict[CallKey, CallTally]:
        """The tallies by key (for a caller that adds to many: ``tallies.get(key)`` finds one
        with one lookup where :meth:`tally` would cost a call too; new ones through
        :meth:`tally`, so that the order stays the order of first use)."""
        return self._tallies

    def items(self) -> Iterator[tuple[CallKey, CallTally]]:
        return iter(self._tallies.items())

    def __len__(self) -> int:
        return len(self._tallies)


def dp_link(items: Iterator[tuple[CallKey, CallTally]], rank: int) -> tuple[float, float]:
    """(link seconds, highest busbw) of ``rank``'s data-parallel calls (every dp-family axis:
    dp, dp x cp, the expert and the HSDP shard / replicate groups)."""
    link = busbw = 0.0
    for key, tally in items:
        if key.rank == rank and key.axis in DATA_PARALLEL_AXES:
            link += tally.time_s
            busbw = max(busbw, tally.busbw_bps)
    return link, busbw


def dp_links(items: Iterator[tuple[CallKey, CallTally]]) -> dict[int, tuple[float, float]]:
    """:func:`dp_link` of every rank with data-parallel calls, in one pass over the tallies
    (each rank's seconds added in tally order, as :func:`dp_link` adds them)."""
    links: dict[int, list[float]] = {}
    for key, tally in items:
        if key.axis in DATA_PARALLEL_AXES:
            entry = links.get(key.rank)
            if entry is None:
                links[key.rank] = [0.0 + tally.time_s, max(0.0, tally.busbw_bps)]
            else:
                entry[0] += tally.time_s
                entry[1] = max(entry[1], tally.busbw_bps)
    return {rank: (link, busbw) for rank, (link, busbw) in links.items()}
