"""FP8 casts as Transformer Engine runs them: the HBM bytes and kernels of quantizing the
inputs, weights and output gradients of each FP8 linear, per micro-batch and per step.

The byte counts per element and their sources (TransformerEngine 2.20.0.dev0 at d0067d0,
Megatron-LM at d98e8a6, Megatron-Bridge at 067f987) are derived in docs/fp8.md; the
functions below are the formulas of that page, and tests/workload/test_fp8.py checks them by
hand.
"""

from __future__ import annotations

from dataclasses import dataclass

from collsim.core.errors import ConfigError

__all__ = [
    "FP8Casts",
    "TE_FP8_OPS",
    "FUSED_NORM_INPUT_OPS",
    "LinearShape",
    "quantize_bytes",
    "linear_cast_bytes",
    "weight_cast_bytes_per_step",
    "cast_bytes_per_step",
    "fp8_param_gather_of",
    "weight_cache_of",
]

TE_FP8_OPS = frozenset(
    {
        "qkv_proj",
        "out_proj",
        "mlp_up",
        "mlp_down",
        "expert_up",
        "expert_down",
        "shared_up",
        "shared_down",
        "q_down",
        "q_up",
        "kv_down",
        "kv_up",
    }
)
"""Linears Megatron-Core runs under the FP8 recipe with Transformer Engine: its TE linears
(``TELayerNormColumnParallelLinear``, ``TERowParallelLinear``, ``TELinear`` for the MLA
projections) and the routed and shared experts (``TEGroupedMLP`` passes the FP8 recipe to
``te.GroupedLinear``; megatron/core/extensions/transformer_engine.py at d98e8a6). The router,
the attention core, the LM head and the loss stay 16-bit."""

FUSED_NORM_INPUT_OPS = frozenset({"qkv_proj", "mlp_up"})
"""Linears whose input quantization Transformer Engine fuses into the preceding norm
(``LayerNormLinear``: ``apply_normalization`` with the input quantizer,
transformer_engine/pytorch/module/layernorm_linear.py at d0067d0; Megatron-Core builds the QKV
and the dense MLP's first linear as ``TELayerNormColumnParallelLinear``)."""

_RECIPES = ("tensorwise", "delayed", "blockwise", "mxfp8")
_SCALE_BYTES = {"tensorwise": 0.0, "delayed": 0.0, "blockwise": 4.0 / 128, "mxfp8": 1.0 / 32}
"""Scale bytes per quantized element: one fp32 per 1 x 128 tile (blockwise, DeepSeek-V3
section 3.3.2), one E8M0 byte per 32 elements (mxfp8, OCP MX spec v1.0 section 5); per-tensor
scales are negligible."""


@dataclass(frozen=True, slots=True, kw_only=True)
class FP8Casts:
    """How a stack quantizes around its FP8 linears (docs/fp8.md)."""

    recipe: str = "tensorwise"
    """``tensorwise`` (current scaling), ``delayed``, ``blockwise`` or ``mxfp8``."""
    weight_cache: bool = False
    """Quantize the weights once per step and reuse them in the other micro-batches (TE's
    ``is_first_microbatch``, which Megatron-Core passes)."""
    param_gather: bool = False
    """Weights kept in FP8 (Megatron ``--fp8-param-gather``): the optimizer writes the FP8
    weights from the fp32 master shard and only their transposes are made per step."""
    fused_norm: bool = False
    """Input quantization of :data:`FUSED_NORM_INPUT_OPS` fused into the norm kernel."""

    def __post_init__(self) -> None:
        if self.recipe not in _RECIPES:
            raise ConfigError(
                f"must be one of {', '.join(_RECIPES)}; got {self.recipe!r}",
                key_path="training.fp8_recipe",
            )


@dataclass(frozen=True, slots=True)
class LinearShape:
    """Elements of one FP8 linear on a rank for one micro-batch: input ``m x k``, weight
    ``k x n`` and output ``m x n`` (times ``batch`` for grouped experts)."""

    name: str
    m: int
    n: int
    k: int
    batch: int = 1

    @property
    def input_elements(self) -> float:
        return float(self.batch * self.m * self.k)

    @property
    def weight_elements(self) -> float:
        return float(self.batch * self.k * self.n)

    @property
    def output_elements(self) -> float:
        return float(self.batch * self.m * self.n)


def quantize_bytes(recipe: str, *, copies: int = 2, fused: bool = False) -> float:
    """HBM bytes per element of quantizing one 16-bit tensor into ``copies`` FP8 copies
    (rowwise, and columnwise for the transposed GEMM operand), docs/fp8.md::

        delayed     2 + c          (amax from the history; one cast-transpose kernel)
        tensorwise  4 + c          (an amax pass reads the tensor first: current scaling)
        blockwise   2 + c (1 + 4/128)     mxfp8   2 + c (1 + 1/32)   (local scales)

    ``fused`` (the norm writes the quantized output): delayed writes FP8 in place of the
    norm's 16-bit output (1 - 2 = -1) and a transpose of it (read 1, write 1) for each further
    copy; tensorwise computes the amax in the norm (its output stays 16-bit) and one kernel
    casts, 2 + c; blockwise and mxfp8 are not fused on Hopper (TE's normalization.cpp picks
    the unfused path), as unfused.
    """
    scale = _SCALE_BYTES[recipe]
    if fused and recipe == "delayed":
        return -1.0 + 2.0 * (copies - 1)
    if fused and recipe == "tensorwise":
        return 2.0 + copies
    if recipe == "tensorwise":
        return 4.0 + copies
    return 2.0 + copies * (1.0 + scale)


