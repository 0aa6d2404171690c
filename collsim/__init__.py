"""collsim: collective-communication simulator and cost modeller for distributed training.

Closed-form cost models and a SimPy discrete-event simulation of collectives and training steps
on GPU clusters, checked against torch.distributed measurements (``collsim.validate``).

The notebook API (:mod:`collsim.api`) is loaded on first use, so that ``import collsim`` and the
command line stay fast::

    import collsim
    sim = collsim.simulate("scenarios/3d_175b.yaml", overrides={"parallel.dp": 8,
                                                                "cluster.nodes": 64})

The modules behind ``collsim.sweep`` and ``collsim.goodput`` live in :mod:`collsim.study`, so
each exported name is one thing: a function of the API.
"""

from __future__ import annotations

import importlib
from typing import Any

from collsim.core.classcode import install
from collsim.core.errors import (
    CollsimError,
    CollsimWarning,
    ConfigError,
    InfeasibleError,
    SimulationError,
)

install()  # before any module with dataclasses: they reuse their compiled methods

__version__ = "0.1.0"

#: API functions loaded from collsim.api on first use.
_API = ("simulate", "sweep", "collective", "goodput", "load")

__all__ = [
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


def __getattr__(name: str) -> Any:
    if name in _API:
        return getattr(importlib.import_module("collsim.api"), name)
    raise AttributeError(f"module 'collsim' has no attribute {name!r}")
