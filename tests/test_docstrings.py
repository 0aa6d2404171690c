"""Module docstrings say what a module is for; derivations and measured timings live in docs/."""

from __future__ import annotations

import ast
import re
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[1] / "collsim"
MAX_MODULE_DOCSTRING_LINES = 30

#: How code used to quote the timings of the machine it was written on.
MACHINE_TIMING = re.compile(r"development (machine|VM)|\b2-core\b|2-vCPU|Xeon VM", re.I)


def test_module_docstrings_are_short() -> None:
    long = []
    for path in sorted(PACKAGE.rglob("*.py")):
        doc = ast.get_docstring(ast.parse(path.read_text(encoding="utf-8")), clean=False)
        if doc and doc.count("\n") + 1 > MAX_MODULE_DOCSTRING_LINES:
            long.append(f"{path.relative_to(PACKAGE.parent)}: {doc.count(chr(10)) + 1} lines")
    assert not long, "move the derivation to docs/derivations.md:\n" + "\n".join(long)


def test_no_timings_of_the_development_machine_in_code() -> None:
    quoted = [
        f"{path.relative_to(PACKAGE.parent)}:{number}: {line.strip()}"
        for path in sorted(PACKAGE.rglob("*.py"))
        for number, line in enumerate(path.read_text(encoding="utf-8").split("\n"), 1)
        if MACHINE_TIMING.search(line)
    ]
    assert not quoted, "move the figure to docs/derivations.md, Measurements:\n" + "\n".join(quoted)
