"""The JSON Schema (draft 2020-12) of scenario, topology and device files, written from the same
descriptions their readers read through (:mod:`collsim.core.schema`), for ``collsim schema`` and
for editors that validate YAML as it is typed (docs/internals.md, "The schema checker").
"""

from __future__ import annotations

from typing import Any

from collsim.core.schema import (
    Anything,
    Either,
    ListOf,
    Section,
    Spec,
    Value,
    choices_of,
    defaults_of,
)

__all__ = ["json_schema"]


_PATH_PATTERN = r"\.ya?ml$"
"""A device or topology given as a file."""


def _nullable(out: dict[str, Any]) -> dict[str, Any]:
    """``out`` that also admits ``null`` (an optional key the readers treat as absent)."""
    if "type" in out and "anyOf" not in out:
        out["type"] = [out["type"], "null"]
        if "enum" in out:
            out["enum"] = [*out["enum"], None]
        return out
    return {"anyOf": [out, {"type": "null"}]}


def _json(spec: Spec, optional: bool = False) -> dict[str, Any]:
    out = _json_plain(spec)
    if optional and spec.nullable:
        return _nullable(out)
    return out


def _json_plain(spec: Spec) -> dict[str, Any]:
    out: dict[str, Any] = {}
    if isinstance(spec, Anything):
        if spec.description:
            out["description"] = spec.description
        return out
    if isinstance(spec, Either):
        out = {"anyOf": [_json(option) for option in spec.options]}
        if spec.description:
            out["description"] = spec.description
        if spec.default is not None:
            out["default"] = spec.default
        return out
    if isinstance(spec, ListOf):
        out = {"type": "array"}
        if spec.description:
            out["description"] = spec.description
        if spec.items is not None:
            out["items"] = _json(spec.items)
        if spec.min_items:
            out["minItems"] = spec.min_items
        if spec.unique:
            out["uniqueItems"] = True
        if spec.default is not None:
            out["default"] = list(spec.default)
        return out
    if isinstance(spec, Value):
        out = {"type": spec.kind}
        if spec.description:
            out["description"] = spec.description
        if spec.enum is not None:
            out["enum"] = list(choices_of(spec.enum))
        if spec.json_choices is not None:
            out = {
                "description": spec.description,
                "anyOf": [
                    {"type": "string", "enum": list(spec.json_choices())},
                    {"type": "string", "pattern": _PATH_PATTERN},
                ],
            }
            return out
        if spec.exclusive_minimum is not None:
            out["exclusiveMinimum"] = spec.exclusive_minimum
        if spec.minimum is not None:
            out["minimum"] = spec.minimum
        if spec.maximum is not None:
            out["maximum"] = spec.maximum
        if spec.default is not None:
            out["default"] = spec.default
        return out
    out = {"type": "object"}
    if spec.description:
        out["description"] = spec.description
    if spec.values is not None:
        if spec.keys is not None:
            out["propertyNames"] = {"enum": [str(k) for k in choices_of(spec.keys)]}
        out["additionalProperties"] = _json(spec.values)
        return out
    out["properties"] = {
        key: _json(sub, optional=not sub.required) for key, sub in spec.fields.items()
    }
    for key, default in defaults_of(spec).items():
        out["properties"][key].setdefault("default", default)
    out["additionalProperties"] = False
    required = [key for key, sub in spec.fields.items() if sub.required]
    if required:
        out["required"] = required
    if spec.one_of_required:
        out["anyOf"] = [
            {"required": list(group), "properties": {k: {"not": {"type": "null"}} for k in group}}
            for group in spec.one_of_required
        ]
    if spec.exactly_one:
        out["oneOf"] = [
            {"required": [k], "properties": {k: {"not": {"type": "null"}}}}
            for k in spec.exactly_one
        ]
    return out


def json_schema(kind: str, spec: Section) -> dict[str, Any]:
    """The JSON Schema (draft 2020-12) of ``kind`` files described by ``spec``
    (:data:`collsim.study.scenario.SCENARIO`, :data:`collsim.cluster.topology.TOPOLOGY`,
    :data:`collsim.cluster.hardware.DEVICE`)."""
    return {
        "$schema": "https://json-schema.org/draft/2020-12/schema",
        "$id": f"https://collsim.invalid/schema/{kind}.schema.json",
        "title": f"collsim {kind} file",
        **_json(spec),
    }
