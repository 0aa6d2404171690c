"""Pipeline schedules as data: one module per schedule, each giving its op order per stage,
its placement of model chunks on stages and (through the placement) its dependencies; the
step builder, the engine, the closed form and the search's bound read them from here
(docs/pipelines.md)."""

from __future__ import annotations

from collsim.core.errors import ConfigError
from collsim.core.vocab import ScheduleKind
from collsim.parallel.pipeline.base import (
    BACKWARD_PHASES,
    GRADIENT_PHASES,
    Phase,
    PipelineSchedule,
    PipeOp,
    flow,
)
from collsim.parallel.pipeline.dualpipev import DualPipeV
from collsim.parallel.pipeline.gpipe import GPipe
from collsim.parallel.pipeline.interleaved import Interleaved
from collsim.parallel.pipeline.one_f_one_b import OneFOneB
from collsim.parallel.pipeline.zb_h1 import ZBH1

__all__ = [
    "BACKWARD_PHASES",
    "GRADIENT_PHASES",
    "Phase",
    "PipeOp",
    "PipelineSchedule",
    "SCHEDULES",
    "flow",
    "get_schedule",
    "stage_schedule",
    "input_of",
    "output_of",
    "warmup_forwards",
    "paired_ops",
]

SCHEDULES: dict[ScheduleKind, PipelineSchedule] = {
    s.kind: s for s in (GPipe(), OneFOneB(), Interleaved(), ZBH1(), DualPipeV())
}
"""Every schedule by its ``parallel.schedule`` name."""


def get_schedule(kind: ScheduleKind | str) -> PipelineSchedule:
    """The schedule named ``kind``."""
    known = SCHEDULES.get(kind)  # type: ignore[arg-type]
    if known is not None:  # a member, or its value (the members are strings)
        return known
    try:
        return SCHEDULES[ScheduleKind(kind)]
    except (ValueError, KeyError):
        raise ConfigError(f"unknown schedule {kind!r}", key_path="parallel.schedule") from None


def stage_schedule(
    kind: ScheduleKind | str,
    *,
    num_stages: int,
    num_microbatches: int,
    stage: int,
    virtual_stages: int = 1,
) -> list[PipeOp]:
    """The op order of one pipeline stage (:meth:`PipelineSchedule.order`).

    Args:
        kind: the schedule.
        num_stages: pipeline size p.
        num_microbatches: micro-batches per step m.
        stage: this stage's index, 0-based.
        virtual_stages: model chunks per stage v (interleaved only).

    Returns:
        Every (phase, micro-batch, chunk) of the stage exactly once, in execution order.
    """
    return get_schedule(kind).order(
        num_stages=num_stages,
        num_microbatches=num_microbatches,
        stage=stage,
        virtual_stages=virtual_stages,
    )


def warmup_forwards(
    kind: ScheduleKind | str,
    *,
    num_stages: int,
    num_microbatches: int,
    stage: int,
    virtual_stages: int = 1,
) -> int:
    """Forwards a stage runs before its first backward is due (GPipe: all of them)."""
    return get_schedule(kind).warmup_forwards(
        num_stages=num_stages,
        num_microbatches=num_microbatches,
        stage=stage,
        virtual_stages=virtual_stages,
    )


def paired_ops(
    kind: ScheduleKind | str,
    *,
    num_stages: int,
    num_microbatches: int,
    stage: int,
    virtual_stages: int = 1,
) -> frozenset[int]:
    """Indices, in :func:`stage_schedule`'s order, of the ops that run two at a time with
    ``parallel.ep_overlap`` (:meth:`PipelineSchedule.paired`; GPipe pairs nothing).

    Example:
        >>> sorted(paired_ops("1f1b", num_stages=1, num_microbatches=3, stage=0))
        [1, 2, 3, 4]
    """
    return get_schedule(kind).paired(
        num_stages=num_stages,
        num_microbatches=num_microbatches,
        stage=stage,
        virtual_stages=virtual_stages,
    )


def input_of(
    op: PipeOp,
    *,
    stage: int,
    num_stages: int,
    virtual_stages: int,
    schedule: ScheduleKind | str = ScheduleKind.ONE_F_ONE_B,
) -> tuple[int, PipeOp] | None:
    """The (stage, op) whose output this op consumes, or None
    (:meth:`PipelineSchedule.input_of` of ``schedule``)."""
    return get_schedule(schedule).input_of(
        op, stage=stage, num_stages=num_stages, virtual_stages=virtual_stages
    )


def output_of(
    op: PipeOp,
    *,
    stage: int,
    num_stages: int,
    virtual_stages: int,
    schedule: ScheduleKind | str = ScheduleKind.ONE_F_ONE_B,
) -> tuple[int, PipeOp] | None:
    """The (stage, op) that consumes this op's output, or None: the dual of
    :func:`input_of`."""
    return get_schedule(schedule).output_of(
        op, stage=stage, num_stages=num_stages, virtual_stages=virtual_stages
    )
