"""The former home of the pipeline schedules, kept so that existing imports work: everything
lives in :mod:`collsim.parallel.pipeline` now."""

from collsim.parallel.pipeline import (
    Phase,
    PipeOp,
    input_of,
    output_of,
    paired_ops,
    stage_schedule,
    warmup_forwards,
)

__all__ = [
    "Phase",
    "PipeOp",
    "stage_schedule",
    "input_of",
    "output_of",
    "warmup_forwards",
    "paired_ops",
]
