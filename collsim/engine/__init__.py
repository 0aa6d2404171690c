"""The SimPy engine: rank programs on streams, symmetry reduction, memory timeline, trace."""

from __future__ import annotations

from collsim.engine.result import CollectiveStat, StepResult, TraceEvent
from collsim.engine.step import simulate_step

__all__ = ["simulate_step", "StepResult", "CollectiveStat", "TraceEvent"]
