"""One description per key: the readers read through it and the JSON Schema is written from it.

A key added to a description is checked, read (type, range, choices, default, unit, the name it
takes in the built object) and listed in the JSON Schema, with nothing else to edit; every scalar
key of the shipped descriptions reaches the object its reader builds; a bad value is one line
naming the file, the key path, the value and the rule, with exit code 2.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Any

import jsonschema
import pytest
import yaml
from click.testing import CliRunner

from collsim.cli import cli
from collsim.cluster import kernel_tables
from collsim.cluster.hardware import DEVICE, device_from_reader
from collsim.cluster.kernel_tables import MEASURED
from collsim.cluster.topology import TOPOLOGY, parse_topology
from collsim.core.errors import ConfigError
from collsim.core.schema import (
    Either,
    ListOf,
    Section,
    Value,
    check,
    choice_value,
    choices_of,
    defaults_of,
    non_negative_value,
    positive_value,
    read_described,
    read_value,
    scaled,
    values_of,
)
from collsim.core.schema_json import json_schema
from collsim.core.units import US, gbps_to_bps
from collsim.core.vocab import FabricKind
from collsim.core.yamlio import ConfigReader, YamlDoc, parse_yaml_text

REPO = Path(__file__).resolve().parents[2]
H100_TOPOLOGY = REPO / "topologies" / "dgx_h100.yaml"
H100_DEVICE = REPO / "collsim" / "data" / "devices" / "h100.yaml"
DDP = REPO / "scenarios" / "ddp_gpt3_1.3b.yaml"

# -- a key added to a description ------------------------------------------------------------------


@dataclasses.dataclass(frozen=True, kw_only=True)
class _Link:
    bandwidth_bps: float
    kind: FabricKind
    latency_s: float
    lanes: tuple[int, ...] = ()


_LINK = Section(
    description="A link.",
    fields={
        "bandwidth_gbps": positive_value(
            "number", "GB/s.", required=True, field="bandwidth_bps", convert=gbps_to_bps
        ),
        "kind": choice_value(
            "Transport.", values_of(FabricKind), default="fat_tree", convert=FabricKind
        ),
        "latency_us": non_negative_value(
            "number", "Microseconds.", default=0.5, field="latency_s", convert=scaled(US)
        ),
    },
)

_LANES = ListOf(
    items=non_negative_value("integer", "A lane."),
    description="Lanes in use.",
    unique=True,
)


def _doc(text: str) -> YamlDoc:
    return parse_yaml_text(text, "link.yaml")


def _read(doc: YamlDoc, spec: Section) -> _Link:
    reader = ConfigReader(doc.data, doc=doc)
    values = read_described(reader, spec)
    reader.finish()
    return _Link(**values)


def test_a_key_added_to_a_description_is_checked_read_and_in_the_json_schema() -> None:
    text = "bandwidth_gbps: 25\nkind: roce\nlanes: [0, 3]\n"
    # before: the key is unknown to the checker and to the reader
    assert [e.message for e in check(_doc(text), _LINK)] == [
        "unknown key (known keys here: bandwidth_gbps, kind, latency_us)"
    ]
    with pytest.raises(ConfigError, match="lanes: unknown key"):
        _read(_doc(text), _LINK)
    assert "lanes" not in json_schema("link", _LINK)["properties"]

    # after: one entry in the description, nothing else
    with_lanes = dataclasses.replace(_LINK, fields={**_LINK.fields, "lanes": _LANES})
    assert check(_doc(text), with_lanes) == []
    link = _read(_doc(text), with_lanes)
    assert link == _Link(
        bandwidth_bps=25 * 1e9, kind=FabricKind.ROCE, latency_s=0.5 * US, lanes=(0, 3)
    )
    schema = json_schema("link", with_lanes)
    jsonschema.Draft202012Validator.check_schema(schema)
    assert schema["properties"]["lanes"] == {
        "type": ["array", "null"],
        "description": "Lanes in use.",
        "items": {"type": "integer", "description": "A lane.", "minimum": 0},
        "uniqueItems": True,
    }
    assert schema["properties"]["latency_us"]["default"] == 0.5
    assert schema["required"] == ["bandwidth_gbps"]
    jsonschema.validate(yaml.safe_load(text), schema)
    for bad in ("lanes: [1, 1]", "lanes: [-1]", "kind: token_ring", "latency_us: -2"):
        data = yaml.safe_load(f"bandwidth_gbps: 25\n{bad}\n")
        assert not jsonschema.Draft202012Validator(schema).is_valid(data), bad
        assert len(check(_doc(f"bandwidth_gbps: 25\n{bad}\n"), with_lanes)) == 1, bad


def test_the_reader_applies_the_description_s_rules_with_its_messages() -> None:
    """Read without :func:`check` first (the device catalogue is read so), a value out of
    range or choice gets the message check() gives, at the key's path."""
    for text, key in (
        ("bandwidth_gbps: 0\n", "bandwidth_gbps"),
        ("bandwidth_gbps: 1\nkind: token_ring\n", "kind"),
        ("bandwidth_gbps: 1\nlatency_us: -1\n", "latency_us"),
        ("bandwidth_gbps: true\n", "bandwidth_gbps"),
    ):
        (expected,) = check(_doc(text), _LINK)
        with pytest.raises(ConfigError) as caught:
            _read(_doc(text), _LINK)
        assert str(caught.value) == str(expected)
        assert caught.value.key_path == key
    # absent: the default, in the file's unit, converted; absent without a default: left out
    reader = ConfigReader({"bandwidth_gbps": 2})
    assert read_value(reader, "latency_us", _LINK.fields["latency_us"]) == 0.5 * US  # type: ignore[arg-type]
    assert "lanes" not in read_described(
        ConfigReader({"bandwidth_gbps": 2}),
        dataclasses.replace(_LINK, fields={**_LINK.fields, "lanes": _LANES}),
    )
    # null is absent: the default, and the key counts as read
    reader = ConfigReader({"bandwidth_gbps": 2, "latency_us": None, "kind": None})
    assert read_described(reader, _LINK) == {
        "bandwidth_bps": 2e9,
        "kind": FabricKind.FAT_TREE,
        "latency_s": 0.5 * US,
    }
    reader.finish()


