"""The compiled methods of collsim's dataclasses, kept between runs as Python keeps bytecode.

``dataclasses`` writes each class's ``__init__``, ``__repr__``, ``__eq__``, ``__hash__`` and,
when frozen, ``__setattr__`` / ``__delattr__`` as source text and compiles it every time the
class is made; for the 120 dataclasses a ``collsim run`` imports, that compiling is most of
the time the classes cost, a large share of the command's start-up. :func:`install` gives the
``dataclasses`` module an ``exec`` that compiles each text of a collsim module once and keeps
the code in ``collsim/__pycache__`` (marshalled, named by the interpreter's cache tag, headed by
its magic number and the flags, written at exit unless ``sys.dont_write_bytecode``, as ``.pyc``
files are). The same text compiled
with the same flags is the same code, so the classes are the same; texts of other modules'
classes pass to the built-in ``exec`` untouched. The figures are in docs/internals.md.
"""

from __future__ import annotations
import __future__

import atexit
import builtins
import dataclasses
import marshal
import os
import stat
import sys
from collections.abc import Callable
from importlib.util import MAGIC_NUMBER
from pathlib import Path
from typing import Any

__all__ = ["MAX_ENTRIES", "CodeCache", "caching_exec", "future_flags", "install"]

MAX_ENTRIES = 2048
"""Texts a cache file keeps: collsim's 162 dataclasses have at most six methods each, about
a thousand texts; a file past this (texts of classes since changed) keeps only those of the
process that writes it."""

_PREFIX = "collsim."


class CodeCache:
    """Compiled texts by their source, read from and written to one file: text -> the
    marshalled code (each unmarshalled when first asked for: a command takes the few it
    needs, not every class any command made)."""

    def __init__(self, path: Path | None, *, flags: int = 0) -> None:
        self.path = path
        self.flags = flags
        """Compiler flags (:func:`future_flags` of the module whose ``exec`` this stands for)."""
        self.stored: dict[str, bytes] | None = None
        """Text -> marshalled code (None until first used: the file is read then)."""
        self.code: dict[str, Any] = {}
        """Text -> code object, of the texts asked for."""
        self.added = 0

    @property
    def used(self) -> set[str]:
        """The texts asked for in this process."""
        return set(self.code)

    @property
    def header(self) -> tuple[bytes, int]:
        """What a file must open with to be read: the interpreter's bytecode magic number (as
        ``.pyc`` files) and the compiler flags."""
        return (MAGIC_NUMBER, self.flags)

    def _load(self) -> dict[str, bytes]:
        stored: Any = None
        if self.path is not None:
            try:
                stored = marshal.loads(self.path.read_bytes())
            except (OSError, ValueError, EOFError, TypeError):
                stored = None  # no file yet, or one this interpreter cannot read: compile
        ok = type(stored) is tuple and len(stored) == 2 and stored[0] == self.header
        checked: dict[str, bytes] = stored[1] if ok and type(stored[1]) is dict else {}
        self.stored = checked
        return checked

    def compiled(self, text: str) -> Any:
        """The code of ``text`` as ``exec`` in the module of :attr:`flags` compiles it."""
        found = self.code.get(text)
        if found is not None:
            return found
        stored = self.stored if self.stored is not None else self._load()
        blob = stored.get(text)
        if type(blob) is bytes:
            try:
                found = marshal.loads(blob)
            except (ValueError, EOFError, TypeError):
                found = None
        if type(found) is not _CODE:
            found = compile(text, "<string>", "exec", self.flags, dont_inherit=True)
            stored[text] = marshal.dumps(found)
            self.added += 1
        self.code[text] = found
        return found

    def save(self) -> None:
        """Write the file when texts were compiled (atomically: another process may read it);
        nothing when it cannot be written."""
        stored = self.stored
        if self.path is None or not self.added or stored is None or sys.dont_write_bytecode:
            return
        if len(stored) > MAX_ENTRIES:
            stored = {k: v for k, v in stored.items() if k in self.code}
        tmp = self.path.with_name(f"{self.path.name}.{os.getpid()}.tmp")
        try:
            self.path.parent.mkdir(exist_ok=True)
            fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, _mode())
            try:
                with os.fdopen(fd, "wb") as out:
                    out.write(marshal.dumps((self.header, stored)))
                os.replace(tmp, self.path)
            except BaseException:
                tmp.unlink(missing_ok=True)
                raise
        except OSError:
            return  # a read-only install: the classes are compiled each run, as without it
        self.added = 0


_CODE = type(CodeCache.save.__code__)


def _mode() -> int:
    """The file's permissions: those of this source file less execute, as for ``.pyc`` files."""
    try:
        return stat.S_IMODE(os.stat(__file__).st_mode) & 0o666
    except OSError:
        return 0o644


def _cache_path() -> Path | None:
    tag = sys.implementation.cache_tag
    if tag is None:
        return None
    return Path(__file__).resolve().parent.parent / "__pycache__" / f"dataclasses.{tag}.marshal"


def install() -> CodeCache | None:
    """Give ``dataclasses`` the caching ``exec`` (once per process; the cache it uses, or
    None when it cannot: an interpreter without a cache tag, or a ``dataclasses`` whose
    ``exec`` is already someone else's)."""
    current = getattr(dataclasses, "exec", None)
    if current is not None:
        return getattr(current, "cache", None)
    path = _cache_path()
    if path is None:
        return None
    cache = CodeCache(path, flags=future_flags(vars(dataclasses)))
    dataclasses.exec = caching_exec(cache)  # type: ignore[attr-defined]
    atexit.register(cache.save)
    return cache


def caching_exec(cache: CodeCache) -> Callable[..., None]:
    """``exec`` with the texts run in collsim modules' namespaces (``globals``) compiled by
    ``cache``; anything else passes to the built-in as it came."""
    run = builtins.exec
    compiled = cache.compiled

    def exec_(source: Any, globals: Any = None, locals: Any = None, /, **kw: Any) -> None:  # noqa: A002
        if (
            type(source) is str
            and type(globals) is dict
            and str(globals.get("__name__", "")).startswith(_PREFIX)
        ):
            source = compiled(source)
        run(source, globals, locals, **kw)

    exec_.cache = cache  # type: ignore[attr-defined]
    return exec_


def future_flags(namespace: dict[str, Any]) -> int:
    """The compiler flags of the ``from __future__`` imports of the module with
    ``namespace``: those its ``exec`` of a text passes on to the compiler."""
    flags = 0
    for value in namespace.values():
        if isinstance(value, __future__._Feature):
            flags |= value.compiler_flag
    return flags
