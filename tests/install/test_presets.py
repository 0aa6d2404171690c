"""The topology presets: one source of truth inside the package, mirrored at the top level."""

from __future__ import annotations

from pathlib import Path

from collsim.cluster.topology import PRESET_DIR, resolve_topology_path

REPO = Path(__file__).resolve().parents[2]


def test_top_level_topologies_are_the_package_presets() -> None:
    shipped = {p.name: p.read_bytes() for p in PRESET_DIR.glob("*.yaml")}
    mirrored = {p.name: p.read_bytes() for p in (REPO / "topologies").glob("*.yaml")}
    assert shipped, "no presets inside the package"
    assert sorted(shipped) == sorted(mirrored)
    differ = [name for name in shipped if shipped[name] != mirrored[name]]
    assert differ == [], f"topologies/ and collsim/data/topologies/ differ: {differ}"


def test_a_name_resolves_inside_the_package(tmp_path: Path, monkeypatch: object) -> None:
    import pytest

    assert isinstance(monkeypatch, pytest.MonkeyPatch)
    monkeypatch.chdir(tmp_path)  # no ./topologies here
    path = resolve_topology_path("dgx_h100")
    assert path.parent == PRESET_DIR
