"""The EP / CP collectives of a layer agree with the volume formulas."""

from __future__ import annotations

import warnings

import pytest

from collsim.cluster.topology import load_topology
from collsim.collectives import CollectiveOp
from collsim.core.errors import CollsimWarning
from collsim.parallel.config import ParallelConfig, TrainingConfig
from collsim.parallel.context import cp_volumes, kv_block_bytes
from collsim.parallel.layer_comms import layer_comms
from collsim.parallel.moe import ep_volumes
from collsim.parallel.plan import build_plan
from collsim.workload import get_preset


def _plan(spec, nodes, **par):  # type: ignore[no-untyped-def]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", CollsimWarning)
        return build_plan(
            load_topology("dgx_h100", nodes=nodes),
            spec,
            TrainingConfig(global_batch=64, micro_batch=1),
            ParallelConfig(**par),
            for_simulation=False,
        )


def test_moe_layer_collectives_match_ep_volumes() -> None:
    spec = get_preset("qwen3-30b-a3b")
    plan = _plan(spec, 2, tp=2, dp=8, ep=4, etp=2, sequence_parallel=True)
    comms = layer_comms(plan)
    names = [(c.name, c.phase) for c in comms]
    assert names[:4] == [
        ("ep_dispatch", "forward"),
        ("etp_gather", "forward"),
        ("etp_scatter", "forward"),
        ("ep_combine", "forward"),
    ]
    assert [n for n, p in names if p == "backward"] == [
        "ep_combine",
        "etp_scatter",
        "etp_gather",
        "ep_dispatch",
    ]
    tokens = 4096 / 2  # SP: s / tp tokens per rank
    v = ep_volumes(tokens=tokens, top_k=8, hidden=2048, element_bytes=2, ep=4, etp=2)
    dispatch = comms[0]
    assert dispatch.size_bytes == v.all_to_all_size_bytes
    # what an all_to_all of that size sends per rank: (n - 1) / n of the buffer
    assert dispatch.size_bytes * 3 / 4 == v.dispatch_bytes
    assert {c.op for c in comms} <= {op.value for op in CollectiveOp}
    assert layer_comms(plan, layer=0)[0].name == "ep_dispatch"  # every Qwen3 layer is MoE


def test_dense_first_layer_has_no_ep_traffic() -> None:
    spec = get_preset("deepseek-v3", num_layers=8)
    plan = _plan(spec, 2, dp=16, ep=16)
    assert layer_comms(plan, layer=0) == []
    assert len(layer_comms(plan, layer=5)) == 4


@pytest.mark.parametrize("algorithm", ["ring", "all_gather"])
def test_cp_collectives_match_cp_volumes(algorithm: str) -> None:
    spec = get_preset("llama3-8b", num_layers=4)
    plan = _plan(spec, 2, tp=2, cp=4, dp=2, cp_algorithm=algorithm, sequence_parallel=True)
    comms = layer_comms(plan)
    block = kv_block_bytes(
        micro_batch=1,
        seq_len=8192,
        cp=4,
        kv_heads=8,
        key_dim=128,
        value_dim=128,
        element_bytes=2,
        tp=2,
    )
    v = cp_volumes(block, cp=4, algorithm=algorithm)
    fwd = [c for c in comms if c.phase == "forward"]
    bwd = [c for c in comms if c.phase == "backward"]
    if algorithm == "ring":
        assert sum(c.size_bytes * c.calls for c in fwd) == v.forward_bytes
        assert sum(c.size_bytes * c.calls for c in bwd) == v.backward_bytes
        assert all(c.overlappable and c.op == "send_recv" for c in comms)
    else:
        (ag,) = fwd
        (rs,) = bwd
        assert ag.op == "all_gather" and ag.size_bytes == v.collective_size_bytes
        assert rs.op == "reduce_scatter" and rs.size_bytes * 3 / 4 == v.backward_bytes


@pytest.mark.parametrize("algorithm", ["torch_allgather", "torch_alltoall"])
def test_torch_cp_bytes_per_layer_by_hand(algorithm: str) -> None:
    # Llama 3 8B, s = 8192, cp 4, tp 2: 2048 tokens and 32 / 2 = 16 heads on a rank (torch CP
    # exchanges K and V after torchtitan repeats the 8 KV heads to all 32), 128 + 128 wide,
    # bf16: 2048 x 16 x 256 x 2 = 16 MiB per block; dK, dV in fp32 twice that
    spec = get_preset("llama3-8b", num_layers=4)
    plan = _plan(spec, 2, tp=2, cp=4, dp=2, cp_algorithm=algorithm, sequence_parallel=True)
    comms = layer_comms(plan)
    block = 2048 * 16 * 256 * 2
    assert block == 16 * 2**20
    fwd = [c for c in comms if c.phase == "forward"]
    bwd = [c for c in comms if c.phase == "backward"]
    if algorithm == "torch_allgather":
        # one all-gather of the 4 blocks forward, the same again backward
        assert [(c.op, c.size_bytes, c.calls) for c in fwd] == [("all_gather", 4 * block, 1)]
        assert (bwd[0].op, bwd[0].size_bytes, bwd[0].calls) == ("all_gather", 4 * block, 1)
    else:
        # three sends of the held block to the next rank, forward and again backward
        assert [(c.op, c.size_bytes, c.calls) for c in fwd] == [("send_recv", block, 3)]
        assert (bwd[0].op, bwd[0].size_bytes, bwd[0].calls) == ("send_recv", block, 3)
    # the fp32 dK, dV go to the next rank at each of the 4 steps
    assert (bwd[1].name, bwd[1].op, bwd[1].size_bytes, bwd[1].calls) == (
        "cp_dkv_rotate",
        "send_recv",
        2 * block,
        4,
    )
    v = cp_volumes(block, cp=4, algorithm=algorithm)
    assert v.forward_bytes == 3 * block
    assert v.backward_bytes == 3 * block + 4 * 2 * block


@pytest.mark.parametrize(
    ("training", "key"),
    [
        ({"stack": "megatron_te"}, "parallel.cp_algorithm"),
        ({"attention_kernel": "flash3"}, "training.attention_kernel"),
        ({"attention_kernel": "eager"}, "training.attention_kernel"),
    ],
)
def test_torch_cp_refuses_what_torch_does_not_run(training: dict, key: str) -> None:
    from collsim.core.errors import ConfigError

    spec = get_preset("llama3-8b", num_layers=4)
    with pytest.raises(ConfigError) as err, warnings.catch_warnings():
        warnings.simplefilter("ignore", CollsimWarning)
        build_plan(
            load_topology("dgx_h100", nodes=2),
            spec,
            TrainingConfig(global_batch=64, micro_batch=1, **training),
            ParallelConfig(tp=2, cp=4, dp=2, cp_algorithm="torch_allgather"),
            for_simulation=False,
        )
    assert err.value.key_path == key
    assert "\n" not in str(err.value)
