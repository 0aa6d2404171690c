"""MoE, MLA, sliding-window and context-parallel ops: FLOPs, GEMM shapes and kept tensors
against hand computations."""

from __future__ import annotations

import dataclasses

import pytest

from collsim.core.errors import ConfigError
from collsim.workload import get_preset, model_flops_per_step
from collsim.workload.flops import forward_layers_flops
from collsim.workload.memory import activation_bytes_per_layer
from collsim.workload.ops import attended_keys, layer_ops, routed_rows

MIXTRAL = get_preset("mixtral-8x7b", seq_len=4096)
DS = get_preset("deepseek-v3")


def _by_name(ops):  # type: ignore[no-untyped-def]
    return {op.name: op for op in ops}


def test_moe_layer_gemms_by_hand() -> None:
    # Mixtral: 4096 tokens, top-2 of 8 experts of 14336, ep 4 -> 2 local experts; balanced.
    ops = _by_name(layer_ops(MIXTRAL, micro_batch=1, ep=4))
    t, h, f, k = 4096, 4096, 14336, 2
    rows = t * k  # routed rows on this rank: t k (ep x t x k / ep)
    assert ops["router"].flops == 2 * t * h * 8
    up = ops["expert_up"].gemms[0]
    assert (up.m, up.n, up.k, up.batch) == (rows // 2, 2 * f, h, 2)
    assert ops["expert_up"].flops + ops["expert_down"].flops == 2 * rows * 3 * h * f
    assert ops["expert_up"].saved["expert_up.input"] == 2 * rows * h  # dispatched tokens
    assert "shared_up" not in ops and "mlp_up" not in ops


def test_etp_and_capacity_and_imbalance_change_rows() -> None:
    t = 1024.0
    assert routed_rows(MIXTRAL, t) == t * 2
    assert routed_rows(MIXTRAL, t, etp=2) == t * 2 * 2
    assert routed_rows(dataclasses.replace(MIXTRAL, capacity_factor=1.25), t) == t * 2 * 1.25
    assert routed_rows(dataclasses.replace(MIXTRAL, load_imbalance=1.5), t) == t * 2 * 1.5
    # etp halves each expert's width, doubles the rows: the FLOPs per rank stay.
    a = _by_name(layer_ops(MIXTRAL, micro_batch=1, ep=8))
    b = _by_name(layer_ops(MIXTRAL, micro_batch=1, ep=4, etp=2))
    assert a["expert_up"].flops == pytest.approx(b["expert_up"].flops)


def test_deepseek_dense_first_and_shared_expert() -> None:
    dense = _by_name(layer_ops(DS, micro_batch=1, layer=0))
    moe = _by_name(layer_ops(DS, micro_batch=1, layer=3))
    assert "mlp_up" in dense and "router" not in dense
    t, h = 4096, 7168
    assert moe["shared_up"].flops + moe["shared_down"].flops == 2 * t * 3 * h * 2048
    assert moe["router"].flops == 2 * t * h * 256


def test_mla_projection_flops_by_hand() -> None:
    ops = _by_name(layer_ops(DS, micro_batch=1, tp=8, layer=3))
    t, h, a = 4096, 7168, 128 // 8
    assert ops["q_down"].flops == 2 * t * h * 1536  # replicated over TP
    assert ops["q_up"].flops == 2 * t * 1536 * a * 192
    assert ops["kv_down"].flops == 2 * t * h * (512 + 64)
    assert ops["kv_up"].flops == 2 * t * 512 * a * (128 + 128)
    assert ops["out_proj"].flops == 2 * t * a * 128 * h
    fa = ops["flash_attention"]
    # causal half of s x s, q/k width 192 and v width 128
    assert fa.flops == pytest.approx(2 * a * t * (t / 2) * (192 + 128))


def test_sliding_window_attention_flops() -> None:
    oss = get_preset("gpt-oss-120b")
    s, w = oss.seq_len, 128
    full = _by_name(layer_ops(oss, micro_batch=1, layer=1))["flash_attention"]
    win = _by_name(layer_ops(oss, micro_batch=1, layer=0))["flash_attention"]
    assert win.flops / full.flops == pytest.approx((w - w * (w - 1) / (2 * s)) / (s / 2))
    # exact mean of min(i + 1, w) over i in 0..s-1
    assert attended_keys(s, w, causal=True) == pytest.approx(
        sum(min(i + 1, w) for i in range(s)) / s
    )
    assert attended_keys(s, w, causal=False) == w


def test_context_parallel_splits_tokens() -> None:
    spec = get_preset("llama3-8b")
    one = layer_ops(spec, micro_batch=1)
    four = layer_ops(spec, micro_batch=1, cp=4)
    f1 = {op.name: op.flops for op in one}
    f4 = {op.name: op.flops for op in four}
    for name in ("qkv_proj", "out_proj", "mlp_up", "mlp_down", "flash_attention"):
        assert f4[name] == pytest.approx(f1[name] / 4), name
    act1 = activation_bytes_per_layer(spec, micro_batch=1)
    act4 = activation_bytes_per_layer(spec, micro_batch=1, cp=4)
    assert act4 == pytest.approx(act1 / 4)
    with pytest.raises(ConfigError, match="divisible by cp"):
        layer_ops(spec, micro_batch=1, cp=3)


def test_cp_one_is_the_dense_path() -> None:
    spec = get_preset("llama3-8b")
    assert layer_ops(spec, micro_batch=2, tp=2) == layer_ops(spec, micro_batch=2, tp=2, cp=1)


def test_moe_activation_memory_by_hand() -> None:
    spec = dataclasses.replace(MIXTRAL, seq_len=1024)
    e, t, h, f, k, n = 2, 1024, 4096, 14336, 2, 8
    rows = t * k
    ops = layer_ops(spec, micro_batch=1)
    moe_saved = sum(
        v
        for op in ops
        for name, v in op.saved.items()
        if op.name
        in (
            "router",
            "router_topk",
            "expert_up",
            "expert_activation",
            "expert_down",
            "moe_unpermute",
        )
    )
    expected = (
        e * t * h  # router input
        + 4 * t * n  # fp32 router scores
        + e * rows * h  # dispatched tokens (expert input)
        + 2 * e * rows * f  # SwiGLU input (gate and up)
        + e * rows * f  # down input
        + e * rows * h  # expert outputs for the combine
    )
    assert moe_saved == expected


def test_moe_model_flops_are_active_parameters() -> None:
    # Without attention over s x s, forward FLOPs per token of an MoE model = 2 x active
    # matmul parameters (top-k experts + shared + router + attention projections + head).
    spec = get_preset("mixtral-8x7b", seq_len=256)
    tokens = spec.seq_len
    core = forward_layers_flops(spec, 1, ("attn_scores", "attn_values"))
    total = model_flops_per_step(spec, 1) / 3
    matmul_params = (
        spec.active_parameters(embedding=False)
        - spec.num_layers * 2 * spec.hidden  # norms
        - spec.hidden  # final norm
    )
    assert total - core == pytest.approx(2 * tokens * matmul_params, rel=1e-9)


def test_model_flops_ignore_padding_and_imbalance() -> None:
    spec = get_preset("mixtral-8x7b", seq_len=512)
    padded = dataclasses.replace(spec, capacity_factor=2.0, load_imbalance=1.3)
    assert model_flops_per_step(padded, 4) == model_flops_per_step(spec, 4)


def test_window_and_mla_model_flops() -> None:
    # GPT-OSS: model FLOPs of the attention core count s x s on full layers and s x w on
    # the 18 windowed ones (QK^T and AV: 2 x 2 x s x keys x d per head).
    oss = get_preset("gpt-oss-120b", seq_len=1024)
    core = forward_layers_flops(oss, 1, ("attn_scores", "attn_values"))
    s, w, d, a = 1024, 128, 64, 64
    assert core == pytest.approx(18 * 4 * a * s * s * d + 18 * 4 * a * s * w * d)
    # DeepSeek-V3: q/k width 192 and v width 128 in the core, every projection counted once.
    ds = get_preset("deepseek-v3", seq_len=512)
    core = forward_layers_flops(ds, 1, ("attn_scores", "attn_values"))
    assert core == pytest.approx(61 * 2 * 128 * 512 * 512 * (192 + 128))
    proj = forward_layers_flops(ds, 1, ("q_down", "q_up", "kv_down", "kv_up", "out_proj"))
    q = 7168 * 1536 + 1536 * 128 * 192
    kv = 7168 * 576 + 512 * 128 * 256
    assert proj == pytest.approx(61 * 2 * 512 * (q + kv + 128 * 128 * 7168))
