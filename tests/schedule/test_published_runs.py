"""``collsim run`` of every plan of modern_plans.md (scenarios/published/): each of these
recipes really ran, so each plan fits (exit 0); the JSON carries the ep / cp breakdown keys."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from click.testing import CliRunner

from collsim.cli import cli
from collsim.cluster.topology import load_topology
from collsim.step.result import BREAKDOWN_KEYS

ROOT = Path(__file__).resolve().parents[2]
PLANS = sorted(
    p
    for p in (ROOT / "scenarios" / "published").glob("*.yaml")
    if p.name.startswith(("moe_", "cp_", "hsdp_"))
)


def _topology_known(path: Path) -> bool:
    from collsim.core.errors import ConfigError
    from collsim.study.scenario import load_scenario

    try:
        load_topology(load_scenario(path).cluster.topology, nodes=1)
    except ConfigError:
        return False
    return True


@pytest.mark.parametrize("path", PLANS, ids=lambda p: p.stem)
def test_collsim_run_prices_the_plan(path: Path, tmp_path: Path) -> None:
    if not _topology_known(path):
        pytest.skip("its topology is not in the catalogue yet")
    out = tmp_path / "result.json"
    res = CliRunner().invoke(cli, ["run", str(path), "--json", str(out)])
    assert res.exit_code == 0, res.output
    data = json.loads(out.read_text())
    assert set(BREAKDOWN_KEYS) <= set(data["breakdown_s"])
    assert {"ep_exposed", "cp_exposed"} <= set(data["breakdown_s"])
    assert sum(data["breakdown_s"].values()) == pytest.approx(data["step_time_s"], rel=1e-9)
    assert data["fits"] and "does not fit" not in res.output
    axes = {c["axis"] for c in data["collectives"]}
    name = path.name
    if name.startswith("moe_") and "gpt_oss" not in name or name.startswith("hsdp_"):
        # the expert exchange: one all-to-all over ep, or DeepEP / HybridEP's network leg
        # (ep_node) with its NVLink leg (ep_local)
        assert axes & {"ep", "ep_node"} and data["breakdown_s"]["ep_exposed"] > 0
    from collsim.study.scenario import load_scenario

    if load_scenario(path).parallel.cp > 1:
        assert "cp" in axes  # the KV exchange is priced
    else:
        assert "cp" not in axes and data["breakdown_s"]["cp_exposed"] == 0
