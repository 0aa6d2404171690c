"""DualPipeV (DeepSeek-V3 technical report, 2024, section 3.2.1; the V-shaped "cut-in-half"
DualPipe of deepseek-ai/DualPipe, as torch.distributed.pipelining's ``ScheduleDualPipeV``
orders it). Each of the ``p`` stages holds two chunks: chunk 0 of stage ``s`` is model part
``s`` and chunk 1 is part ``2p - 1 - s``, so the forward runs down the stages and back up
(the first stage holds the embedding and the head). The order has eight steps (torch's
``_calculate_single_rank_operations``): forwards of chunk 0, forwards of both chunks,
zero-bubble I-W-F of chunk 1, the main step of overlapped forward-backward pairs
(F0 with B1, F1 with B0), B1 then F1-B0 pairs, whole and split backwards of both chunks,
and the pending weight-gradient ops. An overlapped pair runs its two ops one after the other
on the compute stream (their communication is hidden under each other's compute: with
``parallel.ep_overlap`` they run as paired ops). Needs at least ``2p`` micro-batches
(torch's check)."""

from __future__ import annotations

from collsim.core.errors import ConfigError
from collsim.core.vocab import ScheduleKind
from collsim.parallel.pipeline.base import Phase, PipelineSchedule, PipeOp, check_stage

__all__ = ["DualPipeV"]

F, B, I, W = Phase.FORWARD, Phase.BACKWARD, Phase.BACKWARD_INPUT, Phase.BACKWARD_WEIGHT


class DualPipeV(PipelineSchedule):
    kind = ScheduleKind.DUALPIPEV
    splits_backward = True

    def chunks(self, virtual_stages: int) -> int:
        return 2

    def part_of(self, stage: int, chunk: int, num_stages: int, virtual_stages: int) -> int:
        return stage if chunk == 0 else 2 * num_stages - 1 - stage

    def where(self, part: int, num_stages: int, virtual_stages: int) -> tuple[int, int]:
        p = num_stages
        return (part, 0) if part < p else (2 * p - 1 - part, 1)

    def check(self, *, num_stages: int, num_microbatches: int, virtual_stages: int) -> None:
        if num_microbatches < 2 * num_stages:
            raise ConfigError(
                f"DualPipeV needs at least 2 x pp = {2 * num_stages} micro-batches, got "
                f"{num_microbatches} (torch.distributed.pipelining ScheduleDualPipeV)",
                key_path="parallel.schedule",
            )

    def order(
        self, *, num_stages: int, num_microbatches: int, stage: int, virtual_stages: int
    ) -> list[PipeOp]:
        return self._order(num_stages, num_microbatches, stage)[0]

    def paired(
        self, *, num_stages: int, num_microbatches: int, stage: int, virtual_stages: int
    ) -> frozenset[int]:
        return frozenset(self._order(num_stages, num_microbatches, stage)[1])

    @staticmethod
    def _order(p: int, m: int, r: int) -> tuple[list[PipeOp], list[int]]:
        check_stage(r, p)
        ops: list[PipeOp] = []
        pairs: list[int] = []
        nxt = {(F, 0): 0, (F, 1): 0, (B, 0): 0, (B, 1): 0}  # next micro-batch per pass
        weights: list[tuple[int, int]] = []  # (chunk, micro-batch) of pending W ops

        def add(phase: Phase, chunk: int) -> None:
            key = (F if phase is F else B, chunk)
            mb = nxt[key]
            nxt[key] = mb + 1
            ops.append(PipeOp(phase, mb, chunk))
            if phase is I:
                weights.append((chunk, mb))

        def weight() -> None:
            if weights:
                chunk, mb = weights.pop(0)
                ops.append(PipeOp(W, mb, chunk))

        def overlapped(f_chunk: int, b_chunk: int) -> None:
            pairs.extend((len(ops), len(ops) + 1))
            add(F, f_chunk)
            add(B, b_chunk)

        for _ in range((p - r - 1) * 2):  # 1: F0
            add(F, 0)
        for _ in range(r + 1):  # 2: F0 F1
            add(F, 0)
            add(F, 1)
        for _ in range(p - r - 1):  # 3: I1 W F1 (zero bubble)
            add(I, 1)
            weight()
            add(F, 1)
        for i in range(m - 2 * p + r + 1):  # 4: F0B1 - F1B0, overlapped
            if i == 0 and r == p - 1:  # not overlapped, to shorten the bubble
                add(F, 0)
                add(B, 1)
            else:
                overlapped(0, 1)
            overlapped(1, 0)
        for _ in range(p - r - 1):  # 5: B1 - F1B0
            add(B, 1)
            overlapped(1, 0)
        split = False
        step6 = r + 1
        for i in range(step6):  # 6: B1 B0, the second half split (zero bubble)
            if i == step6 // 2 and r % 2 == 1:
                split = True
            add(I if split else B, 1)
            if i == step6 // 2 and r % 2 == 0:
                split = True
            add(I if split else B, 0)
        for _ in range(p - r - 1):  # 7: W B0
            weight()
            add(I if split else B, 0)
        for _ in range(r + 1):  # 8: W
            weight()
        return ops, pairs
