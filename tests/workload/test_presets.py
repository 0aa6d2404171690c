from __future__ import annotations

import dataclasses

import pytest

from collsim.core.errors import ConfigError
from collsim.workload import PRESETS, TransformerSpec, get_preset


@pytest.mark.parametrize(
    ("name", "published"),
    [
        ("gpt3-175b", 175e9),  # Brown 2020 Table 2.1
        ("gpt3-13b", 13.0e9),
        ("gpt3-125m", 125e6),
        ("megatron-530b", 530e9),  # Korthikanti 2022 Table 3
        ("megatron-1t", 1.0e12),
        ("megatron-22b", 22e9),
        ("megatron-39.1b", 39.1e9),  # Narayanan 2021 Table 1
        ("llama2-7b", 6.74e9),  # Llama-2 release: 6,738,415,616
        ("llama2-70b", 68.98e9),
        ("llama3-8b", 8.03e9),  # Llama-3 release: 8,030,261,248
        ("llama3-405b", 405.8e9),
    ],
    ids=str,
)
def test_num_parameters_match_published_totals(name: str, published: float) -> None:
    assert get_preset(name).num_parameters() == pytest.approx(published, rel=0.02)


def test_llama3_8b_count_is_exact() -> None:
    # embeddings 2 x 128256 x 4096, 32 layers of (q,o 4096^2; k,v 4096x1024; 3 x 4096 x 14336;
    # two RMSNorm 4096), final RMSNorm 4096: the released checkpoint has 8,030,261,248.
    assert get_preset("llama3-8b").num_parameters() == 8_030_261_248


def test_gpt_layer_is_12h2_plus_13h() -> None:
    spec = get_preset("gpt3-6.7b")
    h = spec.hidden
    assert spec.layer_parameters() == 12 * h * h + 13 * h


def test_overrides_replace_fields() -> None:
    spec = get_preset("gpt3-175b", num_layers=2, seq_len=1024)
    assert (spec.num_layers, spec.seq_len, spec.hidden) == (2, 1024, 12288)
    assert spec == dataclasses.replace(PRESETS["gpt3-175b"], num_layers=2, seq_len=1024)


def test_unknown_preset_lists_valid_names() -> None:
    with pytest.raises(ConfigError, match="gpt3-175b.*llama3-405b") as info:
        get_preset("gpt-5")
    assert info.value.key_path == "model.preset"


def test_unknown_override_field() -> None:
    with pytest.raises(ConfigError, match="unknown model field 'layers'"):
        get_preset("gpt3-125m", layers=3)


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"num_heads": 7}, "divisible by num_heads"),  # 64 % 7 != 0
        ({"num_kv_heads": 3}, "divisor of num_heads"),  # 4 % 3 != 0
        ({"num_layers": 0}, "positive integer"),
        ({"norm": "batchnorm"}, "layernorm, rmsnorm"),
    ],
    ids=["heads", "kv_heads", "layers", "norm"],
)
def test_invalid_specs(kwargs: dict[str, object], match: str) -> None:
    base: dict[str, object] = dict(
        name="t", num_layers=2, hidden=64, num_heads=4, ffn_hidden=256, seq_len=128, vocab=1000
    )
    base.update(kwargs)
    with pytest.raises(ConfigError, match=match):
        TransformerSpec(**base)  # type: ignore[arg-type]
