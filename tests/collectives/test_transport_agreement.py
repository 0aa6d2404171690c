"""DES time = closed form on the rented clusters' topologies (EFA latencies and completion
cost, an EFA interface shared by two GPUs on p4d, the aws-ofi-nccl tuner's picks on p5 / p5en,
RoCE and InfiniBand H100 nodes): both run from the same phases, so they agree to round-off
(as tests/collectives/test_agreement.py asserts for the DGX topologies)."""

from __future__ import annotations

import pytest

from collsim.collectives import Group, cost
from tests.collectives.helpers import run_des, topo

SHAPES = {
    "p4d-2nodes": ("aws_p4d", 2),
    "p5-4nodes": ("aws_p5", 4),
    "p5en-4nodes": ("aws_p5en", 4),
    "azure-2nodes": ("azure_nd_h100_v5", 2),
    "oci-2nodes": ("oci_bm_gpu_h100_8", 2),
}
OPS = ["all_reduce", "all_gather", "reduce_scatter", "broadcast", "all_to_all"]
# the plugin's regions on 4 nodes change pick at 36 MiB and 1.5 GiB (test_ofi_tuner): a size in
# each class
SIZES = [1 << 10, 1 << 20, 64 << 20, 2 << 30]


@pytest.mark.parametrize("shape", list(SHAPES))
@pytest.mark.parametrize("op", OPS)
def test_des_matches_closed_form_with_auto(shape: str, op: str) -> None:
    name, nodes = SHAPES[shape]
    group = Group.all(topo(name, nodes))
    for size in SIZES:
        closed = cost(op, size, group)
        simulated, _ = run_des(group, op, size)
        assert (simulated.algorithm, simulated.protocol) == (closed.algorithm, closed.protocol)
        assert simulated.time_s == pytest.approx(closed.time_s, rel=1e-9), (size, closed.label)


def test_des_matches_closed_form_on_16_p5_nodes() -> None:
    # the plugin's tree LL128, ring LL128 and NVLS-tree picks on 128 ranks
    group = Group.all(topo("aws_p5", 16))
    for size, label in (
        (1 << 20, "tree/ll128"),
        (1 << 30, "ring/ll128"),
        (4 << 30, "nvls_tree/simple"),
    ):
        closed = cost("all_reduce", size, group)
        assert closed.label == label
        simulated, _ = run_des(group, "all_reduce", size)
        assert (simulated.algorithm, simulated.protocol) == (closed.algorithm, closed.protocol)
        assert simulated.time_s == pytest.approx(closed.time_s, rel=1e-9), (size, closed.label)
