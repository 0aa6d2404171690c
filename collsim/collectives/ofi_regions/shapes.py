"""The shape of aws-ofi-nccl's region tables: a coordinate, a vertex, one table.

Per (platform, ranks per node, op) a table holds the extended points (two vertices whose line
is carried to the edge of the plane, ``extend_region``) by the plugin's name, then the regions
in order. A coordinate is bytes or ranks, ``MAX_SIZE`` / ``MAX_RANKS``, or ``name.x`` /
``name.y`` of an extended point; a whole vertex may be an extended point's name.
"""

from __future__ import annotations

from collsim.core.vocab import Algorithm, CollectiveOp, Protocol

__all__ = ["Coord", "RegionTable", "Regions", "Vertex"]

Coord = int | str
Vertex = tuple[Coord, Coord] | str
RegionTable = tuple[
    dict[str, tuple[tuple[int, int], tuple[int, int]]],
    tuple[tuple[Algorithm, Protocol, tuple[Vertex, ...]], ...],
]
Regions = dict[tuple[str, int, CollectiveOp], RegionTable]
