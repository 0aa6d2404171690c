"""Goodput of long training jobs: failures, checkpoints, restarts, spares.

- :mod:`collsim.study.goodput.config`: the ``reliability`` scenario section (frozen dataclasses and
  its reader over a :class:`collsim.core.yamlio.ConfigReader`);
- :mod:`collsim.study.goodput.costs`: checkpoint size from the plan, write / load / restart times;
- :mod:`collsim.study.goodput.closed_form`: Young and Daly intervals and the exact renewal ratio;
- :mod:`collsim.study.goodput.montecarlo`: the seeded Monte Carlo of the job's timeline;
- :mod:`collsim.study.goodput.estimate`: both side by side, with the best interval and its spread.

The package namespace holds the parts without numpy (the scenario loader imports the config);
import :mod:`collsim.study.goodput.estimate` for the Monte Carlo.

Example::

    from collsim.study.goodput.estimate import estimate_goodput

    costs = job_costs(reliability, state=checkpoint_state(spec, training, parallel),
                      num_nodes=2048, step_time_s=12.0, tokens_per_step=16.8e6)
    result = estimate_goodput(costs, reliability, days=54, runs=1000, seed=0)
    result.closed_form.effective_training_time_ratio
"""

from __future__ import annotations

from collsim.study.goodput.closed_form import (
    daly_interval_s,
    effective_training_time_ratio,
    optimal_interval_s,
    renewal_breakdown,
    young_interval_s,
)
from collsim.study.goodput.config import (
    COMPONENTS,
    CheckpointConfig,
    ComponentRate,
    ReliabilityConfig,
    RestartConfig,
    SparesConfig,
    StorageConfig,
    read_reliability,
)
from collsim.study.goodput.costs import CheckpointState, JobCosts, checkpoint_state, job_costs

__all__ = [
    "COMPONENTS",
    "CheckpointConfig",
    "CheckpointState",
    "ComponentRate",
    "JobCosts",
    "ReliabilityConfig",
    "RestartConfig",
    "SparesConfig",
    "StorageConfig",
    "checkpoint_state",
    "daly_interval_s",
    "effective_training_time_ratio",
    "job_costs",
    "optimal_interval_s",
    "read_reliability",
    "renewal_breakdown",
    "young_interval_s",
]
