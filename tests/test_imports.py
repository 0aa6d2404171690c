"""The import graph of collsim: no cycle between its modules, the glossary at the bottom.

The graph is read from the source with :mod:`ast` and holds every import: at module level,
under ``if TYPE_CHECKING:`` and inside functions, since each says that one module needs another
(a late import only hides a circle). Importing ``a.b.c`` runs ``a/__init__.py`` and
``a/b/__init__.py`` first, so an import also depends on the packages above its target.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[1] / "collsim"


def _module_names() -> dict[str, Path]:
    names: dict[str, Path] = {}
    for path in PACKAGE.rglob("*.py"):
        parts = list(path.relative_to(PACKAGE.parent).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts = parts[:-1]
        names[".".join(parts)] = path
    return names


MODULES = _module_names()


def _imports(tree: ast.AST) -> list[ast.Import | ast.ImportFrom]:
    """Every import statement of a module, wherever it stands."""
    return [node for node in ast.walk(tree) if isinstance(node, ast.Import | ast.ImportFrom)]


def _known(name: str) -> str | None:
    """The collsim module ``name`` names, or the module that defines it (``a.b.attr``)."""
    while name and name not in MODULES:
        name = name.rpartition(".")[0]
    return name or None


def _targets(module: str, node: ast.Import | ast.ImportFrom) -> set[str]:
    is_package = MODULES[module].name == "__init__.py"
    if isinstance(node, ast.Import):
        names = [alias.name for alias in node.names]
    else:
        base = node.module or ""
        if node.level:
            parts = module.split(".") if is_package else module.split(".")[:-1]
            parts = parts[: len(parts) - node.level + 1]
            base = ".".join(parts + ([node.module] if node.module else []))
        # ``from pkg import sub`` imports the submodule; ``from mod import name`` the module
        names = [f"{base}.{alias.name}" for alias in node.names]
    out: set[str] = set()
    for name in names:
        target = _known(name)
        if target is None or not target.startswith("collsim"):
            continue
        parts = target.split(".")
        out.update(".".join(parts[:i]) for i in range(1, len(parts) + 1))
    # a module's own package is already being imported when it runs
    return {t for t in out if t != module and not module.startswith(t + ".")}


def import_graph() -> dict[str, set[str]]:
    """collsim module -> the collsim modules its import runs."""
    graph: dict[str, set[str]] = {}
    for module, path in MODULES.items():
        tree = ast.parse(path.read_text(encoding="utf-8"), filename=str(path))
        deps: set[str] = set()
        for node in _imports(tree):
            deps |= _targets(module, node)
        graph[module] = deps
    return graph


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One cycle of ``graph`` as a path ``[a, b, ..., a]``, or None."""
    state: dict[str, int] = {}  # 1: on the current path, 2: done
    path: list[str] = []

    def visit(node: str) -> list[str] | None:
        state[node] = 1
        path.append(node)
        for dep in sorted(graph.get(node, ())):
            if state.get(dep) == 1:
                return path[path.index(dep) :] + [dep]
            if dep not in state:
                found = visit(dep)
                if found:
                    return found
        path.pop()
        state[node] = 2
        return None

    for node in sorted(graph):
        if node not in state:
            found = visit(node)
            if found:
                return found
    return None


def test_the_walker_sees_the_imports() -> None:
    graph = import_graph()
    assert len(graph) > 50
    # a plain import; ``from package import submodule``; a TYPE_CHECKING-only import
    assert "collsim.cluster.topology" in graph["collsim.collectives.types"]
    assert "collsim.collectives.tuner" in graph["collsim.collectives.nvls"]
    assert "collsim.cluster.topology" in graph["collsim.collectives.memo"]
    # an import of a submodule runs the packages above it; relative imports resolve
    node = ast.parse("from collsim.collectives.select import cost").body[0]
    assert isinstance(node, ast.ImportFrom)
    assert _targets("collsim.play.engine.core", node) == {
        "collsim.collectives",
        "collsim.collectives.select",
    }
    node = ast.parse("from .streams import Work").body[0]
    assert isinstance(node, ast.ImportFrom)
    assert _targets("collsim.play.engine.core", node) == {"collsim.play.engine.streams"}
    # a function-local import and a TYPE_CHECKING import are edges too
    tree = ast.parse(
        "if TYPE_CHECKING:\n    import collsim.api\ndef f():\n    import collsim.cli\n"
    )
    assert {_targets("collsim.play.engine.core", n).pop() for n in _imports(tree)} == {
        "collsim.api",
        "collsim.cli",
    }


def test_find_cycle_finds_one() -> None:
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": set()}) == ["a", "b", "c", "a"]
    assert find_cycle({"a": {"b"}, "b": set()}) is None


def test_no_import_cycle_inside_collsim() -> None:
    cycle = find_cycle(import_graph())
    assert cycle is None, "import cycle: " + " -> ".join(cycle or [])


@pytest.mark.parametrize("leaf", ["collsim.core.errors", "collsim.core.vocab"])
def test_the_glossary_and_the_errors_sit_at_the_bottom(leaf: str) -> None:
    # vocab names every enum and raises ConfigError on a bad name; errors imports nothing
    allowed = {"collsim.core.errors": set(), "collsim.core.vocab": {"collsim.core.errors"}}[leaf]
    assert import_graph()[leaf] == allowed


