"""Framework costs: the work a training stack does beside the model's own kernels, in seconds
(and bytes) on one rank, for the engine to schedule as named parts of the step.

Derivations, measurements and sources: docs/derivations.md, ``collsim.workload.framework``.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import TYPE_CHECKING, Any

from collsim.core.errors import ConfigError
from collsim.core.vocab import Dtype, parse_enum

if TYPE_CHECKING:
    from collsim.workload.compute import ComputeModel
    from collsim.workload.model import TransformerSpec

__all__ = ["FrameworkCosts", "framework_costs", "HOST_STEP_S", "GRAD_CLIP_BYTES_PER_PARAM"]

GRAD_CLIP_BYTES_PER_PARAM = 12.0
"""Gradient-norm pass: read fp32 grads for the norm (4), read and write them to scale (8)."""

HOST_STEP_S = {"eager": 2e-3, "compiled": 1e-3, "cuda_graphs": 0.5e-3}
"""Host time per optimizer step outside the kernels (zero_grad, the optimizer's Python loop,
the learning-rate schedule, logging). ASSUMPTION: no published figure in compute.md (its
framework-overhead row for FSDP copies, casts, clipping and host time is a gap); 2 ms eager is
the order of a Python loop over a few hundred parameter groups at ~10 us per op."""


@dataclass(frozen=True, slots=True, kw_only=True)
class FrameworkCosts:
    """Framework costs on one rank (see the module docstring for what each is per)."""

    fsdp_copy_in_s: float = 0.0
    """Per unit per all-gather."""
    fsdp_copy_out_s: float = 0.0
    """Per unit per all-gather (FSDP2)."""
    fsdp_grad_cast_s: float = 0.0
    """Per unit per reduce-scatter."""
    fsdp_grad_copy_out_s: float = 0.0
    """Per unit per reduce-scatter."""
    fsdp_copy_bytes: float = 0.0
    """HBM bytes of copy-in + copy-out, per unit per all-gather."""
    fsdp_grad_bytes: float = 0.0
    """HBM bytes of the grad cast + copy-out, per unit per reduce-scatter."""
    grad_reduce_bytes_per_element: float = 2.0
    """Bytes per gradient element the gradient reduction moves (4 in fp32)."""
    grad_clip_s: float = 0.0
    """Per step (compute only; its all-reduce is a collective)."""
    optimizer_s: float = 0.0
    """Per step."""
    host_step_s: float = 0.0
    """Per step."""
    embedding_s: float = 0.0
    """Per micro-batch, forward + backward."""
    loss_s: float = 0.0
    """Per micro-batch, forward + backward."""

    def as_dict(self) -> dict[str, float]:
        return {k: float(v) for k, v in asdict(self).items()}

    def per_step_s(
        self, *, units: int, all_gathers_per_unit: int, reduce_scatters_per_unit: int
    ) -> float:
        """Total over a step for ``units`` units with the given collective counts per unit
        (embedding and loss excluded: they are already inside the compute blocks)."""
        return (
            units * all_gathers_per_unit * (self.fsdp_copy_in_s + self.fsdp_copy_out_s)
            + units * reduce_scatters_per_unit * (self.fsdp_grad_cast_s + self.fsdp_grad_copy_out_s)
            + self.grad_clip_s
            + self.optimizer_s
            + self.host_step_s
        )


def framework_costs(
    model: ComputeModel,
    *,
    unit_params: float,
    local_params: float,
    dp: int,
    zero: int = 3,
    fsdp_version: int = 1,
    grad_reduce_dtype: str = "fp32",
    grad_clip: bool = True,
    optimizer: str = "adam",
    optimizer_implementation: str = "fused",
    spec: TransformerSpec | None = None,
    micro_batch: int = 1,
    tp: int = 1,
    sequence_parallel: bool = False,
) -> FrameworkCosts:
    """Framework costs of a plan on ``model``'s device.

    Args:
        model: the compute model (device, dtype, execution mode).
        unit_params: parameters of one FSDP unit, unsharded (one layer on one TP rank).
        local_params: parameters this rank updates (its shard under ZeRO/FSDP).
        dp: data-parallel (sharding) size.
        zero: ZeRO stage; the FSDP terms are 0 below 3.
        fsdp_version: 1 (flat parameter, torch FSDP) or 2 (per-parameter DTensor, FSDP2).
        grad_reduce_dtype: ``fp32`` or ``bf16`` (what gradients are reduced in).
        grad_clip: the stack clips gradients by their global norm.
        optimizer / optimizer_implementation: see ``ComputeModel.optimizer_time_s``.
        spec, micro_batch, tp, sequence_parallel: for the embedding and loss times.
    """
    if dp <= 0:
        raise ConfigError(f"must be > 0, got {dp}", key_path="parallel.dp")
    if fsdp_version not in (1, 2):
        raise ConfigError(f"must be 1 or 2, got {fsdp_version}", key_path="training.fsdp_version")
    reduce_bytes = float(
        parse_enum(Dtype, grad_reduce_dtype, key_path="training.grad_reduce_dtype").size_bytes
    )
    param_bytes = float(Dtype(model.dtype).size_bytes)
    shard = unit_params / dp
    copy_in_b = copy_out_b = grad_cast_b = grad_out_b = 0.0
    if zero >= 3:
        if param_bytes < 4.0:
            copy_in_b = shard * (4.0 + param_bytes)
        if fsdp_version == 2:
            copy_out_b = unit_params * 2.0 * param_bytes
        if reduce_bytes != param_bytes:
            grad_cast_b = unit_params * (param_bytes + reduce_bytes)
        grad_out_b = shard * 12.0
    embedding_s = loss_s = 0.0
    if spec is not None:
        emb = model.embedding_times(
            spec, micro_batch=micro_batch, tp=tp, sequence_parallel=sequence_parallel
        )
        head = model.head_times(
            spec, micro_batch=micro_batch, tp=tp, sequence_parallel=sequence_parallel
        )
        embedding_s = emb.forward_s + emb.backward_s
        loss_s = sum(c.time_s for c in head.ops if c.name == "loss")
    return FrameworkCosts(
        fsdp_copy_in_s=model.memory_time_s(copy_in_b),
        fsdp_copy_out_s=model.memory_time_s(copy_out_b),
        fsdp_grad_cast_s=model.memory_time_s(grad_cast_b),
        fsdp_grad_copy_out_s=model.memory_time_s(grad_out_b),
        fsdp_copy_bytes=copy_in_b + copy_out_b,
        fsdp_grad_bytes=grad_cast_b + grad_out_b,
        grad_reduce_bytes_per_element=reduce_bytes,
        grad_clip_s=model.memory_time_s(GRAD_CLIP_BYTES_PER_PARAM * local_params, 3)
        if grad_clip
        else 0.0,
        optimizer_s=model.optimizer_time_s(local_params, optimizer, optimizer_implementation),
        host_step_s=HOST_STEP_S[model.execution],
        embedding_s=embedding_s,
        loss_s=loss_s,
    )


def costs_dict(costs: FrameworkCosts) -> dict[str, Any]:
    """The costs as a plain mapping (for ``--json``)."""
    return costs.as_dict()
