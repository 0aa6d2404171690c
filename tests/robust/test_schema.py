"""One schema (collsim/core/schema.py) checks files with every error at once and is the JSON
Schema."""

from __future__ import annotations

import functools
import json
from pathlib import Path

import jsonschema
import pytest
import yaml
from click.testing import CliRunner

from collsim.cli import cli
from collsim.cluster.hardware import DEVICE
from collsim.cluster.topology import TOPOLOGY, load_topology
from collsim.core.errors import ConfigError, ConfigErrors
from collsim.core.schema import check
from collsim.core.yamlio import load_yaml
from collsim.study.scenario import SCENARIO, load_scenario

REPO = Path(__file__).resolve().parents[2]
SCENARIOS = sorted((REPO / "scenarios").rglob("*.yaml"))
TOPOLOGIES = sorted((REPO / "topologies").glob("*.yaml")) + sorted(
    (REPO / "collsim" / "data" / "topologies").glob("*.yaml")
)
DEVICES = sorted((REPO / "collsim" / "data" / "devices").glob("*.yaml")) + sorted(
    (REPO / "validate" / "data").rglob("*profile*.yaml")
)


@functools.cache
def _schema(kind: str) -> dict:
    """The JSON Schema as ``collsim schema KIND`` prints it (checked against the metaschema)."""
    res = CliRunner().invoke(cli, ["schema", kind])
    assert res.exit_code == 0, res.output
    schema = json.loads(res.stdout)
    jsonschema.Draft202012Validator.check_schema(schema)
    return schema


def _rel(path: Path) -> str:
    return str(path.relative_to(REPO))


@pytest.mark.parametrize(
    ("path", "kind", "spec"),
    [(p, "scenario", SCENARIO) for p in SCENARIOS]
    + [(p, "topology", TOPOLOGY) for p in TOPOLOGIES]
    + [(p, "device", DEVICE) for p in DEVICES],
    ids=lambda v: _rel(v) if isinstance(v, Path) else (v if isinstance(v, str) else ""),
)
def test_schema_validates_every_shipped_file(path: Path, kind: str, spec: object) -> None:
    """Every shipped scenario, topology and device passes both the JSON Schema and check()."""
    jsonschema.validate(yaml.safe_load(path.read_text()), _schema(kind))
    assert check(load_yaml(path), spec) == []  # type: ignore[arg-type]


def test_every_kind_of_shipped_file_is_covered() -> None:
    assert len(SCENARIOS) >= 30 and len(TOPOLOGIES) >= 26 and len(DEVICES) >= 11


def _doc_blocks(name: str, invalid: bool) -> list[str]:
    import sys

    sys.path.insert(0, str(REPO / "tests"))
    from test_docs import read_blocks

    return [
        b.text
        for b in read_blocks(name)
        if b.lang == "yaml" and ("invalid" in b.options) == invalid
    ]


@pytest.mark.parametrize("name", ["scenarios.md", "topologies.md", "commands.md"])
def test_schema_rejects_the_malformed_examples_of_the_docs(name: str) -> None:
    schemas = {"scenario": _schema("scenario"), "topology": _schema("topology")}
    bad = _doc_blocks(name, invalid=True)
    assert bad, f"{name} has no malformed example"
    for text in bad:
        data = yaml.safe_load(text)
        kind = "topology" if "intra_node" in data or "gpus_per_node" in data else "scenario"
        with pytest.raises(jsonschema.ValidationError):
            jsonschema.validate(data, schemas[kind])
    for text in _doc_blocks(name, invalid=False):
        data = yaml.safe_load(text)
        if not isinstance(data, dict):
            continue
        kind = "topology" if "intra_node" in data or "gpus_per_node" in data else "scenario"
        if kind == "scenario" and "training" not in data:
            continue  # a fragment of a scenario shown in the text
        jsonschema.validate(data, schemas[kind])


def test_the_docs_error_examples_are_rejected_by_the_schema() -> None:
    """The --set mistakes that docs/scenarios.md shows, applied to a shipped scenario."""
    schema = _schema("scenario")
    base = yaml.safe_load((REPO / "scenarios" / "ddp_gpt3_1.3b.yaml").read_text())
    for section, key, value in [
        ("parallel", "zero", 4),
        ("parallel", "tp", "two"),
        ("model", "preset", "gpt4"),
        ("parallel", "bucket", 25),
    ]:
        data = json.loads(json.dumps(base))
        data[section][key] = value
        with pytest.raises(jsonschema.ValidationError):
            jsonschema.validate(data, schema)


