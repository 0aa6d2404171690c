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
docs/topologies.md ("The aws-ofi-nccl tuner").
"""

from __future__ import annotations

import math
from collections.abc import Callable

from collsim.core.vocab import Algorithm, CollectiveOp, Protocol

__all__ = ["PLATFORMS", "region_pick", "inside"]

_TREE, _RING, _NVLS_TREE, _PAT = Algorithm.TREE, Algorithm.RING, Algorithm.NVLS_TREE, Algorithm.PAT
_LL, _LL128, _SIMPLE = Protocol.LL, Protocol.LL128, Protocol.SIMPLE

_MAX_SIZE = 100.0 * 1024 * 1024 * 1024
"""``TUNER_MAX_SIZE`` (include/tuner/nccl_ofi_tuner_region.h), bytes."""
_MAX_RANKS = 1024.0 * 1024
"""``TUNER_MAX_RANKS`` (the same header)."""
_EPS = 1e-10
"""``is_inside_region``'s comparison epsilon."""

_Coord = int | str
_Vertex = tuple[_Coord, _Coord] | str
_Table = tuple[
    dict[str, tuple[tuple[int, int], tuple[int, int]]],
    tuple[tuple[Algorithm, Protocol, tuple[_Vertex, ...]], ...],
]
"""Per (platform, ranks per node, op): the extended points (two vertices whose line is carried
to the edge of the plane, ``extend_region``) by the plugin's name, then the regions in order. A
coordinate is bytes or ranks, ``MAX_SIZE`` / ``MAX_RANKS``, or ``name.x`` / ``name.y`` of an
extended point; a whole vertex may be an extended point's name."""
_REGIONS: dict[tuple[str, int, CollectiveOp], _Table] = {
    ("p5_p5e", 8, CollectiveOp.ALL_REDUCE): (
        {
            "extended_nvlstree_simple_1": ((8053063680, 160), (9663676416, 192)),
            "extended_nvlstree_simple_2": ((402653184, 2048), (402653184, 4096)),
            "extended_ring_simple": ((8053063680, 160), (9663676416, 192)),
            "extended_tree_ll128": ((402653184, 2048), (402653184, 4096)),
        },
        (
            (
                _TREE,
                _LL128,
                (
                    (0, 16),
                    (31457280, 16),
                    (37748736, 32),
                    (117440512, 64),
                    (301989888, 128),
                    (301989888, 256),
                    (335544320, 512),
                    (536870912, 1024),
                    (402653184, 2048),
                    (402653184, 4096),
                    "extended_tree_ll128",
                    (0, "extended_tree_ll128.y"),
                ),
            ),
            (
                _NVLS_TREE,
                _SIMPLE,
                (
                    (31457281, 16),
                    ("MAX_SIZE", 16),
                    (31457281, 16),
                ),
            ),
            (
                _RING,
                _LL128,
                (
                    (31457280, 17),
                    (1073741824, 17),
                    (2147483648, 64),
                    (2147483648, 128),
                    (1342177280, 160),
                    (2147483648, 256),
                    (1074790400, 256),
                    (444596224, 160),
                    (301989888, 128),
                    (117440512, 64),
                    (37748736, 32),
                ),
            ),
            (
                _NVLS_TREE,
                _SIMPLE,
                (
                    (2147483648, 128),
                    (6442450944, 128),
                    (8053063680, 160),
                    (9663676416, 192),
                    "extended_nvlstree_simple_1",
                    "extended_nvlstree_simple_2",
                    (402653184, 4096),
                    (402653184, 2048),
                    (536870912, 1024),
                    (335544320, 512),
                    (301989888, 256),
                    (310378496, 160),
                    (444596224, 160),
                    (1074790400, 256),
                    (2684354560, 256),
                    (2147483648, 224),
                    (1342177280, 160),
                ),
            ),
            (
                _RING,
                _SIMPLE,
                (
                    (1073741824, 17),
                    ("extended_ring_simple.x", 17),
                    "extended_ring_simple",
                    (9663676416, 192),
                    (8053063680, 160),
                    (2684354560, 64),
                    (1610612736, 32),
                ),
            ),
        ),
    ),
    ("p5_p5e", 2, CollectiveOp.ALL_REDUCE): (
        {
            "extended_nvlstree_simple": ((787480576, 128), (1073741824, 256)),
            "extended_tree_ll128": ((88160256, 128), (178163712, 256)),
            "extended_tree_simple_1": ((787480576, 128), (1073741824, 256)),
            "extended_tree_simple_2": ((257114112, 128), (269484032, 256)),
        },
        (
            (
                _TREE,
                _LL128,
                (
                    (0, 4),
                    (1314816, 4),
                    (1051648, 8),
                    (1051648, 12),
                    (2367488, 16),
                    (5525504, 32),
                    (9473024, 64),
                    (88160256, 128),
                    (178163712, 256),
                    "extended_tree_ll128",
                    (0, "extended_tree_ll128.y"),
                ),
            ),
            (
                _RING,
                _LL128,
                (
                    (1314816, 4),
                    (19736576, 4),
                    (41842688, 8),
                    (296747008, 64),
                    (257114112, 128),
                    (269484032, 256),
                    (178163712, 256),
                    (88160256, 128),
                    (9473024, 64),
                    (5525504, 32),
                    (2367488, 16),
                    (1051648, 12),
                    (1051648, 8),
                    (1314816, 4),
                ),
            ),
            (
                _NVLS_TREE,
                _SIMPLE,
                (
                    (19736576, 4),
                    (81844224, 4),
                    (275775488, 8),
                    (275775488, 48),
                    (296747008, 64),
                    (41842688, 8),
                ),
            ),
            (
                _TREE,
                _LL128,
                (
                    (81844224, 4),
                    (269484032, 4),
                    (81844224, 4),
                ),
            ),
            (
                _TREE,
                _SIMPLE,
                (
                    (269484032, 4),
                    ("MAX_SIZE", 4),
                    (269484032, 4),
                ),
            ),
            (
                _RING,
                _SIMPLE,
                (
                    (81844224, 5),
                    ("MAX_SIZE", 5),
                    ("MAX_SIZE", 32),
                    (1073741824, 40),
                    (1073741824, 128),
                    (787480576, 128),
                    (296747008, 64),
                    (275775488, 48),
                    (275775488, 8),
                    (81844224, 5),
                ),
            ),
            (
                _TREE,
                _SIMPLE,
                (
                    (296747008, 64),
                    (787480576, 128),
                    (1073741824, 256),
                    "extended_tree_simple_1",
                    "extended_tree_simple_2",
                    (269484032, 256),
                    (257114112, 128),
                ),
            ),
            (
                _NVLS_TREE,
                _SIMPLE,
                (
                    "extended_nvlstree_simple",
                    (1073741824, 256),
                    (787480576, 128),
                    (1073741824, 128),
                    (1073741824, 40),
                    ("MAX_SIZE", 32),
                ),
            ),
        ),
    ),
    ("p5_p5e", 1, CollectiveOp.ALL_GATHER): (
        {
            "extended_ring_simple": ((4194304, 2), (8589934592, 2048)),
        },
        (
            (
                _RING,
                _SIMPLE,
                (
                    (4194304, 2),
                    ("MAX_SIZE", 2),
                    "extended_ring_simple",
                    (8589934592, 2048),
                ),
            ),
        ),
    ),
    ("p5_p5e", 1, CollectiveOp.ALL_REDUCE): (
        {
            "extended_ring_ll128": ((4736000, 2), (269484032, 128)),
            "extended_tree_ll128": ((9999360, 64), (119477248, 128)),
        },
        (
            (
                _TREE,
                _LL128,
                (
                    (0, 16),
                    (2367488, 16),
                    (9999360, 64),
                    (119477248, 128),
                    "extended_tree_ll128",
                    (0, "MAX_RANKS"),
                ),
            ),
            (
                _RING,
                _LL128,
                (
                    (0, 2),
                    (4736000, 2),
                    (269484032, 128),
                    "extended_ring_ll128",
                    "extended_tree_ll128",
                    (119477248, 128),
                    (9999360, 64),
                    (2367488, 16),
                    (0, 16),
                ),
            ),
            (
                _RING,
                _SIMPLE,
                (
                    (4736000, 2),
                    ("MAX_SIZE", 2),
                    "extended_ring_ll128",
                    (269484032, 128),
                ),
            ),
        ),
    ),
    ("p5_p5e", 1, CollectiveOp.REDUCE_SCATTER): (
        {
            "extended_ring_simple": ((8388608, 2), (4294967296, 1024)),
        },
        (
            (
                _RING,
                _SIMPLE,
                (
                    (8388608, 2),
                    ("MAX_SIZE", 2),
                    "extended_ring_simple",
                    (4294967296, 1024),
                ),
            ),
        ),
    ),
    ("p5en", 8, CollectiveOp.ALL_GATHER): (
        {
            "extended_ring_ll": ((28305408, 768), (33554432, 1024)),
            "extended_ring_ll128": ((7247754240, 384), (17179865088, 896)),
        },
        (
            (
                _RING,
                _LL,
                (
                    (0, 16),
                    (786432, 16),
                    (4718592, 128),
                    (13630464, 384),
                    (19922944, 512),
                    (28305408, 768),
                    (33554432, 1024),
                    "extended_ring_ll",
                    (0, "MAX_RANKS"),
                ),
            ),
            (
                _RING,
                _LL128,
                (
                    "extended_ring_ll",
                    (33554432, 1024),
                    (28305408, 768),
                    (19922944, 512),
                    (13630464, 384),
                    (4718592, 128),
                    (786432, 16),
                    (236978176, 16),
                    (956301312, 64),
                    (7247754240, 384),
                    (17179865088, 896),
                    "extended_ring_ll128",
                ),
            ),
            (
                _RING,
                _SIMPLE,
                (
                    "extended_ring_ll128",
                    (17179865088, 896),
                    (7247754240, 384),
                    (956301312, 64),
                    (494927872, 32),
                    (236978176, 16),
                    ("MAX_SIZE", 16),
                ),
            ),
        ),
    ),
    ("p5en", 8, CollectiveOp.ALL_REDUCE): (
        {
            "extended_nvlstree_simple": ((7516192768, 256), (17179869184, 448)),
            "extended_tree_ll": ((196608, 192), (196608, 1024)),
            "extended_tree_ll128": ((129499136, 127), (218103808, 1024)),
        },
        (
            (
                _TREE,
                _LL,
                (
                    (0, 16),
                    (196608, 16),
                    (196608, 1024),
                    "extended_tree_ll",
                    (0, "MAX_RANKS"),
                ),
            ),
            (
                _TREE,
                _LL128,
                (
                    "extended_tree_ll",
                    (196608, 1024),
                    (196608, 16),
                    (13107200, 16),
                    (129499136, 127),
                    (218103808, 1024),
                    "extended_tree_ll128",
                ),
            ),
            (
                _RING,
                _LL128,
                (
                    (129499136, 127),
                    (13107200, 16),
                    (29884416, 16),
                    (293601280, 32),
                    (589299712, 64),
                    (549453824, 128),
                ),
            ),
            (
                _NVLS_TREE,
                _SIMPLE,
                (
                    "extended_tree_ll128",
                    (218103808, 1024),
                    (129499136, 127),
                    (549453824, 128),
                    (589299712, 64),
                    (293601280, 32),
                    (29884416, 16),
                    ("MAX_SIZE", 16),
                    (509607936, 32),
                    (7516192768, 256),
                    (17179869184, 448),
                    "extended_nvlstree_simple",
                ),
            ),
            (
                _RING,
                _SIMPLE,
                (
                    "extended_nvlstree_simple",
                    (17179869184, 448),
                    (7516192768, 256),
                    (509607936, 32),
                    ("MAX_SIZE", 16),
                ),
            ),
        ),
    ),
    ("p5en", 8, CollectiveOp.REDUCE_SCATTER): (
        {
            "extended_ring_ll": ((7340032, 256), (18874368, 512)),
            "extended_ring_ll128": ((7247757312, 256), (17179869184, 640)),
        },
        (
            (
                _RING,
                _LL,
                (
                    (0, 16),
                    (786432, 16),
                    (4718592, 128),
                    (7340032, 256),
                    (18874368, 512),
                    "extended_ring_ll",
                    (0, "MAX_RANKS"),
                ),
            ),
            (
                _RING,
                _LL128,
                (
                    "extended_ring_ll",
                    (18874368, 512),
                    (7340032, 256),
                    (4718592, 128),
                    (786432, 16),
                    (291504128, 16),
                    (589299712, 32),
                    (2415919104, 128),
                    (7247757312, 256),
                    (17179869184, 640),
                    "extended_ring_ll128",
                ),
            ),
            (
                _RING,
                _SIMPLE,
                (
                    "extended_ring_ll128",
                    (17179869184, 640),
                    (7247757312, 256),
                    (2415919104, 128),
                    (589299712, 32),
                    (291504128, 16),
                    ("MAX_SIZE", 16),
                ),
            ),
        ),
    ),
    ("p5en", 1, CollectiveOp.ALL_GATHER): (
        {
            "extended_pat_simple": ((50331648, 64), (117440512, 128)),
            "extended_ring_ll128": ((50331648, 16), (301989888, 128)),
        },
        (
            (
                _PAT,
                _SIMPLE,
                (
                    (0, 2),
                    (65536, 2),
                    (1048576, 2),
                    (8388608, 8),
                    (16777216, 16),
                    (16777216, 32),
                    (50331648, 64),
                    (117440512, 128),
                    "extended_pat_simple",
                    ("MAX_SIZE", "MAX_RANKS"),
                    (65536, "MAX_RANKS"),
                    (0, "MAX_RANKS"),
                ),
            ),
            (
                _RING,
                _LL128,
                (
                    "extended_pat_simple",
                    (117440512, 128),
                    (50331648, 64),
                    (16777216, 32),
                    (16777217, 16),
                    (8388609, 8),
                    (1048576, 2),
                    (4194304, 2),
                    (50331648, 16),
                    (301989888, 128),
                    "extended_ring_ll128",
                ),
            ),
            (
                _RING,
                _SIMPLE,
                (
                    "extended_ring_ll128",
                    (301989888, 128),
                    (50331648, 16),
                    (4194304, 2),
                    ("MAX_SIZE", 2),
                ),
            ),
        ),
    ),
    ("p5en", 1, CollectiveOp.ALL_REDUCE): (
        {
            "extended_ring_ll128": ((50331648, 16), (301989888, 128)),
            "extended_tree_ll128": ((524288, 8), (1048576, 96)),
            "extended_tree_simple": ((8388608, 32), (33554432, 128)),
        },
        (
            (
                _TREE,
                _LL,
                (
                    (0, 2),
                    (65536, 2),
                    (65536, 64),
                    (65536, "MAX_RANKS"),
                ),
            ),
            (
                _TREE,
                _LL128,
                (
                    (65536, "MAX_RANKS"),
                    (65536, 64),
                    (65536, 2),
                    (262144, 2),
                    (1048576, 4),
                    (4194304, 8),
                    (16777216, 16),
                    (33554432, 32),
                    (1048576, 32),
                    (1048576, 96),
                    "extended_tree_ll128",
                ),
            ),
            (
                _TREE,
                _SIMPLE,
                (
                    "extended_tree_ll128",
                    (1048576, 96),
                    (1048577, 32),
                    (33554431, 32),
                    (33554432, 128),
                    "extended_tree_simple",
                ),
            ),
            (
                _RING,
                _LL128,
                (
                    "extended_tree_simple",
                    (33554432, 128),
                    (33554433, 32),
                    (16777217, 16),
                    (4194305, 8),
                    (1048577, 4),
                    (262144, 2),
                    (6291456, 2),
                    (50331648, 16),
                    (301989888, 128),
                    "extended_ring_ll128",
                ),
            ),
            (
                _RING,
                _SIMPLE,
                (
                    "extended_ring_ll128",
                    (301989888, 128),
                    (50331648, 16),
                    (6291456, 2),
                    ("MAX_SIZE", 2),
                ),
            ),
        ),
    ),
    ("p5en", 1, CollectiveOp.REDUCE_SCATTER): (
        {
            "extended_pat_simple": ((50331648, 64), (117440512, 128)),
            "extended_ring_ll128": ((50331648, 16), (301989888, 128)),
        },
        (
            (
                _PAT,
                _SIMPLE,
                (
                    (0, 2),
                    (65536, 2),
                    (1048576, 2),
                    (16777216, 32),
                    (50331648, 64),
                    (117440512, 128),
                    "extended_pat_simple",
                    ("MAX_SIZE", "MAX_RANKS"),
                    (65536, "MAX_RANKS"),
                    (0, "MAX_RANKS"),
                ),
            ),
            (
                _RING,
                _LL128,
                (
                    "extended_pat_simple",
                    (117440512, 128),
                    (50331648, 64),
                    (16777216, 32),
                    (1048576, 2),
                    (4194304, 2),
                    (50331648, 16),
                    (301989888, 128),
                    "extended_ring_ll128",
                ),
            ),
            (
                _RING,
                _SIMPLE,
                (
                    "extended_ring_ll128",
                    (301989888, 128),
                    (50331648, 16),
                    (4194304, 2),
                    ("MAX_SIZE", 2),
                ),
            ),
        ),
    ),
}
"""The plugin's regions (src/tuner/nccl_ofi_regions.cpp ``region_init_internal_p5_p5e`` and
``region_init_internal_p5en``), in its order."""

PLATFORMS = frozenset(platform for platform, _, _ in _REGIONS)
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


def _polygon(vertices: tuple[_Vertex, ...], extended: dict[str, _Point]) -> list[_Point]:
    """A region's vertices in log2 space, extended points resolved (in bytes and ranks first,
    as the plugin keeps them, then log2 again)."""

    def coord(value: _Coord, axis: int) -> float:
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
        table = _REGIONS.get(key)
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
