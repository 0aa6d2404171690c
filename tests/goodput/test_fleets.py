"""Goodput across fleet failure rates (``--fleet``, the published low / central / high), the
bounds on ``--runs`` and ``--seed``, the units of the report and the exit of a plan that does
not fit."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from collsim.study.goodput.estimate import Spread
from collsim.study.goodput.fleets import at_rate, find_fleets, levels, published_fleets
from collsim.study.scenario import load_scenario

REPO = Path(__file__).resolve().parents[2]
SCENARIO = Path(__file__).resolve().parent / "data" / "goodput_gpt3_175b_1024.yaml"
PUBLISHED = REPO / "scenarios" / "published" / "goodput_llama3_405b_16384.yaml"
CLI = [sys.executable, "-c", "import sys; from collsim.cli import main; sys.exit(main())"]


def collsim(*args: str) -> subprocess.CompletedProcess[str]:
    env = {"PYTHONPATH": str(REPO), "PATH": "/usr/bin:/bin"}
    return subprocess.run(
        CLI + list(args), cwd=REPO, env=env, capture_output=True, text=True, timeout=600
    )


def test_the_published_fleets_are_the_reference_figures() -> None:
    fleets = {f.name: f for f in published_fleets()}
    # reliability.md C1 (Kokolis et al., HPCA 2025): 6.50 and 2.34 per 1,000 node-days
    assert fleets["meta_rsc1"].per_1000_node_days == 6.50
    assert fleets["meta_rsc2"].per_1000_node_days == 2.34
    assert all("arXiv:2410.21680" in fleets[n].source for n in ("meta_rsc1", "meta_rsc2"))
    # C5: ~205 failures in four months on 1,600 H200 (200 nodes)
    assert fleets["crusoe_h200"].per_1000_node_days == pytest.approx(
        205 / (200 * 4 * 30.44) * 1000, abs=0.01
    )
    named = levels(published_fleets())
    assert [level for level, _ in named] == ["low", "central", "high"]
    rates = [f.per_1000_node_days for _, f in named]
    assert rates == sorted(rates)


def test_a_fleet_rate_scales_every_component_by_one_factor() -> None:
    rel = load_scenario(SCENARIO).reliability
    assert rel is not None
    scaled = at_rate(rel, 2.34)
    assert sum(c.per_1000_node_days for c in scaled.components) == pytest.approx(2.34)
    total = sum(c.per_1000_node_days for c in rel.components)
    for before, after in zip(rel.components, scaled.components):
        assert after.per_1000_node_days == pytest.approx(before.per_1000_node_days * 2.34 / total)
        assert after.nodes_affected == before.nodes_affected


def test_the_default_report_shows_low_central_and_high_with_bands(tmp_path: Path) -> None:
    out = tmp_path / "g.json"
    done = collsim("goodput", str(SCENARIO), "--runs", "60", "--json", str(out))
    assert done.returncode == 0, done.stderr
    text = done.stdout
    for level in ("low", "central", "high"):
        line = next(x for x in text.splitlines() if x.strip().startswith(level + " "))
        assert line.count("(") >= 2 and " - " in line  # MC mean (5th - 95th) twice
    data = json.loads(out.read_text())
    assert [f["level"] for f in data["fleets"]] == ["low", "central", "high"]
    interruptions = [f["interruptions"] for f in data["fleets"]]
    assert interruptions == sorted(interruptions) and interruptions[0] < interruptions[-1]
    for fleet in data["fleets"]:
        mc = fleet["monte_carlo"]["interruptions"]
        assert mc["p5"] <= mc["mean"] <= mc["p95"]
    # units as the README states: binary memory sizes, token scales written out
    assert "TiB" in text or "GiB" in text
    assert " TB" not in text and " GB " not in text and " B tokens" not in text
    assert "billion tokens per day" in text


def test_one_fleet_by_name_or_file(tmp_path: Path) -> None:
    one = collsim("goodput", str(SCENARIO), "--runs", "20", "--fleet", "meta_rsc2")
    assert one.returncode == 0, one.stderr
    assert "at the published fleet failure rates" not in one.stdout
    custom = tmp_path / "fleets.yaml"
    custom.write_text("fleets:\n  ours: {per_1000_node_days: 0}\n")
    bad = collsim("goodput", str(SCENARIO), "--fleet", str(custom))
    assert bad.returncode == 2
    lines = bad.stderr.strip().splitlines()
    assert len(lines) == 1 and "fleets.ours.per_1000_node_days" in lines[0]
    assert str(custom) in lines[0] and "> 0" in lines[0]
    unknown = collsim("goodput", str(SCENARIO), "--fleet", "nowhere")
    assert unknown.returncode == 2 and len(unknown.stderr.strip().splitlines()) == 1
    assert find_fleets("meta_rsc1")[0].per_1000_node_days == 6.50


@pytest.mark.parametrize(
    ("args", "option"), [(["--runs", "1000000"], "--runs"), (["--seed", "-1"], "--seed")]
)
def test_runs_and_seed_out_of_range_are_one_line(args: list[str], option: str) -> None:
    done = collsim("goodput", str(SCENARIO), *args)
    assert done.returncode == 2
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1 and option in lines[0] and "Traceback" not in done.stderr


def test_a_plan_that_does_not_fit_exits_1_after_its_report() -> None:
    done = collsim(
        "goodput",
        str(SCENARIO),
        "--runs",
        "20",
        "--set",
        "training.micro_batch=16",
        "--set",
        "training.recompute=none",
    )
    assert done.returncode == 1, done.stderr
    assert "interruptions" in done.stdout
    assert "does not fit" in done.stderr and "GiB" in done.stderr


def test_a_spread_reads_float_noise_below_zero_as_zero() -> None:
    spread = Spread.of(np.array([-2.56e-10] * 50 + [1.0] * 50))
    assert spread.p5 == 0.0
    assert Spread.of(np.array([-1.0, -1.0])).p5 == -1.0  # a real negative is kept


@pytest.mark.slow
def test_must_show_the_llama3_405b_run_at_three_rates_with_bands() -> None:
    done = collsim("goodput", str(PUBLISHED), "--runs", "200")
    assert done.returncode == 0, done.stderr
    table = done.stdout.split("at the published fleet failure rates", 1)[1]
    assert "interruptions" in table and "effective training" in table
    for level in ("low", "central", "high"):
        assert any(x.strip().startswith(level + " ") for x in table.splitlines())
