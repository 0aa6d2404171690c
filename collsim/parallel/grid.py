"""The rank grid: named parallel axes, and a rank's place on them.

A layout is a list of named axes (``tp``, ``cp``, ``dp``, ``pp``), fastest-varying first, in the
order a :class:`~collsim.core.vocab.RankOrder` names them; :func:`grid_rank` and
:func:`grid_index` turn a grid position into a global rank and back, and :class:`RankCoords` is
the position :class:`~collsim.parallel.plan.Plan` hands out. A new dimension is one more name
in the order and its size.
"""

from __future__ import annotations

from dataclasses import dataclass

from collsim.core.vocab import RankOrder

__all__ = ["GRID_ORDER", "GridAxis", "RankCoords", "grid_index", "grid_rank", "rank_axes"]


@dataclass(frozen=True, slots=True)
class GridAxis:
    """One named dimension of the rank grid and its size."""

    name: str
    """``tp``, ``cp``, ``dp`` or ``pp`` (a field of :class:`RankCoords`)."""
    size: int


GRID_ORDER = ("pp", "dp", "cp", "tp")
"""The index order of :meth:`Plan.grid` (pipeline first, tensor parallel last), whatever the
rank layout."""


def rank_axes(order: RankOrder, sizes: dict[str, int]) -> tuple[GridAxis, ...]:
    """The grid of a layout as named axes, fastest-varying first: the axes of the order string
    (``tp-cp-ep-dp-pp``) that have a size (``ep`` folds inside the others), so a new dimension
    is a name in the order and a size here."""
    return tuple(GridAxis(name, sizes[name]) for name in order.value.split("-") if name in sizes)


def grid_rank(axes: tuple[GridAxis, ...], index: dict[str, int]) -> int:
    """Global rank of the grid position ``index`` (axis name -> index, 0 where absent) on the
    named ``axes``, fastest-varying first (docs/derivations.md)."""
    rank = 0
    for axis in reversed(axes):
        rank = rank * axis.size + index.get(axis.name, 0)
    return rank


def grid_index(axes: tuple[GridAxis, ...], rank: int) -> dict[str, int]:
    """The grid position of ``rank`` on the named ``axes`` (the inverse of :func:`grid_rank`)."""
    index: dict[str, int] = {}
    for axis in axes:
        rank, index[axis.name] = divmod(rank, axis.size)
    return index


@dataclass(frozen=True, slots=True)
class RankCoords:
    """Where a rank sits in the TP x CP x PP x DP grid."""

    dp: int
    pp: int
    tp: int
    cp: int = 0
