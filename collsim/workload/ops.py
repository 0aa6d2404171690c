"""The ops of a transformer layer, the embedding and the LM head: FLOPs, bytes, saved tensors.

Device-independent accounting for ONE rank of a Megatron-style tensor-parallel group of size t
(Shoeybi et al. 2019; Korthikanti et al. 2022):

- QKV projection and MLP up (and gate) are column-parallel: each rank owns heads/t heads and
  ffn/t columns; the attention output projection and MLP down are row-parallel (input split by
  t, output a partial sum that the tp all-reduce, or reduce-scatter with sequence parallelism,
  completes: that communication is not in here, see ``collsim.parallel``).
- Norms, dropouts and residual adds run on the whole sequence on every rank, or on s/t of it with
  sequence parallelism (SP).
- Element-wise ops move bytes, matmuls move bytes and do FLOPs; every matmul is listed as GEMMs
  ``C[m, n] = A[m, k] B[k, n]`` (``batch`` of them) so that the compute model can judge the shape.
- Backward of a matmul is two GEMMs of the same FLOPs (dA = dC B^T, dB = A^T dC), so 2x the
  forward FLOPs; backward of an element-wise op moves 2x its forward bytes.
- Activation memory: each op lists the tensors it keeps for backward, in the dtype's element
  size ``e`` (``e`` = 2 for bf16/fp16, Korthikanti's setting) and 1 byte per dropout mask
  element. Summed over a GPT layer (ffn = 4h, multi-head attention, dropout) these give exactly
  Korthikanti's sbh(34 + 5as/h) and its TP / SP / recompute variants, which the tests check.

Fused kernels as Megatron-LM runs them: scale + mask + softmax is one op; the bias adds live in
the GEMM epilogues; the SwiGLU gate and up projections are one GEMM of width 2 ffn / t; the
dropout after each block and the residual add are one bias-dropout-add op.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from collsim.core.errors import ConfigError
from collsim.core.vocab import Dtype, OpKind, RecomputeMode, parse_enum
from collsim.workload.model import TransformerSpec

__all__ = [
    "OpKind",
    "Gemm",
    "Op",
    "activation_element_bytes",
    "layer_ops",
    "embedding_ops",
    "head_ops",
    "SELECTIVE_OPS",
    "SELECTIVE_TENSORS",
    "parse_recompute",
    "kept_bytes",
    "OP_NAMES",
    "FLOPS_PER_ELEMENT",
    "elementwise_op",
    "variant_layer_ops",
    "routed_rows",
    "attended_keys",
]


SELECTIVE_OPS = ("attn_scores", "softmax", "attn_dropout", "attn_values")
"""Ops re-run in backward with selective recompute: QK^T, softmax, its dropout, attention over V."""

OP_NAMES = (
    "attn_norm",
    "qkv_proj",
    "rotary",
    "attn_scores",
    "softmax",
    "attn_dropout",
    "attn_values",
    "flash_attention",
    "out_proj",
    "attn_dropout_add",
    "attn_residual_add",
    "mlp_norm",
    "mlp_up",
    "activation",
    "mlp_down",
    "mlp_dropout_add",
    "mlp_residual_add",
    "embedding",
    "position_add",
    "embedding_dropout",
    "final_norm",
    "lm_head",
    "loss",
    # multi-head latent attention (DeepSeek-V2/V3)
    "q_down",
    "q_norm",
    "q_up",
    "kv_down",
    "kv_norm",
    "kv_up",
    # mixture of experts
    "router",
    "router_topk",
    "moe_permute",
    "expert_up",
    "expert_activation",
    "expert_down",
    "moe_unpermute",
    "shared_up",
    "shared_activation",
    "shared_down",
)
"""Every op name the layer, embedding and head can contain (keys of time overrides)."""

SELECTIVE_TENSORS = ("softmax.output", "attn_dropout.mask", "attn_dropout.output")
"""Tensors selective recompute does not keep (the 5as^2b term); Q, K, V stay as its inputs."""

FLOPS_PER_ELEMENT = {
    "norm": 5.0,
    "softmax": 5.0,
    "dropout": 3.0,
    "add": 1.0,
    "gelu": 8.0,
    "swiglu": 6.0,
    "rotary": 3.0,
    "embedding": 0.0,
    "loss": 5.0,
}


def activation_element_bytes(dtype: str) -> int:
    """Bytes per stored activation element: 2 for bf16/fp16, 4 for fp32.

    fp8 training (Transformer Engine style) runs the GEMMs in fp8 but keeps activations in bf16,
    so fp8 stores 2 bytes per element here (:attr:`collsim.core.vocab.Dtype.activation_dtype`).

    Raises:
        ConfigError: unknown dtype.
    """
    return parse_enum(Dtype, dtype, key_path="training.dtype").activation_dtype.size_bytes


@dataclass(frozen=True, slots=True)
class Gemm:
    """``batch`` independent GEMMs C[m, n] = A[m, k] @ B[k, n]."""

    m: int
    n: int
    k: int
    batch: int = 1

    @property
    def flops(self) -> float:
        return 2.0 * self.batch * self.m * self.n * self.k

    def bytes(self, element_bytes: int) -> float:
        """Minimum traffic: read A and B once, write C once."""
        return float(
            element_bytes * self.batch * (self.m * self.k + self.k * self.n + self.m * self.n)
        )

    def backward(self) -> tuple[Gemm, Gemm]:
        """dA[m, k] = dC[m, n] B^T[n, k] and dB[k, n] = A^T[k, m] dC[m, n]."""
        return (Gemm(self.m, self.k, self.n, self.batch), Gemm(self.k, self.n, self.m, self.batch))


@dataclass(frozen=True, slots=True, kw_only=True)
class Op:
    """One op of the forward pass on one rank, with what its backward costs.

    Attributes:
        name: stable op name (``qkv_proj``, ``softmax``, ...); keys of time overrides.
        kind: matmul or element-wise.
        gemms: the forward GEMMs (matmul ops only).
        flops: forward FLOPs.
        size_bytes: forward memory traffic in bytes.
        backward_gemms: the backward GEMMs (matmul ops only).
        backward_flops: backward FLOPs (2x forward).
        backward_bytes: backward memory traffic in bytes.
        saved: tensors kept from forward to backward with no recompute, name -> bytes.
    """

    name: str
    kind: OpKind
    flops: float
    size_bytes: float
    backward_flops: float
    backward_bytes: float
    gemms: tuple[Gemm, ...] = ()
    backward_gemms: tuple[Gemm, ...] = ()
    saved: dict[str, float] = field(default_factory=dict)
    weight_gradient: bool = False
    """A linear with a weight: the second backward GEMM (dB) is its weight gradient."""

    @property
    def saved_bytes(self) -> float:
        return float(sum(self.saved.values()))


def _matmul(name: str, gemm: Gemm, e: int, saved: dict[str, float]) -> Op:
    back = gemm.backward()
    return Op(
        name=name,
        kind=OpKind.MATMUL,
        gemms=(gemm,),
        flops=gemm.flops,
        size_bytes=gemm.bytes(e),
        backward_gemms=back,
        backward_flops=sum(g.flops for g in back),
        backward_bytes=sum(g.bytes(e) for g in back),
        saved=saved,
        weight_gradient=True,
    )


def _elementwise(
    name: str, kind: str, elements: float, size_bytes: float, saved: dict[str, float]
) -> Op:
    flops = FLOPS_PER_ELEMENT[kind] * elements
    return Op(
        name=name,
        kind=OpKind.ELEMENTWISE,
        flops=flops,
        size_bytes=size_bytes,
        backward_flops=2.0 * flops,
        backward_bytes=2.0 * size_bytes,
        saved=saved,
    )


def elementwise_op(name: str, kind: str, elements: float, size_bytes: float) -> Op:
    """One element-wise op of ``kind`` (a key of :data:`FLOPS_PER_ELEMENT`) over ``elements``
    moving ``size_bytes``, as the layer's op list builds it (backward: twice the FLOPs and
    bytes); nothing saved for backward."""
    return _elementwise(name, kind, elements, size_bytes, {})


def _residual(block: str, dropout: bool, elements: float, e: int) -> Op:
    """The block output's dropout and residual add: Megatron's fused bias-dropout-add kernel
    reads the block output and the residual, writes the sum and a 1-byte mask (3e + 1 bytes
    per element); without dropout a plain residual add (3e)."""
    if dropout:
        return _elementwise(
            f"{block}_dropout_add",
            "dropout",
            elements,
            (3 * e + 1) * elements,
            {f"{block}_dropout_add.mask": elements},
        )
    return _elementwise(f"{block}_residual_add", "add", elements, 3 * e * elements, {})


def _check_tp(spec: TransformerSpec, tp: int) -> None:
    if not isinstance(tp, int) or tp <= 0:
        raise ConfigError(f"must be a positive integer, got {tp!r}", key_path="parallel.tp")
    if spec.num_heads % tp:
        raise ConfigError(
            f"num_heads ({spec.num_heads}) must be divisible by tp ({tp})", key_path="parallel.tp"
        )
    if spec.ffn_hidden % tp:
        raise ConfigError(
            f"ffn_hidden ({spec.ffn_hidden}) must be divisible by tp ({tp})", key_path="parallel.tp"
        )


def layer_ops(
    spec: TransformerSpec,
    *,
    micro_batch: int,
    tp: int = 1,
    sequence_parallel: bool = False,
    dtype: str = "bf16",
    layer: int | None = None,
    ep: int = 1,
    etp: int = 1,
    cp: int = 1,
) -> list[Op]:
    """The forward ops of one transformer layer on one tensor-parallel rank, in order.

    Args:
        spec: the model.
        micro_batch: sequences per micro-batch (b).
        tp: tensor-parallel size (t); heads and ffn must be divisible by it.
        sequence_parallel: norms, dropouts and residual adds run on s/t tokens.
        dtype: compute dtype; sets the activation element size (see activation_element_bytes).
        layer: which layer (dense or MoE MLP, full or windowed attention); None is the most
            common kind. Ignored for a dense model with full attention.
        ep: expert-parallel size (E / ep experts per rank); MoE layers only.
        etp: expert tensor-parallel size (each expert's width / etp); MoE layers only.
        cp: context-parallel size (s / cp query tokens per rank, keys over the whole s).

    Returns:
        Ops with FLOPs, bytes and the tensors each keeps for backward (no recompute).
    """
    if spec.is_moe or spec.is_mla or spec.sliding_window is not None or cp != 1:
        return variant_layer_ops(
            spec,
            micro_batch=micro_batch,
            tp=tp,
            sequence_parallel=sequence_parallel,
            dtype=dtype,
            layer=layer,
            ep=ep,
            etp=etp,
            cp=cp,
        )
    _check_tp(spec, tp)
    if micro_batch <= 0:
        raise ConfigError(f"must be > 0, got {micro_batch}", key_path="training.micro_batch")
    e = activation_element_bytes(dtype)
    b, s, h, d = micro_batch, spec.seq_len, spec.hidden, spec.head_dim
    tokens = b * s
    sp_div = tp if sequence_parallel else 1
    ew = tokens * h / sp_div  # elements of an SP-region tensor
    heads = spec.num_heads // tp
    kv_heads = math.ceil(spec.kv_heads / tp)  # kv heads are replicated when tp > kv
    ffn = spec.ffn_hidden // tp
    norm_flops = "norm"

    ops: list[Op] = []
    ops.append(_elementwise("attn_norm", norm_flops, ew, 2 * e * ew, {"attn_norm.input": e * ew}))
    ops.append(
        _matmul(
            "qkv_proj",
            Gemm(tokens, (heads + 2 * kv_heads) * d, h),
            e,
            {"qkv_proj.input": e * tokens * h / sp_div},
        )
    )
    if spec.position_embedding == "rotary":
        qk = tokens * (heads + kv_heads) * d
        ops.append(_elementwise("rotary", "rotary", qk, 2 * e * qk, {}))
    if spec.flash_attention:
        ops.append(_flash_attention(b, s, d, heads, kv_heads, e))
    else:
        ops += _core_attention(b, s, d, heads, kv_heads, e, spec.dropout)
    ops.append(
        _matmul(
            "out_proj", Gemm(tokens, h, heads * d), e, {"out_proj.input": e * tokens * heads * d}
        )
    )
    ops.append(_residual("attn", spec.dropout, ew, e))
    ops.append(_elementwise("mlp_norm", norm_flops, ew, 2 * e * ew, {"mlp_norm.input": e * ew}))
    width = 2 * ffn if spec.gated_mlp else ffn
    ops.append(
        _matmul("mlp_up", Gemm(tokens, width, h), e, {"mlp_up.input": e * tokens * h / sp_div})
    )
    act = float(tokens * ffn)
    if spec.gated_mlp:
        ops.append(
            _elementwise(
                "activation", "swiglu", act, 3 * e * act, {"activation.input": 2 * e * act}
            )
        )
    else:
        ops.append(
            _elementwise("activation", "gelu", act, 2 * e * act, {"activation.input": e * act})
        )
    ops.append(_matmul("mlp_down", Gemm(tokens, h, ffn), e, {"mlp_down.input": e * act}))
    ops.append(_residual("mlp", spec.dropout, ew, e))
    return ops


def _core_attention(
    b: int, s: int, d: int, heads: int, kv_heads: int, e: int, dropout: bool
) -> list[Op]:
    """Unfused core attention (Megatron-LM 2021-22): QK^T, softmax, dropout, AV kernels."""
    tokens = b * s
    probs = float(b * heads * s * s)
    out: list[Op] = []
    scores = Gemm(s, s, d, b * heads)
    scores_bytes = e * (b * heads * s * d + b * kv_heads * s * d + probs)
    out.append(
        Op(
            name="attn_scores",
            kind=OpKind.MATMUL,
            gemms=(scores,),
            flops=scores.flops,
            size_bytes=scores_bytes,
            backward_gemms=scores.backward(),
            backward_flops=2 * scores.flops,
            backward_bytes=2 * scores_bytes,
            saved={"q": e * tokens * heads * d, "k": e * tokens * kv_heads * d},
        )
    )
    out.append(
        _elementwise("softmax", "softmax", probs, 2 * e * probs, {"softmax.output": e * probs})
    )
    values_saved: dict[str, float] = {"v": e * tokens * kv_heads * d}
    if dropout:
        out.append(
            _elementwise(
                "attn_dropout", "dropout", probs, (2 * e + 1) * probs, {"attn_dropout.mask": probs}
            )
        )
        values_saved["attn_dropout.output"] = e * probs
    values = Gemm(s, d, s, b * heads)
    values_bytes = e * (probs + b * kv_heads * s * d + b * heads * s * d)
    out.append(
        Op(
            name="attn_values",
            kind=OpKind.MATMUL,
            gemms=(values,),
            flops=values.flops,
            size_bytes=values_bytes,
            backward_gemms=values.backward(),
            backward_flops=2 * values.flops,
            backward_bytes=2 * values_bytes,
            saved=values_saved,
        )
    )
    return out


FLASH_CAUSAL_FRACTION = 0.5
"""Share of the s x s blocks a causal FlashAttention kernel computes (it skips the rest)."""


def _flash_attention(b: int, s: int, d: int, heads: int, kv_heads: int, e: int) -> Op:
    """Fused causal attention (FlashAttention-2, Dao 2023) on one rank.

    FLOPs are the ones executed: forward 4 b s^2 d heads x 1/2 (QK^T and AV over the causal
    half); backward 2.5 x forward (dV, dP, dQ, dK plus QK^T recomputed in the kernel).
    Bytes: forward reads q, k, v and writes o; backward reads q, k, v, o, do and writes dq,
    dk, dv. Keeps q, k, v and the fp32 log-sum-exp (o is the saved input of out_proj).
    """
    tokens = b * s
    flops = 4.0 * b * heads * s * s * d * FLASH_CAUSAL_FRACTION
    q = float(tokens * heads * d)
    kv = float(tokens * kv_heads * d)
    lse = 4.0 * b * heads * s
    return Op(
        name="flash_attention",
        kind=OpKind.FUSED_ATTENTION,
        flops=flops,
        size_bytes=e * (2 * q + 2 * kv) + lse,
        backward_flops=2.5 * flops,
        backward_bytes=e * (4 * q + 4 * kv) + lse,
        gemms=(Gemm(s, s, d, b * heads),),
        saved={"q": e * q, "k": e * kv, "v": e * kv, "flash_attention.lse": lse},
    )


# ---- MoE, MLA, sliding-window and context-parallel layers ------------------------------------


def attended_keys(seq_len: int, window: int | None, *, causal: bool) -> float:
    """Mean keys one query attends to.

    Model-FLOPs convention (``causal`` False, the s x s matrix as Narayanan counts it): s, or
    min(w, s) with a window. Executed by a causal kernel (``causal`` True): s x
    :data:`FLASH_CAUSAL_FRACTION` (the causal half), or with a window w <= s the mean of
    min(i + 1, w) over query positions i = 0..s-1, which is w - w (w - 1) / (2 s)
    (the first w - 1 queries see i + 1 keys, the others w).
    """
    if window is None or window >= seq_len:
        return seq_len * FLASH_CAUSAL_FRACTION if causal else float(seq_len)
    if not causal:
        return float(window)
    return window - window * (window - 1) / (2.0 * seq_len)


def routed_rows(spec: TransformerSpec, tokens: float, *, etp: int = 1) -> float:
    """Token-expert rows one rank's experts compute in one MoE layer.

    Each of the ``tokens`` tokens of a rank picks top-k experts; under balanced routing the E
    / ep experts of a rank receive k x tokens rows from the ep ranks of its group (ep x tokens x
    k x (1/ep)), and an expert-tensor-parallel group of etp ranks computes the rows of all its
    etp members (Megatron-Core gathers them over the etp group). Dropless: x
    ``load_imbalance`` (the busiest rank sets the pace). With a capacity factor c every expert
    is padded to c times its balanced share (Megatron's ``--moe-pad-expert-input-to-capacity``),
    so the rank computes c x k x tokens x etp rows.
    """
    factor = spec.capacity_factor if spec.capacity_factor is not None else spec.load_imbalance
    return tokens * spec.moe_top_k * etp * factor


def _check_variant(spec: TransformerSpec, tp: int, ep: int, etp: int, cp: int) -> None:
    _check_tp(spec, tp)
    for key, value in (("ep", ep), ("etp", etp), ("cp", cp)):
        if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
            raise ConfigError(
                f"must be a positive integer, got {value!r}", key_path=f"parallel.{key}"
            )
    if spec.is_moe and spec.num_experts % ep:
        raise ConfigError(
            f"model experts ({spec.num_experts}) must be divisible by ep, got {ep}",
            key_path="parallel.ep",
        )
    if spec.is_moe and spec.expert_ffn_hidden % etp:
        raise ConfigError(
            f"expert ffn ({spec.expert_ffn_hidden}) must be divisible by etp, got {etp}",
            key_path="parallel.etp",
        )
    if spec.seq_len % cp:
        raise ConfigError(
            f"seq_len ({spec.seq_len}) must be divisible by cp, got {cp}", key_path="parallel.cp"
        )


def variant_layer_ops(
    spec: TransformerSpec,
    *,
    micro_batch: int,
    tp: int = 1,
    sequence_parallel: bool = False,
    dtype: str = "bf16",
    layer: int | None = None,
    ep: int = 1,
    etp: int = 1,
    cp: int = 1,
) -> list[Op]:
    """The forward ops of one layer of an MoE, MLA, sliding-window or context-parallel model
    on one rank (see :func:`layer_ops` for the arguments).

    Attention: GQA as in :func:`layer_ops`; MLA (DeepSeek-V2, arXiv 2405.04434, section 2.1)
    as q down (h -> q_lora, replicated over TP as Megatron-Core's duplicated linears), q norm,
    q up (q_lora -> heads (nope + rope) / t), kv down (h -> kv_lora + rope, replicated), kv
    norm, kv up (kv_lora -> heads (nope + v) / t), rotary on the rope parts, attention with
    q/k width nope + rope and v width v_head, out (heads v / t -> h). Sliding-window layers
    attend to ``sliding_window`` keys (:func:`attended_keys`). With CP a rank holds s / cp
    query tokens (two chunks of s / (2 cp) with causal load balancing, so every rank does the
    same work) and attends over keys of the whole sequence; the KV exchange is in
    :mod:`collsim.parallel.context`.

    MoE MLP (Megatron-Core ``MoELayer`` with the all-to-all dispatcher): router h -> E on the
    rank's tokens (replicated weights), top-k selection, permute into expert order, the
    grouped expert GEMMs (E / ep local experts, each of width f_e / etp, on the rows of
    :func:`routed_rows`), unpermute (the weighted sum of each token's k rows), and the shared
    experts as a dense TP-split MLP. The EP all-to-alls are in :mod:`collsim.parallel.moe`.
    """
    _check_variant(spec, tp, ep, etp, cp)
    if micro_batch <= 0:
        raise ConfigError(f"must be > 0, got {micro_batch}", key_path="training.micro_batch")
    e = activation_element_bytes(dtype)
    b, h = micro_batch, spec.hidden
    s_local = spec.seq_len // cp
    tokens = b * s_local
    sp_div = tp if sequence_parallel else 1
    ew = tokens * h / sp_div
    heads = spec.num_heads // tp
    ops: list[Op] = []
    ops.append(_elementwise("attn_norm", "norm", ew, 2 * e * ew, {"attn_norm.input": e * ew}))
    if spec.is_mla:
        ops += _mla_projections(spec, tokens, heads, e, sp_div)
        kv_heads = heads
    else:
        kv_heads = math.ceil(spec.kv_heads / tp)
        d = spec.head_dim
        ops.append(
            _matmul(
                "qkv_proj",
                Gemm(tokens, (heads + 2 * kv_heads) * d, h),
                e,
                {"qkv_proj.input": e * tokens * h / sp_div},
            )
        )
        if spec.position_embedding == "rotary":
            qk = tokens * (heads + kv_heads) * d
            ops.append(_elementwise("rotary", "rotary", qk, 2 * e * qk, {}))
    window = spec.sliding_window if spec.is_window_layer(layer) else None
    ops += _variant_attention(spec, b, s_local, heads, kv_heads, e, window)
    dv = spec.value_head_dim
    ops.append(
        _matmul(
            "out_proj",
            Gemm(tokens, h, heads * dv),
            e,
            {"out_proj.input": e * tokens * heads * dv},
        )
    )
    ops.append(_residual("attn", spec.dropout, ew, e))
    ops.append(_elementwise("mlp_norm", "norm", ew, 2 * e * ew, {"mlp_norm.input": e * ew}))
    if spec.is_moe_layer(layer):
        ops += _moe_mlp(spec, tokens, tp, sp_div, ep, etp, e)
    else:
        ops += _dense_mlp(spec, "mlp", spec.ffn_hidden // tp, tokens, sp_div, e)
    ops.append(_residual("mlp", spec.dropout, ew, e))
    return ops


def _mla_projections(
    spec: TransformerSpec, tokens: int, heads: int, e: int, sp_div: int
) -> list[Op]:
    h = spec.hidden
    assert spec.kv_lora_rank is not None
    kv_lora, rope, nope, dv = (
        spec.kv_lora_rank,
        spec.qk_rope_head_dim,
        spec.qk_nope_head_dim,
        spec.value_head_dim,
    )
    qk = nope + rope
    ops: list[Op] = []
    if spec.q_lora_rank is not None:
        ql = spec.q_lora_rank
        ops.append(
            _matmul("q_down", Gemm(tokens, ql, h), e, {"attn_proj.input": e * tokens * h / sp_div})
        )
        n = float(tokens * ql)
        ops.append(_elementwise("q_norm", "norm", n, 2 * e * n, {"q_norm.input": e * n}))
        ops.append(_matmul("q_up", Gemm(tokens, heads * qk, ql), e, {"q_up.input": e * n}))
        kv_saved: dict[str, float] = {}
    else:
        ops.append(
            _matmul(
                "q_up",
                Gemm(tokens, heads * qk, h),
                e,
                {"attn_proj.input": e * tokens * h / sp_div},
            )
        )
        kv_saved = {}
    # kv down reads the same normed input as q down: saved once (attn_proj.input).
    ops.append(_matmul("kv_down", Gemm(tokens, kv_lora + rope, h), e, kv_saved))
    n = float(tokens * kv_lora)
    ops.append(_elementwise("kv_norm", "norm", n, 2 * e * n, {"kv_norm.input": e * n}))
    ops.append(
        _matmul("kv_up", Gemm(tokens, heads * (nope + dv), kv_lora), e, {"kv_up.input": e * n})
    )
    if spec.position_embedding == "rotary":
        r = float(tokens * (heads + 1) * rope)
        ops.append(_elementwise("rotary", "rotary", r, 2 * e * r, {}))
    return ops


def _variant_attention(
    spec: TransformerSpec,
    b: int,
    s_q: int,
    heads: int,
    kv_heads: int,
    e: int,
    window: int | None,
) -> list[Op]:
    """Core attention of ``s_q`` local queries over the keys of the whole sequence (one CP
    rank holds s / cp queries), q/k width ``qk_head_dim``, v width ``value_head_dim``."""
    s = spec.seq_len
    dqk, dv = spec.qk_head_dim, spec.value_head_dim
    q = float(b * s_q * heads * dqk)
    k = float(b * s * kv_heads * dqk)
    v = float(b * s * kv_heads * dv)
    k_local = k * s_q / s
    v_local = v * s_q / s
    o = float(b * s_q * heads * dv)
    if spec.flash_attention:
        keys = attended_keys(s, window, causal=True)
        flops = 2.0 * b * heads * s_q * keys * (dqk + dv)
        lse = 4.0 * b * heads * s_q
        span = min(window, s) if window is not None else s
        return [
            Op(
                name="flash_attention",
                kind=OpKind.FUSED_ATTENTION,
                flops=flops,
                size_bytes=e * (q + k + v + o) + lse,
                backward_flops=2.5 * flops,
                backward_bytes=e * (2 * q + 2 * k + 2 * v + 2 * o) + lse,
                gemms=(Gemm(s_q, span, dqk, b * heads),),
                saved={"q": e * q, "k": e * k_local, "v": e * v_local, "flash_attention.lse": lse},
            )
        ]
    keys_n = int(attended_keys(s, window, causal=False))
    probs = float(b * heads * s_q * keys_n)
    scores = Gemm(s_q, keys_n, dqk, b * heads)
    scores_bytes = e * (q + k + probs)
    out: list[Op] = [
        Op(
            name="attn_scores",
            kind=OpKind.MATMUL,
            gemms=(scores,),
            flops=scores.flops,
            size_bytes=scores_bytes,
            backward_gemms=scores.backward(),
            backward_flops=2 * scores.flops,
            backward_bytes=2 * scores_bytes,
            saved={"q": e * q, "k": e * k_local},
        ),
        _elementwise("softmax", "softmax", probs, 2 * e * probs, {"softmax.output": e * probs}),
    ]
    values_saved: dict[str, float] = {"v": e * v_local}
    if spec.dropout:
        out.append(
            _elementwise(
                "attn_dropout", "dropout", probs, (2 * e + 1) * probs, {"attn_dropout.mask": probs}
            )
        )
        values_saved["attn_dropout.output"] = e * probs
    values = Gemm(s_q, dv, keys_n, b * heads)
    values_bytes = e * (probs + v + o)
    out.append(
        Op(
            name="attn_values",
            kind=OpKind.MATMUL,
            gemms=(values,),
            flops=values.flops,
            size_bytes=values_bytes,
            backward_gemms=values.backward(),
            backward_flops=2 * values.flops,
            backward_bytes=2 * values_bytes,
            saved=values_saved,
        )
    )
    return out


def _dense_mlp(
    spec: TransformerSpec, prefix: str, width: int, tokens: int, sp_div: int, e: int
) -> list[Op]:
    """A TP-split (gated) MLP of local inner ``width`` on ``tokens`` tokens: ``mlp_*`` for the
    dense MLP, ``shared_*`` for shared experts (the same shapes)."""
    h = spec.hidden
    up_name = f"{prefix}_up"
    act_name = "activation" if prefix == "mlp" else f"{prefix}_activation"
    down_name = f"{prefix}_down"
    up_width = 2 * width if spec.gated_mlp else width
    act = float(tokens * width)
    ops = [
        _matmul(
            up_name, Gemm(tokens, up_width, h), e, {f"{up_name}.input": e * tokens * h / sp_div}
        )
    ]
    if spec.gated_mlp:
        ops.append(
            _elementwise(act_name, "swiglu", act, 3 * e * act, {f"{act_name}.input": 2 * e * act})
        )
    else:
        ops.append(_elementwise(act_name, "gelu", act, 2 * e * act, {f"{act_name}.input": e * act}))
    ops.append(_matmul(down_name, Gemm(tokens, h, width), e, {f"{down_name}.input": e * act}))
    return ops


def _moe_mlp(
    spec: TransformerSpec, tokens: int, tp: int, sp_div: int, ep: int, etp: int, e: int
) -> list[Op]:
    h = spec.hidden
    n_exp = spec.num_experts
    local = n_exp // ep
    width = spec.expert_ffn_hidden // etp
    t_moe = tokens / sp_div  # tokens entering the router on this rank (SP-split with SP)
    rows = routed_rows(spec, t_moe, etp=etp)
    per_expert = max(1, math.ceil(rows / local))
    ops: list[Op] = []
    ops.append(
        _matmul(
            "router",
            Gemm(max(1, math.ceil(t_moe)), n_exp, h),
            e,
            {"router.input": e * t_moe * h},
        )
    )
    scores = t_moe * n_exp
    ops.append(
        _elementwise(
            "router_topk",
            "softmax",
            scores,
            (e + 4) * scores,
            {"router_topk.probs_fp32": 4 * scores},
        )
    )
    ops.append(_elementwise("moe_permute", "embedding", rows * h, 2 * e * rows * h, {}))
    up_width = 2 * width if spec.gated_mlp else width
    ops.append(
        _matmul(
            "expert_up",
            Gemm(per_expert, up_width, h, local),
            e,
            {"expert_up.input": e * rows * h},
        )
    )
    act = rows * width
    if spec.gated_mlp:
        ops.append(
            _elementwise(
                "expert_activation",
                "swiglu",
                act,
                3 * e * act,
                {"expert_activation.input": 2 * e * act},
            )
        )
    else:
        ops.append(
            _elementwise(
                "expert_activation", "gelu", act, 2 * e * act, {"expert_activation.input": e * act}
            )
        )
    ops.append(
        _matmul(
            "expert_down",
            Gemm(per_expert, h, width, local),
            e,
            {"expert_down.input": e * act},
        )
    )
    ops.append(
        _elementwise(
            "moe_unpermute",
            "add",
            rows * h,
            (2 * e) * rows * h,
            {"moe_unpermute.input": e * rows * h},
        )
    )
    if spec.shared_ffn_hidden:
        ops += _dense_mlp(spec, "shared", spec.shared_ffn_hidden // tp, tokens, sp_div, e)
    return ops


def embedding_ops(
    spec: TransformerSpec,
    *,
    micro_batch: int,
    tp: int = 1,
    sequence_parallel: bool = False,
    dtype: str = "bf16",
    cp: int = 1,
) -> list[Op]:
    """Forward ops of the (vocab-parallel) input embedding on one rank.

    The lookup writes b s h elements on every rank (rows outside the rank's vocab shard are
    zeros until the tp all-reduce / reduce-scatter); GPT adds the learned position rows and
    applies dropout (on s/t tokens with SP).
    """
    _check_tp(spec, tp)
    e = activation_element_bytes(dtype)
    tokens = micro_batch * (spec.seq_len // cp)  # s / cp tokens per context-parallel rank
    full = float(tokens * spec.hidden)
    ew = full / (tp if sequence_parallel else 1)
    ops = [
        _elementwise(
            "embedding", "embedding", full, 2 * e * full, {"embedding.token_ids": 8.0 * tokens}
        )
    ]
    if spec.position_embedding == "learned":
        ops.append(_elementwise("position_add", "add", full, 3 * e * full, {}))
    if spec.dropout:
        ops.append(
            _elementwise(
                "embedding_dropout", "dropout", ew, (2 * e + 1) * ew, {"embedding_dropout.mask": ew}
            )
        )
    return ops


def head_ops(
    spec: TransformerSpec,
    *,
    micro_batch: int,
    tp: int = 1,
    sequence_parallel: bool = False,
    dtype: str = "bf16",
    cp: int = 1,
) -> list[Op]:
    """Forward ops of the final norm, the (vocab-parallel) LM head and the loss on one rank.

    The cross-entropy follows Megatron's vocab-parallel loss: logits are upcast to fp32 and the
    fp32 softmax of the rank's V/t columns (4 s b V / t bytes) is kept for backward.
    """
    _check_tp(spec, tp)
    if spec.vocab % tp:
        # Megatron pads the vocabulary so that it splits evenly over tp; so do we.
        vocab_local = math.ceil(spec.vocab / tp)
    else:
        vocab_local = spec.vocab // tp
    e = activation_element_bytes(dtype)
    tokens = micro_batch * (spec.seq_len // cp)  # s / cp tokens per context-parallel rank
    h = spec.hidden
    ew = tokens * h / (tp if sequence_parallel else 1)
    logits = float(tokens * vocab_local)
    return [
        _elementwise("final_norm", "norm", ew, 2 * e * ew, {"final_norm.input": e * ew}),
        _matmul("lm_head", Gemm(tokens, vocab_local, h), e, {"lm_head.input": e * ew}),
        _elementwise("loss", "loss", logits, (e + 4) * logits, {"loss.softmax_fp32": 4 * logits}),
    ]


def parse_recompute(recompute: str) -> RecomputeMode:
    """``none`` / ``selective`` / ``full`` (any case, or the config enum) as a RecomputeMode."""
    return parse_enum(RecomputeMode, recompute, key_path="training.recompute")


def kept_bytes(ops: list[Op], mode: RecomputeMode) -> tuple[float, float]:
    """Activation bytes of a layer's ops under ``mode``: (kept from forward to backward,
    rebuilt while the layer recomputes).

    none: every saved tensor. selective: all but the softmax output, its dropout mask and the
    dropout output (Korthikanti's 5as^2b term). full: only the layer input (the first op's
    input, split by t with SP), the rest is rebuilt during backward.
    """
    full = float(sum(op.saved_bytes for op in ops))
    if mode is RecomputeMode.NONE:
        return full, 0.0
    if mode is RecomputeMode.SELECTIVE:
        dropped = sum(v for op in ops for k, v in op.saved.items() if k in SELECTIVE_TENSORS)
        return full - dropped, float(dropped)
    first = ops[0].saved_bytes
    return first, full - first
