"""aws-ofi-nccl's region tuner: the (algorithm, protocol) it sets for NCCL on P5 / P5e / P5en.

Source: aws/aws-ofi-nccl 2daf7d30 (:data:`collsim.cluster.transports.AWS_OFI_NCCL`),
src/tuner/nccl_ofi_regions.cpp (the region tables, ``is_inside_region``, ``extend_region``,
``region_get_coll_info_internal_v3``), include/tuner/nccl_ofi_tuner_region.h (``TUNER_MAX_SIZE``,
``TUNER_MAX_RANKS``, the log2 transform) and src/tuner/nccl_ofi_tuner.cpp (the region tuner is
chosen over the model tuner wherever both exist, which is every platform here). A region is a
polygon in (log2 bytes, log2 ranks); the first region of the op that holds the call's point, on
its edge included, and that NCCL has enabled, is the pick; with no such region, or on two nodes
or fewer, NCCL's own tuner decides. The tables exist for 8, 2 and 1 ranks per node (P5 / P5e) and
8 and 1 (P5en). The vertex figures are the plugin's; the geometry is re-derived in
docs/topologies.md ("The aws-ofi-nccl tuner"); the tables are in
:mod:`collsim.collectives.ofi_regions`, one module per platform.
"""

from __future__ import annotations

import math
from collections.abc import Callable

from collsim.collectives.ofi_regions import REGIONS, Coord, Vertex
from collsim.core.vocab import Algorithm, CollectiveOp, Protocol

__all__ = ["PLATFORMS", "region_pick", "inside"]

_MAX_SIZE = 100.0 * 1024 * 1024 * 1024
"""``TUNER_MAX_SIZE`` (include/tuner/nccl_ofi_tuner_region.h), bytes."""
_MAX_RANKS = 1024.0 * 1024
"""``TUNER_MAX_RANKS`` (the same header)."""
_EPS = 1e-10
"""``is_inside_region``'s comparison epsilon."""


PLATFORMS = frozenset(platform for platform, _, _ in REGIONS)
"""Tuner platforms with regions (``p5_p5e``, ``p5en``)."""

_Point = tuple[float, float]


def _log2_point(x: float, y: float) -> _Point:
    """``transform_log2``: 0 becomes 1e-6 first."""
    return (math.log2(x if x != 0 else 1e-6), math.log2(y if y != 0 else 1e-6))


def _extend(a: _Point, b: _Point) -> _Point:
    """``extend_region`` (in log2 space): the line through ``a`` and ``b`` carried to where it
    meets x = log2 MAX_SIZE or y = log2 MAX_RANKS, whichever it meets first."""
    zx, zy = _log2_point(_MAX_SIZE, _MAX_RANKS)
    if a[0] == b[0]:
        return (a[0], zy)
    if a[1] == b[1]:
        return (zx, a[1])
    slope = (a[1] - b[1]) / (a[0] - b[0])
    offset = b[1] - slope * b[0]
    projected = slope * zx + offset
    return (zx, projected) if projected < zy else ((zy - offset) / slope, zy)


def _polygon(vertices: tuple[Vertex, ...], extended: dict[str, _Point]) -> list[_Point]:
    """A region's vertices in log2 space, extended points resolved (in bytes and ranks first,
    as the plugin keeps them, then log2 again)."""

    def coord(value: Coord, axis: int) -> float:
        if isinstance(value, int):
            return float(value)
        if value == "MAX_SIZE":
            return _MAX_SIZE
        if value == "MAX_RANKS":
            return _MAX_RANKS
        name, _, which = value.partition(".")
        return float(2.0 ** extended[name][0 if which == "x" else 1])

    out: list[_Point] = []
    for v in vertices:
        if isinstance(v, str):
            ext = extended[v]
            out.append(_log2_point(float(2.0 ** ext[0]), float(2.0 ** ext[1])))
        else:
            out.append(_log2_point(coord(v[0], 0), coord(v[1], 1)))
    return out


def _cross(a: _Point, b: _Point) -> float:
    return a[0] * b[1] - a[1] * b[0]


