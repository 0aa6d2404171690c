"""``collsim search --space FILE.yaml``: restrict or extend any axis of the search space.

The file is a mapping of :class:`collsim.study.search.SearchSpace` fields to their values: a list
replaces the axis's values (fewer to restrict, others to extend), a scalar sets a one-value
field (``max_tp``, ``zero_with_pp``, ``zero2_with_pp``). Each key and value is checked against
the field's type and the rule of its axis (micro-batches and sizes at least 1, ZeRO stages 0-3,
prefetch depths at least 0, bucket sizes positive and finite, schedules, recompute modes,
dispatchers and CP algorithms from the vocabulary, lists non-empty without repeats); a broken
rule is one :class:`collsim.core.errors.ConfigError` naming the file, line, key path and value
(exit 2), before any plan is enumerated.
"""

from __future__ import annotations

import dataclasses
import math
import typing
from pathlib import Path
from typing import Any

from collsim.core.errors import ConfigError
from collsim.core.vocab import CPAlgorithm, RecomputeMode, ScheduleKind
from collsim.core.yamlio import load_yaml
from collsim.parallel.config import DISPATCHERS
from collsim.study.search import SearchSpace

__all__ = ["read_space"]

#: Axes whose integers may be 0 (ZeRO stage 0, prefetch depth 0), and their largest value.
_INT_RANGES: dict[str, tuple[int, int | None]] = {
    "zero_stages": (0, 3),
    "prefetches": (0, None),
}


def _choices(name: str) -> list[str] | None:
    """The allowed strings of a string axis (None: any)."""

    enums: dict[str, Any] = {
        "schedules": ScheduleKind,
        "recomputes": RecomputeMode,
        "cp_algorithms": CPAlgorithm,
    }
    if name == "dispatchers":
        return list(DISPATCHERS)
    enum = enums.get(name)
    return None if enum is None else [member.value for member in enum]


def read_space(path: str | Path, base: Any = None) -> Any:
    """The :class:`collsim.study.search.SearchSpace` of ``base`` (default: the default space) with
    the fields of the YAML file ``path`` replaced.

    Raises:
        ConfigError: the file cannot be read, is not a mapping, names an unknown field or
            breaks a field's rule (exit 2).
    """

    doc = load_yaml(path)
    where = str(path)
    if not isinstance(doc.data, dict):
        raise ConfigError("a search space is a mapping of axes to values", file=where, line=1)
    hints = typing.get_type_hints(SearchSpace)
    fields = {f.name for f in dataclasses.fields(SearchSpace)}
    values: dict[str, Any] = {}
    for key, value in doc.data.items():
        line = doc.line_of((key,))

        def fail(rule: str, key: str = str(key), line: int | None = line) -> ConfigError:
            return ConfigError(rule, file=where, line=line, key_path=key)

        if key not in fields:
            raise fail(f"not an axis of the search; axes: {', '.join(sorted(fields))}")
        values[key] = _check(key, value, hints[key], fail)
    return dataclasses.replace(base if base is not None else SearchSpace(), **values)


def _check(name: str, value: Any, hint: Any, fail: Any) -> Any:
    """``value`` for the field ``name`` of type ``hint``, or ``fail(rule)`` raised."""
    args = typing.get_args(hint)
    optional = type(None) in args
    if optional:
        if value is None:
            return None
        hint = next(a for a in args if a is not type(None))
        args = typing.get_args(hint)
    if typing.get_origin(hint) is tuple:
        element = args[0]
        if not isinstance(value, list) or not value:
            raise fail(f"expected a non-empty list, got {value!r}")
        out = tuple(_scalar(name, v, element, fail) for v in value)
        if len(set(out)) != len(out):
            raise fail(f"values repeat in {value!r}")
        return out
    return _scalar(name, value, hint, fail)


def _scalar(name: str, value: Any, kind: Any, fail: Any) -> Any:
    """One value of the axis ``name`` (type ``kind``: int, float, bool or str), checked."""
    if kind is bool:
        if not isinstance(value, bool):
            raise fail(f"expected true or false, got {value!r}")
        return value
    if kind is int:
        low, high = _INT_RANGES.get(name, (1, None))
        if isinstance(value, bool) or not isinstance(value, int):
            raise fail(f"expected an integer, got {value!r}")
        if value < low or (high is not None and value > high):
            rule = f"{low}-{high}" if high is not None else f">= {low}"
            raise fail(f"must be {rule}, got {value!r}")
        return value
    if kind is float:
        if isinstance(value, bool) or not isinstance(value, int | float):
            raise fail(f"expected a number, got {value!r}")
        if not math.isfinite(value) or value <= 0:
            raise fail(f"must be a finite number > 0, got {value!r}")
        return float(value)
    if kind is str:
        choices = _choices(name)
        if not isinstance(value, str) or (choices is not None and value not in choices):
            allowed = f"one of {', '.join(choices)}" if choices is not None else "a string"
            raise fail(f"must be {allowed}, got {value!r}")
        return value
    raise fail(f"cannot be set from a file (type {kind})")  # pragma: no cover
