from __future__ import annotations

import subprocess
import sys

import collsim


def test_public_names_are_pinned() -> None:
    # the errors and the version, then the notebook API (collsim.api, loaded on first use)
    assert sorted(collsim.__all__) == sorted(
        [
            "__version__",
            "CollsimError",
            "CollsimWarning",
            "ConfigError",
            "InfeasibleError",
            "SimulationError",
            "simulate",
            "sweep",
            "collective",
            "goodput",
            "load",
        ]
    )
    for name in collsim.__all__:
        assert getattr(collsim, name) is not None


def test_the_api_is_not_imported_by_import_collsim() -> None:
    code = (
        "import sys, collsim; "
        "print(sorted(m for m in ('collsim.api', 'pandas', 'numpy', 'simpy') if m in sys.modules))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"
