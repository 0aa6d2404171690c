"""Block times of a plan: each layer kind, the embedding and the head for one micro-batch.

The compute model of the plan's device and training settings prices the workload's ops
(:class:`~collsim.workload.compute.ComputeModel`), or measured overrides replace them
(:data:`BLOCK_OVERRIDE_KEYS`); a block keeps the parts the step program places apart: the dgrad
of its column-parallel linears, core attention, routed experts, weight gradients, FP8 weights,
each TP linear, and its activations.
"""

from __future__ import annotations

from dataclasses import replace
from typing import TYPE_CHECKING, Any

from collsim.core.vocab import Dtype
from collsim.parallel.config import ParallelConfig, TrainingConfig
from collsim.parallel.plan import Plan
from collsim.step.ops import BlockTimes
from collsim.step.shapes import ShapeCache
from collsim.step.torch_cp import CHUNK_OPS, chunk_times
from collsim.workload.compute import ComputeModel
from collsim.workload.fp8 import FP8Casts, weight_cache_of
from collsim.workload.memory import fp8_layer_savings
from collsim.workload.op_records import activation_element_bytes
from collsim.workload.torch_cp import buffer_bytes, is_torch_cp

if TYPE_CHECKING:
    from collsim.cluster.hardware import Device
    from collsim.workload.compute import LayerTimes
    from collsim.workload.model import TransformerSpec

__all__ = [
    "BLOCK_OVERRIDE_KEYS",
    "block_times",
    "fp8_casts_of",
    "paced",
    "memory_bound_share",
]


BLOCK_OVERRIDE_KEYS = (
    "layer.forward",
    "layer.backward",
    "layer.recompute",
    "layer.wgrad",
    "embedding.forward",
    "embedding.backward",
    "head.forward",
    "head.backward",
    "head.wgrad",
    "optimizer",
)
"""Override keys for whole blocks (seconds per micro-batch; optimizer: per step; ``*.wgrad``:
the weight-gradient part of that backward, what a split backward runs as its W op). Any other
key is an op name of the workload (``qkv_proj``, ``softmax.backward``, ...)."""


_ATTENTION_OPS = (
    frozenset(("flash_attention", "attn_scores", "softmax", "attn_dropout", "attn_values"))
    | CHUNK_OPS
)
"""Core-attention ops of the workload (what a CP ring step overlaps)."""


_EXPERT_OPS = frozenset(("expert_up", "expert_activation", "expert_down"))
"""Routed-expert GEMMs of the workload (between the EP dispatch and combine)."""


def _compute_model(
    device: Device, plan: Plan, op_over: dict[str, float], cache: ShapeCache | None
) -> ComputeModel:
    """The compute model of a plan's device and training settings (one per distinct setting
    in a ``cache``: its memo of layer prices then serves every plan that shares it)."""
    training = plan.training
    kwargs: dict[str, Any] = {
        "fp8_casts": fp8_casts_of(plan),
        "overrides": op_over,
        "attention_kernel": training.attention_kernel,
        "execution": str(training.execution),
        "fused_kernels": bool(training.fused_kernels),
    }
    dtype = str(training.dtype)
    if cache is None:
        return ComputeModel(device, dtype, **kwargs)
    key = (
        device,
        dtype,
        tuple(
            sorted(
                (k, tuple(sorted(v.items())) if isinstance(v, dict) else v)
                for k, v in kwargs.items()
            )
        ),
    )
    return cache.get("compute", key, lambda: ComputeModel(device, dtype, **kwargs))


