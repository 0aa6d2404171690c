"""FSDP / ZeRO-3 units and the order their all-gathers are issued (prefetch).

Following torch FSDP (Zhao et al. 2023, "PyTorch FSDP", section 3.3-3.4) with per-layer
wrapping: each transformer layer is one unit; the input embedding and the final norm + LM head
are units of their own. Forward gathers the units in order and, with ``reshard_after_forward``,
frees each gathered unit after its forward; backward gathers them again in reverse order and
reduce-scatters each unit's gradient right after its backward (ZeRO-3, Rajbhandari et al. 2020).

Prefetch depth ``d`` (FSDP's ``forward_prefetch`` / ``backward_prefetch`` and DeepSpeed's
prefetch bucket, as a unit count): the all-gather of unit ``i + d`` is issued when unit ``i``
starts computing, so up to ``d + 1`` units are gathered at once. ``d = 0`` gathers each unit
only when it is needed, exposing every all-gather.

When gradients are synchronised (:func:`grad_sync_of`) is a choice of the stack: per
micro-batch, or once per step with the gradients accumulated unsharded in the meantime.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

from collsim.parallel.params import ParamTensor

if TYPE_CHECKING:
    from collsim.parallel.config import ParallelConfig, TrainingConfig

__all__ = ["FSDPUnit", "build_units", "grad_sync_of", "issue_schedule"]


def grad_sync_of(parallel: ParallelConfig, training: TrainingConfig) -> str:
    """When a ZeRO-3 / FSDP plan reduces its gradients: ``microbatch`` or ``step``.

    ``parallel.fsdp.grad_sync`` when the scenario states it. Else ``step`` for an FSDP2 stack
    (``training.fsdp_version`` 2: torchtitan, NeMo Automodel) with pipelining: torch's
    pipeline stage runs every backward but the last of a step with
    ``set_requires_gradient_sync(False)`` and ``set_reshard_after_backward(False)`` and then
    runs FSDP's post-backward once (``_PipelineStageBase.backward_maybe_with_nosync``,
    torch/distributed/pipelining/stage.py in pytorch/pytorch at 88fa1e7): the reduce-scatter
    (and the HSDP all-reduce across replicas) runs once per step, the gradients accumulate
    unsharded in the reduce dtype (FSDP2 ``FSDPParam.to_accumulated_grad_if_needed``) and a
    unit gathered for a backward stays gathered until the next forward needs it. Without
    pipelining torchtitan runs a plain ``loss.backward()`` per micro-batch
    (torchtitan/trainer.py ``forward_backward_step`` in pytorch/torchtitan at 003fe28), so FSDP
    reduces in every micro-batch, as torch FSDP1 does without ``no_sync``: ``microbatch``.
    """
    explicit = parallel.fsdp.grad_sync
    if explicit is not None:
        return explicit
    if parallel.zero == 3 and parallel.pp > 1 and training.fsdp_version == 2:
        return "step"
    return "microbatch"


@dataclass(frozen=True, slots=True)
class FSDPUnit:
    """One FSDP unit: the parameters gathered and freed together.

    Attributes:
        segment: ``"embedding"``, a layer index, or ``"head"`` (as in ParamTensor).
        numel: elements of the unit on one TP rank, unsharded over DP.
    """

    segment: str | int
    numel: float


def build_units(tensors: Sequence[ParamTensor]) -> list[FSDPUnit]:
    """Units of one model chunk in forward order (one per segment)."""
    sizes: dict[str | int, float] = {}
    for t in tensors:
        sizes[t.segment] = sizes.get(t.segment, 0) + t.numel
    return [FSDPUnit(segment=seg, numel=n) for seg, n in sizes.items()]


def issue_schedule(num_units: int, depth: int) -> list[list[int]]:
    """Which units' all-gathers are issued as each unit (in execution order) starts.

    Args:
        num_units: units in execution order (forward order for forward, reversed for backward).
        depth: prefetch depth (0 = on demand).

    Returns:
        ``out[i]``: positions issued just before unit ``i`` computes.

    Example:
        >>> issue_schedule(4, 1)
        [[0, 1], [2], [3], []]
        >>> issue_schedule(3, 0)
        [[0], [1], [2]]
    """
    out: list[list[int]] = []
    for i in range(num_units):
        if i == 0:
            out.append(list(range(min(depth + 1, num_units))))
        else:
            j = i + depth
            out.append([j] if j < num_units else [])
    return out