# -- every shipped description reaches its object ----------------------------------------------


def _variant(spec: Value, current: Any) -> Any:
    """A valid file value of ``spec`` whose read value differs from ``current`` where it can."""
    convert = spec.convert or (lambda v: v)
    if spec.enum is not None:
        choices = choices_of(spec.enum)
        return next((c for c in choices if convert(c) != current), choices[0])
    if spec.kind == "boolean":
        return not current
    if spec.kind == "string":
        return "renamed"
    if spec.maximum is not None:
        candidates: tuple[float, ...] = (spec.maximum / 2, spec.maximum / 4)
    else:
        candidates = (3, 5) if spec.kind == "integer" else (2.5, 3.5)
    return next((c for c in candidates if convert(c) != current), candidates[0])


def _scalar_keys(spec: Section, path: tuple[str, ...] = ()) -> list[tuple[tuple[str, ...], Value]]:
    out: list[tuple[tuple[str, ...], Value]] = []
    for key, sub in spec.fields.items():
        if isinstance(sub, Value):
            out.append(((*path, key), sub))
        elif isinstance(sub, Section) and sub.values is None:
            out += _scalar_keys(sub, (*path, key))
    return out


def _set(data: dict[str, Any], path: tuple[str, ...], value: Any) -> None:
    for key in path[:-1]:
        data = data.setdefault(key, {})
    data[path[-1]] = value


#: Keys whose value the reader works out with other keys (the rules between keys stay there)
#: or does not keep: each is read by :func:`read_described` like the others.
_TOPOLOGY_RULES: set[tuple[str, ...]] = {
    ("description",),
    ("fabric", "net_latency_us"),
    ("fabric", "net_simple_latency_us"),
    ("fabric", "completion_us"),
    ("fabric", "platform"),
}
_DEVICE_RULES: set[tuple[str, ...]] = {("description",), ("key",)}
_MEASURED = "measured"
"""The device's kernel tables: read by collsim.cluster.kernel_tables.MeasuredTables.from_reader
through the same description (test_a_measured_key_is_described_checked_read_and_in_the_schema)."""


def _topology_part(topology: Any, section: tuple[str, ...]) -> Any:
    return {
        (): topology,
        ("intra_node",): topology.intra,
        ("nics",): topology.nics,
        ("fabric",): topology.fabric,
        ("host",): topology,
        ("collectives",): topology.collectives,
    }[section]


