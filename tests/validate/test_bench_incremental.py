"""`validate bench -o x.csv` keeps every finished point: killed half-way with SIGKILL, the file
holds whole rows that `validate compare` accepts, and `--resume` measures only the rest."""

from __future__ import annotations

import os
import pty
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from collsim.validate.data.dataset import read_measurements

pytestmark = pytest.mark.torch

REPO = Path(__file__).resolve().parents[2]
#: 2 ops x 11 sizes (1 KiB .. 1 MiB), 40 timed iterations each: long enough to be stopped half-way
BENCH = [
    "validate", "bench", "-n", "2", "--ops", "all_reduce,broadcast", "-b", "1K", "-e", "1M",
    "--iters", "40", "--warmup", "1", "--timeout", "120",
]  # fmt: skip
TOTAL = 2 * 11


def _collsim(*args: str, cwd: Path) -> list[str]:
    return [sys.executable, "-c", "from collsim.cli import main; main()", *args]


def _drain(fd: int) -> str:
    chunks = []
    while True:
        try:
            data = os.read(fd, 65536)
        except OSError:  # EIO: the other side is closed
            break
        if not data:
            break
        chunks.append(data)
    os.close(fd)
    return b"".join(chunks).decode(errors="replace")


def _rows(path: Path) -> int:
    if not path.exists():
        return 0
    lines = [ln for ln in path.read_text().splitlines() if ln and not ln.startswith("#")]
    return max(0, len(lines) - 1)  # minus the header


def test_killed_bench_keeps_its_points_and_resumes(tmp_path: Path) -> None:
    out = tmp_path / "b.csv"
    scratch = tmp_path / "tmp"  # the run's temporary folders go here
    scratch.mkdir()
    env = {**os.environ, "PYTHONPATH": str(REPO), "TMPDIR": str(scratch)}
    proc = subprocess.Popen(
        _collsim(*BENCH, "-o", str(out), cwd=tmp_path),
        cwd=tmp_path,
        env=env,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        start_new_session=True,
    )
    deadline = time.monotonic() + 90
    try:
        while _rows(out) < 3 and time.monotonic() < deadline and proc.poll() is None:
            time.sleep(0.02)
        assert proc.poll() is None, "the bench ended before it could be killed"
        os.kill(proc.pid, signal.SIGKILL)  # the parent: no clean-up of its own at all
    finally:
        _, err_bytes = proc.communicate(timeout=30)
    # its ranks see the parent gone within half a second: they remove the run's folder and end
    deadline = time.monotonic() + 10
    while list(scratch.glob("collsim-*")) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert list(scratch.glob("collsim-*")) == []  # (torch keeps a torchinductor_* of its own)
    stderr = err_bytes.decode()
    assert "bench:" not in stderr  # no progress line when stderr is not a terminal
    partial = read_measurements(out)
    done = len(partial.rows)
    assert 3 <= done < TOTAL
    assert partial.metadata["world_size"] == 2 and "partial" in partial.metadata["status"]
    assert all(r["time_us"] > 0 and r["wrong"] == 0 for r in partial.rows)

    plot = tmp_path / "cmp.png"
    cmp = subprocess.run(
        _collsim("validate", "compare", str(out), "--topology", "localhost", "--plot", str(plot),
                 cwd=tmp_path),
        cwd=tmp_path, env=env, capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert cmp.returncode == 0, cmp.stderr
    assert plot.exists()

    # resumed with stderr on a terminal: the progress line shows points done and an ETA
    master, slave = pty.openpty()
    res = subprocess.run(
        _collsim(*BENCH, "-o", str(out), "--resume", cwd=tmp_path),
        cwd=tmp_path, env=env, stdout=subprocess.PIPE, stderr=slave, timeout=180,
    )  # fmt: skip
    os.close(slave)
    terminal = _drain(master)
    assert res.returncode == 0, terminal
    assert f"resuming {out}: {done} point(s) already measured" in terminal
    left = TOTAL - done
    assert re.search(rf"bench: {left}/{left} done, \d+ s, ETA 0 s", terminal), terminal
    assert re.search(rf"bench: 1/{left} done, \d+ s, ETA \d+ s", terminal), terminal
    full = read_measurements(out)
    assert len(full.rows) == TOTAL
    keys = [(r["op"], r["size_bytes"]) for r in full.rows]
    assert len(set(keys)) == TOTAL
    # the points measured before the kill are kept as they were, not measured again
    before = {(r["op"], r["size_bytes"]): r["time_us"] for r in partial.rows}
    after = {(r["op"], r["size_bytes"]): r["time_us"] for r in full.rows}
    assert all(after[k] == pytest.approx(v, rel=1e-6) for k, v in before.items())
    assert "status" not in full.metadata and "overhead_noop_us" in full.metadata
    assert not list(tmp_path.glob(".*writing*"))


def test_resume_refuses_a_file_measured_otherwise(tmp_path: Path) -> None:
    from click.testing import CliRunner

    from collsim.cli import cli

    out = tmp_path / "b.csv"
    out.write_text(
        '# backend: "gloo"\n# world_size: 2\n# iters: 40\n'
        "op,size_bytes,count,type,redop,root,time_us,min_us,p90_us,algbw_gbps,busbw_gbps,"
        "wrong,world_size,iters\n"
        "all_reduce,1024,256,float,sum,-1,50,40,60,0.02,0.02,0,2,40\n"
    )
    res = CliRunner().invoke(
        cli, ["validate", "bench", "-n", "2", "--iters", "10", "-o", str(out), "--resume"]
    )
    assert res.exit_code == 2
    assert "cannot resume: it was measured with iters 40, this run asks for 10" in res.stderr


def test_missing_torch_is_one_line_with_the_install_command(tmp_path: Path) -> None:
    code = (
        "import sys; sys.modules['torch'] = None\n"
        "from collsim.cli import main\n"
        "main(['validate', 'bench', '-n', '2', '-o', 'b.csv'])\n"
    )
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    proc = subprocess.run(
        [sys.executable, "-c", code], cwd=tmp_path, env=env, capture_output=True, text=True,
        timeout=60,
    )  # fmt: skip
    assert proc.returncode == 2
    assert proc.stderr == (
        "error: --backend: torch is not installed; the validate commands need it: "
        "pip install 'collsim[validate]' (or: pip install torch==2.13.0)\n"
    )
    assert list(tmp_path.iterdir()) == []


def test_a_backend_torch_lacks_is_one_line(tmp_path: Path) -> None:
    import torch

    if torch.cuda.is_available():
        pytest.skip("this torch has CUDA")
    from click.testing import CliRunner

    from collsim.cli import cli

    res = CliRunner().invoke(cli, ["validate", "bench", "--backend", "nccl", "-n", "2"])
    assert res.exit_code == 2 and res.stderr.count("\n") == 1
    assert "has no nccl backend" in res.stderr and "--index-url" in res.stderr
