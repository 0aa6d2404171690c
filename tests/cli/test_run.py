"""``collsim run``: the report, JSON, exit codes and one-line errors.

The first part stands in for the engine with a hand-made StepResult (so the report and the exit
codes are tested on known numbers); the last part runs the shipped scenarios end to end.
"""

from __future__ import annotations

import json
import re
import warnings
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
from click.testing import CliRunner

import collsim.cli.run as run_mod
import collsim.study.job as job_mod
from collsim.cli import cli, main
from collsim.core.errors import CollsimWarning, ConfigError
from collsim.core.units import GB, GiB
from collsim.parallel.plan import build_plan
from collsim.report.tables import (
    format_run_report,
    format_seconds,
    format_table,
    memory_verdict,
    merge_collectives,
)
from collsim.step.result import BREAKDOWN_KEYS, MEMORY_KEYS, CollectiveStat, StepResult

REPO = Path(__file__).resolve().parents[2]
SCENARIOS = REPO / "scenarios"

SCENARIO = """\
name: unit
cluster: {topology: fake, nodes: 2}
model: {preset: gpt3-1.3b}
training: {global_batch: 64, micro_batch: 2, dtype: bf16, optimizer: adam, recompute: none}
parallel:
  tp: 2
  pp: 2
  dp: 4
  schedule: 1f1b
  zero: 0
"""

# -- a stand-in engine ----------------------------------------------------------------------------


def fake_topology(scenario: Any) -> SimpleNamespace:
    nodes = scenario.cluster.nodes
    return SimpleNamespace(
        name="fake",
        num_nodes=nodes,
        gpus_per_node=8,
        num_ranks=8 * nodes,
        device=SimpleNamespace(name="H100 SXM"),
    )


def make_result(*, fits: bool = True, peak_bytes: float = 40 * GiB) -> StepResult:
    breakdown = dict(
        compute=1.5,
        tp_exposed=0.1,
        pp_exposed=0.05,
        dp_exposed=0.2,
        ep_exposed=0.0,
        cp_exposed=0.0,
        bubble=0.1,
        framework=0.0,
        interference=0.0,
        optimizer=0.05,
    )  # sums to 2.0 s
    memory = dict(
        parameters=10 * GiB,
        gradients=10 * GiB,
        optimizer=15 * GiB,
        activations=peak_bytes - 37 * GiB,
        buffers=2 * GiB,
    )
    return StepResult(
        step_time_s=2.0,
        tokens_per_s=64 * 2048 / 2.0,
        model_tflops_per_gpu=400.0,
        hardware_tflops_per_gpu=450.0,
        mfu=400 / 989,
        hfu=450 / 989,
        breakdown_s=breakdown,
        memory_peak_bytes=peak_bytes,
        memory_bytes=memory,
        memory_capacity_bytes=80 * GB,
        fits=fits,
        num_gpus=16,
        collectives=[
            CollectiveStat(
                axis="tp",
                op="all_reduce",
                group_size=2,
                algorithm="nvls",
                count=192,
                size_bytes=16 * 2**20,
                time_s=0.3,
                busbw_bps=370e9,
            ),
            CollectiveStat(
                axis="dp",
                op="all_reduce",
                group_size=4,
                algorithm="ring",
                count=27,
                size_bytes=25 * 2**20,
                time_s=0.4,
                busbw_bps=45e9,
            ),
        ],
        warnings=["engine note: 8 micro-batches over 2 stages"],
        mapping="\n".join(f"mapping line {i}" for i in range(20)),
    )


@pytest.fixture
def fake_engine(monkeypatch: pytest.MonkeyPatch) -> dict[str, Any]:
    """Replace topology loading and the engine; the real plan checks still run."""
    state: dict[str, Any] = {"result": make_result(), "calls": []}

    def simulate(
        inputs: Any, *, all_ranks: bool, trace: bool, fidelity: str = "auto"
    ) -> StepResult:
        state["calls"].append({"all_ranks": all_ranks, "trace": trace, "fidelity": fidelity})
        build_plan(inputs.topology, inputs.spec, inputs.training, inputs.parallel)
        warnings.warn("fewer buckets than layers", CollsimWarning)
        return state["result"]

    monkeypatch.setattr(job_mod, "scenario_topology", fake_topology)
    monkeypatch.setattr(job_mod, "simulate_inputs", simulate)
    return state