def _function_local_imports(tree: ast.AST) -> list[ast.Import | ast.ImportFrom]:
    found: list[ast.Import | ast.ImportFrom] = []
    for node in ast.walk(tree):
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef | ast.Lambda):
            found += [n for n in ast.walk(node) if isinstance(n, ast.Import | ast.ImportFrom)]
    return list({id(n): n for n in found}.values())  # nested functions are walked twice


#: What a library module may import late: torch (optional, the validate extra), and pandas and
#: matplotlib with the report modules built on them (the run path stays light without them:
#: tests/report/test_report_trace.py); orjson and ijson, optional readers of large profiler
#: traces (collsim.validate.data.kineto falls back to json without them); distributed, the
#: optional Dask backend of collsim.core.jobs (the local pool runs without it), and
#: collsim.core.dask_worker, its worker side, which imports distributed; hashlib (OpenSSL's
#: bindings, 2-5 ms of start-up), digested only by a search's replay memo
#: (collsim.step.replay_events), and difflib, asked only for a misspelt key (collsim.core.yamlio).
HEAVY = (
    "hashlib",
    "difflib",
    "torch",
    "pandas",
    "matplotlib",
    "orjson",
    "ijson",
    "distributed",
    "collsim.core.dask_worker",
    "collsim.report.frames",
    "collsim.report.plots",
)


def _imports_heavy(node: ast.Import | ast.ImportFrom) -> bool:
    names = [a.name for a in node.names] if isinstance(node, ast.Import) else [node.module or ""]
    return all(any(n == h or n.startswith(h + ".") for h in HEAVY) for n in names)


def _has_reason(lines: list[str], node: ast.stmt, run: dict[int, ast.stmt]) -> bool:
    """A comment on the import, or on the line above the run of imports it belongs to."""
    while True:
        end = node.end_lineno or node.lineno
        if any("#" in lines[i - 1] for i in range(node.lineno, end + 1)):
            return True
        above = node.lineno - 1
        if above not in run:
            return above >= 1 and lines[above - 1].strip().startswith("#")
        node = run[above]


def test_function_local_imports_are_for_start_up_and_say_why() -> None:
    # cli/ and api.py load layers late so that start-up stays cheap; torch is optional (the
    # validate extra) and loads only where ranks run, pandas and matplotlib only where a frame
    # or a figure is made; everything else imports at the top
    wrong: list[str] = []
    for module, path in MODULES.items():
        lines = path.read_text(encoding="utf-8").split("\n")
        tree = ast.parse("\n".join(lines), filename=str(path))
        late = _function_local_imports(tree)
        run: dict[int, ast.stmt] = {(n.end_lineno or n.lineno): n for n in late}
        for node in late:
            where = f"{path.relative_to(PACKAGE.parent)}:{node.lineno}: {ast.unparse(node)}"
            start_up = module in ("collsim.api", "collsim.cli") or module.startswith("collsim.cli.")
            if not (start_up or _imports_heavy(node)):
                wrong.append(f"{where} (import it at the top)")
            elif not _has_reason(lines, node, run):
                wrong.append(f"{where} (say why it is late)")
    assert not wrong, "\n".join(wrong)


#: The layers of DESIGN.md, top to bottom: a module imports only its own layer or those below.
#: ``collsim/__init__.py`` stands with the notebook API at the top (it loads it on first use).
LAYERS = (
    "cli",
    "api",
    "validate",
    "report",
    "study",
    "play",
    "step",
    "parallel",
    "workload",
    "collectives",
    "cluster",
    "core",
)


def layer_of(module: str) -> int:
    """The index of ``module``'s layer in :data:`LAYERS` (0 = the top)."""
    parts = module.split(".")
    if parts == ["collsim"]:
        return LAYERS.index("api")
    return LAYERS.index(parts[1])


def _named_targets(module: str, node: ast.Import | ast.ImportFrom) -> set[str]:
    """The modules an import names, without the packages above them that importing runs
    (every import runs ``collsim/__init__.py``, which imports only :mod:`collsim.core.errors`)."""
    deps = _targets(module, node)
    return {t for t in deps if not any(d.startswith(t + ".") for d in deps)}


def layer_violations() -> list[str]:
    """``a -> b`` for every import of a module ``b`` in a layer above ``a``'s."""
    wrong: list[str] = []
    for module, path in sorted(MODULES.items()):
        tree = ast.parse(path.read_text(encoding="utf-8"), filename=str(path))
        for node in _imports(tree):
            for target in sorted(_named_targets(module, node)):
                if layer_of(target) < layer_of(module):
                    wrong.append(f"{module} -> {target} (line {node.lineno})")
    return wrong


def test_every_module_has_a_layer() -> None:
    assert {m.split(".")[1] for m in MODULES if m != "collsim"} == set(LAYERS)
    validate = layer_of("collsim.validate.measure.bench")
    assert layer_of("collsim") == layer_of("collsim.api") < validate
    assert layer_of("collsim.cli.run") == 0 and layer_of("collsim.core.errors") == len(LAYERS) - 1


def test_the_layer_check_sees_an_upward_import() -> None:
    node = ast.parse("from collsim.workload.kernels import MeasuredTables").body[0]
    assert isinstance(node, ast.ImportFrom)
    # the import names the module and runs the packages above it; only the module is an edge
    assert _named_targets("collsim.cluster.hardware", node) == {"collsim.workload.kernels"}
    assert layer_of("collsim.workload.kernels") < layer_of("collsim.cluster.hardware")


def test_imports_flow_down_the_layers() -> None:
    wrong = layer_violations()
    assert not wrong, "imports against the layers of DESIGN.md:\n" + "\n".join(wrong)
