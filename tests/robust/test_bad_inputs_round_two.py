"""Inputs that once took the machine down, crashed or answered wrong, each run as its own
``collsim`` process: one ``error:`` line on stderr, exit status 2, no traceback, under 30 s and
1 GB (the process's peak resident set, ``ru_maxrss`` of the waited child).

The inputs are a user's: special files given as scenario, HF ``config.json``, device file,
measured table or plot input; a YAML alias bomb; a sweep of a billion sizes; a measured file of
10,000 rows; a 300-character output name; outputs that are inputs; options out of range.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
DDP = REPO / "scenarios" / "ddp_gpt3_1.3b.yaml"
MEASURED = REPO / "validate" / "data" / "localhost_gloo_n2.csv"
LIMIT_S = 30.0
LIMIT_BYTES = 10**9


def collsim(*args: str, cwd: Path | None = None) -> tuple[int, str, str]:
    """Run ``collsim ARGS`` as a process of its own; check its time and peak memory (the
    process writes its own ``ru_maxrss`` to a file as it exits)."""
    import tempfile

    env = dict(os.environ, PYTHONPATH=str(REPO))
    with tempfile.TemporaryDirectory(prefix="collsim-test-") as scratch:
        peak_file = Path(scratch) / "maxrss"
        code = (
            "import atexit, resource, sys\n"
            f"atexit.register(lambda: open({str(peak_file)!r}, 'w').write("
            "str(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss)))\n"
            "from collsim.cli import main\n"
            "sys.exit(main())\n"
        )
        started = time.perf_counter()
        try:
            proc = subprocess.run(
                [sys.executable, "-c", code, *args],
                capture_output=True,
                text=True,
                env=env,
                cwd=cwd or REPO,
                timeout=LIMIT_S,
            )
        except subprocess.TimeoutExpired:
            raise AssertionError(f"collsim {' '.join(args)}: over {LIMIT_S} s") from None
        elapsed_s = time.perf_counter() - started
        peak_bytes = int(peak_file.read_text()) * 1024  # Linux: KiB
    assert elapsed_s < LIMIT_S
    assert peak_bytes < LIMIT_BYTES, f"peak RSS {peak_bytes / 2**20:.0f} MiB"
    return proc.returncode, proc.stdout, proc.stderr


def refused(*args: str, match: str, cwd: Path | None = None) -> str:
    """The command exits 2 with one ``error:`` line that contains ``match``."""
    code, _, err = collsim(*args, cwd=cwd)
    assert "Traceback" not in err, err
    lines = err.splitlines()
    assert code == 2, (code, err)
    assert len(lines) == 1 and lines[0].startswith("error: "), err
    assert match in lines[0], lines[0]
    return lines[0]


def _bomb(levels: int) -> str:
    lines = ["x0: &a0 [lol, lol, lol, lol, lol, lol, lol, lol, lol]"]
    lines += [f"x{i}: &a{i} [{', '.join([f'*a{i - 1}'] * 9)}]" for i in range(1, levels)]
    return "\n".join(lines) + "\n"


@pytest.mark.parametrize("levels", [7, 8])
def test_yaml_alias_bomb(tmp_path: Path, levels: int) -> None:
    path = tmp_path / "bomb.yaml"
    path.write_text(_bomb(levels))
    assert len(path.read_bytes()) < 520  # 432 and 505 bytes
    refused("run", str(path), match="YAML aliases expand to more than")


@pytest.fixture(params=["/dev/zero", "/dev/urandom", "fifo"])
def special(request: pytest.FixtureRequest, tmp_path: Path) -> Path:
    """A special file behind a name with the suffix each reader expects."""
    if request.param == "fifo":
        target = tmp_path / "pipe"
        os.mkfifo(target)
    else:
        target = Path(request.param)
    return target


def _named(special: Path, tmp_path: Path, name: str) -> Path:
    link = tmp_path / name
    link.symlink_to(special)
    return link


def test_special_file_as_scenario(special: Path) -> None:
    refused("run", str(special), match="not a regular file")


def test_special_file_as_hf_config(special: Path, tmp_path: Path) -> None:
    config = _named(special, tmp_path, "config.json")
    scenario = tmp_path / "s.yaml"
    scenario.write_text(
        "name: x\ncluster: {topology: dgx_h100, nodes: 1}\n"
        f"model: {{hf_config: {config}}}\ntraining: {{global_batch: 16, micro_batch: 2}}\n"
        "parallel: {dp: 8}\n"
    )
    refused("run", str(scenario), match="HF config is not a regular file")


def test_special_file_as_device_file(special: Path, tmp_path: Path) -> None:
    device = _named(special, tmp_path, "dev.yaml")
    refused("run", str(DDP), "--set", f"cluster.device={device}", match="not a regular file")


def test_special_file_as_measured_table(special: Path, tmp_path: Path) -> None:
    table = _named(special, tmp_path, "m.csv")
    refused("validate", "compare", str(table), "--topology", "localhost", match="regular file")


def test_special_file_to_plot(special: Path, tmp_path: Path) -> None:
    table = _named(special, tmp_path, "m.csv")
    out = str(tmp_path / "p.png")
    refused("plot", "collectives", str(table), "-o", out, match="not a regular file")
    refused("plot", "scaling", str(table), "-o", out, match="not a regular file")


def test_binary_hf_config(tmp_path: Path) -> None:
    config = tmp_path / "config.json"
    config.write_bytes(bytes(range(128, 256)) * 8)
    scenario = tmp_path / "s.yaml"
    scenario.write_text(
        "name: x\ncluster: {topology: dgx_h100, nodes: 1}\n"
        f"model: {{hf_config: {config}}}\ntraining: {{global_batch: 16, micro_batch: 2}}\n"
        "parallel: {dp: 8}\n"
    )
    refused("run", str(scenario), match="not UTF-8 text")


def test_a_billion_sizes() -> None:
    refused(
        "collective", "--topology", "dgx_h100", "-f", "1", "-i", "1", "-b", "1", "-e", "1G",
        match="1,073,741,824 sizes, above the limit of 10,000",
    )  # fmt: skip


def test_one_rank_send_recv() -> None:
    refused(
        "collective", "--topology", "dgx_h100", "--gpus", "1", "--op", "send_recv",
        match="send_recv needs at least 2 ranks",
    )  # fmt: skip


def test_calibrate_rows_are_bounded(tmp_path: Path) -> None:
    lines = MEASURED.read_text().splitlines()
    header = next(i for i, line in enumerate(lines) if line.startswith("op,"))
    body = lines[header + 1 :]
    big = tmp_path / "big.csv"
    big.write_text("\n".join(lines[: header + 1] + [body[i % len(body)] for i in range(10_000)]))
    out = str(tmp_path / "cal.yaml")
    refused("validate", "calibrate", str(big), "-o", out, match="10,000 measured rows")
    assert not Path(out).exists()


def test_300_character_output_name(tmp_path: Path) -> None:
    out = tmp_path / ("a" * 300 + ".json")
    refused("run", str(DDP), "--json", str(out), match="longer than the 255")


def test_outputs_that_are_inputs_or_each_other(tmp_path: Path) -> None:
    scenario = tmp_path / "s.yaml"
    scenario.write_bytes(DDP.read_bytes())
    refused("run", str(scenario), "--json", str(scenario), match="same file as the input")
    assert scenario.read_bytes() == DDP.read_bytes()
    out = str(tmp_path / "o.json")
    refused("run", str(scenario), "--json", out, "--trace", out, match="same file as --json")
    assert not Path(out).exists()


@pytest.mark.torch
@pytest.mark.parametrize(
    "output, match",
    [("/proc/p.yaml", "cannot write"), ("x/a/b/c/p.txt", "must end in .yaml")],
)
def test_validate_compute_output_checked_first(tmp_path: Path, output: str, match: str) -> None:
    refused("validate", "compute", "--quick", "-o", output, match=match, cwd=tmp_path)
    assert not (tmp_path / "x").exists()


@pytest.mark.torch
@pytest.mark.parametrize(
    "args, match",
    [
        (["--straggler-rank", "5"], "must be < the smallest world size (2)"),
        (["--hidden", "100000"], "fp32 parameters needs about"),
    ],
)
def test_validate_step_checked_before_work(args: list[str], match: str) -> None:
    refused("validate", "step", "--world-sizes", "2", *args, match=match)


def test_holdout_that_would_compare_nothing(tmp_path: Path) -> None:
    refused(
        "validate", "holdout", str(MEASURED), "--min-size", "1T",
        match="no odd power-of-two size of at least 1099511627776 B",
    )  # fmt: skip
    lines = MEASURED.read_text().splitlines()
    even = [
        line
        for line in lines
        if line.startswith(("#", "op,")) or line.split(",")[1] in ("1024", "4096", "16384")
    ]
    path = tmp_path / "even.csv"
    path.write_text("\n".join(even) + "\n")
    refused("validate", "holdout", str(path), match="no odd power-of-two size")


def test_compare_reads_each_rows_ranks(tmp_path: Path) -> None:
    lines = MEASURED.read_text().splitlines()
    last = lines[-1].split(",")
    last[12] = "4"  # ranks (world_size column) of the last row
    path = tmp_path / "mixed.csv"
    path.write_text("\n".join(lines[:-1] + [",".join(last)]) + "\n")
    refused(
        "validate", "compare", str(path), "--topology", "localhost",
        match="a row of 4 ranks",
    )  # fmt: skip


def test_top_k_on_a_dense_model() -> None:
    refused("run", str(DDP), "--set", "model.top_k=2", match="model.top_k: only for a mixture")


def test_search_ep_on_a_dense_model() -> None:
    refused("search", str(DDP), "--ep", "2", match="expert parallelism needs a mixture")


def test_clock_factor_far_below_a_thousandth() -> None:
    refused(
        "run", str(DDP), "--set", "stragglers.slow_gpu.ranks=[3]",
        "--set", "stragglers.slow_gpu.clock_factor=1.0e-300",
        match="must be in [0.001, 1]",
    )  # fmt: skip


@pytest.mark.parametrize(
    "args, match",
    [
        (["run"], "missing argument 'SCENARIO'"),
        (["run", str(DDP), "--bogus"], "no such option '--bogus'"),
        (["collective", "--topology", "dgx_h100", "-b", "x"], "invalid value for '--minbytes'"),
        (["validate", "compare", str(MEASURED)], "missing option '--topology'"),
        (["nosuch"], "no such command 'nosuch'"),
    ],
)
def test_click_usage_errors_are_one_error_line(args: list[str], match: str) -> None:
    refused(*args, match=match)


def test_bom_prefixed_csv_is_read_like_yaml(tmp_path: Path) -> None:
    path = tmp_path / "bom.csv"
    path.write_bytes(b"\xef\xbb\xbf" + MEASURED.read_bytes())
    code, out, err = collsim("validate", "compare", str(path), "--topology", "localhost")
    assert code == 0, err
    assert "all_reduce" in out


def test_straggler_line_names_the_slowed_rank() -> None:
    code, out, err = collsim(
        "run", str(REPO / "scenarios" / "3d_175b.yaml"),
        "--set", "stragglers.slow_gpu.ranks=[13]",
        "--set", "stragglers.slow_gpu.clock_factor=0.5",
        "--set", "stragglers.slow_node.nodes=[1]",
        "--set", "stragglers.slow_node.clock_factor=0.9",
    )  # fmt: skip
    assert code == 0, err
    line = next(line for line in out.splitlines() if line.startswith("stragglers:"))
    assert line.startswith("stragglers: rank 13 at 0.45x clock, "), line
    assert line.endswith("... 4 more ranks"), line


def test_plot_collectives_one_line_per_file_op_and_ranks(tmp_path: Path) -> None:
    """A bench CSV of six ops and a second file of other ranks: a line per (file, op, ranks),
    each with its own (colour, marker); ``--op`` keeps one op."""
    import matplotlib

    matplotlib.use("Agg")
    from collsim.cli.plot import _measured_series, collective_frame
    from collsim.report.plots import plot_collectives

    other = REPO / "validate" / "data" / "localhost_gloo_n4_run4.csv"
    frames = [(path, collective_frame(path)) for path in (MEASURED, other)]
    data = _measured_series(frames, None)
    labels = set(data["algorithm"])
    assert len(labels) == 12, sorted(labels)
    assert "localhost_gloo_n2 measured all_gather n=2" in labels
    for label in labels:  # each line is one op's sizes, each size once
        sizes = data[data["algorithm"] == label]["size_bytes"]
        assert sizes.is_unique, label
    fig = plot_collectives(data)
    styles = [(line.get_color(), line.get_marker()) for line in fig.axes[0].get_lines()]
    assert len(styles) == 12 and len(set(styles)) == 12, styles
    only = _measured_series(frames, "all_gather")
    assert set(only["op"]) == {"all_gather"} and only["algorithm"].nunique() == 2


@pytest.mark.torch
def test_bench_ranks_beyond_this_machines_memory() -> None:
    """1,024 local ranks (the option's range) need about 240 GiB before a buffer: refused
    before a rank starts, naming the memory available."""
    refused(
        "validate", "bench", "--world-size", "1024", "-b", "1K", "-e", "1K",
        match="1024 ranks need about",
    )  # fmt: skip


def test_bench_memory_estimate_follows_the_largest_op() -> None:
    from collsim.validate.measure.bench import (
        PARENT_BYTES,
        RANK_BASE_BYTES,
        BenchConfig,
        bench_memory_bytes,
    )

    sizes = (1024, 256 * 2**20)
    reduce_only = BenchConfig(ops=("all_reduce",), sizes_bytes=sizes)
    every_op = BenchConfig(
        ops=("all_reduce", "all_gather", "reduce_scatter", "broadcast", "all_to_all", "send_recv"),
        sizes_bytes=sizes,
    )
    base = PARENT_BYTES + 4 * RANK_BASE_BYTES
    # all_reduce holds 1.25 buffers of 256 MiB per rank; the others up to 2.25 (their outputs
    # and gloo's copies, all_gather and reduce_scatter in place; measured on 4 ranks,
    # collsim.validate.measure.bench_memory._OP_BUFFERS), and eight 1 MiB blocks of check data
    assert bench_memory_bytes(reduce_only, 4) - base == 4 * (320 * 2**20 + 8 * 2**20)
    assert bench_memory_bytes(every_op, 4) - base == 4 * (576 * 2**20 + 8 * 2**20)
    # the measured peak of that run (benchmarks/peak_rss.py -- collsim validate bench
    # --world-size 4 -b 1K -e 256M -n 2 -w 1, torch 2.13.0+cpu, PSS of the process tree)
    assert bench_memory_bytes(every_op, 4) > 2.70 * 2**30
    assert bench_memory_bytes(every_op, 4, backend="nccl") == base  # buffers on the GPU
