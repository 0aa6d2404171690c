"""The descriptions (SCENARIO, TOPOLOGY, DEVICE) and the readers know the same keys, both ways.

The training, parallel, ddp, fsdp, cluster, model and stragglers readers take their keys from
SCENARIO itself (collsim.core.schema.read_described); the others (reliability, topology, device)
still list their own, which this test holds equal to the descriptions.

- Every key of every shipped scenario, topology and device file is a key of the schema.
- For every key of the schema, an example document that uses it (generated from the schema,
  starting from a shipped file) passes :func:`collsim.core.schema.check` and the JSON Schema, and
  the reader, with the schema check switched off, reads it: a bogus key put beside it is the
  reader's first error (so the reader reached the end of that mapping and found the schema's
  key known). The reader's list of the keys it knows there must be a subset of the schema's.
- For every scalar key of the schema, a value of the wrong type is rejected by both
  :func:`~collsim.core.schema.check` (at that key) and the JSON Schema.

A key added to a reader and not to the schema fails the first or the second test (the
schema rejects it in a shipped file, or the reader's known keys are not the schema's); a key
listed in the schema that no reader reads fails the second.
"""

from __future__ import annotations

import copy
import functools
import json
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import jsonschema
import pytest
import yaml

import collsim.cluster.hardware
import collsim.cluster.topology
import collsim.study.scenario
from collsim.cluster.hardware import DEVICE
from collsim.cluster.topology import TOPOLOGY
from collsim.core.errors import ConfigError
from collsim.core.schema import (
    Anything,
    Either,
    ListOf,
    Section,
    Spec,
    Value,
    check,
    choices_of,
    json_schema,
)
from collsim.core.yamlio import ConfigReader, YamlDoc, parse_yaml_text
from collsim.study.scenario import SCENARIO

REPO = Path(__file__).resolve().parents[2]
BOGUS = "zz_not_a_key"
HF_CONFIG = REPO / "scenarios" / "hf" / "mixtral-8x7b" / "config.json"

Path_ = tuple[str, ...]

# -- the schema, walked --------------------------------------------------------------------------


def _free_key(spec: Section) -> str:
    """A key a ``values`` mapping accepts (its first allowed key; ``bf16`` for dtype maps)."""
    return str(choices_of(spec.keys)[0]) if spec.keys is not None else "bf16"


def example(spec: Spec) -> Any:
    """A valid value of ``spec``: its first choice, the low end of its range, ``false``; for a
    mapping, its required keys (and the first alternative of its required groups)."""
    if isinstance(spec, Anything):
        return {}
    if isinstance(spec, Either):
        return example(spec.options[0])
    if isinstance(spec, ListOf):
        return [] if spec.items is None else [example(spec.items)]
    if isinstance(spec, Value):
        if spec.enum is not None:
            return choices_of(spec.enum)[0]
        if spec.json_choices is not None:
            return list(spec.json_choices())[0]
        if spec.kind == "boolean":
            return False
        if spec.kind == "string":
            return "x"
        if spec.maximum is not None:
            return spec.maximum
        if spec.exclusive_minimum is not None:
            return spec.exclusive_minimum + 1
        return spec.minimum if spec.minimum is not None else 1
    if spec.values is not None:
        return {_free_key(spec): example(spec.values)}
    out = {k: example(sub) for k, sub in spec.fields.items() if sub.required}
    for group in spec.one_of_required[:1]:
        out.update({k: example(spec.fields[k]) for k in group})
    for key in spec.exactly_one[:1]:
        out[key] = example(spec.fields[key])
    return out


