"""``collsim.simulate(path)`` and ``collsim run path --json`` give the same step for every shipped
scenario (both go through :mod:`collsim.study.job`), stragglers included."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from click.testing import CliRunner

import collsim
from collsim.cli import cli

REPO = Path(__file__).resolve().parents[2]
SCENARIOS = sorted([*REPO.glob("scenarios/*.yaml"), *REPO.glob("scenarios/published/*.yaml")])

#: Scenarios whose two steps took over 5 s here (both steps, the test's 2-core machine under
#: load; the 16,384-GPU ones take about 4 s): run with --run-slow.
SLOW = {
    "moe_qwen3_235b_a22b_h100_256_fp8.yaml",
    "cp_llama31_405b_h100_1024_fp8.yaml",
    "cp_llama31_405b_h100x96_512_32k.yaml",
    "hsdp_qwen3_30b_a3b_h100_64_fsdp.yaml",
    "hsdp_qwen3_30b_a3b_h100_64_hsdp.yaml",
}


STRAGGLERS = """\
name: straggler
cluster: {topology: dgx_h100, nodes: 2}
model: {preset: gpt3-350m}
training: {global_batch: 32, micro_batch: 2}
parallel: {tp: 2, pp: 2, dp: 4}
stragglers:
  slow_gpu: {ranks: [5], clock_factor: 0.8}
"""


def _run_json(path: Path, out: Path) -> dict[str, object]:
    res = CliRunner().invoke(cli, ["run", str(path), "--json", str(out)])
    assert res.exit_code in (0, 1), res.output  # 1: the plan does not fit (JSON still written)
    data: dict[str, object] = json.loads(out.read_text())
    return data


def _same_step(path: Path, tmp_path: Path) -> dict[str, object]:
    sim = collsim.simulate(path)
    ran = _run_json(path, tmp_path / "run.json")
    ours = json.loads(json.dumps(sim.result.to_dict(), default=str))
    assert ours["step_time_s"] == ran["step_time_s"]
    assert ours["breakdown_s"] == ran["breakdown_s"]
    assert ours["memory_peak_bytes"] == ran["memory_peak_bytes"]
    assert ours == ran  # and every other figure of the summary
    return ours


@pytest.mark.parametrize(
    "path",
    [
        pytest.param(p, id=p.name, marks=[pytest.mark.slow] if p.name in SLOW else [])
        for p in SCENARIOS
    ],
)
def test_simulate_gives_the_step_collsim_run_gives(path: Path, tmp_path: Path) -> None:
    _same_step(path, tmp_path)


def test_simulate_keeps_the_scenarios_stragglers(tmp_path: Path) -> None:
    path = tmp_path / "straggler.yaml"
    path.write_text(STRAGGLERS)
    ours = _same_step(path, tmp_path)
    details = ours["details"]
    assert isinstance(details, dict)
    assert details["stragglers"]["slowdown"] > 1.0
    assert details["stragglers"]["clock_factors"] == {"5": 0.8}
    without = tmp_path / "plain.yaml"
    without.write_text(STRAGGLERS.split("stragglers:")[0])
    plain = collsim.simulate(without)
    assert plain.stragglers is None
    assert ours["step_time_s"] > plain.step_time_s
