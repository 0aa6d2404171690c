"""The scenario loader: schema, presets and overrides, --set, and located errors."""

from __future__ import annotations

import math
import re
from pathlib import Path

import pytest

from collsim.core.errors import ConfigError
from collsim.parallel.config import Recompute, ScheduleKind
from collsim.study.scenario import load_scenario, parse_override
from collsim.workload.presets import get_preset

BASE = """\
name: tiny
cluster: {topology: dgx_h100, nodes: 2}
model:
  preset: gpt3-1.3b
training:
  global_batch: 64
  micro_batch: 2
  dtype: bf16
  optimizer: adam
  recompute: selective
parallel:
  tp: 2
  pp: 2
  dp: 4
  schedule: gpipe
  zero: 1
  ddp: {bucket_mb: 50, overlap: false}
"""


@pytest.fixture(autouse=True)
def _in_tmp(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)  # errors then name the file as "s.yaml"


def write(tmp_path: Path, text: str, name: str = "s.yaml") -> Path:
    (tmp_path / name).write_text(text)
    return Path(name)


def test_loads_every_section(tmp_path: Path) -> None:
    s = load_scenario(write(tmp_path, BASE))
    assert s.name == "tiny"
    assert (s.cluster.topology, s.cluster.nodes) == ("dgx_h100", 2)
    assert s.model == get_preset("gpt3-1.3b")
    assert (s.training.global_batch, s.training.micro_batch) == (64, 2)
    assert s.training.recompute is Recompute.SELECTIVE
    assert (s.parallel.tp, s.parallel.pp, s.parallel.dp, s.parallel.zero) == (2, 2, 4, 1)
    assert s.parallel.schedule is ScheduleKind.GPIPE
    assert s.parallel.ddp.bucket_mb == 50.0 and s.parallel.ddp.overlap is False
    assert s.parallel.fsdp.prefetch == 1  # default of the section left out
    assert s.source == Path("s.yaml")


def test_explicit_model_keys_override_the_preset(tmp_path: Path) -> None:
    text = BASE.replace(
        "  preset: gpt3-1.3b\n",
        "  preset: gpt3-1.3b\n  layers: 4\n  seq_len: 1024\n  kv_heads: 4\n",
    )
    s = load_scenario(write(tmp_path, text))
    preset = get_preset("gpt3-1.3b")
    assert (s.model.num_layers, s.model.seq_len, s.model.num_kv_heads) == (4, 1024, 4)
    assert s.model.hidden == preset.hidden and s.model.vocab == preset.vocab
    assert s.model.name != preset.name  # a modified preset is not named as the preset


def test_model_without_preset_needs_the_shape(tmp_path: Path) -> None:
    model = (
        "model:\n  layers: 2\n  hidden: 64\n  heads: 4\n  seq_len: 128\n  vocab: 1000\n"
        "  norm: rmsnorm\n  gated_mlp: true\n"
    )
    s = load_scenario(write(tmp_path, BASE.replace("model:\n  preset: gpt3-1.3b\n", model)))
    assert (s.model.num_layers, s.model.hidden, s.model.ffn_hidden) == (2, 64, 256)
    assert s.model.norm == "rmsnorm" and s.model.gated_mlp is True
    missing = BASE.replace("model:\n  preset: gpt3-1.3b\n", "model:\n  layers: 2\n  hidden: 64\n")
    with pytest.raises(ConfigError, match=r"s.yaml:3: model.heads: missing required key"):
        load_scenario(write(tmp_path, missing))


def test_set_overrides_any_key_with_yaml_values(tmp_path: Path) -> None:
    s = load_scenario(
        write(tmp_path, BASE),
        [
            "parallel.tp=4",
            "parallel.dp=2",
            "parallel.sequence_parallel=true",
            "parallel.fsdp.offload=yes",  # YAML 1.1 boolean
            "training.dtype=fp32",
            "model.layers=8",
            "cluster.nodes=1",
            "name=renamed",
            "parallel.tp=8",  # the last one wins
        ],
    )
    assert (s.parallel.tp, s.parallel.dp, s.parallel.sequence_parallel) == (8, 2, True)
    assert s.parallel.fsdp.offload is True
    assert s.training.dtype == "fp32" and s.model.num_layers == 8
    assert s.cluster.nodes == 1 and s.name == "renamed"