@pytest.mark.parametrize("kind", ["topology", "device"])
def test_every_scalar_key_reaches_the_object_its_reader_builds(kind: str) -> None:
    if kind == "topology":
        spec, path, rules = TOPOLOGY, H100_TOPOLOGY, _TOPOLOGY_RULES

        def build(data: dict[str, Any]) -> Any:
            return parse_topology(parse_yaml_text(yaml.safe_dump(data), "t.yaml"))

        def part(obj: Any, section: tuple[str, ...]) -> Any:
            return _topology_part(obj, section)

    else:
        spec, path, rules = DEVICE, H100_DEVICE, _DEVICE_RULES

        def build(data: dict[str, Any]) -> Any:
            doc = parse_yaml_text(yaml.safe_dump(data), "d.yaml")
            assert check(doc, DEVICE) == []
            return device_from_reader(ConfigReader(doc.data, doc=doc), "d", "d.yaml")

        def part(obj: Any, section: tuple[str, ...]) -> Any:
            return obj

    base_data = yaml.safe_load(path.read_text())
    base = build(base_data)
    reached = []
    for key_path, value_spec in _scalar_keys(spec):
        if key_path in rules or key_path[0] == _MEASURED:
            continue
        attr = value_spec.field or key_path[-1]
        current = getattr(part(base, key_path[:-1]), attr)
        value = _variant(value_spec, current)
        data = yaml.safe_load(path.read_text())
        _set(data, key_path, value)
        built = getattr(part(build(data), key_path[:-1]), attr)
        expected = value_spec.convert(value) if value_spec.convert else value
        assert built == expected, (key_path, value, built)
        reached.append(key_path)
    assert len(reached) >= {"topology": 25, "device": 10}[kind]


def _device(data: dict[str, Any]) -> Any:
    """The device of ``data`` as a device file, read without :func:`check` first (as the
    catalogue is read)."""
    doc = parse_yaml_text(yaml.safe_dump(data), "d.yaml")
    return device_from_reader(ConfigReader(doc.data, doc=doc), "d", "d.yaml")


