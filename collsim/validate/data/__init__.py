"""The measurement vocabulary and its readers: collsim's collective CSV and JSON,
nccl-tests and rccl-tests logs, PyTorch profiler (Kineto) traces."""

from __future__ import annotations

__all__: list[str] = []
