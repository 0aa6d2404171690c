"""`collsim sweep`, `collsim search` and `collsim plot` through click's CliRunner."""

from __future__ import annotations

import csv
import re
from pathlib import Path

import pytest
from click.testing import CliRunner

from collsim.cli import cli

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"

TINY = """\
name: tiny
cluster: {topology: dgx_h100, nodes: 1}
model: {layers: 4, hidden: 256, heads: 8, seq_len: 128, vocab: 1000}
training: {global_batch: 32, micro_batch: 1}
parallel: {tp: 2, pp: 2, dp: 2, zero: 1, schedule: 1f1b}
"""


@pytest.fixture
def scenario(tmp_path: Path) -> Path:
    path = tmp_path / "tiny.yaml"
    path.write_text(TINY)
    return path


def invoke(*args: str):
    return CliRunner().invoke(cli, [str(a) for a in args], catch_exceptions=False)


def rows(path: Path) -> list[dict[str, str]]:
    with path.open() as handle:
        return list(csv.DictReader(handle))


@pytest.mark.parametrize(
    "args, key",
    [
        (["--set", "parallel.zerro=1,2"], "parallel.zerro"),
        (["--set", "parallel.zero=0,9"], "parallel.zero"),
        (["--set", "training.recompute=full,sometimes"], "training.recompute"),
        (["--gpus", "8,16,...,100"], "--gpus"),
        (["--gpus", "8,16", "--set", "parallel.dp=2,4"], "parallel.dp"),
        (["-o", "/no/such/folder/x.csv"], "--output"),  # before the sweep runs
        (["--plot", "/no/such/folder/x.png"], "--plot"),
    ],
    ids=[
        "unknown-key",
        "bad-value",
        "bad-enum",
        "bad-gpus",
        "grown-axis",
        "output-folder",
        "plot-folder",
    ],
)
def test_sweep_bad_input_is_one_line_exit_2(scenario: Path, args, key: str) -> None:
    result = invoke("sweep", scenario, *args)
    assert result.exit_code == 2
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: ") and key in lines[0]
    assert result.stdout == ""


def test_sweep_table_csv_and_plot(scenario: Path, tmp_path: Path) -> None:
    out, image = tmp_path / "sweep.csv", tmp_path / "scaling.png"
    result = invoke(
        "sweep",
        scenario,
        "--gpus",
        "4,8,...,32",
        "--set",
        "parallel.zero=0,1",
        "-o",
        out,
        "--plot",
        image,
    )
    assert result.exit_code == 0, result.stderr
    table = rows(out)
    assert len(table) == 8
    assert [(r["plan"], r["num_gpus"], r["dp"]) for r in table[:4]] == [
        ("zero=0", "4", "1"),
        ("zero=0", "8", "2"),
        ("zero=0", "16", "4"),
        ("zero=0", "32", "8"),
    ]
    assert all(r["feasible"] == "True" for r in table)
    assert {
        "step_time_s",
        "tokens_per_s",
        "mfu",
        "compute_s",
        "dp_exposed_s",
        "mem_optimizer_bytes",
        "memory_peak_bytes",
        "comm_bytes_dp",
    } <= set(table[0])
    # weak scaling: the global batch follows dp (32 sequences per dp 2 at the scenario's 8 GPUs)
    assert [r["global_batch"] for r in table[:4]] == ["16", "32", "64", "128"]
    assert image.read_bytes()[:8] == PNG_MAGIC
    assert "zero=1" in result.stdout and "16" in result.stdout
    # not a terminal: no progress bar on stderr, only the files written
    assert result.stderr.splitlines() == [f"wrote {out}", f"wrote {image}"]


def test_sweep_named_plans(scenario: Path, tmp_path: Path) -> None:
    out = tmp_path / "plans.csv"
    result = invoke(
        "sweep",
        scenario,
        "--gpus",
        "4,8",
        "-o",
        out,
        "--plan",
        "DDP: parallel.zero=0, parallel.ddp.overlap=false",
        "--plan",
        "FSDP / ZeRO-3: parallel.zero=3",
    )
    assert result.exit_code == 0, result.stderr
    assert [(r["plan"], r["num_gpus"], r["zero"]) for r in rows(out)] == [
        ("DDP", "4", "0"),
        ("DDP", "8", "0"),
        ("FSDP / ZeRO-3", "4", "3"),
        ("FSDP / ZeRO-3", "8", "3"),
    ]
    bad = invoke("sweep", scenario, "--plan", "DDP: parallel.ddp.overlapp=true")
    assert bad.exit_code == 2 and "parallel.ddp.overlapp" in bad.stderr
    assert len(bad.stderr.strip().splitlines()) == 1


