"""EP / CP / HSDP plans: rank mapping, groups, uneven pipeline splits, memory, errors."""

from __future__ import annotations

import dataclasses
import warnings

import pytest

from collsim.cluster.topology import load_topology
from collsim.core.errors import CollsimWarning, ConfigError
from collsim.parallel.config import FSDPConfig, ParallelConfig, TrainingConfig
from collsim.parallel.plan import ParallelAxis, build_plan
from collsim.workload import TransformerSpec, get_preset
from collsim.workload.memory import (
    layers_per_stage,
    model_state_bytes,
    moe_model_state_bytes,
    parameters_per_rank,
    stage_parameter_split,
)

MOE = TransformerSpec(
    name="moe",
    num_layers=8,
    hidden=256,
    num_heads=8,
    num_kv_heads=4,
    ffn_hidden=1024,
    seq_len=256,
    vocab=1000,
    num_experts=16,
    moe_top_k=2,
    moe_ffn_hidden=512,
    first_k_dense=1,
    gated_mlp=True,
)


@pytest.fixture(scope="module")
def two_nodes():  # type: ignore[no-untyped-def]
    return load_topology("dgx_h100", nodes=2)


def _plan(topo, spec=MOE, *, gb=32, mb=1, sim=False, fsdp=None, **par):  # type: ignore[no-untyped-def]
    if fsdp is not None:
        par["fsdp"] = FSDPConfig(**fsdp)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", CollsimWarning)
        return build_plan(
            topo,
            spec,
            TrainingConfig(global_batch=gb, micro_batch=mb),
            ParallelConfig(**par),
            for_simulation=sim,
        )


def test_mapping_without_cp_is_unchanged(two_nodes) -> None:  # type: ignore[no-untyped-def]
    plan = _plan(two_nodes, tp=2, pp=2, dp=4, order="tp-cp-ep-pp-dp")
    for r in range(16):
        c = plan.coords(r)
        assert r == c.dp * (2 * 2) + c.pp * 2 + c.tp and c.cp == 0
    assert plan.group_of(5, "dp") == (1, 5, 9, 13)


def test_cp_sits_between_tp_and_pp(two_nodes) -> None:  # type: ignore[no-untyped-def]
    plan = _plan(two_nodes, tp=2, cp=2, pp=2, dp=2, order="tp-cp-ep-pp-dp")
    assert plan.group_of(0, "tp") == (0, 1)
    assert plan.group_of(0, "cp") == (0, 2)
    assert plan.group_of(0, "pp") == (0, 4)
    assert plan.group_of(0, "dp") == (0, 8)
    assert plan.group_of(0, ParallelAxis.DP_CP) == (0, 2, 8, 10)
    assert len(plan.groups("cp")) == 8
    assert plan.stage_ranks(1) == [4, 5, 6, 7, 12, 13, 14, 15]
    # the default (pp outermost): a stage's tp x cp x dp ranks are consecutive
    plan = _plan(two_nodes, tp=2, cp=2, pp=2, dp=2)
    assert plan.group_of(0, "cp") == (0, 2)
    assert plan.group_of(0, "dp") == (0, 4)
    assert plan.group_of(0, "pp") == (0, 8)
    assert plan.group_of(0, ParallelAxis.DP_CP) == (0, 2, 4, 6)
    assert plan.stage_ranks(1) == list(range(8, 16))


def _nodes_of(topo, group):  # type: ignore[no-untyped-def]
    return {topo.node_of(r) for r in group}


