"""YAML with line numbers, and a strict reader that names the key path of every bad value.

Topology and scenario files are read through :func:`load_yaml`, which keeps the line of every
key so that errors can say ``file:line: key.path: message``. :class:`ConfigReader` takes values
out of a mapping one key at a time, checks type and range, and rejects keys nobody asked for.

Example::

    doc = load_yaml("topologies/dgx_h100.yaml")
    reader = ConfigReader(doc.data, doc=doc)
    nodes = reader.get("nodes", int, default=1, check=positive)
    reader.finish()           # ConfigError on any key that was not read
"""

from __future__ import annotations

import math
import os
import stat
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from collsim.core.errors import ConfigError

__all__ = [
    "MAX_INPUT_BYTES",
    "MAX_YAML_NODES",
    "read_input_bytes",
    "read_input_text",
    "YamlDoc",
    "load_yaml",
    "parse_yaml_text",
    "ConfigReader",
    "REQUIRED",
    "positive",
    "non_negative",
    "one_of",
    "unknown_key_message",
    "closest_key",
    "with_hint",
    "type_name",
]

KeyPath = tuple[str | int, ...]


@dataclass
class YamlDoc:
    """A parsed YAML document with the line (1-based) of each key path."""

    data: Any
    file: str
    lines: dict[KeyPath, int] = field(default_factory=dict)

    def line_of(self, path: KeyPath) -> int | None:
        """Line of ``path``, or of its nearest ancestor that has one."""
        probe = tuple(path)
        while probe:
            if probe in self.lines:
                return self.lines[probe]
            probe = probe[:-1]
        return self.lines.get((), None)


#: The largest file collsim reads as input (a scenario, a topology, a device file, an HF
#: ``config.json``, a measured table, a file to plot): 16 MiB, 250 times the largest input
#: shipped in this repository (tests/validate/data/straggler_localhost_gloo_n2.json, 59 KB).
#: Bigger files, and anything that is not a regular file (``/dev/zero``, a named pipe, a
#: folder), are refused before a byte is read; docs/commands.md, "Resource limits".
MAX_INPUT_BYTES = 16 * 1024 * 1024

#: The most nodes (mappings, lists and scalars) a YAML document may hold once its aliases are
#: expanded. An alias repeats its anchor's whole subtree, so nine aliases per list over seven
#: levels of 462 bytes expand to 9**7 = 4.8 million nodes (a "billion laughs"); the largest
#: shipped file holds under 3,000. The count is made on the composed nodes, before a value is
#: built.
MAX_YAML_NODES = 1_000_000


def read_input_bytes(
    path: str | Path, *, what: str = "file", max_bytes: int = MAX_INPUT_BYTES
) -> bytes:
    """The bytes of an input file: a regular file of at most ``max_bytes``.

    The file is checked with ``stat`` before it is opened, so a named pipe cannot block the
    read and ``/dev/zero`` is not read at all.

    Raises:
        ConfigError: missing, not a regular file, larger than ``max_bytes``, or unreadable.
    """
    name = str(path)
    try:
        info = os.stat(path)
    except FileNotFoundError:
        raise ConfigError(f"{what} not found", file=name) from None
    except OSError as exc:
        raise ConfigError(f"cannot read {what}: {exc.strerror or exc}", file=name) from None
    if stat.S_ISDIR(info.st_mode):
        raise ConfigError(f"{what} is a folder, not a file", file=name)
    if not stat.S_ISREG(info.st_mode):
        raise ConfigError(
            f"{what} is not a regular file (a device, pipe or socket); only files are read",
            file=name,
        )
    if info.st_size > max_bytes:
        raise ConfigError(
            f"{what} is {info.st_size:,} bytes, above the {max_bytes:,}-byte limit on inputs",
            file=name,
        )
    try:
        with open(path, "rb") as handle:
            data = handle.read(max_bytes + 1)
    except OSError as exc:
        raise ConfigError(f"cannot read {what}: {exc.strerror or exc}", file=name) from None
    if len(data) > max_bytes:  # grew since stat
        raise ConfigError(f"{what} is above the {max_bytes:,}-byte limit on inputs", file=name)
    return data


