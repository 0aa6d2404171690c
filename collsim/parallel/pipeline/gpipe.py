"""GPipe (Huang et al. 2019): all forwards of the step, then all backwards (a flush)."""

from __future__ import annotations

from collsim.core.vocab import ScheduleKind
from collsim.parallel.pipeline.base import Phase, PipelineSchedule, PipeOp, check_stage

__all__ = ["GPipe"]


class GPipe(PipelineSchedule):
    kind = ScheduleKind.GPIPE

    def order(
        self, *, num_stages: int, num_microbatches: int, stage: int, virtual_stages: int
    ) -> list[PipeOp]:
        check_stage(stage, num_stages)
        m = num_microbatches
        return [PipeOp(Phase.FORWARD, i) for i in range(m)] + [
            PipeOp(Phase.BACKWARD, i) for i in range(m)
        ]

    def warmup_forwards(
        self, *, num_stages: int, num_microbatches: int, stage: int, virtual_stages: int
    ) -> int:
        check_stage(stage, num_stages)
        return num_microbatches
