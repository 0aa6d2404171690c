"""aws-ofi-nccl's regions for P5en (8 and 1 ranks per node) (src/tuner/nccl_ofi_regions.cpp
``region_init_internal_p5en``, aws/aws-ofi-nccl 2daf7d30), in the plugin's order.
"""

from __future__ import annotations

from collsim.collectives.ofi_regions.shapes import Regions
from collsim.core.vocab import Algorithm, CollectiveOp, Protocol

__all__ = ["P5EN"]

_TREE, _RING, _NVLS_TREE, _PAT = Algorithm.TREE, Algorithm.RING, Algorithm.NVLS_TREE, Algorithm.PAT
_LL, _LL128, _SIMPLE = Protocol.LL, Protocol.LL128, Protocol.SIMPLE

P5EN: Regions = {
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
