"""Transformer model specs and the named presets (GPT-3, Megatron, Llama-2, Llama-3).

A :class:`TransformerSpec` describes a decoder-only transformer the way Megatron-LM builds it:
``num_layers`` identical layers of (norm, attention, residual, norm, MLP, residual), a token
embedding (plus a learned position embedding for GPT), a final norm and an LM head.

Sources of the presets:

- GPT-3: Brown et al. 2020, "Language Models are Few-Shot Learners", Table 2.1 (vocab 50257,
  context 2048, ffn = 4 x hidden, learned positions, LM head tied to the embedding). Two rows
  of that table are not self-consistent and are fixed here: GPT-3 XL lists 24 heads of 128 for
  d_model 2048 (we use 16 heads of 128); GPT-3 13B lists d_model 5140 (we use 5120 = 40 x 128,
  as every public replication does).
- Megatron: Narayanan et al. 2021 (SC21) Table 1 rows 1.7B / 7.5B / 39.1B and the 530B / 1T
  configurations; Korthikanti et al. 2022 Table 3 (22B: 48 layers, hidden 6144, 64 heads;
  530B: 105 layers, hidden 20480, 128 heads; 1T: 128 layers, hidden 25600, 160 heads).
  Vocab 51200 (GPT-2 BPE padded), seq 2048, ffn = 4 x hidden, tied embedding.
- Llama-2: Touvron et al. 2023 Table 1 and the released configs (RMSNorm, SwiGLU with
  ffn 11008 / 13824 / 28672, GQA with 8 kv heads for 70B, vocab 32000, seq 4096, untied head,
  no biases, rotary positions, no dropout, trained with FlashAttention).
- Llama-3: Llama Team 2024 "The Llama 3 Herd of Models" Table 3 (8B: 32 x 4096, ffn 14336;
  70B: 80 x 8192, ffn 28672; 405B: 126 x 16384, ffn 53248; 8 kv heads; vocab 128256; seq 8192).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

from collsim.errors import ConfigError

__all__ = ["TransformerSpec", "PRESETS", "get_preset", "preset_names"]

_NORMS = ("layernorm", "rmsnorm")
_POSITIONS = ("learned", "rotary")


@dataclass(frozen=True, slots=True, kw_only=True)
class TransformerSpec:
    """A decoder-only transformer.

    Example:
        >>> spec = TransformerSpec(name="tiny", num_layers=2, hidden=64, num_heads=4,
        ...                        ffn_hidden=256, seq_len=128, vocab=1000)
        >>> spec.head_dim
        16
    """

    name: str
    num_layers: int
    hidden: int
    num_heads: int
    ffn_hidden: int
    """Inner MLP width (4 x hidden for GPT; the SwiGLU width for Llama)."""
    seq_len: int
    vocab: int
    num_kv_heads: int | None = None
    """Key/value heads (grouped-query attention); None means num_heads (multi-head attention)."""
    gated_mlp: bool = False
    """SwiGLU MLP: gate and up projections (h -> ffn each), then down (ffn -> h)."""
    norm: str = "layernorm"
    """``layernorm`` (weight and bias) or ``rmsnorm`` (weight only)."""
    bias: bool = True
    """Linear layers carry biases (GPT) or not (Llama)."""
    position_embedding: str = "learned"
    """``learned`` (a seq_len x hidden table, GPT) or ``rotary`` (no parameters, Llama)."""
    tied_embeddings: bool = True
    """LM head shares the token embedding matrix (GPT, Megatron) or has its own (Llama)."""
    dropout: bool = True
    """Dropout after softmax and after the attention and MLP blocks (GPT training) or none."""
    flash_attention: bool = False
    """Core attention as one fused kernel (FlashAttention, Dao 2022/2023): no s x s matrix is
    stored. False is Megatron-LM 2021-22 (separate QK^T, softmax, dropout, AV kernels), the
    setting of the Narayanan and Korthikanti measurements; the Llama presets set True."""

    def __post_init__(self) -> None:
        for key in ("num_layers", "hidden", "num_heads", "ffn_hidden", "seq_len", "vocab"):
            value = getattr(self, key)
            if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
                raise ConfigError(
                    f"must be a positive integer, got {value!r}", key_path=f"model.{key}"
                )
        if self.hidden % self.num_heads:
            raise ConfigError(
                f"hidden ({self.hidden}) must be divisible by num_heads ({self.num_heads})",
                key_path="model.num_heads",
            )
        kv = self.num_kv_heads
        if kv is not None:
            if not isinstance(kv, int) or isinstance(kv, bool) or kv <= 0 or self.num_heads % kv:
                raise ConfigError(
                    f"must be a positive divisor of num_heads ({self.num_heads}), got {kv!r}",
                    key_path="model.num_kv_heads",
                )
        if self.norm not in _NORMS:
            raise ConfigError(
                f"must be one of {', '.join(_NORMS)}; got {self.norm!r}", key_path="model.norm"
            )
        if self.position_embedding not in _POSITIONS:
            raise ConfigError(
                f"must be one of {', '.join(_POSITIONS)}; got {self.position_embedding!r}",
                key_path="model.position_embedding",
            )

    # ---- derived sizes -------------------------------------------------------------------
    @property
    def head_dim(self) -> int:
        """hidden / num_heads."""
        return self.hidden // self.num_heads

    @property
    def kv_heads(self) -> int:
        """Number of key/value heads (num_heads without GQA)."""
        return self.num_kv_heads if self.num_kv_heads is not None else self.num_heads

    @property
    def qkv_width(self) -> int:
        """Output width of the fused QKV projection: (num_heads + 2 kv_heads) x head_dim."""
        return (self.num_heads + 2 * self.kv_heads) * self.head_dim

    def norm_parameters(self) -> int:
        """Parameters of one norm: 2h for LayerNorm (weight, bias), h for RMSNorm."""
        return 2 * self.hidden if self.norm == "layernorm" else self.hidden

    def layer_parameters(self) -> int:
        """Parameters of one transformer layer (two norms, attention, MLP)."""
        h, f = self.hidden, self.ffn_hidden
        attention = h * self.qkv_width + h * h
        mlp = (3 if self.gated_mlp else 2) * h * f
        if self.bias:
            attention += self.qkv_width + h
            mlp += (2 * f if self.gated_mlp else f) + h
        return attention + mlp + 2 * self.norm_parameters()

    def embedding_parameters(self) -> int:
        """Token embedding (vocab x hidden) plus the learned position table if any."""
        positions = self.seq_len * self.hidden if self.position_embedding == "learned" else 0
        return self.vocab * self.hidden + positions

    def head_parameters(self) -> int:
        """Final norm plus the LM head matrix (0 for the matrix when tied to the embedding)."""
        head = 0 if self.tied_embeddings else self.vocab * self.hidden
        return self.norm_parameters() + head

    def num_parameters(self) -> int:
        """Total unique parameters: layers + embedding + final norm + untied LM head."""
        return (
            self.num_layers * self.layer_parameters()
            + self.embedding_parameters()
            + self.head_parameters()
        )


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
