"""collsim: collective-communication simulator and cost modeller for distributed training.

Closed-form cost models and a SimPy discrete-event simulation of collectives and training steps
on GPU clusters, checked against torch.distributed measurements (``collsim.validate``).
"""

from __future__ import annotations

from collsim.errors import (
    CollsimError,
    CollsimWarning,
    ConfigError,
    InfeasibleError,
    SimulationError,
)

__version__ = "0.1.0"

__all__ = [
    "__version__",
    "CollsimError",
    "CollsimWarning",
    "ConfigError",
    "InfeasibleError",
    "SimulationError",
]