def read_input_text(
    path: str | Path, *, what: str = "file", max_bytes: int = MAX_INPUT_BYTES
) -> str:
    """:func:`read_input_bytes` decoded as UTF-8 (a byte-order mark is dropped).

    Raises:
        ConfigError: as :func:`read_input_bytes`, or the bytes are not UTF-8 text (the line and
            offset of the first bad byte).
    """
    data = read_input_bytes(path, what=what, max_bytes=max_bytes)
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as exc:
        line = data.count(b"\n", 0, exc.start) + 1
        raise ConfigError(
            f"not UTF-8 text (byte 0x{data[exc.start]:02x} at offset {exc.start})",
            file=str(path),
            line=line,
        ) from None
    return text.removeprefix("\ufeff")


def _expanded_nodes(root: yaml.Node, file: str) -> int:
    """Nodes of ``root`` with every alias expanded, counted without expanding: a node shared
    by aliases is counted once per use. Stops at :data:`MAX_YAML_NODES`; a node that holds
    itself (``&a [*a]``) is refused."""
    sizes: dict[int, int] = {}
    open_nodes: set[int] = set()

    def size(node: yaml.Node) -> int:
        key = id(node)
        if key in sizes:
            return sizes[key]
        if key in open_nodes:
            raise ConfigError(
                "YAML alias refers to a node that contains it (a recursive anchor)",
                file=file,
                line=node.start_mark.line + 1,
            )
        open_nodes.add(key)
        total = 1
        if isinstance(node, yaml.MappingNode):
            for k, v in node.value:
                total += size(k) + size(v)
                if total > MAX_YAML_NODES:
                    break
        elif isinstance(node, yaml.SequenceNode):
            for child in node.value:
                total += size(child)
                if total > MAX_YAML_NODES:
                    break
        open_nodes.discard(key)
        sizes[key] = total
        if total > MAX_YAML_NODES:
            raise ConfigError(
                f"YAML aliases expand to more than {MAX_YAML_NODES:,} values (an alias repeats "
                "its anchor's whole content); write the values out or use fewer aliases",
                file=file,
                line=node.start_mark.line + 1,
            )
        return total

    return size(root)


#: libyaml's parser where PyYAML was built with it (the wheels on PyPI are): it reads a file
#: about ten times faster than the pure-Python one, with the same nodes and marks.
_BaseLoader: type[yaml.SafeLoader] = getattr(yaml, "CSafeLoader", yaml.SafeLoader)


class _LineLoader(_BaseLoader):  # type: ignore[valid-type,misc]
    """SafeLoader; line numbers are read from the composed node tree."""


def _reader_error(exc: yaml.reader.ReaderError, file: str) -> ConfigError:
    char = chr(exc.character) if isinstance(exc.character, int) else exc.character
    return ConfigError(f"not YAML text: character {char!r} at offset {exc.position}", file=file)


def _construct(
    node: yaml.Node, path: KeyPath, lines: dict[KeyPath, int], loader: yaml.SafeLoader
) -> Any:
    lines.setdefault(path, node.start_mark.line + 1)
    if isinstance(node, yaml.MappingNode):
        out: dict[Any, Any] = {}
        loader.flatten_mapping(node)
        for key_node, value_node in node.value:
            key = loader.construct_object(key_node, deep=True)
            if key in out:
                raise ConfigError(
                    f"duplicate key {key!r}",
                    key_path=_dotted(path + (key,)),
                    line=key_node.start_mark.line + 1,
                )
            lines[path + (key,)] = key_node.start_mark.line + 1
            out[key] = _construct(value_node, path + (key,), lines, loader)
        return out
    if isinstance(node, yaml.SequenceNode):
        return [_construct(child, path + (i,), lines, loader) for i, child in enumerate(node.value)]
    return loader.construct_object(node, deep=True)


