"""The step as data: per symmetry class, the typed operations a rank runs.

Built once per plan by :func:`build_schedule`; the SimPy engine (:mod:`collsim.play.engine`) plays
it, the closed form (:mod:`collsim.play.walk`) walks it. Results of both are
:class:`~collsim.step.result.StepResult`; memory of both is a
:class:`~collsim.step.memory.MemoryLedger` timeline.
"""

from __future__ import annotations

from collsim.step.blocks import BLOCK_OVERRIDE_KEYS
from collsim.step.build import StepSchedule, build_schedule
from collsim.step.result import CollectiveStat, StepResult, TraceEvent

__all__ = [
    "BLOCK_OVERRIDE_KEYS",
    "CollectiveStat",
    "StepResult",
    "StepSchedule",
    "TraceEvent",
    "build_schedule",
]
