"""The step as data: per symmetry class, the typed operations a rank runs.

Built once per plan by :func:`build_schedule`; the SimPy engine (:mod:`collsim.engine`) plays
it, the closed form (:mod:`collsim.estimate`) walks it. Results of both are
:class:`~collsim.schedule.result.StepResult`; memory of both is a
:class:`~collsim.schedule.memory.MemoryLedger` timeline.
"""

from __future__ import annotations

from collsim.schedule.build import BLOCK_OVERRIDE_KEYS, StepSchedule, build_schedule
from collsim.schedule.result import CollectiveStat, StepResult, TraceEvent

__all__ = [
    "BLOCK_OVERRIDE_KEYS",
    "CollectiveStat",
    "StepResult",
    "StepSchedule",
    "TraceEvent",
    "build_schedule",
]
