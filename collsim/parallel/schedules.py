"""Pipeline schedules: the order of forward and backward ops on each stage.

- GPipe (Huang et al. 2019): all forwards of the step, then all backwards (a flush).
- 1F1B / PipeDream-Flush (Narayanan et al. 2021, section 2.2.1, Fig. 4 top): stage ``s`` runs
  ``p - s - 1`` warm-up forwards, then alternates one forward and one backward, then drains.
  At most ``p - s`` micro-batches of activations are in flight on stage ``s``.
- Interleaved 1F1B (Narayanan et al. 2021, section 2.2.2, Fig. 4 bottom): each stage holds
  ``v`` model chunks; the op order is Megatron-LM's ``forward_backward_pipelining_with_
  interleaving``: warm-up ``(p - s - 1) * 2 + (v - 1) * p`` forwards (all of them when the
  micro-batch count equals p), micro-batches taken in groups of p per chunk. The bubble time
  shrinks by v: (1/v)(p-1)/m of the ideal time.
"""

from __future__ import annotations

from typing import NamedTuple

from collsim.errors import ConfigError
from collsim.vocab import PipelinePhase, ScheduleKind

Phase = PipelinePhase
"""The name the schedules use for :class:`collsim.vocab.PipelinePhase`."""

__all__ = [
    "Phase",
    "PipeOp",
    "stage_schedule",
    "input_of",
    "output_of",
    "warmup_forwards",
    "paired_ops",
]


class PipeOp(NamedTuple):
    """One forward or backward of one micro-batch through one model chunk of a stage.

    A named tuple, not a frozen dataclass: a step builds one per op of every stage (1,536 for
    3d_175b) and a frozen dataclass's ``__init__`` sets each field through
    ``object.__setattr__``, about three times the cost."""

    phase: Phase
    microbatch: int
    chunk: int = 0


def stage_schedule(
    kind: ScheduleKind | str,
    *,
    num_stages: int,
    num_microbatches: int,
    stage: int,
    virtual_stages: int = 1,
) -> list[PipeOp]:
    """The op order of one pipeline stage.

    Args:
        kind: gpipe, 1f1b or interleaved.
        num_stages: pipeline size p.
        num_microbatches: micro-batches per step m.
        stage: this stage's index, 0-based.
        virtual_stages: model chunks per stage v (interleaved only).

    Returns:
        Every (phase, micro-batch, chunk) of the stage exactly once, in execution order.
    """
    p, m, v = num_stages, num_microbatches, virtual_stages
    F, B = Phase.FORWARD, Phase.BACKWARD
    warmup = warmup_forwards(kind, num_stages=p, num_microbatches=m, stage=stage, virtual_stages=v)
    match ScheduleKind(kind):
        case ScheduleKind.GPIPE:
            return [PipeOp(F, i) for i in range(m)] + [PipeOp(B, i) for i in range(m)]
        case ScheduleKind.ONE_F_ONE_B:
            return _one_f_one_b(
                [PipeOp(F, i) for i in range(m)], [PipeOp(B, i) for i in range(m)], warmup
            )
        case ScheduleKind.INTERLEAVED:
            total = m * v
            fwd = [
                PipeOp(F, _mb_id(k, p, v), _chunk_id(k, p, v, forward=True)) for k in range(total)
            ]
            bwd = [
                PipeOp(B, _mb_id(k, p, v), _chunk_id(k, p, v, forward=False)) for k in range(total)
            ]
            return _one_f_one_b(fwd, bwd, warmup)
        case _:  # pragma: no cover
            raise ConfigError(f"unknown schedule {kind!r}", key_path="parallel.schedule")


def warmup_forwards(
    kind: ScheduleKind | str,
    *,
    num_stages: int,
    num_microbatches: int,
    stage: int,
    virtual_stages: int = 1,
) -> int:
    """Forwards a stage runs before its first backward is due (GPipe: all of them)."""
    p, m, v = num_stages, num_microbatches, virtual_stages
    if not 0 <= stage < p:
        raise ConfigError(f"stage must be in [0, {p}), got {stage}")
    match ScheduleKind(kind):
        case ScheduleKind.GPIPE:
            return m
        case ScheduleKind.ONE_F_ONE_B:
            return min(p - stage - 1, m)
        case ScheduleKind.INTERLEAVED:
            total = m * v
            if v == 1:
                return min(p - stage - 1, m)
            if m == p:
                return total
            return min((p - stage - 1) * 2 + (v - 1) * p, total)
        case _:  # pragma: no cover
            raise ConfigError(f"unknown schedule {kind!r}", key_path="parallel.schedule")