def test_set_creates_missing_sections(tmp_path: Path) -> None:
    text = BASE.replace("  ddp: {bucket_mb: 50, overlap: false}\n", "")
    s = load_scenario(write(tmp_path, text), ["parallel.ddp.bucket_mb=100"])
    assert s.parallel.ddp.bucket_mb == 100.0


@pytest.mark.parametrize(
    "text, pattern",
    [
        # unknown key, with the line and the keys that are known there
        (
            BASE.replace("  tp: 2\n", "  tp: 2\n  tpp: 3\n"),
            r"^s.yaml:13: parallel.tpp: unknown key \(known keys here: .*tp",
        ),
        # wrong type
        (BASE.replace("  tp: 2\n", "  tp: two\n"), r"^s.yaml:12: parallel.tp: must be an integer"),
        (
            BASE.replace("optimizer: adam", "optimizer: 3"),
            r"^s.yaml:9: training.optimizer: must be a string",
        ),
        (
            BASE.replace("overlap: false", "overlap: 2"),
            r"^s.yaml:17: parallel.ddp.overlap: must be true or false",
        ),
        # a value rejected by the config dataclass gets the file and line added
        (
            BASE.replace("recompute: selective", "recompute: sometimes"),
            r"^s.yaml:10: training.recompute: must be one of none, selective, full; "
            r"got 'sometimes'",
        ),
        (
            BASE.replace("zero: 1", "zero: 4"),
            r"^s.yaml:16: parallel.zero: must be one of 0, 1, 2, 3",
        ),
        (
            BASE.replace("micro_batch: 2", "micro_batch: 0"),
            r"^s.yaml:7: training.micro_batch: must be > 0, got 0",
        ),
        # unknown preset
        (
            BASE.replace("gpt3-1.3b", "gpt5"),
            r"^s.yaml:4: model.preset: unknown model preset 'gpt5'",
        ),
        # model shape rules
        (
            BASE.replace("  preset: gpt3-1.3b\n", "  preset: gpt3-1.3b\n  heads: 15\n"),
            r"^s.yaml:5: model.heads: hidden \(2048\) must be divisible by heads \(15\)",
        ),
        (
            BASE.replace("  preset: gpt3-1.3b\n", "  preset: gpt3-1.3b\n  kv_heads: 3\n"),
            r"^s.yaml:5: model.kv_heads: heads \(16\) must be divisible by kv_heads \(3\)",
        ),
        # a missing section, a section that is not a mapping, an unknown top-level key
        (
            BASE.replace("training:", "trainin:"),
            r"^s.yaml:6: trainin: unknown key|training: missing",
        ),
        (
            BASE.replace("cluster: {topology: dgx_h100, nodes: 2}", "cluster: dgx_h100"),
            r"^s.yaml:2: cluster: must be a mapping",
        ),
        # YAML syntax error, with its line
        (BASE.replace("  tp: 2\n", "  tp: [2\n"), r"^s.yaml:\d+: YAML syntax error"),
        ("", r"^s.yaml.*cluster: missing required section"),
        ("- 1\n- 2\n", r"^s.yaml:1: a scenario must be a mapping"),
    ],
    ids=[
        "unknown-key",
        "tp-not-int",
        "optimizer-not-str",
        "overlap-not-bool",
        "bad-enum",
        "bad-zero",
        "micro-batch-0",
        "unknown-preset",
        "heads-vs-hidden",
        "kv-heads",
        "unknown-section",
        "section-not-mapping",
        "yaml-syntax",
        "empty-file",
        "list-file",
    ],
)
def test_bad_files_name_file_line_and_key(tmp_path: Path, text: str, pattern: str) -> None:
    with pytest.raises(ConfigError, match=pattern) as err:
        load_scenario(write(tmp_path, text))
    assert "\n" not in str(err.value)


