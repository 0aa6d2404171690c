from __future__ import annotations

import pytest

from collsim.core.errors import ConfigError
from collsim.core.units import GiB, MiB, parse_size
from collsim.core.yamlio import ConfigReader, parse_yaml_text, positive


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
    from collsim.core.yamlio import load_yaml

    binary = tmp_path / "b.yaml"
    binary.write_bytes(b"a: \xff\xfe\n")
    with pytest.raises(ConfigError, match=r"b.yaml:1: not UTF-8 text \(byte 0xff at offset 3\)"):
        load_yaml(binary)
    with pytest.raises(ConfigError, match=r"is a folder, not a file"):
        load_yaml(tmp_path)
    with pytest.raises(ConfigError, match=r"missing.yaml: file not found"):
        load_yaml(tmp_path / "missing.yaml")


def _alias_bomb(levels: int, per_list: int = 9) -> str:
    """``x0: &a0 [lol, ...]``, ``x1: &a1 [*a0, *a0, ...]``, ...: per_list**levels leaves."""
    lines = [f"x0: &a0 [{', '.join(['lol'] * per_list)}]"]
    for i in range(1, levels):
        lines.append(f"x{i}: &a{i} [{', '.join([f'*a{i - 1}'] * per_list)}]")
    return "\n".join(lines) + "\n"


def test_alias_bomb_is_refused_before_it_expands() -> None:
    import resource
    import time

    text = _alias_bomb(7)  # 432 bytes, 9**7 = 4.8 million values once expanded
    assert len(text) < 500
    rss_before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    start = time.perf_counter()
    with pytest.raises(ConfigError, match=r"^b.yaml:\d+: YAML aliases expand to more than"):
        parse_yaml_text(text, file="b.yaml")
    assert time.perf_counter() - start < 2.0
    # ru_maxrss is in KiB on Linux: the refusal costs well under 100 MiB
    assert resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - rss_before < 100 * 1024
    with pytest.raises(ConfigError, match=r"YAML aliases expand"):
        parse_yaml_text(_alias_bomb(8), file="b.yaml")  # 508 bytes: 43 million values


def test_small_aliases_still_expand() -> None:
    doc = parse_yaml_text(_alias_bomb(3, per_list=3), file="a.yaml")
    assert doc.data["x2"] == [[["lol"] * 3] * 3] * 3
    base = "base: &b {tp: 2, pp: 1}\nrun: {<<: *b, dp: 4}\n"
    assert parse_yaml_text(base).data["run"] == {"tp": 2, "pp": 1, "dp": 4}


def test_recursive_anchor_is_refused() -> None:
    with pytest.raises(ConfigError, match=r"^r.yaml:1: YAML alias refers to a node that contains"):
        parse_yaml_text("a: &a [1, *a]\n", file="r.yaml")


@pytest.mark.parametrize("special", ["/dev/zero", "/dev/urandom", "fifo"])
def test_special_files_are_not_read(tmp_path, special: str) -> None:
    import os

    from collsim.core.yamlio import load_yaml, read_input_bytes

    if special == "fifo":
        special = str(tmp_path / "pipe.yaml")
        os.mkfifo(special)  # opening it for reading would block until a writer comes
    with pytest.raises(ConfigError, match=r"not a regular file"):
        load_yaml(special)
    with pytest.raises(ConfigError, match=r"not a regular file"):
        read_input_bytes(special, what="CSV")


def test_oversized_files_are_refused_before_reading(tmp_path) -> None:
    from collsim.core.yamlio import MAX_INPUT_BYTES, load_yaml

    big = tmp_path / "big.yaml"
    with big.open("wb") as handle:  # a sparse file: its size without writing the bytes
        handle.truncate(MAX_INPUT_BYTES + 1)
    with pytest.raises(ConfigError, match=r"big.yaml: file is 16,777,217 bytes, above the"):
        load_yaml(big)


def test_byte_order_mark_is_dropped(tmp_path) -> None:
    from collsim.core.yamlio import load_yaml, read_input_text

    path = tmp_path / "bom.yaml"
    path.write_bytes(b"\xef\xbb\xbfa: 1\n")
    assert load_yaml(path).data == {"a": 1}
    assert read_input_text(path) == "a: 1\n"
