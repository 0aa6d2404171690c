"""The SimPy engine: rank programs on streams, symmetry reduction, memory timeline, trace.

``simulate_step(topology, spec, training, parallel)`` returns a :class:`StepResult`; see
:mod:`collsim.play.engine.step` for the options (``all_ranks``, ``trace``, ``op_time_overrides``,
``fidelity``, ``zero_communication``).
"""

from __future__ import annotations

from collsim.play.engine.step import prepare_step, simulate_step
from collsim.step.result import CollectiveStat, StepResult, TraceEvent

__all__ = ["simulate_step", "prepare_step", "StepResult", "CollectiveStat", "TraceEvent"]
