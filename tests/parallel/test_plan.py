"""Plan checks (ConfigError naming the key), warnings and the rank mapping."""

from __future__ import annotations

import warnings

import pytest

from collsim.cluster.topology import load_topology
from collsim.core.errors import CollsimWarning, ConfigError
from collsim.parallel.config import ParallelConfig, TrainingConfig
from collsim.parallel.describe import describe_mapping
from collsim.parallel.plan import ParallelAxis, build_plan
from collsim.workload.model import TransformerSpec

SPEC = TransformerSpec(
    name="t", num_layers=8, hidden=256, num_heads=8, ffn_hidden=1024, seq_len=128, vocab=1000
)


@pytest.fixture(scope="module")
def two_nodes():
    return load_topology("dgx_a100", nodes=2)  # 16 GPUs, 8 per node


def _plan(topo, *, gb=32, mb=1, **par):
    return build_plan(
        topo, SPEC, TrainingConfig(global_batch=gb, micro_batch=mb), ParallelConfig(**par)
    )


@pytest.mark.parametrize(
    "par, gb, key, match",
    [
        # 2 x 2 x 2 = 8 GPUs on a 16-GPU cluster
        (dict(tp=2, pp=2, dp=2), 32, "parallel", r"tp x pp x dp = 2 x 2 x 2 = 8 must equal .* 16"),
        # 8 heads are not divisible by tp = 16... use 3 x 1 x ... impossible: heads 8 % 16 == 8
        (dict(tp=16, pp=1, dp=1), 32, "parallel.tp", r"heads \(8\) must be divisible by tp"),
        # 8 layers over pp 16
        (
            dict(tp=1, pp=16, dp=1),
            32,
            "parallel.pp",
            r"layers \(8\) .* pp x virtual_stages = 16 x 1",
        ),
        # 8 layers over pp 4 x 4 chunks
        (
            dict(tp=1, pp=4, dp=4, schedule="interleaved", virtual_stages=4),
            32,
            "parallel.virtual_stages",
            r"pp x virtual_stages = 4 x 4",
        ),
        # 30 sequences over micro-batch 1 x dp 16
        (dict(tp=1, pp=1, dp=16), 30, "training.global_batch", r"30.*micro_batch x dp = 1 x 16"),
        # interleaved, m = 32 / 4 = 8... use dp 2 -> m = 6 not divisible by pp 4
        (
            dict(tp=2, pp=4, dp=2, schedule="interleaved", virtual_stages=2),
            12,
            "parallel.schedule",
            r"micro-batches \(6\) divisible by pp \(4\)",
        ),
    ],
    ids=["world", "heads", "layers", "chunks", "batch", "interleaved-m"],
)
def test_plan_errors_name_the_key(two_nodes, par, gb, key, match) -> None:
    with pytest.raises(ConfigError, match=match) as info:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", CollsimWarning)
            _plan(two_nodes, gb=gb, **par)
    assert info.value.key_path == key
    assert "\n" not in str(info.value)


def test_valid_plan_counts(two_nodes) -> None:
    plan = _plan(two_nodes, gb=64, mb=2, tp=2, pp=2, dp=4)
    assert plan.num_microbatches == 64 // (2 * 4)
    assert plan.layers_per_stage == 4
    assert plan.warnings == ()


def test_bubble_and_wide_tp_warn(two_nodes) -> None:
    with pytest.warns(CollsimWarning, match=r"fewer micro-batches \(2\) than pipeline stages"):
        plan = _plan(two_nodes, gb=2, tp=2, pp=8, dp=1)
    assert any("bubble" in w for w in plan.warnings)
    with pytest.warns(CollsimWarning, match=r"tp \(16\) is larger than a node \(8 GPUs\)"):
        build_plan(
            two_nodes,
            TransformerSpec(
                name="w",
                num_layers=2,
                hidden=256,
                num_heads=16,
                ffn_hidden=1024,
                seq_len=64,
                vocab=100,
            ),
            TrainingConfig(global_batch=4),
            ParallelConfig(tp=16),
        )


def test_mapping_tp_inside_node_pp_then_dp(two_nodes) -> None:
    plan = _plan(two_nodes, tp=4, pp=2, dp=2, order="tp-cp-ep-pp-dp")
    # rank = dp * 8 + pp * 4 + tp
    assert plan.group_of(0, "tp") == (0, 1, 2, 3)
    assert plan.group_of(5, "pp") == (1, 5)
    assert plan.group_of(6, "dp") == (6, 14)
    for rank in range(16):
        c = plan.coords(rank)
        assert plan.rank(dp=c.dp, pp=c.pp, tp=c.tp) == rank
        assert len({two_nodes.node_of(r) for r in plan.group_of(rank, "tp")}) == 1
    for axis in ParallelAxis:
        groups = plan.groups(axis)
        assert sorted(r for g in groups for r in g) == list(range(16))
    text = describe_mapping(plan)
    assert "tp groups: 4 of 4; first [0, 1, 2, 3] on node(s) 0" in text
    assert "dp groups: 8 of 2; first [0, 8] on node(s) 0-1" in text
    assert "stage 1: layers 4-7" in text
    assert "x 8 GPUs, order tp-cp-ep-pp-dp\nrank = dp_index * 8 + pp_index * 4 + tp_index" in text


def test_default_mapping_puts_pp_outermost(two_nodes) -> None:
    # Megatron-Core's default order tp-cp-ep-dp-pp: rank = pp * 8 + dp * 4 + tp
    plan = _plan(two_nodes, tp=4, pp=2, dp=2)
    assert plan.order == "tp-cp-ep-dp-pp"
    assert plan.group_of(0, "tp") == (0, 1, 2, 3)
    assert plan.group_of(5, "pp") == (5, 13)
    assert plan.group_of(6, "dp") == (2, 6)
    assert plan.stage_ranks(1) == list(range(8, 16))
    for rank in range(16):
        c = plan.coords(rank)
        assert plan.rank(dp=c.dp, pp=c.pp, tp=c.tp) == rank
    for axis in ParallelAxis:
        groups = plan.groups(axis)
        assert sorted(r for g in groups for r in g) == list(range(16))
    text = describe_mapping(plan)
    assert "x 8 GPUs, order tp-cp-ep-dp-pp\nrank = pp_index * 8 + dp_index * 4 + tp_index" in text
    assert "dp groups: 8 of 2; first [0, 4] on node(s) 0" in text
    with pytest.raises(ConfigError, match="must be one of tp-cp-ep-dp-pp, tp-cp-ep-pp-dp") as e:
        ParallelConfig(tp=4, pp=2, dp=2, order="pp-dp-tp")
    assert e.value.key_path == "parallel.order"


def test_interleaved_chunks_take_virtual_stages(two_nodes) -> None:
    plan = _plan(two_nodes, gb=32, tp=2, pp=4, dp=2, schedule="interleaved", virtual_stages=2)
    # 8 layers, 8 virtual stages of one layer: stage s holds layers s and s + 4
    assert [list(plan.chunk_layers(1, c)) for c in range(2)] == [[1], [5]]
