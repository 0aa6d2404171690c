"""Training FLOPs per step, model/hardware TFLOP/s per GPU, MFU and HFU.

Conventions (Narayanan et al. 2021, "Efficient Large-Scale Language Model Training on GPU
Clusters Using Megatron-LM", Appendix / section 5.1; the MFU/HFU terms are from Chowdhery et
al. 2022 (PaLM) Appendix B and Korthikanti et al. 2022):

- only matmul FLOPs count (2 m n k per GEMM); norms, softmax, dropout, adds are ignored;
- attention scores and attention over values are counted over the full s x s matrix (the
  causal mask is not exploited);
- backward = 2 x forward, so a step without recompute is 3 x the forward FLOPs;
- the embedding lookup costs no FLOPs; the LM head (h -> V) is a matmul, never recomputed;
- attention counts the unfused QK^T and AV matmuls even when the model runs FlashAttention
  (which executes only the causal half and recomputes QK^T in backward): FLOPs here are the
  model's, not the kernels';
- model FLOPs (MFU) count no recompute; hardware FLOPs (HFU) add the recomputed forward
  (full: every layer matmul again; selective: QK^T and attention over V again).

For a GPT layer (ffn = 4h, multi-head attention) this gives Narayanan's closed forms
(:func:`narayanan_model_flops`, :func:`narayanan_hardware_flops`); :func:`model_flops_per_step`
sums the ops of :mod:`collsim.workload.ops` and so also covers GQA and SwiGLU models.
"""

from __future__ import annotations

import dataclasses
from functools import lru_cache

from collsim.core.errors import ConfigError
from collsim.core.vocab import OpKind
from collsim.workload.model import TransformerSpec
from collsim.workload.ops import SELECTIVE_OPS, Op, head_ops, layer_ops

__all__ = [
    "narayanan_model_flops",
    "narayanan_hardware_flops",
    "forward_matmul_flops",
    "forward_layers_flops",
    "model_flops_per_step",
    "hardware_flops_per_step",
    "model_tflops_per_gpu",
    "hardware_tflops_per_gpu",
    "mfu",
    "hfu",
]


STEP_FLOPS_KEPT = 64
"""(spec, batch, recompute) entries :func:`model_flops_per_step` and
:func:`hardware_flops_per_step` keep (a bound, not a figure: a spec hashes by value)."""


def narayanan_model_flops(spec: TransformerSpec, global_batch: int) -> float:
    """72 B s l h^2 (1 + s/(6h) + V/(12 l h)): one step without recompute (Narayanan 2021)."""
    b, s, l, h, v = global_batch, spec.seq_len, spec.num_layers, spec.hidden, spec.vocab
    return 72.0 * b * s * l * h * h * (1 + s / (6 * h) + v / (12 * l * h))


def narayanan_hardware_flops(spec: TransformerSpec, global_batch: int) -> float:
    """96 B s l h^2 (1 + s/(6h) + V/(16 l h)): one step with full recompute (Narayanan 2021)."""
    b, s, l, h, v = global_batch, spec.seq_len, spec.num_layers, spec.hidden, spec.vocab
    return 96.0 * b * s * l * h * h * (1 + s / (6 * h) + v / (16 * l * h))


def _matmul_flops(ops: list[Op], names: tuple[str, ...] | None = None) -> float:
    return float(
        sum(
            op.flops
            for op in ops
            if op.kind is OpKind.MATMUL and (names is None or op.name in names)
        )
    )


def _unfused(spec: TransformerSpec) -> TransformerSpec:
    """The spec as model FLOPs count it: unfused attention, and for MoE balanced dropless
    routing (model FLOPs are the useful ones: neither capacity padding nor the busiest
    rank's excess count)."""
    changes: dict[str, object] = {}
    if spec.flash_attention:
        changes["flash_attention"] = False
    if spec.is_moe and (spec.capacity_factor is not None or spec.load_imbalance != 1.0):
        changes["capacity_factor"] = None
        changes["load_imbalance"] = 1.0
    return dataclasses.replace(spec, **changes) if changes else spec  # type: ignore[arg-type]


def forward_matmul_flops(spec: TransformerSpec, sequences: int = 1) -> tuple[float, float]:
    """(one layer, LM head) forward matmul FLOPs for ``sequences`` sequences, whole model.

    The layer is the most common kind (an MoE layer of an MoE model); see
    :func:`forward_layers_flops` for the sum over all layers."""
    layer = _matmul_flops(layer_ops(_unfused(spec), micro_batch=sequences))
    head = _matmul_flops(head_ops(spec, micro_batch=sequences))
    return layer, head


