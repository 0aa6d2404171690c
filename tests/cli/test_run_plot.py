"""``collsim run --plot`` draws one Gantt row per pipeline stage, the stages as the plan places
its ranks (pp outermost in 3d_175b: ranks 0, 128, ..., 896 run stages 0 to 7)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from click.testing import CliRunner

from collsim.cli import cli
from collsim.report import plots

REPO = Path(__file__).resolve().parents[2]


def test_the_3d_plot_has_a_row_per_stage(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    drawn: list[Any] = []
    save = plots.save_figure

    def keep(fig: Any, path: Any) -> None:
        drawn.append(fig)
        save(fig, path)

    monkeypatch.setattr(plots, "save_figure", keep)
    out = tmp_path / "step.png"
    res = CliRunner().invoke(
        cli, ["run", str(REPO / "scenarios" / "3d_175b.yaml"), "--plot", str(out)]
    )
    assert res.exit_code == 0, res.output
    assert out.read_bytes()[:4] == b"\x89PNG" and len(drawn) == 1
    gantt = drawn[0].axes[0]
    rows = [t.get_text() for t in gantt.get_yticklabels() if t.get_text().startswith("stage")]
    assert rows == [f"stage {s} (rank {s * 128})" for s in range(8)]
