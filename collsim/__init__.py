"""collsim: collective-communication simulator and cost modeller for distributed training.

Closed-form cost models and a SimPy discrete-event simulation of collectives and training steps
on GPU clusters, checked against torch.distributed measurements (``collsim.validate``).

The notebook API (:mod:`collsim.api`) is loaded on first use, so that ``import collsim`` and the
command line stay fast::

    import collsim
    sim = collsim.simulate("scenarios/3d_175b.yaml", overrides={"parallel.dp": 8,
                                                                "cluster.nodes": 64})

``collsim.sweep`` and ``collsim.goodput`` are both functions of the API and modules of the
package. The names stay the functions: the package keeps a callable stand-in under each name
that calls the API function and reads and writes every other attribute through to the module
(``collsim.sweep.run_point`` is the module's), while ``from collsim.sweep import ...`` and
``import collsim.sweep`` import the module as usual.
"""

from __future__ import annotations

import importlib
import sys
import types
from typing import Any

from collsim.errors import (
    CollsimError,
    CollsimWarning,
    ConfigError,
    InfeasibleError,
    SimulationError,
)

__version__ = "0.1.0"

#: API functions loaded from collsim.api on first use.
_API = ("simulate", "sweep", "collective", "goodput", "load")
#: API names that are also modules of the package.
_MODULE_NAMES = frozenset({"sweep", "goodput"})

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


class _FunctionAndModule:
    """``collsim.sweep``: calls ``collsim.api.sweep``; other attributes are the module's."""

    def __init__(self, name: str) -> None:
        object.__setattr__(self, "_name", name)

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        api = importlib.import_module("collsim.api")
        return getattr(api, self._name)(*args, **kwargs)

    def _module(self) -> types.ModuleType:
        return importlib.import_module(f"collsim.{self._name}")

    def __getattr__(self, attr: str) -> Any:
        return getattr(self._module(), attr)

    def __setattr__(self, attr: str, value: Any) -> None:
        setattr(self._module(), attr, value)

    def __delattr__(self, attr: str) -> None:
        delattr(self._module(), attr)

    def __repr__(self) -> str:
        return f"<collsim.{self._name}: function of collsim.api and module collsim.{self._name}>"


_STAND_INS = {name: _FunctionAndModule(name) for name in _MODULE_NAMES}


class _Package(types.ModuleType):
    """The package module: importing ``collsim.sweep`` does not replace ``collsim.sweep()``."""

    def __setattr__(self, name: str, value: Any) -> None:
        if name in _MODULE_NAMES and isinstance(value, types.ModuleType):
            return  # the submodule stays in sys.modules; the name stays the stand-in
        super().__setattr__(name, value)


def __getattr__(name: str) -> Any:
    if name in _STAND_INS:
        return _STAND_INS[name]
    if name in _API:
        return getattr(importlib.import_module("collsim.api"), name)
    raise AttributeError(f"module 'collsim' has no attribute {name!r}")


sys.modules[__name__].__class__ = _Package
