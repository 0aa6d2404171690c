"""The keys of scenario, topology and device files: one description per key, three uses. A
description (:data:`collsim.study.scenario.SCENARIO`, :data:`collsim.cluster.topology.TOPOLOGY`,
:data:`collsim.cluster.hardware.DEVICE`, each beside its reader) gives every key's type, range,
choices, default, unit conversion, the name it takes in the object built from it, and its meaning;
:func:`check` reports every error of a document at once, :func:`read_described` reads the keys of
one mapping as described (the readers keep only the rules between keys), and
:func:`collsim.core.schema_json.json_schema` writes the description as a JSON Schema
(docs/internals.md, "The schema checker").
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

from collsim.core.errors import ConfigError, ConfigErrors
from collsim.core.yamlio import (
    REQUIRED,
    ConfigReader,
    YamlDoc,
    type_name,
    unknown_key_message,
    with_hint,
)

__all__ = [
    "Value",
    "ListOf",
    "Either",
    "Anything",
    "Section",
    "Spec",
    "check",
    "raise_errors",
    "choices_of",
    "positive_value",
    "non_negative_value",
    "flag_value",
    "text_value",
    "fraction_value",
    "choice_value",
    "values_of",
    "read_described",
    "read_value",
    "defaults_of",
    "scaled",
]

KeyPath = tuple[str | int, ...]
Choices = tuple[Any, ...] | Callable[[], Sequence[Any]]
"""Allowed values: a tuple, or a function that returns them (read from a reader's module)."""


@dataclass(frozen=True, kw_only=True)
class Value:
    """One scalar key."""

    kind: str
    """``integer``, ``number``, ``string`` or ``boolean`` (JSON Schema type names); a number
    key takes integers too, as the readers do."""
    description: str = ""
    required: bool = False
    nullable: bool = True
    """``key: null`` counts as absent (the reader's default); False where the reader
    refuses ``null``."""
    minimum: float | None = None
    exclusive_minimum: float | None = None
    maximum: float | None = None
    enum: Choices | None = None
    """Allowed values, checked here and listed in the JSON Schema."""
    fold_case: bool = False
    """Compare strings in lower case (the reader lower-cases them); the JSON Schema lists the
    lower-case spellings."""
    json_choices: Callable[[], Sequence[str]] | None = None
    """Values listed in the JSON Schema only, beside any ``*.yaml`` path (devices: the reader
    also takes a full name and checks it with its own message)."""
    rule: str | None = None
    """The message of a failed range or choice, ``{value}`` / ``{value!r}`` / ``{choices}``
    filled in, when it is not the generic one."""
    default: Any = None
    """What an absent (or null) key reads as, in the file's units; None: the key is left out
    and the built object's own default applies (or its reader works one out)."""
    field: str | None = None
    """The name the value takes in the object built from the mapping (default: the key)."""
    convert: Callable[[Any], Any] | None = None
    """Turns the file's value into the built object's (a unit: ``gbps_to_bps``; an enum)."""


@dataclass(frozen=True, kw_only=True)
class ListOf:
    """A list whose items share one schema."""

    items: Spec | None
    """Schema of every item; None: items of any kind (a reader checks them)."""
    description: str = ""
    required: bool = False
    nullable: bool = True
    min_items: int = 0
    unique: bool = False
    item_rule: str | None = None
    """The message of a bad item (``{item!r}``) when it is not ``item N: <the item's error>``."""
    min_rule: str = "must have at least {min_items} item(s)"
    unique_rule: str = "names an entry twice: {value}"
    default: Any = None
    field: str | None = None
    convert: Callable[[Any], Any] | None = None
    """As :class:`Value`'s; the reader hands the list over as a tuple."""


@dataclass(frozen=True, kw_only=True)
class Either:
    """A key that takes one of several shapes (a number or ``auto``, a key or a mapping)."""

    options: tuple[Spec, ...]
    description: str = ""
    required: bool = False
    nullable: bool = True
    rule: str
    """The message of a value that has none of the options' types (``{value!r}``)."""
    default: Any = None
    field: str | None = None
    convert: Callable[[Any], Any] | None = None
    """As :class:`Value`'s (an either-or with a mapping option is left to its reader)."""


@dataclass(frozen=True, kw_only=True)
class Anything:
    """Free content the reader keeps as it is (``measured.notes``)."""

    description: str = ""
    required: bool = False
    nullable: bool = True


@dataclass(frozen=True, kw_only=True)
class Section:
    """A mapping of named keys (``fields``), or of free keys that share one schema (``values``)."""

    fields: dict[str, Spec] = field(default_factory=dict)
    description: str = ""
    required: bool = False
    nullable: bool = True
    values: Spec | None = None
    """Schema of every value, for a mapping keyed by ``keys`` (ops -> algorithm, ...)."""
    keys: Choices | None = None
    """The keys a ``values`` mapping may have; None: any key."""
    key_rule: str = "unknown key; must be one of {choices}"
    """The message for a key not in ``keys`` (``{key!r}``, ``{choices}``)."""
    one_of_required: tuple[tuple[str, ...], ...] = ()
    """Alternatives of required keys (the model: a ``preset``, an ``hf_config`` or its shape)."""
    missing_rule: str = "missing required key"
    exactly_one: tuple[str, ...] = ()
    """Keys of which exactly one must be given."""
    exactly_one_rule: str = ""
    builds: type | None = None
    """The dataclass the mapping is read into: a key that states no default of its own (and no
    unit conversion) has the default of the field it is read into (:func:`defaults_of`)."""


Spec = Value | ListOf | Either | Anything | Section


def defaults_of(section: Section) -> dict[str, Any]:
    """Key -> what the key reads as when it is absent, in the file's terms: the description's
    own default, else (no conversion) the default of the field of :attr:`Section.builds` it is
    read into, where that is a plain value (an enum as its value; None and factories: none)."""
    fields = {f.name: f for f in dataclasses.fields(section.builds)} if section.builds else {}
    out: dict[str, Any] = {}
    for key, spec in section.fields.items():
        if not isinstance(spec, _READ):
            continue
        if spec.default is not None:
            out[key] = spec.default
            continue
        built = fields.get(spec.field or key)
        if built is None or spec.convert is not None:
            continue
        value = getattr(built.default, "value", built.default)
        if isinstance(value, bool | int | float | str):
            out[key] = value
    return out


def choices_of(choices: Choices) -> tuple[Any, ...]:
    """The values of a :data:`Choices` (calls the function of a lazy one)."""
    return tuple(choices() if callable(choices) else choices)


# -- shorthands -----------------------------------------------------------------------------------


def positive_value(kind: str, description: str, **kw: Any) -> Value:
    """A number or integer above 0."""
    return Value(kind=kind, description=description, exclusive_minimum=0, **kw)


def non_negative_value(kind: str, description: str, **kw: Any) -> Value:
    """A number or integer of at least 0."""
    return Value(kind=kind, description=description, minimum=0, **kw)


def flag_value(description: str, **kw: Any) -> Value:
    """true or false."""
    return Value(kind="boolean", description=description, **kw)


def text_value(description: str, **kw: Any) -> Value:
    """A string."""
    return Value(kind="string", description=description, **kw)


def fraction_value(description: str, **kw: Any) -> Value:
    """A number in (0, 1]."""
    return Value(
        kind="number",
        description=description,
        exclusive_minimum=0,
        maximum=1,
        rule=kw.pop("rule", "must be in (0, 1], got {value}"),
        **kw,
    )


def choice_value(description: str, choices: Choices, **kw: Any) -> Value:
    """One of ``choices``."""
    kind = kw.pop("kind", "string")
    return Value(kind=kind, description=description, enum=choices, **kw)


def values_of(choices: Iterable[Any]) -> tuple[Any, ...]:
    """The values a schema lists for a StrEnum, a tuple, or a dict's keys."""
    return tuple(getattr(v, "value", v) for v in choices)


def scaled(factor: float) -> Callable[[float], float]:
    """A :attr:`Value.convert` that multiplies by ``factor`` (a unit: ``scaled(US)``)."""

    def convert(value: float) -> float:
        return value * factor

    return convert


_PY_TYPES: dict[str, type] = {"integer": int, "number": float, "string": str, "boolean": bool}
"""The Python type a described key of each JSON Schema type is read as."""


def _py_kinds(spec: Spec) -> tuple[type, ...] | None:
    """The Python types ``spec`` is read as; None: a mapping, left to the reader."""
    if isinstance(spec, Value):
        return (_PY_TYPES[spec.kind],)
    if isinstance(spec, ListOf):
        return (list,)
    if isinstance(spec, Either):
        kinds = [_py_kinds(option) for option in spec.options]
        if any(k is None for k in kinds):
            return None
        return tuple(t for k in kinds if k is not None for t in k)
    return None


def _problem(value: Any, spec: Spec) -> str | None:
    """The description's first objection to ``value`` (the message :func:`check` gives)."""
    if isinstance(spec, Value):
        return None if value is None else _value_error(value, spec)
    errors = check(YamlDoc(data=value, file=""), spec)
    if not errors:
        return None
    first = errors[0]
    return f"{first.key_path}: {first.message}" if first.key_path else first.message


def read_value(reader: ConfigReader, key: str, spec: Value | ListOf | Either) -> Any:
    """``key`` of ``reader`` as ``spec`` describes it: its type, its range and choices (the
    message of :func:`check`), its default when absent or null, converted; a list as a tuple.
    None: absent, no default."""
    kinds = _py_kinds(spec)
    if kinds is None:
        raise TypeError(f"{key}: a mapping is read by its own reader")
    default = REQUIRED if spec.required else None
    raw = reader.data.get(key)  # checked as written (the reader turns 0 into 0.0)
    value = reader.get(key, kinds, default=default, check=lambda _: _problem(raw, spec))
    if value is None:
        value = spec.default
    if value is None:
        return None
    if isinstance(value, list):
        value = tuple(value)
    return spec.convert(value) if spec.convert is not None else value


def read_described(reader: ConfigReader, section: Section) -> dict[str, Any]:
    """The keys ``section`` describes, read from ``reader`` (:func:`read_value`), under the
    names they take in the object built from them; a key that is absent and has no default is
    left out. Mappings, and either-ors with a mapping option, are left to the reader.

    A ``values`` section (free keys, one schema) gives every key of the mapping, each checked
    against the section's ``keys``."""
    out: dict[str, Any] = {}
    values = section.values
    if values is not None:
        if not isinstance(values, _READ) or _py_kinds(values) is None:
            raise TypeError("a mapping of mappings is read by its own reader")
        allowed = choices_of(section.keys) if section.keys is not None else None
        for key, _ in list(reader.items()):
            if allowed is not None and key not in allowed:
                choices = ", ".join(map(str, allowed))
                raise reader.error(_fmt(section.key_rule, key=key, choices=choices), key)
            out[str(key)] = read_value(reader, str(key), values)
        return out
    data = reader.data
    for key, spec in section.fields.items():
        if not isinstance(spec, _READ):
            continue
        if key not in data and spec.default is None and not spec.required:
            continue  # absent, no default: the built object's own
        if isinstance(spec, Either) and _py_kinds(spec) is None:
            continue
        value = read_value(reader, key, spec)
        if value is not None:
            out[spec.field or key] = value
    return out


_READ = (Value, ListOf, Either)
"""The kinds of description :func:`read_described` reads (mappings have their readers)."""


# -- checking -------------------------------------------------------------------------------------

_TYPE_WORDS = {
    "integer": "an integer",
    "number": "a number",
    "string": "a string",
    "boolean": "true or false",
    "object": "a mapping",
    "array": "a list",
}


def _dotted(path: KeyPath) -> str:
    """``a.b[0].c``, as :mod:`collsim.core.yamlio` writes key paths."""
    parts: list[str] = []
    for part in path:
        if isinstance(part, int):
            parts.append(f"[{part}]")
        else:
            parts.append(("." if parts else "") + str(part))
    return "".join(parts)


def _json_type(spec: Spec) -> str | None:
    if isinstance(spec, Value):
        return spec.kind
    if isinstance(spec, ListOf):
        return "array"
    if isinstance(spec, Section):
        return "object"
    return None


def _has_type(value: Any, kind: str) -> bool:
    if kind == "boolean":
        return isinstance(value, bool)
    if kind == "string":
        return isinstance(value, str)
    if kind == "integer":
        return isinstance(value, int) and not isinstance(value, bool)
    if kind == "number":
        return isinstance(value, int | float) and not isinstance(value, bool)
    if kind == "object":
        return isinstance(value, dict)
    if kind == "array":
        return isinstance(value, list)
    return True


def _fmt(rule: str, **kw: Any) -> str:
    return rule.format(**kw)


def _value_error(value: Any, spec: Value) -> str | None:
    if not _has_type(value, spec.kind):
        return f"must be {_TYPE_WORDS[spec.kind]}, got {value!r}"
    if isinstance(value, float) and not math.isfinite(value):
        return f"must be a finite number, got {value!r}"
    if spec.enum is not None:
        allowed = choices_of(spec.enum)
        probe = value.strip().lower() if spec.fold_case and isinstance(value, str) else value
        if probe not in allowed:
            choices = ", ".join(map(str, allowed))
            if spec.rule:
                return _fmt(spec.rule, value=value, choices=choices)
            return f"must be one of {choices}; got {value!r}"
        return None
    low_ok = True
    generic = ""
    if spec.exclusive_minimum is not None and not value > spec.exclusive_minimum:
        low_ok = False
        generic = f"must be > {spec.exclusive_minimum:g}, got {value}"
    elif spec.minimum is not None and not value >= spec.minimum:
        low_ok = False
        generic = f"must be >= {spec.minimum:g}, got {value}"
    high_ok = spec.maximum is None or value <= spec.maximum
    if not high_ok:
        generic = f"must be <= {spec.maximum:g}, got {value}"
    if not (low_ok and high_ok):
        return _fmt(spec.rule, value=value) if spec.rule else generic
    return None


def check(doc: YamlDoc, schema: Spec) -> list[ConfigError]:
    """Every schema error of ``doc``, in file order, each with its file, line and key path.

    Stays long: one walk of the document as a few nested functions (value, list, section)
    that share the error list and the document's line table.
    """
    errors: list[tuple[int, int, ConfigError]] = []

    def add(path: KeyPath, message: str, line: int | None = None) -> None:
        if line is None:
            line = doc.line_of(path) if path else doc.lines.get(())
        err = ConfigError(message, key_path=_dotted(path) or None, file=doc.file, line=line)
        errors.append((line or 0, len(errors), err))

    def walk(data: Any, spec: Spec, path: KeyPath) -> None:
        if data is None:
            if not spec.nullable:
                kind = _json_type(spec)
                words = _TYPE_WORDS[kind] if kind else "a value"
                add(path, f"must be {words}, got nothing")
            return
        if isinstance(spec, Anything):
            return
        if isinstance(spec, Value):
            problem = _value_error(data, spec)
            if problem:
                add(path, problem)
            return
        if isinstance(spec, Either):
            for option in spec.options:
                kind = _json_type(option)
                if kind is not None and _has_type(data, kind):
                    walk(data, option, path)
                    return
            add(path, _fmt(spec.rule, value=data))
            return
        if isinstance(spec, ListOf):
            walk_list(data, spec, path)
            return
        walk_section(data, spec, path)

    def walk_list(data: Any, spec: ListOf, path: KeyPath) -> None:
        if not isinstance(data, list):
            add(path, f"must be a list, got {type_name(data)}")
            return
        if len(data) < spec.min_items:
            add(path, _fmt(spec.min_rule, min_items=spec.min_items))
        if spec.items is not None:
            for i, item in enumerate(data):
                if spec.item_rule is not None:
                    sub = check_one(item, spec.items)
                    if sub:
                        add(path, _fmt(spec.item_rule, item=item))
                        return
                else:
                    walk(item, spec.items, path + (i,))
        if spec.unique:
            hashable = [repr(x) for x in data]
            if len(set(hashable)) != len(hashable):
                add(path, _fmt(spec.unique_rule, value=data))

    def walk_section(data: Any, spec: Section, path: KeyPath) -> None:
        if not isinstance(data, dict):
            add(path, f"must be a mapping, got {type_name(data)}")
            return
        if spec.values is not None:
            allowed = choices_of(spec.keys) if spec.keys is not None else None
            for key, value in data.items():
                if allowed is not None and key not in allowed:
                    choices = ", ".join(map(str, allowed))
                    message = _fmt(spec.key_rule, key=key, choices=choices)
                    add(path + (key,), with_hint(message, key, allowed))
                else:
                    walk(value, spec.values, path + (key,))
            return
        unknown: list[str] = []
        for key, value in data.items():
            if key not in spec.fields:
                unknown.append(key)
                continue
            walk(value, spec.fields[key], path + (key,))
        if spec.exactly_one and sum(data.get(k) is not None for k in spec.exactly_one) != 1:
            add(path, spec.exactly_one_rule)
        # Missing keys of one mapping are one error, naming the others; a misspelt key there
        # is what explains it, so it is named in the same line (and not reported again).
        found = ", ".join(f"{k!r} at line {doc.line_of(path + (k,))}" for k in unknown)
        hint = f"; unknown key(s) here: {found}" if unknown else ""
        at = doc.line_of(path + (unknown[0],)) if unknown else None
        missing = [k for k, sub in spec.fields.items() if sub.required and data.get(k) is None]
        if missing:
            also = f" (also missing: {', '.join(missing[1:])})" if missing[1:] else ""
            add(path + (missing[0],), _missing(spec.fields[missing[0]]) + also + hint, at)
        group_missing = []
        if spec.one_of_required and not any(
            all(data.get(k) is not None for k in group) for group in spec.one_of_required
        ):
            # the last alternative is the spelled-out one (the model's shape keys): name its
            # missing keys; a choice between single keys is an error of the mapping itself
            last = spec.one_of_required[-1]
            group_missing = [k for k in last if data.get(k) is None]
            tail = hint if not missing else ""
            if len(last) > 1:
                rest = group_missing[1:]
                also = f" (also missing: {', '.join(rest)})" if rest else ""
                add(path + (group_missing[0],), spec.missing_rule + also + tail, at)
            else:
                add(path, spec.missing_rule + tail, at)
        if not missing and not group_missing:
            for key in unknown:
                add(path + (key,), unknown_key_message(str(key), spec.fields))

    def check_one(data: Any, spec: Spec) -> bool:
        """Whether ``data`` has an error under ``spec`` (collected apart, then dropped)."""
        before = len(errors)
        walk(data, spec, ())
        bad = len(errors) > before
        del errors[before:]
        return bad

    walk(doc.data, schema, ())
    return [err for _, _, err in sorted(errors, key=lambda t: (t[0], t[1]))]


def _missing(spec: Spec) -> str:
    return "missing required section" if isinstance(spec, Section) else "missing required key"


def raise_errors(errors: list[ConfigError]) -> None:
    """Raise the one error, or all of them as :class:`~collsim.core.errors.ConfigErrors`."""

    if len(errors) == 1:
        raise errors[0]
    if errors:
        raise ConfigErrors(errors)
