"""Memory closed forms: model states (ZeRO), parameters per rank (TP x PP), activations.

These are used by tests and by the plan search; the engine keeps its own memory timeline.

Model states per GPU (Rajbhandari et al. 2020, "ZeRO: Memory Optimizations Toward Training
Trillion Parameter Models", section 3 and Figure 1), Psi parameters, N data-parallel ranks:

=================  =========================  ===========================
stage              mixed-precision (2+2+K)    pure fp32 Adam (4+4+8)
=================  =========================  ===========================
0 (DDP)            (4 + K) Psi                16 Psi
1 (optimizer)      (4 + K/N) Psi              (8 + 8/N) Psi
2 (+ gradients)    (2 + (2 + K)/N) Psi        (4 + 12/N) Psi
3 (+ parameters)   (4 + K) Psi / N            16 Psi / N
=================  =========================  ===========================

K = 12 for mixed-precision Adam (fp32 master weights, momentum, variance), K = 8 for
mixed-precision SGD with momentum (master + momentum); pure fp32 keeps 8 (Adam) or 4 (SGD)
bytes of optimizer state per parameter beside the 4-byte parameter and 4-byte gradient.

Activations per layer: :func:`korthikanti_activation_bytes` is the closed form of Korthikanti
et al. 2022 ("Reducing Activation Recomputation in Large Transformer Models", sections 4.1-4.3,
Table 2); :func:`activation_bytes_per_layer` sums the tensors each op keeps for backward
(:mod:`collsim.workload.ops`), which also covers GQA, SwiGLU and dropout-free models.
"""

from __future__ import annotations

from dataclasses import dataclass

from collsim.errors import ConfigError
from collsim.workload.model import TransformerSpec
from collsim.workload.ops import RecomputeMode, kept_bytes, layer_ops, parse_recompute

__all__ = [
    "ModelStateBytes",
    "model_state_bytes",
    "layers_per_stage",
    "parameters_per_rank",
    "layer_parameters_per_rank",
    "korthikanti_activation_bytes",
    "activation_bytes_per_layer",
]


@dataclass(frozen=True, slots=True)
class ModelStateBytes:
    """Model-state bytes on one GPU, by category."""

    parameters: float
    gradients: float
    optimizer: float

    @property
    def total(self) -> float:
        return self.parameters + self.gradients + self.optimizer


def model_state_bytes(
    num_params: float,
    *,
    zero: int = 0,
    dp: int = 1,
    optimizer: str = "adam",
    mixed_precision: bool = True,
) -> ModelStateBytes:
    """Bytes of parameters, gradients and optimizer state per GPU (ZeRO table above).

    Args:
        num_params: parameters this GPU's model replica holds (Psi; after TP/PP splitting).
        zero: 0 (DDP), 1, 2 or 3 (FSDP full shard).
        dp: data-parallel ranks the states are sharded over (N).
        optimizer: ``adam`` or ``sgd`` (with momentum).
        mixed_precision: 16-bit parameters and gradients with fp32 master copies (True), or
            everything in fp32 (False).

    Example:
        >>> model_state_bytes(7e9, zero=0, optimizer="adam", mixed_precision=False).total
        112000000000.0
    """
    if zero not in (0, 1, 2, 3):
        raise ConfigError(f"must be one of 0, 1, 2, 3; got {zero!r}", key_path="parallel.zero")
    if dp <= 0:
        raise ConfigError(f"must be > 0, got {dp}", key_path="parallel.dp")
    if num_params < 0:
        raise ConfigError(f"must be >= 0, got {num_params}", key_path="num_params")
    opt = str(optimizer).lower()
    if opt not in ("adam", "sgd"):
        raise ConfigError(
            f"must be one of adam, sgd; got {optimizer!r}", key_path="training.optimizer"
        )
    if mixed_precision:
        param_b, grad_b = 2.0, 2.0
        state_b = 12.0 if opt == "adam" else 8.0
    else:
        param_b, grad_b = 4.0, 4.0
        state_b = 8.0 if opt == "adam" else 4.0
    n = float(dp)
    params = param_b / n if zero >= 3 else param_b
    grads = grad_b / n if zero >= 2 else grad_b
    states = state_b / n if zero >= 1 else state_b
    return ModelStateBytes(
        parameters=params * num_params, gradients=grads * num_params, optimizer=states * num_params
    )


def layers_per_stage(num_layers: int, pp: int) -> list[int]:
    """Layers on each pipeline stage: l // pp each, the first l % pp stages get one more."""
    if pp <= 0 or pp > num_layers:
        raise ConfigError(
            f"must be in 1..num_layers ({num_layers}), got {pp}", key_path="parallel.pp"
        )
    base, extra = divmod(num_layers, pp)
    return [base + (1 if i < extra else 0) for i in range(pp)]


