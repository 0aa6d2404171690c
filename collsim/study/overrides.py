"""Scenario overrides (``--set key.path=value``), and errors located at their line or ``--set``."""

from __future__ import annotations

import copy
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import yaml

from collsim.core.errors import ConfigError, ConfigErrors
from collsim.core.yamlio import YamlDoc

__all__ = ["Override", "parse_override", "apply_overrides", "locate"]

KeyPath = tuple[str, ...]


@dataclass(frozen=True, slots=True)
class Override:
    """One ``--set``: its text, its key path and its value."""

    text: str
    """``key.path=value`` as typed."""
    path: KeyPath
    value: Any


def parse_override(text: str) -> Override:
    """Parse one ``--set key.path=value``; the value is read as a YAML scalar or flow value.

    Raises:
        ConfigError: no ``=``, an empty key, or a value that is not valid YAML.
    """
    where = f"--set {text}"
    key, sep, raw = text.partition("=")
    key = key.strip()
    if not sep or not key:
        raise ConfigError("expected KEY.PATH=VALUE, e.g. parallel.tp=4", file=where)
    parts = tuple(p.strip() for p in key.split("."))
    if any(not p for p in parts):
        raise ConfigError("empty part in key path", key_path=key, file=where)
    try:
        value = yaml.safe_load(raw) if raw.strip() else None
    except yaml.YAMLError as exc:
        problem = getattr(exc, "problem", None) or "invalid YAML"
        raise ConfigError(
            f"cannot parse value {raw!r}: {problem}", key_path=key, file=where
        ) from None
    if value is None:
        raise ConfigError("missing value (use KEY.PATH=VALUE)", key_path=key, file=where)
    return Override(text=text, path=parts, value=value)


def apply_overrides(data: dict[str, Any], overrides: Sequence[Override]) -> dict[str, Any]:
    """A deep copy of ``data`` with each override written at its key path.

    Missing intermediate sections are created (``--set parallel.ddp.overlap=false`` works without
    a ``ddp`` section); keys nobody knows are rejected later by the reader, at ``--set``.

    Raises:
        ConfigError: an override walks into a value that is not a mapping.
    """
    out = copy.deepcopy(data)
    for override in overrides:
        node: Any = out
        for i, part in enumerate(override.path[:-1]):
            child = node.get(part)
            if child is None:
                child = node[part] = {}
            if not isinstance(child, dict):
                raise ConfigError(
                    f"{'.'.join(override.path[: i + 1])} is not a section",
                    key_path=".".join(override.path),
                    file=f"--set {override.text}",
                )
            node = child
        node[override.path[-1]] = override.value
    return out


def _split(key_path: str | None) -> KeyPath:
    return tuple(key_path.split(".")) if key_path else ()


def locate(error: ConfigError, doc: YamlDoc, overrides: Sequence[Override]) -> ConfigError:
    if isinstance(error, ConfigErrors):
        return ConfigErrors([locate(e, doc, overrides) for e in error.errors])
    path = _split(error.key_path)
    # The last override that set the key (or a section above it) wins. An error in a
    # section the file does not have belongs to the override that created the section.
    for override in reversed(overrides):
        n = len(override.path)
        created = any(
            path[:k] == override.path[:k] and path[:k] not in doc.lines
            for k in range(1, min(len(path), n) + 1)
        )
        if path[:n] == override.path or created:
            return error.at(key_path=error.key_path, file=f"--set {override.text}", line=None)
    if error.file is not None and error.file != doc.file:
        return error
    line = doc.line_of(path) if path else None
    return error.at(
        key_path=error.key_path,
        file=doc.file,
        line=error.line if error.line is not None else line,
    )
