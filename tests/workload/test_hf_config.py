"""HF config.json import: field mapping, counts against the published totals, errors."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest

from collsim.core.errors import ConfigError
from collsim.workload import get_preset
from collsim.workload.hf_config import spec_from_hf_config, spec_from_hf_dict

HF = Path(__file__).parents[1] / "data" / "hf"


@pytest.mark.parametrize(
    ("name", "published"),
    [
        ("deepseek-v3", 671e9),  # DeepSeek-V3 report: 671 B without the MTP module
        ("mixtral-8x7b", 46.7e9),  # Mixtral paper: 46.7 B
        ("qwen3-235b-a22b", 235e9),  # Qwen3 report Table 2
        ("llama3.1-405b", 405e9),  # Llama 3 paper: 405 B
        ("gpt-oss-120b", 116.83e9),  # gpt-oss model card Table 1
    ],
)
def test_hf_counts_match_published_totals(name: str, published: float) -> None:
    spec = spec_from_hf_config(HF / name / "config.json")
    assert spec.num_parameters() == pytest.approx(published, rel=0.01)


@pytest.mark.parametrize(
    ("name", "exact"),
    [
        # Counts of the released checkpoints (sum of numel over the state dict).
        ("gpt2", 124_439_808),
        ("pythia-160m", 162_322_944),
        ("llama2-7b", 6_738_415_616),
        ("mistral-7b", 7_241_732_096),
        ("qwen2-7b", 7_615_616_512),
    ],
)
def test_hf_dense_counts_are_exact(name: str, exact: int) -> None:
    assert spec_from_hf_config(HF / name / "config.json").num_parameters() == exact


@pytest.mark.parametrize(
    ("name", "preset"),
    [
        ("deepseek-v3", "deepseek-v3"),
        ("mixtral-8x7b", "mixtral-8x7b"),
        ("qwen3-235b-a22b", "qwen3-235b-a22b"),
        ("qwen3-30b-a3b", "qwen3-30b-a3b"),
        ("gpt-oss-120b", "gpt-oss-120b"),
        ("llama3.1-405b", "llama3-405b"),
        ("llama2-7b", "llama2-7b"),
    ],
)
def test_hf_config_equals_the_preset(name: str, preset: str) -> None:
    ref = get_preset(preset)
    spec = spec_from_hf_config(HF / name / "config.json", seq_len=ref.seq_len, name=ref.name)
    assert spec == ref


def test_field_mapping_details() -> None:
    ds = spec_from_hf_config(HF / "deepseek-v3" / "config.json")
    assert (ds.first_k_dense, ds.num_shared_experts, ds.router) == (3, 1, "sigmoid")
    assert (ds.q_lora_rank, ds.kv_lora_rank, ds.qk_head_dim, ds.value_head_dim) == (
        1536,
        512,
        192,
        128,
    )
    oss = spec_from_hf_config(HF / "gpt-oss-120b" / "config.json")
    assert oss.sliding_window_layers == tuple(range(0, 36, 2))
    assert oss.head_dim == 64 and oss.attention_sinks and oss.router_bias
    mistral = spec_from_hf_config(HF / "mistral-7b" / "config.json")
    assert mistral.sliding_window == 4096 and mistral.is_window_layer(31)
    qwen2 = spec_from_hf_config(HF / "qwen2-7b" / "config.json")
    assert qwen2.qkv_bias and not qwen2.bias and qwen2.sliding_window is None
    gpt2 = spec_from_hf_config(HF / "gpt2" / "config.json")
    assert (gpt2.ffn_hidden, gpt2.tied_embeddings, gpt2.position_embedding) == (
        3072,
        True,
        "learned",
    )


def test_qwen2_sliding_window_from_max_window_layers() -> None:
    data = json.loads((HF / "qwen2-7b" / "config.json").read_text())
    data.update(use_sliding_window=True, sliding_window=4096, max_window_layers=20)
    spec = spec_from_hf_dict(data)
    assert spec.sliding_window_layers == tuple(range(20, 28))


@pytest.mark.parametrize(
    ("path", "field", "match"),
    [
        ("bad/bert.json", "model_type", "unknown architecture 'bert'"),
        ("bad/qwen3_moe_mlp_only.json", "mlp_only_layers", "only a prefix"),
    ],
)
def test_unmappable_configs_name_the_field(path: str, field: str, match: str) -> None:
    with pytest.raises(ConfigError, match=match) as info:
        spec_from_hf_config(HF / path)
    assert info.value.key_path == field
    assert str(HF / path) in str(info.value) and "\n" not in str(info.value)


@pytest.mark.parametrize(
    ("change", "field"),
    [
        ({"decoder_sparse_step": 2}, "decoder_sparse_step"),
        ({"hidden_act": "relu"}, "hidden_act"),
        ({"num_key_value_heads": 5}, "num_key_value_heads"),
        ({"hidden_size": None}, "hidden_size"),
        ({"model_type": None}, "model_type"),
    ],
)
def test_bad_fields(change: dict[str, object], field: str) -> None:
    data = json.loads((HF / "qwen3-30b-a3b" / "config.json").read_text())
    for k, v in change.items():
        if v is None:
            data.pop(k)
        else:
            data[k] = v
    with pytest.raises(ConfigError) as info:
        spec_from_hf_dict(data, source="x.json")
    assert info.value.key_path == field


def test_llama_mixed_biases_rejected() -> None:
    data = json.loads((HF / "llama2-7b" / "config.json").read_text())
    data["mlp_bias"] = True
    with pytest.raises(ConfigError, match="differs from attention_bias") as info:
        spec_from_hf_dict(data)
    assert info.value.key_path == "mlp_bias"


def test_overrides_keep_the_rest() -> None:
    spec = spec_from_hf_config(HF / "mixtral-8x7b" / "config.json", seq_len=4096)
    assert dataclasses.replace(spec, seq_len=32768) == dataclasses.replace(
        get_preset("mixtral-8x7b"), name=spec.name
    )
