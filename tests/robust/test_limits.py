"""Resource bounds decided from the plan before any topology is built or any event runs.

The inputs are the ones that took the machine down before: each must now stop at once with one
line that names the --max-* option raising the limit, exit 2.
"""

from __future__ import annotations

import time
from pathlib import Path

import pytest
from click.testing import CliRunner

from collsim.cli import cli
from collsim.core.errors import ConfigError, LimitError
from collsim.study.limits import Limits, check_scenario, estimate_needs
from collsim.study.scenario import load_scenario

REPO = Path(__file__).resolve().parents[2]
DDP = REPO / "scenarios" / "ddp_gpt3_1.3b.yaml"
BIG = REPO / "scenarios" / "3d_175b.yaml"


def run(*args: str) -> tuple[int, str, float]:
    started = time.perf_counter()
    res = CliRunner().invoke(cli, ["run", *args])
    return res.exit_code, res.stderr, time.perf_counter() - started


@pytest.mark.parametrize(
    "overrides, option",
    [
        (["training.global_batch=640000000000", "training.micro_batch=4"], "--max-microbatches"),
        (["model.layers=10000000"], "--max-layers"),
        (["cluster.nodes=125000000"], "--max-gpus"),
    ],
    ids=["global-batch-640e9", "layers-1e7", "nodes-125e6"],
)
def test_runaway_plans_stop_at_once(overrides: list[str], option: str) -> None:
    args = [str(DDP)]
    for text in overrides:
        args += ["--set", text]
    code, err, elapsed_s = run(*args)
    assert code == 2
    assert err.count("\n") == 1 and err.startswith("error: --set ")
    assert option in err
    assert elapsed_s < 5.0


def test_the_issue_files_as_written(tmp_path: Path) -> None:
    """The same three inputs as scenario files (not --set), located at their lines."""
    text = DDP.read_text()
    cases = {
        "batch.yaml": text.replace("global_batch: 128", "global_batch: 640000000000").replace(
            "micro_batch: 2", "micro_batch: 4"
        ),
        "layers.yaml": text.replace(
            "model: {preset: gpt3-1.3b}", "model: {preset: gpt3-1.3b, layers: 10000000}"
        ),
        "nodes.yaml": text.replace("nodes: 1}", "nodes: 125000000}"),
    }
    for name, body in cases.items():
        path = tmp_path / name
        path.write_text(body)
        code, err, _ = run(str(path))
        assert code == 2, (name, err)
        assert err.startswith(f"error: {path}:") and "--max-" in err, err


def test_a_limit_option_raises_the_limit() -> None:
    code, err, _ = run(str(DDP), "--set", "model.layers=240", "--max-layers", "100")
    assert code == 2 and "--max-layers" in err
    code, err, _ = run(str(DDP), "--set", "model.layers=240", "--max-layers", "1000")
    assert code == 1 and err.startswith("does not fit"), err  # simulated: it is too big


