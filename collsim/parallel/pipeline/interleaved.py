"""Interleaved 1F1B (Narayanan et al. 2021, section 2.2.2, Fig. 4 bottom): each stage holds
``v`` model chunks, chunk ``c`` of stage ``s`` being model part ``c p + s``; the op order is
Megatron-LM's ``forward_backward_pipelining_with_interleaving``: warm-up
``(p - s - 1) * 2 + (v - 1) * p`` forwards (all of them when the micro-batch count equals p),
micro-batches taken in groups of p per chunk. The bubble shrinks by v: (1/v)(p-1)/m of the
ideal time."""

from __future__ import annotations

import functools

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
        fwd, bwd = _chunk_ops(p, m, v)
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


@functools.lru_cache(maxsize=8)
def _chunk_ops(p: int, m: int, v: int) -> tuple[tuple[PipeOp, ...], tuple[PipeOp, ...]]:
    """The forwards and the backwards of every stage in their own order: op k's micro-batch
    (Megatron's ``get_microbatch_id_in_model_chunk``) and chunk (``get_model_chunk_id``: groups
    of p consecutive ops share a chunk; backward runs the chunks in reverse). The same for
    every stage (only the warm-up differs), so made once per shape for the stages' orders;
    the ops made without the named tuple's keyword layer: a search's bounds build these orders
    for every pipeline shape they walk."""
    pv, new = p * v, tuple.__new__
    forward, backward = Phase.FORWARD, Phase.BACKWARD
    ids = [((k // pv) * p + k % p, (k % pv) // p) for k in range(m * v)]  # (micro-batch, chunk)
    fwd = tuple([new(PipeOp, (forward, mb, chunk)) for mb, chunk in ids])
    bwd = tuple([new(PipeOp, (backward, mb, v - 1 - chunk)) for mb, chunk in ids])
    return fwd, bwd
