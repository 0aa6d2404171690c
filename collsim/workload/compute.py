"""Compute-time model: the times of whole blocks (layer, embedding, head) and optimizer steps.

:class:`ComputeModel` prices each op of a block with :class:`~collsim.workload.op_costs.OpCostModel`
(kernel rates per device, per op, per phase) and sums forward, backward and recompute, with the
activations the block keeps; the optimizer step is memory-bound over the rank's parameters.
Derivations, measurements and sources: docs/derivations.md, ``collsim.workload.op_costs``.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from functools import cached_property

from collsim.core.errors import ConfigError
from collsim.core.vocab import OpKind, RecomputeMode
from collsim.workload.model import TransformerSpec
from collsim.workload.op_costs import OpCost, OpCostModel
from collsim.workload.ops import (
    SELECTIVE_OPS,
    Op,
    embedding_ops,
    head_ops,
    kept_bytes,
    kept_tensors,
    layer_ops,
    parse_recompute,
)

__all__ = [
    "LayerTimes",
    "ComputeModel",
    "optimizer_bytes_per_param",
]


OPTIMIZER_BYTES_PER_PARAM: dict[tuple[str, bool, str], float] = {
    ("adam", True, "fused"): 30.0,
    ("adam", False, "fused"): 28.0,
    ("sgd", True, "fused"): 22.0,
    ("sgd", False, "fused"): 20.0,
    ("adam", True, "foreach"): 82.0,
    ("adam", False, "foreach"): 80.0,
    ("sgd", True, "foreach"): 30.0,
    ("sgd", False, "foreach"): 28.0,
}
"""HBM bytes per parameter of one optimizer step (fp32 state), by (optimizer, mixed precision,
implementation). fused (one kernel reading and writing each state once; apex / TE / torch
``fused=True``): Adam reads master, grad, m, v (16) and writes master, m, v (12) = 28, + the
16-bit model copy (2) = 30 in mixed precision; SGD with momentum 20 / 22. foreach (torch's
multi-tensor default, and per-parameter loops): counted from torch.optim.adam
``_multi_tensor_adam`` for AdamW: p.mul_ (8), m.lerp_ (12), v.mul_ + addcmul_ (20),
sqrt / div_ / add_ for the denominator (24), p.addcdiv_ (16) = 80 bytes (+2 for a 16-bit
copy); SGD momentum: buf.mul_().add_() (20) + p.add_ (8) = 28 (+2)."""


def optimizer_bytes_per_param(optimizer: str, dtype: str, implementation: str = "fused") -> float:
    """HBM bytes one optimizer step moves per parameter (:data:`OPTIMIZER_BYTES_PER_PARAM`)."""
    opt = str(optimizer).lower()
    mixed = str(dtype).lower() != "fp32"
    key = (opt, mixed, str(implementation).lower())
    if key not in OPTIMIZER_BYTES_PER_PARAM:
        if (opt, mixed, "fused") not in OPTIMIZER_BYTES_PER_PARAM:
            raise ConfigError(
                f"must be one of adam, sgd; got {optimizer!r}", key_path="training.optimizer"
            )
        raise ConfigError(
            f"must be one of fused, foreach; got {implementation!r}",
            key_path="training.optimizer_implementation",
        )
    return OPTIMIZER_BYTES_PER_PARAM[key]


@dataclass(frozen=True, slots=True, kw_only=True)
class LayerTimes:
    """Times of one layer (or the embedding / head) on one rank for one micro-batch.

    ``backward_s`` excludes recomputation; the backward pass of a step costs
    ``backward_s + recompute_s`` (the recomputed forward runs just before the backward).
    ComputeModel memoizes these per argument set: treat them as read-only.
    """

    forward_s: float
    backward_s: float
    recompute_s: float
    ops: tuple[OpCost, ...] = ()
    activation_bytes: float = 0.0
    """Bytes kept from forward to backward (Korthikanti's per-layer activation memory)."""
    transient_bytes: float = 0.0
    """Extra bytes rebuilt during the backward of this layer when it recomputes (0 otherwise)."""
    forward_flops: float = 0.0
    backward_flops: float = 0.0
    recompute_flops: float = 0.0
    attention_kernel: str = ""
    """The attention kernel the times assume (``flash2``... or ``eager``; empty outside layers)."""
    memory_bound_s: float = 0.0
    """Time of the memory-bound ops (all phases): the share ``overlap_slowdown`` weights by HBM
    contention rather than SM loss."""
    wgrad_s: float = 0.0
    """The weight-gradient part of ``backward_s``: of each linear's backward, the share of its
    dB GEMM in the two GEMMs' times (what a split backward runs as its weight-gradient op)."""
    fp8_weights: tuple[float, float, int] = (0.0, 0.0, 0)
    """With Transformer Engine's FP8 casts (``fp8_casts``): the FP8 weight elements of the
    block on the rank, (non-expert, routed-expert), and its FP8 linears (their once-per-step
    casts are priced by the step, :func:`collsim.workload.fp8.weight_cast_bytes_per_step`)."""
    kept_tensor_bytes: tuple[float, ...] = ()
    """A layer's kept tensors one by one (they add up to ``activation_bytes``;
    :func:`collsim.workload.op_records.kept_tensors`): what the caching allocator replay
    allocates (:mod:`collsim.step.allocator`)."""
    rebuilt_tensor_bytes: tuple[float, ...] = ()
    """A layer's recomputed tensors one by one (they add up to ``transient_bytes``)."""


class ComputeModel(OpCostModel):
    """Kernel-level compute times of transformer ops and whole blocks on one device.

    Takes the arguments of :class:`~collsim.workload.op_costs.OpCostModel`, which prices each
    op; this class sums the ops of a layer, the embedding and the head, and memoizes the block
    times per argument set.

    Example:
        >>> model = ComputeModel(get_device("a100"), "bf16")            # doctest: +SKIP
        >>> model.layer_times(get_preset("megatron-22b"), micro_batch=4, tp=8).forward_s
    """

    @cached_property
    def _memo(self) -> dict[tuple[object, ...], LayerTimes]:
        """Block times by argument set (made on first use)."""
        return {}

    # ---- whole blocks ----------------------------------------------------------------------
    def _times(
        self, ops: list[Op], recompute: RecomputeMode, layer: bool, kernel: str = ""
    ) -> LayerTimes:
        costs: list[OpCost] = []
        forward = backward = again = 0.0
        fwd_flops = bwd_flops = re_flops = 0.0
        memory_s = wgrad = 0.0
        for op in ops:
            fc = self.op_cost(op, "forward")
            bc = self.op_cost(op, "backward")
            costs += [fc, bc]
            forward += fc.time_s
            backward += bc.time_s
            if op.weight_gradient:
                wgrad += bc.wgrad_s if bc.bound != "override" else bc.time_s * self._wgrad_share(op)
            fwd_flops += op.flops
            bwd_flops += op.backward_flops
            if fc.bound == "memory":
                memory_s += fc.time_s
            if bc.bound == "memory":
                memory_s += bc.time_s
            if recompute is RecomputeMode.FULL or (
                recompute is RecomputeMode.SELECTIVE and op.name in SELECTIVE_OPS
            ):
                rc = dataclasses.replace(fc, phase="recompute")
                costs.append(rc)
                again += rc.time_s
                re_flops += op.flops
                if rc.bound == "memory":
                    memory_s += rc.time_s
        kept, transient = (
            kept_bytes(ops, recompute) if layer else (float(sum(op.saved_bytes for op in ops)), 0.0)
        )
        kept_each, rebuilt_each = kept_tensors(ops, recompute) if layer else ((), ())
        return LayerTimes(
            forward_s=forward,
            backward_s=backward,
            recompute_s=again,
            ops=tuple(costs),
            activation_bytes=kept,
            transient_bytes=transient,
            forward_flops=fwd_flops,
            backward_flops=bwd_flops,
            recompute_flops=re_flops,
            attention_kernel=kernel,
            memory_bound_s=memory_s,
            wgrad_s=wgrad,
            fp8_weights=self._fp8_weights(ops),
            kept_tensor_bytes=kept_each,
            rebuilt_tensor_bytes=rebuilt_each,
        )

    def fp8_linears(self, times: LayerTimes) -> int:
        """The FP8 linears of a block (ops of ``times`` that this model runs in FP8)."""
        if self.dtype != "fp8":
            return 0
        return sum(
            1
            for c in times.ops
            if c.phase == "forward" and c.kind is OpKind.MATMUL and c.name in self._fp8_ops
        )

    def _fp8_weights(self, ops: list[Op]) -> tuple[float, float, int]:
        """(non-expert, routed-expert) FP8 weight elements of ``ops`` and their FP8 linears,
        with Transformer Engine's casts (zeros otherwise)."""
        if self.fp8_casts is None or self.dtype != "fp8":
            return (0.0, 0.0, 0)
        dense = expert = 0.0
        count = 0
        for op in ops:
            if op.kind is OpKind.MATMUL and op.name in self._fp8_ops and op.gemms:
                g = op.gemms[0]
                elements = float(g.batch * g.k * g.n)
                count += 1
                if op.name.startswith("expert_"):
                    expert += elements
                else:
                    dense += elements
        return (dense, expert, count)

    def _wgrad_share(self, op: Op) -> float:
        """The weight-gradient GEMM's share of a linear's backward time (dA and dB priced
        apart, each as :meth:`gemm_time_s` prices it)."""
        if len(op.backward_gemms) != 2:
            return 0.5
        fp8 = self.dtype == "fp8" and op.name in self._fp8_ops
        dtype = self.dtype if fp8 or self.dtype != "fp8" else "bf16"
        d_input = self.gemm_time_s(op.backward_gemms[0], dtype)[0]
        d_weight = self.gemm_time_s(op.backward_gemms[1], dtype)[0]
        total = d_input + d_weight
        return d_weight / total if total > 0 else 0.5

    def _spec_for(self, spec: TransformerSpec) -> tuple[TransformerSpec, str]:
        """The spec with ``flash_attention`` as the attention kernel decides, and the kernel."""
        if self.attention_kernel is None:
            return spec, self._kernel_name(
                spec.flash_attention
            ) if spec.flash_attention else "eager"
        fused = self.attention_kernel != "eager"
        if fused != spec.flash_attention:
            spec = dataclasses.replace(spec, flash_attention=fused)
        return spec, self.attention_kernel if fused else "eager"

    def _with_style(self, spec: TransformerSpec) -> None:
        self._norm = spec.norm
        self._gated = spec.gated_mlp

    def layer_times(
        self,
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
        cp_algorithm: str = "ring",
        cp_load_balance: bool = True,
    ) -> LayerTimes:
        """Forward, backward and recompute times of ONE transformer layer on one rank.

        Excludes tensor-parallel communication (2 all-reduces forward and 2 backward, or their
        reduce-scatter + all-gather halves with SP): the engine schedules those.

        Args:
            spec: the model.
            micro_batch: sequences per micro-batch.
            tp: tensor-parallel size.
            sequence_parallel: Megatron sequence parallelism.
            recompute: ``none``, ``selective`` (core attention) or ``full`` (whole layer).
            layer, ep, etp, cp: which layer (its kind: dense / MoE, full / windowed
                attention; None the most common) and the expert / context split, passed to
                :func:`collsim.workload.ops.layer_ops`.
            cp_algorithm, cp_load_balance: how the CP ranks attend (torch's context
                parallelism: one SDPA call per KV chunk) and the causal balancing.
        """
        mode = parse_recompute(recompute)
        key = (
            "layer",
            spec,
            micro_batch,
            tp,
            bool(sequence_parallel),
            mode,
            layer,
            ep,
            etp,
            cp,
        ) + (cp_algorithm, cp_load_balance)
        if key not in self._memo:
            run_spec, kernel = self._spec_for(spec)
            self._with_style(run_spec)
            ops = layer_ops(
                run_spec,
                micro_batch=micro_batch,
                tp=tp,
                sequence_parallel=sequence_parallel,
                dtype=self.dtype,
                layer=layer,
                ep=ep,
                etp=etp,
                cp=cp,
                cp_algorithm=cp_algorithm,
                cp_load_balance=cp_load_balance,
            )
            self._memo[key] = self._times(ops, mode, layer=True, kernel=kernel)
        return self._memo[key]

    def embedding_times(
        self,
        spec: TransformerSpec,
        *,
        micro_batch: int,
        tp: int = 1,
        sequence_parallel: bool = False,
    ) -> LayerTimes:
        """Input embedding (lookup, position add, dropout) on one rank; never recomputed."""
        key = ("embedding", spec, micro_batch, tp, bool(sequence_parallel))
        if key not in self._memo:
            self._with_style(spec)
            ops = embedding_ops(
                spec,
                micro_batch=micro_batch,
                tp=tp,
                sequence_parallel=sequence_parallel,
                dtype=self.dtype,
            )
            self._memo[key] = self._times(ops, RecomputeMode.NONE, layer=False)
        return self._memo[key]

    def head_times(
        self,
        spec: TransformerSpec,
        *,
        micro_batch: int,
        tp: int = 1,
        sequence_parallel: bool = False,
    ) -> LayerTimes:
        """Final norm, LM head and cross-entropy loss on one rank; never recomputed."""
        key = ("head", spec, micro_batch, tp, bool(sequence_parallel))
        if key not in self._memo:
            self._with_style(spec)
            ops = head_ops(
                spec,
                micro_batch=micro_batch,
                tp=tp,
                sequence_parallel=sequence_parallel,
                dtype=self.dtype,
            )
            self._memo[key] = self._times(ops, RecomputeMode.NONE, layer=False)
        return self._memo[key]

    def optimizer_time_s(
        self, num_params_local: float, optimizer: str = "adam", implementation: str = "fused"
    ) -> float:
        """Time of one optimizer step over ``num_params_local`` parameters: bytes / bandwidth.

        Bytes per parameter from :func:`optimizer_bytes_per_param` (``fused``: one kernel per
        chunk of tensors; ``foreach``: torch's multi-tensor default, five passes); memory
        bound at the access-size bandwidth; the launch cost is charged once (fused) or once
        per pass (foreach). A measured profile's optimizer bandwidth replaces the HBM curve.
        """
        if num_params_local < 0:
            raise ConfigError(f"must be >= 0, got {num_params_local}", key_path="num_params")
        if num_params_local == 0:
            return 0.0
        per_param = optimizer_bytes_per_param(optimizer, self.dtype, implementation)
        size = num_params_local * per_param
        measured = getattr(self.measured, "optimizer_bytes_per_s", None)
        passes = 1 if implementation == "fused" else 5
        if measured:
            return size / float(measured) + self.launch_s * passes
        bandwidth = self.memory_bandwidth_at(size / passes)
        return size / bandwidth + self.launch_s * passes