def paired_ops(
    kind: ScheduleKind | str,
    *,
    num_stages: int,
    num_microbatches: int,
    stage: int,
    virtual_stages: int = 1,
) -> frozenset[int]:
    """Indices, in :func:`stage_schedule`'s order, of the ops that Megatron-Core's combined
    1F1B (``--overlap-moe-expert-parallel-comm``, megatron/core/pipeline_parallel/
    combined_1f1b.py) runs two at a time: each steady-state forward with the backward after
    it. Without warm-up (pp = 1, or the last stage of plain 1F1B) the backward of micro-batch
    i goes with the forward of i + 1, and the first forward and the last backward run alone
    (``combined_1f1b_schedule_for_no_pipelining``). GPipe pairs nothing.

    Example:
        >>> sorted(paired_ops("1f1b", num_stages=1, num_microbatches=3, stage=0))
        [1, 2, 3, 4]
    """
    if ScheduleKind(kind) is ScheduleKind.GPIPE:
        return frozenset()
    m = num_microbatches * (virtual_stages if ScheduleKind(kind) is ScheduleKind.INTERLEAVED else 1)
    w = warmup_forwards(
        kind,
        num_stages=num_stages,
        num_microbatches=num_microbatches,
        stage=stage,
        virtual_stages=virtual_stages,
    )
    if w == 0:
        return frozenset(range(1, 2 * m - 1))
    return frozenset(range(w, w + 2 * (m - w)))


def _one_f_one_b(fwd: list[PipeOp], bwd: list[PipeOp], warmup: int) -> list[PipeOp]:
    order = fwd[:warmup]
    remaining = len(fwd) - warmup
    for i in range(remaining):
        order.append(fwd[warmup + i])
        order.append(bwd[i])
    order.extend(bwd[remaining:])
    return order


def _chunk_id(k: int, p: int, v: int, *, forward: bool) -> int:
    """Megatron's get_model_chunk_id: groups of p consecutive ops share a chunk."""
    chunk = (k % (p * v)) // p
    return chunk if forward else v - 1 - chunk


def _mb_id(k: int, p: int, v: int) -> int:
    """Megatron's get_microbatch_id_in_model_chunk."""
    return (k // (p * v)) * p + k % p


def output_of(
    op: PipeOp, *, stage: int, num_stages: int, virtual_stages: int
) -> tuple[int, PipeOp] | None:
    """The (stage, op) that consumes this op's output across stages, or None: the dual of
    :func:`input_of`.

    A forward of chunk c on stage s feeds the forward of (s + 1, c), or from the last stage
    the forward of (0, c + 1); a backward feeds the backward of (s - 1, c), or from the first
    stage the backward of (p - 1, c - 1). The last chunk's forward on the last stage (the
    loss follows on the same stage) and the first chunk's backward on the first stage feed
    nothing remote.
    """
    p, v = num_stages, virtual_stages
    if op.phase is Phase.FORWARD:
        if stage < p - 1:
            return stage + 1, op
        if op.chunk < v - 1:
            return 0, PipeOp(Phase.FORWARD, op.microbatch, op.chunk + 1)
        return None
    if stage > 0:
        return stage - 1, op
    if op.chunk > 0:
        return p - 1, PipeOp(Phase.BACKWARD, op.microbatch, op.chunk - 1)
    return None


def input_of(
    op: PipeOp, *, stage: int, num_stages: int, virtual_stages: int
) -> tuple[int, PipeOp] | None:
    """The (stage, op) whose output this op consumes across stages, or None.

    A forward of chunk c on stage s reads the forward of (s - 1, c), or of (p - 1, c - 1) on
    the first stage; a backward reads the backward of (s + 1, c), or of (0, c + 1) on the last
    stage. The first forward and the last stage's last-chunk backward (which follows its own
    forward and the loss) read nothing remote.
    """
    p, v = num_stages, virtual_stages
    if op.phase is Phase.FORWARD:
        if stage > 0:
            return stage - 1, op
        if op.chunk > 0:
            return p - 1, PipeOp(Phase.FORWARD, op.microbatch, op.chunk - 1)
        return None
    if stage < p - 1:
        return stage + 1, op
    if op.chunk < v - 1:
        return 0, PipeOp(Phase.BACKWARD, op.microbatch, op.chunk + 1)
    return None