BROKEN = """\
name: broken
cluster: {topology: dgx_h100, nodes: 0}
model: {preset: gpt3-1.3b, layers: -2, norm: batchnorm}
training: {global_batch: 64, micro_batch: two, dtype: bf17}
parallel:
  tp: 1
  zero: 5
  ddp: {bucket_mb: .nan, overlapp: true}
"""


def test_every_error_of_a_file_at_once(tmp_path: Path) -> None:
    path = tmp_path / "broken.yaml"
    path.write_text(BROKEN)
    with pytest.raises(ConfigErrors) as info:
        load_scenario(path)
    lines = info.value.lines()
    p = str(path)
    assert lines == [
        f"error: {p}:2: cluster.nodes: must be > 0, got 0",
        f"error: {p}:3: model.layers: must be > 0, got -2",
        f"error: {p}:3: model.norm: must be one of layernorm, rmsnorm; got 'batchnorm'",
        f"error: {p}:4: training.micro_batch: must be an integer, got 'two'",
        f"error: {p}:4: training.dtype: must be one of bf16, fp16, fp32, fp8; got 'bf17'",
        f"error: {p}:7: parallel.zero: must be one of 0, 1, 2, 3; got 5",
        f"error: {p}:8: parallel.ddp.bucket_mb: must be a finite number, got nan",
        f"error: {p}:8: parallel.ddp.overlapp: unknown key (known keys here: bucket_mb, "
        "first_bucket_mb, gradient_as_bucket_view, overlap); did you mean 'overlap'?",
    ]
    res = CliRunner().invoke(cli, ["run", p])
    assert res.exit_code == 2
    assert res.stderr.splitlines() == lines


def test_topology_errors_at_once(tmp_path: Path) -> None:
    path = tmp_path / "t.yaml"
    path.write_text(
        "name: t\ndevice: h100\ngpus_per_node: 0\n"
        "intra_node: {interconnect: nvlink, bandwidth_gbps: -1}\n"
        "collectives: {algorithms: {all_reduse: ring}}\n"
    )
    with pytest.raises(ConfigErrors) as info:
        load_topology(path)
    assert [e.key_path for e in info.value.errors] == [
        "gpus_per_node",
        "intra_node.interconnect",
        "intra_node.bandwidth_gbps",
        "collectives.algorithms.all_reduse",
    ]


def test_a_misspelt_section_is_one_error(tmp_path: Path) -> None:
    path = tmp_path / "s.yaml"
    path.write_text(
        "cluster: {topology: dgx_h100}\nmodel: {preset: gpt3-1.3b}\ntrainin: {global_batch: 8}\n"
    )
    with pytest.raises(ConfigError) as info:
        load_scenario(path)
    assert str(info.value) == (
        f"{path}:3: training: missing required section; unknown key(s) here: 'trainin' at line 3"
    )


THREE = """\
name: three
cluster: {topology: dgx_h100, nodes: 1}
model: {preset: gpt3-125m, norm: batchnorm}
training: {global_batch: 64, micro_batch: 4}
parallel: {dp: 8, fsdp: {prefetch: -1}, zerro: 1}
"""


def test_three_distinct_errors_are_three_lines_and_exit_2(tmp_path: Path) -> None:
    """A choice, a range and an unknown key (with its near miss) in one file: three lines on
    stderr, in file order, nothing else, exit status 2; nothing is simulated."""
    path = tmp_path / "three.yaml"
    path.write_text(THREE)
    res = CliRunner().invoke(cli, ["run", str(path)])
    assert res.exit_code == 2, res.output
    lines = res.stderr.splitlines()
    assert len(lines) == 3, lines
    p = str(path)
    assert (
        lines[0] == f"error: {p}:3: model.norm: must be one of layernorm, rmsnorm; got 'batchnorm'"
    )
    assert lines[1] == f"error: {p}:5: parallel.fsdp.prefetch: must be >= 0, got -1"
    assert lines[2].startswith(f"error: {p}:5: parallel.zerro: unknown key (known keys here: ")
    assert lines[2].endswith("; did you mean 'zero'?")
    assert res.stdout == ""


def test_topology_unknown_keys_all_reported_with_hints(tmp_path: Path) -> None:
    path = tmp_path / "t.yaml"
    path.write_text(
        "name: t\ndevice: h100\ngpus_per_node: 8\n"
        "intra_node: {interconnect: nvswitch, bandwidth_gbps: 450, latency: 1}\n"
        "fabric: {kind: infiniband, shrap: true}\n"
        "collectives: {ops: {all_reduce: {overhead_us: 5, eficiency: 0.5}}}\n"
    )
    with pytest.raises(ConfigErrors) as info:
        load_topology(path)
    got = [(e.key_path, e.message.rsplit("; ", 1)[-1]) for e in info.value.errors]
    assert got == [
        ("intra_node.latency", "did you mean 'latency_us'?"),
        ("fabric.shrap", "did you mean 'sharp'?"),
        ("collectives.ops.all_reduce.eficiency", "did you mean 'efficiency'?"),
    ]