def leaves(spec: Section, path: Path_ = ()) -> Iterator[tuple[Path_, tuple[Spec, ...]]]:
    """Every key of the schema below ``spec``: (key path, the spec of each step of it). A
    mapping key is yielded too; an Either with a mapping option is also walked into."""
    items: list[tuple[str, Spec]]
    if spec.values is not None:
        items = [(_free_key(spec), spec.values)]
    else:
        items = list(spec.fields.items())
    for key, sub in items:
        here = path + (key,)
        yield here, (sub,)
        options = sub.options if isinstance(sub, Either) else (sub,)
        for option in options:
            if isinstance(option, Section):
                for deeper, chain in leaves(option, here):
                    yield deeper, (option, *chain)


def _with(data: dict[str, Any], path: Path_, chain: tuple[Spec, ...], value: Any) -> None:
    """Write ``value`` at ``path``, creating (or replacing with an example) each mapping on
    the way that the path goes through."""
    node = data
    for key, spec in zip(path[:-1], chain[:-1], strict=True):
        child = node.get(key)
        if not isinstance(child, dict):
            child = node[key] = example(spec)
        node = child
    node[path[-1]] = value


def _chain(root: Section, path: Path_) -> tuple[Spec, ...]:
    for leaf, chain in leaves(root):
        if leaf == path:
            return chain
    raise KeyError(path)


# Keys whose reader needs a companion key, or another base, to read them at all (the rules
# between keys that the readers check before they reach the end of the mapping).
FIXUPS: dict[Path_, Callable[[dict[str, Any]], None]] = {
    ("model", "hf_config"): lambda d: (
        d["model"].pop("preset", None),
        d["model"].__setitem__("hf_config", str(HF_CONFIG)),
    ),
    ("reliability", "components", "gpu", "per_1000_node_days"): lambda d: d["reliability"][
        "components"
    ]["gpu"].pop("mtbf_hours"),
    ("reliability", "spares", "nodes"): lambda d: d["reliability"]["spares"].setdefault(
        "repair_hours", 1
    ),
    ("collectives", "ops", "all_reduce", "knee_bytes"): lambda d: d["collectives"]["ops"][
        "all_reduce"
    ].setdefault("knee_efficiency", 1),
    ("collectives", "ops", "all_reduce", "knee_efficiency"): lambda d: d["collectives"]["ops"][
        "all_reduce"
    ].setdefault("knee_bytes", 0),
}


# -- the readers, with the schema check switched off ---------------------------------------------


def _read_scenario(doc: YamlDoc) -> None:
    from collsim.study.scenario import scenario_from_doc

    scenario_from_doc(doc)


def _read_topology(doc: YamlDoc) -> None:
    from collsim.cluster.topology import parse_topology

    parse_topology(doc)


def _read_device(doc: YamlDoc) -> None:
    from collsim.cluster.hardware import device_from_reader

    device_from_reader(ConfigReader(doc.data, doc=doc), "x", doc.file)


KINDS: dict[str, tuple[Section, Path, Callable[[YamlDoc], None]]] = {
    "scenario": (SCENARIO, REPO / "scenarios" / "ddp_gpt3_1.3b.yaml", _read_scenario),
    "topology": (TOPOLOGY, REPO / "topologies" / "dgx_h100.yaml", _read_topology),
    "device": (DEVICE, REPO / "collsim" / "data" / "devices" / "h100.yaml", _read_device),
}


def _reader_error(kind: str, data: dict[str, Any], monkeypatch: pytest.MonkeyPatch) -> Any:
    """The reader's first error on ``data`` with the schema check off (None: it read it)."""
    _, _, read = KINDS[kind]
    doc = parse_yaml_text(yaml.safe_dump(data, sort_keys=False), f"{kind}.yaml")
    with monkeypatch.context() as m:
        for reader in (collsim.study.scenario, collsim.cluster.topology, collsim.cluster.hardware):
            m.setattr(reader, "check", lambda doc, schema: [])
        try:
            read(doc)
        except ConfigError as exc:
            return exc
    return None


@functools.cache
def _validator(kind: str) -> jsonschema.Draft202012Validator:
    return jsonschema.Draft202012Validator(
        json.loads(json.dumps(json_schema(kind, KINDS[kind][0])))
    )


