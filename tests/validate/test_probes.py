"""The probes in validate/probes/ run and print what their docstrings say (tiny sizes)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.torch

PROBES = Path(__file__).resolve().parents[2] / "validate" / "probes"


def _run(*args: str) -> str:
    proc = subprocess.run([sys.executable, *args], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-2000:]
    return proc.stdout


def test_sched_noise_probe() -> None:
    out = _run(str(PROBES / "sched_noise.py"), "-n", "2", "--sizes", "4K", "--iters", "4")
    assert out.startswith("# all_reduce, 2 gloo ranks, 4 iterations, default policy")
    row = out.splitlines()[1]
    assert row.split()[0] == "4096" and "slowest median" in row and "skew median" in row
    assert len(out.splitlines()[2].split(":")[1].split()) == 4      # every sample printed


def test_allreduce_after_compute_probe() -> None:
    out = _run(str(PROBES / "allreduce_after_compute.py"), "-n", "2", "--size", "64K",
               "--compute-ms", "2", "--iters", "2")
    rows = [line.split() for line in out.splitlines()[1:]]
    assert [r[0] for r in rows] == ["alone", "after_compute", "after_compute_and_touch",
                                    "alone_again"]
    assert all(float(r[1]) > 0 for r in rows)


def test_ddp_overhead_probe() -> None:
    out = _run(str(PROBES / "ddp_overhead.py"), "-n", "2", "--iters", "1", "--warmup", "0")
    rows = {line.rsplit(None, 1)[0]: float(line.rsplit(None, 1)[1])
            for line in out.splitlines()[1:]}
    assert set(rows) == {"local", "all_reduce", "ddp", "ddp - local - all_reduce"}
    assert min(rows["local"], rows["all_reduce"], rows["ddp"]) > 0
    assert rows["ddp - local - all_reduce"] == pytest.approx(
        rows["ddp"] - rows["local"] - rows["all_reduce"], abs=0.15)
