"""Fixtures for the workload tests: a device built here, so the tests do not depend on the
hardware catalogue (A100 SXM 80GB figures from reference/hardware.yaml)."""

from __future__ import annotations

from dataclasses import dataclass, field

import pytest


@dataclass(frozen=True, slots=True, kw_only=True)
class FakeDevice:
    """Same fields as collsim.cluster.hardware.Device (docs/internals.md)."""

    name: str = "A100 SXM"
    peak_flops: dict[str, float] = field(
        default_factory=lambda: {"bf16": 312e12, "fp16": 312e12, "tf32": 156e12, "fp32": 19.5e12}
    )
    matmul_efficiency: float = 271.2 / 312  # MAMF, hardware.yaml
    memory_bytes: float = 80e9
    memory_bandwidth_bps: float = 2.039e12

    def peak_flops_for(self, dtype: str) -> float:
        return self.peak_flops[dtype]


@pytest.fixture
def a100() -> FakeDevice:
    return FakeDevice()