@pytest.mark.parametrize(
    "override, pattern",
    [
        ("parallel.tp", r"^--set parallel.tp: expected KEY.PATH=VALUE"),
        ("=4", r"^--set =4: expected KEY.PATH=VALUE"),
        ("parallel..tp=4", r"^--set parallel..tp=4: parallel..tp: empty part in key path"),
        ("parallel.tp=", r"^--set parallel.tp=: parallel.tp: missing value"),
        ("parallel.tp=[4", r"^--set parallel.tp=\[4: parallel.tp: cannot parse value"),
        (
            "parallel.tp=four",
            r"^--set parallel.tp=four: parallel.tp: must be an integer, got 'four'",
        ),
        ("parallel.tp=0", r"^--set parallel.tp=0: parallel.tp: must be > 0, got 0"),
        ("parallel.tq=4", r"^--set parallel.tq=4: parallel.tq: unknown key"),
        ("training.dtype=fp64", r"^--set training.dtype=fp64: training.dtype: must be one of"),
        ("model.preset=gpt5", r"^--set model.preset=gpt5: model.preset: unknown model preset"),
        ("name.first=x", r"^--set name.first=x: name.first: name is not a section"),
    ],
    ids=[
        "no-equals",
        "no-key",
        "empty-part",
        "no-value",
        "bad-yaml",
        "wrong-type",
        "bad-value",
        "unknown-key",
        "bad-enum",
        "unknown-preset",
        "not-a-section",
    ],
)
def test_bad_set_names_the_override_and_key(tmp_path: Path, override: str, pattern: str) -> None:
    with pytest.raises(ConfigError, match=pattern) as err:
        load_scenario(write(tmp_path, BASE), [override])
    assert "\n" not in str(err.value)


def test_later_errors_are_located_in_the_file_or_at_set(tmp_path: Path) -> None:
    s = load_scenario(write(tmp_path, BASE), ["parallel.pp=1"])
    plan_error = ConfigError("heads (16) must be divisible by tp, got 3", key_path="parallel.tp")
    assert str(s.locate(plan_error)) == (
        "s.yaml:12: parallel.tp: heads (16) must be divisible by tp, got 3"
    )
    assert str(s.locate(ConfigError("x", key_path="parallel.pp"))) == (
        "--set parallel.pp=1: parallel.pp: x"
    )
    # A key path the file does not have points at its nearest ancestor.
    assert s.locate(ConfigError("x", key_path="parallel")).line == 11


def test_topology_path_is_relative_to_the_scenario(tmp_path: Path) -> None:
    (tmp_path / "topo").mkdir()
    (tmp_path / "topo" / "mine.yaml").write_text("name: mine\n")
    text = BASE.replace("topology: dgx_h100", "topology: topo/mine.yaml")
    s = load_scenario(write(tmp_path, text))
    assert s.cluster.topology == str(Path("topo") / "mine.yaml")
    missing = BASE.replace("topology: dgx_h100", "topology: nowhere/x.yaml")
    assert load_scenario(write(tmp_path, missing)).cluster.topology == "nowhere/x.yaml"


def test_missing_file_is_a_config_error(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match=r"nope.yaml: file not found"):
        load_scenario(tmp_path / "nope.yaml")


def test_parse_override_reads_yaml_scalars() -> None:
    assert parse_override("parallel.tp=8").value == 8
    assert parse_override("parallel.ddp.bucket_mb=12.5").value == 12.5
    assert parse_override("parallel.schedule=1f1b").value == "1f1b"
    assert parse_override("a.b = false").path == ("a", "b")
    assert parse_override("a.b=x=y").value == "x=y"


# -- the shipped scenarios -------------------------------------------------------------------------

SCENARIOS = sorted((Path(__file__).resolve().parents[1] / "scenarios").glob("*.yaml"))