def test_sweep_lists_infeasible_points(scenario: Path, tmp_path: Path) -> None:
    out = tmp_path / "s.csv"
    result = invoke("sweep", scenario, "--set", "parallel.tp=2,3", "-o", out)
    assert result.exit_code == 0
    bad = [r for r in rows(out) if r["feasible"] == "False"]
    assert len(bad) == 1 and bad[0]["reason"].startswith("config: ")
    assert "infeasible points: 1 of 2" in result.stderr
    assert "tp=3" in result.stderr


def test_search_prints_best_plans_and_counts_rejections(scenario: Path, tmp_path: Path) -> None:
    out = tmp_path / "plans.csv"
    result = invoke(
        "search",
        scenario,
        "--gpus",
        "8",
        "--top",
        "5",
        "--simulate",
        "2",
        "--micro-batch",
        "1,2",
        "-o",
        out,
    )
    assert result.exit_code == 0, result.stderr
    lines = result.stdout.splitlines()
    assert "8 x H100" in lines[0]
    table = [line for line in lines if re.match(r"^\s+\d+\s+tp\d", line)]
    assert len(table) == 5
    assert sum("simulated" in line for line in table) == 2
    assert "plans set aside:" in result.stderr and "pp_layers" in result.stderr
    plans = rows(out)
    assert sum(r["simulated"] == "True" for r in plans) == 2
    times = [float(r["est_step_time_s"]) for r in plans]
    assert times == sorted(times)


def test_plot_scaling_of_a_plain_sweep(scenario: Path, tmp_path: Path) -> None:
    # no --set / --plan: the series column is empty in the CSV and becomes the file name
    sweep_csv = tmp_path / "plain.csv"
    assert invoke("sweep", scenario, "--gpus", "4,8", "-o", sweep_csv).exit_code == 0
    result = invoke("plot", "scaling", sweep_csv, "-o", tmp_path / "plain.png")
    assert result.exit_code == 0, result.stderr
    assert (tmp_path / "plain.png").read_bytes()[:8] == PNG_MAGIC


@pytest.mark.parametrize(
    "args, key",
    [
        (["--gpus", "12"], "--gpus"),  # not whole 8-GPU nodes
        (["--set", "training.global_bach=8"], "training.global_bach"),
        (["--set", "training.dtype=fp12"], "training.dtype"),
        (["--zero", "0,4"], "--zero"),
        (["--recompute", "some"], "--recompute"),
        (["-o", "/no/such/folder/x.csv"], "--output"),
    ],
    ids=["gpus", "unknown-key", "bad-value", "zero", "recompute", "output-folder"],
)
def test_search_bad_input_is_one_line_exit_2(scenario: Path, args, key: str) -> None:
    result = invoke("search", scenario, *args)
    assert result.exit_code == 2
    assert len(result.stderr.strip().splitlines()) == 1 and key in result.stderr


def test_plot_commands_write_images(scenario: Path, tmp_path: Path) -> None:
    sweep_csv = tmp_path / "sweep.csv"
    assert (
        invoke(
            "sweep", scenario, "--gpus", "4,8", "--set", "parallel.zero=0,1,3", "-o", sweep_csv
        ).exit_code
        == 0
    )
    for kind, name in (("scaling", "a.png"), ("memory", "b.svg"), ("breakdown", "c.png")):
        result = invoke("plot", kind, sweep_csv, "-o", tmp_path / name)
        assert result.exit_code == 0, result.stderr
        assert (tmp_path / name).stat().st_size > 1000
    assert (tmp_path / "b.svg").read_text().lstrip().startswith("<?xml")
    result = invoke("plot", "timeline", scenario, "-o", tmp_path / "t.png", "--rank", "0")
    assert result.exit_code == 0, result.stderr
    result = invoke("plot", "step", scenario, "-o", tmp_path / "s.png")
    assert result.exit_code == 0, result.stderr
    result = invoke(
        "plot", "pipeline", scenario, "-o", tmp_path / "p.png", "--set", "training.global_batch=16"
    )
    assert result.exit_code == 0, result.stderr
    coll = tmp_path / "coll.csv"
    coll.write_text(
        "size_bytes,time_us,algbw_GBps,busbw_GBps,algorithm\n"
        "1024,10,0.1,0.175,ring\n1048576,50,20.9,36.7,ring\n"
    )
    assert invoke("plot", "collectives", coll, "-o", tmp_path / "c1.png").exit_code == 0
    result = invoke(
        "plot",
        "collectives",
        "--topology",
        "dgx_h100",
        "--gpus",
        "8",
        "-b",
        "1K",
        "-e",
        "1M",
        "-o",
        tmp_path / "c2.png",
    )
    assert result.exit_code == 0, result.stderr
    for name in ("a.png", "c.png", "t.png", "s.png", "p.png", "c1.png", "c2.png"):
        assert (tmp_path / name).read_bytes()[:8] == PNG_MAGIC


