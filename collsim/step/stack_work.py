"""The training stack's own work in the step program, beside the model's compute.

Per stage: the optimizer step over the rank's shard (on the CPU with FSDP offload), the
framework work of ZeRO-3 / FSDP (copy-in and copy-out of gathered units, gradient casts) put
into the segments that do it, the per-step gradient-norm pass and host time, and the
once-per-step FP8 weight casts of Transformer Engine (:mod:`collsim.workload.framework`,
:mod:`collsim.workload.fp8`).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from collsim.cluster.hardware import get_device
from collsim.parallel.plan import Plan
from collsim.step.dataparallel import DataParallelRules
from collsim.step.ops import BlockTimes, StageModel
from collsim.workload.compute import ComputeModel
from collsim.workload.fp8 import weight_cast_bytes_per_step
from collsim.workload.framework import framework_costs

__all__ = [
    "plan_framework_costs",
    "stage_weight_cast_s",
    "stage_optimizer_s",
    "framework_work",
]


def stage_weight_cast_s(
    plan: Plan, stage: int, layer_of: Callable[[int], BlockTimes], model: ComputeModel
) -> float:
    """Seconds of the once-per-step FP8 weight casts of ``stage``'s layers
    (:func:`~collsim.workload.fp8.weight_cast_bytes_per_step`; the shard of FP8 parameters is
    the data-parallel group, the expert-data-parallel one for routed experts), one kernel per
    FP8 linear."""
    casts = model.fp8_casts
    if casts is None:
        return 0.0
    dense = expert = 0.0
    linears = 0
    for index in plan.stage_layers(stage):
        d, e, n = layer_of(index).fp8_weights
        dense += d
        expert += e
        linears += n
    shard = plan.cp * plan.dp if plan.parallel.zero >= 1 else 1
    expert_shard = max(1, plan.edp) if plan.parallel.zero >= 1 and plan.spec.is_moe else 1
    size = weight_cast_bytes_per_step(dense, casts, shard=shard) + weight_cast_bytes_per_step(
        expert, casts, shard=expert_shard
    )
    return model.memory_time_s(size, max(1, linears)) if size > 0 else 0.0


def stage_optimizer_s(
    plan: Plan,
    stage: StageModel,
    model: ComputeModel,
    overrides: dict[str, float],
    cpu: list[ComputeModel],
    rules: DataParallelRules,
) -> float:
    """The optimizer step over the parameters this rank updates (its ZeRO shard); on the CPU
    with FSDP offload (``cpu`` caches the CPU compute model)."""
    if "optimizer" in overrides:
        return float(overrides["optimizer"])
    par = plan.parallel
    if par.zero >= 1:  # the shard: non-expert states over N, routed experts over N_e
        n, n_e = rules.shard_sizes
        expert = sum(t.numel for c in stage.chunks for t in c.tensors if t.expert)
        local = (stage.numel - expert) / n + expert / n_e
    else:
        local = stage.numel
    optimizer = str(plan.training.optimizer)
    if par.zero == 3 and par.fsdp.offload:
        if not cpu:
            cpu.append(ComputeModel(get_device("cpu"), "fp32"))
        return cpu[0].optimizer_time_s(local, optimizer)
    return model.optimizer_time_s(local, optimizer, str(plan.training.optimizer_implementation))


def plan_framework_costs(model: Any, plan: Plan, unit_params: float, local_params: float) -> Any:
    """:func:`collsim.workload.framework.framework_costs` of one unit of ``unit_params``
    parameters on a rank holding ``local_params``, with the plan's data parallelism, ZeRO
    stage and training stack (shared by the program and the search's floors)."""
    tr = plan.training
    return framework_costs(
        model,
        unit_params=unit_params,
        local_params=local_params,
        dp=max(1, plan.dp),
        zero=plan.parallel.zero,
        fsdp_version=int(tr.fsdp_version or 1),
        grad_reduce_dtype=str(tr.grad_reduce_dtype or "bf16"),
        grad_clip=bool(tr.grad_clip),
        optimizer=str(tr.optimizer),
        optimizer_implementation=str(tr.optimizer_implementation),
    )


def framework_work(
    plan: Plan, stages: dict[int, StageModel], model: ComputeModel, rules: DataParallelRules
) -> dict[int, float]:
    """Put the training stack's own work into the schedule (``collsim.workload.framework``):
    FSDP / ZeRO-3 copy-in (and FSDP2 copy-out) of every gathered unit in the segment that
    gathers it, the gradient cast and copy-out of every reduced unit in its backward segment
    (``Segment.framework_s``); returns per stage the per-step part (the gradient-norm pass of
    the clipping, the host time of a step), run before the optimizer."""
    par = plan.parallel
    cache: dict[tuple[float, float], Any] = {}

    def costs(unit: float, local: float) -> Any:
        key = (unit, local)
        hit = cache.get(key)
        if hit is None:
            hit = cache[key] = plan_framework_costs(model, plan, unit, local)
        return hit

    per_step: dict[int, float] = {}
    for s, stage in stages.items():
        local = stage.numel / (plan.dp if par.zero >= 1 else 1)
        whole = costs(0.0, local)
        per_step[s] = whole.grad_clip_s + whole.host_step_s
        if par.zero != 3 or plan.dp < 2:
            continue
        # with gradients synced once per step (rules.sync_once) a unit's gradient is cast and
        # copied out once, and without reshard after forward it is gathered once: per step
        once = rules.sync_once
        gather_once = once and not rules.reshard_after_forward
        for chunk in stage.chunks:
            for forward, seg in [(True, f) for f in chunk.forward] + [
                (False, b) for b in chunk.backward
            ]:
                ukey = rules.unit_key(chunk, seg)
                if ukey == "root" and seg.key != "embedding":
                    continue  # the root unit is gathered and reduced once, at the embedding
                fw = costs(rules.unit_numel(chunk, ukey), local)
                gather = fw.fsdp_copy_in_s + fw.fsdp_copy_out_s
                grad = fw.fsdp_grad_cast_s + fw.fsdp_grad_copy_out_s
                if forward:
                    if gather_once:
                        per_step[s] += gather
                    else:
                        seg.framework_s += gather
                else:
                    if rules.reshard_after_forward and ukey != "root":
                        seg.framework_s += gather
                    if once:
                        per_step[s] += grad
                    else:
                        seg.framework_s += grad
            # a split backward: the input-gradient op gathers, the weight-gradient op reduces
            for i_seg, w_seg in zip(chunk.input_grad or [], chunk.weight_grad or [], strict=True):
                ukey = rules.unit_key(chunk, i_seg)
                if ukey == "root" and i_seg.key != "embedding":
                    continue
                fw = costs(rules.unit_numel(chunk, ukey), local)
                if rules.reshard_after_forward and ukey != "root":
                    i_seg.framework_s += fw.fsdp_copy_in_s + fw.fsdp_copy_out_s
                grad = fw.fsdp_grad_cast_s + fw.fsdp_grad_copy_out_s
                if once:
                    per_step[s] += grad
                else:
                    w_seg.framework_s += grad
    return per_step
