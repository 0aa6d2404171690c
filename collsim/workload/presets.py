"""The named model presets (GPT-3, Megatron-LM, Llama-2 and -3, and the recent open models
DeepSeek-V3, Mixtral, Qwen3, gpt-oss), each a :class:`~collsim.workload.model.TransformerSpec`
with its source, and :func:`get_preset`, which scenarios' ``model.preset`` reads (sources:
docs/derivations.md, ``collsim.workload.model``).
"""

from __future__ import annotations

import dataclasses
from typing import Any

from collsim.core.errors import ConfigError
from collsim.workload.model import TransformerSpec

__all__ = ["PRESETS", "get_preset", "preset_names"]


def _gpt3(name: str, layers: int, hidden: int, heads: int) -> TransformerSpec:
    return TransformerSpec(
        name=name,
        num_layers=layers,
        hidden=hidden,
        num_heads=heads,
        ffn_hidden=4 * hidden,
        seq_len=2048,
        vocab=50257,
    )


def _megatron(name: str, layers: int, hidden: int, heads: int) -> TransformerSpec:
    return TransformerSpec(
        name=name,
        num_layers=layers,
        hidden=hidden,
        num_heads=heads,
        ffn_hidden=4 * hidden,
        seq_len=2048,
        vocab=51200,
    )


def _llama(
    name: str, layers: int, hidden: int, heads: int, kv_heads: int, ffn: int, vocab: int, seq: int
) -> TransformerSpec:
    return TransformerSpec(
        name=name,
        num_layers=layers,
        hidden=hidden,
        num_heads=heads,
        num_kv_heads=kv_heads,
        ffn_hidden=ffn,
        seq_len=seq,
        vocab=vocab,
        gated_mlp=True,
        norm="rmsnorm",
        bias=False,
        position_embedding="rotary",
        tied_embeddings=False,
        dropout=False,
        flash_attention=True,
    )


def _modern(name: str, **fields: Any) -> TransformerSpec:
    """A Llama-style decoder (RMSNorm, SwiGLU, rotary, no biases, untied head, no dropout,
    FlashAttention) with the given fields."""
    base: dict[str, Any] = {
        "gated_mlp": True,
        "norm": "rmsnorm",
        "bias": False,
        "position_embedding": "rotary",
        "tied_embeddings": False,
        "dropout": False,
        "flash_attention": True,
    }
    base.update(fields)
    return TransformerSpec(name=name, **base)


_MODERN = [
    # DeepSeek-V3 report (arXiv 2412.19437) section 4.2; DeepseekV3Config (transformers 5.24.0).
    # seq 4096: the pre-training sequence length of section 4.2.
    _modern(
        "deepseek-v3",
        num_layers=61,
        hidden=7168,
        num_heads=128,
        ffn_hidden=18432,
        seq_len=4096,
        vocab=129280,
        q_lora_rank=1536,
        kv_lora_rank=512,
        qk_nope_head_dim=128,
        qk_rope_head_dim=64,
        v_head_dim=128,
        num_experts=256,
        moe_top_k=8,
        num_shared_experts=1,
        moe_ffn_hidden=2048,
        first_k_dense=3,
        router="sigmoid",
    ),
    # Mixtral of Experts (arXiv 2401.04088) Table 1; MixtralConfig (num_local_experts 8,
    # num_experts_per_tok 2); context 32768 (section 2).
    _modern(
        "mixtral-8x7b",
        num_layers=32,
        hidden=4096,
        num_heads=32,
        num_kv_heads=8,
        ffn_hidden=14336,
        seq_len=32768,
        vocab=32000,
        num_experts=8,
        moe_top_k=2,
    ),
    _modern(
        "mixtral-8x22b",
        num_layers=56,
        hidden=6144,
        num_heads=48,
        num_kv_heads=8,
        ffn_hidden=16384,
        seq_len=65536,
        vocab=32000,
        num_experts=8,
        moe_top_k=2,
    ),
    # Qwen3 report (arXiv 2505.09388) Table 2; Qwen3MoeConfig field names. seq 4096: the
    # general pre-training stage (section 3.2).
    _modern(
        "qwen3-30b-a3b",
        num_layers=48,
        hidden=2048,
        num_heads=32,
        num_kv_heads=4,
        head_size=128,
        qk_norm=True,
        ffn_hidden=6144,
        seq_len=4096,
        vocab=151936,
        num_experts=128,
        moe_top_k=8,
        moe_ffn_hidden=768,
    ),
    _modern(
        "qwen3-235b-a22b",
        num_layers=94,
        hidden=4096,
        num_heads=64,
        num_kv_heads=4,
        head_size=128,
        qk_norm=True,
        ffn_hidden=12288,
        seq_len=4096,
        vocab=151936,
        num_experts=128,
        moe_top_k=8,
        moe_ffn_hidden=1536,
    ),
    # gpt-oss model card; GptOssConfig defaults (transformers 5.24.0): layer_types sliding on
    # even layers ("sliding_attention" if (i + 1) % 2), window 128; attention_bias true (the
    # experts carry biases too, the router as well). seq 4096: initial_context_length.
    _modern(
        "gpt-oss-120b",
        num_layers=36,
        hidden=2880,
        num_heads=64,
        num_kv_heads=8,
        head_size=64,
        ffn_hidden=2880,
        seq_len=4096,
        vocab=201088,
        bias=True,
        attention_sinks=True,
        sliding_window=128,
        sliding_window_layers=tuple(range(0, 36, 2)),
        num_experts=128,
        moe_top_k=4,
        moe_ffn_hidden=2880,
        router_bias=True,
    ),
]


