"""Parameter tensors of one rank, in registration order: what DDP buckets and FSDP units hold.

Megatron-LM splits (Shoeybi et al. 2019): column-parallel QKV and MLP up/gate keep weight and
bias / t; row-parallel output projection and MLP down keep weight / t and a replicated bias;
norms are replicated; the word embedding is vocab-parallel (V/t rows) on the first stage with
a replicated learned position table; the final norm and the LM head are on the last stage. A
tied LM head with pp > 1 keeps a copy of the embedding matrix on the last stage (Megatron's
``shared_embedding``). The totals equal ``collsim.workload.memory.parameters_per_rank``.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, NamedTuple

from collsim.workload.memory import attention_parameters_per_rank

if TYPE_CHECKING:
    from collsim.workload.model import TransformerSpec

__all__ = ["ParamTensor", "layer_tensors", "chunk_tensors"]


class ParamTensor(NamedTuple):
    """One parameter tensor of one rank (a named tuple: a step's schedule makes one per
    tensor of every stage, 1,152 for 3d_175b, and a frozen dataclass costs about three times
    as much to make).

    Attributes:
        name: ``L12.qkv.weight``, ``embedding.word``, ``head.weight``, ...
        numel: elements on this rank (fractional only for a vocab-parallel V / t split).
        segment: backward segment that produces its gradient: ``"head"``, a layer index, or
            ``"embedding"``.
    """

    name: str
    numel: float
    segment: str | int
    expert: bool = False
    """A routed-expert tensor: its gradient is reduced over the expert data-parallel group
    (edp), not dp x cp (Megatron-Core's separate expert buffers)."""


def layer_tensors(
    spec: TransformerSpec, layer: int, tp: int, *, ep: int = 1, etp: int = 1
) -> list[ParamTensor]:
    """The tensors of one transformer layer on one TP rank, in forward registration order.

    Their sum is ``collsim.workload.memory.layer_parameters_per_rank(spec, tp, layer=layer,
    ep=ep, etp=etp)``: MLA projections, routed experts (E / ep per rank, width / etp, as one
    grouped tensor per projection), shared experts and the router where the model has them.
    """

    h, f = spec.hidden, spec.ffn_hidden
    norm = spec.norm_parameters() // h  # 2 (LN) or 1 (RMS)
    bias = spec.bias
    p = f"L{layer}."
    out: list[ParamTensor] = [ParamTensor(p + "attn_norm", norm * h, layer)]
    if spec.is_mla or spec.qkv_bias is not None or spec.qk_norm or spec.attention_sinks:
        out.append(ParamTensor(p + "attention", attention_parameters_per_rank(spec, tp), layer))
    else:
        qkv = spec.qkv_width
        out.append(ParamTensor(p + "qkv.weight", h * qkv // tp, layer))
        if bias:
            out.append(ParamTensor(p + "qkv.bias", qkv // tp, layer))
        out.append(ParamTensor(p + "out_proj.weight", spec.attention_width * h // tp, layer))
        if bias:
            out.append(ParamTensor(p + "out_proj.bias", h, layer))
    out.append(ParamTensor(p + "mlp_norm", norm * h, layer))
    if spec.is_moe_layer(layer):
        out.append(ParamTensor(p + "router", spec.router_parameters(), layer))
        out += _mlp_tensors(spec, p + "experts.", spec.expert_ffn_hidden, etp, layer, ep=ep)
        if spec.shared_ffn_hidden:
            out += _mlp_tensors(spec, p + "shared.", spec.shared_ffn_hidden, tp, layer)
        return out
    return out + _mlp_tensors(spec, p + "mlp_", f, tp, layer)


def _mlp_tensors(
    spec: TransformerSpec, prefix: str, width: int, split: int, layer: int, *, ep: int = 0
) -> list[ParamTensor]:
    """Up (and gate) and down of an MLP of inner ``width`` split over ``split`` ranks; with
    ``ep`` the E / ep routed experts of the rank stacked in one tensor per projection."""
    h = spec.hidden
    up = (2 if spec.gated_mlp else 1) * width
    many = spec.num_experts / ep if ep else 1
    x = bool(ep)
    out = [ParamTensor(f"{prefix}up.weight", many * h * up / split, layer, x)]
    if spec.bias:
        out.append(ParamTensor(f"{prefix}up.bias", many * up / split, layer, x))
    out.append(ParamTensor(f"{prefix}down.weight", many * width * h / split, layer, x))
    if spec.bias:
        out.append(ParamTensor(f"{prefix}down.bias", many * h, layer, x))
    return out


def _vocab_rows(spec: TransformerSpec, tp: int) -> float:
    """V / t rows per rank (fractional when t does not divide V, as in
    ``workload.memory.parameters_per_rank``; Megatron pads V, which changes little)."""
    return spec.vocab / tp


def chunk_tensors(
    spec: TransformerSpec,
    layers: range | Sequence[int],
    *,
    tp: int,
    first: bool,
    last: bool,
    pp: int,
    ep: int = 1,
    etp: int = 1,
) -> list[ParamTensor]:
    """All tensors of one model chunk on one TP rank, in registration order.

    Args:
        spec: the model.
        layers: global layer indices of the chunk.
        tp: tensor-parallel size.
        first: the chunk holds the input embedding (first stage, first chunk).
        last: the chunk holds the final norm and LM head (last stage, last chunk).
        pp: pipeline size (a tied head needs its own copy only when pp > 1).
    """
    h = spec.hidden
    out: list[ParamTensor] = []
    if first:
        out.append(ParamTensor("embedding.word", _vocab_rows(spec, tp) * h, "embedding"))
        if spec.position_embedding == "learned":
            out.append(ParamTensor("embedding.position", spec.seq_len * h, "embedding"))
    for layer in layers:
        out += layer_tensors(spec, layer, tp, ep=ep, etp=etp)
    if last:
        out.append(ParamTensor("head.final_norm", spec.norm_parameters(), "head"))
        if not spec.tied_embeddings or pp > 1:
            out.append(ParamTensor("head.weight", _vocab_rows(spec, tp) * h, "head"))
    return out