def block_times(
    plan: Plan, device: Device, overrides: dict[str, float], cache: ShapeCache | None = None
) -> tuple[dict[int, BlockTimes], BlockTimes, BlockTimes, ComputeModel]:
    """Seconds of each layer kind (by its representative layer index), the embedding and the
    head per micro-batch (compute model or overrides), with the dgrad time of their
    column-parallel linears and the core-attention / expert seconds of a layer."""

    op_over = {k: v for k, v in overrides.items() if k not in BLOCK_OVERRIDE_KEYS}
    tr = plan.training
    model = _compute_model(device, plan, op_over, cache)
    mb, tp, sp = plan.training.micro_batch, plan.tp, plan.parallel.sequence_parallel
    spec = plan.spec
    variant = spec.is_moe or spec.is_mla or spec.sliding_window is not None or plan.cp > 1
    et = model.embedding_times(spec, micro_batch=mb, tp=tp, sequence_parallel=sp)
    ht = model.head_times(spec, micro_batch=mb, tp=tp, sequence_parallel=sp)

    def pick(key: str, value: float) -> float:
        return float(overrides.get(key, value))

    def dgrad(times: LayerTimes, names: tuple[str, ...], backward_s: float) -> tuple[float, ...]:
        """Half the backward of each named linear (its dgrad), scaled like an overridden block."""
        scale = backward_s / times.backward_s if times.backward_s > 0 else 0.0
        by_name = {o.name: o.time_s for o in times.ops if o.phase == "backward"}
        return tuple(by_name.get(n, 0.0) / 2 * scale for n in names)

    def part(
        times: LayerTimes, names: frozenset[str], fwd: float, bwd: float
    ) -> tuple[float, float]:
        f = sum(o.time_s for o in times.ops if o.phase == "forward" and o.name in names)
        b = sum(o.time_s for o in times.ops if o.phase == "backward" and o.name in names)
        fs = fwd / times.forward_s if times.forward_s > 0 else 0.0
        bs = bwd / times.backward_s if times.backward_s > 0 else 0.0
        return (f * fs, b * bs)

    reps = [r for r, _ in spec.layer_kinds()] if variant else [0]
    layers: dict[int, BlockTimes] = {}
    cp_how = _torch_cp_of(plan)
    for rep in reps:
        kinds: dict[str, Any] = (
            {"layer": rep, "ep": plan.ep, "etp": plan.etp, "cp": plan.cp} if variant else {}
        )
        lt = model.layer_times(
            spec,
            micro_batch=mb,
            tp=tp,
            sequence_parallel=sp,
            recompute=str(tr.recompute),
            **kinds,
            **cp_how,
        )
        fwd = pick("layer.forward", lt.forward_s)
        bwd = pick("layer.backward", lt.backward_s)
        kept = lt.activation_bytes - _fp8_saved(plan, kinds)
        layers[rep] = BlockTimes(
            fwd,
            bwd,
            pick("layer.recompute", lt.recompute_s),
            kept,
            lt.transient_bytes,
            column_dgrad_s=dgrad(lt, ("mlp_up", "qkv_proj"), bwd),
            attention_s=part(lt, _ATTENTION_OPS, fwd, bwd),
            experts_s=part(lt, _EXPERT_OPS, fwd, bwd),
            wgrad_s=pick("layer.wgrad", _scaled_wgrad(lt, bwd)),
            fp8_weights=lt.fp8_weights,
            linears_s=_linears(lt, fwd, bwd),
            fp8_linears=model.fp8_linears(lt),
            **_torch_cp_fields(plan, lt, fwd, bwd),
        )
    # a CP rank embeds and scores its s / cp tokens: the embedding and head ops are linear in
    # the tokens (lookup, LM-head GEMM rows, loss), so their times and activations scale 1 / cp
    k = 1.0 / plan.cp
    head_bwd = pick("head.backward", ht.backward_s * k)
    emb = BlockTimes(
        pick("embedding.forward", et.forward_s * k),
        pick("embedding.backward", et.backward_s * k),
        0.0,
        et.activation_bytes * k,
    )
    head = BlockTimes(
        pick("head.forward", ht.forward_s * k),
        head_bwd,
        0.0,
        ht.activation_bytes * k,
        column_dgrad_s=dgrad(ht, ("lm_head",), head_bwd),
        wgrad_s=pick("head.wgrad", _scaled_wgrad(ht, head_bwd)),
    )
    return layers, emb, head, model


def fp8_casts_of(plan: Plan) -> FP8Casts | None:
    """How the plan's stack quantizes around its FP8 linears: Transformer Engine's casts
    (:class:`~collsim.workload.fp8.FP8Casts`) under ``megatron_te`` with ``dtype: fp8``, with
    the weight cache (``training.fp8_weight_cache``), FP8 parameters (the plan's FP8 weight
    gather) and input quantization fused into the norms; None otherwise (torchao's casts)."""
    tr = plan.training
    if str(tr.dtype) != "fp8" or tr.stack != "megatron_te":
        return None
    return FP8Casts(
        recipe=str(tr.fp8_recipe or "tensorwise"),
        weight_cache=weight_cache_of(tr.stack, tr.fp8_weight_cache, zero=plan.parallel.zero),
        param_gather=bool(plan.parallel.fsdp.fp8_all_gather),
        fused_norm=True,
    )


def _linears(
    times: LayerTimes, forward_s: float, backward_s: float
) -> tuple[tuple[str, float, float, float], ...]:
    """Per TP linear of a layer (``qkv_proj``, ``out_proj``, ``mlp_up``, ``mlp_down``):
    (forward, dgrad, wgrad) seconds, scaled like the block when an override replaced it (what
    the overlapped tensor parallelism of :mod:`collsim.parallel.tp_overlap` chunks)."""
    fs = forward_s / times.forward_s if times.forward_s > 0 else 0.0
    bs = backward_s / times.backward_s if times.backward_s > 0 else 0.0
    out: dict[str, tuple[float, float, float]] = {}
    for o in times.ops:
        if o.name not in _TP_LINEARS or o.phase == "recompute":
            continue
        f, d, w = out.get(o.name, (0.0, 0.0, 0.0))
        if o.phase == "forward":
            f = o.time_s * fs
        else:
            w = o.wgrad_s * bs
            d = (o.time_s - o.wgrad_s) * bs
        out[o.name] = (f, d, w)
    return tuple((name, *out[name]) for name in sorted(out))