def test_ep_groups_on_the_nodes_under_each_order() -> None:
    # DeepSeek-V3's plan shape on 32 nodes: tp 1, pp 4, dp 64, ep 64 (edp 1). Pipeline
    # outermost: each stage is 8 consecutive nodes and each EP group one stage (8 nodes, all 8
    # GPUs of each); dp outermost: an EP group takes every 4th rank, 2 GPUs of 32 nodes.
    topo = load_topology("dgx_h100", nodes=32)
    spec = dataclasses.replace(MOE, num_experts=64, num_layers=8, first_k_dense=0)
    outer = _plan(topo, spec, gb=256, tp=1, pp=4, dp=64, ep=64)
    inner = _plan(topo, spec, gb=256, tp=1, pp=4, dp=64, ep=64, order="tp-cp-ep-pp-dp")
    for g in outer.groups("ep"):
        assert len(_nodes_of(topo, g)) == 8 and g == tuple(range(g[0], g[0] + 64))
    for g in inner.groups("ep"):
        assert len(_nodes_of(topo, g)) == 32
        assert sorted(topo.local_rank(r) for r in g) == sorted([g[0] % 8, g[0] % 8 + 4] * 32)
    # ep 8 over tp 1 x dp 64 with pp 4: intra-node groups with pp outermost only
    outer8 = _plan(topo, spec, gb=256, tp=1, pp=4, dp=64, ep=8)
    inner8 = _plan(topo, spec, gb=256, tp=1, pp=4, dp=64, ep=8, order="tp-cp-ep-pp-dp")
    assert all(len(_nodes_of(topo, g)) == 1 for g in outer8.groups("ep"))
    assert all(len(_nodes_of(topo, g)) == 4 for g in inner8.groups("ep"))
    assert any("expert groups stride over the 4 pipeline stages" in w for w in inner8.warnings)
    assert not outer8.warnings


def test_expert_groups_fold_tp_cp_dp(two_nodes) -> None:  # type: ignore[no-untyped-def]
    # 16 GPUs: tp 2 x cp 2 x dp 4, pp 1; experts etp 1 x ep 8 x edp 2 over the 16 ranks.
    plan = _plan(two_nodes, tp=2, cp=2, dp=4, ep=8, sequence_parallel=True)
    assert plan.edp == 2
    assert plan.group_of(0, "ep") == tuple(range(8))
    assert plan.group_of(3, "edp") == (3, 11)
    assert len(plan.groups("ep")) == 2
    # etp 2: etp groups are consecutive pairs, ep strides by 2
    plan = _plan(two_nodes, tp=2, dp=8, ep=4, etp=2, sequence_parallel=True)
    assert plan.group_of(0, "etp") == (0, 1)
    assert plan.group_of(0, "ep") == (0, 2, 4, 6)
    assert plan.group_of(0, "edp") == (0, 8)
    every = sorted(r for g in plan.groups("ep") for r in g)
    assert every == list(range(16))


def test_hsdp_groups(two_nodes) -> None:  # type: ignore[no-untyped-def]
    plan = _plan(
        two_nodes,
        spec=get_preset("llama2-7b", num_layers=4),
        dp=16,
        zero=3,
        fsdp={"shard_group_size": 8},
    )
    assert plan.group_of(3, "dp_shard") == tuple(range(8))
    assert plan.group_of(3, "dp_replicate") == (3, 11)
    with pytest.raises(ConfigError, match="must divide dp") as info:
        _plan(
            two_nodes,
            spec=get_preset("llama2-7b", num_layers=4),
            dp=16,
            fsdp={"shard_group_size": 6},
        )
    assert info.value.key_path == "parallel.fsdp.shard_group_size"


@pytest.mark.parametrize(
    ("spec", "par", "key", "match"),
    [
        (MOE, dict(dp=16, ep=3), "parallel.ep", r"experts \(16\) must be divisible by ep"),
        (MOE, dict(tp=2, dp=8, ep=8, etp=4), "parallel.ep", r"ep x etp = 8 x 4 must divide"),
        (MOE, dict(tp=2, dp=8, ep=4), "parallel.sequence_parallel", "needs sequence_parallel"),
        (MOE, dict(dp=4, cp=2, pp=2, ep=16), "parallel.ep", "must divide tp x cp x dp"),
        (
            get_preset("llama2-7b", seq_len=100, num_layers=4),
            dict(dp=4, cp=4),
            "parallel.cp",
            r"divisible by 2 x cp = 8 \(causal load balancing\)",
        ),
        (
            get_preset("llama2-7b", seq_len=34, num_layers=4),
            dict(dp=4, cp=4, cp_load_balance=False),
            "parallel.cp",
            "divisible by cp = 4",
        ),
        (get_preset("llama2-7b", num_layers=4), dict(dp=16, ep=2), "parallel.ep", "routed experts"),
        (
            MOE,
            dict(dp=2, pp=8, layers_per_stage=(1, 1, 1, 1, 1, 1, 1, 2)),
            "parallel.layers_per_stage",
            "sum to 9",
        ),
    ],
)
def test_bad_plans_name_the_key(two_nodes, spec, par, key, match) -> None:  # type: ignore[no-untyped-def]
    with pytest.raises(ConfigError, match=match) as info:
        _plan(two_nodes, spec, **par)
    assert info.value.key_path == key
    assert "\n" not in str(info.value)


