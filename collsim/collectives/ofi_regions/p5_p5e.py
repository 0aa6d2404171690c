"""aws-ofi-nccl's regions for P5 and P5e (8, 2 and 1 ranks per node) (src/tuner/nccl_ofi_regions.cpp
``region_init_internal_p5_p5e``, aws/aws-ofi-nccl 2daf7d30), in the plugin's order.
"""

from __future__ import annotations

from collsim.collectives.ofi_regions.shapes import Regions
from collsim.core.vocab import Algorithm, CollectiveOp, Protocol

__all__ = ["P5_P5E"]

_TREE, _RING, _NVLS_TREE, _PAT = Algorithm.TREE, Algorithm.RING, Algorithm.NVLS_TREE, Algorithm.PAT
_LL, _LL128, _SIMPLE = Protocol.LL, Protocol.LL128, Protocol.SIMPLE

P5_P5E: Regions = {
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
}
