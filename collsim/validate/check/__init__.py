"""Judging collsim against measurements: simulated against measured collectives, held-out
sizes, measured device profiles against the compute model, predicted against measured steps
and traces."""

from __future__ import annotations

__all__: list[str] = []
