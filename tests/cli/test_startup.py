"""What the ``collsim`` process does around its command to start and end cheaply."""

from __future__ import annotations

import gc
import os
import subprocess
import sys
from pathlib import Path

import pytest

from collsim.cli import BLAS_THREAD_VARIABLES, main, one_blas_thread

ROOT = Path(__file__).resolve().parents[2]


def _python(code: str, **env: str) -> subprocess.CompletedProcess[str]:
    clean = {k: v for k, v in os.environ.items() if k not in BLAS_THREAD_VARIABLES}
    return subprocess.run(
        [sys.executable, "-c", code],
        capture_output=True,
        text=True,
        timeout=120,
        check=True,
        cwd=ROOT,
        env={**clean, "PYTHONPATH": str(ROOT), **env},
    )


@pytest.mark.skipif(not Path("/proc/self/task").is_dir(), reason="threads counted in /proc")
def test_numpy_starts_no_blas_threads_in_the_collsim_process() -> None:
    code = (
        "import os\nfrom collsim.cli import one_blas_thread\none_blas_thread()\n"
        "import numpy\nprint(len(os.listdir('/proc/self/task')), os.environ.get("
        "'OPENBLAS_NUM_THREADS'))"
    )
    assert _python(code).stdout.split() == ["1", "1"]


def test_a_thread_count_the_user_chose_is_kept(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in BLAS_THREAD_VARIABLES:
        monkeypatch.delenv(name, raising=False)
    monkeypatch.delitem(sys.modules, "numpy", raising=False)
    monkeypatch.setenv("OMP_NUM_THREADS", "3")
    one_blas_thread()
    assert "OPENBLAS_NUM_THREADS" not in os.environ
    monkeypatch.delenv("OMP_NUM_THREADS")
    one_blas_thread()
    assert os.environ["OPENBLAS_NUM_THREADS"] == "1"


def test_nothing_is_set_once_numpy_is_loaded(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in BLAS_THREAD_VARIABLES:
        monkeypatch.delenv(name, raising=False)
    import numpy  # noqa: F401

    one_blas_thread()
    assert "OPENBLAS_NUM_THREADS" not in os.environ


def _console(*argv: str) -> list[str]:
    """The last line a ``collsim ARGV`` process prints at exit: whether the collector is frozen,
    and its OPENBLAS_NUM_THREADS."""
    code = (
        f"import atexit, gc, os, sys\nsys.argv = ['collsim', *{list(argv)!r}]\n"
        "atexit.register(lambda: print(gc.get_freeze_count() > 0, "
        "os.environ.get('OPENBLAS_NUM_THREADS')))\n"
        "from collsim.cli import main\nmain()"
    )
    return _python(code).stdout.splitlines()[-1].split()


def test_the_console_process_freezes_the_collector_at_the_end() -> None:
    assert _console("--version") == ["True", "1"]


def test_validate_runs_as_it_is() -> None:
    assert _console("validate", "--help") == ["False", "None"]


def test_a_call_with_arguments_leaves_the_collector_alone() -> None:
    before = gc.get_freeze_count()
    main(["--version"])
    assert gc.get_freeze_count() == before
