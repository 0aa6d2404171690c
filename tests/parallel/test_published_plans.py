"""The published plans of scenarios/published/: each loads, its plan checks pass, and bad
plans exit 2 naming the key (``collsim run`` of each: tests/schedule/test_published_runs.py)."""

from __future__ import annotations

import warnings
from pathlib import Path

import pytest
from click.testing import CliRunner

from collsim.cli import cli
from collsim.cluster.topology import load_topology
from collsim.core.errors import CollsimWarning, ConfigError
from collsim.parallel.plan import build_plan
from collsim.study.scenario import load_scenario

ROOT = Path(__file__).parents[2]
# the modern-plans rows (the goodput scenarios beside them are checked in tests/goodput)
PUBLISHED = sorted(
    p
    for p in (ROOT / "scenarios" / "published").glob("*.yaml")
    if not p.name.startswith(("goodput_", "llmf_"))
)
# modern_plans.md: the file names of the rows
NAMES = {
    "moe_deepseek_v3_h100_1024.yaml",
    "moe_deepseek_v3_h100_256.yaml",
    "moe_qwen3_235b_a22b_h100_256_fp8.yaml",
    "moe_qwen3_30b_a3b_h100_16_fp8.yaml",
    "moe_gpt_oss_120b_h100_64.yaml",
    "cp_llama3_405b_h100_16384.yaml",
    "cp_llama3_405b_h100_16384_8k.yaml",
    "cp_llama31_405b_h100_1024_fp8.yaml",
    "cp_llama3_70b_h100_64.yaml",
    "cp_llama2_7b_1m_h100_1024_fp8.yaml",
    "cp_llama31_405b_h100x96_512_32k.yaml",
    "cp_llama31_405b_h100x96_512_256k.yaml",
    "hsdp_qwen3_30b_a3b_h100_64_fsdp.yaml",
    "hsdp_qwen3_30b_a3b_h100_64_hsdp.yaml",
}
MISSING_TOPOLOGY: set[str] = set()
ROWS = [p for p in PUBLISHED if p.name in NAMES]


def test_every_row_has_its_file() -> None:
    names = {p.name for p in PUBLISHED}
    assert NAMES <= names
    # other published files (the goodput study's) are not rows of modern_plans.md
    assert all(n.startswith("goodput_") for n in names - NAMES)


@pytest.mark.parametrize("path", ROWS, ids=lambda p: p.stem)
def test_published_plan_checks_pass(path: Path) -> None:
    scenario = load_scenario(path)
    text = path.read_text()
    assert text.startswith("#") and "Source:" in text.split("name:")[0]
    if scenario.cluster.topology in MISSING_TOPOLOGY:
        pytest.skip(f"topology {scenario.cluster.topology} is not in the catalogue yet")
    # a one-node copy of the cluster's topology, scaled to the plan's GPUs
    topo = load_topology(scenario.cluster.topology, nodes=scenario.cluster.nodes)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", CollsimWarning)
        plan = build_plan(
            topo, scenario.model, scenario.training, scenario.parallel, for_simulation=False
        )
    assert plan.num_gpus == topo.num_ranks
    assert sorted(i for s in range(plan.pp) for i in plan.stage_layers(s)) == list(
        range(scenario.model.num_layers)
    )


def test_deepseek_plan_groups() -> None:
    s = load_scenario(ROOT / "scenarios" / "published" / "moe_deepseek_v3_h100_256.yaml")
    topo = load_topology(s.cluster.topology, nodes=s.cluster.nodes)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", CollsimWarning)
        plan = build_plan(topo, s.model, s.training, s.parallel, for_simulation=False)
    ep = plan.group_of(0, "ep")
    assert len(ep) == 64 and plan.edp == 1
    assert ep == plan.group_of(0, "dp")  # tp 1, cp 1: the EP group is the stage's dp ranks


DS = "moe_deepseek_v3_h100_256.yaml"
L70 = "cp_llama3_70b_h100_64.yaml"


