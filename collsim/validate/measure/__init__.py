"""Measuring on real ranks: the launcher, the collective bench, training steps timed on the
ranks, compute and kernel profiles of the local device, and the breakdown of profiler traces."""

from __future__ import annotations

__all__: list[str] = []
