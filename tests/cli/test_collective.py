"""``collsim collective``: nccl-tests style output, formats, modes and one-line errors."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from collsim.cli import main
from collsim.cli.collective import sweep_sizes


def run(argv: list[str], capsys: pytest.CaptureFixture[str]) -> tuple[int, str, str]:
    try:
        main(["collective", *argv])
        code = 0
    except SystemExit as exc:
        code = int(exc.code or 0)
    out, err = capsys.readouterr()
    return code, out, err


def test_table_has_nccl_tests_columns_and_the_algorithm(capsys) -> None:
    code, out, err = run(
        [
            "--topology",
            "topologies/dgx_h100.yaml",
            "--gpus",
            "8",
            "--op",
            "all_reduce",
            "-b",
            "1M",
            "-e",
            "4M",
            "-f",
            "2",
        ],
        capsys,
    )
    assert code == 0
    lines = out.splitlines()
    header = next(line for line in lines if "size" in line and "busbw" in line)
    for column in ("size", "count", "type", "redop", "root", "time", "algbw", "busbw", "algorithm"):
        assert column in header
    data = [line.split() for line in lines if not line.startswith("#")]
    assert [row[0] for row in data] == ["1048576", "2097152", "4194304"]
    assert data[0][1:5] == ["262144", "float", "sum", "-1"]  # 1 MiB / 4 B
    assert data[0][-1] == "ring/ll"
    assert lines[-1].startswith("# Avg bus bandwidth")
    assert "dgx_h100" in err and "closed form" in err  # messages on stderr


def test_csv_columns_and_values(capsys) -> None:
    code, out, _ = run(
        ["--topology", "dgx_h100", "--gpus", "8", "-b", "1G", "-e", "1G", "-F", "csv"], capsys
    )
    assert code == 0
    lines = out.strip().splitlines()
    assert '# units: {"size_bytes": "bytes"' in out  # units stated in the header
    header, row = [line for line in lines if not line.startswith("#")]
    assert header.split(",")[:11] == [
        "op",
        "size_bytes",
        "count",
        "dtype",
        "redop",
        "root",
        "ranks",
        "nodes",
        "algorithm",
        "protocol",
        "time_us",
    ]
    cells = dict(zip(header.split(","), row.split(",")))
    assert (cells["op"], cells["ranks"], cells["nodes"], cells["dtype"]) == (
        "all_reduce",
        "8",
        "1",
        "float",
    )
    assert int(cells["size_bytes"]) == 1 << 30
    time_us, algbw, busbw = (float(cells[k]) for k in ("time_us", "algbw_gbps", "busbw_gbps"))
    assert algbw == pytest.approx((1 << 30) / time_us / 1e3, rel=1e-3)
    assert busbw == pytest.approx(algbw * 2 * 7 / 8, rel=1e-3)
    assert (cells["algorithm"], cells["protocol"]) == ("nvls", "simple")


def test_des_mode_matches_closed_form(capsys) -> None:
    args = [
        "--topology",
        "dgx_a100",
        "--nodes",
        "2",
        "--op",
        "all_gather",
        "-b",
        "1M",
        "-e",
        "64M",
        "-f",
        "8",
        "-F",
        "json",
    ]
    _, closed, _ = run(args, capsys)
    _, des, _ = run([*args, "--mode", "des"], capsys)
    closed_rows, des_rows = json.loads(closed)["rows"], json.loads(des)["rows"]
    assert len(closed_rows) == len(des_rows) == 3
    for a, b in zip(closed_rows, des_rows):
        assert b["time_us"] == pytest.approx(a["time_us"], rel=0.01)
        assert a["count"] == a["size_bytes"] // 4 // 16  # per-rank count, nccl-tests


def test_localhost_takes_the_rank_count_from_gpus(capsys) -> None:
    code, out, _ = run(
        ["--topology", "localhost", "--gpus", "3", "-b", "1K", "-e", "1K", "-F", "json"], capsys
    )
    assert code == 0
    assert json.loads(out)["ranks"] == 3


def test_sweep_sizes_follow_nccl_tests() -> None:
    assert sweep_sizes(8, 64, 2, 0) == [8, 16, 32, 64]
    assert sweep_sizes(1, 3, 1, 1) == [1, 2, 3]


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--topology", "dgx_h100", "-b", "1Q"], "not a size"),
        (["--topology", "dgx_h100", "-b", "4M", "-e", "1M"], "larger than -e"),
        (["--topology", "dgx_h100", "--op", "allreduce"], "allreduce"),
        (["--topology", "dgx_h100", "--gpus", "12", "--nodes", "1"], "12 GPUs per node asked"),
        (["--topology", "dgx_h100", "--gpus", "12", "--nodes", "5"], "do not spread evenly"),
        (["--topology", "no_such_topology"], "no topology file or name 'no_such_topology'"),
        (["--topology", "dgx_a100", "--algo", "nvls"], "no in-switch reduction"),
        (["--topology", "dgx_h100", "-f", "nan"], "finite"),  # nan passes FloatRange
        (["--topology", "dgx_h100", "-f", "inf"], "finite"),
    ],
    ids=[
        "bad-size",
        "b-gt-e",
        "bad-op",
        "too-many-per-node",
        "uneven",
        "unknown-topology",
        "nvls-on-a100",
        "nan-factor",
        "inf-factor",
    ],
)
def test_bad_flags_exit_2_with_one_line(args: list[str], message: str, capsys) -> None:
    code, out, err = run(args, capsys)
    assert code == 2
    assert message in err
    assert len(err.strip().splitlines()) == 1 and "Traceback" not in err and out == ""


@pytest.mark.parametrize(
    ("edit", "expected"),
    [
        (("rate_gbit: 400", "rate_gbit: 400\n  colour: red"), r":\d+: nics\.colour: unknown key"),
        (
            ("bandwidth_gbps: 450", "bandwidth_gbps: -450"),
            r":\d+: intra_node\.bandwidth_gbps: must be > 0, got -450",
        ),
        (("device: h100\n", ""), r":\d+: device: missing required key"),
        (("  count: 8", "  count: [8"), r":\d+: YAML syntax error"),
    ],
    ids=["unknown-key", "negative-bandwidth", "missing-field", "yaml-syntax"],
)
def test_malformed_topology_file_exits_2(
    edit: tuple[str, str], expected: str, tmp_path: Path, repo: Path, capsys
) -> None:
    import re

    text = (repo / "topologies" / "dgx_h100.yaml").read_text()
    assert edit[0] in text
    bad = tmp_path / "bad.yaml"
    bad.write_text(text.replace(edit[0], edit[1], 1))
    code, out, err = run(["--topology", str(bad), "-b", "1M", "-e", "1M"], capsys)
    assert code == 2 and out == ""
    lines = err.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in err
    assert re.search(re.escape(str(bad)) + expected, lines[0]), lines[0]


def test_short_flags_mean_what_they_mean_in_nccl_tests(capsys) -> None:
    """-o is the reduction op and -r the root (nccl-tests src/common.cu getopt string)."""
    code, out, _ = run(["--topology", "dgx_h100", "-o", "max", "-b", "1M", "-e", "1M"], capsys)
    assert code == 0
    row = next(line.split() for line in out.splitlines() if not line.startswith("#"))
    assert row[3] == "max"
    code, out, _ = run(
        ["--topology", "dgx_h100", "--op", "broadcast", "-r", "3", "-b", "1M", "-e", "1M"], capsys
    )
    assert code == 0
    row = next(line.split() for line in out.splitlines() if not line.startswith("#"))
    assert (row[3], row[4]) == ("none", "3")
    code, _, err = run(["--topology", "dgx_h100", "-o", "all_gather"], capsys)
    assert code == 2 and "all_gather" in err and "sum" in err  # -o is no longer the collective
    code, _, err = run(["--topology", "dgx_h100", "--op", "reduce", "-r", "8"], capsys)
    assert code == 2 and "-r/--root" in err


@pytest.mark.parametrize("letter", ["-t", "-N", "-g", "-a", "-p", "-m"])
def test_letters_nccl_tests_uses_otherwise_are_gone(letter: str, capsys) -> None:
    """nccl-tests: -t threads, -N run cycles, -g GPUs per thread, -a average mode, -p parallel
    init, -m aggregated iterations; collsim's long names keep their meaning."""
    code, out, err = run(["--topology", "dgx_h100", letter, "1"], capsys)
    assert code == 2 and out == ""
    assert f"error: no such option '{letter}'" in err and len(err.strip().splitlines()) == 1


def test_validate_bench_short_flags_follow_nccl_tests() -> None:
    """validate bench: -n iterations and -w warm-up, as nccl-tests; the world size is long."""
    import click

    from collsim.cli.validate import bench

    ctx = bench.make_context("bench", ["-n", "7", "-w", "3", "-b", "1K", "-e", "4K"])
    assert ctx.params["iters"] == 7 and ctx.params["warmup"] == 3
    assert ctx.params["world_size"] is None
    ctx = bench.make_context("bench", ["--world-size", "4"])
    assert ctx.params["world_size"] == 4
    for command in ("bench", "compare", "step", "ddp", "fsdp"):
        from collsim.cli import validate as module

        options = {o for p in getattr(module, command).params for o in p.opts}
        assert "-t" not in options, command
        if command != "bench":
            assert "-n" not in options, command
    assert isinstance(bench, click.Command)
