"""Closed-form step time and memory of a parallel plan, for ranking plans in a search.

The estimate is a sum of named parts, in the decomposition of Narayanan et al. 2021
("Efficient Large-Scale Language Model Training on GPU Clusters Using Megatron-LM", SC21,
sections 2-3) and of Calculon (Isaev et al. 2023, ``get_total_time``: compute + exposed TP / PP /
DP communication + bubble + optimizer):

- **compute** = m x (t_f + t_b) of the slowest pipeline stage, where t_f and t_b are one
  micro-batch's forward and backward (+ recompute) through the stage's layers, from the
  workload layer's roofline :class:`~collsim.workload.ComputeModel`; the first stage adds the
  embedding, the last the LM head and loss.
- **bubble** = (p - 1) / v x (t_f + t_b) (GPipe and 1F1B: v = 1; interleaved 1F1B with v model
  chunks per stage divides it by v; Narayanan 2021 section 2.2).
- **tp_exposed**: Megatron TP does 2 all-reduces of s b h activations per layer in forward and 2
  in backward (+2 in a fully recomputed forward); with sequence parallelism each becomes a
  reduce-scatter + all-gather (Korthikanti 2022). They block compute, so all of it is exposed.
- **pp_exposed**: 2 point-to-point sends of s b h / t bytes (Megatron's scatter-gather over TP)
  per micro-batch and model chunk, blocking in 1F1B, plus 2 (p - 1) on the fill and drain.
- **dp_exposed**: gradients of the stage's parameters (the dtype's bytes each): all-reduce in
  buckets for DDP (ZeRO-0), reduce-scatter in buckets + all-gather of the updated parameters for
  ZeRO-1/2, and per micro-batch all-gather (forward and backward) + reduce-scatter for ZeRO-3.
  Bucketed gradient traffic overlaps the backward of the last micro-batch when
  ``ddp.overlap`` (all but the last bucket can hide); ZeRO-3 traffic of each layer overlaps
  the compute of the layer before it (prefetch), forward and backward separately, and only
  what exceeds it is exposed.
- **optimizer** = the memory-bound optimizer step over the parameters this GPU updates.

Every collective is timed by the closed form of :func:`collsim.collectives.cost` on the real
ranks of the group (TP innermost, then PP, then DP, as the engine maps them), so NVLink vs
network and hierarchical algorithms come from the topology.

Memory per GPU (first stage, the one holding the most activations): model states from the ZeRO
table (:func:`collsim.workload.model_state_bytes`), activations per layer from Korthikanti 2022
(:func:`collsim.workload.activation_bytes_per_layer`) x layers per stage x micro-batches in
flight (GPipe m, 1F1B min(p, m), interleaved p (1 + (p - 1) / (p v)); Narayanan 2021 section
2.2.2), plus the full-recompute rebuild of one layer, ZeRO-3 gathered units and DDP buckets.

The estimate ignores contention between concurrent collectives, link sharing between TP, PP and
DP traffic, stragglers and the memory timeline: the discrete-event engine re-simulates the best
plans for that.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from collsim.errors import InfeasibleError

if TYPE_CHECKING:  # pragma: no cover
    from collsim.parallel.config import ParallelConfig, TrainingConfig
    from collsim.topology import Topology
    from collsim.workload.model import TransformerSpec

__all__ = ["Estimate", "Estimator", "estimate_step"]

_MB_TORCH = float(1 << 20)  # torch's bucket_cap_mb counts MiB


@dataclass(frozen=True, slots=True, kw_only=True)
class Estimate:
    """Closed-form figures of one plan (seconds, bytes, FLOP/s)."""

    step_time_s: float
    breakdown_s: dict[str, float]
    """compute, tp_exposed, pp_exposed, dp_exposed, bubble, optimizer (sum = step time)."""
    memory_bytes: dict[str, float]
    """parameters, gradients, optimizer, activations, buffers on the first-stage GPU."""
    memory_peak_bytes: float
    memory_capacity_bytes: float
    fits: bool
    num_gpus: int
    num_microbatches: int
    tokens_per_s: float
    model_tflops_per_gpu: float
    mfu: float
    details: dict[str, Any] = field(default_factory=dict)


class Estimator:
    """Estimates plans of one model on one cluster; caches compute and collective costs.

    Args:
        topology: the cluster (its GPU count is the plans' tp x pp x dp).
        spec: the model.
    """

    def __init__(self, topology: Topology, spec: TransformerSpec) -> None:
        from collsim.workload import ComputeModel

        self.topology = topology
        self.spec = spec
        self._compute: dict[str, Any] = {}
        self._compute_model: dict[str, ComputeModel] = {}
        self._layer: dict[tuple[Any, ...], Any] = {}
        self._coll: dict[tuple[Any, ...], float] = {}
        self._groups: dict[tuple[int, ...], Any] = {}
        self._ComputeModel = ComputeModel
        self._flops: dict[int, float] = {}

    # -- cached building blocks ----------------------------------------------------------------
    def _model(self, dtype: str) -> Any:
        if dtype not in self._compute_model:
            self._compute_model[dtype] = self._ComputeModel(self.topology.device, dtype)
        return self._compute_model[dtype]

    def _times(
        self, kind: str, dtype: str, micro_batch: int, tp: int, sp: bool, recompute: str
    ) -> Any:
        key = (kind, dtype, micro_batch, tp, sp, recompute)
        if key not in self._layer:
            model = self._model(dtype)
            if kind == "layer":
                value = model.layer_times(
                    self.spec,
                    micro_batch=micro_batch,
                    tp=tp,
                    sequence_parallel=sp,
                    recompute=recompute,
                )
            elif kind == "embedding":
                value = model.embedding_times(
                    self.spec, micro_batch=micro_batch, tp=tp, sequence_parallel=sp
                )
            else:
                value = model.head_times(
                    self.spec, micro_batch=micro_batch, tp=tp, sequence_parallel=sp
                )
            self._layer[key] = value
        return self._layer[key]

    def _group(self, ranks: tuple[int, ...]) -> Any:
        if ranks not in self._groups:
            from collsim.collectives import Group

            self._groups[ranks] = Group(self.topology, ranks)
        return self._groups[ranks]

    def collective_s(self, op: str, size_bytes: float, ranks: tuple[int, ...]) -> float:
        """Closed-form time of one collective on these ranks (0 for a group of one)."""
        if len(ranks) < 2 or size_bytes <= 0:
            return 0.0
        size = int(size_bytes)
        key = (op, size, ranks)
        if key not in self._coll:
            from collsim.collectives import CollectiveOp, cost

            self._coll[key] = float(cost(CollectiveOp(op), size, self._group(ranks)).time_s)
        return self._coll[key]

    def _model_flops(self, global_batch: int) -> float:
        if global_batch not in self._flops:
            from collsim.workload import model_flops_per_step

            self._flops[global_batch] = model_flops_per_step(self.spec, global_batch)
        return self._flops[global_batch]

    # -- the estimate --------------------------------------------------------------------------
    def estimate(self, training: TrainingConfig, parallel: ParallelConfig) -> Estimate:
        """Step time, breakdown and memory of one plan (see the module docstring).

        Raises:
            InfeasibleError: tp x pp x dp is not the cluster's size (reason ``world_size``), or
                the global batch does not split into dp x micro-batch (reason ``batch``).
        """
        from collsim.workload import activation_bytes_per_layer, model_state_bytes
        from collsim.workload.memory import layers_per_stage, parameters_per_rank

        spec, topo = self.spec, self.topology
        tp, pp, dp, v = parallel.tp, parallel.pp, parallel.dp, parallel.virtual_stages
        num_gpus = tp * pp * dp
        if num_gpus != topo.num_ranks:
            raise InfeasibleError(
                f"tp x pp x dp = {num_gpus} is not {topo.num_ranks} GPUs", reason="world_size"
            )
        b = training.micro_batch
        if training.global_batch % (b * dp):
            raise InfeasibleError(
                f"global batch {training.global_batch} does not split into "
                f"dp {dp} x micro-batch {b}",
                reason="batch",
            )
        m = training.global_batch // (b * dp)
        dtype = str(training.dtype)
        recompute = str(training.recompute)
        sp = bool(parallel.sequence_parallel and tp > 1)
        elem = 2 if dtype in ("bf16", "fp16", "fp8") else 4
        s, h = spec.seq_len, spec.hidden

        layer = self._times("layer", dtype, b, tp, sp, recompute)
        emb = self._times("embedding", dtype, b, tp, sp, recompute)
        head = self._times("head", dtype, b, tp, sp, recompute)
        counts = layers_per_stage(spec.num_layers, pp)

        # Per micro-batch forward / backward of the first and last stage (same stage if pp = 1).
        def stage_times(stage: int) -> tuple[float, float]:
            n = counts[stage]
            fwd = n * layer.forward_s
            bwd = n * (layer.backward_s + layer.recompute_s)
            if stage == 0:
                fwd += emb.forward_s
                bwd += emb.backward_s
            if stage == pp - 1:
                fwd += head.forward_s
                bwd += head.backward_s
            return fwd, bwd

        # TP collectives per layer per micro-batch (ranks 0..tp-1 of the first node).
        tp_ranks = tuple(range(tp))
        act_bytes = s * b * h * elem
        if tp > 1:
            if sp:
                per_call = self.collective_s(
                    "reduce_scatter", act_bytes, tp_ranks
                ) + self.collective_s("all_gather", act_bytes, tp_ranks)
            else:
                per_call = self.collective_s("all_reduce", act_bytes, tp_ranks)
            calls = 4 + (2 if recompute == "full" else 0)
            tp_layer_s = calls * per_call
            tp_embed_s = self.collective_s("all_reduce", act_bytes, tp_ranks)
        else:
            tp_layer_s = tp_embed_s = 0.0

        slowest = 0
        stage_total = []
        for stage in {0, pp - 1}:
            fwd, bwd = stage_times(stage)
            tp_s = counts[stage] * tp_layer_s + (tp_embed_s if stage == 0 else 0.0)
            stage_total.append((fwd + bwd + tp_s, stage, fwd, bwd, tp_s))
        _, slowest, t_f, t_b, tp_mb_s = max(stage_total)

        # Pipeline: p2p between consecutive stages (rank 0 -> rank tp).
        if pp > 1:
            p2p_bytes = act_bytes / tp if tp > 1 else act_bytes
            t_p2p = self.collective_s("send_recv", p2p_bytes, (0, tp))
            pp_exposed = 2 * t_p2p * (v * m + pp - 1)
        else:
            t_p2p = pp_exposed = 0.0
        compute = m * (t_f + t_b)
        bubble = (pp - 1) / v * (t_f + t_b + tp_mb_s)
        tp_exposed = m * tp_mb_s

        # Data parallel: ranks with stride tp x pp.
        params_local = max(parameters_per_rank(spec, tp=tp, pp=pp, stage=st) for st in {0, pp - 1})
        dp_ranks = tuple(range(0, num_gpus, tp * pp))
        grad_bytes = params_local * elem
        bucket_bytes = parallel.ddp.bucket_mb * _MB_TORCH
        num_buckets = max(1, math.ceil(grad_bytes / bucket_bytes))
        last_bucket = grad_bytes - (num_buckets - 1) * bucket_bytes
        dp_link = dp_exposed = 0.0
        zero = parallel.zero
        if dp > 1:
            if zero == 3:
                # Per micro-batch and unit (layer): an all-gather in forward, an all-gather and
                # a reduce-scatter in backward. With prefetch, a unit's traffic hides behind
                # the compute of the unit before it, phase by phase: forward exposes
                # max(0, AG - t_f), backward max(0, AG + RS - t_b) per layer; without
                # prefetch all of it is exposed. The first gather is never hidden.
                n_units = counts[slowest]
                unit_bytes = grad_bytes / max(1, n_units)
                gather = self.collective_s("all_gather", unit_bytes, dp_ranks)
                scatter = self.collective_s("reduce_scatter", unit_bytes, dp_ranks)
                dp_link = m * n_units * (2 * gather + scatter)
                if parallel.fsdp.prefetch > 0:
                    fwd_unit = layer.forward_s
                    bwd_unit = layer.backward_s + layer.recompute_s
                    per_mb = n_units * (
                        max(0.0, gather - fwd_unit) + max(0.0, gather + scatter - bwd_unit)
                    )
                else:
                    per_mb = n_units * (2 * gather + scatter)
                dp_exposed = m * per_mb + gather
            else:
                op = "all_reduce" if zero == 0 else "reduce_scatter"
                full = self.collective_s(op, bucket_bytes, dp_ranks)
                tail = self.collective_s(op, last_bucket, dp_ranks)
                grads = (num_buckets - 1) * full + tail
                if parallel.ddp.overlap:
                    grads_exposed = max(tail, grads - t_b)
                else:
                    grads_exposed = grads
                gather = (
                    self.collective_s("all_gather", grad_bytes, dp_ranks) if zero in (1, 2) else 0.0
                )
                dp_link = grads + gather
                dp_exposed = grads_exposed + gather

        updated = params_local / (dp if zero >= 1 else 1)
        optimizer_s = self._model(dtype).optimizer_time_s(updated, str(training.optimizer))
        breakdown = {
            "compute": compute,
            "tp_exposed": tp_exposed,
            "pp_exposed": pp_exposed,
            "dp_exposed": dp_exposed,
            "bubble": bubble,
            "optimizer": optimizer_s,
        }
        step = sum(breakdown.values())

        # Memory on the first stage.
        states = model_state_bytes(
            parameters_per_rank(spec, tp=tp, pp=pp, stage=0),
            zero=zero,
            dp=dp,
            optimizer=str(training.optimizer),
            mixed_precision=dtype != "fp32",
        )
        per_layer = activation_bytes_per_layer(
            spec, micro_batch=b, tp=tp, sequence_parallel=sp, recompute=recompute, dtype=dtype
        )
        match str(parallel.schedule):
            case "gpipe":
                in_flight = float(m)
            case "interleaved" if v > 1:
                in_flight = pp * (1 + (pp - 1) / (pp * v))
            case _:
                in_flight = float(min(pp, m))
        activations = per_layer * counts[0] * in_flight + layer.transient_bytes
        if zero == 3:
            unit = grad_bytes / max(1, counts[0])
            buffers = (1 + parallel.fsdp.prefetch) * unit  # gathered layers in flight
        else:
            buffers = 2 * min(bucket_bytes, grad_bytes)
        memory = {
            "parameters": states.parameters,
            "gradients": states.gradients,
            "optimizer": states.optimizer,
            "activations": activations,
            "buffers": buffers,
        }
        peak = sum(memory.values())
        capacity = float(topo.device.memory_bytes)

        flops = self._model_flops(training.global_batch)
        peak_flops = topo.device.peak_flops_for(dtype)
        tflops = flops / step / num_gpus / 1e12
        return Estimate(
            step_time_s=step,
            breakdown_s=breakdown,
            memory_bytes=memory,
            memory_peak_bytes=peak,
            memory_capacity_bytes=capacity,
            fits=peak <= capacity,
            num_gpus=num_gpus,
            num_microbatches=m,
            tokens_per_s=training.global_batch * s / step,
            model_tflops_per_gpu=tflops,
            mfu=tflops * 1e12 / peak_flops,
            details={
                "t_forward_s": t_f,
                "t_backward_s": t_b,
                "t_p2p_s": t_p2p,
                "dp_link_s": dp_link,
                "slowest_stage": slowest,
                "params_per_gpu": params_local,
                "in_flight_microbatches": in_flight,
            },
        )


def estimate_step(
    topology: Topology, spec: TransformerSpec, training: TrainingConfig, parallel: ParallelConfig
) -> Estimate:
    """One-off :meth:`Estimator.estimate` (build an :class:`Estimator` to estimate many)."""
    return Estimator(topology, spec).estimate(training, parallel)
