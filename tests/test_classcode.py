"""The compiled methods of collsim's dataclasses kept between runs (collsim.core.classcode)."""

from __future__ import annotations

import dataclasses
import importlib
import importlib.util
import marshal
import os
import subprocess
import sys
import types
from pathlib import Path
from typing import Any

import pytest

import collsim
from collsim.core.classcode import CodeCache, caching_exec, future_flags, install

REPO = Path(__file__).resolve().parents[1]

SOURCE = '''
from dataclasses import dataclass, field

@dataclass(frozen=True, slots=True)
class Point:
    """A point."""
    x: float
    y: float = 2.0
    tags: tuple = field(default_factory=tuple)

@dataclass(order=True)
class Count:
    """A count."""
    n: int = 0
'''


def _module(name: str, exec_: Any) -> types.ModuleType:
    """``SOURCE`` run as module ``name`` with ``exec_`` as dataclasses' exec."""
    module = types.ModuleType(name)
    sys.modules[name] = module
    saved = vars(dataclasses).get("exec")
    dataclasses.exec = exec_  # type: ignore[attr-defined]
    try:
        exec(compile(SOURCE, f"<{name}>", "exec"), vars(module))
    finally:
        if saved is None:
            del dataclasses.exec  # type: ignore[attr-defined]
        else:
            dataclasses.exec = saved  # type: ignore[attr-defined]
        del sys.modules[name]
    return module


def _probe(cache: CodeCache) -> types.ModuleType:
    """``SOURCE`` as a collsim module whose classes go through ``cache``."""
    return _module("collsim.classcode_probe", caching_exec(cache))


@pytest.fixture
def path(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """A cache file's path, in a process that writes bytecode."""
    monkeypatch.setattr(sys, "dont_write_bytecode", False)
    return tmp_path / "code.marshal"


def _behaviour(module: types.ModuleType) -> list[Any]:
    p, q = module.Point(1.0), module.Point(1.0, 2.0, ())
    out: list[Any] = [repr(p), p == q, hash(p) == hash(q), p != module.Point(3.0)]
    with pytest.raises(dataclasses.FrozenInstanceError):
        p.x = 5.0
    c = module.Count(3)
    out += [
        repr(c),
        c < module.Count(4),
        c == module.Count(3),
        [f.name for f in dataclasses.fields(p)],
    ]
    return out


def test_the_package_installs_the_cache() -> None:
    assert collsim.__name__ == "collsim"
    installed = getattr(dataclasses, "exec", None)
    assert installed is not None and isinstance(installed.cache, CodeCache)
    assert install() is installed.cache  # once per process
    importlib.import_module("collsim.step.result")  # a module of dataclasses

    # collsim's own classes went through it: their texts are in the cache
    assert any("def __init__" in text for text in installed.cache.used)


def test_cached_classes_behave_as_compiled_ones(path: Path) -> None:
    first = CodeCache(path)
    made = _probe(first)
    assert first.added > 0 and len(first.used) == first.added
    first.save()
    assert path.exists()
    # a new process reads every text back and compiles none
    second = CodeCache(path)
    again = _probe(second)
    assert second.added == 0 and second.used == first.used
    plain = _module("collsim.classcode_probe", exec)
    assert _behaviour(made) == _behaviour(again) == _behaviour(plain)
    # the same code objects as dataclasses' own compile of each text (its module has no
    # future imports; this one has, and they would change the code)
    header, blobs = marshal.loads(path.read_bytes())
    assert header == (importlib.util.MAGIC_NUMBER, 0)
    stored = {t: marshal.loads(blob) for t, blob in blobs.items()}
    assert stored
    assert all(
        code == compile(t, "<string>", "exec", dont_inherit=True) for t, code in stored.items()
    )
    assert not all(code == compile(t, "<string>", "exec") for t, code in stored.items())


def test_other_modules_classes_pass_through(tmp_path: Path) -> None:
    cache = CodeCache(tmp_path / "code.marshal")
    made = _module("someone_elses", caching_exec(cache))
    assert cache.added == 0 and not cache.used
    assert _behaviour(made) == _behaviour(_module("collsim.classcode_probe", exec))


def test_a_bad_file_is_compiled_over_and_an_unwritable_one_is_skipped(path: Path) -> None:
    path.write_bytes(b"not marshal data")
    cache = CodeCache(path)
    _probe(cache)
    assert cache.added > 0
    locked = path.parent / "locked"
    locked.mkdir()
    unwritable = CodeCache(locked / "sub" / "code.marshal")
    _probe(unwritable)
    locked.chmod(0o500)
    try:
        unwritable.save()  # no error: compiled each run, as without the cache
    finally:
        locked.chmod(0o700)
    if os.geteuid() != 0:  # root writes anywhere
        assert not (locked / "sub").exists()


def test_future_flags_are_those_a_module_compiles_with() -> None:
    assert future_flags(vars(dataclasses)) == 0
    import __future__

    assert future_flags(globals()) == __future__.annotations.compiler_flag


def test_a_process_writes_the_file_only_where_bytecode_is_written(tmp_path: Path) -> None:
    # a copy of the package, so that the checkout's own cache file is not touched
    code = (
        "import sys, collsim.core.classcode as c, dataclasses;"
        "from pathlib import Path;"
        f"cache = c.CodeCache(Path({str(tmp_path / 'code.marshal')!r}));"
        "dataclasses.exec.cache.path = None;"
        "dataclasses.exec = c.caching_exec(cache);"
        "import atexit; atexit.register(cache.save);"
        "import collsim.step.result"
    )
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    env["PYTHONDONTWRITEBYTECODE"] = "1"
    subprocess.run([sys.executable, "-c", code], env=env, check=True, timeout=120)
    assert not (tmp_path / "code.marshal").exists()
    del env["PYTHONDONTWRITEBYTECODE"]
    subprocess.run([sys.executable, "-c", code], env=env, check=True, timeout=120)
    assert (tmp_path / "code.marshal").exists()


def test_a_full_file_keeps_only_the_texts_in_use(
    path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    stale = {f"x = {i}": marshal.dumps(compile(f"x = {i}", "<string>", "exec")) for i in range(9)}
    path.write_bytes(marshal.dumps((CodeCache(path).header, stale)))
    cache = CodeCache(path)
    _probe(cache)
    monkeypatch.setattr("collsim.core.classcode.MAX_ENTRIES", 10)
    cache.save()
    kept = marshal.loads(path.read_bytes())[1]
    assert set(kept) == cache.used and not set(stale) & set(kept)
    # under the bound the stale texts stay (they may be another command's)
    again = CodeCache(path)
    path.write_bytes(marshal.dumps((again.header, stale)))
    _probe(again)
    monkeypatch.setattr("collsim.core.classcode.MAX_ENTRIES", 100)
    again.save()
    assert set(marshal.loads(path.read_bytes())[1]) == set(stale) | again.used


def test_a_file_of_another_interpreter_or_other_flags_is_not_read(path: Path) -> None:
    first = CodeCache(path)
    _probe(first)
    first.save()
    _, blobs = marshal.loads(path.read_bytes())
    for header in ((b"\x00\x00\r\n", 0), (importlib.util.MAGIC_NUMBER, 1 << 24)):
        path.write_bytes(marshal.dumps((header, blobs)))
        other = CodeCache(path)
        _probe(other)
        assert other.added == len(first.used)  # every text compiled anew
    flagged = CodeCache(path, flags=1 << 24)  # a file written under other flags is its own
    _probe(flagged)
    flagged.save()
    assert marshal.loads(path.read_bytes())[0] == (importlib.util.MAGIC_NUMBER, 1 << 24)
