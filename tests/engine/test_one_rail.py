"""The contention check looks at one rail's groups where the rails are alike
(``Plan.one_rail_groups``): it must give the answer the check of every group gives."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import assume, given, settings
from hypothesis import strategies as st

from collsim.core.vocab import ParallelAxis
from collsim.parallel.config import ParallelConfig, TrainingConfig
from collsim.parallel.plan import build_plan
from collsim.play.engine.comm import axis_contends
from collsim.step.stragglers import degrade_topology

from .conftest import topology

DP, PP = ParallelAxis.DP, ParallelAxis.PP


def _oversubscribed(nodes: int):
    """dgx_h100 with 4 nodes per rail leaf and 4:1 oversubscribed uplinks: groups that cross
    leaves contend."""
    from collsim.cluster.topology import parse_topology, resolve_topology_path
    from collsim.core.yamlio import parse_yaml_text

    text = resolve_topology_path("dgx_h100").read_text()
    text = text.replace("oversubscription: 1.0", "oversubscription: 4.0")
    text = text.replace("nodes_per_leaf: 32", "nodes_per_leaf: 4")
    return parse_topology(parse_yaml_text(text, "oversubscribed.yaml"), nodes=nodes)


def _plan(name: str, nodes: int, tp: int, pp: int, order: str = "tp-cp-ep-dp-pp"):
    from collsim.workload import TransformerSpec

    topo = _oversubscribed(nodes) if name == "oversubscribed" else topology(name, nodes)
    dp = topo.num_ranks // (tp * pp)
    spec = TransformerSpec(
        name="t",
        num_layers=8 * pp,
        hidden=512,
        num_heads=8,
        ffn_hidden=2048,
        seq_len=256,
        vocab=4096,
    )
    training = TrainingConfig(global_batch=dp * pp * 2, micro_batch=1)
    return build_plan(topo, spec, training, ParallelConfig(tp=tp, pp=pp, dp=dp, order=order))


@settings(max_examples=20, deadline=None)
@given(
    name=st.sampled_from(["dgx_a100", "dgx_h100", "oversubscribed"]),
    nodes=st.sampled_from([2, 8, 24, 48]),
    tp=st.sampled_from([1, 2, 4, 8]),
    pp=st.sampled_from([1, 2, 4]),
    order=st.sampled_from(["tp-cp-ep-dp-pp", "tp-cp-ep-pp-dp"]),
)
def test_one_rail_decides_as_every_group_does(
    name: str, nodes: int, tp: int, pp: int, order: str
) -> None:
    plan = _plan(name, nodes, tp, pp, order)
    topo = plan.topology
    full = plan.active_groups()
    reduced = plan.active_groups(node_local=True)
    for axis in (DP, PP):
        groups, few = full[axis], reduced[axis]
        if not len(groups) or groups.shape[1] < 2:
            continue
        assert axis_contends(topo, groups) == axis_contends(topo, few)


def test_groups_on_every_rail_reduce_to_the_first() -> None:
    plan = _plan("dgx_h100", 64, tp=8, pp=2)  # dp groups: one per (stage, GPU index)
    dp = plan.group_rows(DP)
    few = plan.one_rail_groups(dp)
    assert len(dp) == 16 and len(few) == 2
    assert bool((few % 8 == 0).all())


def test_groups_that_mix_gpu_indices_are_kept() -> None:
    plan = _plan("dgx_h100", 8, tp=1, pp=1)  # one dp group over all 64 GPUs
    dp = plan.group_rows(DP)
    assert np.array_equal(plan.one_rail_groups(dp), dp)


def test_degraded_links_keep_every_group() -> None:
    plan = _plan("dgx_h100", 8, tp=8, pp=1)
    topo = plan.topology
    slow = degrade_topology(topo, {topo.path(1, 9)[0]: 0.1})  # GPU index 1's rail only
    slow_plan = build_plan(slow, plan.spec, plan.training, plan.parallel)
    dp = slow_plan.group_rows(DP)
    assert np.array_equal(slow_plan.one_rail_groups(dp), dp)


def test_an_oversubscribed_fabric_contends_on_one_rail_as_on_all() -> None:
    # dp outermost: each dp group strides 4 nodes (a leaf), every ring flow crosses leaves,
    # and the four stages' groups share each rail's uplinks (1 NIC of capacity, 4 flows)
    plan = _plan("oversubscribed", 16, tp=8, pp=4, order="tp-cp-ep-pp-dp")
    topo = plan.topology
    dp = plan.group_rows(DP)
    few = plan.one_rail_groups(dp)
    assert len(dp) == 32 and len(few) == 4
    assert axis_contends(topo, dp) and axis_contends(topo, few)
    # pp outermost: the pipeline sends cross leaves together instead
    plan = _plan("oversubscribed", 16, tp=8, pp=4)
    topo = plan.topology
    pairs, few = plan.active_groups()[PP], plan.active_groups(node_local=True)[PP]
    assert len(pairs) == 8 * len(few)
    assert axis_contends(topo, pairs) and axis_contends(topo, few)
    dp = plan.group_rows(DP)
    assert not axis_contends(topo, dp) and not axis_contends(topo, plan.one_rail_groups(dp))


@pytest.mark.parametrize("name", ["dgx_a100", "dgx_h100"])
def test_pipeline_pairs_reduce_to_one_gpu_index(name: str) -> None:
    plan = _plan(name, 16, tp=8, pp=4)
    pairs = plan.active_groups()[PP]
    few = plan.active_groups(node_local=True)[PP]
    assert len(few) * 8 == len(pairs)


@settings(max_examples=25, deadline=None)
@given(
    name=st.sampled_from(["dgx_a100", "dgx_h100", "oversubscribed", "pcie_8gpu"]),
    nodes=st.sampled_from([2, 8, 24]),
    tp=st.sampled_from([1, 2, 4, 8]),
    pp=st.sampled_from([2, 4]),
    order=st.sampled_from(["tp-cp-ep-dp-pp", "tp-cp-ep-pp-dp"]),
)
def test_pipeline_rows_made_directly_are_the_one_rail_rows(
    name: str, nodes: int, tp: int, pp: int, order: str
) -> None:
    """Where the first GPU index's pipeline sends are made without the others
    (``Plan.pipeline_pairs``), they are the rows ``one_rail_groups`` keeps of all of them."""
    assume(nodes * 8 >= tp * pp)  # every topology here has 8 GPUs a node
    plan = _plan(name, nodes, tp, pp, order)
    every = plan.active_groups()[PP]
    assert np.array_equal(plan.active_groups(node_local=True)[PP], plan.one_rail_groups(every))
