"""Transformer model specs: :class:`TransformerSpec`, a decoder-only transformer as a scenario's
``model:`` gives it (the named presets are :mod:`collsim.workload.presets`).

Derivations, measurements and sources: docs/derivations.md, ``collsim.workload.model``.
"""

from __future__ import annotations

from dataclasses import dataclass

from collsim.core.errors import ConfigError

__all__ = ["TransformerSpec"]

_NORMS = ("layernorm", "rmsnorm")
_POSITIONS = ("learned", "rotary")
_ROUTERS = ("softmax", "sigmoid")


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

    # ---- attention variants ----------------------------------------------------------------
    head_size: int | None = None
    """Explicit head dimension where it is not hidden / num_heads (Qwen3: 128 with hidden
    4096 and 64 heads; GPT-OSS: 64 with hidden 2880); HF ``head_dim``, Megatron
    ``kv_channels``. None: hidden / num_heads."""
    qkv_bias: bool | None = None
    """Biases on the q, k, v projections only (Qwen2); None follows ``bias``."""
    qk_norm: bool = False
    """RMSNorm over each head of q and k (Qwen3): 2 x head_dim parameters per layer."""
    attention_sinks: bool = False
    """A learned sink logit per head (GPT-OSS): num_heads parameters per layer."""
    q_lora_rank: int | None = None
    """MLA (DeepSeek-V2/V3): rank of the query compression (None: q projected directly)."""
    kv_lora_rank: int | None = None
    """MLA: rank of the joint key/value compression; set = multi-head latent attention."""
    qk_nope_head_dim: int = 0
    """MLA: per-head query/key width without rotary embedding."""
    qk_rope_head_dim: int = 0
    """MLA: per-head query/key width with rotary embedding (the key part shared by heads)."""
    v_head_dim: int | None = None
    """MLA: per-head value width (None: qk_nope_head_dim)."""
    sliding_window: int | None = None
    """Sliding-window attention: each query sees the last ``sliding_window`` keys."""
    sliding_window_layers: tuple[int, ...] | None = None
    """The layers that use the window (GPT-OSS: the even ones); None: every layer."""

    # ---- mixture of experts ----------------------------------------------------------------
    num_experts: int = 0
    """Routed experts per MoE layer; 0 = a dense model."""
    moe_top_k: int = 1
    """Routed experts per token."""
    num_shared_experts: int = 0
    """Experts every token goes through (DeepSeek: 1)."""
    moe_ffn_hidden: int | None = None
    """Inner width of one routed expert (None: ffn_hidden)."""
    shared_expert_ffn_hidden: int | None = None
    """Inner width of the shared experts together (None: num_shared_experts x
    moe_ffn_hidden)."""
    first_k_dense: int = 0
    """The first k layers use a dense MLP of ffn_hidden (DeepSeek-V3: 3)."""
    capacity_factor: float | None = None
    """Tokens an expert takes, as a multiple of its balanced share (dropping and padding);
    None = dropless (every routed token is computed)."""
    router: str = "softmax"
    """Router score: ``softmax`` (Mixtral, Qwen3, GPT-OSS) or ``sigmoid`` (DeepSeek-V3)."""
    router_bias: bool = False
    """The router linear carries a bias (GPT-OSS)."""
    load_imbalance: float = 1.0
    """Tokens of the busiest expert rank over the balanced mean (>= 1; 1 = perfect balance)."""

    def __post_init__(self) -> None:
        for key in ("num_layers", "hidden", "num_heads", "ffn_hidden", "seq_len", "vocab"):
            value = getattr(self, key)
            if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
                raise ConfigError(
                    f"must be a positive integer, got {value!r}", key_path=f"model.{key}"
                )
        if self.head_size is None and not self.is_mla and self.hidden % self.num_heads:
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
        self._check_variants()

    def _check_variants(self) -> None:
        def positive(key: str, value: object, allow_none: bool = True) -> None:
            if value is None and allow_none:
                return
            if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
                raise ConfigError(
                    f"must be a positive integer, got {value!r}", key_path=f"model.{key}"
                )

        for key in ("head_size", "q_lora_rank", "kv_lora_rank", "v_head_dim", "sliding_window"):
            positive(key, getattr(self, key))
        if self.is_mla:
            positive("qk_nope_head_dim", self.qk_nope_head_dim, allow_none=False)
            if self.qk_rope_head_dim < 0:
                raise ConfigError(
                    f"must be >= 0, got {self.qk_rope_head_dim}", key_path="model.qk_rope_head_dim"
                )
        if self.sliding_window_layers is not None:
            bad = [i for i in self.sliding_window_layers if not 0 <= i < self.num_layers]
            if bad or self.sliding_window is None:
                raise ConfigError(
                    f"must be layer indices in 0..{self.num_layers - 1} with sliding_window "
                    f"set, got {list(self.sliding_window_layers)[:8]}",
                    key_path="model.sliding_window_layers",
                )
        if self.num_experts < 0:
            raise ConfigError(f"must be >= 0, got {self.num_experts}", key_path="model.num_experts")
        if self.num_experts:
            if not 1 <= self.moe_top_k <= self.num_experts:
                raise ConfigError(
                    f"must be in 1..num_experts ({self.num_experts}), got {self.moe_top_k}",
                    key_path="model.moe_top_k",
                )
            positive("moe_ffn_hidden", self.moe_ffn_hidden)
            positive("shared_expert_ffn_hidden", self.shared_expert_ffn_hidden)
            if self.num_shared_experts < 0:
                raise ConfigError(
                    f"must be >= 0, got {self.num_shared_experts}",
                    key_path="model.num_shared_experts",
                )
            if not 0 <= self.first_k_dense <= self.num_layers:
                raise ConfigError(
                    f"must be in 0..num_layers ({self.num_layers}), got {self.first_k_dense}",
                    key_path="model.first_k_dense",
                )
            if self.capacity_factor is not None and self.capacity_factor <= 0:
                raise ConfigError(
                    f"must be > 0 (or null for dropless), got {self.capacity_factor}",
                    key_path="model.capacity_factor",
                )
            if self.router not in _ROUTERS:
                raise ConfigError(
                    f"must be one of {', '.join(_ROUTERS)}; got {self.router!r}",
                    key_path="model.router",
                )
            if self.load_imbalance < 1.0:
                raise ConfigError(
                    f"must be >= 1 (busiest over mean), got {self.load_imbalance}",
                    key_path="model.load_imbalance",
                )

    # ---- derived sizes -------------------------------------------------------------------
    @property
    def head_dim(self) -> int:
        """The explicit ``head_size`` when given, else hidden / num_heads (not used by MLA)."""
        return self.head_size if self.head_size is not None else self.hidden // self.num_heads

    @property
    def is_mla(self) -> bool:
        """Multi-head latent attention (``kv_lora_rank`` set)."""
        return self.kv_lora_rank is not None

    @property
    def is_moe(self) -> bool:
        """The model has routed experts."""
        return self.num_experts > 0

    @property
    def qk_head_dim(self) -> int:
        """Per-head width of queries and keys (MLA: nope + rope)."""
        return self.qk_nope_head_dim + self.qk_rope_head_dim if self.is_mla else self.head_dim

    @property
    def value_head_dim(self) -> int:
        """Per-head width of values and of the attention output."""
        if self.is_mla:
            return self.v_head_dim if self.v_head_dim is not None else self.qk_nope_head_dim
        return self.head_dim

    @property
    def attention_width(self) -> int:
        """Width of the attention output (num_heads x value_head_dim), the out_proj input."""
        return self.num_heads * self.value_head_dim

    @property
    def expert_ffn_hidden(self) -> int:
        """Inner width of one routed expert."""
        return self.moe_ffn_hidden if self.moe_ffn_hidden is not None else self.ffn_hidden

    @property
    def shared_ffn_hidden(self) -> int:
        """Inner width of the shared experts together (0 without shared experts)."""
        if self.shared_expert_ffn_hidden is not None:
            return self.shared_expert_ffn_hidden if self.num_shared_experts else 0
        return self.num_shared_experts * self.expert_ffn_hidden

    @property
    def num_moe_layers(self) -> int:
        """Layers with routed experts."""
        return self.num_layers - self.first_k_dense if self.is_moe else 0

    def is_moe_layer(self, layer: int | None = None) -> bool:
        """Whether ``layer`` has routed experts; None asks about the most common layer."""
        if not self.is_moe:
            return False
        if layer is None:
            return self.num_moe_layers >= self.num_layers - self.num_moe_layers
        return layer >= self.first_k_dense

    def is_window_layer(self, layer: int | None = None) -> bool:
        """Whether ``layer`` uses sliding-window attention; None asks about the most common
        layer (full attention on a tie, as GPT-OSS's 18 + 18)."""
        if self.sliding_window is None:
            return False
        if self.sliding_window_layers is None:
            return True
        if layer is None:
            return 2 * len(set(self.sliding_window_layers)) > self.num_layers
        return layer in self.sliding_window_layers

    def attention_keys(self, layer: int | None = None) -> int:
        """Keys each query attends to in the model-FLOPs convention (the full s x s matrix):
        seq_len, or min(window, seq_len) for a sliding-window layer."""
        if self.is_window_layer(layer):
            assert self.sliding_window is not None
            return min(self.sliding_window, self.seq_len)
        return self.seq_len

    def layer_kinds(self) -> list[tuple[int, int]]:
        """Distinct layer kinds as (a representative layer index, how many layers are like it):
        layers differ by dense / MoE MLP and by full / windowed attention."""
        kinds: dict[tuple[bool, bool], list[int]] = {}
        for i in range(self.num_layers):
            kinds.setdefault((self.is_moe_layer(i), self.is_window_layer(i)), []).append(i)
        return [(layers[0], len(layers)) for layers in kinds.values()]

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

    def attention_parameters(self) -> int:
        """Parameters of one attention block (without the pre-attention norm).

        GQA/MHA: QKV h x (heads + 2 kv_heads) d, output (heads d) x h, biases when set,
        q/k norms (2 d, Qwen3), sinks (heads, GPT-OSS). MLA (DeepSeek-V2 paper, arXiv
        2405.04434, section 2.1.2; DeepSeek-V3's ``modeling_deepseek.py`` layout): q down
        h x q_lora, its RMSNorm q_lora, q up q_lora x heads (nope + rope) (or h x heads (nope +
        rope) without q compression); kv down h x (kv_lora + rope), its RMSNorm kv_lora, kv up
        kv_lora x heads (nope + v); output heads v x h.
        """
        h, a = self.hidden, self.num_heads
        out = self.attention_width * h
        if self.is_mla:
            assert self.kv_lora_rank is not None
            qk = self.qk_head_dim
            if self.q_lora_rank is not None:
                q = h * self.q_lora_rank + self.q_lora_rank + self.q_lora_rank * a * qk
            else:
                q = h * a * qk
            kv_lora = self.kv_lora_rank
            kv = h * (kv_lora + self.qk_rope_head_dim) + kv_lora
            kv += kv_lora * a * (self.qk_nope_head_dim + self.value_head_dim)
            params = q + kv + out
            if self.bias:
                params += h
            return params
        params = h * self.qkv_width + out
        qkv_bias = self.bias if self.qkv_bias is None else self.qkv_bias
        if qkv_bias:
            params += self.qkv_width
        if self.bias:
            params += h
        if self.qk_norm:
            params += 2 * self.head_dim
        if self.attention_sinks:
            params += a
        return params

    def mlp_parameters_of(self, width: int) -> int:
        """One (gated or plain) MLP of inner ``width``: 3 h f (SwiGLU) or 2 h f, with biases."""
        h = self.hidden
        params = (3 if self.gated_mlp else 2) * h * width
        if self.bias:
            params += (2 * width if self.gated_mlp else width) + h
        return params

    def router_parameters(self) -> int:
        """The router linear h x E (plus E biases with ``router_bias``)."""
        if not self.is_moe:
            return 0
        return self.hidden * self.num_experts + (self.num_experts if self.router_bias else 0)

    def mlp_parameters(self, layer: int | None = None) -> int:
        """Parameters of one layer's MLP: dense, or E routed experts + shared + router."""
        if not self.is_moe_layer(layer):
            return self.mlp_parameters_of(self.ffn_hidden)
        routed = self.num_experts * self.mlp_parameters_of(self.expert_ffn_hidden)
        shared = self.mlp_parameters_of(self.shared_ffn_hidden) if self.shared_ffn_hidden else 0
        return routed + shared + self.router_parameters()

    def expert_parameters(self, layer: int | None = None) -> int:
        """Parameters of the routed experts of one layer (0 for a dense layer)."""
        if not self.is_moe_layer(layer):
            return 0
        return self.num_experts * self.mlp_parameters_of(self.expert_ffn_hidden)

    def layer_parameters(self, layer: int | None = None) -> int:
        """Parameters of one transformer layer (two norms, attention, MLP).

        ``layer`` picks the layer (dense or MoE, full or windowed); None is the most common
        kind (the MoE layer of an MoE model).
        """
        return self.attention_parameters() + self.mlp_parameters(layer) + 2 * self.norm_parameters()

    def active_layer_parameters(self, layer: int | None = None) -> int:
        """Parameters one token goes through in ``layer``: top-k of the routed experts."""
        if not self.is_moe_layer(layer):
            return self.layer_parameters(layer)
        inactive = (self.num_experts - self.moe_top_k) * self.mlp_parameters_of(
            self.expert_ffn_hidden
        )
        return self.layer_parameters(layer) - inactive

    def all_layer_parameters(self) -> int:
        """Parameters of all transformer layers."""
        return sum(self.layer_parameters(i) * n for i, n in self.layer_kinds())

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
        return self.all_layer_parameters() + self.embedding_parameters() + self.head_parameters()

    def active_parameters(self, *, embedding: bool = True) -> int:
        """Parameters one token goes through: every layer with only top-k routed experts, the
        head, and the input embedding unless ``embedding`` is False.

        Reports differ on the embedding: Mixtral (12.9 B) and Qwen3 (22 B, 3.3 B) count it,
        the gpt-oss model card (5.13 B) does not; DeepSeek-V3's 37 B is 36.6 B without it
        and 37.6 B with it.
        """
        layers = sum(self.active_layer_parameters(i) * n for i, n in self.layer_kinds())
        emb = self.embedding_parameters() if embedding else 0
        return layers + emb + self.head_parameters()
