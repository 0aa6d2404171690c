"""The validation harness: run collectives and training steps for real and compare with collsim.

torch is imported inside functions only, so this package (and the core) imports without it.

- :mod:`~collsim.validate.measure.launch`: ranks that cannot hang (spawn + FileStore + watchdog, or
  torchrun with env://); :class:`~collsim.validate.measure.launch.RankFailure` names the rank.
- :mod:`~collsim.validate.measure.bench`: nccl-tests-style collective timing with result checks.
- :mod:`~collsim.validate.data.dataset`: measured CSV/JSON with metadata; the printed table.
- :mod:`~collsim.validate.fit.calibrate`: fit a topology (link latency, bandwidth, per-op
  algorithm, overhead and efficiency) to a measurement through collsim's own cost formula.
- :mod:`~collsim.validate.check.compare`: simulate the measured points; errors, summary, plot.
- :mod:`~collsim.validate.measure.sketch`: DDP and FSDP from scratch with their checks.
- :mod:`~collsim.validate.measure.step`: real DDP / FSDP-sketch steps of a small GPT, measured and
  simulated with the engine.
"""

from __future__ import annotations

__all__: list[str] = []