def test_a_measured_key_is_described_checked_read_and_in_the_schema(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    base = yaml.safe_load(H100_DEVICE.read_text())
    assert DEVICE.fields["measured"] is MEASURED
    # every scalar key of the description reaches the tables: a field of its own or ``extra``
    reached = []
    for (key,), spec in _scalar_keys(MEASURED):
        value = _variant(spec, spec.default)
        tables = _device({**base, "measured": {key: value}}).measured
        got = getattr(tables, key) if hasattr(tables, key) else tables.extra[key]
        assert got == value, (key, value, got)
        reached.append(key)
    assert len(reached) == 6
    # the tables are lists of rows; a row's shape is a rule of the reader
    rows = {"gemm": [[64, 64, 64, "bf16", 1e12]], "bandwidth": [[1024, 5e9]]}
    tables = _device({**base, "measured": rows}).measured
    assert tables.gemm == ((64, 64, 64, "bf16", 1e12),) and tables.bandwidth == ((1024.0, 5e9),)
    with pytest.raises(ConfigError, match="measured: malformed table row"):
        _device({**base, "measured": {"gemm": [[64, 64]]}})
    # absent, a key reads as the description's default, or by the rule between keys
    tables = _device({**base, "measured": {"concurrent_slowdown": 1.5}}).measured
    assert tables.extra["concurrent_memory_slowdown"] == 1.5
    assert _device({**base, "measured": {}}).measured.extra["concurrent_slowdown"] == 1.0
    # a bad value: the checker and the reader give the same line, at the same key path
    for bad, message in (
        ({"gemm_reach": 1}, "must be > 1, got 1"),
        ({"concurrent_memory_slowdown": 0.5}, "must be >= 1, got 0.5"),
        ({"launch_us": "fast"}, "must be a number, got 'fast'"),
    ):
        ((key, _),) = bad.items()
        doc = parse_yaml_text(yaml.safe_dump({**base, "measured": bad}), "d.yaml")
        (expected,) = check(doc, DEVICE)
        assert expected.key_path == f"measured.{key}" and expected.message == message
        with pytest.raises(ConfigError) as caught:
            device_from_reader(ConfigReader(doc.data, doc=doc), "d", "d.yaml")
        assert str(caught.value) == str(expected)
    # in the JSON Schema, with its range and default
    schema = json_schema("device", DEVICE)
    measured = schema["properties"]["measured"]["properties"]
    assert measured["gemm_reach"]["exclusiveMinimum"] == 1
    assert measured["concurrent_slowdown"]["default"] == 1.0
    validator = jsonschema.Draft202012Validator(schema)
    assert validator.is_valid({**base, "measured": {"gemm_reach": 2}})
    assert not validator.is_valid({**base, "measured": {"gemm_reach": 1}})
    # a key added to the description is checked, read and listed with nothing else to edit
    spec = non_negative_value("number", "A new figure.")
    with_new = dataclasses.replace(MEASURED, fields={**MEASURED.fields, "new_figure": spec})
    monkeypatch.setattr(kernel_tables, "MEASURED", with_new)
    tables = _device({**base, "measured": {"new_figure": 2}}).measured
    assert tables.extra["new_figure"] == 2.0
    with pytest.raises(ConfigError, match="measured.new_figure: must be >= 0, got -1"):
        _device({**base, "measured": {"new_figure": -1}})
    assert "new_figure" in json_schema("measured", with_new)["properties"]


#: Scenario keys that need another key to be read at all (the rules between keys), and the
#: value each is given where the generated one breaks such a rule.
_COMPANIONS = {
    "training.fp8_recipe": ["training.dtype=fp8"],
    "training.fp8_weight_cache": ["training.stack=megatron_te"],
    "parallel.virtual_stages": ["parallel.schedule=interleaved"],
    "parallel.routing_nodes": ["parallel.routing=node_limited"],
    "model.kv_lora_rank": ["model.qk_nope_head_dim=128", "model.v_head_dim=128"],
}
_VALUES = {"model.hidden": 4096, "model.heads": 32, "model.kv_heads": 4}


def test_every_cluster_model_training_and_parallel_key_reaches_the_scenario() -> None:
    from collsim.study.scenario import SCENARIO, load_scenario

    base = load_scenario(DDP)
    parts = {
        ("cluster",): lambda s: s.cluster,
        ("model",): lambda s: s.model,
        ("training",): lambda s: s.training,
        ("parallel",): lambda s: s.parallel,
        ("parallel", "ddp"): lambda s: s.parallel.ddp,
        ("parallel", "fsdp"): lambda s: s.parallel.fsdp,
    }
    reached = []
    for key_path, value_spec in _scalar_keys(SCENARIO):
        section, dotted = key_path[:-1], ".".join(key_path)
        if section not in parts or key_path in {("model", "preset"), ("model", "hf_config")}:
            continue
        attr = value_spec.field or key_path[-1]
        value = _VALUES.get(dotted, _variant(value_spec, getattr(parts[section](base), attr)))
        # a mixture-of-experts key needs experts; the others do not mind them
        extra = [
            *_COMPANIONS.get(dotted, []),
            *(["model.experts=8"] if section == ("model",) else []),
        ]
        if dotted == "model.experts":
            extra = []
        scenario = load_scenario(DDP, [*extra, f"{dotted}={json.dumps(value)}"])
        built = getattr(parts[section](scenario), attr)
        assert built == value or str(built) == str(value), (dotted, value, built)
        reached.append(key_path)
    assert len(reached) >= 70


# -- errors: file, key path, value, rule; exit code 2 ------------------------------------------


def _scenario_with(tmp_path: Path, extra: str, **files: str) -> Path:
    for name, text in files.items():
        (tmp_path / name).write_text(text)
    path = tmp_path / "s.yaml"
    path.write_text(DDP.read_text() + extra)
    return path


def _topology_with(extra: str) -> str:
    return H100_TOPOLOGY.read_text().replace("fabric:\n", f"fabric:\n{extra}", 1)


@pytest.mark.parametrize(
    ("extra", "files", "line"),
    # line: {n} is the line of the extra text it names, counted from the end of the base file
    [
        (
            "stragglers:\n  slow_gpu: {ranks: [1], clock_factor: 1.5}\n",
            {},
            "s.yaml:{n+2}: stragglers.slow_gpu.clock_factor: must be in [0.001, 1] "
            "(1 = full speed), got 1.5",
        ),
        (
            "reliability:\n  components: {gpu: {mtbf_hours: 5, replace_fraction: 2}}\n"
            "  storage: {write_bandwidth_gbps: 10}\n",
            {},
            "s.yaml:{n+2}: reliability.components.gpu.replace_fraction: must be in 0..1, got 2",
        ),
        (
            "reliability:\n  components: {gpu: {mtbf_hours: 5}}\n  spares: {nodes: 4}\n"
            "  storage: {write_bandwidth_gbps: 10}\n",
            {},
            "s.yaml:{n+3}: reliability.spares.repair_hours: missing required key (needed when "
            "spares.nodes is set)",
        ),
    ],
)
def test_a_bad_scenario_key_is_one_line_with_exit_code_2(
    tmp_path: Path, extra: str, files: dict[str, str], line: str
) -> None:
    path = _scenario_with(tmp_path, extra, **files)
    result = CliRunner().invoke(cli, ["run", str(path)])
    assert result.exit_code == 2, result.output
    (got,) = result.output.strip().splitlines()
    assert got.startswith(f"error: {tmp_path}/"), got
    named = line.split(":", 2)[1]
    n = len(DDP.read_text().splitlines()) + int(named.strip("{}n+") or 0)
    assert got.removeprefix(f"error: {tmp_path}/") == line.replace(named, str(n)), got


@pytest.mark.parametrize(
    ("where", "text", "message"),
    [
        (
            "t.yaml",
            H100_TOPOLOGY.read_text().replace("oversubscription: 1.0", "oversubscription: 0.5", 1),
            "fabric.oversubscription: must be >= 1 (1 = non-blocking), got 0.5",
        ),
        (
            "t.yaml",
            _topology_with("  completion_us: 3\n  net_simple_latency_us: 4\n"),
            "fabric.completion_us: give completion_us or net_simple_latency_us, not both",
        ),
        (
            "d.yaml",
            H100_DEVICE.read_text().replace("memory_gb: 80", "memory_gb: -80", 1),
            "memory_gb: must be > 0, got -80",
        ),
        (
            "d.yaml",
            H100_DEVICE.read_text() + "measured:\n  gemm_reach: 1\n",
            "measured.gemm_reach: must be > 1, got 1",
        ),
        (
            "d.yaml",
            H100_DEVICE.read_text().replace("generation: hopper", "generation: volta", 1),
            "generation: must be one of ampere, hopper, blackwell, cdna3, cpu, generic; "
            "got 'volta'",
        ),
    ],
)
def test_a_bad_topology_or_device_key_names_its_own_file(
    tmp_path: Path, where: str, text: str, message: str
) -> None:
    (tmp_path / where).write_text(text)
    if where == "t.yaml":
        cluster = f"cluster: {{topology: {tmp_path / where}, nodes: 1}}"
    else:
        cluster = f"cluster: {{topology: dgx_h100, nodes: 1, device: {tmp_path / where}}}"
    path = tmp_path / "s.yaml"
    path.write_text(DDP.read_text().replace("cluster: {topology: dgx_h100, nodes: 1}", cluster, 1))
    result = CliRunner().invoke(cli, ["run", str(path)])
    assert result.exit_code == 2, result.output
    (got,) = result.output.strip().splitlines()
    assert got.startswith(f"error: {tmp_path / where}:"), got
    assert got.endswith(f": {message}"), got
    line = int(got.removeprefix(f"error: {tmp_path / where}:").split(":", 1)[0])
    assert text.splitlines()[line - 1].strip().startswith(message.split(":")[0].split(".")[-1])


def _sections(spec: Any) -> list[Section]:
    """Every mapping of named keys below ``spec`` (an either-or's mapping option too)."""
    if isinstance(spec, Section):
        subs = list(spec.fields.values()) + ([spec.values] if spec.values is not None else [])
        return ([spec] if spec.fields else []) + [s for sub in subs for s in _sections(sub)]
    if isinstance(spec, Either):
        return [s for option in spec.options for s in _sections(option)]
    return []


@pytest.mark.parametrize("kind", ["scenario", "topology", "device"])
def test_every_default_the_json_schema_lists_is_valid_and_is_what_an_absent_key_reads_as(
    kind: str,
) -> None:
    from collsim.study.scenario import SCENARIO

    root = {"scenario": SCENARIO, "topology": TOPOLOGY, "device": DEVICE}[kind]
    count = 0
    for section in _sections(root):
        for key, default in defaults_of(section).items():
            spec = section.fields[key]
            assert check(YamlDoc(data={key: default}, file="d"), Section(fields={key: spec})) == []
            properties = json_schema(kind, section)["properties"]
            assert properties[key]["default"] == default
            jsonschema.validate({key: default}, {"properties": {key: properties[key]}})
            # absent, the key reads as its default: the description's, converted, or the
            # built object's own
            read = read_value(ConfigReader({}), key, spec)  # type: ignore[arg-type]
            name = spec.field or key  # type: ignore[union-attr]
            if section.builds is None or spec.default is not None:  # type: ignore[union-attr]
                convert = spec.convert or (lambda v: v)  # type: ignore[union-attr]
                assert read == convert(default)
            else:
                built = next(f for f in dataclasses.fields(section.builds) if f.name == name)
                assert read is None
                assert getattr(built.default, "value", built.default) == default
            count += 1
    assert count >= {"scenario": 35, "topology": 17, "device": 1}[kind]
