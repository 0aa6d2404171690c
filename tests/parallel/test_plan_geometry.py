"""Rank geometry lives in Plan: the grid as named axes, the stage of a rank, pipeline peers."""

from __future__ import annotations

import pytest

from collsim.cluster.topology import load_topology
from collsim.core.vocab import RankOrder
from collsim.parallel.config import ParallelConfig, TrainingConfig
from collsim.parallel.plan import GridAxis, build_plan, grid_index, grid_rank, rank_axes
from collsim.workload.model import TransformerSpec

SPEC = TransformerSpec(
    name="t", num_layers=8, hidden=256, num_heads=8, ffn_hidden=1024, seq_len=128, vocab=1000
)


def _plan(order: str, tp: int = 2, pp: int = 4, dp: int = 2):
    topo = load_topology("dgx_a100", nodes=tp * pp * dp // 8)
    training = TrainingConfig(global_batch=8 * dp, micro_batch=1)
    return build_plan(topo, SPEC, training, ParallelConfig(tp=tp, pp=pp, dp=dp, order=order))


def test_the_grid_is_the_named_axes_of_the_order() -> None:
    sizes = {"tp": 2, "cp": 1, "dp": 3, "pp": 4}
    pp_outer = rank_axes(RankOrder.PP_OUTER, sizes)
    assert pp_outer == (GridAxis("tp", 2), GridAxis("cp", 1), GridAxis("dp", 3), GridAxis("pp", 4))
    assert [a.name for a in rank_axes(RankOrder.DP_OUTER, sizes)] == ["tp", "cp", "pp", "dp"]
    # rank = ((pp * dp_size + dp) * cp_size + cp) * tp_size + tp with pp outermost
    assert grid_rank(pp_outer, {"tp": 1, "dp": 2, "pp": 3}) == ((3 * 3 + 2) * 1 + 0) * 2 + 1
    for rank in range(24):
        assert grid_rank(pp_outer, grid_index(pp_outer, rank)) == rank


@pytest.mark.parametrize(
    "order, stages",
    [
        # pp outermost: a stage is tp x dp = 4 consecutive ranks
        ("tp-cp-ep-dp-pp", [0, 0, 0, 0, 1, 1, 1, 1, 2, 2, 2, 2, 3, 3, 3, 3]),
        # dp outermost: stages cycle every tp = 2 ranks within each replica of 8
        ("tp-cp-ep-pp-dp", [0, 0, 1, 1, 2, 2, 3, 3, 0, 0, 1, 1, 2, 2, 3, 3]),
    ],
)
def test_stage_of_a_rank_in_either_layout(order: str, stages: list[int]) -> None:
    plan = _plan(order)
    assert [plan.stage_of(r) for r in range(16)] == stages
    for stage in range(4):
        assert all(plan.stage_of(r) == stage for r in plan.stage_ranks(stage))


@pytest.mark.parametrize("order", ["tp-cp-ep-dp-pp", "tp-cp-ep-pp-dp"])
def test_pipeline_peers_are_the_neighbours_in_the_pp_group(order: str) -> None:
    plan = _plan(order)
    for rank in range(16):
        group = plan.group_of(rank, "pp")
        at = group.index(rank)
        before, after = plan.pipeline_peers(rank)
        assert before == (group[at - 1] if at > 0 else None)
        assert after == (group[at + 1] if at < len(group) - 1 else None)
    # the active pipeline sends are exactly the (rank, next) pairs
    pairs = {tuple(p) for p in plan.pipeline_pairs().tolist()}
    assert pairs == {
        (r, plan.pipeline_peers(r)[1]) for r in range(16) if plan.pipeline_peers(r)[1] is not None
    }


@pytest.mark.parametrize("order", ["tp-cp-ep-dp-pp", "tp-cp-ep-pp-dp"])
def test_a_rank_is_its_grid_position_by_strides(order: str) -> None:
    # Plan.rank sums each index times its axis's stride; grid_rank is Horner's form of the
    # same mixed-radix number (out-of-range indices included: both extrapolate linearly)
    plan = _plan(order, tp=2, pp=4, dp=4)
    for dp in range(-1, 5):
        for pp in range(-1, 5):
            for tp in range(3):
                index = {"dp": dp, "pp": pp, "tp": tp, "cp": 0}
                assert plan.rank(dp=dp, pp=pp, tp=tp) == grid_rank(plan.axes, index)
    for rank in range(plan.num_gpus):  # and every rank round-trips
        c = plan.coords(rank)
        assert plan.rank(dp=c.dp, pp=c.pp, tp=c.tp, cp=c.cp) == rank