def forward_layers_flops(
    spec: TransformerSpec, sequences: int = 1, names: tuple[str, ...] | None = None
) -> float:
    """Forward matmul FLOPs of all transformer layers for ``sequences`` sequences.

    Layers differ (dense-first and MoE layers, full and sliding-window attention): each kind
    is counted once and multiplied by its number of layers. MoE layers count the router, the
    top-k routed experts of every token (E x (k tokens / E) rows) and the shared experts, so
    the MLP FLOPs are 2 x tokens x active MLP parameters (Kaplan 2020's 2 N per token with N
    the active parameters, as the DeepSeek-V3 and Megatron-Core MoE FLOPs counts do); MLA
    counts its down and up projections; sliding-window layers attend to min(w, s) keys.
    """
    base = _unfused(spec)
    return sum(
        n * _matmul_flops(layer_ops(base, micro_batch=sequences, layer=i), names)
        for i, n in spec.layer_kinds()
    )


@lru_cache(maxsize=STEP_FLOPS_KEPT)
def model_flops_per_step(spec: TransformerSpec, global_batch: int) -> float:
    """Model FLOPs of one training step: 3 x (all layers + LM head) forward matmul FLOPs
    (3 x (l x layer + LM head) for a model whose layers are all alike). Kept per (spec,
    batch): a search asks it of every plan."""
    _check_batch(global_batch)
    head = _matmul_flops(head_ops(spec, micro_batch=global_batch))
    return 3.0 * (forward_layers_flops(spec, global_batch) + head)


@lru_cache(maxsize=STEP_FLOPS_KEPT)
def hardware_flops_per_step(
    spec: TransformerSpec, global_batch: int, recompute: str = "none"
) -> float:
    """Model FLOPs plus the recomputed forward FLOPs (none / selective / full), kept as
    :func:`model_flops_per_step`."""
    _check_batch(global_batch)
    mode = str(recompute).lower()
    model = model_flops_per_step(spec, global_batch)
    if mode == "none":
        return model
    if mode == "full":
        return model + forward_layers_flops(spec, global_batch)
    if mode == "selective":
        return model + forward_layers_flops(spec, global_batch, SELECTIVE_OPS)
    raise ConfigError(
        f"must be one of none, selective, full; got {recompute!r}", key_path="training.recompute"
    )


def _check_batch(global_batch: int) -> None:
    if global_batch <= 0:
        raise ConfigError(f"must be > 0, got {global_batch}", key_path="training.global_batch")


def _per_gpu(flops: float, step_time_s: float, num_gpus: int) -> float:
    if step_time_s <= 0 or num_gpus <= 0:
        raise ConfigError(f"step_time_s and num_gpus must be > 0, got {step_time_s}, {num_gpus}")
    return flops / step_time_s / num_gpus


def model_tflops_per_gpu(
    spec: TransformerSpec, global_batch: int, step_time_s: float, num_gpus: int
) -> float:
    """Model TFLOP/s per GPU (Narayanan's "achieved teraFLOP/s per GPU" without recompute)."""
    return _per_gpu(model_flops_per_step(spec, global_batch), step_time_s, num_gpus) / 1e12


def hardware_tflops_per_gpu(
    spec: TransformerSpec,
    global_batch: int,
    step_time_s: float,
    num_gpus: int,
    recompute: str = "none",
) -> float:
    """Hardware TFLOP/s per GPU: recomputed FLOPs count too (Narayanan's Table 1 figures)."""
    flops = hardware_flops_per_step(spec, global_batch, recompute)
    return _per_gpu(flops, step_time_s, num_gpus) / 1e12


def mfu(
    spec: TransformerSpec, global_batch: int, step_time_s: float, num_gpus: int, peak_flops: float
) -> float:
    """Model FLOPs utilization: model FLOP/s per GPU over the peak FLOP/s (PaLM App. B)."""
    return model_tflops_per_gpu(spec, global_batch, step_time_s, num_gpus) * 1e12 / peak_flops


def hfu(
    spec: TransformerSpec,
    global_batch: int,
    step_time_s: float,
    num_gpus: int,
    peak_flops: float,
    recompute: str = "none",
) -> float:
    """Hardware FLOPs utilization: hardware FLOP/s per GPU over the peak FLOP/s."""
    return (
        hardware_tflops_per_gpu(spec, global_batch, step_time_s, num_gpus, recompute)
        * 1e12
        / peak_flops
    )
