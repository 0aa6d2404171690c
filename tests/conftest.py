"""Shared fixtures. Keep these few and tiny."""

from __future__ import annotations

import importlib.util
import os
from collections.abc import Iterator
from pathlib import Path

import pytest
from hypothesis import settings

# Property tests draw the same examples on every run (a run judges the code, not the draw);
# tests that want fresh draws say so in their own settings.
settings.register_profile("collsim", derandomize=True, database=None)
settings.load_profile("collsim")

# The tests start collsim in child processes hundreds of times: those write and reuse bytecode
# and the dataclasses' compiled methods (collsim.core.classcode), as on a user's machine,
# instead of compiling the package anew in each one (PYTHONDONTWRITEBYTECODE, where the shell
# sets it, forbids both; tests that need it set it in their children's environment).
os.environ.pop("PYTHONDONTWRITEBYTECODE", None)

REPO = Path(__file__).resolve().parents[1]
SHARED = REPO.parent / "shared"

HAS_TORCH = importlib.util.find_spec("torch") is not None


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption(
        "--run-slow",
        action="store_true",
        default=False,
        help="also run the tests marked slow (the wheel install, long fuzz and sweep jobs)",
    )


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    skip_torch = pytest.mark.skip(reason="torch is not installed (the validate extra)")
    skip_slow = pytest.mark.skip(reason="slow: run with --run-slow")
    run_slow = config.getoption("--run-slow")
    for item in items:
        if "torch" in item.keywords and not HAS_TORCH:
            item.add_marker(skip_torch)
        if "slow" in item.keywords and not run_slow:
            item.add_marker(skip_slow)


@pytest.fixture(scope="session", autouse=True)
def _temporary_folders_stay_inside_the_run(
    tmp_path_factory: pytest.TempPathFactory,
) -> Iterator[None]:
    """Every temporary folder of the session (tempfile, and child processes through TMPDIR)
    goes under the session's own pytest folder, and the session ends with none of collsim's
    left in it: a leak fails the run at teardown instead of filling /tmp."""
    import shutil
    import tempfile

    folder = tmp_path_factory.mktemp("tmp")
    saved_env, saved_dir = os.environ.get("TMPDIR"), tempfile.tempdir
    os.environ["TMPDIR"] = str(folder)
    tempfile.tempdir = None  # re-read TMPDIR
    try:
        yield
    finally:
        if saved_env is None:
            os.environ.pop("TMPDIR", None)
        else:
            os.environ["TMPDIR"] = saved_env
        tempfile.tempdir = saved_dir
        left = sorted(p.name for p in folder.glob("collsim-*"))
        for path in folder.glob("collsim-*"):
            shutil.rmtree(path, ignore_errors=True)
        assert not left, f"temporary folders left behind by the tests: {left}"


@pytest.fixture
def repo() -> Path:
    """The repository root."""
    return REPO
