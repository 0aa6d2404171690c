"""Fitting models to measurements: the numerics, a topology's per-op calibration, the
multi-node fabric calibration, and device profiles learned from traces."""

from __future__ import annotations

__all__: list[str] = []