def test_scenarios_are_shipped() -> None:
    names = {p.name for p in SCENARIOS}
    assert {
        "3d_175b.yaml",
        "ddp_gpt3_1.3b.yaml",
        "fsdp_llama2_7b.yaml",
        "pipeline_13b_gpipe.yaml",
        "pipeline_13b_1f1b.yaml",
        "pipeline_13b_interleaved.yaml",
        "seed_7b_fp32_ddp.yaml",
        "seed_7b_fp32_fsdp.yaml",
    } <= names


@pytest.mark.parametrize("path", SCENARIOS, ids=[p.stem for p in SCENARIOS])
def test_shipped_scenario_plan_covers_its_cluster(path: Path) -> None:
    from collsim.cluster.topology import load_topology

    s = load_scenario(path)
    topology = load_topology(s.cluster.topology, nodes=s.cluster.nodes)
    assert s.parallel.world_size == topology.num_ranks
    assert s.training.global_batch % (s.training.micro_batch * s.parallel.dp) == 0


_PRODUCT = re.compile(r"#[^#]*?\b(\d+(?:\s*x\s*\d+)+)\s*=\s*([\d,]+)\b")


@pytest.mark.parametrize("path", SCENARIOS, ids=[p.stem for p in SCENARIOS])
def test_derived_totals_in_comments_are_right(path: Path) -> None:
    """Every ``# a x b x c = n`` comment multiplies out."""
    checked = 0
    for line in path.read_text().splitlines():
        for factors, total in _PRODUCT.findall(line):
            product = math.prod(int(f) for f in re.split(r"\s*x\s*", factors))
            assert product == int(total.replace(",", "")), line
            checked += 1
    assert checked >= 1


def test_3d_175b_is_the_design_example() -> None:
    s = load_scenario(SCENARIOS[0].parent / "3d_175b.yaml")
    assert (s.cluster.topology, s.cluster.nodes, s.model.name) == ("dgx_a100", 128, "gpt3-175b")
    assert (s.parallel.tp, s.parallel.pp, s.parallel.dp, s.parallel.zero) == (8, 8, 16, 1)
    assert (s.training.global_batch, s.training.micro_batch) == (1536, 1)
    assert (
        s.training.recompute is Recompute.FULL and s.parallel.schedule is ScheduleKind.ONE_F_ONE_B
    )
    assert (s.parallel.ddp.bucket_mb, s.parallel.ddp.overlap) == (25.0, True)


def test_stack_shortcut_and_explicit_override() -> None:
    from collsim.parallel.config import STACKS, TrainingConfig

    tr = TrainingConfig(global_batch=8, stack="torchtitan", grad_reduce_dtype="bf16")
    assert tr.fsdp_version == 2 and tr.attention_kernel == STACKS["torchtitan"]["attention_kernel"]
    assert tr.grad_reduce_dtype == "bf16"  # explicit key wins over the stack
    plain = TrainingConfig(global_batch=8)
    assert plain.attention_kernel is None and plain.grad_reduce_dtype == "bf16"
    with pytest.raises(ConfigError, match=r"training.stack: must be one of megatron_te"):
        TrainingConfig(global_batch=8, stack="nemo")
    with pytest.raises(ConfigError, match=r"training.execution: must be one of eager"):
        TrainingConfig(global_batch=8, execution="jit")


def test_attention_kernel_key_decides_a_hand_written_model(tmp_path) -> None:  # type: ignore[no-untyped-def]
    from collsim.study.scenario import load_scenario

    text = (
        "cluster: {topology: dgx_h100, device: h800}\n"
        "model: {layers: 2, hidden: 512, heads: 8, seq_len: 1024, vocab: 1000}\n"
        "training: {global_batch: 8, attention_kernel: flash3}\nparallel: {dp: 8}\n"
    )
    (tmp_path / "s.yaml").write_text(text)
    sc = load_scenario(tmp_path / "s.yaml")
    assert sc.model.flash_attention  # a hand-written model gets the kernel the scenario names
    assert sc.cluster.load().device.key == "h800"
    (tmp_path / "b.yaml").write_text(text.replace("flash3", "flash9"))
    with pytest.raises(ConfigError, match=r"b.yaml:3: training.attention_kernel: must be one of"):
        load_scenario(tmp_path / "b.yaml")
