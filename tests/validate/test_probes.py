"""The probes in validate/probes/ run and print what their docstrings say (tiny sizes)."""

from __future__ import annotations

import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

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
    assert len(out.splitlines()[2].split(":")[1].split()) == 4  # every sample printed


def test_allreduce_after_compute_probe() -> None:
    out = _run(
        str(PROBES / "allreduce_after_compute.py"),
        "-n",
        "2",
        "--size",
        "64K",
        "--compute-ms",
        "2",
        "--iters",
        "2",
    )
    rows = [line.split() for line in out.splitlines()[1:]]
    assert [r[0] for r in rows] == [
        "alone",
        "after_compute",
        "after_compute_and_touch",
        "alone_again",
    ]
    assert all(float(r[1]) > 0 for r in rows)


def test_ddp_overhead_probe() -> None:
    out = _run(str(PROBES / "ddp_overhead.py"), "-n", "2", "--iters", "1", "--warmup", "0")
    rows = {
        line.rsplit(None, 1)[0]: float(line.rsplit(None, 1)[1]) for line in out.splitlines()[1:]
    }
    assert set(rows) == {"local", "all_reduce", "ddp", "ddp - local - all_reduce"}
    assert min(rows["local"], rows["all_reduce"], rows["ddp"]) > 0
    assert rows["ddp - local - all_reduce"] == pytest.approx(
        rows["ddp"] - rows["local"] - rows["all_reduce"], abs=0.15
    )


def _knee_rules() -> Any:
    """validate/probes/knee_rules.py as a module."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("knee_rules", PROBES / "knee_rules.py")
    probe = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(probe)
    return probe


def test_knee_rules_probe() -> None:
    data = PROBES.parents[0] / "data" / "localhost_gloo_n2.csv"
    out = _run(str(PROBES / "knee_rules.py"), str(data), "--rules", "line")
    lines = out.splitlines()
    rows = [line for line in lines if line.startswith("data/localhost_gloo_n2.csv n=2 ")]
    assert [r.split()[2] for r in rows] == ["line"]
    for r in rows:
        ops = dict(item.split("=") for item in r.split()[3:])
        assert {"all_reduce", "all_gather", "broadcast"} <= set(ops)
        assert all(0 <= float(v) < 100 for v in ops.values())
    summary = [
        line.split()
        for line in lines[
            lines.index(next(line for line in lines if line.startswith("# rule"))) + 1 :
        ]
    ]
    assert [s[0] for s in summary] == ["line"]
    assert all(s[3].endswith("/3") for s in summary)  # 3 checked ops of one file


def test_knee_rules_figures_are_holdouts() -> None:
    """The probe's F0.05 figures (its fitted curve) are what ``holdout`` gets from the
    calibrated topology through the simulator, to 0.1 point."""
    from collsim.validate.check.compare import compare, summarize, topology_for
    from collsim.validate.data.dataset import read_measurements
    from collsim.validate.fit.calibrate import calibrate, write_topology

    probe = _knee_rules()
    path = PROBES.parents[0] / "data" / "localhost_gloo_n2.csv"
    meas = read_measurements(path)
    topo = topology_for(
        write_topology(calibrate(meas, subset="even"), Path(tempfile.mkdtemp()) / "even.yaml"), meas
    )
    tool = {
        s.op: s.median_abs_error
        for s in summarize(compare(meas, topo, subset="odd", min_bytes=2**18))
    }
    figures = probe.held_out_errors(str(path), probe.RULES["F0.05"], 2**18)
    assert set(figures) == set(tool) - {"all"}
    for op, err in figures.items():
        assert err == pytest.approx(tool[op], abs=1e-3), op


def test_knee_rules_standard_error() -> None:
    import math

    probe = _knee_rules()
    row = {"time_us": 100.0, "p90_us": 100.0 + 1.2816 * 10.0, "iters": 100}
    # sigma 10 us, SE of the median sqrt(pi/2) x 10 / 10 us, relative to 100 us
    assert probe.relative_standard_error(row) == pytest.approx(math.sqrt(math.pi / 2) / 100)
    assert probe.relative_standard_error({**row, "p90_us": 100.0}) == 1e-3  # the floor
