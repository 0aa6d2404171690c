"""The validation harness: run collectives and training steps for real and compare with collsim.

Four parts (torch is imported inside functions only, so the package imports without it):
:mod:`~collsim.validate.data` (the measurement vocabulary and its readers: collsim's collective
CSV, nccl-tests logs, Kineto traces), :mod:`~collsim.validate.measure` (what runs on the ranks:
the launcher, the collective bench, timed training steps, compute profiles, trace breakdowns),
:mod:`~collsim.validate.fit` (numerics, per-op and fabric calibration, device profiles from
traces) and :mod:`~collsim.validate.check` (simulated against measured: collectives, kernels,
steps, traces).
"""

from __future__ import annotations

__all__: list[str] = []