def test_inline_device_errors_are_located_in_the_topology(tmp_path: Path) -> None:
    path = tmp_path / "t.yaml"
    path.write_text(
        "name: t\ngpus_per_node: 8\nintra_node: {interconnect: nvswitch, bandwidth_gbps: 450}\n"
        "device:\n  name: X\n  peak_tflops: {bf16: -1}\n  mamf_tflops: fast\n"
        "  memory_gb: 80\n  memory_bandwidth_tbps: 3\n  generation: volta\n"
    )
    with pytest.raises(ConfigErrors) as info:
        load_topology(path)
    assert [str(e).removeprefix(str(path)) for e in info.value.errors] == [
        ":6: device.peak_tflops.bf16: must be > 0, got -1",
        ":7: device.mamf_tflops: must be a number or a mapping of dtype to TFLOP/s, got 'fast'",
        ":10: device.generation: must be one of ampere, hopper, blackwell, cdna3, cpu, generic; "
        "got 'volta'",
    ]


def test_set_errors_are_reported_together_at_their_overrides(tmp_path: Path) -> None:
    res = CliRunner().invoke(
        cli,
        [
            "run",
            str(REPO / "scenarios" / "ddp_gpt3_1.3b.yaml"),
            "--set",
            "parallel.ddp.bucket_mb=.nan",
            "--set",
            "training.stack=megatron",
            "--set",
            "stragglers.slow_gpu.ranks=[1, 1]",
        ],
    )
    assert res.exit_code == 2, res.output
    lines = res.stderr.splitlines()
    assert sorted(lines) == sorted(
        [
            "error: --set parallel.ddp.bucket_mb=.nan: parallel.ddp.bucket_mb: must be a finite "
            "number, got nan",
            "error: --set training.stack=megatron: training.stack: must be one of megatron_te, "
            "torchtitan, llm_foundry, fsdp, nemo_automodel, deepspeed; got 'megatron'",
            "error: --set stragglers.slow_gpu.ranks=[1, 1]: stragglers.slow_gpu.clock_factor: "
            "missing required key",
            "error: --set stragglers.slow_gpu.ranks=[1, 1]: stragglers.slow_gpu.ranks: names an "
            "entry twice: [1, 1]",
        ]
    )


def test_a_device_file_reports_every_error_at_once(tmp_path: Path) -> None:
    from collsim.cluster.hardware import load_device_file

    path = tmp_path / "dev.yaml"
    path.write_text(
        "name: X\npeak_tflops: {bf16: 100}\nmamf_tflops: {bf16: .inf}\n"
        "memory_gb: 0\nmemory_bandwidth_tbps: 3\nclocks: {boost: 1980}\n"
    )
    with pytest.raises(ConfigErrors) as info:
        load_device_file(path)
    assert [str(e).removeprefix(str(path)) for e in info.value.errors] == [
        ":3: mamf_tflops.bf16: must be a finite number, got inf",
        ":4: memory_gb: must be > 0, got 0",
        ":6: clocks.boost: unknown key (known keys here: boost_mhz, sustained_mhz); "
        "did you mean 'boost_mhz'?",
    ]


@pytest.mark.parametrize(
    ("key", "known", "hint"),
    [
        ("overlapp", ["bucket_mb", "first_bucket_mb", "overlap"], "overlap"),
        ("bucket", ["bucket_mb", "first_bucket_mb", "overlap"], "bucket_mb"),
        ("boost", ["boost_mhz", "sustained_mhz"], "boost_mhz"),
        ("zerro", ["dp", "pp", "tp", "zero"], "zero"),
        ("colour", ["count", "efficiency", "latency_us", "rate_gbit"], None),
        ("bucket_mb", ["dp", "ddp", "pp", "tp", "zero"], None),
        ("p", ["pp", "tp"], None),
    ],
)
def test_did_you_mean_only_where_a_key_is_close(
    key: str, known: list[str], hint: str | None
) -> None:
    from collsim.core.yamlio import closest_key, unknown_key_message

    assert closest_key(key, known) == hint
    message = unknown_key_message(key, known)
    assert message.startswith(f"unknown key (known keys here: {', '.join(sorted(known))})")
    assert message.endswith(f"; did you mean {hint!r}?" if hint else ")")