_ALL = [
    # GPT-3, Brown et al. 2020 Table 2.1
    _gpt3("gpt3-125m", 12, 768, 12),
    _gpt3("gpt3-350m", 24, 1024, 16),
    _gpt3("gpt3-760m", 24, 1536, 16),
    _gpt3("gpt3-1.3b", 24, 2048, 16),  # table: 24 heads of 128, inconsistent with 2048
    _gpt3("gpt3-2.7b", 32, 2560, 32),
    _gpt3("gpt3-6.7b", 32, 4096, 32),
    _gpt3("gpt3-13b", 40, 5120, 40),  # table: d_model 5140, not divisible by 40
    _gpt3("gpt3-175b", 96, 12288, 96),
    # Megatron-LM, Narayanan 2021 Table 1 and Korthikanti 2022 Table 3
    _megatron("megatron-1.7b", 24, 2304, 24),
    _megatron("megatron-7.5b", 36, 4096, 32),
    _megatron("megatron-22b", 48, 6144, 64),
    _megatron("megatron-39.1b", 48, 8192, 64),
    _megatron("megatron-175b", 96, 12288, 96),
    _megatron("megatron-530b", 105, 20480, 128),
    _megatron("megatron-1t", 128, 25600, 160),
    # Llama-2 (Touvron 2023) and Llama-3 (Llama Team 2024)
    _llama("llama2-7b", 32, 4096, 32, 32, 11008, 32000, 4096),
    _llama("llama2-13b", 40, 5120, 40, 40, 13824, 32000, 4096),
    _llama("llama2-70b", 80, 8192, 64, 8, 28672, 32000, 4096),
    _llama("llama3-8b", 32, 4096, 32, 8, 14336, 128256, 8192),
    _llama("llama3-70b", 80, 8192, 64, 8, 28672, 128256, 8192),
    _llama("llama3-405b", 126, 16384, 128, 8, 53248, 128256, 8192),
    *_MODERN,
]


PRESETS: dict[str, TransformerSpec] = {spec.name: spec for spec in _ALL}
"""Named model presets, keyed by name (``gpt3-175b``, ``megatron-22b``, ``llama3-8b``, ...)."""


def preset_names() -> list[str]:
    """The valid preset names, in catalogue order."""
    return list(PRESETS)


def get_preset(name: str, **overrides: Any) -> TransformerSpec:
    """A preset by name, with explicit fields replacing the preset's (``dataclasses.replace``).

    Overrides replace fields one by one and derive nothing: overriding ``hidden`` keeps the
    preset's ``ffn_hidden``, so give both when you change the width.

    Args:
        name: a key of :data:`PRESETS` (case-insensitive).
        **overrides: TransformerSpec fields to replace, e.g. ``num_layers=2``.

    Raises:
        ConfigError: unknown preset (the message lists the valid names) or unknown field.

    Example:
        >>> get_preset("gpt3-175b", num_layers=2).num_layers
        2
    """
    key = str(name).strip().lower()
    if key not in PRESETS:
        raise ConfigError(
            f"unknown model preset {name!r}; valid presets: {', '.join(PRESETS)}",
            key_path="model.preset",
        )
    spec = PRESETS[key]
    if not overrides:
        return spec
    fields = {f.name for f in dataclasses.fields(TransformerSpec)}
    for key_name in overrides:
        if key_name not in fields:
            raise ConfigError(
                f"unknown model field {key_name!r}; valid fields: {', '.join(sorted(fields))}",
                key_path=f"model.{key_name}",
            )
    return dataclasses.replace(spec, **overrides)
