"""Measured-data readers check every value: the inputs that crashed or misled ``validate
calibrate``, ``compare`` and ``holdout`` are now one-line errors ``file:line: column: rule``
with exit status 2. And one CSV schema: every collective table collsim writes is read by every
command that reads one."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from collsim.cli import main
from collsim.core.errors import ConfigError
from collsim.validate.data.dataset import (
    COLUMNS,
    Measurements,
    read_measurements,
    write_measurements,
)

REPO = Path(__file__).resolve().parents[2]
BENCH = REPO / "validate" / "data" / "localhost_gloo_n2.csv"
DATA = Path(__file__).resolve().parent / "data"


def run(argv: list[str], capsys: pytest.CaptureFixture[str]) -> tuple[int, str, str]:
    try:
        main(argv)
        code = 0
    except SystemExit as exc:
        code = int(exc.code or 0)
    out, err = capsys.readouterr()
    return code, out, err


def _bench_with(tmp_path: Path, column: str, value: str) -> tuple[Path, int]:
    """The shipped gloo bench CSV with ``column`` of its first row set to ``value``."""
    lines = BENCH.read_text().splitlines()
    head = next(i for i, line in enumerate(lines) if not line.startswith("#"))
    names = lines[head].split(",")
    cells = lines[head + 1].split(",")
    cells[names.index(column)] = value
    lines[head + 1] = ",".join(cells)
    path = tmp_path / "measured.csv"
    path.write_text("\n".join(lines) + "\n")
    return path, head + 2


def _one_line_exit_2(code: int, out: str, err: str, pattern: str) -> None:
    assert code == 2, (code, out, err)
    lines = [line for line in (out + err).splitlines() if line.strip()]
    assert len(lines) == 1, lines
    assert "Traceback" not in out + err
    assert re.search(pattern, lines[0]), lines[0]


CASES = [
    ("time_us", "nan", r"time_us: must be a finite number > 0, got nan"),  # was LinAlgError / nan%
    ("time_us", "0", r"time_us: must be a finite number > 0, got 0"),  # was ZeroDivisionError
    ("time_us", "-5", r"time_us: must be a finite number > 0, got -5"),  # was "-1727 %"
    ("op", "foo", r"op: unknown op 'foo' \(choose from all_reduce"),  # was a ValueError traceback
    ("size_bytes", "1.5", r"size_bytes: must be an integer, got 1.5"),
    ("busbw_gbps", "inf", r"busbw_gbps: must be a finite number >= 0, got inf"),
]


@pytest.mark.parametrize("command", ["calibrate", "compare"])
@pytest.mark.parametrize(
    ("column", "value", "message"), CASES, ids=[f"{c}={v}" for c, v, _ in CASES]
)
def test_bad_value_is_one_line_with_file_line_column(
    command: str,
    column: str,
    value: str,
    message: str,
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
) -> None:
    path, line = _bench_with(tmp_path, column, value)
    args = (
        ["-o", str(tmp_path / "t.yaml")] if command == "calibrate" else ["--topology", "localhost"]
    )
    code, out, err = run(["validate", command, str(path), *args], capsys)
    _one_line_exit_2(code, out, err, re.escape(f"{path}:{line}: ") + message)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["measured.csv"]  # nothing written


@pytest.mark.parametrize("command", ["calibrate", "compare", "holdout"])
def test_binary_file_is_one_line(
    command: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    path = tmp_path / "measured.csv"
    path.write_bytes(BENCH.read_bytes()[:200] + b"\n\xff\xfe\x00binary")  # was UnicodeDecodeError
    extra = {"calibrate": ["-o", str(tmp_path / "t.yaml")], "compare": ["--topology", "localhost"]}
    code, out, err = run(["validate", command, str(path), *extra.get(command, [])], capsys)
    _one_line_exit_2(code, out, err, re.escape(f"{path}:") + r"\d+: a binary file")


def test_plot_collectives_reads_binary_as_one_line(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    path = tmp_path / "c.csv"
    path.write_bytes(b"op,size_bytes\n\xff\xfe")
    code, out, err = run(["plot", "collectives", str(path), "-o", str(tmp_path / "c.png")], capsys)
    _one_line_exit_2(code, out, err, re.escape(f"{path}:2: a binary file"))


def test_holdout_with_unknown_ops_checks_nothing_and_fails(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    code, out, err = run(["validate", "holdout", str(BENCH), "--ops", "foo"], capsys)  # was exit 0
    _one_line_exit_2(code, out, err, r"--ops.*unknown op\(s\) foo")
    lines = BENCH.read_text().splitlines()
    only_reduce = tmp_path / "ar.csv"
    only_reduce.write_text(
        "\n".join(line for line in lines if line.startswith(("#", "op,", "all_reduce,"))) + "\n"
    )
    code, out, err = run(["validate", "holdout", str(only_reduce), "--ops", "broadcast"], capsys)
    _one_line_exit_2(code, out, err, r"--ops.*none of broadcast is in the measurements")


def test_compare_refuses_non_positive_times_given_in_memory() -> None:
    from collsim.cluster.topology import load_topology
    from collsim.validate.check.compare import compare

    meas = read_measurements(BENCH)
    for bad in (0.0, -5.0, float("nan")):
        rows = [dict(r) for r in meas.rows]
        rows[0]["time_us"] = bad
        broken = Measurements(rows=rows, metadata=meas.metadata, path="m.csv")
        with pytest.raises(ConfigError, match=r"m.csv: time_us: must be a finite number > 0"):
            compare(broken, load_topology("localhost", gpus_per_node=2))


def test_calibrate_fit_refuses_nan_directly() -> None:
    from collsim.validate.fit.numerics import fit_line

    with pytest.raises(ConfigError, match="finite numbers > 0"):
        fit_line([1.0, 2.0, 3.0], [1e-5, float("nan"), 3e-5])


# ------------------------------------------------------------------------ one CSV schema


def test_schema_header_states_units_and_columns(tmp_path: Path) -> None:
    rows = [
        dict(
            op="all_reduce", size_bytes=1024, time_us=12.5, world_size=16, nodes=2, type="bfloat16"
        )
    ]
    path = write_measurements(tmp_path / "t.csv", rows, {"tool": "test"})
    text = path.read_text()
    assert text.startswith('# schema: "collsim-collectives/2"\n# units: {"size_bytes": "bytes"')
    assert '"time_us": "microseconds"' in text and '"busbw_gbps": "GB/s (1e9 bytes/s)' in text
    header = next(line for line in text.splitlines() if not line.startswith("#"))
    assert header == ",".join(COLUMNS)
    for column in ("op", "ranks", "nodes", "dtype", "algorithm"):
        assert column in COLUMNS
    back = read_measurements(path)
    assert back.rows == rows and back.metadata == {"tool": "test"}
    assert back.num_nodes == 2 and back.world_size == 16


def test_each_command_reads_the_others_output(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    coll = tmp_path / "coll.csv"
    code, out, err = run(
        [
            "collective",
            "--topology",
            "dgx_h100",
            "--nodes",
            "2",
            "-b",
            "1K",
            "-e",
            "64M",
            "-F",
            "csv",
        ],
        capsys,
    )
    assert code == 0, err
    coll.write_text(out)
    # collective -F csv -> compare (its own topology: every point exact)
    report = tmp_path / "r.json"
    code, out, err = run(
        [
            "validate",
            "compare",
            str(coll),
            "--topology",
            "dgx_h100",
            "--plot",
            str(tmp_path / "a.png"),
            "--json",
            str(report),
            "--csv",
            str(tmp_path / "compared.csv"),
        ],
        capsys,
    )
    assert code == 0, err
    assert "all_reduce" in out and re.search(r"all\s+17\s+0\.0%", out)
    # compare --csv -> calibrate (an NCCL fit on the topology the table names) -> plot
    code, out, err = run(
        ["validate", "calibrate", str(tmp_path / "compared.csv"), "-o", str(tmp_path / "fit.yaml")],
        capsys,
    )
    assert code == 0, err
    assert "calibrated dgx_h100" in out
    compared = read_measurements(tmp_path / "compared.csv")
    known = {"ring", "tree", "nvls", "nvls_tree", "collnet_direct", "collnet_chain", "pat"}
    assert {r["algorithm"] for r in compared.rows} <= known
    assert all("simulated_us" in r and "error" in r for r in compared.rows)
    for inputs in (
        [coll, tmp_path / "compared.csv"],
        [BENCH],
        [DATA / "all_reduce_perf_2node.log", DATA / "all_reduce_perf_1node.json"],
    ):
        code, out, err = run(
            ["plot", "collectives", *map(str, inputs), "-o", str(tmp_path / "p.png")], capsys
        )
        assert code == 0, err
    # a bench CSV of the old layout still reads and calibrates
    code, out, err = run(
        ["validate", "calibrate", str(BENCH), "--no-knees", "-o", str(tmp_path / "g.yaml")], capsys
    )
    assert code == 0, err
    assert "world size 2" in out


def test_old_collective_csv_is_refused_by_compare_with_a_hint(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    old = tmp_path / "old.csv"
    old.write_text("size_bytes,time_us,algbw_GBps,busbw_GBps,algorithm\n1024,10,0.1,0.17,ring/ll\n")
    code, out, err = run(["validate", "compare", str(old), "--topology", "dgx_h100"], capsys)
    _one_line_exit_2(code, out, err, re.escape(f"{old}:1: ") + "no 'op' column")


@pytest.mark.parametrize(
    "args",
    [["compare", str(BENCH), "--topology", "localhost", "--csv", "{tmp}/no/such/c.csv"]],
    ids=["compare-csv"],
)
def test_missing_output_folder_is_refused_before_the_work(
    args: list[str], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    filled = [a.format(tmp=tmp_path) for a in args]
    code, out, err = run(["validate", *filled], capsys)
    _one_line_exit_2(code, out, err, r"does not exist")
    assert list(tmp_path.iterdir()) == []


# ----------------------------------------------------------------------------- fuzzing

from hypothesis import HealthCheck, given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

_CELLS = st.one_of(
    st.sampled_from(["nan", "-nan", "inf", "-1", "0", "1e400", "", "N/A", "x", "1.5", " 7 ", "-0"]),
    st.text(alphabet=st.characters(blacklist_categories=("Cs",)), max_size=8),
    st.floats(allow_nan=True, allow_infinity=True).map(repr),
)


@settings(
    max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(
    which=st.sampled_from(["csv", "log", "json"]),
    row=st.integers(min_value=0, max_value=40),
    field=st.integers(min_value=0, max_value=30),
    value=_CELLS,
)
def test_fuzzed_cells_read_or_give_one_config_error(
    which: str, row: int, field: int, value: str, tmp_path: Path
) -> None:
    """A cell of a measured file replaced by anything: the file reads (every value checked)
    or the reader raises ConfigError naming the file; never another exception."""
    source = {
        "csv": BENCH,
        "log": DATA / "all_reduce_perf_2node.log",
        "json": DATA / "all_reduce_perf_2node.json",
    }[which]
    text = source.read_text()
    if which == "json":
        numbers = list(re.finditer(r'":(-?[\d.]+|"[^"]*")', text))
        match = numbers[(row * 31 + field) % len(numbers)]
        text = text[: match.start(1)] + json_token(value) + text[match.end(1) :]
    else:
        lines = text.splitlines()
        body = [i for i, line in enumerate(lines) if line and not line.startswith(("#", "op,"))]
        index = body[row % len(body)]
        sep = "," if which == "csv" else None
        cells = lines[index].split(sep)
        cells[field % len(cells)] = value.replace("\n", " ")
        lines[index] = (sep or "  ").join(cells)
        text = "\n".join(lines) + "\n"
    path = tmp_path / f"fuzz_{source.name}"
    path.write_text(text)
    try:
        meas = read_measurements(path)
    except ConfigError as exc:
        assert str(path) in str(exc) and "\n" not in str(exc).strip()
        return
    for r in meas.rows:
        t = float(r["time_us"])
        assert t > 0 and t == t and t != float("inf")


def json_token(value: str) -> str:
    import json

    return json.dumps(value)


def test_compare_plots_a_table_with_an_empty_message(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    # a row of size 0 stays in the comparison; the log-scale plot draws the others
    path, _ = _bench_with(tmp_path, "size_bytes", "0")
    image = tmp_path / "c.png"
    code, out, err = run(
        ["validate", "compare", str(path), "--topology", "localhost", "--plot", str(image)],
        capsys,
    )
    assert "Traceback" not in err
    assert image.exists() and image.stat().st_size > 0, err
    assert code in (0, 1), err  # 1: outside the target, never a crash


def test_a_message_beyond_any_memory_is_one_line(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    # 1e308 parsed as an integer size once, and the calibration fit overflowed
    path, line = _bench_with(tmp_path, "size_bytes", "1e308")
    code, out, err = run(
        ["validate", "calibrate", str(path), "-o", str(tmp_path / "c.yaml")], capsys
    )
    _one_line_exit_2(code, out, err, rf"{path.name}:{line}: size_bytes: must be <= 2\*\*50")