@pytest.fixture
def scenario_file(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    monkeypatch.chdir(tmp_path)
    (tmp_path / "unit.yaml").write_text(SCENARIO)
    return Path("unit.yaml")


def invoke(*args: str) -> Any:
    return CliRunner().invoke(cli, ["run", *args])


# -- report and exit codes on known numbers -------------------------------------------------------


def test_report_has_every_part(fake_engine: dict[str, Any], scenario_file: Path) -> None:
    res = invoke(str(scenario_file))
    assert res.exit_code == 0, res.output
    out = res.stdout
    for text in [
        "step time",
        "2.000 s",
        "tokens/s",
        "65,536",
        "(4,096 per GPU)",
        "MFU 40.4 %",
        "HFU 45.5 %",
        "compute",
        "75.0 %",
        "exposed TP comm",
        "exposed PP comm",
        "exposed DP comm",
        "pipeline bubble",
        "optimizer",
        "parameters",
        "activations",
        "buffers",
        "fits: 40.00 GiB of 74.51 GiB",
        "nvls",
        "370.0",
        "ring",
        "45.0",
        "mapping line 7",
        "(12 more lines in --json 'mapping')",
        "tp 2 x pp 2 x dp 4, 1f1b",
        "2 x 8 H100 SXM = 16 GPUs",
    ]:
        assert text in out, text
    assert "other (unaccounted)" not in out  # the parts add up to the step time
    assert max(len(line) for line in out.splitlines()) <= 100
    # warnings go to stderr, each once: the engine's CollsimWarning and the result's own
    assert res.stderr.splitlines() == [
        "warning: fewer buckets than layers",
        "warning: engine note: 8 micro-batches over 2 stages",
    ]
    assert fake_engine["calls"] == [{"all_ranks": False, "trace": False, "fidelity": "auto"}]


def test_plan_that_does_not_fit_prints_report_then_exits_1(
    fake_engine: dict[str, Any], scenario_file: Path
) -> None:
    fake_engine["result"] = make_result(fits=False, peak_bytes=100 * GiB)
    res = invoke(str(scenario_file), "--json", "out.json")
    assert res.exit_code == 1
    assert "step time" in res.stdout and "does not fit" in res.stdout
    # 80 GB = 74.51 GiB of HBM
    assert res.stderr.splitlines()[-1] == "does not fit: 100.00 GiB needed of 74.51 GiB"
    assert json.loads(Path("out.json").read_text())["fits"] is False


def test_json_has_the_pinned_keys(fake_engine: dict[str, Any], scenario_file: Path) -> None:
    res = invoke(str(scenario_file), "--json", "result.json", "--all-ranks")
    assert res.exit_code == 0, res.output
    data = json.loads(Path("result.json").read_text())
    for key in [
        "step_time_s",
        "tokens_per_s",
        "model_tflops_per_gpu",
        "hardware_tflops_per_gpu",
        "mfu",
        "hfu",
        "breakdown_s",
        "memory_peak_bytes",
        "memory_bytes",
        "fits",
    ]:
        assert key in data, key
    assert set(data["breakdown_s"]) == set(BREAKDOWN_KEYS)
    assert set(data["memory_bytes"]) == set(MEMORY_KEYS)
    assert data["step_time_s"] == 2.0 and data["memory_peak_bytes"] == 40 * GiB
    assert fake_engine["calls"] == [{"all_ranks": True, "trace": False, "fidelity": "auto"}]


def test_trace_is_written_by_the_trace_writer(
    fake_engine: dict[str, Any], scenario_file: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    written: list[tuple[Any, Path, str]] = []
    monkeypatch.setattr(
        run_mod,
        "_trace_writer",
        lambda: lambda result, path, name: written.append((result, path, name)),
    )
    res = invoke(str(scenario_file), "--trace", "t.json")
    assert res.exit_code == 0, res.output
    assert written == [(fake_engine["result"], Path("t.json"), "unit")]
    assert fake_engine["calls"] == [{"all_ranks": False, "trace": True, "fidelity": "auto"}]


def test_trace_without_a_writer_says_not_yet(
    fake_engine: dict[str, Any], scenario_file: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(run_mod, "_trace_writer", lambda: None)
    res = invoke(str(scenario_file), "--trace", "t.json")
    assert res.exit_code == 3
    assert "not yet available" in res.stderr and fake_engine["calls"] == []


# -- bad input: one line naming the key, exit 2 ---------------------------------------------------

BAD_INPUT = [
    # plan checks (build_plan) located in the file or at the --set
    (
        ["--set", "parallel.dp=2"],
        r"^error: unit.yaml:5: parallel: tp x pp x dp = 2 x 2 x 2 = 8 "
        r"must equal the GPUs",
    ),
    (
        [
            "--set",
            "parallel.tp=3",
            "--set",
            "parallel.dp=8",
            "--set",
            "parallel.pp=1",
            "--set",
            "cluster.nodes=3",
        ],
        r"^error: --set parallel.tp=3: parallel.tp: model heads \(16\) must be divisible by tp",
    ),
    (
        [
            "--set",
            "parallel.pp=16",
            "--set",
            "parallel.dp=1",
            "--set",
            "cluster.nodes=4",
            "--set",
            "training.global_batch=32",
        ],  # 24 layers over 16 stages
        r"^error: --set parallel.pp=16: parallel.pp: model layers \(24\) must be divisible",
    ),
    (
        ["--set", "training.global_batch=63"],
        r"^error: --set training.global_batch=63: training.global_batch: global batch \(63\) must "
        r"be divisible by micro_batch x dp",
    ),
    # loader errors
    (["--set", "model.preset=gpt5"], r"^error: --set model.preset=gpt5: model.preset: unknown"),
    (["--set", "parallel.tpp=2"], r"^error: --set parallel.tpp=2: parallel.tpp: unknown key"),
    (["--set", "parallel.tp=two"], r"^error: --set parallel.tp=two: parallel.tp: must be an int"),
    (["--set", "parallel.tp"], r"^error: --set parallel.tp: expected KEY.PATH=VALUE"),
    (
        ["--set", "training.dtype=[bf16"],
        r"^error: --set training.dtype=\[bf16: training.dtype: "
        r"cannot parse value",
    ),
]


def test_plot_with_another_suffix_is_one_line_exit_2(
    fake_engine: dict[str, Any], scenario_file: Path
) -> None:
    res = invoke(str(scenario_file), "--plot", "step.pdf")
    assert res.exit_code == 2
    assert res.stderr == "error: --plot: the image must end in .png or .svg, got 'step.pdf'\n"
    assert fake_engine["calls"] == [] and not Path("step.pdf").exists()


def test_plot_and_fidelity_reach_the_engine(
    fake_engine: dict[str, Any], scenario_file: Path
) -> None:
    res = invoke(str(scenario_file), "--fidelity", "layer")
    assert res.exit_code == 0, res.output
    assert fake_engine["calls"] == [{"all_ranks": False, "trace": False, "fidelity": "layer"}]
    # the stand-in result has no trace events: plotting it is a one-line error, not a crash
    res = invoke(str(scenario_file), "--plot", "step.png")
    assert fake_engine["calls"][-1] == {"all_ranks": False, "trace": True, "fidelity": "auto"}
    errors = [line for line in res.stderr.splitlines() if not line.startswith("warning: ")]
    assert res.exit_code == 2 and len(errors) == 1
    assert errors[0].startswith("error: ") and "trace" in errors[0]
    res = invoke(str(scenario_file), "--fidelity", "exact")
    assert res.exit_code == 2 and fake_engine["calls"][-1]["fidelity"] == "auto"
    from collsim.play.engine.step import FIDELITIES

    assert run_mod.FIDELITY_CHOICES == (*FIDELITIES, "closed")


@pytest.mark.parametrize(
    "args, pattern",
    BAD_INPUT,
    ids=[
        "world-size",
        "heads-vs-tp",
        "layers-vs-pp",
        "batch-vs-dp",
        "unknown-preset",
        "unknown-key",
        "wrong-type",
        "set-without-value",
        "set-bad-yaml",
    ],
)
def test_bad_input_is_one_line_exit_2(
    fake_engine: dict[str, Any], scenario_file: Path, args: list[str], pattern: str
) -> None:
    res = invoke(str(scenario_file), *args)
    assert res.exit_code == 2, res.output
    assert res.stdout == ""
    assert len(res.stderr.splitlines()) == 1
    assert re.match(pattern, res.stderr), res.stderr


@pytest.mark.parametrize(
    "edit, pattern",
    [
        (("  tp: 2\n", "  tp: 2\n  tq: 2\n"), r"^error: unit.yaml:7: parallel.tq: unknown key"),
        (("  tp: 2\n", "  tp: 2.5\n"), r"^error: unit.yaml:6: parallel.tp: must be an integer"),
        (("  tp: 2\n", "  tp: [2\n"), r"^error: unit.yaml:\d+: YAML syntax error"),
        (("gpt3-1.3b", "gpt-3"), r"^error: unit.yaml:3: model.preset: unknown model preset"),
    ],
    ids=["unknown-key", "wrong-type", "yaml-syntax", "unknown-preset"],
)
def test_bad_file_through_main_exits_2(
    fake_engine: dict[str, Any],
    scenario_file: Path,
    capsys: pytest.CaptureFixture[str],
    edit: tuple[str, str],
    pattern: str,
) -> None:
    scenario_file.write_text(SCENARIO.replace(*edit))
    with pytest.raises(SystemExit) as exc:
        main(["run", str(scenario_file)])
    assert exc.value.code == 2
    captured = capsys.readouterr()
    assert captured.out == "" and len(captured.err.splitlines()) == 1
    assert re.match(pattern, captured.err), captured.err


def test_engine_config_error_is_located(
    fake_engine: dict[str, Any], scenario_file: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    def fail(*args: Any, **kwargs: Any) -> StepResult:
        raise ConfigError("must be <= 4 on this topology", key_path="parallel.dp")

    monkeypatch.setattr(job_mod, "simulate_inputs", fail)
    res = invoke(str(scenario_file))
    assert (res.exit_code, res.stderr) == (
        2,
        "error: unit.yaml:8: parallel.dp: must be <= 4 on this topology\n",
    )


def test_missing_scenario_file(fake_engine: dict[str, Any], scenario_file: Path) -> None:
    res = invoke("nowhere.yaml")
    assert (res.exit_code, res.stderr) == (2, "error: nowhere.yaml: file not found\n")


# -- text tables ----------------------------------------------------------------------------------


def test_format_table_pads_and_aligns() -> None:
    table = format_table(["op", "time"], [["all_reduce", "1 ms"], ["send", "12.5 ms"]])
    assert table.splitlines() == [
        "  op             time",
        "  ----------  -------",
        "  all_reduce     1 ms",
        "  send        12.5 ms",
    ]
    with pytest.raises(ValueError):
        format_table(["a", "b"], [["only one"]])


@pytest.mark.parametrize(
    "time_s, text",
    [
        (12.3456, "12.35 s"),
        (0.1234, "123.4 ms"),
        (5.6e-5, "56.00 us"),
        (0.0, "0 s"),
        (3e-9, "3.000 ns"),
        (1.5, "1.500 s"),
        (1234.5, "1234 s"),
        (0.99999, "1.000 s"),
    ],
)
def test_format_seconds(time_s: float, text: str) -> None:
    assert format_seconds(time_s) == text


def test_breakdown_shows_what_is_unaccounted() -> None:
    result = make_result()
    result.step_time_s = 2.5  # parts sum to 2.0 s
    report = format_run_report(result)
    line = next(l for l in report.splitlines() if "other (unaccounted)" in l)
    assert line.split()[-4:] == ["500.0", "ms", "20.0", "%"]


def test_collective_records_merge_by_kind() -> None:
    def stat(size: float, count: int, time_s: float, busbw: float, axis: str = "dp") -> Any:
        return CollectiveStat(
            axis=axis,
            op="all_reduce",
            group_size=8,
            algorithm="ring",
            count=count,
            size_bytes=size,
            time_s=time_s,
            busbw_bps=busbw,
        )

    # 8-rank ring all_reduce: busbw = 2 x 7/8 x bytes / time per call
    a = stat(100e6, 2, 2 * 1e-3, 2 * 7 / 8 * 100e6 / 1e-3)
    b = stat(50e6, 1, 1e-3, 2 * 7 / 8 * 50e6 / 1e-3)
    merged = merge_collectives([a, b, stat(1e6, 1, 1e-5, 1e11, axis="tp")])
    assert [(m.axis, m.count) for m in merged] == [("dp", 3), ("tp", 1)]
    dp = merged[0]
    assert dp.total_bytes == pytest.approx(250e6) and dp.time_s == pytest.approx(3e-3)
    assert dp.busbw_bps == pytest.approx(2 * 7 / 8 * 250e6 / 3e-3)


def test_long_mapping_lines_are_wrapped() -> None:
    result = make_result()
    result.mapping = "stage 0: " + ", ".join(str(r) for r in range(60))
    lines = format_run_report(result).splitlines()
    wrapped = lines[lines.index("rank mapping") + 1 :]
    assert len(wrapped) > 1 and max(len(line) for line in wrapped) <= 96
    assert " ".join(l.strip() for l in wrapped) == result.mapping


def test_memory_verdict() -> None:
    assert memory_verdict(make_result()) == "fits: 40.00 GiB of 74.51 GiB"
    assert memory_verdict(make_result(fits=False, peak_bytes=112 * GB)) == (
        "does not fit: 104.31 GiB needed of 74.51 GiB"
    )


# -- end to end on the shipped scenarios, with the real topology and engine -----------------------


def _has_engine() -> bool:
    import collsim.play.engine

    return hasattr(collsim.play.engine, "simulate_step")


needs_engine = pytest.mark.skipif(
    not _has_engine(), reason="collsim.play.engine.simulate_step missing"
)


def run_json(tmp_path: Path, name: str, *args: str) -> tuple[Any, dict[str, Any]]:
    out = tmp_path / f"{name}.json"
    res = CliRunner().invoke(
        cli, ["run", str(SCENARIOS / f"{name}.yaml"), "--json", str(out), *args]
    )
    assert res.exception is None or isinstance(res.exception, SystemExit), res.output
    data = json.loads(out.read_text()) if out.exists() else {}
    return res, data


@needs_engine
def test_3d_175b_end_to_end(tmp_path: Path) -> None:
    res, data = run_json(tmp_path, "3d_175b")
    assert res.exit_code == 0, res.output
    assert max(len(line) for line in res.stdout.splitlines()) <= 100
    assert data["num_gpus"] == 1024 and data["fits"] is True
    # the parts of the step add up to the step time (BREAKDOWN_KEYS contract)
    assert sum(data["breakdown_s"].values()) == pytest.approx(data["step_time_s"], rel=1e-6)
    assert 0 < data["mfu"] <= data["hfu"] < 1  # full recompute: HFU counts it, MFU not
    # tokens/s is the global batch of tokens over the step time
    assert data["tokens_per_s"] == pytest.approx(1536 * 2048 / data["step_time_s"], rel=1e-9)
    axes = {(c["axis"], c["op"]) for c in data["collectives"]}
    assert ("tp", "all_reduce") in axes and ("pp", "send_recv") in axes
    assert any(axis == "dp" for axis, _ in axes)
    assert data["mapping"].splitlines()[0] in res.stdout  # the rank mapping is shown


@needs_engine
def test_7b_fp32_ddp_does_not_fit(tmp_path: Path) -> None:
    from collsim.workload import get_preset

    res, data = run_json(tmp_path, "seed_7b_fp32_ddp")
    assert res.exit_code == 1
    assert "step time" in res.stdout  # the report is still printed
    mem = data["memory_bytes"]
    states = mem["parameters"] + mem["gradients"] + mem["optimizer"]
    # fp32 Adam: 4 (weights) + 4 (gradients) + 8 (m, v) = 16 bytes per parameter, unsharded
    assert states == pytest.approx(16 * get_preset("llama2-7b").num_parameters(), rel=1e-9)
    assert data["fits"] is False and data["memory_peak_bytes"] > data["memory_capacity_bytes"]
    # the caching allocator replay runs out of memory: said against what it can hold
    needed = data["memory_peak_bytes"] / GiB
    alloc = data["details"]["allocator"]
    assert alloc["oom"] is True
    assert res.stderr.splitlines()[-1] == (
        f"does not fit: {needed:.2f} GiB allocated, out of memory in "
        f"{alloc['limit_bytes'] / GiB:.2f} GiB"
    )
    assert res.stderr.count("does not fit") == 1  # said once, not also as a warning


@needs_engine
def test_7b_fp32_fsdp_fits(tmp_path: Path) -> None:
    from collsim.workload import get_preset

    res, data = run_json(tmp_path, "seed_7b_fp32_fsdp")
    assert res.exit_code == 0, res.output
    spec = get_preset("llama2-7b")
    psi = spec.num_parameters()
    mem = data["memory_bytes"]
    # fp32 Adam sharded over 8: 4/8 bytes of gradients and 8/8 of m, v per parameter
    assert mem["gradients"] == pytest.approx(4 * psi / 8, rel=1e-9)
    assert mem["optimizer"] == pytest.approx(8 * psi / 8, rel=1e-9)
    # parameters: the 4/8-byte shard plus the units gathered at the peak (at least one fp32
    # layer); with per-layer units that is far from the whole model gathered at once (the
    # seed's "+28 GB temporary full parameters" holds for a single unit wrapping everything)
    shard = 4 * psi / 8
    assert shard + 4 * spec.layer_parameters() <= mem["parameters"] < shard + 4 * psi / 4
    assert data["fits"] is True


@needs_engine
def test_pipeline_schedules_compare(tmp_path: Path) -> None:
    runs = {s: run_json(tmp_path, f"pipeline_13b_{s}")[1] for s in ("gpipe", "1f1b", "interleaved")}
    bubble = {s: d["breakdown_s"]["bubble"] for s, d in runs.items()}
    acts = {s: d["memory_bytes"]["activations"] for s, d in runs.items()}
    assert bubble["interleaved"] < bubble["1f1b"]
    assert acts["1f1b"] < acts["gpipe"]  # 4 micro-batches in flight, not 16


@needs_engine
@pytest.mark.parametrize(
    "name, ops",
    [
        ("ddp_gpt3_1.3b", {("dp", "all_reduce")}),
        ("fsdp_llama2_7b", {("dp", "all_gather"), ("dp", "reduce_scatter")}),
    ],
)
def test_data_parallel_scenarios(tmp_path: Path, name: str, ops: set[tuple[str, str]]) -> None:
    res, data = run_json(tmp_path, name)
    assert res.exit_code == 0, res.output
    assert ops <= {(c["axis"], c["op"]) for c in data["collectives"]}


@needs_engine
@pytest.mark.parametrize(
    "args, pattern",
    [
        (
            ["--set", "parallel.tp=5", "--set", "cluster.nodes=80"],  # 5 x 8 x 16 = 80 x 8
            r"^error: --set parallel.tp=5: parallel.tp: model heads \(96\) must be divisible by tp",
        ),
        (["--set", "parallel.dp=8"], r"^error: .*3d_175b.yaml:\d+: parallel.*1024"),
        (
            [
                "--set",
                "parallel.pp=5",
                "--set",
                "parallel.dp=1",
                "--set",
                "parallel.tp=8",
                "--set",
                "cluster.nodes=5",
                "--set",
                "training.global_batch=5",
            ],
            r"^error: --set parallel.pp=5: parallel.pp: model layers \(96\)",
        ),
        (
            ["--set", "training.global_batch=1000"],
            r"^error: --set training.global_batch=1000: "
            r"training.global_batch: ",
        ),
        (["--set", "cluster.topology=nowhere"], r"^error: .*topology.*nowhere"),
    ],
    ids=["heads-vs-tp", "world-size", "layers-vs-pp", "batch-vs-dp", "unknown-topology"],
)
def test_plan_errors_end_to_end(args: list[str], pattern: str) -> None:
    res = CliRunner().invoke(cli, ["run", str(SCENARIOS / "3d_175b.yaml"), *args])
    assert res.exit_code == 2, res.output
    assert len(res.stderr.splitlines()) == 1 and res.stdout == ""
    assert re.match(pattern, res.stderr), res.stderr


@needs_engine
def test_poor_plan_warns_once_on_stderr(tmp_path: Path) -> None:
    res, _ = run_json(tmp_path, "pipeline_13b_1f1b", "--set", "training.global_batch=2")
    assert res.exit_code == 0, res.output
    lines = [l for l in res.stderr.splitlines() if "fewer micro-batches" in l]
    assert len(lines) == 1 and lines[0].startswith("warning: ")


@needs_engine
def test_trace_file_is_written(tmp_path: Path) -> None:
    trace = tmp_path / "step.json"
    res, _ = run_json(tmp_path, "ddp_gpt3_1.3b", "--trace", str(trace))
    assert res.exit_code == 0, res.output
    assert json.loads(trace.read_text())["traceEvents"]


@needs_engine
def test_all_ranks_agrees_with_the_symmetry_reduction(tmp_path: Path) -> None:
    _, reduced = run_json(tmp_path, "pipeline_13b_1f1b")
    res, full = run_json(tmp_path, "pipeline_13b_1f1b", "--all-ranks")
    assert res.exit_code == 0, res.output
    assert full["step_time_s"] == pytest.approx(reduced["step_time_s"], rel=1e-9)
    assert full["memory_peak_bytes"] == pytest.approx(reduced["memory_peak_bytes"], rel=1e-9)


@needs_engine
def test_run_keeps_heavy_modules_out() -> None:
    """`collsim run` must start fast: no pandas, matplotlib or torch on its path."""
    import subprocess
    import sys

    code = (
        "import sys\nfrom collsim.cli import main\n"
        "try:\n    main(['run', sys.argv[1]])\nexcept SystemExit:\n    pass\n"
        "print('heavy=' + ','.join(m for m in ('pandas', 'matplotlib', 'torch')"
        " if m in sys.modules), file=sys.stderr)"
    )
    out = subprocess.run(
        [sys.executable, "-c", code, str(SCENARIOS / "ddp_gpt3_1.3b.yaml")],
        capture_output=True,
        text=True,
        timeout=120,
        check=True,
    )
    assert "step time" in out.stdout
    assert out.stderr.strip().splitlines()[-1] == "heavy="


@needs_engine
@pytest.mark.parametrize("name, suffix", [("pipeline_13b_1f1b", ".png"), ("ddp_gpt3_1.3b", ".svg")])
def test_plot_image_is_written(tmp_path: Path, name: str, suffix: str) -> None:
    import xml.etree.ElementTree as ET

    image = tmp_path / f"step{suffix}"
    res, data = run_json(tmp_path, name, "--plot", str(image))
    assert res.exit_code == 0, res.output
    assert f"wrote {image}" in res.stderr and data["step_time_s"] > 0
    raw = image.read_bytes()
    if suffix == ".png":
        from matplotlib.image import imread

        assert raw.startswith(b"\x89PNG\r\n\x1a\n")
        pixels = imread(str(image))
        assert pixels.shape[0] > 400 and pixels.shape[1] > 1000
        assert pixels.std() > 0.05  # not a blank canvas
    else:
        root = ET.fromstring(raw)
        assert root.tag.endswith("svg") and float(root.get("width", "0").rstrip("pt")) > 500
        paths = [el for el in root.iter() if el.tag.endswith("path")]
        assert len(paths) > 100  # bars, axes and glyphs drawn


@pytest.mark.parametrize(
    "argv",
    [
        ["run", "scenarios"],  # a directory, not a file
        ["run", "scenarios/3d_175b.yaml", "--bogus"],  # unknown option
        ["run", "scenarios/3d_175b.yaml", "--json", "/no/such/dir/r.json"],  # output folder missing
    ],
    ids=["directory", "unknown-option", "json-folder-missing"],
)
def test_usage_errors_are_one_line_exit_2(
    argv: list[str], capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    from collsim.cli import main

    monkeypatch.chdir(Path(__file__).resolve().parents[2])
    with pytest.raises(SystemExit) as exit_info:
        main(argv)
    assert exit_info.value.code == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1, err
    assert "Usage:" not in err