def test_65536_gpu_plan_fails_its_batch_check_before_the_topology(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    import collsim.cluster.topology

    def refuse(*args: object, **kwargs: object) -> None:
        raise AssertionError("the topology was built")

    monkeypatch.setattr(collsim.cluster.topology, "load_topology", refuse)
    monkeypatch.setattr(collsim.cluster.topology.Topology, "__init__", refuse)
    code, err, elapsed_s = run(
        str(BIG),
        "--set",
        "cluster.nodes=8192",
        "--set",
        "parallel.dp=1024",
        "--set",
        "training.global_batch=98305",
    )
    assert code == 2, err
    assert "must be divisible by micro_batch x dp" in err and err.count("\n") == 1
    assert elapsed_s < 2.0


def test_defaults_admit_what_collsim_runs() -> None:
    # 65,536 GPUs with the 3d_175b plan (issue 10's benchmark) and a million-token sequence
    big = load_scenario(
        BIG, ["cluster.nodes=8192", "parallel.dp=1024", "training.global_batch=98304"]
    )
    needs = check_scenario(big)
    assert needs.gpus == 65_536 and needs.microbatches == 96
    long = load_scenario(DDP, ["model.seq_len=1048576"])
    check_scenario(long)
    for path in sorted((REPO / "scenarios").rglob("*.yaml")):
        check_scenario(load_scenario(path))


@pytest.mark.parametrize(
    "path, overrides",
    [
        (DDP, []),
        (DDP, ["training.global_batch=12800"]),
        (DDP, ["model.layers=240"]),
        (BIG, []),
        # the plans of the grid that came closest to the bound (0.89 and 0.88 of it)
        (BIG, ["parallel.tp=1", "parallel.pp=2", "parallel.dp=32", "cluster.nodes=8",
               "training.global_batch=32", "model.layers=64", "parallel.zero=1"]),
        (BIG, ["parallel.tp=1", "parallel.pp=2", "parallel.dp=32", "cluster.nodes=8",
               "training.global_batch=32", "model.layers=8", "parallel.zero=1"]),
        # the all-ranks grid's closest plans (collsim.study.limits): a rank's per-layer step events
        (BIG, ["parallel.tp=8", "parallel.pp=2", "parallel.dp=2", "cluster.nodes=4",
               "training.global_batch=2", "model.layers=64", "parallel.zero=1",
               "model.seq_len=128", "all_ranks"]),
        (BIG, ["parallel.tp=8", "parallel.pp=1", "parallel.dp=2", "cluster.nodes=2",
               "training.global_batch=2", "model.layers=64", "parallel.zero=1",
               "model.seq_len=128", "all_ranks"]),
        # ZeRO-3: a gather per layer and micro-batch (8.1 events each)
        (DDP, ["parallel.zero=3", "training.global_batch=1600", "training.micro_batch=1",
               "model.layers=64", "model.seq_len=128"]),
        # many micro-batches through 8 stages of one layer each (17.5 events per stage each)
        (BIG, ["parallel.tp=1", "parallel.pp=8", "parallel.dp=16", "cluster.nodes=16",
               "training.global_batch=32000", "training.micro_batch=2", "model.layers=8",
               "model.seq_len=128", "parallel.zero=2"]),
    ],
)  # fmt: skip
def test_event_estimate_bounds_the_engine(path: Path, overrides: list[str]) -> None:
    """The estimate is an upper bound of the SimPy events the engine schedules."""
    import warnings

    from collsim.play.engine.step import prepare_step

    all_ranks = "all_ranks" in overrides
    sc = load_scenario(path, [o for o in overrides if o != "all_ranks"])
    needs = check_scenario(sc, all_ranks=all_ranks)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        engine = prepare_step(
            sc.cluster.load(), sc.model, sc.training, sc.parallel, all_ranks=all_ranks
        )
        engine.run()
    events = next(engine.env._eid)
    assert events <= needs.events, (events, needs.events)
    assert needs.work >= needs.events


def test_limits_reject_bad_values() -> None:
    with pytest.raises(ConfigError, match="--max-events"):
        Limits(max_events=0)
    with pytest.raises(ConfigError, match="--max-memory-gib"):
        Limits(max_memory_gib=float("nan"))
    sc = load_scenario(DDP)
    with pytest.raises(LimitError, match="--max-memory-gib"):
        check_scenario(sc, Limits(max_memory_gib=0.01))
    with pytest.raises(LimitError, match="--max-events"):
        check_scenario(sc, Limits(max_events=10))
    # 1 stage x (8 micro-batches x (20 + 2 x 24 layers) + 10 x 24 layers) + 16 x 24 layers
    assert estimate_needs(gpus=8, layers=24, microbatches=8, tp=1, pp=1, dp=8).events == 1168
    # dense: no per-layer events in a micro-batch, 1 x (8 x 20 + 10 x 24) + 16 x 24
    dense = estimate_needs(
        gpus=8, layers=24, microbatches=8, tp=1, pp=1, dp=8, per_layer_exchanges=False
    )
    assert dense.events == 784


def test_all_ranks_estimate_admits_3d_175b() -> None:
    """``run scenarios/3d_175b.yaml --all-ranks`` (429,634 events, 339 MiB measured, see
    collsim.study.limits) fits the default limits; the estimate stays an upper bound of its
    events."""
    needs = check_scenario(load_scenario(BIG), all_ranks=True)
    assert needs.events == 1024 * (96 * 20 + 10 * 12) + 16 * 96
    assert 429_634 <= needs.events < 5 * 429_634  # 4.9 x: the 20 events per micro-batch
    assert needs.memory_bytes < Limits().max_memory_gib * 2**30


@pytest.mark.parametrize(
    "text",
    [".nan", ".inf", "-.inf", ".NaN"],
)
def test_numeric_fields_reject_nan_and_infinity(text: str) -> None:
    code, err, _ = run(str(DDP), "--set", f"parallel.ddp.bucket_mb={text}")
    assert code == 2 and "must be a finite number" in err and err.count("\n") == 1


def test_topology_numbers_reject_nan(tmp_path: Path) -> None:
    from collsim.cluster.topology import load_topology

    src = (REPO / "topologies" / "dgx_h100.yaml").read_text()
    assert "bandwidth_gbps:" in src
    bad = tmp_path / "t.yaml"
    bad.write_text(src.replace("bandwidth_gbps: ", "bandwidth_gbps: .nan #", 1))
    with pytest.raises(ConfigError, match="must be a finite number"):
        load_topology(bad)


def test_collective_and_search_refuse_huge_clusters_before_building_them() -> None:
    for args in (
        ["collective", "--topology", "dgx_h100", "--nodes", "125000000", "-b", "1K", "-e", "1K"],
        ["search", str(BIG), "--gpus", "10000000"],
        ["plot", "collectives", "--topology", "dgx_h100", "--gpus", "10000000", "-o", "x.png"],
    ):
        started = time.perf_counter()
        res = CliRunner().invoke(cli, args)
        assert res.exit_code == 2, (args, res.output)
        assert "more than the limit of 262,144" in res.stderr and res.stderr.count("\n") == 1
        assert time.perf_counter() - started < 5.0


def test_a_32768_rank_collective_is_admitted() -> None:
    res = CliRunner().invoke(
        cli, ["collective", "--topology", "dgx_h100", "--nodes", "4096", "-b", "1M", "-e", "1M"]
    )
    assert res.exit_code == 0, res.output
    assert "32768 ranks on dgx_h100" in res.output


def test_a_sweep_point_beyond_a_limit_is_infeasible_not_a_hang() -> None:
    started = time.perf_counter()
    res = CliRunner().invoke(
        cli, ["sweep", str(DDP), "--set", "training.global_batch=128,640000000000"]
    )
    assert time.perf_counter() - started < 5.0
    assert res.exit_code == 0, res.output  # the first point runs
    assert "infeasible points: 1 of 2" in res.stderr and "--max-microbatches" in res.stderr
    res = CliRunner().invoke(cli, ["sweep", str(DDP), "--gpus", "8,1048576"])
    assert res.exit_code == 2 and "--max-gpus" in res.stderr


def test_fsdp_layer_scans_count_as_work() -> None:
    """ZeRO-3 with 5,000 layers took 56 s in the engine (found by the fuzzer): refused now."""
    overrides = [
        "model.layers=5000",
        "cluster.nodes=2",
        "parallel.dp=16",
        "training.global_batch=16",
        "training.micro_batch=1",
        "parallel.zero=3",
        "model.seq_len=128",
    ]
    with pytest.raises(LimitError, match="--max-events"):
        check_scenario(load_scenario(DDP, overrides))
    ddp = check_scenario(load_scenario(DDP, [*overrides[:-2], "parallel.zero=0"]))
    assert ddp.work < Limits().max_events  # the same plan under DDP buckets: 2 s, admitted


@pytest.mark.parametrize(
    "old, new, key",
    [
        ("gpus_per_node: 8", "gpus_per_node: 100000000", "gpus_per_node"),
        ("count: 8", "count: 100000000", "nics.count"),
    ],
)
def test_a_topology_file_cannot_ask_for_a_billion_links(
    old: str, new: str, key: str, tmp_path: Path
) -> None:
    """Found by the fuzzer: these built links until the kernel killed the process (23 GB)."""
    src = (REPO / "topologies" / "dgx_h100.yaml").read_text()
    assert old in src
    path = tmp_path / "t.yaml"
    path.write_text(src.replace(old, new, 1))
    started = time.perf_counter()
    res = CliRunner().invoke(
        cli, ["collective", "--topology", str(path), "--gpus", "8", "-e", "1K"]
    )
    assert res.exit_code == 2 and f"{key}: 1 node(s) x 100,000,000" in res.stderr
    assert time.perf_counter() - started < 5.0
