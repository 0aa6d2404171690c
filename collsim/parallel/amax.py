"""FP8 amax reductions as the stacks run them (docs/fp8.md, "Amax reductions"): delayed
scaling (Transformer Engine ``DelayedScaling``, ``reduce_and_update_fp8_tensors`` in
transformer_engine/pytorch/quantization.py at 001597e) all-reduces one buffer of the forward
amaxes (3 per GEMM) at the exit of Megatron-Core's outer ``autocast`` (one per model chunk and
micro-batch, megatron/core/transformer/transformer_block.py at d98e8a6) and one of the backward
amaxes (2 per GEMM) after the chunk's backward, with MAX over the stage's tp x dp x cp ranks
(``get_amax_reduction_group(with_context_parallel=True)``), each followed by one kernel that
updates the histories and scales; current scaling (``tensorwise``) all-reduces the amax of
every tensor sequence parallelism gathers over TP (Transformer Engine's
``with_amax_reduction`` on the TP group, module/linear.py; torchao's float8 TP styles cast
the sharded DTensor); blockwise and MXFP8 scales are local.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from collsim.core.vocab import ParallelAxis
from collsim.parallel.sharding import DELAYED_AMAX_HISTORY

if TYPE_CHECKING:
    from collsim.parallel.plan import Plan

__all__ = [
    "AMAX_BYTES",
    "AMAX_HISTORY_LEN",
    "AmaxReduction",
    "AmaxPlan",
    "amax_plan",
    "history_update_bytes",
    "tp_amax_reduce",
]

AMAX_BYTES = 4
"""One fp32 amax."""
AMAX_HISTORY_LEN = DELAYED_AMAX_HISTORY
"""``DelayedScaling.amax_history_len`` default (:data:`collsim.parallel.sharding.
DELAYED_AMAX_HISTORY`)."""
FORWARD_AMAXES_PER_GEMM = 3
BACKWARD_AMAXES_PER_GEMM = 2
"""FP8 tensors per GEMM of a TE module: forward input, weight, output; backward output
gradient and input gradient (``num_gemms * 3`` / ``* 2``, TE module/base.py)."""


@dataclass(frozen=True, slots=True)
class AmaxReduction:
    """One amax all-reduce (MAX) of ``size_bytes`` on the group of ``axis``, ``calls`` times
    in ``phase`` of one layer (``per: "layer"``) or of one model chunk (``per: "chunk"``)."""

    size_bytes: float
    axis: str
    phase: str
    calls: int = 1
    per: str = "layer"


@dataclass(frozen=True, slots=True)
class AmaxPlan:
    """The amax reductions of one plan and the delayed-scaling history update of one chunk
    (HBM bytes per phase, one kernel each)."""

    reductions: tuple[AmaxReduction, ...] = ()
    update_bytes: tuple[float, float] = (0.0, 0.0)

    def of(self, per: str, phase: str) -> list[AmaxReduction]:
        return [r for r in self.reductions if r.per == per and r.phase == phase]


def history_update_bytes(tensors: int, history_len: int = AMAX_HISTORY_LEN) -> float:
    """HBM bytes of one fused history and scale update over ``tensors`` FP8 tensors: each
    history (``history_len`` fp32) read and written rolled, the reduced amax read, the scale
    and its inverse written."""
    return float(tensors * (2 * history_len * AMAX_BYTES + 3 * AMAX_BYTES))


def tp_amax_reduce(plan: Plan) -> bool:
    """Current scaling reduces the amax of every tensor sequence parallelism gathers over TP
    (module docstring): an FP8 plan with ``tensorwise`` scaling, tp > 1 and sequence
    parallelism, under any stack (Transformer Engine and torchao alike). The step program
    places these reductions before the TP gathers (``collsim.step.ops.TPOverlap``)."""
    tr = plan.training
    return (
        str(tr.dtype) == "fp8"
        and str(tr.fp8_recipe or "tensorwise") == "tensorwise"
        and plan.tp > 1
        and bool(plan.parallel.sequence_parallel)
    )


def amax_plan(plan: Plan, *, linears_per_layer: int, layers_per_chunk: int) -> AmaxPlan:
    """The once-per-chunk amax reductions of ``plan`` under delayed scaling (module
    docstring), with ``linears_per_layer`` FP8 GEMMs in a layer and ``layers_per_chunk``
    layers in the model chunk (one buffer per chunk and phase: its size follows the chunk);
    empty for the other recipes (current scaling: :func:`tp_amax_reduce`)."""
    tr = plan.training
    if str(tr.dtype) != "fp8" or str(tr.fp8_recipe) != "delayed":
        return AmaxPlan()
    gemms = linears_per_layer * layers_per_chunk
    if gemms <= 0:
        return AmaxPlan()
    fwd, bwd = FORWARD_AMAXES_PER_GEMM * gemms, BACKWARD_AMAXES_PER_GEMM * gemms
    update = (history_update_bytes(fwd), history_update_bytes(bwd))
    if plan.tp * plan.dp * plan.cp < 2:  # TE skips the reduction on a group of one
        return AmaxPlan((), update)
    axis = ParallelAxis.TP_DP_CP
    return AmaxPlan(
        (
            AmaxReduction(AMAX_BYTES * fwd, axis, "forward", per="chunk"),
            AmaxReduction(AMAX_BYTES * bwd, axis, "backward", per="chunk"),
        ),
        update,
    )
