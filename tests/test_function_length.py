"""No function in collsim over about 80 lines without a reason in its docstring.

A function's length is counted from its first statement after the docstring to its last line.
One longer than :data:`MAX_LINES` says why in its docstring, in a sentence that starts with
``Stays long:``.
"""

from __future__ import annotations

import ast
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
MAX_LINES = 80


def body_lines(node: ast.FunctionDef | ast.AsyncFunctionDef) -> int:
    """Lines from the first statement after the docstring to the end of the function."""
    body = node.body
    if ast.get_docstring(node) is not None:
        body = body[1:]
    if not body:
        return 0
    end = node.end_lineno if node.end_lineno is not None else body[-1].lineno
    return end - body[0].lineno + 1


def long_functions() -> dict[str, tuple[int, str]]:
    """``path:name`` -> (body lines, docstring) of every function over the limit."""
    found: dict[str, tuple[int, str]] = {}
    for path in sorted((REPO / "collsim").rglob("*.py")):
        tree = ast.parse(path.read_text(encoding="utf-8"))
        for node in ast.walk(tree):
            if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
                lines = body_lines(node)
                if lines > MAX_LINES:
                    key = f"{path.relative_to(REPO).as_posix()}:{node.name}"
                    found[key] = (lines, ast.get_docstring(node) or "")
    return found


def test_body_lines_skip_the_docstring() -> None:
    code = 'def f():\n    """doc\n\n    more."""\n    a = 1\n    return a\n'
    node = ast.parse(code).body[0]
    assert isinstance(node, ast.FunctionDef)
    assert body_lines(node) == 2


def test_a_function_over_the_limit_is_counted_long() -> None:
    code = "def f():\n" + "".join(f"    a{i} = {i}\n" for i in range(MAX_LINES + 1))
    node = ast.parse(code).body[0]
    assert isinstance(node, ast.FunctionDef)
    assert body_lines(node) == MAX_LINES + 1


def test_long_functions_say_why() -> None:
    unexplained = sorted(
        f"{key} ({lines} lines)"
        for key, (lines, doc) in long_functions().items()
        if "Stays long:" not in doc
    )
    assert unexplained == [], "split these or say why in the docstring ('Stays long: ...')"