def test_expert_context_and_hsdp_plans_are_simulated(two_nodes) -> None:  # type: ignore[no-untyped-def]
    """The refusal gate is gone: EP, etp, CP and HSDP plans build for simulation and run."""
    from collsim.play.engine import simulate_step

    spec = dataclasses.replace(MOE, num_layers=2, seq_len=512)
    for par in (
        dict(dp=16, ep=8),
        dict(tp=2, dp=8, etp=2, sequence_parallel=True),
        dict(dp=8, cp=2),
        dict(dp=16, zero=3, fsdp={"shard_group_size": 8}),
    ):
        plan = _plan(two_nodes, spec, sim=True, **par)
        assert plan.num_gpus == 16
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", CollsimWarning)
            result = simulate_step(two_nodes, spec, plan.training, plan.parallel, fidelity="fused")
        assert result.step_time_s > 0


def test_llama3_405b_balanced_split() -> None:
    topo = load_topology("dgx_h100", nodes=16)
    plan = _plan(
        topo,
        get_preset("llama3-405b"),
        gb=128,
        pp=16,
        dp=8,
        account_for_embedding=True,
        account_for_loss=True,
    )
    sizes = [len(plan.chunk_layers(s, 0)) for s in range(16)]
    assert sizes == [7] + [8] * 14 + [7]
    assert plan.chunk_layers(1, 0) == range(7, 15)
    assert [i for s in range(16) for i in plan.stage_layers(s)] == list(range(126))
    assert layers_per_stage(126, 16, first_offset=1, last_offset=1) == sizes


def test_deepseek_61_layers_on_4x8() -> None:
    topo = load_topology("dgx_h100", nodes=4)
    spec = get_preset("deepseek-v3")
    par = dict(pp=4, dp=8, schedule="interleaved", virtual_stages=8)
    with pytest.raises(ConfigError, match="pipeline_split: balanced") as info:
        _plan(topo, spec, gb=64, **par)  # the default even split must divide
    assert info.value.key_path == "parallel.virtual_stages"
    plan = _plan(topo, spec, gb=64, pipeline_split="balanced", **par)
    layers = sorted(i for s in range(4) for i in plan.stage_layers(s))
    assert layers == list(range(61))
    assert (
        sorted(len(plan.chunk_layers(s, c)) for s in range(4) for c in range(8))
        == [1] * 3 + [2] * 29
    )
    assert plan.layers_per_chunk == 2 and not plan.even_split


def test_even_split_as_before(two_nodes) -> None:  # type: ignore[no-untyped-def]
    plan = _plan(two_nodes, tp=1, pp=4, dp=4, schedule="interleaved", virtual_stages=2)
    assert plan.even_split and plan.layers_per_chunk == 1
    assert [plan.chunk_layers(s, c) for c in range(2) for s in range(4)] == [
        range(i, i + 1) for i in range(8)
    ]


def test_explicit_layers_per_stage(two_nodes) -> None:  # type: ignore[no-untyped-def]
    plan = _plan(two_nodes, tp=2, pp=4, dp=2, layers_per_stage=(1, 3, 3, 1))
    assert [plan.chunk_layers(s, 0) for s in range(4)] == [
        range(0, 1),
        range(1, 4),
        range(4, 7),
        range(7, 8),
    ]


