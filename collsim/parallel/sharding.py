"""HSDP gradient reduction and FSDP all-gather sizes, FP8 weight copies and their scales.

Derivations, measurements and sources: docs/derivations.md, ``collsim.parallel.sharding``.
"""

from __future__ import annotations

from dataclasses import dataclass

from collsim.core.errors import ConfigError

__all__ = [
    "HSDPVolumes",
    "hsdp_gradient_volumes",
    "fsdp_all_gather_bytes",
    "fp8_weight_bytes",
    "DELAYED_AMAX_HISTORY",
]

DELAYED_AMAX_HISTORY = 1024
"""TE ``DelayedScaling.amax_history_len`` default (transformer_engine/common/recipe)."""

_BLOCK = 128 * 128
"""Weight block of the blockwise recipe (DeepSeek-V3 report section 3.3.2)."""
_MX_BLOCK = 32
"""Elements per MX scale (OCP Microscaling Formats spec v1.0)."""


@dataclass(frozen=True, slots=True)
class HSDPVolumes:
    """One gradient reduction of P parameters on one rank (see the module docstring).

    Attributes:
        reduce_scatter_size_bytes: P e, the reduce-scatter input inside a shard group.
        reduce_scatter_bytes: (g - 1) / g x P e sent per rank.
        all_reduce_size_bytes: P e / g, the shard all-reduced across replicas.
        all_reduce_bytes: 2 (r - 1) / r x P e / g sent per rank (ring).
    """

    reduce_scatter_size_bytes: float
    reduce_scatter_bytes: float
    all_reduce_size_bytes: float
    all_reduce_bytes: float

    @property
    def total_bytes(self) -> float:
        return self.reduce_scatter_bytes + self.all_reduce_bytes


def hsdp_gradient_volumes(
    params: float, *, element_bytes: float, shard: int, replicate: int
) -> HSDPVolumes:
    """Reduce-scatter inside a shard group of ``shard`` ranks, all-reduce across
    ``replicate`` groups.

    Example:
        >>> v = hsdp_gradient_volumes(8e9, element_bytes=4, shard=8, replicate=8)
        >>> (v.reduce_scatter_bytes, v.all_reduce_bytes)
        (28000000000.0, 7000000000.0)
    """
    if shard <= 0 or replicate <= 0:
        raise ConfigError(
            f"shard and replicate must be > 0, got {shard}, {replicate}",
            key_path="parallel.fsdp.shard_group_size",
        )
    size = params * element_bytes
    shard_size = size / shard
    return HSDPVolumes(
        reduce_scatter_size_bytes=size,
        reduce_scatter_bytes=size * (shard - 1) / shard,
        all_reduce_size_bytes=shard_size,
        all_reduce_bytes=2.0 * shard_size * (replicate - 1) / replicate,
    )


def fsdp_all_gather_bytes(
    params: float, *, shard: int, fp8: bool = False, reshard_after_forward: bool = True
) -> tuple[float, float]:
    """(output size, bytes a rank receives) of the parameter all-gathers of one unit in a
    step: forward, plus backward again unless ``reshard_after_forward`` is false. bf16 weights
    move 2 bytes per parameter, FP8 weights 1 (their per-tensor scale is an fp32 all-reduce of
    the amax, 4 bytes, left out)."""
    e = 1.0 if fp8 else 2.0
    size = params * e
    gathers = 2 if reshard_after_forward else 1
    return size, gathers * size * (shard - 1) / shard


def fp8_weight_bytes(
    params: float, recipe: str, *, num_tensors: int = 1, transpose_copy: bool = True
) -> float:
    """Bytes of the FP8 weight copies and their scales kept beside bf16 weights (module doc).

    Args:
        params: weight elements (the FP8 GEMM weights of the rank).
        recipe: tensorwise, delayed, blockwise or mxfp8.
        num_tensors: weight tensors (per-tensor scales).
        transpose_copy: keep the transposed (columnwise) copy too (TE on Hopper; always for
            MXFP8).

    Example:
        >>> fp8_weight_bytes(1024 * 1024, "mxfp8") == 2 * (1024 * 1024 + 1024 * 1024 / 32)
        True
    """
    copies = 2 if transpose_copy else 1
    match str(recipe).lower():
        case "tensorwise":
            return copies * params + 8.0 * num_tensors
        case "delayed":
            return copies * params + 4.0 * (2 + DELAYED_AMAX_HISTORY) * num_tensors
        case "blockwise":
            return copies * (params + 4.0 * params / _BLOCK)
        case "mxfp8":
            return 2 * (params + params / _MX_BLOCK)
        case _:
            raise ConfigError(
                f"must be one of tensorwise, delayed, blockwise, mxfp8; got {recipe!r}",
                key_path="training.fp8_recipe",
            )
