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


def test_each_error_name_is_the_class_collsim_raises() -> None:
    import re
    import warnings
    from pathlib import Path

    import pytest

    from collsim.cluster.topology import load_topology
    from collsim.core import errors
    from collsim.parallel.config import ParallelConfig, TrainingConfig
    from collsim.parallel.plan import build_plan
    from collsim.workload.presets import get_preset

    pyproject = (Path(__file__).resolve().parents[1] / "pyproject.toml").read_text()
    assert re.search(rf'^version = "{re.escape(collsim.__version__)}"', pyproject, re.M)
    for name in ("CollsimError", "ConfigError", "InfeasibleError", "SimulationError"):
        assert getattr(collsim, name) is getattr(errors, name)
    scenario = Path(__file__).resolve().parents[1] / "scenarios" / "ddp_gpt3_1.3b.yaml"
    with pytest.raises(collsim.ConfigError, match="parallel.zerro") as bad:
        collsim.simulate(scenario, {"parallel.zerro": 1})
    assert isinstance(bad.value, collsim.CollsimError)
    from collsim.study.sweep import cluster_for

    with pytest.raises(collsim.InfeasibleError) as far:
        cluster_for("dgx_h100", 12, None)  # not a whole number of 8-GPU nodes
    assert far.value.reason == "gpus" and isinstance(far.value, collsim.CollsimError)
    assert issubclass(collsim.SimulationError, collsim.CollsimError)
    # a plan with fewer micro-batches than stages warns with CollsimWarning
    topo = load_topology("dgx_h100", nodes=1)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always", collsim.CollsimWarning)
        build_plan(
            topo,
            get_preset("gpt3-350m"),
            TrainingConfig(global_batch=2, micro_batch=1),
            ParallelConfig(tp=1, pp=4, dp=2),
        )
    assert any(issubclass(w.category, collsim.CollsimWarning) for w in caught)