def parse_yaml_text(text: str, file: str = "<string>") -> YamlDoc:
    """Parse YAML text, keeping key lines. Syntax errors become ConfigError with the line."""
    try:
        loader = _LineLoader(text)
    except yaml.reader.ReaderError as exc:  # a control character, not text YAML can hold
        raise _reader_error(exc, file) from None
    try:
        node = loader.get_single_node()
        lines: dict[KeyPath, int] = {}
        if node is not None:
            _expanded_nodes(node, file)
        data = {} if node is None else _construct(node, (), lines, loader)
    except yaml.reader.ReaderError as exc:  # libyaml finds it while parsing
        raise _reader_error(exc, file) from None
    except yaml.MarkedYAMLError as exc:
        mark = exc.problem_mark or exc.context_mark
        line = mark.line + 1 if mark is not None else None
        problem = exc.problem or exc.context or "invalid YAML"
        raise ConfigError(f"YAML syntax error: {problem}", file=file, line=line) from None
    except yaml.YAMLError as exc:
        raise ConfigError(f"YAML error: {exc}", file=file) from None
    except ConfigError as exc:
        raise exc.located(file=file) from None
    finally:
        loader.dispose()
    return YamlDoc(data=data, file=file, lines=lines)


def load_yaml(path: str | Path) -> YamlDoc:
    """Read and parse a YAML file (:func:`read_input_text`: a regular file of at most
    :data:`MAX_INPUT_BYTES`). A missing, special or oversized file is a ConfigError."""
    return parse_yaml_text(read_input_text(path), file=str(path))


def _dotted(path: KeyPath) -> str:
    parts: list[str] = []
    for part in path:
        if isinstance(part, int):
            parts.append(f"[{part}]")
        else:
            parts.append(("." if parts else "") + str(part))
    return "".join(parts)


class _Required:
    def __repr__(self) -> str:
        return "REQUIRED"


REQUIRED: Any = _Required()

Check = Callable[[Any], str | None]


def positive(value: Any) -> str | None:
    """Rule: value > 0."""
    return None if value > 0 else f"must be > 0, got {value}"


def non_negative(value: Any) -> str | None:
    """Rule: value >= 0."""
    return None if value >= 0 else f"must be >= 0, got {value}"


def one_of(*choices: Any) -> Check:
    """Rule: value is one of ``choices``."""

    def check(value: Any) -> str | None:
        if value in choices:
            return None
        return f"must be one of {', '.join(map(str, choices))}; got {value!r}"

    return check


_TYPE_NAMES = {
    int: "an integer",
    float: "a number",
    str: "a string",
    bool: "true or false",
    dict: "a mapping",
    list: "a list",
}


