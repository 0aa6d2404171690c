"""The wheel works without the source tree: presets and scenarios resolve after a plain install.

Slow (about a minute): builds the wheel with ``--no-build-isolation`` (no download), installs it
into a fresh virtualenv that sees the packages already installed (``--system-site-packages``)
and runs the two first commands a user types from an empty folder.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
TIMEOUT_S = 600


def _run(cmd: list[str], cwd: Path, env: dict[str, str] | None = None) -> str:
    done = subprocess.run(
        cmd, cwd=cwd, env=env, capture_output=True, text=True, timeout=TIMEOUT_S, check=False
    )
    assert done.returncode == 0, f"{' '.join(cmd)} exited {done.returncode}:\n{done.stderr}"
    return done.stdout


@pytest.mark.slow
def test_wheel_runs_from_an_empty_folder(tmp_path: Path) -> None:
    dist = tmp_path / "dist"
    _run(
        [
            sys.executable,
            "-m",
            "pip",
            "wheel",
            "--no-deps",
            "--no-build-isolation",
            "-w",
            str(dist),
            str(REPO),
        ],
        cwd=tmp_path,
    )
    wheels = list(dist.glob("collsim-*.whl"))
    assert len(wheels) == 1
    venv = tmp_path / "venv"
    _run([sys.executable, "-m", "venv", "--system-site-packages", str(venv)], cwd=tmp_path)
    py = venv / "bin" / "python"
    # The dependencies come from this interpreter's environment (no download): its
    # site-packages as a plain path entry, after the new venv's own (which gets the wheel).
    import sysconfig

    purelib = _run(
        [str(py), "-c", "import sysconfig; print(sysconfig.get_path('purelib'))"], cwd=tmp_path
    ).strip()
    (Path(purelib) / "deps.pth").write_text(sysconfig.get_path("purelib") + "\n")
    # --ignore-installed: an editable install of the checkout, seen through deps.pth, would
    # otherwise count as "already satisfied" and the wheel would not be installed
    _run(
        [str(py), "-m", "pip", "install", "--no-deps", "--no-index", "--ignore-installed"]
        + [str(wheels[0])],
        cwd=tmp_path,
    )
    work = tmp_path / "empty"
    work.mkdir()
    shutil.copy(REPO / "scenarios" / "ddp_gpt3_1.3b.yaml", work / "scenario.yaml")
    # no PYTHONPATH pointing at the source tree, and not run from inside it
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    where = _run(
        [
            str(py),
            "-c",
            "import collsim.cluster.topology as t; print(t.resolve_topology_path('dgx_h100'))",
        ],
        cwd=work,
        env=env,
    ).strip()
    assert str(venv) in where and "site-packages" in where, where
    collsim = str(venv / "bin" / "collsim")
    out = _run(
        [
            collsim,
            "collective",
            "--topology",
            "dgx_h100",
            "--gpus",
            "8",
            "--op",
            "all_reduce",
            "-b",
            "1M",
            "-e",
            "1M",
        ],
        cwd=work,
        env=env,
    )
    assert "1048576" in out
    out = _run([collsim, "run", "scenario.yaml"], cwd=work, env=env)
    assert "step" in out.lower()