def layer_parameters_per_rank(spec: TransformerSpec, tp: int) -> float:
    """One transformer layer's parameters on one TP rank (Megatron splits).

    This is the size of an FSDP unit (one layer) or of a layer's gradients in DDP buckets.

    Column-parallel QKV and MLP up/gate: weights and biases / t. Row-parallel output projection
    and MLP down: weights / t, biases replicated. Norms replicated.
    """
    h, f = spec.hidden, spec.ffn_hidden
    up = (2 if spec.gated_mlp else 1) * h * f
    weights = (h * spec.qkv_width + h * h + up + h * f) / tp
    biases = 0.0
    if spec.bias:
        biases = (spec.qkv_width + (2 * f if spec.gated_mlp else f)) / tp + 2 * h
    return weights + biases + 2 * spec.norm_parameters()


def parameters_per_rank(
    spec: TransformerSpec, *, tp: int = 1, pp: int = 1, stage: int = 0
) -> float:
    """Parameters held by one rank of pipeline ``stage`` under TP size ``tp``.

    Split (Megatron-LM): transformer layers as :func:`layers_per_stage`; the word embedding is
    vocab-parallel (V/t rows per rank) on the first stage, with the learned position table
    replicated there; the final norm and the LM head are on the last stage. A tied LM head
    still needs the embedding matrix on the last stage when pp > 1, so Megatron keeps a copy
    there (its gradient all-reduced with the first stage's): counted on both stages.

    Raises:
        ConfigError: stage out of range, or heads/ffn not divisible by tp.
    """
    if tp <= 0 or spec.num_heads % tp or spec.ffn_hidden % tp:
        raise ConfigError(
            f"tp ({tp}) must divide num_heads ({spec.num_heads}) and ffn_hidden "
            f"({spec.ffn_hidden})",
            key_path="parallel.tp",
        )
    counts = layers_per_stage(spec.num_layers, pp)
    if not 0 <= stage < pp:
        raise ConfigError(f"must be in 0..{pp - 1}, got {stage}", key_path="stage")
    total = counts[stage] * layer_parameters_per_rank(spec, tp)
    word = spec.vocab * spec.hidden / tp
    if stage == 0:
        total += word
        if spec.position_embedding == "learned":
            total += spec.seq_len * spec.hidden
    if stage == pp - 1:
        total += spec.norm_parameters()
        if not spec.tied_embeddings or pp > 1:
            total += word
    return total


def korthikanti_activation_bytes(
    *,
    seq_len: int,
    micro_batch: int,
    hidden: int,
    num_heads: int,
    tp: int = 1,
    sequence_parallel: bool = False,
    recompute: str = "none",
) -> float:
    """Activation bytes of one GPT layer per rank, Korthikanti 2022 (16-bit activations).

    ==========================  ==============================
    mode                        bytes
    ==========================  ==============================
    no parallelism (t = 1)      s b h (34 + 5 a s / h)
    TP                          s b h (10 + 24/t + 5 a s/(h t))
    TP + SP                     s b h (34/t + 5 a s/(h t))
    TP + selective              s b h (10 + 24/t)
    TP + SP + selective         s b h 34/t
    full recompute              2 s b h (2 s b h / t with SP)
    ==========================  ==============================
    """
    s, b, h, a, t = seq_len, micro_batch, hidden, num_heads, tp
    sbh = float(s * b * h)
    mode = parse_recompute(recompute)
    if mode is RecomputeMode.FULL:
        return 2 * sbh / (t if sequence_parallel else 1)
    attention = 0.0 if mode is RecomputeMode.SELECTIVE else 5 * a * s / (h * t)
    if sequence_parallel:
        return sbh * (34 / t + attention)
    return sbh * (10 + 24 / t + attention)


def activation_bytes_per_layer(
    spec: TransformerSpec,
    *,
    micro_batch: int,
    tp: int = 1,
    sequence_parallel: bool = False,
    recompute: str = "none",
    dtype: str = "bf16",
) -> float:
    """Bytes one layer keeps from forward to backward on one rank: the sum over its ops.

    none: every tensor an op saves; selective: without the softmax output, its dropout mask and
    the dropout output; full: only the layer input (split by t with SP).
    """
    ops = layer_ops(
        spec, micro_batch=micro_batch, tp=tp, sequence_parallel=sequence_parallel, dtype=dtype
    )
    return kept_bytes(ops, parse_recompute(recompute))[0]