@pytest.mark.parametrize(
    ("base", "sets", "key", "match"),
    [
        (DS, ["parallel.ep=48"], "parallel.ep", "divisible by ep"),
        (
            DS,
            ["parallel.ep=64", "parallel.dp=32", "cluster.nodes=16"],
            "parallel.ep",
            "must divide",
        ),
        (L70, ["model.seq_len=4002"], "parallel.cp", "2 x cp"),
        (L70, ["model.kv_heads=3"], "model.kv_heads", "divisible by kv_heads"),
    ],
)
def test_bad_plans_exit_2_with_the_key(base: str, sets: list[str], key: str, match: str) -> None:
    args = ["run", str(ROOT / "scenarios" / "published" / base)]
    for s in sets:
        args += ["--set", s]
    res = CliRunner().invoke(cli, args)
    assert res.exit_code == 2, res.output
    line = res.output.strip()
    assert "\n" not in line and key in line and match in line


def test_unknown_hf_architecture_exits_2(tmp_path: Path) -> None:
    bad = ROOT / "tests" / "data" / "hf" / "bad" / "bert.json"
    path = tmp_path / "s.yaml"
    path.write_text(
        f"cluster: {{topology: dgx_h100}}\nmodel: {{hf_config: {bad}}}\n"
        "training: {global_batch: 8}\nparallel: {dp: 8}\n"
    )
    res = CliRunner().invoke(cli, ["run", str(path)])
    assert res.exit_code == 2
    line = res.output.strip()
    assert "\n" not in line and "model_type: unknown architecture 'bert'" in line


def test_hf_config_in_a_scenario(tmp_path: Path) -> None:
    cfg = ROOT / "tests" / "data" / "hf" / "mixtral-8x7b" / "config.json"
    path = tmp_path / "s.yaml"
    path.write_text(
        f"cluster: {{topology: dgx_h100, nodes: 1}}\n"
        f"model: {{hf_config: {cfg}, seq_len: 4096, top_k: 1}}\n"
        "training: {global_batch: 8}\nparallel: {dp: 8}\n"
    )
    s = load_scenario(path)
    assert (s.model.num_experts, s.model.moe_top_k, s.model.seq_len) == (8, 1, 4096)
    with pytest.raises(ConfigError, match="not both"):
        path.write_text(
            f"cluster: {{topology: dgx_h100}}\nmodel: {{preset: llama2-7b, hf_config: {cfg}}}\n"
            "training: {global_batch: 8}\n"
        )
        load_scenario(path)


def test_model_variant_keys(tmp_path: Path) -> None:
    path = tmp_path / "s.yaml"
    path.write_text(
        "cluster: {topology: dgx_h100}\n"
        "model: {layers: 4, hidden: 256, heads: 4, kv_heads: 2, head_dim: 96, seq_len: 128,\n"
        "        vocab: 1000, experts: 8, top_k: 2, shared_experts: 1, expert_ffn_hidden: 128,\n"
        "        first_k_dense: 1, capacity_factor: 1.25, router: sigmoid, sliding_window: 32,\n"
        "        sliding_window_layers: odd, gated_mlp: true}\n"
        "training: {global_batch: 8, dtype: fp8, fp8_recipe: mxfp8}\n"
        "parallel: {dp: 8, ep: 4, cp: 1, cp_algorithm: all_gather,\n"
        "           fsdp: {shard_group_size: 4, reduce_dtype: fp32, fp8_all_gather: true}}\n"
    )
    s = load_scenario(path)
    m = s.model
    assert (m.head_dim, m.num_experts, m.moe_top_k, m.shared_ffn_hidden) == (96, 8, 2, 128)
    assert m.sliding_window_layers == (1, 3) and m.capacity_factor == 1.25
    assert str(s.training.fp8_recipe) == "mxfp8"
    assert s.parallel.fsdp.shard_group_size == 4 and str(s.parallel.fsdp.reduce_dtype) == "fp32"
    bad = path.read_text().replace("top_k: 2", "top_k: 9")
    path.write_text(bad)
    with pytest.raises(ConfigError) as info:
        load_scenario(path)
    assert info.value.key_path == "model.top_k"
