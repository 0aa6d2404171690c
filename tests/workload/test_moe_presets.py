"""Parameter counts of the MoE / MLA / SWA presets and of HF-style configs against the
published totals, and the per-layer formulas against hand counts."""

from __future__ import annotations

import pytest

from collsim.core.errors import ConfigError
from collsim.workload import TransformerSpec, get_preset


@pytest.mark.parametrize(
    ("name", "total", "active", "embedding"),
    [
        # DeepSeek-V3 report (arXiv 2412.19437) section 1: 671 B total, 37 B activated,
        # without the 14 B multi-token-prediction module (active: test_rounded_active_counts).
        ("deepseek-v3", 671e9, None, False),
        # Mixtral paper (arXiv 2401.04088) section 2: 46.7 B total, 12.9 B active (13 B).
        ("mixtral-8x7b", 46.7e9, 12.9e9, True),
        # Mixtral 8x22B release: 141 B total, 39 B active.
        ("mixtral-8x22b", 141e9, 39e9, True),
        # Qwen3 report (arXiv 2505.09388) Table 2: 235 B / 22 B, 30.5 B / 3.3 B.
        ("qwen3-235b-a22b", 235e9, 22e9, True),
        ("qwen3-30b-a3b", 30.5e9, None, True),
        # gpt-oss model card Table 1: 116.83 B total, 5.13 B active (no embedding).
        ("gpt-oss-120b", 116.83e9, 5.13e9, False),
    ],
)
def test_moe_presets_match_published_counts(
    name: str, total: float, active: float | None, embedding: bool
) -> None:
    spec = get_preset(name)
    assert spec.num_parameters() == pytest.approx(total, rel=0.01)
    if active is not None:
        assert spec.active_parameters(embedding=embedding) == pytest.approx(active, rel=0.01)


def test_rounded_active_counts() -> None:
    # Two reports give active parameters to two significant digits, and neither says whether
    # the input embedding counts. DeepSeek-V3's "37 B": 36.63 B without the embedding (1.01 %
    # under 37, rounds to 37), 37.55 B with it (1.5 % over). Qwen3-30B-A3B's "3.3 B": 3.353 B
    # with the embedding (truncated to 3.3), 3.04 B without.
    ds = get_preset("deepseek-v3")
    assert round(ds.active_parameters(embedding=False) / 1e9) == 37
    assert ds.active_parameters(embedding=False) == pytest.approx(36.626e9, rel=1e-4)
    assert ds.active_parameters() == pytest.approx(37.552e9, rel=1e-4)
    assert int(get_preset("qwen3-30b-a3b").active_parameters() / 1e8) == 33


def test_qwen3_30b_count_is_exact() -> None:
    # 48 x (q 2048x4096, k,v 2048x512, o 4096x2048, q/k norms 2 x 128, router 2048x128,
    # 128 experts x 3 x 2048 x 768, two norms) + 2 x 151936 x 2048 + final norm:
    # 30,532,122,624, the count keras-hub lists for qwen3_moe_30b_a3b_en.
    assert get_preset("qwen3-30b-a3b").num_parameters() == 30_532_122_624


def test_deepseek_v3_layer_by_hand() -> None:
    s = get_preset("deepseek-v3")
    h, a = 7168, 128
    q = h * 1536 + 1536 + 1536 * a * (128 + 64)
    kv = h * (512 + 64) + 512 + 512 * a * (128 + 128)
    out = a * 128 * h
    attention = q + kv + out
    assert s.attention_parameters() == attention
    expert = 3 * h * 2048
    moe = 256 * expert + expert + h * 256  # routed + 1 shared + router
    assert s.layer_parameters(3) == attention + moe + 2 * h
    assert s.layer_parameters(0) == attention + 3 * h * 18432 + 2 * h
    assert s.active_layer_parameters(3) == attention + 9 * expert + h * 256 + 2 * h
    assert s.num_parameters() == (
        3 * s.layer_parameters(0) + 58 * s.layer_parameters(3) + 2 * 129280 * h + h
    )


def test_gpt_oss_layer_by_hand() -> None:
    s = get_preset("gpt-oss-120b")
    h, d = 2880, 64
    attention = h * (64 + 16) * d + 64 * d * h + (64 + 16) * d + h + 64  # biases, sinks
    expert = 3 * h * 2880 + 2 * 2880 + h  # gate/up + down, with biases
    assert s.attention_parameters() == attention
    assert s.layer_parameters(0) == attention + 128 * expert + h * 128 + 128 + 2 * h
    assert s.is_window_layer(0) and not s.is_window_layer(1)
    assert s.attention_keys(0) == 128 and s.attention_keys(1) == s.seq_len


def test_dense_presets_unchanged_by_the_new_fields() -> None:
    for name in ("llama3-8b", "gpt3-175b", "llama2-70b"):
        spec = get_preset(name)
        assert spec.active_parameters() == spec.num_parameters()
        assert spec.layer_kinds() == [(0, spec.num_layers)]


def test_out_projection_uses_heads_times_head_dim() -> None:
    # Qwen3-235B: 64 heads of 128 = 8192 wide attention in a 4096 model.
    s = get_preset("qwen3-235b-a22b")
    assert s.attention_width == 8192
    assert s.attention_parameters() == 4096 * (64 + 8) * 128 + 8192 * 4096 + 2 * 128


@pytest.mark.parametrize(
    ("fields", "key"),
    [
        ({"num_experts": 8, "moe_top_k": 9}, "model.moe_top_k"),
        ({"num_experts": 8, "capacity_factor": 0.0}, "model.capacity_factor"),
        ({"num_experts": 8, "router": "hash"}, "model.router"),
        ({"num_experts": 8, "load_imbalance": 0.5}, "model.load_imbalance"),
        ({"num_experts": 8, "first_k_dense": 9}, "model.first_k_dense"),
        ({"sliding_window_layers": (0,)}, "model.sliding_window_layers"),
        ({"kv_lora_rank": 64, "qk_nope_head_dim": 0}, "model.qk_nope_head_dim"),
        ({"head_size": 0}, "model.head_size"),
    ],
)
def test_bad_variant_fields_name_the_key(fields: dict[str, object], key: str) -> None:
    base: dict[str, object] = dict(
        name="t", num_layers=8, hidden=64, num_heads=4, ffn_hidden=128, seq_len=32, vocab=100
    )
    base.update(fields)
    with pytest.raises(ConfigError) as info:
        TransformerSpec(**base)  # type: ignore[arg-type]
    assert info.value.key_path == key
