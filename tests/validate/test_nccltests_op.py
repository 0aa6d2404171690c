"""``--op`` for logs that do not say which collective they are, and the one-line refusals of a
log that cannot be read: the missing ``--op``, an unknown op, a malformed line (exit 2)."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from collsim.cli import main

DATA = Path(__file__).resolve().parent / "data"


def run(argv: list[str], capsys: pytest.CaptureFixture[str]) -> tuple[int, str, str]:
    try:
        main(argv)
        code = 0
    except SystemExit as exc:
        code = int(exc.code or 0)
    out, err = capsys.readouterr()
    return code, out, err


def _headerless(tmp_path: Path) -> Path:
    path = tmp_path / "run1.log"  # rccl-tests prints no 'Collective test starting' line
    path.write_text((DATA / "rccl_all_reduce_1node.log").read_text())
    return path


@pytest.mark.parametrize("command", ["compare", "calibrate"])
def test_a_log_without_its_op_names_the_missing_op(
    command: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    path = _headerless(tmp_path)
    extra = (
        ["--topology", "mi300x"]
        if command == "compare"
        else ["-o", str(tmp_path / "t.yaml"), "--base", "mi300x"]
    )
    code, out, err = run(["validate", command, str(path), *extra], capsys)
    assert code == 2 and out == "" and "Traceback" not in err
    lines = err.strip().splitlines()
    assert len(lines) == 1 and "--op" in lines[0] and str(path) in lines[0], lines


def test_op_reads_the_log(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = _headerless(tmp_path)
    code, out, err = run(
        ["validate", "compare", str(path), "--topology", "mi300x", "--op", "allreduce"], capsys
    )
    assert code == 0, err
    assert "all_reduce" in out


@pytest.mark.parametrize(("value", "says"), [("alltoallv", "unknown op"), ("sort", "unknown op")])
def test_unknown_op_is_one_line(
    value: str, says: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    path = _headerless(tmp_path)
    code, out, err = run(
        ["validate", "compare", str(path), "--topology", "mi300x", "--op", value], capsys
    )
    assert code == 2 and out == ""
    lines = [line for line in err.strip().splitlines() if line.strip()]
    assert any(says in line and "--op" in line for line in lines), err
    assert "Traceback" not in err


def test_malformed_line_for_calibrate_names_it(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    lines = (DATA / "all_reduce_perf_2node.log").read_text().splitlines()
    index = next(i for i, line in enumerate(lines) if line and not line.startswith("#"))
    lines[index] = lines[index][: lines[index].rindex("0")]
    path = tmp_path / "all_reduce_perf.log"
    path.write_text("\n".join(lines) + "\n")
    code, out, err = run(
        ["validate", "calibrate", str(path), "-o", str(tmp_path / "t.yaml")], capsys
    )
    assert code == 2 and out == ""
    got = err.strip().splitlines()
    assert len(got) == 1 and re.search(re.escape(f"{path}:{index + 1}: malformed"), got[0]), got
