"""docs/tutorial.md runs: its ```python blocks, in order, in one namespace, in a fresh folder
that links the repository's scenarios/ (as tests/test_docs.py runs the console examples)."""

from __future__ import annotations

import contextlib
import io
import os
from pathlib import Path

import pytest
from test_docs import read_blocks

REPO = Path(__file__).resolve().parents[1]


def test_tutorial_runs(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    (tmp_path / "scenarios").symlink_to(REPO / "scenarios")
    (tmp_path / "topologies").symlink_to(REPO / "topologies")
    monkeypatch.chdir(tmp_path)
    blocks = [b for b in read_blocks("tutorial.md") if b.lang == "python"]
    assert len(blocks) >= 8
    namespace: dict[str, object] = {"__name__": "tutorial"}
    out = io.StringIO()
    for block in blocks:
        code = compile(block.text, f"docs/tutorial.md:{block.line}", "exec")
        with contextlib.redirect_stdout(out):
            exec(code, namespace)  # noqa: S102 - the documentation's own examples
    text = out.getvalue()
    assert "ms per step, MFU" in text
    assert "parallel.zerro: unknown key" in text
    assert "--max-microbatches" in text
    assert (tmp_path / "step.png").read_bytes()[:4] == b"\x89PNG"
    assert os.path.getsize(tmp_path / "step.png") > 10_000
