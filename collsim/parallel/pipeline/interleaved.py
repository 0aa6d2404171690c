"""Interleaved 1F1B (Narayanan et al. 2021, section 2.2.2, Fig. 4 bottom): each stage holds
``v`` model chunks, chunk ``c`` of stage ``s`` being model part ``c p + s``; the op order is
Megatron-LM's ``forward_backward_pipelining_with_interleaving``: warm-up
``(p - s - 1) * 2 + (v - 1) * p`` forwards (all of them when the micro-batch count equals p),
micro-batches taken in groups of p per chunk. The bubble shrinks by v: (1/v)(p-1)/m of the
ideal time."""

from __future__ import annotations

from collsim.core.errors import ConfigError
from collsim.core.vocab import ScheduleKind
from collsim.parallel.pipeline.base import (
    Phase,
    PipelineSchedule,
    PipeOp,
    check_stage,
    one_f_one_b,
)
from collsim.parallel.pipeline.one_f_one_b import steady_pairs

__all__ = ["Interleaved"]


class Interleaved(PipelineSchedule):
    kind = ScheduleKind.INTERLEAVED

    def chunks(self, virtual_stages: int) -> int:
        return virtual_stages

    def check(self, *, num_stages: int, num_microbatches: int, virtual_stages: int) -> None:
        if num_stages > 1 and num_microbatches % num_stages:
            raise ConfigError(
                f"interleaved 1F1B needs the number of micro-batches ({num_microbatches}) "
                f"divisible by pp ({num_stages})",
                key_path="parallel.schedule",
            )

    def order(
        self, *, num_stages: int, num_microbatches: int, stage: int, virtual_stages: int
    ) -> list[PipeOp]:
        p, m, v = num_stages, num_microbatches, virtual_stages
        warmup = self.warmup_forwards(
            num_stages=p, num_microbatches=m, stage=stage, virtual_stages=v
        )
        total = m * v
        fwd = [
            PipeOp(Phase.FORWARD, _mb_id(k, p, v), _chunk_id(k, p, v, True)) for k in range(total)
        ]
        bwd = [
            PipeOp(Phase.BACKWARD, _mb_id(k, p, v), _chunk_id(k, p, v, False)) for k in range(total)
        ]
        return one_f_one_b(fwd, bwd, warmup)

    def warmup_forwards(
        self, *, num_stages: int, num_microbatches: int, stage: int, virtual_stages: int
    ) -> int:
        p, m, v = num_stages, num_microbatches, virtual_stages
        check_stage(stage, p)
        total = m * v
        if v == 1:
            return min(p - stage - 1, m)
        if m == p:
            return total
        return min((p - stage - 1) * 2 + (v - 1) * p, total)

    def paired(
        self, *, num_stages: int, num_microbatches: int, stage: int, virtual_stages: int
    ) -> frozenset[int]:
        w = self.warmup_forwards(
            num_stages=num_stages,
            num_microbatches=num_microbatches,
            stage=stage,
            virtual_stages=virtual_stages,
        )
        return steady_pairs(num_microbatches * virtual_stages, w)


def _chunk_id(k: int, p: int, v: int, forward: bool) -> int:
    """Megatron's get_model_chunk_id: groups of p consecutive ops share a chunk."""
    chunk = (k % (p * v)) // p
    return chunk if forward else v - 1 - chunk


def _mb_id(k: int, p: int, v: int) -> int:
    """Megatron's get_microbatch_id_in_model_chunk."""
    return (k // (p * v)) * p + k % p