def _intersect(x0: _Point, x1: _Point, y0: _Point, y1: _Point) -> tuple[int, _Point | None]:
    """Whether segment x0-x1 crosses segment y0-y1: 1 yes, -1 no, 0 too close to y0 or y1 (or
    parallel); with the crossing point on the y line where one was computed (``intersect``)."""
    dx = (x1[0] - x0[0], x1[1] - x0[1])
    dy = (y1[0] - y0[0], y1[1] - y0[1])
    d = _cross(dy, dx)
    if abs(d) < _EPS:
        return 0, None
    a = (_cross(x0, dx) - _cross(y0, dx)) / d
    sect = (y0[0] + a * dy[0], y0[1] + a * dy[1])
    if a < -_EPS or a > 1 + _EPS:
        return -1, sect
    if a < _EPS or a > 1 - _EPS:
        return 0, sect
    a = (_cross(x0, dy) - _cross(y0, dy)) / d
    return (-1 if a < 0 or a > 1 else 1), sect


def _distance(x: _Point, y0: _Point, y1: _Point) -> float:
    """Distance from ``x`` to its perpendicular foot on segment y0-y1, infinite when the foot
    is off the segment (``distance``; a parallel case measures from the origin, as there)."""
    dy = (y1[0] - y0[0], y1[1] - y0[1])
    r, sect = _intersect(x, (x[0] + dy[1], x[1] - dy[0]), y0, y1)
    if r == -1:
        return math.inf
    s = sect if sect is not None else (0.0, 0.0)
    return math.hypot(s[0] - x[0], s[1] - x[1])


def inside(point: _Point, polygon: list[_Point]) -> int:
    """``is_inside_region``: 1 inside, 0 on an edge, -1 outside (ray cast to a far point)."""
    n = len(polygon)
    for i in range(n):
        if _distance(point, polygon[i], polygon[(i + 1) % n]) < _EPS:
            return 0
    xs = [v[0] for v in polygon]
    ys = [v[1] for v in polygon]
    if not (min(xs) <= point[0] <= max(xs) and min(ys) <= point[1] <= max(ys)):
        return -1
    far = _log2_point(2.0 * _MAX_SIZE, 2.0 * _MAX_RANKS)
    crosses = sum(
        1 for i in range(n) if _intersect(point, far, polygon[i], polygon[(i + 1) % n])[0] == 1
    )
    return 1 if crosses % 2 else -1


_POLYGONS: dict[tuple[str, int, CollectiveOp], list[tuple[Algorithm, Protocol, list[_Point]]]] = {}


def _regions(
    platform: str, per_node: int, op: CollectiveOp
) -> list[tuple[Algorithm, Protocol, list[_Point]]] | None:
    key = (platform, per_node, op)
    found = _POLYGONS.get(key)
    if found is None:
        table = REGIONS.get(key)
        if table is None:
            return None
        points, regions = table
        extended = {
            name: _extend(_log2_point(*a), _log2_point(*b)) for name, (a, b) in points.items()
        }
        found = _POLYGONS[key] = [(a, p, _polygon(vs, extended)) for a, p, vs in regions]
    return found


def region_pick(
    platform: str,
    op: CollectiveOp,
    size_bytes: float,
    num_ranks: int,
    num_nodes: int,
    enabled: Callable[[Algorithm, Protocol], bool],
) -> tuple[Algorithm, Protocol] | None:
    """The plugin's (algorithm, protocol) for one call, or None where NCCL's own tuner decides
    (two nodes or fewer, a rank layout or op without regions, no enabled region holding the
    point). ``enabled`` says whether NCCL's table has the pair (the plugin skips the pairs NCCL
    marks ``NCCL_ALGO_PROTO_IGNORE``)."""
    if num_nodes <= 2 or num_ranks % num_nodes:
        return None
    regions = _regions(platform, num_ranks // num_nodes, op)
    if regions is None:
        return None
    point = _log2_point(float(int(size_bytes)), float(num_ranks))
    for algorithm, protocol, polygon in regions:
        if not enabled(algorithm, protocol):
            continue
        if inside(point, polygon) >= 0:
            return algorithm, protocol
    return None
