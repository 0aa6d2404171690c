"""Context-parallel communication volumes: ring attention and all-gather KV.

The sequence of s tokens is split over cp ranks; with causal load balancing into 2 cp chunks,
rank i holding chunks i and 2 cp - 1 - i (Megatron-Core / Transformer Engine context
parallelism; "The Llama 3 Herd of Models", arXiv 2407.21783, section 3.3.2), so each rank
holds s / cp tokens either way. One rank's K and V block for one layer and micro-batch, with
b sequences, kv_heads / tp key/value heads on the TP rank, key width d_k and value width d_v
(d_k = d_v = head_dim for GQA; nope + rope and v_head for MLA, whose K and V are exchanged
after the up projection as TE does), e bytes per element::

    kv_block = b (s / cp) (kv_heads / tp) (d_k + d_v) e

Ring attention (Liu et al. 2023, "Ring Attention with Blockwise Transformers", section 3;
TE ``cp_comm_type = "p2p"``): cp - 1 steps; at each one a rank sends its current KV block to
the next rank of the ring (and receives one), overlapped with the attention of the block it
holds. Forward: (cp - 1) kv_block sent per rank. Backward: the KV blocks go around again
together with the dK, dV accumulators of the same size: 2 (cp - 1) kv_block.

All-gather KV (Llama 3, section 3.3.2: "we first all-gather the key (K) and value (V)
tensors, and then compute attention output for the local query (Q) tensor chunk"; TE
``cp_comm_type = "all_gather"``): forward one all-gather of cp x kv_block (the gathered
output, the nccl-tests size), of which a rank receives (cp - 1) kv_block; backward a
reduce-scatter of dK, dV of the same size, (cp - 1) kv_block sent per rank.

torch's context parallelism (``torch_allgather``, ``torch_alltoall``): K and V of every
query head, exchanged again in backward with the fp32 dK, dV rotated at each of the cp steps
(docs/derivations.md, ``collsim.workload.torch_cp``).
"""

from __future__ import annotations

from dataclasses import dataclass

from collsim.core.errors import ConfigError
from collsim.workload.torch_cp import CAST_BYTES, TORCH_CP_ALGORITHMS

__all__ = ["CPVolumes", "kv_block_bytes", "cp_volumes"]


@dataclass(frozen=True, slots=True)
class CPVolumes:
    """Bytes of one attention layer and micro-batch on one CP rank (module docstring).

    Attributes:
        kv_block_bytes: one rank's K and V for its s / cp tokens.
        steps: ring steps (cp - 1), or 1 collective for all-gather.
        collective_size_bytes: per-step message (ring: kv_block) or the all-gather output
            (cp x kv_block).
        forward_bytes: bytes a rank sends (ring) or receives (all-gather) in forward.
        backward_bytes: the same in backward.
    """

    kv_block_bytes: float
    steps: int
    collective_size_bytes: float
    forward_bytes: float
    backward_bytes: float


def kv_block_bytes(
    *,
    micro_batch: int,
    seq_len: int,
    cp: int,
    kv_heads: int,
    key_dim: int,
    value_dim: int,
    element_bytes: float,
    tp: int = 1,
) -> float:
    """b (s / cp) (kv_heads / tp) (d_k + d_v) e: one rank's K and V block (see module doc).

    kv heads are replicated when tp > kv_heads (one per TP rank), as in the layer ops.
    """
    if cp <= 0 or seq_len % cp:
        raise ConfigError(
            f"seq_len ({seq_len}) must be divisible by cp, got {cp}", key_path="parallel.cp"
        )
    heads = max(kv_heads / tp, 1.0) if tp > kv_heads else kv_heads / tp
    return micro_batch * (seq_len / cp) * heads * (key_dim + value_dim) * element_bytes


def cp_volumes(
    block_bytes: float, *, cp: int, algorithm: str = "ring", element_bytes: int = 2
) -> CPVolumes:
    """Forward and backward KV traffic of one layer and micro-batch per CP rank.

    Example:
        >>> v = cp_volumes(100.0, cp=4, algorithm="ring")
        >>> (v.forward_bytes, v.backward_bytes)
        (300.0, 600.0)
    """
    algo = str(algorithm).lower()
    if cp == 1:
        return CPVolumes(block_bytes, 0, 0.0, 0.0, 0.0)
    if algo == "ring":
        fwd = (cp - 1) * block_bytes
        return CPVolumes(block_bytes, cp - 1, block_bytes, fwd, 2.0 * fwd)
    if algo == "all_gather":
        fwd = (cp - 1) * block_bytes
        return CPVolumes(block_bytes, 1, cp * block_bytes, fwd, fwd)
    if algo in TORCH_CP_ALGORITHMS:
        dkv = block_bytes * CAST_BYTES / element_bytes
        kv = (cp - 1) * block_bytes
        if algo == "torch_allgather":
            return CPVolumes(block_bytes, 1, cp * block_bytes, kv, kv + cp * dkv)
        return CPVolumes(block_bytes, cp - 1, block_bytes, kv, kv + cp * dkv)
    raise ConfigError(
        f"must be one of ring, all_gather, {', '.join(TORCH_CP_ALGORITHMS)}; got {algorithm!r}",
        key_path="parallel.cp_algorithm",
    )