def test_moe_model_state_equals_its_formula() -> None:
    # DeepSeek-V3 on stage 1 of PP 4 (layers 16..31 contiguous), tp 1, ep 64, dp 256, ZeRO-1
    spec = get_preset("deepseek-v3")
    dense, experts = stage_parameter_split(spec, tp=1, pp=4, stage=1, ep=64)
    h = 7168
    expert = 3 * h * 2048
    layer_dense = spec.attention_parameters() + 2 * h + expert + h * 256  # + shared + router
    assert dense == pytest.approx(15 * layer_dense)
    assert experts == pytest.approx(15 * (256 / 64) * expert)
    edp = 1 * 1 * 256 // 64
    states = moe_model_state_bytes(dense, experts, zero=1, dp_cp=256, edp=edp)
    k = 12.0
    assert states.total == pytest.approx(
        (2 + 2) * (dense + experts) + k * (dense / 256 + experts / edp)
    )
    # zero 3 (FSDP): everything divided by its own group
    z3 = moe_model_state_bytes(dense, experts, zero=3, dp_cp=256, edp=edp)
    assert z3.total == pytest.approx(16 * (dense / 256 + experts / edp))
    # ep = 1 and one group: the plain ZeRO table
    same = moe_model_state_bytes(dense, experts, zero=1, dp_cp=8, edp=8)
    assert same.total == pytest.approx(model_state_bytes(dense + experts, zero=1, dp=8).total)
    assert parameters_per_rank(spec, pp=4, stage=1, ep=64) == pytest.approx(dense + experts)


def test_rank_model_states_by_hand(two_nodes) -> None:  # type: ignore[no-untyped-def]
    from collsim.parallel.states import rank_model_states

    # MOE on 16 GPUs: tp 2, dp 8, ep 4 -> edp = 2 x 8 / 4 = 4; ZeRO-1, bf16 Adam.
    plan = _plan(two_nodes, tp=2, dp=8, ep=4, zero=1, sequence_parallel=True)
    r = rank_model_states(plan)
    dense, experts = stage_parameter_split(MOE, tp=2, ep=4)
    assert (r.dense_params, r.expert_params) == (dense, experts)
    assert (r.shard_group, r.expert_shard_group) == (8, 4)
    assert r.total == pytest.approx(4 * (dense + experts) + 12 * (dense / 8 + experts / 4))
    # HSDP: shard groups of 4 dp ranks, 2 replicas; experts over edp / 2 = 2
    plan = _plan(
        two_nodes,
        tp=2,
        dp=8,
        ep=4,
        zero=3,
        sequence_parallel=True,
        fsdp={"shard_group_size": 4, "reshard_after_forward": False},
    )
    r = rank_model_states(plan)
    assert (r.shard_group, r.expert_shard_group) == (4, 2)
    sharded = 16 * (dense / 4 + experts / 2)
    assert r.states.total == pytest.approx(sharded)
    # parameters kept gathered after forward: 2 bytes each, less the sharded copy
    assert r.kept_gathered_bytes == pytest.approx(
        2 * (dense + experts) - 2 * (dense / 4 + experts / 2)
    )


def test_rank_model_states_fp8_copies(two_nodes) -> None:  # type: ignore[no-untyped-def]
    from collsim.parallel.sharding import fp8_weight_bytes
    from collsim.parallel.states import rank_model_states

    spec = get_preset("llama2-7b", num_layers=4)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", CollsimWarning)
        plan = build_plan(
            two_nodes,
            spec,
            TrainingConfig(global_batch=16, dtype="fp8", fp8_recipe="blockwise"),
            ParallelConfig(dp=16, zero=1),
            for_simulation=False,
        )
    r = rank_model_states(plan)
    gemm = r.dense_params - 2 * spec.vocab * spec.hidden  # both vocab matrices stay bf16
    assert r.fp8_copy_bytes == pytest.approx(fp8_weight_bytes(gemm, "blockwise"))


def test_fp32_reduce_and_fp8_gather_no_longer_warn(two_nodes) -> None:  # type: ignore[no-untyped-def]
    spec = get_preset("llama2-7b", num_layers=4)
    with warnings.catch_warnings():
        warnings.simplefilter("error", CollsimWarning)
        plan = build_plan(
            two_nodes,
            spec,
            TrainingConfig(global_batch=16),
            ParallelConfig(dp=16, zero=3, fsdp=FSDPConfig(reduce_dtype="fp32")),
        )
    assert not plan.warnings