def _check(kind: str, data: dict[str, Any]) -> list[str]:
    root, _, _ = KINDS[kind]
    doc = parse_yaml_text(yaml.safe_dump(data, sort_keys=False), f"{kind}.yaml")
    return [str(e) for e in check(doc, root)]


def _base(kind: str) -> dict[str, Any]:
    data = yaml.safe_load(KINDS[kind][1].read_text())
    assert isinstance(data, dict)
    return data


def _spec_at(root: Section, path: tuple[Any, ...]) -> Spec | None:
    """The schema of ``path`` (None: the schema has no such key)."""
    spec: Spec = root
    for key in path:
        if isinstance(spec, Either):
            spec = next((o for o in spec.options if isinstance(o, Section)), spec)
        if not isinstance(spec, Section):
            return spec if isinstance(spec, Anything) else None
        if spec.values is not None:
            if spec.keys is not None and key not in choices_of(spec.keys):
                return None
            spec = spec.values
        elif key in spec.fields:
            spec = spec.fields[key]
        else:
            return None
    return spec


def _key_paths(data: Any, path: tuple[Any, ...] = ()) -> Iterator[tuple[Any, ...]]:
    if isinstance(data, dict):
        for key, value in data.items():
            yield path + (key,)
            yield from _key_paths(value, path + (key,))


def _shipped() -> list[tuple[str, Path]]:
    out = [("scenario", p) for p in sorted((REPO / "scenarios").rglob("*.yaml"))]
    out += [("topology", p) for p in sorted((REPO / "topologies").glob("*.yaml"))]
    out += [("topology", p) for p in sorted((REPO / "collsim/data/topologies").glob("*.yaml"))]
    out += [("device", p) for p in sorted((REPO / "collsim/data/devices").glob("*.yaml"))]
    out += [("device", p) for p in sorted((REPO / "validate/data").glob("*profile*.yaml"))]
    return out


# -- tests ---------------------------------------------------------------------------------------


def test_every_key_of_every_shipped_file_is_a_schema_key() -> None:
    files = _shipped()
    assert len(files) >= 60
    unknown = []
    for kind, path in files:
        data = yaml.safe_load(path.read_text())
        for key_path in _key_paths(data):
            if _spec_at(KINDS[kind][0], key_path) is None:
                unknown.append(f"{path.relative_to(REPO)}: {'.'.join(map(str, key_path))}")
    assert unknown == []


@pytest.mark.parametrize("kind", list(KINDS))
def test_every_schema_key_is_read_by_its_reader(kind: str, monkeypatch: pytest.MonkeyPatch) -> None:
    root, _, _ = KINDS[kind]
    problems: list[str] = []
    count = 0
    for path, chain in leaves(root):
        count += 1
        dotted = ".".join(path)
        data = _base(kind)
        _with(data, path, chain, example(chain[-1]))
        if path in FIXUPS:
            FIXUPS[path](data)
        # the example is valid for check() and for the JSON Schema
        errors = _check(kind, data)
        if errors:
            problems.append(f"{dotted}: check() rejects its example: {errors}")
            continue
        json_errors = [e.message for e in _validator(kind).iter_errors(data)]
        if json_errors:
            problems.append(f"{dotted}: the JSON Schema rejects its example: {json_errors}")
            continue
        # a bogus key beside it is the reader's first error: the reader read this key
        parent = path[:-1]
        parent_spec = _spec_at(root, parent) if parent else root
        if isinstance(parent_spec, Either):
            parent_spec = next(o for o in parent_spec.options if isinstance(o, Section))
        assert isinstance(parent_spec, Section), dotted
        if parent_spec.values is not None and parent_spec.keys is None:
            continue  # a free mapping (peak_tflops: any dtype): nothing is unknown there
        node = data
        for key in parent:
            node = node[key]
        node[BOGUS] = copy.deepcopy(node[path[-1]])
        error = _reader_error(kind, data, monkeypatch)
        bogus_path = ".".join((*parent, BOGUS))
        if error is None or error.key_path != bogus_path:
            problems.append(f"{dotted}: the reader's first error is not the bogus key: {error}")
            continue
        # the keys the reader knows there are keys of the schema
        if "known keys here: " in error.message and parent_spec.values is None:
            listed = error.message.split("known keys here: ", 1)[1].split(")", 1)[0]
            known = set(listed.split(", "))
            extra = known - set(parent_spec.fields)
            if extra:
                problems.append(f"{dotted}: the reader knows keys the schema lacks: {extra}")
    assert count >= {"scenario": 120, "topology": 50, "device": 20}[kind]
    assert problems == []


