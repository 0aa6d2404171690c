"""Exit codes live on the exception classes and are mapped to the process exit once."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest
from click.testing import CliRunner

from collsim.cli import cli, main
from collsim.core import errors
from collsim.validate.measure.launch import RankFailure

REPO = Path(__file__).resolve().parents[2]
DDP = REPO / "scenarios" / "ddp_gpt3_1.3b.yaml"
#: 24 layers cannot split into 8 stages x 2 chunks: build_plan refuses it (parallel.virtual_stages)
BAD_PLAN = [
    "--set",
    "parallel.pp=8",
    "--set",
    "parallel.dp=1",
    "--set",
    "parallel.schedule=interleaved",
    "--set",
    "parallel.virtual_stages=2",
]


def test_exception_classes_carry_their_exit_codes() -> None:
    assert errors.ConfigError.exit_code == 2
    assert errors.ConfigErrors.exit_code == 2
    assert errors.LimitError.exit_code == 2
    assert errors.InfeasibleError.exit_code == 1
    assert errors.UnavailableError.exit_code == 3
    assert errors.SimulationError.exit_code == 70
    assert RankFailure.exit_code == 1


def test_no_subcommand_maps_exit_codes_itself() -> None:
    """sys.exit appears only in collsim/cli/__init__.py (the one mapping)."""
    offenders = []
    for path in sorted((REPO / "collsim").rglob("*.py")):
        if path == REPO / "collsim" / "cli" / "__init__.py":
            continue
        tree = ast.parse(path.read_text())
        for node in ast.walk(tree):
            if (
                isinstance(node, ast.Attribute)
                and node.attr == "exit"
                and isinstance(node.value, ast.Name)
                and node.value.id == "sys"
            ):
                offenders.append(f"{path.relative_to(REPO)}:{node.lineno}")
    assert offenders == []


def test_plot_timeline_exits_2_where_run_exits_2(tmp_path: Path) -> None:
    runner = CliRunner()
    run = runner.invoke(cli, ["run", str(DDP), *BAD_PLAN])
    plot = runner.invoke(
        cli, ["plot", "timeline", str(DDP), "-o", str(tmp_path / "t.png"), *BAD_PLAN]
    )
    assert run.exit_code == 2, run.output
    assert plot.exit_code == 2, plot.output
    assert plot.stderr == run.stderr
    assert plot.stderr.count("\n") == 1 and "virtual_stages" in plot.stderr
    assert not (tmp_path / "t.png").exists()


def test_main_uses_the_class_code(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as info:
        main(["run", str(DDP), "--set", "parallel.ddp.bucket_mb=.nan"])
    assert info.value.code == 2
    err = capsys.readouterr().err
    assert err == (
        "error: --set parallel.ddp.bucket_mb=.nan: parallel.ddp.bucket_mb: must be a finite "
        "number, got nan\n"
    )


def test_several_errors_print_one_line_each(capsys: pytest.CaptureFixture[str]) -> None:
    exc = errors.ConfigErrors(
        [
            errors.ConfigError("must be > 0, got -1", key_path="a.b", file="f.yaml", line=3),
            errors.ConfigError("unknown key", key_path="c", file="f.yaml", line=7),
        ]
    )
    assert exc.lines() == [
        "error: f.yaml:3: a.b: must be > 0, got -1",
        "error: f.yaml:7: c: unknown key",
    ]
    assert isinstance(exc, errors.ConfigError) and exc.exit_code == 2


def test_the_tree_in_errors_docstring_gives_each_class_its_code() -> None:
    """The tree drawn in collsim/core/errors.py names every CollsimError class and its exit code."""
    import re

    drawn = {
        m.group(1): int(m.group(2))
        for m in re.finditer(
            r"^\s*[│├└─ ]*(\w+Error\w*)\s.*?exit (\d+)\s*$", errors.__doc__ or "", re.M
        )
    }
    classes = {
        name: cls
        for name, cls in vars(errors).items()
        if isinstance(cls, type) and issubclass(cls, errors.CollsimError)
    }
    assert set(drawn) == set(classes)
    assert {name: cls.exit_code for name, cls in classes.items()} == drawn


def test_nothing_below_the_cli_edge_leaves_the_process() -> None:
    """No SystemExit, click Exit or context exit outside collsim/cli/__init__.py either (the
    ranks that collsim.validate.measure.launch spawns are processes of their own: they end with
    os._exit once their result is written)."""
    child_exits = {"collsim/validate/measure/launch.py"}
    offenders = []
    for path in sorted((REPO / "collsim").rglob("*.py")):
        if path == REPO / "collsim" / "cli" / "__init__.py":
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            name = node.id if isinstance(node, ast.Name) else None
            attr = node.attr if isinstance(node, ast.Attribute) else None
            if attr == "_exit" and str(path.relative_to(REPO)) in child_exits:
                continue
            if name in ("SystemExit", "exit", "quit") or attr in ("Exit", "_exit"):
                offenders.append(f"{path.relative_to(REPO)}:{node.lineno}")
            if attr == "exit" and not (isinstance(node.value, ast.Name) and node.value.id == "sys"):
                offenders.append(f"{path.relative_to(REPO)}:{node.lineno}")
    assert offenders == []