_TP_LINEARS = frozenset(("qkv_proj", "out_proj", "mlp_up", "mlp_down"))


def _fp8_saved(plan: Plan, kinds: dict[str, Any]) -> float:
    """What an FP8 layer keeps less than its 16-bit count (its FP8 linears keep 1-byte
    inputs: :func:`collsim.workload.memory.fp8_layer_savings`); 0 for other dtypes."""
    tr = plan.training
    if Dtype(tr.dtype) is not Dtype.FP8:
        return 0.0
    return fp8_layer_savings(
        plan.spec,
        micro_batch=tr.micro_batch,
        tp=plan.tp,
        sequence_parallel=plan.parallel.sequence_parallel,
        recompute=str(tr.recompute),
        **kinds,
    )


def _torch_cp_of(plan: Plan) -> dict[str, Any]:
    """The layer-times arguments of torch's context parallelism (none for other plans, so
    they share the memo of the plain CP layer)."""
    algorithm = str(plan.parallel.cp_algorithm)
    if plan.cp < 2 or not is_torch_cp(algorithm):
        return {}
    return {"cp_algorithm": algorithm, "cp_load_balance": plan.parallel.cp_load_balance}


def _torch_cp_fields(plan: Plan, times: LayerTimes, fwd: float, bwd: float) -> dict[str, Any]:
    """The block's fields of torch's context parallelism (its CP steps' seconds and its
    attention's buffers); none for other plans."""
    if not _torch_cp_of(plan):
        return {}
    return {"cp_chunks_s": _chunks(times, fwd, bwd), "cp_buffer_bytes": _cp_buffers(plan)}


def _cp_buffers(plan: Plan) -> tuple[float, float]:
    """Bytes a layer's attention holds beyond its kept activations under torch's context
    parallelism, forward and backward, on the busiest rank
    (:func:`collsim.workload.torch_cp.buffer_bytes`; K and V of every query head of the TP
    rank, as :func:`collsim.workload.torch_cp.torch_cp_attention_ops` prices them)."""
    spec, tr = plan.spec, plan.training
    return buffer_bytes(
        micro_batch=tr.micro_batch,
        local_tokens=spec.seq_len // plan.cp,
        cp=plan.cp,
        heads=spec.num_heads // plan.tp,
        key_dim=spec.qk_head_dim,
        value_dim=spec.value_head_dim,
        element_bytes=activation_element_bytes(str(tr.dtype)),
        algorithm=str(plan.parallel.cp_algorithm),
        load_balance=plan.parallel.cp_load_balance,
    )


def _chunks(
    times: LayerTimes, fwd: float, bwd: float
) -> tuple[tuple[float, ...], tuple[float, ...]]:
    """Seconds of each torch CP step (its SDPA call and merge) in forward and backward,
    scaled like an overridden block (:func:`collsim.step.torch_cp.chunk_times`)."""
    fs = fwd / times.forward_s if times.forward_s > 0 else 0.0
    bs = bwd / times.backward_s if times.backward_s > 0 else 0.0
    return chunk_times(times.ops, "forward", fs), chunk_times(times.ops, "backward", bs)


def _scaled_wgrad(times: LayerTimes, backward_s: float) -> float:
    """The weight-gradient part of a block's backward (compute model), scaled like the block
    when an override replaced its backward."""
    return times.wgrad_s * backward_s / times.backward_s if times.backward_s > 0 else 0.0


def paced(block: BlockTimes, factor: float) -> BlockTimes:
    """A block's compute seconds times ``factor`` (activations unchanged)."""
    return replace(
        block,
        forward_s=block.forward_s * factor,
        backward_s=block.backward_s * factor,
        recompute_s=block.recompute_s * factor,
        column_dgrad_s=tuple(d * factor for d in block.column_dgrad_s),
        attention_s=(block.attention_s[0] * factor, block.attention_s[1] * factor),
        experts_s=(block.experts_s[0] * factor, block.experts_s[1] * factor),
        wgrad_s=block.wgrad_s * factor,
        linears_s=tuple((n, f * factor, d * factor, w * factor) for n, f, d, w in block.linears_s),
        cp_chunks_s=(
            tuple(c * factor for c in block.cp_chunks_s[0]),
            tuple(c * factor for c in block.cp_chunks_s[1]),
        ),
    )


def memory_bound_share(
    plan: Plan,
    spec: TransformerSpec,
    training: TrainingConfig,
    parallel: ParallelConfig,
    model: ComputeModel,
) -> float:
    """The memory-bound share of a dense layer's forward, backward and recompute time."""
    lt0 = model.layer_times(
        spec,
        micro_batch=training.micro_batch,
        tp=plan.tp,
        sequence_parallel=parallel.sequence_parallel,
        recompute=str(training.recompute),
    )
    block = lt0.forward_s + lt0.backward_s + lt0.recompute_s
    return min(1.0, lt0.memory_bound_s / block) if block > 0 else 0.0
