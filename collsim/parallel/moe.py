"""Expert-parallel communication volumes: the token dispatch and combine all-to-alls.

Megatron-Core's all-to-all token dispatcher (``MoEAlltoAllTokenDispatcher``) and DeepEP send
each token's hidden vector to the rank of each of its top-k experts (dispatch) and back after
the experts (combine); the routing weights are applied on the way back. Under balanced
routing a token's k copies land uniformly on the ep ranks of its EP group, so a fraction
(ep - 1) / ep of them leaves the rank (Lepikhin et al. 2020, "GShard", section 2.2; Fedus et
al. 2021, "Switch Transformers", section 2.2, where an all-to-all moves tokens x hidden per
layer each way). Per MoE layer per rank, with T tokens on the rank, top-k, hidden h and e
bytes per element::

    forward:  dispatch + combine = 2 T k h e (ep - 1) / ep
    backward: the gradient of the combine is a dispatch and the gradient of the dispatch a
              combine: the same 2 T k h e (ep - 1) / ep again

so a training step moves twice the forward bytes (three times with a full recompute, which
repeats the forward all-to-alls). These are the bytes a rank sends (and receives); the
all-to-all buffer in the nccl-tests convention (``collsim.collectives.cost(all_to_all,
size)``) is the whole per-rank send buffer T k h e.

Expert tensor parallelism (etp > 1): Megatron-Core all-gathers the dispatched tokens inside the
etp group before the expert GEMMs and reduce-scatters the expert outputs after them, each
moving T k h e (etp - 1) bytes per rank on average (the rank's T k rows go to etp - 1 peers).
"""

from __future__ import annotations

from dataclasses import dataclass

from collsim.core.errors import ConfigError

__all__ = ["EPVolumes", "ep_volumes", "ep_step_bytes_per_rank"]


@dataclass(frozen=True, slots=True)
class EPVolumes:
    """Bytes of one MoE layer on one rank (see the module docstring).

    Attributes:
        all_to_all_size_bytes: one all-to-all's per-rank buffer, T k h e (nccl-tests size).
        dispatch_bytes: bytes a rank sends in the forward dispatch, T k h e (ep - 1) / ep.
        combine_bytes: the same for the forward combine.
        forward_bytes: dispatch + combine in forward.
        backward_bytes: the two all-to-alls of backward (equal to forward_bytes).
        etp_bytes: etp all-gather + reduce-scatter of the rows in forward (0 when etp = 1).
    """

    all_to_all_size_bytes: float
    dispatch_bytes: float
    combine_bytes: float
    forward_bytes: float
    backward_bytes: float
    etp_bytes: float


def ep_volumes(
    *,
    tokens: float,
    top_k: int,
    hidden: int,
    element_bytes: float,
    ep: int,
    etp: int = 1,
    load_imbalance: float = 1.0,
) -> EPVolumes:
    """The dispatch and combine volumes of one MoE layer on one rank.

    Args:
        tokens: tokens on the rank entering the MoE layer (b s / (cp tp) with SP).
        top_k: routed experts per token.
        hidden: model width h.
        element_bytes: bytes per element on the wire (2 for bf16; 1 for an fp8 dispatch as
            DeepEP's low-precision mode).
        ep: expert-parallel size.
        etp: expert tensor-parallel size.
        load_imbalance: tokens of the busiest rank over the mean (>= 1): the receive side of
            that rank grows by this factor; the send side is the balanced figure.

    Example:
        >>> v = ep_volumes(tokens=4096, top_k=8, hidden=7168, element_bytes=2, ep=64)
        >>> v.forward_bytes == 2 * 4096 * 8 * 7168 * 2 * 63 / 64
        True
    """
    for key, value in (("ep", ep), ("etp", etp), ("top_k", top_k)):
        if value <= 0:
            raise ConfigError(f"must be > 0, got {value}", key_path=f"parallel.{key}")
    if load_imbalance < 1.0:
        raise ConfigError(f"must be >= 1, got {load_imbalance}", key_path="model.load_imbalance")
    size = tokens * top_k * hidden * element_bytes
    one = size * (ep - 1) / ep
    forward = 2.0 * one
    etp_bytes = 2.0 * size * (etp - 1) * load_imbalance
    return EPVolumes(
        all_to_all_size_bytes=size,
        dispatch_bytes=one,
        combine_bytes=one,
        forward_bytes=forward,
        backward_bytes=forward,
        etp_bytes=etp_bytes,
    )


def ep_step_bytes_per_rank(
    volumes: EPVolumes, *, moe_layers: int, microbatches: int, recompute: bool = False
) -> float:
    """All-to-all bytes one rank sends in a training step: per MoE layer and micro-batch,
    forward + backward (+ the forward again with full recompute)."""
    per = volumes.forward_bytes + volumes.backward_bytes
    if recompute:
        per += volumes.forward_bytes
    return per * moe_layers * microbatches
