"""The op records the layer builders make: a GEMM, an op with its forward and backward cost
and the tensors it keeps, the constructors of matmul, element-wise and residual ops, the op
vocabulary (names, FLOPs per element, what selective recompute drops) and the activation
bytes a layer keeps under each recompute mode. :mod:`collsim.workload.ops` builds the dense
layer, the embedding and the head from them, :mod:`collsim.workload.variant_ops` the MoE, MLA,
sliding-window and context-parallel layers.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from collsim.core.errors import ConfigError
from collsim.core.vocab import Dtype, OpKind, RecomputeMode, parse_enum
from collsim.workload.model import TransformerSpec

__all__ = [
    "FLASH_CAUSAL_FRACTION",
    "FLOPS_PER_ELEMENT",
    "Gemm",
    "OP_NAMES",
    "Op",
    "OpKind",
    "SELECTIVE_OPS",
    "SELECTIVE_TENSORS",
    "activation_element_bytes",
    "elementwise_op",
    "kept_bytes",
    "kept_tensors",
    "parse_recompute",
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
    "cp_attention",
    "cp_lse_merge",
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
    causal: bool | None = None
    """Fused attention only: the call runs with (True) or without (False) the causal mask;
    None the model's own (a torch context-parallel step attends a whole KV chunk unmasked)."""
    kernels: int = 1
    backward_kernels: int = 1
    """Element-wise ops: the eager kernels the op runs in forward and in backward (each with
    its launch; a torch context-parallel merge is a chain of them)."""

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


def _activation_matmul(name: str, gemm: Gemm, size_bytes: float, saved: dict[str, float]) -> Op:
    """A GEMM of two activations (attention's QK^T and AV): no weight, so no weight gradient;
    backward is the two input-gradient GEMMs, twice the forward's FLOPs and bytes."""
    return Op(
        name=name,
        kind=OpKind.MATMUL,
        gemms=(gemm,),
        flops=gemm.flops,
        size_bytes=size_bytes,
        backward_gemms=gemm.backward(),
        backward_flops=2 * gemm.flops,
        backward_bytes=2 * size_bytes,
        saved=saved,
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


FLASH_CAUSAL_FRACTION = 0.5
"""Share of the s x s blocks a causal FlashAttention kernel computes (it skips the rest)."""


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


def kept_tensors(ops: list[Op], mode: RecomputeMode) -> tuple[tuple[float, ...], tuple[float, ...]]:
    """The tensors behind :func:`kept_bytes`, in the ops' order: (bytes of each tensor kept
    from forward to backward, bytes of each tensor rebuilt while the layer recomputes)."""
    every = [(op_index, k, v) for op_index, op in enumerate(ops) for k, v in op.saved.items()]
    if mode is RecomputeMode.NONE:
        return tuple(float(v) for _, _, v in every), ()
    if mode is RecomputeMode.SELECTIVE:
        return (
            tuple(float(v) for _, k, v in every if k not in SELECTIVE_TENSORS),
            tuple(float(v) for _, k, v in every if k in SELECTIVE_TENSORS),
        )
    return (
        tuple(float(v) for i, _, v in every if i == 0),
        tuple(float(v) for i, _, v in every if i != 0),
    )
