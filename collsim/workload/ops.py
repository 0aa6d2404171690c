"""The ops of a transformer layer, the embedding and the LM head on ONE rank of a Megatron-style
tensor-parallel group: FLOPs, bytes and the tensors kept for backward, with Megatron-LM's fused
kernels (Shoeybi et al. 2019; Korthikanti et al. 2022; the accounting rules in
docs/derivations.md, ``collsim.workload.ops``). The op records are in
:mod:`collsim.workload.op_records`, the MoE, MLA, sliding-window and context-parallel layers in
:mod:`collsim.workload.variant_ops` (both re-exported here).
"""

from __future__ import annotations

import math

from collsim.core.errors import ConfigError
from collsim.core.vocab import OpKind
from collsim.workload.model import TransformerSpec
from collsim.workload.op_records import (
    FLASH_CAUSAL_FRACTION,
    FLOPS_PER_ELEMENT,
    OP_NAMES,
    SELECTIVE_OPS,
    SELECTIVE_TENSORS,
    Gemm,
    Op,
    _activation_matmul,
    _check_tp,
    _elementwise,
    _matmul,
    _residual,
    activation_element_bytes,
    elementwise_op,
    kept_bytes,
    kept_tensors,
    parse_recompute,
)
from collsim.workload.variant_ops import attended_keys, routed_rows, variant_layer_ops

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
    "kept_tensors",
    "OP_NAMES",
    "FLOPS_PER_ELEMENT",
    "elementwise_op",
    "variant_layer_ops",
    "routed_rows",
    "attended_keys",
]


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
    cp_algorithm: str = "ring",
    cp_load_balance: bool = True,
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
        cp_algorithm, cp_load_balance: how the CP ranks attend (torch's context parallelism
            runs one SDPA call per KV chunk) and whether the sequence is load-balanced.

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
            cp_algorithm=cp_algorithm,
            cp_load_balance=cp_load_balance,
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
        _activation_matmul(
            "attn_scores",
            scores,
            scores_bytes,
            {"q": e * tokens * heads * d, "k": e * tokens * kv_heads * d},
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
    out.append(_activation_matmul("attn_values", values, values_bytes, values_saved))
    return out


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
