"""Ctrl-C (SIGINT) of a real ``collsim sweep`` / ``collsim search`` process keeps the rows it
finished in ``-o``, and ``--resume`` finishes them with those rows unchanged."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pandas as pd
import pytest

REPO = Path(__file__).resolve().parents[2]
ENV = {**os.environ, "PYTHONPATH": str(REPO)}
CLI = [sys.executable, "-c", "import sys; from collsim.cli import main; sys.exit(main())"]


def _rows(path: Path) -> int:
    try:
        return len(pd.read_csv(path)) if path.exists() and path.stat().st_size else 0
    except (ValueError, OSError):
        return 0


def _interrupt_when(args: list[str], out: Path, rows: int, timeout_s: float = 120.0) -> int:
    """Run ``collsim ARGS`` and send it SIGINT once ``out`` holds ``rows`` rows; its exit code."""
    proc = subprocess.Popen(
        CLI + args,
        cwd=REPO,
        env=ENV,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        # a shell without job control starts background commands with SIGINT ignored
        preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL),
    )
    deadline = time.monotonic() + timeout_s
    try:
        while _rows(out) < rows and proc.poll() is None and time.monotonic() < deadline:
            time.sleep(0.05)
        assert proc.poll() is None, "finished before it could be interrupted"
        proc.send_signal(signal.SIGINT)
        _, err = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert b"Traceback" not in err, err.decode()
    assert b"--resume" in err, err.decode()
    return proc.returncode


SWEEP = [
    "sweep",
    "scenarios/ddp_gpt3_1.3b.yaml",
    "--gpus",
    "8,16,...,1024",
    "--set",
    "parallel.zero=0,1,2,3",
    "--set",
    "parallel.ddp.bucket_mb=10,25,50,100",
    "-j",
    "1",
]


def test_an_interrupted_sweep_keeps_its_rows_and_resume_finishes_them(tmp_path: Path) -> None:
    out = tmp_path / "sweep.csv"
    code = _interrupt_when([*SWEEP, "-o", str(out)], out, rows=1)
    assert code == 130
    kept = pd.read_csv(out)
    assert 1 <= len(kept) < 128
    done = subprocess.run(
        CLI + [*SWEEP, "-o", str(out), "--resume"], cwd=REPO, env=ENV, capture_output=True
    )
    assert done.returncode == 0, done.stderr.decode()
    resumed = pd.read_csv(out)
    full_path = tmp_path / "full.csv"
    full = subprocess.run(CLI + [*SWEEP, "-o", str(full_path)], cwd=REPO, env=ENV)
    assert full.returncode == 0
    whole = pd.read_csv(full_path)
    assert len(resumed) == len(whole) == 128
    # the rows the interrupted run kept are the resumed file's first rows, unchanged
    pd.testing.assert_frame_equal(resumed.iloc[: len(kept)], kept, check_dtype=False)
    columns = [c for c in whole.columns if c != "elapsed_s"]
    pd.testing.assert_frame_equal(resumed[columns], whole[columns], check_dtype=False)


def test_resume_refuses_another_sweeps_file(tmp_path: Path) -> None:
    out = tmp_path / "other.csv"
    pd.DataFrame({"plan": ["x"], "num_gpus": [3]}).to_csv(out, index=False)
    done = subprocess.run(
        CLI + [*SWEEP, "-o", str(out), "--resume"], cwd=REPO, env=ENV, capture_output=True
    )
    assert done.returncode == 2
    lines = done.stderr.decode().strip().splitlines()
    assert len(lines) == 1 and "--resume" in lines[0] and "row 1" in lines[0]


SEARCH = [
    "search",
    "scenarios/ddp_gpt3_1.3b.yaml",
    "--gpus",
    "32",
    "--simulate",
    "2",
    "--tolerance",
    "0",
    "-j",
    "1",
]


@pytest.mark.slow
def test_an_interrupted_search_keeps_its_plans_and_resume_continues(tmp_path: Path) -> None:
    out = tmp_path / "plans.csv"
    code = _interrupt_when([*SEARCH, "-o", str(out)], out, rows=1)
    assert code == 130
    kept = pd.read_csv(out)
    assert len(kept) >= 1
    done = subprocess.run(
        CLI + [*SEARCH, "-o", str(out), "--resume"], cwd=REPO, env=ENV, capture_output=True
    )
    assert done.returncode == 0, done.stderr.decode()
    assert f"{len(kept):,} plans taken from" in done.stdout.decode()
    resumed = pd.read_csv(out).set_index("plan")
    full_path = tmp_path / "full.csv"
    full = subprocess.run(CLI + [*SEARCH, "-o", str(full_path)], cwd=REPO, env=ENV)
    assert full.returncode == 0
    whole = pd.read_csv(full_path).set_index("plan")
    # every plan the interrupted run estimated is in the finished table with the same estimate
    est = [c for c in kept.columns if c.startswith("est_")]
    pd.testing.assert_frame_equal(resumed.loc[kept["plan"], est], kept.set_index("plan")[est])
    # and the best plans are those of a search that was never interrupted
    assert list(resumed.index[:10]) == list(whole.index[:10])
    assert list(resumed["est_step_time_s"][:10]) == list(whole["est_step_time_s"][:10])
