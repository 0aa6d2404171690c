"""Model specs from Hugging Face ``config.json`` files.

Derivations, measurements and sources: docs/derivations.md, ``collsim.workload.hf_config``.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from collsim.core.errors import ConfigError
from collsim.core.yamlio import read_input_text
from collsim.workload.model import TransformerSpec

__all__ = ["SUPPORTED_TYPES", "spec_from_hf_config", "spec_from_hf_dict"]

SUPPORTED_TYPES = (
    "llama",
    "mistral",
    "mixtral",
    "qwen2",
    "qwen3",
    "qwen3_moe",
    "deepseek_v3",
    "gpt_oss",
    "gpt2",
    "gpt_neox",
)

_GATED_ACTS = ("silu", "swish")
_PLAIN_ACTS = ("gelu", "gelu_new", "gelu_pytorch_tanh", "gelu_fast", "relu")


class _Fields:
    """Typed reads of a config dict; errors name the field and the file."""

    def __init__(self, data: dict[str, Any], file: str) -> None:
        self.data = data
        self.file = file

    def error(self, field: str, message: str) -> ConfigError:
        return ConfigError(message, key_path=field, file=self.file)

    def int(self, field: str, default: Any = ...) -> Any:
        value = self.data.get(field, default)
        if value is ...:
            raise self.error(field, "missing required field")
        if value is None:
            return None
        if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
            raise self.error(field, f"must be a positive integer, got {value!r}")
        return value

    def bool(self, field: str, default: bool) -> bool:
        value = self.data.get(field, default)
        if value is None:
            return default
        if not isinstance(value, bool):
            raise self.error(field, f"must be true or false, got {value!r}")
        return value

    def number(self, field: str, default: float) -> float:
        value = self.data.get(field, default)
        if value is None:
            return default
        if not isinstance(value, (int, float)) or isinstance(value, bool):
            raise self.error(field, f"must be a number, got {value!r}")
        return float(value)

    def str(self, field: str, default: str) -> str:
        value = self.data.get(field, default)
        if not isinstance(value, str):
            raise self.error(field, f"must be a string, got {value!r}")
        return value


def spec_from_hf_config(
    path: str | Path, *, seq_len: int | None = None, name: str | None = None
) -> TransformerSpec:
    """Read ``path`` (a config.json) into a TransformerSpec.

    Args:
        path: the config file.
        seq_len: training sequence length (default: ``max_position_embeddings``).
        name: the spec name (default: the file's parent directory name).

    Raises:
        ConfigError: missing or unreadable file, invalid JSON, unknown ``model_type``, a
            missing field or one that cannot be mapped (named in the message).
    """

    p = Path(path)
    text = read_input_text(p, what="HF config")
    try:
        data = json.loads(text)
    except json.JSONDecodeError as exc:
        raise ConfigError(f"invalid JSON: {exc.msg}", file=str(p), line=exc.lineno) from None
    if not isinstance(data, dict):
        raise ConfigError("an HF config must be a JSON object", file=str(p))
    return spec_from_hf_dict(
        data, source=str(p), seq_len=seq_len, name=name or p.parent.name or p.stem
    )


def spec_from_hf_dict(
    data: dict[str, Any], *, source: str = "<config>", seq_len: int | None = None, name: str = "hf"
) -> TransformerSpec:
    """Map a parsed config dict (see :func:`spec_from_hf_config`)."""
    f = _Fields(data, source)
    model_type = data.get("model_type")
    if model_type is None:
        raise f.error("model_type", "missing (the architecture of the config)")
    if model_type not in SUPPORTED_TYPES:
        raise f.error(
            "model_type",
            f"unknown architecture {model_type!r}; supported: {', '.join(SUPPORTED_TYPES)}",
        )
    if model_type == "gpt2":
        fields = _gpt2(f)
    elif model_type == "gpt_neox":
        fields = _gpt_neox(f)
    else:
        fields = _llama_like(f, model_type)
    if seq_len is not None:
        fields["seq_len"] = seq_len
    try:
        return TransformerSpec(name=name, **fields)
    except ConfigError as exc:
        raise ConfigError(exc.message, key_path=exc.key_path, file=source) from None


def _gpt2(f: _Fields) -> dict[str, Any]:
    h = f.int("n_embd")
    inner = f.int("n_inner", None)
    act = f.str("activation_function", "gelu_new")
    if act not in _PLAIN_ACTS:
        raise f.error("activation_function", f"unsupported activation {act!r}")
    dropout = any(f.number(k, 0.1) > 0 for k in ("resid_pdrop", "attn_pdrop", "embd_pdrop"))
    return {
        "num_layers": f.int("n_layer"),
        "hidden": h,
        "num_heads": f.int("n_head"),
        "ffn_hidden": inner if inner is not None else 4 * h,
        "seq_len": f.int("n_positions", 1024),
        "vocab": f.int("vocab_size"),
        "tied_embeddings": f.bool("tie_word_embeddings", True),
        "dropout": dropout,
    }


def _gpt_neox(f: _Fields) -> dict[str, Any]:
    act = f.str("hidden_act", "gelu")
    if act not in _PLAIN_ACTS:
        raise f.error("hidden_act", f"unsupported activation {act!r} for gpt_neox")
    dropout = any(f.number(k, 0.0) > 0 for k in ("hidden_dropout", "attention_dropout"))
    return {
        "num_layers": f.int("num_hidden_layers"),
        "hidden": f.int("hidden_size"),
        "num_heads": f.int("num_attention_heads"),
        "ffn_hidden": f.int("intermediate_size"),
        "seq_len": f.int("max_position_embeddings", 2048),
        "vocab": f.int("vocab_size"),
        "bias": f.bool("attention_bias", True),
        "position_embedding": "rotary",
        "tied_embeddings": f.bool("tie_word_embeddings", False),
        "dropout": dropout,
        "flash_attention": True,
    }


def _window_layers(f: _Fields, layers: int, window: int | None) -> tuple[int, ...] | None:
    """Sliding-window layers from ``layer_types`` (None: every layer uses the window)."""
    types = f.data.get("layer_types")
    if types is None:
        return None
    if not isinstance(types, list) or len(types) != layers:
        raise f.error("layer_types", f"must list {layers} layer types, got {types!r}")
    bad = [t for t in types if t not in ("full_attention", "sliding_attention")]
    if bad:
        raise f.error("layer_types", f"unsupported layer type {bad[0]!r}")
    sliding = tuple(i for i, t in enumerate(types) if t == "sliding_attention")
    if sliding and window is None:
        raise f.error("sliding_window", "sliding_attention layers need a sliding_window")
    return sliding


def _llama_like(f: _Fields, model_type: str) -> dict[str, Any]:
    layers = f.int("num_hidden_layers")
    heads = f.int("num_attention_heads")
    out: dict[str, Any] = {
        "num_layers": layers,
        "hidden": f.int("hidden_size"),
        "num_heads": heads,
        "ffn_hidden": f.int("intermediate_size"),
        "seq_len": f.int("max_position_embeddings", 4096),
        "vocab": f.int("vocab_size"),
        "gated_mlp": True,
        "norm": "rmsnorm",
        "bias": False,
        "position_embedding": "rotary",
        "tied_embeddings": f.bool("tie_word_embeddings", False),
        "dropout": f.number("attention_dropout", 0.0) > 0,
        "flash_attention": True,
    }
    act = f.str("hidden_act", "silu")
    if act not in _GATED_ACTS:
        raise f.error("hidden_act", f"unsupported activation {act!r} (a SwiGLU MLP needs silu)")
    kv = f.int("num_key_value_heads", None)
    if model_type != "deepseek_v3":
        if kv is not None and heads % kv:
            raise f.error("num_key_value_heads", f"{kv} must divide num_attention_heads ({heads})")
        out["num_kv_heads"] = kv
        head_dim = f.int("head_dim", None)
        if head_dim is not None and head_dim * heads != out["hidden"]:
            out["head_size"] = head_dim
    if model_type == "llama":
        attn_bias = f.bool("attention_bias", False)
        mlp_bias = f.bool("mlp_bias", False)
        if attn_bias != mlp_bias:
            raise f.error(
                "mlp_bias",
                f"{mlp_bias} differs from attention_bias ({attn_bias}); the spec has one bias "
                "flag for the projections and the MLP",
            )
        out["bias"] = attn_bias
    if model_type in ("mistral", "mixtral"):
        window = f.int("sliding_window", None)
        if window is not None:
            out["sliding_window"] = window
    if model_type in ("qwen2", "qwen3", "qwen3_moe"):
        _qwen_fields(f, model_type, layers, out)
    if model_type in ("mixtral", "gpt_oss"):
        out["num_experts"] = f.int("num_local_experts", 8)
        out["moe_top_k"] = f.int("num_experts_per_tok", 2)
    if model_type == "qwen3_moe":
        _qwen3_moe_fields(f, out)
    if model_type == "gpt_oss":
        _gpt_oss_fields(f, layers, out)
    if model_type == "deepseek_v3":
        _deepseek_v3_fields(f, out)
    return out


def _qwen_fields(f: _Fields, model_type: str, layers: int, out: dict[str, Any]) -> None:
    """Qwen2 / Qwen3 (dense and MoE): q, k, v biases or q / k norms, sliding windows."""
    if model_type == "qwen2":
        out["qkv_bias"] = True
    else:
        out["qk_norm"] = True
        if f.bool("attention_bias", False):
            raise f.error(
                "attention_bias",
                "true puts biases on q, k, v and o but not the MLP, which the spec cannot express",
            )
    if f.bool("use_sliding_window", False):
        window = f.int("sliding_window", 4096)
        out["sliding_window"] = window
        layer_set = _window_layers(f, layers, window)
        if layer_set is None:
            first = f.int("max_window_layers", 28)
            layer_set = tuple(range(min(first, layers), layers))
        out["sliding_window_layers"] = layer_set


def _qwen3_moe_fields(f: _Fields, out: dict[str, Any]) -> None:
    """Qwen3-MoE's experts and its leading dense layers."""
    out["num_experts"] = f.int("num_experts", 128)
    out["moe_top_k"] = f.int("num_experts_per_tok", 8)
    out["moe_ffn_hidden"] = f.int("moe_intermediate_size", 768)
    step = f.int("decoder_sparse_step", 1)
    if step != 1:
        raise f.error("decoder_sparse_step", f"{step}: only every layer sparse (1) maps")
    dense = f.data.get("mlp_only_layers") or []
    if not isinstance(dense, list) or dense != list(range(len(dense))):
        raise f.error(
            "mlp_only_layers",
            f"{dense!r}: only a prefix of dense layers (0, 1, ..., k-1) maps",
        )
    out["first_k_dense"] = len(dense)


def _gpt_oss_fields(f: _Fields, layers: int, out: dict[str, Any]) -> None:
    """gpt-oss: 64-wide heads, biases, attention sinks, alternating sliding windows."""
    out["head_size"] = f.int("head_dim", 64)
    out["bias"] = f.bool("attention_bias", True)
    out["attention_sinks"] = True
    out["router_bias"] = True
    out["moe_ffn_hidden"] = out["ffn_hidden"]
    window = f.int("sliding_window", 128)
    if window is not None:
        types = _window_layers(f, layers, window)
        out["sliding_window"] = window
        # GptOssConfig.__post_init__: sliding on layers where (i + 1) % 2, when not given.
        out["sliding_window_layers"] = types if types is not None else tuple(range(0, layers, 2))


def _deepseek_v3_fields(f: _Fields, out: dict[str, Any]) -> None:
    """DeepSeek-V3: multi-head latent attention and its routed and shared experts."""
    kv_lora = f.int("kv_lora_rank", 512)
    out.update(
        q_lora_rank=f.int("q_lora_rank", 1536),
        kv_lora_rank=kv_lora,
        qk_nope_head_dim=f.int("qk_nope_head_dim", 128),
        qk_rope_head_dim=f.int("qk_rope_head_dim", 64),
        v_head_dim=f.int("v_head_dim", 128),
        num_experts=f.int("n_routed_experts", 256),
        moe_top_k=f.int("num_experts_per_tok", 8),
        num_shared_experts=f.data.get("n_shared_experts") or 0,
        moe_ffn_hidden=f.int("moe_intermediate_size", 2048),
        first_k_dense=f.data.get("first_k_dense_replace") or 0,
        router="sigmoid" if f.str("scoring_func", "sigmoid") == "sigmoid" else "softmax",
    )
    freq = f.int("moe_layer_freq", 1)
    if freq != 1:
        raise f.error("moe_layer_freq", f"{freq}: only every layer after the dense ones maps")
    if f.bool("attention_bias", False):
        raise f.error("attention_bias", "true is not part of the MLA layout mapped here")