@pytest.mark.parametrize("kind", list(KINDS))
def test_every_section_s_unknown_keys_are_rejected_by_both(
    kind: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A bogus key in every mapping of the schema: check() names it with the reader's words,
    the JSON Schema rejects it, and the reader (schema off) rejects it too."""
    root, _, _ = KINDS[kind]
    sections: list[tuple[Path_, tuple[Spec, ...]]] = [((), ())]
    sections += [
        (p, (*c[:-1], o))
        for p, c in leaves(root)
        for o in (c[-1].options if isinstance(c[-1], Either) else (c[-1],))
        if isinstance(o, Section) and (o.values is None or o.keys is not None)
    ]
    problems = []
    for path, chain in sections:
        data = _base(kind)
        if path:
            _with(data, path, chain, example(chain[-1]))
            if path in FIXUPS:
                FIXUPS[path](data)
        node = data
        for key in path:
            node = node[key]
        node[BOGUS] = node.get(BOGUS, 1) if chain and chain[-1].values is None else {}
        dotted = ".".join((*path, BOGUS))
        errors = _check(kind, data)
        if len(errors) != 1 or f": {dotted}: " not in errors[0]:
            problems.append(f"{dotted}: check() says {errors}")
        if _validator(kind).is_valid(data):
            problems.append(f"{dotted}: the JSON Schema accepts it")
        error = _reader_error(kind, data, monkeypatch)
        if error is None or error.key_path != dotted:
            problems.append(f"{dotted}: the reader says {error}")
    assert len(sections) >= {"scenario": 15, "topology": 10, "device": 4}[kind]
    assert problems == []


def _wrong(spec: Value | ListOf) -> Any:
    return ["a", "list"] if isinstance(spec, Value) else "not a list"


@pytest.mark.parametrize("kind", list(KINDS))
def test_check_and_json_schema_agree_on_a_wrong_type_at_every_key(kind: str) -> None:
    root, _, _ = KINDS[kind]
    problems = []
    for path, chain in leaves(root):
        spec = chain[-1]
        if not isinstance(spec, Value | ListOf):
            continue
        data = _base(kind)
        _with(data, path, chain, example(spec))
        if path in FIXUPS:
            FIXUPS[path](data)
        _with(data, path, chain, _wrong(spec))
        dotted = ".".join(path)
        errors = _check(kind, data)
        if not any(f": {dotted}: must be " in e for e in errors):
            problems.append(f"{dotted}: check() says {errors}")
        if _validator(kind).is_valid(data):
            problems.append(f"{dotted}: the JSON Schema accepts {_wrong(spec)!r}")
    assert problems == []


def test_inline_device_in_a_topology_is_read_with_every_device_key(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The device schema is the topology's ``device:`` mapping: the h100 catalogue file
    written inline passes check() and is read."""
    topology = _base("topology")
    topology["device"] = _base("device")
    assert _check("topology", topology) == []
    assert _validator("topology").is_valid(topology)
    assert _reader_error("topology", topology, monkeypatch) is None
    chain = _chain(TOPOLOGY, ("device", "measured", "concurrent_slowdown"))
    assert isinstance(chain[-1], Value)
