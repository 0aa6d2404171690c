"""aws-ofi-nccl's region tables, one module per platform (the polygons the region tuner of
:mod:`collsim.collectives.ofi_tuner` tests a call against), in the plugin's order.
"""

from __future__ import annotations

from collsim.collectives.ofi_regions.p5_p5e import P5_P5E
from collsim.collectives.ofi_regions.p5en import P5EN
from collsim.collectives.ofi_regions.shapes import Coord, Regions, RegionTable, Vertex

__all__ = ["REGIONS", "Coord", "RegionTable", "Regions", "Vertex"]

REGIONS: Regions = {**P5_P5E, **P5EN}
"""The plugin's regions (src/tuner/nccl_ofi_regions.cpp ``region_init_internal_p5_p5e`` and
``region_init_internal_p5en``), in its order."""
