"""DES time = closed form on an uncontended network, every (op, algorithm): both run from the
same phases, so they agree to float round-off (docs/internals.md), not just within a percent.

Sizes 1 KiB, 1 MiB and 1 GiB; groups of 2 to 64 ranks on one or several nodes, NVLink, PCIe
and loopback, one rank per node (PAT) and fabrics with in-network reduction (CollNet). The
protocol is the one the closed form picks for the algorithm at that size.
"""

from __future__ import annotations

import pytest

from collsim.collectives import Algorithm, CollectiveOp, Group, cost, phases_for, supported
from collsim.core.errors import ConfigError
from tests.collectives.helpers import run_des, topo

SIZES = [1 << 10, 1 << 20, 1 << 30]

SHAPES = {
    # name: (topology, nodes, ranks per node in the group, gpus_per_node override)
    "2r-1node-nvlink": ("dgx_h100", 1, 2, None),
    "8r-1node-nvls": ("dgx_h100", 1, 8, None),
    "6r-1node-pcie": ("pcie_8gpu", 1, 6, None),
    "3r-loopback": ("localhost", 1, 3, 3),
    "16r-2nodes": ("dgx_a100", 2, 8, None),
    "12r-3nodes": ("dgx_b200", 3, 4, None),
    "64r-8nodes": ("dgx_h100", 8, 8, None),
    "4r-4nodes-1pernode": ("dgx_h100", 4, 1, None),  # PAT's scope: one rank per node
    "16r-2nodes-sharp": ("dgx_h100+sharp", 2, 8, None),  # CollNet: in-network reduction
    "12r-3nodes-sharp": ("dgx_a100+sharp", 3, 4, None),
}


def make_group(shape: str) -> Group:
    name, nodes, per_node, gpn = SHAPES[shape]
    t = topo(name, nodes, gpn)
    return Group(t, tuple(n * t.gpus_per_node + i for n in range(nodes) for i in range(per_node)))


def _cases() -> list[tuple[str, str, str]]:
    cases = []
    for op in CollectiveOp:
        for algorithm in supported(op):
            for shape in SHAPES:
                try:
                    phases_for(op, make_group(shape), algorithm)
                except ConfigError:
                    continue  # e.g. halving_doubling on 6 ranks, nvls across nodes
                cases.append((op.value, algorithm.value, shape))
    return cases


CASES = _cases()


def test_every_op_algorithm_pair_is_covered() -> None:
    covered = {(op, alg) for op, alg, _ in CASES}
    expected = {(op.value, alg.value) for op in CollectiveOp for alg in supported(op)}
    assert covered == expected


@pytest.mark.parametrize(
    ("op", "algorithm", "shape"), CASES, ids=[f"{o}-{a}-{s}" for o, a, s in CASES]
)
def test_des_matches_closed_form(op: str, algorithm: str, shape: str) -> None:
    group = make_group(shape)
    for size in SIZES:
        closed = cost(op, size, group, algorithm)
        simulated, _ = run_des(group, op, size, algorithm)
        assert simulated.algorithm is closed.algorithm is Algorithm(algorithm)
        assert simulated.protocol is closed.protocol
        assert simulated.time_s == pytest.approx(closed.time_s, rel=1e-9), (size, closed.label)
