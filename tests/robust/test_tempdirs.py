"""`validate step` and `validate holdout` leave no temporary folder behind, however they end."""

from __future__ import annotations

import tempfile
from pathlib import Path

import pytest
from click.testing import CliRunner

from collsim.cli import cli

REPO = Path(__file__).resolve().parents[2]
MEASURED = str(REPO / "validate" / "data" / "localhost_gloo_n2.csv")


@pytest.fixture
def tmpdir_here(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """Point tempfile at an empty folder of this test."""
    folder = tmp_path / "tmp"
    folder.mkdir()
    monkeypatch.setenv("TMPDIR", str(folder))
    monkeypatch.setattr(tempfile, "tempdir", None)  # re-read TMPDIR
    return folder


def test_holdout_removes_its_folder_on_success_and_failure(tmpdir_here: Path) -> None:
    ok = CliRunner().invoke(cli, ["validate", "holdout", MEASURED, "--ops", "all_reduce"])
    assert ok.exit_code in (0, 1), ok.output
    assert "temporary (keep them with --out-dir)" in ok.stdout
    failed = CliRunner().invoke(cli, ["validate", "holdout", MEASURED, "--target", "0.0001"])
    assert failed.exit_code == 1
    assert list(tmpdir_here.iterdir()) == []


def test_holdout_out_dir_is_kept_and_not_made_in_a_missing_folder(tmp_path: Path) -> None:
    keep = tmp_path / "ho"
    res = CliRunner().invoke(cli, ["validate", "holdout", MEASURED, "--out-dir", str(keep)])
    assert res.exit_code in (0, 1) and sorted(p.suffix for p in keep.iterdir())
    bad = CliRunner().invoke(
        cli, ["validate", "holdout", MEASURED, "--out-dir", str(tmp_path / "no" / "ho")]
    )
    assert bad.exit_code == 2 and not (tmp_path / "no").exists()


@pytest.mark.torch
def test_step_removes_its_folder_when_it_fails(tmpdir_here: Path) -> None:
    import torch

    if torch.cuda.is_available():
        pytest.skip("needs a torch without nccl to fail at once")
    res = CliRunner().invoke(cli, ["validate", "step", "--world-sizes", "2", "--backend", "nccl"])
    assert res.exit_code == 2 and "has no nccl backend" in res.stderr
    assert list(tmpdir_here.iterdir()) == []
