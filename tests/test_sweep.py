"""Sweeps: GPU-count lists, --set grids, weak/strong scaling, infeasible points, the frame."""

from __future__ import annotations

import math
from pathlib import Path

import pytest

from collsim.core.errors import ConfigError, InfeasibleError
from collsim.report.frames import sweep_frame
from collsim.step.result import StepResult
from collsim.study.sweep import check_overrides, run_sweep
from collsim.study.sweep_grid import build_points, parse_gpus, parse_set

SCENARIO = """\
name: tiny-sweep
cluster: {topology: dgx_h100, nodes: 1}
model: {layers: 4, hidden: 256, heads: 8, seq_len: 128, vocab: 1000}
training: {global_batch: 32, micro_batch: 1}
parallel: {tp: 2, pp: 1, dp: 4, zero: 0}
"""


@pytest.fixture
def scenario(tmp_path: Path) -> Path:
    path = tmp_path / "tiny.yaml"
    path.write_text(SCENARIO)
    return path


def fake_simulate(topology, scenario, *, trace=False, all_ranks=False) -> StepResult:
    """A stand-in engine: step time 1 ms per sequence per replica plus 0.1 ms per dp doubling;
    memory 100 GB / dp for ZeRO-3 (so small dp does not fit in 80 GB)."""
    par, train = scenario.parallel, scenario.training
    step = train.global_batch / par.dp * 1e-3 + 1e-4 * math.log2(par.dp)
    peak = 100e9 / par.dp if par.zero == 3 else 10e9
    assert topology.num_ranks == par.world_size
    return StepResult(
        step_time_s=step,
        tokens_per_s=train.global_batch * 128 / step,
        model_tflops_per_gpu=1.0,
        hardware_tflops_per_gpu=1.0,
        mfu=0.1,
        hfu=0.1,
        breakdown_s={"compute": step},
        memory_peak_bytes=peak,
        memory_bytes={"parameters": peak},
        memory_capacity_bytes=80e9,
        fits=peak <= 80e9,
        num_gpus=topology.num_ranks,
    )


@pytest.mark.parametrize(
    "text, want",
    [
        ("64,128,...,4096", [64, 128, 256, 512, 1024, 2048, 4096]),  # the doubling shorthand
        ("8", [8]),
        ("1,2,...,8,24", [1, 2, 4, 8, 24]),  # more after the progression
        ("4,12,...,108", [4, 12, 36, 108]),  # factor 3
        ("16, 8, 16", [16, 8]),  # order kept, repeats dropped
    ],
    ids=["doubling", "one", "tail", "tripling", "dedup"],
)
def test_parse_gpus(text: str, want: list[int]) -> None:
    assert parse_gpus(text) == want


@pytest.mark.parametrize(
    "text, match",
    [
        ("64,...,4096", "two counts before"),
        ("64,128,...", "two counts before it and one after"),
        ("64,128,...,1000", "1000 is not 64 x 2"),
        ("64,96,...,4096", "not one"),
        ("0,8", "positive integers"),
        ("eight", "positive integers"),
    ],
    ids=["one-before", "none-after", "unreached", "not-geometric", "zero", "word"],
)
def test_parse_gpus_rejects(text: str, match: str) -> None:
    with pytest.raises(ConfigError, match=match) as info:
        parse_gpus(text)
    assert info.value.key_path == "--gpus"


def test_parse_set_splits_outside_brackets() -> None:
    assert parse_set("parallel.zero=0,1,2,3") == ("parallel.zero", ["0", "1", "2", "3"])
    assert parse_set("a.b=[1,2],[3]") == ("a.b", ["[1,2]", "[3]"])
    with pytest.raises(ConfigError, match="KEY.PATH=V1,V2"):
        parse_set("parallel.zero")
    with pytest.raises(ConfigError, match="empty value"):
        parse_set("parallel.zero=0,,1")


@pytest.mark.parametrize(
    "sets, key",
    [
        ([("parallel.zerro", ["1"])], "parallel.zerro"),  # unknown key
        ([("parallel.zero", ["0", "7"])], "parallel.zero"),  # bad value
        ([("parallel.schedule", ["1f1b", "zigzag"])], "parallel.schedule"),
        ([("parallel.dp", ["2"])], "parallel.dp"),  # dp grows with --gpus
    ],
    ids=["unknown-key", "bad-zero", "bad-schedule", "grown-axis"],
)
def test_check_overrides_names_the_key(scenario: Path, sets, key: str) -> None:
    with pytest.raises(ConfigError) as info:
        check_overrides(scenario, sets, gpus=[8, 16])
    assert key in str(info.value)
    assert "\n" not in str(info.value)


