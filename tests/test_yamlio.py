from __future__ import annotations

import pytest

from collsim.errors import ConfigError
from collsim.units import GiB, MiB, parse_size
from collsim.yamlio import ConfigReader, parse_yaml_text, positive


@pytest.mark.parametrize(
    "text, expected",
    [
        ("8", 8),
        ("1K", 1024),
        ("16M", 16 * MiB),
        ("8G", 8 * GiB),
        ("1KiB", 1024),
        ("2kb", 2048),
    ],
    ids=["bytes", "K", "M", "G", "KiB", "kb"],
)
def test_parse_size(text: str, expected: int) -> None:
    assert parse_size(text) == expected


@pytest.mark.parametrize("text", ["", "M", "1X", "-1K"])
def test_parse_size_rejects(text: str) -> None:
    with pytest.raises(ValueError):
        parse_size(text)


def test_reader_names_file_line_and_key() -> None:
    doc = parse_yaml_text("a: 1\nlinks:\n  nvlink:\n    bandwidth_gbps: -5\n", file="t.yaml")
    links = ConfigReader(doc.data, doc=doc).section("links").section("nvlink")
    with pytest.raises(ConfigError) as err:
        links.get("bandwidth_gbps", float, check=positive)
    assert str(err.value) == "t.yaml:4: links.nvlink.bandwidth_gbps: must be > 0, got -5.0"


def test_reader_rejects_unknown_key_with_line() -> None:
    doc = parse_yaml_text("nodes: 2\nnodez: 3\n", file="t.yaml")
    reader = ConfigReader(doc.data, doc=doc)
    reader.get("nodes", int)
    with pytest.raises(ConfigError, match=r"^t.yaml:2: nodez: unknown key"):
        reader.finish()


def test_syntax_error_has_line() -> None:
    with pytest.raises(ConfigError, match=r"^t.yaml:3: YAML syntax error"):
        parse_yaml_text("a: 1\nb: [1, 2\nc: 3\n", file="t.yaml")


def test_missing_key() -> None:
    doc = parse_yaml_text("x: 1\n", file="t.yaml")
    with pytest.raises(ConfigError, match=r"t.yaml:1: nodes: missing required key"):
        ConfigReader(doc.data, doc=doc).get("nodes", int)


def test_load_yaml_rejects_unreadable_files(tmp_path) -> None:
    from collsim.yamlio import load_yaml

    binary = tmp_path / "b.yaml"
    binary.write_bytes(b"a: \xff\xfe\n")
    with pytest.raises(ConfigError, match=r"b.yaml: not UTF-8 text \(byte 3\)"):
        load_yaml(binary)
    with pytest.raises(ConfigError, match=r"cannot read"):
        load_yaml(tmp_path)  # a folder
    with pytest.raises(ConfigError, match=r"missing.yaml: file not found"):
        load_yaml(tmp_path / "missing.yaml")
