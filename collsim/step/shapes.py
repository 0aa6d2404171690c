"""What building a step program derives from a plan's shape alone, kept across the plans of a
search: the compute model with its per-layer prices, each stage's pipeline order, each chunk's
tensors with what its buckets pack, DDP buckets (and their cuts by the packed tensors' form)
and FSDP units, the rank layout in words, and the closed-form walk's pipeline traces, memory
peaks, allocator replays and the tables the walks of one program's DDP variants share (the
most recent few). Plans of one search share them wherever their shapes agree (a tp,
micro-batch and recompute choice repeats across hundreds of plans); an entry is immutable data,
a table read only, or a table of prices that only grows (one pricer's: an entry that holds
prices is keyed by its pricer too), so a program built and walked with a cache is the one built
and walked without.
"""

from __future__ import annotations

from collections.abc import Callable, Hashable, Sequence
from operator import is_
from typing import Any, TypeVar

__all__ = ["IdentityMemo", "ShapeCache", "same_objects"]

T = TypeVar("T")


class ShapeCache:
    """Tables of one model on one cluster, by the shape each entry depends on.

    Each table is a plain dict from a hashable key to an immutable value (or to a model or a
    table of prices whose own memo only grows); :meth:`get` fills an entry on its first use. A
    search's :class:`collsim.play.walk.Estimator` keeps one; one-off callers pass none.
    """

    __slots__ = ("_tables",)

    def __init__(self) -> None:
        self._tables: dict[str, dict[Hashable, Any]] = {}

    def get(self, table: str, key: Hashable, make: Callable[[], T]) -> T:
        """The entry ``key`` of ``table``, made by ``make()`` the first time."""
        entries = self._tables.get(table)
        if entries is None:
            entries = self._tables[table] = {}
        hit = entries.get(key, _MISSING)
        if hit is _MISSING:
            hit = entries[key] = make()
        out: T = hit
        return out

    def table(self, table: str) -> dict[Hashable, Any]:
        """The dict of ``table`` (made empty the first time), for a caller that looks up many
        entries in a loop: read and fill it as :meth:`get` does."""
        entries = self._tables.get(table)
        if entries is None:
            entries = self._tables[table] = {}
        return entries

    def recent(
        self,
        table: str,
        key: Hashable,
        make: Callable[[], T],
        kept: int,
        valid: Callable[[T], bool] | None = None,
    ) -> T:
        """:meth:`get` for a table that keeps only its ``kept`` most recently made entries (the
        oldest dropped first): for large entries that only neighbouring plans share. With
        ``valid``, an entry it refuses is made again in its place (an entry that holds the
        objects it was made from, checked by identity)."""
        entries = self._tables.get(table)
        if entries is None:
            entries = self._tables[table] = {}
        hit = entries.get(key, _MISSING)
        if hit is not _MISSING and valid is not None and not valid(hit):
            del entries[key]
            hit = _MISSING
        if hit is _MISSING:
            while len(entries) >= kept:
                del entries[next(iter(entries))]
            hit = entries[key] = make()
        out: T = hit
        return out

    def sizes(self) -> dict[str, int]:
        """Entries per table (for tests and benchmarks)."""
        return {name: len(entries) for name, entries in self._tables.items()}


_MISSING: Any = object()


def same_objects(held: Sequence[Any], now: Sequence[Any]) -> bool:
    """Whether ``now`` holds the very objects ``held`` holds, in order (how an entry kept by
    the identities of what it was made from checks them: ``held`` keeps them alive, so their
    ids stay their own); the very same sequence at once."""
    return held is now or (len(held) == len(now) and all(map(is_, held, now)))


class IdentityMemo:
    """Values made from an object (and a few knobs), kept by the object's identity and held
    with it, so the id stays its own while the entry lives; at most ``kept`` entries, the
    table started again when full. For pure functions of a frozen object that one process
    asks thousands of times (a search's model, its scenario's sections)."""

    __slots__ = ("_entries", "_kept")

    def __init__(self, kept: int) -> None:
        self._kept = kept
        self._entries: dict[tuple[Any, ...], tuple[Any, Any]] = {}

    def get(self, obj: Any, knobs: tuple[Any, ...], make: Callable[[], T]) -> T:
        """The value ``make()`` makes from ``obj`` with ``knobs``, made once while kept."""
        key = (id(obj), *knobs)
        known = self._entries.get(key)
        if known is not None and known[0] is obj:
            return known[1]  # type: ignore[no-any-return]
        if len(self._entries) >= self._kept:
            self._entries.clear()
        made = make()
        self._entries[key] = (obj, made)
        return made

    def clear(self) -> None:
        self._entries.clear()
