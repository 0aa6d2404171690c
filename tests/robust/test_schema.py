"""One schema (collsim/schema.py) checks files with every error at once and is the JSON Schema."""

from __future__ import annotations

import json
from pathlib import Path

import jsonschema
import pytest
import yaml
from click.testing import CliRunner

from collsim.cli import cli
from collsim.errors import ConfigError, ConfigErrors
from collsim.scenario import load_scenario
from collsim.schema import SCENARIO, TOPOLOGY, Section
from collsim.topology import load_topology

REPO = Path(__file__).resolve().parents[2]
SCENARIOS = sorted((REPO / "scenarios").rglob("*.yaml"))
TOPOLOGIES = sorted((REPO / "topologies").glob("*.yaml"))



def _schema(kind: str) -> dict:
    res = CliRunner().invoke(cli, ["schema", kind])
    assert res.exit_code == 0, res.output
    schema = json.loads(res.stdout)
    jsonschema.Draft202012Validator.check_schema(schema)
    return schema


@pytest.mark.parametrize("path", SCENARIOS, ids=lambda p: p.name)
def test_schema_validates_every_shipped_scenario(path: Path) -> None:
    jsonschema.validate(yaml.safe_load(path.read_text()), _schema("scenario"))


@pytest.mark.parametrize("path", TOPOLOGIES, ids=lambda p: p.name)
def test_schema_validates_every_shipped_topology(path: Path) -> None:
    jsonschema.validate(yaml.safe_load(path.read_text()), _schema("topology"))


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


def _reader_keys(loader, text: str, section: tuple[str, ...]) -> set[str]:
    """The keys a loader knows in one mapping, from its unknown-key message (schema off)."""
    import collsim.schema as schema_module

    saved = schema_module.check
    schema_module.check = lambda doc, schema: []  # type: ignore[assignment]
    try:
        with pytest.raises(ConfigError) as info:
            loader(text)
    finally:
        schema_module.check = saved
    message = str(info.value)
    assert "known keys here: " in message, message
    return set(message.split("known keys here: ")[1].rstrip(")").split(", "))


def _section(schema: Section, path: tuple[str, ...]) -> Section:
    for part in path:
        sub = schema.fields[part]
        assert isinstance(sub, Section)
        schema = sub
    return schema


@pytest.mark.parametrize(
    "path",
    [(), ("cluster",), ("model",), ("training",), ("parallel",), ("parallel", "ddp"),
     ("parallel", "fsdp")],
    ids=lambda p: ".".join(p) or "root",
)  # fmt: skip
def test_schema_knows_the_keys_the_scenario_loader_knows(
    path: tuple[str, ...], tmp_path: Path
) -> None:
    from collsim.scenario import scenario_from_doc
    from collsim.yamlio import parse_yaml_text

    data = yaml.safe_load((REPO / "scenarios" / "ddp_gpt3_1.3b.yaml").read_text())
    node = data
    for part in path:
        node = node.setdefault(part, {})
    node["zz_not_a_key"] = 1
    text = yaml.safe_dump(data)
    known = _reader_keys(lambda t: scenario_from_doc(parse_yaml_text(t, "s.yaml")), text, path)
    assert known - {"zz_not_a_key"} == set(_section(SCENARIO, path).fields)


@pytest.mark.parametrize(
    "path",
    [(), ("intra_node",), ("nics",), ("fabric",), ("host",), ("collectives",)],
    ids=lambda p: ".".join(p) or "root",
)
def test_schema_knows_the_keys_the_topology_loader_knows(path: tuple[str, ...]) -> None:
    from collsim.topology import parse_topology
    from collsim.yamlio import parse_yaml_text

    data = yaml.safe_load((REPO / "topologies" / "dgx_h100.yaml").read_text())
    node = data
    for part in path:
        node = node.setdefault(part, {})
    node["zz_not_a_key"] = 1
    text = yaml.safe_dump(data)
    known = _reader_keys(lambda t: parse_topology(parse_yaml_text(t, "t.yaml")), text, path)
    assert known - {"zz_not_a_key"} == set(_section(TOPOLOGY, path).fields)