def test_weak_scaling_grows_dp_and_the_batch(scenario: Path) -> None:
    points = build_points(gpus=[2, 4, 8, 16], sets=[("parallel.zero", ["0", "3"])])
    assert [p.label for p in points[:1] + points[-1:]] == ["zero=0", "zero=3"]
    outcomes = run_sweep(scenario, points, simulate=fake_simulate)
    frame = sweep_frame(outcomes)
    zero0 = frame[frame["plan"] == "zero=0"].set_index("num_gpus")
    # tp stays 2, dp = N / 2; the batch per replica stays 32 / 4 = 8 sequences
    assert list(zero0["dp"]) == [1, 2, 4, 8]
    assert list(zero0["global_batch"]) == [8, 16, 32, 64]
    assert list(zero0["tp"]) == [2, 2, 2, 2]
    assert zero0["feasible"].all()
    # ZeRO-3 peak 100 GB / dp: dp 1 does not fit, and says so; its numbers are kept
    zero3 = frame[frame["plan"] == "zero=3"].set_index("num_gpus")
    assert list(zero3["feasible"]) == [False, True, True, True]
    assert zero3.loc[2, "reason"] == "memory: peak 100.0 GB > 80.0 GB"
    assert zero3.loc[2, "memory_peak_bytes"] == 100e9
    assert list(frame.columns[:3]) == ["plan", "num_gpus", "tp"]
    assert {
        "step_time_s",
        "compute_s",
        "mem_parameters_bytes",
        "mfu",
        "fits",
        "elapsed_s",
        "parallel.zero",
    } <= set(frame.columns)


def test_strong_scaling_keeps_the_batch_and_lists_what_cannot_split(scenario: Path) -> None:
    points = build_points(gpus=[4, 8, 64, 3])
    frame = sweep_frame(run_sweep(scenario, points, strong=True, simulate=fake_simulate))
    rows = frame.set_index("num_gpus")
    assert list(rows.loc[[4, 8], "global_batch"]) == [32, 32]
    # 64 GPUs: dp 32 still divides the batch of 32 (one sequence each); 3 GPUs do not split
    # into tp 2.
    assert rows.loc[3, "reason"] == "gpus: 3 GPUs do not split into tp 2 x pp 1 x dp"
    assert not rows.loc[3, "feasible"] and math.isnan(rows.loc[3, "step_time_s"])
    assert bool(rows.loc[64, "feasible"])


def test_combinations_that_do_not_build_are_infeasible_points(scenario: Path) -> None:
    sets = [("parallel.schedule", ["1f1b", "interleaved"]), ("parallel.virtual_stages", ["1", "2"])]
    check_overrides(scenario, sets)  # virtual_stages=2 is fine: it works with interleaved
    with pytest.raises(ConfigError, match="parallel.virtual_stages"):
        check_overrides(scenario, [sets[0], ("parallel.virtual_stages", ["1", "0"])])
    points = build_points(
        sets=[("parallel.schedule", ["1f1b", "gpipe"]), ("parallel.virtual_stages", ["1", "2"])]
    )
    frame = sweep_frame(run_sweep(scenario, points, simulate=fake_simulate))
    bad = frame[~frame["feasible"]]
    assert len(bad) == 2
    assert all(r.startswith("config: ") and "virtual_stages" in r for r in bad["reason"])


def test_grow_tp(scenario: Path) -> None:
    points = build_points(gpus=[4, 8])
    frame = sweep_frame(run_sweep(scenario, points, grow="tp", simulate=fake_simulate))
    assert list(frame["tp"]) == [1, 2] and list(frame["dp"]) == [4, 4]
    assert list(frame["global_batch"]) == [32, 32]


def test_infeasible_error_becomes_a_reason(scenario: Path) -> None:
    def boom(topology, scenario, **_):
        raise InfeasibleError("no room", reason="memory")

    (outcome,) = run_sweep(scenario, build_points(), simulate=boom)
    assert outcome.reason == "memory: no room" and outcome.result is None


def test_parse_plan() -> None:
    from collsim.study.sweep_grid import parse_plan

    assert parse_plan("DDP + overlap: parallel.zero=0, parallel.ddp.overlap=true") == (
        "DDP + overlap",
        ["parallel.zero=0", "parallel.ddp.overlap=true"],
    )
    assert parse_plan("base:") == ("base", [])
    with pytest.raises(ConfigError, match="expected NAME: KEY=VALUE"):
        parse_plan("no colon")
    with pytest.raises(ConfigError, match="expected KEY=VALUE, got 'zero'"):
        parse_plan("x: zero")


def test_named_plans_cross_the_sets(scenario: Path) -> None:
    plans = {"DDP": ["parallel.zero=0"], "FSDP": ["parallel.zero=3"]}
    check_overrides(scenario, [], plans=plans)
    with pytest.raises(ConfigError, match="plan 'bad'.*parallel.zerro"):
        check_overrides(scenario, [], plans={"bad": ["parallel.zerro=1"]})
    points = build_points(gpus=[4, 8], sets=[("parallel.tp", ["1", "2"])], plans=plans)
    assert [(p.label, p.num_gpus) for p in points[:3]] == [
        ("DDP, tp=1", 4),
        ("DDP, tp=1", 8),
        ("DDP, tp=2", 4),
    ]
    frame = sweep_frame(run_sweep(scenario, points, simulate=fake_simulate))
    assert list(frame["zero"]) == [0] * 4 + [3] * 4
    assert list(frame["tp"]) == [1, 1, 2, 2] * 2


def test_check_overrides_rejects_an_unknown_topology_with_its_line(tmp_path: Path) -> None:
    path = tmp_path / "bad.yaml"
    path.write_text(SCENARIO.replace("topology: dgx_h100", "topology: dgx_h999"))
    with pytest.raises(
        ConfigError,
        match=r"bad.yaml:2: cluster.topology: no topology file or "
        r"name 'dgx_h999'",
    ):
        check_overrides(path, [])