def linear_cast_bytes(shape: LinearShape, casts: FP8Casts) -> tuple[float, float]:
    """HBM bytes of the casts of one FP8 linear in one micro-batch, (forward, backward).

    Forward: the input into its rowwise and columnwise copies (the wgrad GEMM's operand),
    fused into the norm for :data:`FUSED_NORM_INPUT_OPS` when ``casts.fused_norm``; the weight
    too unless it is cached or kept in FP8 (then :func:`weight_cast_bytes_per_step`). Backward:
    the output gradient into its two copies (dgrad and wgrad operands)."""
    fused = casts.fused_norm and shape.name in FUSED_NORM_INPUT_OPS
    forward = quantize_bytes(casts.recipe, fused=fused) * shape.input_elements
    if not (casts.weight_cache or casts.param_gather):
        forward += quantize_bytes(casts.recipe) * shape.weight_elements
    backward = quantize_bytes(casts.recipe) * shape.output_elements
    return forward, backward


def weight_cast_bytes_per_step(
    weight_elements: float, casts: FP8Casts, *, shard: float = 1.0
) -> float:
    """HBM bytes of the weight casts done once per step over ``weight_elements`` FP8 weight
    elements of a rank (0 when every micro-batch casts its weights: those are in
    :func:`linear_cast_bytes`).

    Cached (TE ``is_first_microbatch``): the 16-bit weight into its two FP8 copies,
    :func:`quantize_bytes`. FP8 parameters: the optimizer casts the fp32 master shard
    (``weight_elements / shard``) into FP8, reading 4 bytes and writing 1 (with an amax pass
    of 4 more for current scaling; mxfp8 and blockwise write both copies with their scales),
    and after the gather each rank makes the transpose (read 1, write 1) of the per-tensor
    recipes."""
    if shard < 1:
        raise ConfigError(f"must be >= 1, got {shard}", key_path="shard")
    if casts.param_gather:
        recipe = casts.recipe
        if recipe in ("blockwise", "mxfp8"):
            master = 4.0 + 2.0 * (1.0 + _SCALE_BYTES[recipe])
            return master * weight_elements / shard
        master = 4.0 + 1.0 + (4.0 if recipe == "tensorwise" else 0.0)
        return master * weight_elements / shard + 2.0 * weight_elements
    if casts.weight_cache:
        return quantize_bytes(casts.recipe) * weight_elements
    return 0.0


def cast_bytes_per_step(
    linears: list[LinearShape],
    casts: FP8Casts,
    *,
    num_microbatches: int,
    shard: float = 1.0,
) -> float:
    """All FP8 cast bytes of one rank in one step: ``num_microbatches`` x the per-micro-batch
    casts of ``linears`` + the once-per-step weight casts."""
    if num_microbatches < 1:
        raise ConfigError(f"must be >= 1, got {num_microbatches}", key_path="num_microbatches")
    per_mb = sum(sum(linear_cast_bytes(s, casts)) for s in linears)
    weights = sum(s.weight_elements for s in linears)
    return num_microbatches * per_mb + weight_cast_bytes_per_step(weights, casts, shard=shard)


def weight_cache_of(stack: str | None, explicit: bool | None, *, zero: int = 0) -> bool:
    """``training.fp8_weight_cache``: the explicit value, else True under ``megatron_te``
    (Megatron-Core passes ``is_first_microbatch``: pipeline_parallel/schedules.py l.496 and
    extensions/transformer_engine.py l.1338 at d98e8a6; TE caches the FP8 weight when it is
    set, module/linear.py l.479 at d0067d0) unless the parameters are sharded (``zero`` 3:
    TE keeps no weight workspace under FSDP2, ``cache_name = None if ... self.is_fsdp2``,
    module/linear.py l.1958), and False otherwise (torchao's ``Float8Linear`` casts its
    weight in every forward)."""
    if explicit is not None:
        return bool(explicit)
    return stack == "megatron_te" and zero < 3


def fp8_param_gather_of(stack: str | None, explicit: bool | None, *, fp8: bool, zero: int) -> bool:
    """``training.fp8_param_gather``: the explicit value (checked: it needs ``dtype: fp8``
    and a sharded optimizer, Megatron-LM arguments.py l.1095 at d98e8a6), else True for an
    FP8 plan with a sharded optimizer under ``megatron_te`` (every FP8 preset of
    Megatron-Bridge sets ``fp8_param_gather = True``: src/megatron/bridge/training/
    mixed_precision.py at 067f987), else False.

    Raises:
        ConfigError: explicit True without fp8 or with ``parallel.zero: 0``.
    """
    if explicit is None:
        return stack == "megatron_te" and fp8 and zero >= 1
    if explicit and not fp8:
        raise ConfigError(
            "needs training.dtype: fp8 (FP8 parameters)", key_path="training.fp8_param_gather"
        )
    if explicit and zero < 1:
        raise ConfigError(
            "needs a sharded optimizer (parallel.zero >= 1; Megatron-LM accepts "
            "--fp8-param-gather only with the distributed optimizer or FSDP), got zero 0",
            key_path="training.fp8_param_gather",
        )
    return bool(explicit)
