"""Memory closed forms: model states (ZeRO), parameters per rank (TP x PP), activations.

Derivations, measurements and sources: docs/derivations.md, ``collsim.workload.memory``.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from collsim.core.errors import ConfigError
from collsim.core.vocab import RecomputeMode
from collsim.workload.model import TransformerSpec
from collsim.workload.ops import (
    Op,
    activation_element_bytes,
    kept_bytes,
    layer_ops,
    parse_recompute,
)

__all__ = [
    "ModelStateBytes",
    "model_state_bytes",
    "layers_per_stage",
    "balanced_chunk_layers",
    "attention_parameters_per_rank",
    "layer_parameter_split",
    "stage_parameter_split",
    "moe_model_state_bytes",
    "parameters_per_rank",
    "layer_parameters_per_rank",
    "korthikanti_activation_bytes",
    "activation_bytes_per_layer",
    "FP8_SAVED_INPUT_OPS",
    "fp8_saved_input_savings",
    "fp8_layer_savings",
]

FP8_SAVED_INPUT_OPS = frozenset(
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
"""Linears Transformer Engine runs under the FP8 recipe in Megatron-Core (its TE linears, the
MLA projections and ``TEGroupedMLP``'s ``te.GroupedLinear`` experts), whose input it keeps for
the weight gradient in FP8: ``_Linear.forward`` saves the quantized input with only its
columnwise (transposed) usage, 1 byte per element, instead of the 16-bit input
(transformer_engine/pytorch/module/linear.py and grouped_linear.py at d0067d0, ``saved_inputmat``
after ``update_usage(rowwise_usage=False, columnwise_usage=True)``); ``LayerNormLinear`` keeps
its quantized ``ln_out`` the same way. The router, attention core, norms, activation
functions and LM head keep 16-bit tensors."""


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
    optimizer_bytes: float | None = None,
) -> ModelStateBytes:
    """Bytes of parameters, gradients and optimizer state per GPU (ZeRO table above).

    Args:
        num_params: parameters this GPU's model replica holds (Psi; after TP/PP splitting).
        zero: 0 (DDP), 1, 2 or 3 (FSDP full shard).
        dp: data-parallel ranks the states are sharded over (N).
        optimizer: ``adam`` or ``sgd`` (with momentum).
        mixed_precision: 16-bit parameters and gradients with fp32 master copies (True), or
            everything in fp32 (False).
        optimizer_bytes: optimizer state per parameter when it is not the table's K (16-bit
            parameters trained without fp32 master copies: Adam's two moments in 16 bits, 4).

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
    if optimizer_bytes is not None:
        state_b = optimizer_bytes
    n = float(dp)
    params = param_b / n if zero >= 3 else param_b
    grads = grad_b / n if zero >= 2 else grad_b
    states = state_b / n if zero >= 1 else state_b
    return ModelStateBytes(
        parameters=params * num_params, gradients=grads * num_params, optimizer=states * num_params
    )


def layers_per_stage(
    num_layers: int,
    pp: int,
    *,
    virtual_stages: int = 1,
    first_offset: float = 0.0,
    last_offset: float = 0.0,
    chunk_sizes: Sequence[int] | None = None,
) -> list[int]:
    """Layers on each pipeline stage.

    Without keywords: l // pp each, the first l % pp stages get one more. With virtual
    stages, offsets or explicit ``chunk_sizes`` (virtual-stage order, as
    ``parallel.layers_per_stage``): the sum over each stage's chunks of
    :func:`balanced_chunk_layers` (or of the given sizes), the split ``Plan.chunk_layers``
    uses.
    """
    if pp <= 0 or pp > num_layers:
        raise ConfigError(
            f"must be in 1..num_layers ({num_layers}), got {pp}", key_path="parallel.pp"
        )
    if chunk_sizes is None and virtual_stages == 1 and not first_offset and not last_offset:
        base, extra = divmod(num_layers, pp)
        return [base + (1 if i < extra else 0) for i in range(pp)]
    sizes = (
        list(chunk_sizes)
        if chunk_sizes is not None
        else balanced_chunk_layers(
            num_layers, pp * virtual_stages, first_offset=first_offset, last_offset=last_offset
        )
    )
    if len(sizes) % pp:
        raise ConfigError(
            f"{len(sizes)} chunk sizes do not split over pp = {pp}",
            key_path="parallel.layers_per_stage",
        )
    return [sum(sizes[s::pp]) for s in range(pp)]


def balanced_chunk_layers(
    num_layers: int, chunks: int, *, first_offset: float = 0.0, last_offset: float = 0.0
) -> list[int]:
    """Layers of each of ``chunks`` virtual pipeline stages (in virtual-stage order), as
    even as possible, where the first and the last chunk count ``first_offset`` and
    ``last_offset`` layers' worth of extra work (the embedding and the LM head + loss).

    Without offsets: l // chunks each, the first l % chunks chunks one more (l / chunks each
    when it divides, as Megatron). With offsets each chunk gets round(cumulative target) -
    round(previous target) layers over the ``num_layers + first_offset + last_offset``
    layer-equivalents, so interior chunks differ by at most one layer. Llama 3 405B on PP 16
    ("The Llama 3 Herd of Models", arXiv 2407.21783, section 3.3.2: "we remove one Transformer
    layer each from the first and the last stages") is ``first_offset = last_offset = 1``:
    126 layers -> 7 on the first and last stages, 8 on the 14 others. Megatron-LM's
    ``--decoder-first-pipeline-num-layers`` / ``--decoder-last-pipeline-num-layers`` and
    ``--account-for-embedding-in-pipeline-split`` make the same kind of split. When
    ``num_layers + 2 = chunks`` with both offsets 1 (Llama 3 405B on PP 16 x V 8: 126 layers,
    128 chunks), the first chunk holds only the embedding and the last only the head and loss
    (0 layers each), as Megatron-LM's ``get_transformer_layer_offset`` places them when both
    account-for flags count one layer each: (layers + 2) / (pp x v) per chunk, the first and
    last chunk one fewer.

    Raises:
        ConfigError: fewer layers than chunks (counting a whole offset as a layer), or a chunk
            other than an offset first / last one left without a layer.
    """
    if chunks <= 0 or num_layers + (first_offset >= 1) + (last_offset >= 1) < chunks:
        raise ConfigError(
            f"pp x virtual_stages ({chunks}) must be in 1..layers ({num_layers})",
            key_path="parallel.pp",
        )
    if not first_offset and not last_offset:
        base, extra = divmod(num_layers, chunks)
        return [base + (1 if i < extra else 0) for i in range(chunks)]
    total = num_layers + first_offset + last_offset
    per = total / chunks
    bounds = [0]
    for c in range(1, chunks):
        bounds.append(min(num_layers, max(0, round(c * per - first_offset))))
    bounds.append(num_layers)
    out = [bounds[i + 1] - bounds[i] for i in range(chunks)]
    # the embedding's (head's) chunk may hold no layer when its offset fills it (Megatron's
    # account-for-embedding / account-for-loss split with layers + 2 = pp x v)
    inner = out[1 if first_offset else 0 : chunks - 1 if last_offset else chunks]
    if not inner or min(inner) <= 0 or min(out) < 0:
        raise ConfigError(
            f"balanced split of {num_layers} layers over {chunks} chunks with offsets "
            f"({first_offset}, {last_offset}) leaves a chunk empty: {out}",
            key_path="parallel.layers_per_stage",
        )
    return out


def _split_tp(spec: TransformerSpec, tp: int) -> None:
    if tp <= 0 or spec.num_heads % tp or spec.ffn_hidden % tp:
        raise ConfigError(
            f"tp ({tp}) must divide num_heads ({spec.num_heads}) and ffn_hidden "
            f"({spec.ffn_hidden})",
            key_path="parallel.tp",
        )


def attention_parameters_per_rank(spec: TransformerSpec, tp: int) -> float:
    """One attention block's parameters on one TP rank (Megatron-Core splits).

    GQA/MHA: QKV weight and bias / t (kv heads replicated up to t when t > kv_heads, as
    Megatron requires kv_heads divisible by t or the heads repeated), output weight / t, its
    bias replicated, q/k norms replicated, sinks / t. MLA (Megatron-Core
    ``MLASelfAttention``): q and kv down projections and their norms replicated on every TP
    rank (``duplicated`` linears), q and kv up projections and the output / t.
    """
    h, a = spec.hidden, spec.num_heads
    out = spec.attention_width * h / tp
    if spec.is_mla:
        assert spec.kv_lora_rank is not None
        qk = spec.qk_head_dim
        if spec.q_lora_rank is not None:
            q = h * spec.q_lora_rank + spec.q_lora_rank + spec.q_lora_rank * a * qk / tp
        else:
            q = h * a * qk / tp
        kv_lora = spec.kv_lora_rank
        kv: float = h * (kv_lora + spec.qk_rope_head_dim) + kv_lora
        kv += kv_lora * a * (spec.qk_nope_head_dim + spec.value_head_dim) / tp
        return q + kv + out + (h if spec.bias else 0)
    d = spec.head_dim
    kv_local = 1.0 if tp > spec.kv_heads else spec.kv_heads / tp
    qkv_local = (a / tp + 2 * kv_local) * d
    params = h * qkv_local + out
    qkv_bias = spec.bias if spec.qkv_bias is None else spec.qkv_bias
    if qkv_bias:
        params += qkv_local
    if spec.bias:
        params += h
    if spec.qk_norm:
        params += 2 * d
    if spec.attention_sinks:
        params += a / tp
    return params


def _mlp_per_rank(spec: TransformerSpec, width: int, split: int) -> float:
    """A (gated) MLP with its inner width split over ``split`` ranks; the down bias
    replicated."""
    h = spec.hidden
    params = (3 if spec.gated_mlp else 2) * h * width / split
    if spec.bias:
        params += (2 * width if spec.gated_mlp else width) / split + h
    return params


def layer_parameter_split(
    spec: TransformerSpec, tp: int, *, layer: int | None = None, ep: int = 1, etp: int = 1
) -> tuple[float, float]:
    """(non-expert, routed-expert) parameters of one layer on one rank.

    The two parts are sharded and reduced over different groups (Megatron-Core folds the
    experts over tp x cp x dp ranks as etp x ep x edp): the non-expert part is split by TP and
    replicated over dp x cp; the routed experts are E / ep local experts, each with its inner
    width split by etp, replicated over edp = tp x cp x dp / (ep x etp). Shared experts and the
    router belong to the non-expert part (shared experts are TP-split like a dense MLP, the
    router replicated).
    """
    _split_tp(spec, tp)
    dense = attention_parameters_per_rank(spec, tp) + 2 * spec.norm_parameters()
    if not spec.is_moe_layer(layer):
        return dense + _mlp_per_rank(spec, spec.ffn_hidden, tp), 0.0
    if spec.shared_ffn_hidden:
        dense += _mlp_per_rank(spec, spec.shared_ffn_hidden, tp)
    dense += spec.router_parameters()
    experts = spec.num_experts / ep * _mlp_per_rank(spec, spec.expert_ffn_hidden, etp)
    return dense, experts


def layer_parameters_per_rank(
    spec: TransformerSpec, tp: int, *, layer: int | None = None, ep: int = 1, etp: int = 1
) -> float:
    """One transformer layer's parameters on one TP rank (Megatron splits).

    This is the size of an FSDP unit (one layer) or of a layer's gradients in DDP buckets.

    Column-parallel QKV and MLP up/gate: weights and biases / t. Row-parallel output projection
    and MLP down: weights / t, biases replicated. Norms replicated. MoE layers: see
    :func:`layer_parameter_split` (``layer`` None is the most common layer kind).
    """
    dense, experts = layer_parameter_split(spec, tp, layer=layer, ep=ep, etp=etp)
    return dense + experts


def parameters_per_rank(
    spec: TransformerSpec,
    *,
    tp: int = 1,
    pp: int = 1,
    stage: int = 0,
    ep: int = 1,
    etp: int = 1,
    stage_layers: Sequence[int] | None = None,
) -> float:
    """Parameters held by one rank of pipeline ``stage`` under TP size ``tp``.

    Split (Megatron-LM): transformer layers as :func:`layers_per_stage` (contiguous blocks),
    or the given ``stage_layers`` (global layer indices, e.g. ``Plan.stage_layers(stage)``);
    the word embedding is vocab-parallel (V/t rows per rank) on the first stage, with the
    learned position table replicated there; the final norm and the LM head are on the last
    stage. A tied LM head still needs the embedding matrix on the last stage when pp > 1, so
    Megatron keeps a copy there (its gradient all-reduced with the first stage's): counted on
    both stages. Routed experts are E / ep per rank, their width / etp.

    Raises:
        ConfigError: stage out of range, or heads/ffn not divisible by tp.
    """
    dense, experts = stage_parameter_split(
        spec, tp=tp, pp=pp, stage=stage, ep=ep, etp=etp, stage_layers=stage_layers
    )
    return dense + experts


def stage_parameter_split(
    spec: TransformerSpec,
    *,
    tp: int = 1,
    pp: int = 1,
    stage: int = 0,
    ep: int = 1,
    etp: int = 1,
    stage_layers: Sequence[int] | None = None,
) -> tuple[float, float]:
    """(non-expert, routed-expert) parameters on one rank of ``stage``: see
    :func:`parameters_per_rank` and :func:`layer_parameter_split`."""
    _split_tp(spec, tp)
    if not 0 <= stage < pp:
        raise ConfigError(f"must be in 0..{pp - 1}, got {stage}", key_path="stage")
    if stage_layers is None:
        counts = layers_per_stage(spec.num_layers, pp)
        first = sum(counts[:stage])
        stage_layers = range(first, first + counts[stage])
    dense = experts = 0.0
    cache: dict[bool, tuple[float, float]] = {}
    for layer in stage_layers:
        kind = spec.is_moe_layer(layer)
        if kind not in cache:
            cache[kind] = layer_parameter_split(spec, tp, layer=layer, ep=ep, etp=etp)
        d, x = cache[kind]
        dense += d
        experts += x
    word = spec.vocab * spec.hidden / tp
    if stage == 0:
        dense += word
        if spec.position_embedding == "learned":
            dense += spec.seq_len * spec.hidden
    if stage == pp - 1:
        dense += spec.norm_parameters()
        if not spec.tied_embeddings or pp > 1:
            dense += word
    return dense, experts


def moe_model_state_bytes(
    dense_params: float,
    expert_params: float,
    *,
    zero: int,
    dp_cp: int,
    edp: int,
    optimizer: str = "adam",
    mixed_precision: bool = True,
    optimizer_bytes: float | None = None,
) -> ModelStateBytes:
    """Model states of one rank of an MoE plan: the ZeRO table applied to each part over the
    group its gradients are reduced in.

    Megatron-Core (``megatron/core/distributed``: the expert parameters get their own
    distributed-optimizer buffers over the expert-data-parallel group) and torchtitan (experts
    FSDP-sharded over ``dp_shard / ep`` ranks, the ``efsdp`` mesh) both shard the non-expert
    states over the dp x cp ranks and the routed-expert states over
    edp = tp x cp x dp / (ep x etp) ranks. With Psi_d non-expert and Psi_e routed-expert
    parameters on the rank (after TP / EP / PP splitting), N = dp x cp and N_e = edp, and the
    per-parameter bytes p, g, k of :func:`model_state_bytes` (2, 2, 12 for mixed-precision
    Adam)::

        zero 0:  (p + g + k) (Psi_d + Psi_e)
        zero 1:  (p + g) (Psi_d + Psi_e) + k (Psi_d / N + Psi_e / N_e)
        zero 2:  p (Psi_d + Psi_e) + (g + k) (Psi_d / N + Psi_e / N_e)
        zero 3:  (p + g + k) (Psi_d / N + Psi_e / N_e)

    Example:
        >>> moe_model_state_bytes(1e9, 8e9, zero=1, dp_cp=64, edp=1).total / 1e9
        132.1875
    """
    a, b = (
        model_state_bytes(
            n_params,
            zero=zero,
            dp=group,
            optimizer=optimizer,
            mixed_precision=mixed_precision,
            optimizer_bytes=optimizer_bytes,
        )
        for n_params, group in ((dense_params, dp_cp), (expert_params, edp))
    )
    return ModelStateBytes(
        parameters=a.parameters + b.parameters,
        gradients=a.gradients + b.gradients,
        optimizer=a.optimizer + b.optimizer,
    )


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


def fp8_saved_input_savings(ops: Sequence[Op], mode: RecomputeMode, element_bytes: float) -> float:
    """Bytes an FP8 layer keeps less than :func:`kept_bytes` counts: the saved input of each
    linear of :data:`FP8_SAVED_INPUT_OPS` is 1 byte per element instead of ``element_bytes``.
    Nothing under full recompute (a layer then keeps only its input).

    Example:
        >>> from collsim.workload.presets import get_preset
        >>> ops = layer_ops(get_preset("gpt3-175b"), micro_batch=1, tp=8, dtype="fp8")
        >>> lin = sum(o.saved[o.name + ".input"] for o in ops if o.name in FP8_SAVED_INPUT_OPS)
        >>> fp8_saved_input_savings(ops, RecomputeMode.SELECTIVE, 2) == lin / 2
        True
    """
    if mode is RecomputeMode.FULL or element_bytes <= 1:
        return 0.0
    share = 1.0 - 1.0 / element_bytes
    return share * sum(
        op.saved.get(f"{op.name}.input", 0.0) for op in ops if op.name in FP8_SAVED_INPUT_OPS
    )


def fp8_layer_savings(
    spec: TransformerSpec,
    *,
    micro_batch: int,
    tp: int = 1,
    sequence_parallel: bool = False,
    recompute: str = "none",
    layer: int | None = None,
    ep: int = 1,
    etp: int = 1,
    cp: int = 1,
) -> float:
    """:func:`fp8_saved_input_savings` of one FP8 layer (the arguments of
    :func:`collsim.workload.ops.layer_ops`): what the step's activation memory keeps less than
    the 16-bit count."""
    ops = layer_ops(
        spec,
        micro_batch=micro_batch,
        tp=tp,
        sequence_parallel=sequence_parallel,
        dtype="fp8",
        layer=layer,
        ep=ep,
        etp=etp,
        cp=cp,
    )
    return fp8_saved_input_savings(ops, parse_recompute(recompute), activation_element_bytes("fp8"))


def activation_bytes_per_layer(
    spec: TransformerSpec,
    *,
    micro_batch: int,
    tp: int = 1,
    sequence_parallel: bool = False,
    recompute: str = "none",
    dtype: str = "bf16",
    layer: int | None = None,
    ep: int = 1,
    etp: int = 1,
    cp: int = 1,
) -> float:
    """Bytes one layer keeps from forward to backward on one rank: the sum over its ops.

    none: every tensor an op saves; selective: without the softmax output, its dropout mask and
    the dropout output; full: only the layer input (split by t with SP).

    MoE layers keep the router input and its fp32 scores (4 t E bytes), the dispatched tokens
    (the expert input, e R h bytes for R routed rows, :func:`collsim.workload.ops.routed_rows`),
    the expert activation input and the down projection input (e R f_e / etp, x 2 gated), the
    expert outputs for the combine (e R h) and the shared experts' tensors. MLA keeps the
    normed input once, the q and kv latents (and their norm inputs). With CP a rank keeps the
    tensors of its s / cp tokens. ``layer`` picks the layer kind (None: the most common).
    With ``dtype: fp8`` the inputs of the FP8 linears are kept in 1 byte
    (:func:`fp8_saved_input_savings`).
    """
    ops = layer_ops(
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
    mode = parse_recompute(recompute)
    kept = kept_bytes(ops, mode)[0]
    if str(dtype).lower() == "fp8":
        kept -= fp8_saved_input_savings(ops, mode, activation_element_bytes(dtype))
    return kept