class ConfigReader:
    """Strict reader over one mapping of a YAML document.

    Args:
        data: the mapping to read.
        doc: the document it came from (for file and line in errors).
        path: key path of ``data`` inside ``doc``.
    """

    def __init__(
        self, data: Any, *, doc: YamlDoc | None = None, path: KeyPath = (), file: str | None = None
    ) -> None:
        self.doc = doc
        self.path = tuple(path)
        self.file = file if file is not None else (doc.file if doc is not None else None)
        if not isinstance(data, dict):
            raise self.error(f"must be a mapping, got {type_name(data)}")
        self.data: dict[Any, Any] = data
        self._seen: set[Any] = set()

    # -- errors -----------------------------------------------------------------------------
    def error(self, message: str, key: str | int | None = None) -> ConfigError:
        """A ConfigError located at ``key`` of this mapping (or at the mapping itself)."""
        path = self.path + ((key,) if key is not None else ())
        line = self.doc.line_of(path) if self.doc is not None else None
        return ConfigError(message, key_path=_dotted(path) or None, file=self.file, line=line)

    # -- reading ----------------------------------------------------------------------------
    def has(self, key: str) -> bool:
        return key in self.data

    def get(
        self,
        key: str,
        kind: type | tuple[type, ...],
        default: Any = REQUIRED,
        check: Check | None = None,
    ) -> Any:
        """Read ``key`` as ``kind`` (int accepted where float is asked), apply ``check``.

        A float must be finite: YAML's ``.nan``, ``.inf`` and ``-.inf`` are refused for every
        numeric key, before ``check`` (a NaN passes every comparison-based range check).
        """
        self._seen.add(key)
        if key not in self.data or self.data[key] is None and default is not REQUIRED:
            if default is REQUIRED:
                raise self.error("missing required key", key)
            return default
        value = self.data[key]
        kinds = kind if isinstance(kind, tuple) else (kind,)
        if float in kinds and isinstance(value, int) and not isinstance(value, bool):
            value = float(value)
        if bool not in kinds and isinstance(value, bool):
            raise self.error(f"must be {_kinds_name(kinds)}, got {value!r}", key)
        if not isinstance(value, kinds):
            raise self.error(f"must be {_kinds_name(kinds)}, got {value!r}", key)
        if isinstance(value, float) and not math.isfinite(value):
            raise self.error(f"must be a finite number, got {value!r}", key)
        if check is not None:
            problem = check(value)
            if problem:
                raise self.error(problem, key)
        return value

    def section(self, key: str, default_empty: bool = False) -> ConfigReader:
        """A reader over the mapping under ``key``."""
        self._seen.add(key)
        if key not in self.data or self.data[key] is None:
            if default_empty:
                return ConfigReader({}, doc=self.doc, path=self.path + (key,), file=self.file)
            raise self.error("missing required section", key)
        return ConfigReader(self.data[key], doc=self.doc, path=self.path + (key,), file=self.file)

    def items(self) -> Iterator[tuple[Any, Any]]:
        """All (key, value) pairs; marks every key as read."""
        for key, value in self.data.items():
            self._seen.add(key)
            yield key, value

    def finish(self) -> None:
        """Raise ConfigError naming the first key that nobody read."""
        for key in self.data:
            if key not in self._seen:
                raise self.error(unknown_key_message(str(key), map(str, self._seen)), key)


def closest_key(key: str, known: Iterable[str]) -> str | None:
    """The known key ``key`` is most likely a misspelling of, or None: the one known key that
    extends it or that it extends (``boost`` / ``boost_mhz``, ``overlapp`` / ``overlap``; both
    at least 3 characters), else the closest by :func:`difflib.get_close_matches` (ratio at
    least 0.75)."""

    names = sorted(set(known))
    stems = [
        k for k in names if min(len(k), len(key)) >= 3 and (k.startswith(key) or key.startswith(k))
    ]
    if len(stems) == 1:
        return stems[0]
    import difflib  # only on a bad key: 1 ms of start-up otherwise

    close = difflib.get_close_matches(key, names, n=1, cutoff=0.75)
    return close[0] if close else None


def unknown_key_message(key: str, known: Iterable[str]) -> str:
    """``unknown key (known keys here: a, b); did you mean 'a'?``: the keys of the mapping,
    and the closest one where one is close (:func:`closest_key`)."""
    names = sorted(set(known))
    return with_hint(f"unknown key (known keys here: {', '.join(names) or 'none'})", key, names)


def with_hint(message: str, key: object, allowed: Iterable[object]) -> str:
    """``message``, then ``; did you mean 'x'?`` when one of ``allowed`` is close to ``key``."""
    close = closest_key(str(key), [str(a) for a in allowed])
    return f"{message}; did you mean {close!r}?" if close else message


def type_name(value: Any) -> str:
    """The kind of a YAML value in words (``a mapping``, ``an integer``, ...)."""
    return {
        dict: "a mapping",
        list: "a list",
        str: "a string",
        bool: "a boolean",
        int: "an integer",
        float: "a number",
        type(None): "nothing",
    }.get(type(value), type(value).__name__)


def _kinds_name(kinds: tuple[type, ...]) -> str:
    return " or ".join(_TYPE_NAMES.get(k, k.__name__) for k in kinds)
