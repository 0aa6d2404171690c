"""The shared types of pipeline schedules: an op, and a schedule as data (its op order per
stage, its placement of model chunks on stages, the dependencies that placement implies).
See docs/pipelines.md."""

from __future__ import annotations

from collections.abc import Sequence
from typing import NamedTuple

from collsim.core.errors import ConfigError
from collsim.core.vocab import PipelinePhase, ScheduleKind

Phase = PipelinePhase
"""The name the schedules use for :class:`collsim.core.vocab.PipelinePhase`."""

__all__ = [
    "Phase",
    "PipeOp",
    "PipelineSchedule",
    "BACKWARD_PHASES",
    "GRADIENT_PHASES",
    "flow",
]

BACKWARD_PHASES = frozenset((Phase.BACKWARD, Phase.BACKWARD_INPUT))
"""Ops that carry the input gradient to the previous model part (a whole backward, or its
input-gradient part)."""
GRADIENT_PHASES = frozenset((Phase.BACKWARD, Phase.BACKWARD_WEIGHT))
"""Ops that produce weight gradients (data-parallel readiness follows them)."""


def flow(phase: Phase) -> Phase:
    """The direction of the message an op sends or reads: forward, or backward for a whole
    backward and an input-gradient op alike (a downstream part may run either for the same
    micro-batch)."""
    return Phase.BACKWARD if phase is Phase.BACKWARD_INPUT else phase


class PipeOp(NamedTuple):
    """One pass of one micro-batch through one model chunk of a stage.

    A named tuple, not a frozen dataclass: a step builds one per op of every stage (1,536 for
    3d_175b) and a frozen dataclass's ``__init__`` sets each field through
    ``object.__setattr__``, about three times the cost."""

    phase: Phase
    microbatch: int
    chunk: int = 0


class PipelineSchedule:
    """A pipeline schedule as data. Subclasses give :meth:`order` (and, where they differ
    from the defaults, the chunks per stage, the placement and the checks); the
    dependencies follow from the placement.

    The model is cut into ``p x v`` consecutive parts (virtual stages); :meth:`part_of`
    places chunk ``c`` of stage ``s`` on one of them. A forward of part ``k`` reads the
    forward of part ``k - 1``; a backward (whole or input-gradient) of part ``k`` reads the
    backward of part ``k + 1`` (the last part's follows its own forward and the loss); a
    weight-gradient op reads only its own stage's input-gradient op, earlier in the order.
    """

    kind: ScheduleKind = ScheduleKind.ONE_F_ONE_B
    splits_backward: bool = False
    """Some backward ops run as an input-gradient op and a weight-gradient op."""

    def chunks(self, virtual_stages: int) -> int:
        """Model chunks per stage (``parallel.virtual_stages`` where the schedule takes it)."""
        return 1

    def part_of(self, stage: int, chunk: int, num_stages: int, virtual_stages: int) -> int:
        """The model part (virtual stage) chunk ``chunk`` of ``stage`` holds: ``c p + s``
        (Megatron's interleaving; one chunk per stage: the stage)."""
        return chunk * num_stages + stage

    def where(self, part: int, num_stages: int, virtual_stages: int) -> tuple[int, int]:
        """(stage, chunk) of model part ``part``: the inverse of :meth:`part_of`."""
        return part % num_stages, part // num_stages

    def check(self, *, num_stages: int, num_microbatches: int, virtual_stages: int) -> None:
        """Raise a ConfigError when the schedule cannot run this shape."""

    def order(
        self, *, num_stages: int, num_microbatches: int, stage: int, virtual_stages: int
    ) -> list[PipeOp]:
        """Every op of ``stage`` exactly once, in execution order."""
        raise NotImplementedError

    def warmup_forwards(
        self, *, num_stages: int, num_microbatches: int, stage: int, virtual_stages: int
    ) -> int:
        """Forwards a stage runs before its first backward."""
        ops = self.order(
            num_stages=num_stages,
            num_microbatches=num_microbatches,
            stage=stage,
            virtual_stages=virtual_stages,
        )
        return next((i for i, op in enumerate(ops) if op.phase is not Phase.FORWARD), len(ops))

    def paired(
        self, *, num_stages: int, num_microbatches: int, stage: int, virtual_stages: int
    ) -> frozenset[int]:
        """Indices into :meth:`order` of the ops that run as forward-backward pairs with
        ``parallel.ep_overlap`` (none by default)."""
        return frozenset()

    # ---- dependencies, from the placement ----------------------------------------------------
    def input_of(
        self, op: PipeOp, *, stage: int, num_stages: int, virtual_stages: int
    ) -> tuple[int, PipeOp] | None:
        """The (stage, op) whose output ``op`` reads, or None (a backward source is named
        with :attr:`Phase.BACKWARD`, whichever backward op its stage runs: :func:`flow`)."""
        p, v = num_stages, virtual_stages
        phase = op.phase
        if phase is Phase.BACKWARD_WEIGHT:
            return None
        k = self.part_of(stage, op.chunk, p, v)
        if phase is Phase.FORWARD:
            if k == 0:
                return None
            s, c = self.where(k - 1, p, v)
            return s, PipeOp(Phase.FORWARD, op.microbatch, c)
        if k == p * v - 1:
            return None
        s, c = self.where(k + 1, p, v)
        return s, PipeOp(Phase.BACKWARD, op.microbatch, c)

    def output_of(
        self, op: PipeOp, *, stage: int, num_stages: int, virtual_stages: int
    ) -> tuple[int, PipeOp] | None:
        """The (stage, op) that reads ``op``'s output, or None: the dual of
        :meth:`input_of`."""
        p, v = num_stages, virtual_stages
        phase = op.phase
        if phase is Phase.BACKWARD_WEIGHT:
            return None
        k = self.part_of(stage, op.chunk, p, v)
        if phase is Phase.FORWARD:
            if k == p * v - 1:
                return None
            s, c = self.where(k + 1, p, v)
            return s, PipeOp(Phase.FORWARD, op.microbatch, c)
        if k == 0:
            return None
        s, c = self.where(k - 1, p, v)
        return s, PipeOp(Phase.BACKWARD, op.microbatch, c)


def one_f_one_b(fwd: Sequence[PipeOp], bwd: Sequence[PipeOp], warmup: int) -> list[PipeOp]:
    """``warmup`` forwards, then one forward and one backward in turn, then the rest."""
    remaining = len(fwd) - warmup
    order = list(fwd[:warmup])
    order += [op for pair in zip(fwd[warmup:], bwd[:remaining]) for op in pair]
    order += bwd[remaining:]
    return order


def check_stage(stage: int, num_stages: int) -> None:
    if not 0 <= stage < num_stages:
        raise ConfigError(f"stage must be in [0, {num_stages}), got {stage}")
