"""Zero-bubble ZB-H1 (Qi et al., "Zero Bubble Pipeline Parallelism", ICLR 2024, section 2.1,
Fig. 3 top): 1F1B with each backward split into an input-gradient op (I) and a
weight-gradient op (W). Stage ``s`` runs the ``p - s - 1`` warm-up forwards of 1F1B, then a
forward and an I in turn, each I followed by the W of the micro-batch ``s`` places behind it
(so every stage holds at most ``p`` micro-batches between forward and W, the first stage's
1F1B peak); in the cooldown each I is followed by a pending W, which fills the wait for the
next stage's gradient. The bubble is ``(p - 1)(T_F + T_B - T_W)`` against 1F1B's
``(p - 1)(T_F + T_B + T_W)`` (the paper's section 2.1, with T_B the input-gradient time;
when T_W <= T_F)."""

from __future__ import annotations

from collsim.core.vocab import ScheduleKind
from collsim.parallel.pipeline.base import Phase, PipelineSchedule, PipeOp, check_stage

__all__ = ["ZBH1"]


class ZBH1(PipelineSchedule):
    kind = ScheduleKind.ZB_H1
    splits_backward = True

    def order(
        self, *, num_stages: int, num_microbatches: int, stage: int, virtual_stages: int
    ) -> list[PipeOp]:
        check_stage(stage, num_stages)
        m = num_microbatches
        w = min(num_stages - stage - 1, m)
        F, I, W = Phase.FORWARD, Phase.BACKWARD_INPUT, Phase.BACKWARD_WEIGHT
        ops = [PipeOp(F, i) for i in range(w)]
        pending: list[int] = []
        for j in range(m - w):  # steady state: F, I, and W once s of them wait
            ops += [PipeOp(F, w + j), PipeOp(I, j)]
            pending.append(j)
            if len(pending) > stage:
                ops.append(PipeOp(W, pending.pop(0)))
        for j in range(m - w, m):  # cooldown: each I followed by a waiting W
            ops.append(PipeOp(I, j))
            pending.append(j)
            ops.append(PipeOp(W, pending.pop(0)))
        ops += [PipeOp(W, j) for j in pending]
        return ops
