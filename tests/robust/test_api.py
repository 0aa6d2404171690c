"""The notebook API: collsim.simulate / sweep / collective / goodput."""

from __future__ import annotations

from pathlib import Path

import pytest

import collsim
from collsim.core.errors import ConfigError, LimitError
from collsim.study.limits import Limits

REPO = Path(__file__).resolve().parents[2]
DDP = REPO / "scenarios" / "ddp_gpt3_1.3b.yaml"


def test_simulate_matches_the_cli_result() -> None:
    from collsim.play.engine import simulate_step
    from collsim.study.scenario import load_scenario

    sim = collsim.simulate(DDP, overrides={"parallel.ddp.bucket_mb": 50})
    sc = load_scenario(DDP, ["parallel.ddp.bucket_mb=50"])
    direct = simulate_step(sc.cluster.load(), sc.model, sc.training, sc.parallel)
    assert sim.step_time_s == pytest.approx(direct.step_time_s, rel=1e-12)
    assert sim.scenario.parallel.ddp.bucket_mb == 50
    assert set(sim.breakdown) == set(direct.breakdown_s)
    assert sum(sim.breakdown.values()) == pytest.approx(sim.step_time_s, rel=1e-6)
    frame = sim.to_frame()
    assert len(frame) == 1 and frame.loc[0, "num_gpus"] == 8
    assert frame.loc[0, "step_time_s"] == pytest.approx(sim.step_time_s)
    timeline = sim.memory_timeline
    assert {"rank", "time_s"} <= set(timeline.columns) and len(timeline) > 0


def test_simulate_overrides_forms_and_errors() -> None:
    a = collsim.simulate(DDP, ["parallel.zero=1"])
    b = collsim.simulate(DDP, {"parallel.zero": 1})
    assert a.step_time_s == b.step_time_s
    with pytest.raises(ConfigError, match="parallel.zerro"):
        collsim.simulate(DDP, {"parallel.zerro": 1})
    with pytest.raises(LimitError, match="--max-layers"):
        collsim.simulate(DDP, {"model.layers": 48}, limits=Limits(max_layers=30))
    loaded = collsim.load(DDP)
    again = collsim.simulate(loaded, {"parallel.zero": 1})
    assert again.step_time_s == a.step_time_s


def test_plot_returns_a_figure(tmp_path: Path) -> None:
    sim = collsim.simulate(DDP)
    step_s = sim.step_time_s
    assert not sim.trace_events  # as collsim run keeps none without --trace
    fig = sim.plot("step", tmp_path / "s.png")
    assert sim.trace_events and sim.step_time_s == pytest.approx(step_s, rel=1e-12)
    assert (tmp_path / "s.png").read_bytes()[:4] == b"\x89PNG"
    assert fig.axes
    with pytest.raises(ConfigError):
        sim.plot("pie")


def test_sweep_and_collective_frames() -> None:
    frame = collsim.sweep(DDP, gpus=[8, 16])
    assert list(frame["num_gpus"]) == [8, 16] and frame["feasible"].all()
    coll = collsim.collective("all_reduce", [2**20, 2**24], gpus=8, algorithms=["ring"])
    assert list(coll["size_bytes"]) == [2**20, 2**24]
    assert (coll["busbw_bps"] > 0).all()
    with pytest.raises(ConfigError, match="op"):
        collsim.collective("all_reduse", 1024)


def test_sweep_name_is_the_function_and_the_module_lives_in_study() -> None:
    import collsim.study.sweep

    assert collsim.sweep is collsim.api.sweep
    assert collsim.study.sweep.parse_gpus("8,16") == [8, 16]


GOODPUT = """\
name: unit
cluster: {topology: dgx_h100, nodes: 1}
model: {preset: gpt3-1.3b}
training: {global_batch: 64, micro_batch: 2}
parallel: {tp: 1, pp: 1, dp: 8}
reliability:
  components:
    gpu: {per_1000_node_days: 5}
  storage: {write_bandwidth_gbps: 10}
"""


