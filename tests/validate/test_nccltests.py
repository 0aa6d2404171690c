"""nccl-tests and rccl-tests output in: the printed format of the fixtures, the reader, the
multi-node calibration and its round trip through ``validate compare``."""

from __future__ import annotations

import importlib.util
import json
import re
import sys
from pathlib import Path
from typing import Any

import pytest

from collsim.cli import main
from collsim.core.errors import ConfigError
from collsim.validate.data.dataset import read_measurements
from collsim.validate.data.nccltests import bus_factor
from collsim.validate.data.nccltests_format import float_str

DATA = Path(__file__).resolve().parent / "data"
LOGS = (
    "all_reduce_perf_1node.log",
    "all_reduce_perf_2node.log",
    "all_gather_perf_1node.log",
    "all_gather_perf_2node.log",
)


def _generator() -> Any:
    spec = importlib.util.spec_from_file_location("fixtures", DATA / "make_nccltests_fixtures.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules["fixtures"] = module
    spec.loader.exec_module(module)
    return module


def run(argv: list[str], capsys: pytest.CaptureFixture[str]) -> tuple[int, str, str]:
    try:
        main(argv)
        code = 0
    except SystemExit as exc:
        code = int(exc.code or 0)
    out, err = capsys.readouterr()
    return code, out, err


# ------------------------------------------------------------------- the printed format


def test_float_str_follows_getfloatstr() -> None:
    """src/util.cu getFloatStr: %.2f, else %.1f, %.0f, %.1e (width >= 7) or %.0e."""
    assert float_str(36.77, 7) == "  36.77"
    assert float_str(12666.4, 7) == "12666.4"  # "12666.40" is 8 wide
    assert float_str(123456.7, 7) == " 123457"
    assert float_str(12345678.0, 7) == "1.2e+07"
    assert float_str(0.001, 6) == "  0.00"
    assert float_str(1234.5, 6) == "1234.5"
    assert float_str(1234567.0, 6) == " 1e+06"


def test_fixture_lines_have_nccl_tests_widths() -> None:
    """Every line of the text fixtures is one of nccl-tests 2.19.6's printf formats."""
    # column header of writeResultHeader, "%10s  %12s  %8s  %6s  %6s  %7s  %6s ..." (no -S)
    names = ("size", "count", "type", "redop", "root", "time", "algbw", "busbw", "#wrong")
    header = "# %10s  %12s  %8s  %6s  %6s  %7s  %6s  %6s  %6s  %7s  %6s  %6s  %6s " % (
        *names,
        *names[5:],
    )
    number = r"[ \d.e+-]"
    row = re.compile(
        r"^[ \d]{12}  [ \d]{12}  [ \w]{8}  [ \w]{6}  [ \d-]{6}"
        + rf"(  {number}{{7}}  {number}{{6}}  {number}{{6}}  [ \d]{{6}}){{2}}$"
    )
    for name in LOGS:
        lines = (DATA / name).read_text().splitlines()
        assert header in lines, name
        rows = [line for line in lines if line and not line.startswith("#")]
        assert rows and all(row.match(line) for line in rows), name
        assert len(rows[0]) == 12 + 2 + 12 + 2 + 8 + 2 + 6 + 2 + 6 + 2 * 33
        ranks = [line for line in lines if line.startswith("#  Rank")]
        pattern = r"^#  Rank [ \d]{2} Group [ \d]{2} Pid [ \d]{6} on [ \w-]{10} device [ \d]{2} "
        assert all(
            re.match(pattern + r"\[[0-9a-f]{4}:[0-9a-f]{2}:[0-9a-f]{2}\] ", r) for r in ranks
        )
        assert lines[-2:] == ["#", ""]  # finalizeFooter, then writeErrors' empty line
        assert "# Out of bounds values : 0 OK" in lines
        footer = next(line for line in lines if line.startswith("# Avg bus bandwidth"))
        assert re.fullmatch(r"# Avg bus bandwidth    : [\d.]+ ", footer)


def test_fixture_json_is_nccl_tests_json() -> None:
    text = (DATA / "all_reduce_perf_2node.json").read_text()
    assert "\n" not in text.rstrip("\n") and ": " not in text  # one line, no spaces
    doc = json.loads(text)
    assert doc["version"] == 3 and doc["args"][0] == "all_reduce_perf"
    assert len(doc["config"]["devices"]) == 16
    first = doc["results"][0]
    assert first["root"] == "    -1"  # "%6i", a string
    assert set(first["out_of_place"]) == {"time", "alg_bw", "bus_bw", "nwrong"}
    assert re.search(r'"time":\d+\.\d{6},', text)  # %lf


# ------------------------------------------------------------------------------ the reader


def test_one_and_two_node_logs() -> None:
    one = read_measurements(DATA / "all_reduce_perf_1node.log")
    two = read_measurements(DATA / "all_reduce_perf_2node.log")
    assert (one.kind, one.world_size, one.num_nodes, one.ranks_per_node) == ("nccl-tests", 8, 1, 8)
    assert (two.world_size, two.num_nodes, two.ranks_per_node) == (16, 2, 8)
    assert two.metadata["hosts"] == ["dgxh100-01", "dgxh100-02"]
    assert two.metadata["device"] == "NVIDIA H100 80GB HBM3"
    assert two.metadata["iters"] == 20 and two.metadata["nccl_tests_version"] == "2.19.6"
    assert [r["size_bytes"] for r in two.rows][:3] == [8, 16, 32]
    last = two.rows[-1]
    assert last["op"] == "all_reduce" and last["size_bytes"] == 8 << 30
    assert last["count"] == 2 << 30 and last["type"] == "float" and last["redop"] == "sum"
    assert last["in_place_time_us"] != last["time_us"]  # both blocks are read
    # busbw as printed is algbw x 2(n-1)/n (two decimals)
    assert last["busbw_gbps"] == pytest.approx(
        last["algbw_gbps"] * bus_factor("all_reduce", 16), abs=0.01
    )
    mean = sum(r["busbw_gbps"] + r["in_place_busbw_gbps"] for r in two.rows) / (2 * len(two.rows))
    assert two.metadata["avg_busbw_gbps"] == pytest.approx(mean, rel=2e-3)
    gather = read_measurements(DATA / "all_gather_perf_2node.log")
    assert gather.rows[0]["count"] == 1024 // 4 // 16  # per-rank count, as nccl-tests prints


def test_json_and_text_give_the_same_rows() -> None:
    text = read_measurements(DATA / "all_reduce_perf_2node.log")
    doc = read_measurements(DATA / "all_reduce_perf_2node.json")
    assert doc.kind == "nccl-tests-json" and doc.world_size == 16 and doc.num_nodes == 2
    for a, b in zip(text.rows, doc.rows, strict=True):
        assert a["size_bytes"] == b["size_bytes"] and a["count"] == b["count"]
        assert a["time_us"] == pytest.approx(b["time_us"], rel=1e-4, abs=0.006)


def test_rccl_tests_log() -> None:
    rccl = read_measurements(DATA / "rccl_all_reduce_1node.log")
    nccl = read_measurements(DATA / "all_reduce_perf_1node.log")
    assert (
        rccl.kind == "rccl-tests" and rccl.world_size == 8 and rccl.metadata["op"] == "all_reduce"
    )
    for a, b in zip(rccl.rows, nccl.rows, strict=True):
        assert a["time_us"] == pytest.approx(b["time_us"], rel=1e-4, abs=0.5)  # %7.0f above 10 ms


def test_content_not_suffix_decides(tmp_path: Path) -> None:
    log = tmp_path / "all_reduce_perf.csv"
    log.write_text((DATA / "all_reduce_perf_1node.log").read_text())
    assert read_measurements(log).kind == "nccl-tests"
    table = tmp_path / "table.log"
    table.write_text("op,size_bytes,time_us,ranks\nall_reduce,1024,10.5,2\n")
    meas = read_measurements(table)
    assert meas.kind == "csv" and meas.rows[0]["time_us"] == 10.5


def test_the_op_comes_from_the_file_name_without_a_starting_line(tmp_path: Path) -> None:
    text = (DATA / "rccl_all_reduce_1node.log").read_text()
    (tmp_path / "reduce_scatter-mi300.log").write_text(text)
    assert (
        read_measurements(tmp_path / "reduce_scatter-mi300.log").metadata["op"] == "reduce_scatter"
    )
    (tmp_path / "run1.log").write_text(text)
    with pytest.raises(ConfigError, match=r"run1.log: op: cannot tell the collective"):
        read_measurements(tmp_path / "run1.log")
    (tmp_path / "gather_perf.log").write_text(text)
    with pytest.raises(ConfigError, match="gather is not modelled"):
        read_measurements(tmp_path / "gather_perf.log")


def _edit(tmp_path: Path, name: str, line_no: int, new: str) -> tuple[Path, int]:
    lines = (DATA / name).read_text().splitlines()
    lines[line_no - 1] = new
    path = tmp_path / name
    path.write_text("\n".join(lines) + "\n")
    return path, line_no


def _time(row: str, value: str) -> str:
    """The row with its out-of-place time (the 6th field) replaced, widths kept."""
    old = row.split()[5]
    at = row.index(" " + old + " ") + 1
    return row[:at] + value.rjust(len(old)) + row[at + len(old) :]


def _first_row(name: str) -> tuple[int, str]:
    lines = (DATA / name).read_text().splitlines()
    index = next(i for i, line in enumerate(lines) if line and not line.startswith("#"))
    return index + 1, lines[index]


@pytest.mark.parametrize(
    ("change", "expected"),
    [
        (lambda row: row[: row.rindex("0")], r"malformed nccl-tests row: expected 5 fields"),
        (lambda row: _time(row, "fast"), r"time_us: not a number: 'fast'"),
        (lambda row: _time(row, "-nan"), r"time_us: must be a finite number > 0"),
        (lambda row: _time(row, "inf"), r"time_us: must be a finite number > 0"),
        (lambda row: _time(row, "0.00"), r"time_us: must be a finite number > 0"),
        (lambda row: row[:-6] + "    -3", r"in_place_wrong: must be >= 0, got -3"),
    ],
    ids=["short-row", "word", "nan", "inf", "zero", "negative-wrong"],
)
def test_malformed_log_line_is_one_line_exit_2(
    change: Any, expected: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    line_no, row = _first_row("all_reduce_perf_2node.log")
    path, _ = _edit(tmp_path, "all_reduce_perf_2node.log", line_no, change(row))
    code, out, err = run(["validate", "compare", str(path), "--topology", "dgx_h100"], capsys)
    assert code == 2 and out == ""
    lines = err.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in err
    assert re.search(re.escape(f"{path}:{line_no}: ") + expected, lines[0]), lines[0]


def test_json_nan_time_is_refused(tmp_path: Path) -> None:
    text = (DATA / "all_reduce_perf_2node.json").read_text()
    first = re.search(r'"time":[\d.]+', text)
    assert first is not None
    bad = tmp_path / "all_reduce_perf.json"
    bad.write_text(text.replace(first.group(0), '"time":"nan"', 1))
    with pytest.raises(ConfigError, match=r"all_reduce_perf.json:1: time_us: must be a finite"):
        read_measurements(bad)


# ----------------------------------------------------------------- calibrate and compare


def test_calibrate_then_compare_round_trip(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """The topology fitted on the one- and two-node fixtures predicts each of them within
    5 % at every size, and finds the figures they were made from."""
    out = tmp_path / "fitted.yaml"
    logs = [str(DATA / name) for name in LOGS]
    code, text, err = run(["validate", "calibrate", *logs, "-o", str(out)], capsys)
    assert code == 0, err
    assert "dgx_h100" in text and f"# wrote {out}" in err  # files written: on stderr
    for name in LOGS + ("all_reduce_perf_2node.json", "rccl_all_reduce_1node.log"):
        report = tmp_path / f"{name}.json"
        code, text, err = run(
            [
                "validate",
                "compare",
                str(DATA / name),
                "--topology",
                str(out),
                "--plot",
                str(tmp_path / "p.png"),
                "--json",
                str(report),
            ],
            capsys,
        )
        assert code == 0, err
        points = json.loads(report.read_text())["points"]
        assert len(points) >= 24
        worst = max(abs(p["error"]) for p in points)
        assert worst <= 0.05, (name, worst)
    truth = _generator().TRUTH
    import yaml

    fitted = yaml.safe_load(out.read_text())
    for dotted, value in truth.items():
        section, key = dotted.split(".")
        assert fitted[section][key] == pytest.approx(value, rel=0.05), dotted
    assert fitted["nodes"] == 2 and fitted["gpus_per_node"] == 8


def test_base_topology_is_far_off_before_the_fit(
    capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    """The fixtures are not the shipped dgx_h100: the round trip above tests the fit."""
    report = tmp_path / "r.json"
    code, _, err = run(
        [
            "validate",
            "compare",
            str(DATA / "all_reduce_perf_2node.log"),
            "--topology",
            "dgx_h100",
            "--plot",
            str(tmp_path / "p.png"),
            "--json",
            str(report),
        ],
        capsys,
    )
    assert code == 0, err
    summary = json.loads(report.read_text())["summary"]
    assert summary[-1]["median_abs_error"] > 0.15


def test_calibrate_needs_a_machine_it_knows(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    text = (
        (DATA / "all_reduce_perf_1node.log").read_text().replace("NVIDIA H100 80GB HBM3", "GPU X")
    )
    log = tmp_path / "all_reduce_perf.log"
    log.write_text(text)
    code, out, err = run(
        ["validate", "calibrate", str(log), "-o", str(tmp_path / "t.yaml")], capsys
    )
    assert code == 2 and "--base" in err and len(err.strip().splitlines()) == 1
    code, out, err = run(
        ["validate", "calibrate", str(log), "--base", "dgx_h100", "-o", str(tmp_path / "t.yaml")],
        capsys,
    )
    assert code == 0, err
    assert "no multi-node file" in out


def _variant(tmp_path: Path, header: str, row_of: Any, name: str = "all_reduce_perf.log") -> Path:
    """The 1-node fixture with its column header replaced and each row rewritten."""
    lines = (DATA / "all_reduce_perf_1node.log").read_text().splitlines()
    out = []
    for line in lines:
        if "out-of-place" in line and line.startswith("#"):
            out.append(header)
        elif line and not line.startswith("#"):
            out.append(row_of(line.split()))
        else:
            out.append(line)
    path = tmp_path / name
    path.write_text("\n".join(out) + "\n")
    return path


def test_per_iteration_timestamp_unchecked_and_in_place_only_variants(tmp_path: Path) -> None:
    """-I 1 (four more columns per block), -S 1 (a timestamp), -c 0 (#wrong N/A), and a table
    with the in-place block only (rccl-tests without out-of-place; nccl-tests' trace replay)."""
    per_iter = _variant(
        tmp_path,
        "#                                                   out-of-place (+ per-iteration)"
        "                                in-place (+ per-iteration)",
        lambda f: (
            "  ".join(f[:9] + ["1.0", "2.0", "2.0", "3.1"] + f[9:] + ["1.0", "2.0", "2.0", "3.1"])
            + "  2026-01-01 00:00:01"
        ),
    )
    rows = read_measurements(per_iter).rows
    plain = read_measurements(DATA / "all_reduce_perf_1node.log").rows
    assert [r["time_us"] for r in rows] == [r["time_us"] for r in plain]
    assert [r["in_place_time_us"] for r in rows] == [r["in_place_time_us"] for r in plain]
    unchecked = _variant(
        tmp_path,
        "#   out-of-place   in-place",
        lambda f: "  ".join(f[:8] + ["N/A"] + f[9:12] + ["N/A"]),
    )
    rows = read_measurements(unchecked).rows
    assert all("wrong" not in r and "in_place_wrong" not in r for r in rows)
    only = _variant(tmp_path, "#            in-place          ", lambda f: "  ".join(f[:5] + f[9:]))
    meas = read_measurements(only)
    assert meas.metadata["blocks"] == ["in_place"]
    assert [r["time_us"] for r in meas.rows] == [r["in_place_time_us"] for r in plain]


def test_holdout_on_nccl_tests_logs(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """holdout on nccl-tests logs: one NCCL fit on the even powers of two of every file, each
    file judged on its odd ones."""
    logs = [str(DATA / n) for n in ("all_reduce_perf_1node.log", "all_reduce_perf_2node.log")]
    code, out, err = run(
        [
            "validate",
            "holdout",
            *logs,
            "--ops",
            "all_reduce",
            "--min-size",
            "0",
            "--out-dir",
            str(tmp_path),
        ],
        capsys,
    )
    assert code == 0, err
    verdicts = re.findall(
        r"all_reduce_perf_(\d)node.log\s+(\d+) all_reduce\s+16\s+([\d.]+)%.*PASS", out
    )
    assert [(n, ranks) for n, ranks, _ in verdicts] == [("1", "8"), ("2", "16")]
    assert all(float(e) < 5 for _, _, e in verdicts)
    assert (tmp_path / "nccl_even.yaml").exists()


def test_launcher_prefixes_and_appended_logs(tmp_path: Path) -> None:
    """mpirun --tag-output and srun -l prefix every line; several binaries' logs appended in
    one file keep each row's own op."""
    text = (DATA / "all_reduce_perf_2node.log").read_text()
    tagged = tmp_path / "tagged.log"
    tagged.write_text("".join(f"[1,0]<stdout>:{line}\n" for line in text.splitlines()))
    srun = tmp_path / "srun.log"
    srun.write_text("".join(f"0: {line}\n" for line in text.splitlines()))
    plain = read_measurements(DATA / "all_reduce_perf_2node.log").rows
    assert read_measurements(tagged).rows == plain == read_measurements(srun).rows
    both = tmp_path / "both.log"
    both.write_text(text + (DATA / "all_gather_perf_2node.log").read_text())
    meas = read_measurements(both)
    assert meas.ops() == ["all_reduce", "all_gather"]
    assert len(meas.rows) == 31 + 24
    mixed = tmp_path / "mixed.log"
    mixed.write_text((DATA / "all_reduce_perf_1node.log").read_text() + text)
    with pytest.raises(ConfigError, match=r"mixed.log:9: runs of 8 ranks on 1 host\(s\) and of 16"):
        read_measurements(mixed)
