"""The ops of the layers that are not a dense GPT layer: routed experts (MoE), multi-head
latent attention (MLA), sliding-window attention and context-parallel attention, on one rank,
with the same accounting as :mod:`collsim.workload.ops` (FLOPs, bytes, saved tensors).
"""

from __future__ import annotations

import math

from collsim.core.errors import ConfigError
from collsim.core.vocab import OpKind
from collsim.workload.model import TransformerSpec
from collsim.workload.op_records import (
    FLASH_CAUSAL_FRACTION,
    Gemm,
    Op,
    _activation_matmul,
    _check_tp,
    _elementwise,
    _matmul,
    _residual,
    activation_element_bytes,
)
from collsim.workload.torch_cp import is_torch_cp, torch_cp_attention_ops

__all__ = ["attended_keys", "routed_rows", "variant_layer_ops"]


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
    cp_algorithm: str = "ring",
    cp_load_balance: bool = True,
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
    :mod:`collsim.parallel.context`. Under torch's context parallelism (``cp_algorithm``
    ``torch_*``) the core attention is one SDPA call per KV chunk with its merges
    (:func:`collsim.workload.torch_cp.torch_cp_attention_ops`).

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
    if cp > 1 and is_torch_cp(cp_algorithm):
        ops += torch_cp_attention_ops(
            micro_batch=b,
            local_tokens=s_local,
            cp=cp,
            heads=heads,
            key_dim=spec.qk_head_dim,
            value_dim=spec.value_head_dim,
            element_bytes=e,
            load_balance=cp_load_balance,
        )
    else:
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
        _activation_matmul("attn_scores", scores, scores_bytes, {"q": e * q, "k": e * k_local}),
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
    out.append(_activation_matmul("attn_values", values, values_bytes, values_saved))
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