def test_goodput_is_what_the_command_computes(tmp_path: Path) -> None:
    import json

    from click.testing import CliRunner

    from collsim.cli import cli
    from collsim.study.goodput.estimate import GoodputResult

    path = tmp_path / "unit.yaml"
    path.write_text(GOODPUT)
    result = collsim.goodput(path, days=10, runs=200, seed=3)
    assert isinstance(result, GoodputResult) and result.days == 10
    out = tmp_path / "g.json"
    args = [
        "goodput",
        str(path),
        "--days",
        "10",
        "--runs",
        "200",
        "--seed",
        "3",
        "--json",
        str(out),
    ]
    res = CliRunner().invoke(cli, args)
    assert res.exit_code == 0, res.output
    data = json.loads(out.read_text())
    assert data.pop("scenario") == "unit"
    # the plan at the published fleet rates comes beside the scenario's own estimate
    assert [f["level"] for f in data.pop("fleets")] == ["low", "central", "high"]
    assert json.loads(json.dumps(result.to_dict(), default=str)) == data
    # the step it rests on is the one collsim.simulate gives
    step = collsim.simulate(path, trace=False).step_time_s
    assert result.costs.step_time_s == step
    assert 0 < result.closed_form.effective_training_time_ratio < 1
    closed = collsim.goodput(path, days=10, monte_carlo=False)
    assert closed.monte_carlo is None
    assert closed.closed_form.goodput_tokens_per_day == result.closed_form.goodput_tokens_per_day


def test_goodput_at_one_fleet_is_what_the_command_computes(tmp_path: Path) -> None:
    """``fleet=`` puts the plan at that fleet's failure rate, as ``collsim goodput --fleet``:
    the same JSON; another fleet's rate gives another outcome; a file of two fleets or an
    unknown name is refused before any work."""
    import json

    from click.testing import CliRunner

    from collsim.cli import cli

    path = tmp_path / "unit.yaml"
    path.write_text(GOODPUT)
    rsc1 = collsim.goodput(path, days=10, runs=100, seed=3, fleet="meta_rsc1")
    out = tmp_path / "g.json"
    args = ["goodput", str(path), "--days", "10", "--runs", "100", "--seed", "3"]
    res = CliRunner().invoke(cli, [*args, "--fleet", "meta_rsc1", "--json", str(out)])
    assert res.exit_code == 0, res.output
    data = json.loads(out.read_text())
    assert data.pop("scenario") == "unit" and data.pop("fleets") == []
    assert data.pop("fleet")["name"] == "meta_rsc1"
    assert json.loads(json.dumps(rsc1.to_dict(), default=str)) == data
    rsc2 = collsim.goodput(path, days=10, runs=100, seed=3, fleet="meta_rsc2")
    # meta_rsc1 fails 6.50 times per 1,000 node-days, meta_rsc2 2.34 (reliability.md C1)
    assert rsc1.closed_form.effective_training_time_ratio < (
        rsc2.closed_form.effective_training_time_ratio
    )
    two = tmp_path / "fleets.yaml"
    two.write_text("fleets:\n  a: {per_1000_node_days: 1}\n  b: {per_1000_node_days: 2}\n")
    with pytest.raises(ConfigError, match="2 fleets"):
        collsim.goodput(path, fleet=str(two))
    with pytest.raises(ConfigError, match="no fleet"):
        collsim.goodput(path, fleet="nowhere")


def test_goodput_needs_a_reliability_section() -> None:
    with pytest.raises(ConfigError, match="reliability"):
        collsim.goodput(DDP)


def test_load_applies_overrides() -> None:
    loaded = collsim.load(DDP, {"parallel.zero": 2})
    assert loaded.parallel.zero == 2 and loaded.source == DDP
    assert collsim.load(loaded) is loaded
