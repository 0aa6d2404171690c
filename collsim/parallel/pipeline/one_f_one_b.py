"""1F1B / PipeDream-Flush (Narayanan et al. 2021, section 2.2.1, Fig. 4 top): stage ``s``
runs ``p - s - 1`` warm-up forwards, then alternates one forward and one backward, then
drains; at most ``p - s`` micro-batches of activations are in flight on stage ``s``."""

from __future__ import annotations

from collsim.core.vocab import ScheduleKind
from collsim.parallel.pipeline.base import (
    Phase,
    PipelineSchedule,
    PipeOp,
    check_stage,
    one_f_one_b,
)

__all__ = ["OneFOneB", "steady_pairs"]


class OneFOneB(PipelineSchedule):
    kind = ScheduleKind.ONE_F_ONE_B

    def order(
        self, *, num_stages: int, num_microbatches: int, stage: int, virtual_stages: int
    ) -> list[PipeOp]:
        m = num_microbatches
        warmup = self.warmup_forwards(
            num_stages=num_stages, num_microbatches=m, stage=stage, virtual_stages=1
        )
        return one_f_one_b(
            [PipeOp(Phase.FORWARD, i) for i in range(m)],
            [PipeOp(Phase.BACKWARD, i) for i in range(m)],
            warmup,
        )

    def warmup_forwards(
        self, *, num_stages: int, num_microbatches: int, stage: int, virtual_stages: int
    ) -> int:
        check_stage(stage, num_stages)
        return min(num_stages - stage - 1, num_microbatches)

    def paired(
        self, *, num_stages: int, num_microbatches: int, stage: int, virtual_stages: int
    ) -> frozenset[int]:
        w = self.warmup_forwards(
            num_stages=num_stages,
            num_microbatches=num_microbatches,
            stage=stage,
            virtual_stages=virtual_stages,
        )
        return steady_pairs(num_microbatches, w)


def steady_pairs(ops_per_phase: int, warmup: int) -> frozenset[int]:
    """Megatron-Core's combined 1F1B (``--overlap-moe-expert-parallel-comm``,
    megatron/core/pipeline_parallel/combined_1f1b.py) runs each steady-state forward with the
    backward after it. Without warm-up (pp = 1, or the last stage of plain 1F1B) the backward
    of micro-batch i goes with the forward of i + 1, and the first forward and the last
    backward run alone (``combined_1f1b_schedule_for_no_pipelining``)."""
    m, w = ops_per_phase, warmup
    if w == 0:
        return frozenset(range(1, 2 * m - 1))
    return frozenset(range(w, w + 2 * (m - w)))