@pytest.mark.parametrize(
    "args, key",
    [
        (["plot", "scaling", "{csv}", "-o", "{tmp}/x.jpg"], "--output"),
        (["plot", "scaling", "{csv}", "-o", "{tmp}/x.png", "--series", "nope"], "--series"),
        (
            ["plot", "timeline", "{scenario}", "-o", "{tmp}/x.png", "--set", "parallel.tq=2"],
            "parallel.tq",
        ),
        (
            [
                "plot",
                "collectives",
                "--topology",
                "dgx_h100",
                "--op",
                "all_reduse",
                "-o",
                "{tmp}/x.png",
            ],
            "--op",
        ),
        (["plot", "scaling", "{csv}", "-o", "/no/such/folder/x.png"], "--output"),
        (["plot", "scaling", "{scenario}.bin", "-o", "{tmp}/x.png"], "not UTF-8 text"),
    ],
    ids=["suffix", "series", "set-key", "op", "output-folder", "binary-csv"],
)
def test_plot_bad_input_exit_2(scenario: Path, tmp_path: Path, args, key: str) -> None:
    sweep_csv = tmp_path / "s.csv"
    sweep_csv.write_text("plan,num_gpus,tokens_per_s\na,8,1.0\n")
    Path(f"{scenario}.bin").write_bytes(b"plan\n\xff\xfe\n")
    filled = [a.format(csv=sweep_csv, tmp=tmp_path, scenario=scenario) for a in args]
    result = invoke(*filled)
    assert result.exit_code == 2
    assert len(result.stderr.strip().splitlines()) == 1 and key in result.stderr


def test_progress_bar_only_on_a_terminal(monkeypatch: pytest.MonkeyPatch) -> None:
    import io
    import sys

    from collsim.cli.sweep import progress_reporter

    class Terminal(io.StringIO):
        def isatty(self) -> bool:
            return True

    for stream, drawn in ((Terminal(), True), (io.StringIO(), False)):
        monkeypatch.setattr(sys, "stderr", stream)
        with progress_reporter(3, "sweep") as tick:
            for _ in range(3):
                tick()
        assert ("3/3" in stream.getvalue()) is drawn
        assert bool(stream.getvalue()) is drawn


@pytest.mark.parametrize(
    "args",
    [
        ["sweep", "{tmp}"],  # a folder, not a file
        ["search", "{scenario}", "--top", "0"],
        ["plot", "scaling", "{tmp}/missing.csv", "-o", "{tmp}/x.png"],
        ["plot", "no-such-kind"],
    ],
    ids=["sweep-folder", "search-top", "plot-missing-csv", "plot-kind"],
)
def test_usage_errors_are_one_line_exit_2(scenario: Path, tmp_path: Path, args) -> None:
    result = invoke(*[a.format(tmp=tmp_path, scenario=scenario) for a in args])
    assert result.exit_code == 2
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), result.stderr


@pytest.mark.parametrize("jobs", ["1", "2"])
def test_sweep_honours_stragglers_on_any_number_of_processes(
    scenario: Path, tmp_path: Path, jobs: str
) -> None:
    # the slowdown curve of one slow GPU: the CLI's engine gets the stragglers section too
    out = tmp_path / "strag.csv"
    result = invoke(
        "sweep",
        scenario,
        "--set",
        "stragglers.slow_gpu.ranks=[0]",
        "--set",
        "stragglers.slow_gpu.clock_factor=1.0,0.5",
        "--jobs",
        jobs,
        "-o",
        out,
    )
    assert result.exit_code == 0, result.stderr
    normal, slowed = (float(r["step_time_s"]) for r in rows(out))
    assert slowed > 1.2 * normal


def test_sweep_on_two_processes_gives_the_same_table(scenario: Path, tmp_path: Path) -> None:
    tables = []
    for jobs in ("1", "2"):
        out = tmp_path / f"sweep{jobs}.csv"
        args = ("sweep", scenario, "--gpus", "4,8,16", "--set", "parallel.zero=0,3")
        assert invoke(*args, "--jobs", jobs, "-o", out).exit_code == 0
        tables.append([{k: v for k, v in r.items() if k != "elapsed_s"} for r in rows(out)])
    assert tables[0] == tables[1] and len(tables[0]) == 6
