"""Output paths are checked before any simulation or measurement; exit 2; no folder created."""

from __future__ import annotations

import time
from pathlib import Path

import pytest
from click.testing import CliRunner

from collsim.cli import cli

REPO = Path(__file__).resolve().parents[2]
DDP = str(REPO / "scenarios" / "ddp_gpt3_1.3b.yaml")
MEASURED = str(REPO / "validate" / "data" / "localhost_gloo_n2.csv")


def _bad_paths(tmp: Path) -> dict[str, str]:
    (tmp / "file").write_text("x")
    (tmp / "folder.csv").mkdir()
    return {
        "proc": "/proc/x{suffix}",
        "under-a-file": str(tmp / "file" / "x{suffix}"),
        "missing-folder": str(tmp / "no" / "such" / "x{suffix}"),
        "a-folder": str(tmp / "folder.csv"),
    }


CASES = [
    (["run", DDP, "--json"], ".json", "--json"),
    (["run", DDP, "--trace"], ".json", "--trace"),
    (["run", DDP, "--plot"], ".png", "--plot"),
    (["sweep", DDP, "--gpus", "8,16", "-o"], ".csv", "--output"),
    (["search", DDP, "--gpus", "8", "-o"], ".csv", "--output"),
    (["validate", "bench", "-n", "2", "-o"], ".csv", "-o/--output"),
    (["validate", "calibrate", MEASURED, "-o"], ".yaml", "-o/--output"),
    (["validate", "compare", MEASURED, "--topology", "localhost", "--json"], ".json", "--json"),
    (["validate", "compare", MEASURED, "--topology", "localhost", "--plot"], ".png", "--plot"),
    (["validate", "step", "--world-sizes", "2", "-o"], ".json", "-o/--output"),
]


@pytest.mark.parametrize(
    "args, suffix, option", CASES, ids=[" ".join(c[0][:2]) + " " + c[2] for c in CASES]
)
def test_unwritable_outputs_fail_first(
    args: list[str], suffix: str, option: str, tmp_path: Path
) -> None:
    bad = _bad_paths(tmp_path)
    before = sorted(p.name for p in tmp_path.rglob("*"))
    for name, template in bad.items():
        path = template.format(suffix=suffix)
        if name == "a-folder" and suffix != ".csv":
            continue
        started = time.perf_counter()
        res = CliRunner().invoke(cli, [*args, path])
        assert res.exit_code == 2, (name, res.output)
        long_name = option.split("/")[-1]  # click names "-o" / "--output" in its own checks
        assert res.stderr.count("\n") == 1 and long_name in res.stderr, (name, res.stderr)
        assert time.perf_counter() - started < 5.0  # nothing was measured or simulated
    assert sorted(p.name for p in tmp_path.rglob("*")) == before  # nothing created


def test_parquet_needs_pyarrow(tmp_path: Path) -> None:
    import importlib.util

    res = CliRunner().invoke(cli, ["sweep", DDP, "-o", str(tmp_path / "s.parquet")])
    if importlib.util.find_spec("pyarrow") is None:
        assert res.exit_code == 2
        assert res.stderr == (
            "error: --output: writing .parquet needs pyarrow: pip install pyarrow "
            "(or use .csv or .json)\n"
        )
    else:
        assert res.exit_code == 0 and (tmp_path / "s.parquet").exists()


def test_sweep_writes_what_the_suffix_says(tmp_path: Path) -> None:
    import json

    import pandas as pd

    res = CliRunner().invoke(cli, ["sweep", DDP, "--gpus", "8,16", "-o", str(tmp_path / "s.json")])
    assert res.exit_code == 0, res.stderr
    records = json.loads((tmp_path / "s.json").read_text())
    assert [r["num_gpus"] for r in records] == [8, 16]
    assert records[0]["memory_peak_bytes"] > 1e9  # bytes in JSON
    csv = CliRunner().invoke(cli, ["sweep", DDP, "--gpus", "8,16", "-o", str(tmp_path / "s.csv")])
    assert csv.exit_code == 0
    assert list(pd.read_csv(tmp_path / "s.csv")["num_gpus"]) == [8, 16]
    bad = CliRunner().invoke(cli, ["sweep", DDP, "-o", str(tmp_path / "s.xlsx")])
    assert bad.exit_code == 2 and "must end in .csv or .json or .parquet" in bad.stderr


def test_sweep_table_is_in_gib(tmp_path: Path) -> None:
    from collsim.api import simulate

    res = CliRunner().invoke(cli, ["sweep", DDP, "--gpus", "8"])
    assert res.exit_code == 0
    header = next(line for line in res.stdout.splitlines() if "GPUs" in line)
    assert "peak GiB" in header and "peak GB " not in header
    peak = simulate(DDP).memory_peak_bytes
    assert f"{peak / 2**30:.1f}" in res.stdout


def test_collective_says_why_it_prints_one_row() -> None:
    res = CliRunner().invoke(
        cli,
        ["collective", "--topology", "dgx_h100", "--gpus", "8", "--op", "all_reduce",
         "-f", "1.5", "-b", "1", "-e", "64"],
    )  # fmt: skip
    assert res.exit_code == 0
    assert "note: the sweep stops at 1 B, before -e 64" in res.stderr
    assert "rounds down to 1 B" in res.stderr
