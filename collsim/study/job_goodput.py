"""The goodput of a job (:mod:`collsim.study.job`): a simulated scenario's reliability
section, checkpoint state and step turned into the inputs of :mod:`collsim.study.goodput`, and
its goodput over a run, at a fleet's failure rate or at every published fleet's, as
``collsim goodput``, ``collsim run`` (its one goodput line) and the notebook API compute it.
Kept apart from the job so that a step that needs no goodput loads none of its models.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from collsim.core.errors import ConfigError
from collsim.study.goodput.costs import checkpoint_state, job_costs
from collsim.study.goodput.estimate import estimate_goodput
from collsim.study.goodput.fleets import at_rate, find_fleets, levels
from collsim.study.job import Job, Overrides, load, run_job

if TYPE_CHECKING:
    from collsim.cluster.topology import Topology
    from collsim.step.result import StepResult
    from collsim.study.goodput.costs import JobCosts
    from collsim.study.goodput.estimate import GoodputResult
    from collsim.study.goodput.fleets import Fleet
    from collsim.study.limits import Limits
    from collsim.study.scenario import Scenario

__all__ = [
    "DEFAULT_DAYS",
    "DEFAULT_RUNS",
    "scenario_costs",
    "job_goodput",
    "scenario_goodput",
    "require_reliability",
    "job_at_rate",
    "job_fleet_goodput",
]

DEFAULT_DAYS = 30.0
"""Run length of a goodput estimate when neither the caller nor ``reliability.duration_days``
gives one (issue 14)."""

DEFAULT_RUNS = 1000
"""Monte Carlo runs of a goodput estimate when the caller gives none."""


def scenario_costs(scenario: Scenario, topology: Topology, result: StepResult) -> JobCosts:
    """The goodput inputs of a simulated scenario: its reliability section, the plan's
    checkpoint state and the step.

    Raises:
        ConfigError: no reliability section, or an interval shorter than a checkpoint write
            (located in the scenario file).
    """

    reliability = scenario.reliability
    if reliability is None:
        raise scenario.locate(ConfigError("missing required section", key_path="reliability"))
    gpus_per_node = max(1, int(topology.gpus_per_node))
    num_nodes = math.ceil(scenario.parallel.world_size / gpus_per_node)
    try:
        return job_costs(
            reliability,
            state=checkpoint_state(scenario.model, scenario.training, scenario.parallel),
            num_nodes=num_nodes,
            step_time_s=result.step_time_s,
            tokens_per_step=float(scenario.training.global_batch * scenario.model.seq_len),
        )
    except ConfigError as exc:
        raise scenario.locate(exc) from None


def job_goodput(
    job: Job,
    *,
    days: float | None = None,
    runs: int = DEFAULT_RUNS,
    seed: int = 0,
    monte_carlo: bool = True,
) -> GoodputResult:
    """The goodput of a simulated job over ``days`` (else ``reliability.duration_days``, else
    :data:`DEFAULT_DAYS`): the closed form and, with ``monte_carlo``, ``runs`` seeded runs.

    Raises:
        ConfigError: the scenario has no reliability section (or a bad one).
    """

    scenario = job.scenario
    costs = scenario_costs(scenario, job.topology, job.result)
    assert scenario.reliability is not None  # scenario_costs raised otherwise
    run_days = days or scenario.reliability.duration_days or DEFAULT_DAYS
    if not monte_carlo:
        return estimate_goodput(costs, scenario.reliability, days=run_days, monte_carlo=False)
    return estimate_goodput(costs, scenario.reliability, days=run_days, runs=runs, seed=seed)


def scenario_goodput(
    scenario: str | Path | Scenario | Mapping[str, Any],
    overrides: Overrides = None,
    *,
    days: float | None = None,
    runs: int = DEFAULT_RUNS,
    seed: int = 0,
    monte_carlo: bool = True,
    limits: Limits | None = None,
    fleet: str | None = None,
) -> GoodputResult:
    """The goodput of ``scenario`` as ``collsim goodput`` computes it: the scenario loaded and
    checked for a reliability section before its step is simulated, then :func:`job_goodput`;
    ``fleet`` (a published fleet's name or a YAML file of one fleet) puts the plan at that
    fleet's failure rate, as ``collsim goodput --fleet``.

    Raises:
        ConfigError: bad input, no reliability section, or a fleet that is not one fleet.
    """
    fleets = find_fleets(fleet) if fleet is not None else []
    if len(fleets) > 1:
        raise ConfigError(f"{fleet} holds {len(fleets)} fleets; give one", key_path="fleet")
    loaded = load(scenario, overrides)
    require_reliability(loaded)
    job = run_job(loaded, limits=limits)
    if fleets:
        job = job_at_rate(job, fleets[0].per_1000_node_days)
    return job_goodput(job, days=days, runs=runs, seed=seed, monte_carlo=monte_carlo)


def require_reliability(scenario: Scenario) -> None:
    """Raise the one-line error of a goodput study of a scenario without ``reliability``."""
    if scenario.reliability is None:
        raise ConfigError(
            "missing required section (collsim goodput needs it)",
            key_path="reliability",
            file=str(scenario.source) if scenario.source is not None else None,
        )


def job_at_rate(job: Job, per_1000_node_days: float) -> Job:
    """``job`` with its reliability section put at a fleet's failure rate
    (:func:`collsim.study.goodput.fleets.at_rate`); the step does not depend on the rate.

    Raises:
        ConfigError: no reliability section, or components that add up to 0.
    """

    require_reliability(job.scenario)
    assert job.scenario.reliability is not None
    rel = at_rate(job.scenario.reliability, per_1000_node_days)
    return dataclasses.replace(job, scenario=dataclasses.replace(job.scenario, reliability=rel))


def job_fleet_goodput(
    job: Job,
    fleets: Sequence[Fleet],
    *,
    days: float | None = None,
    runs: int = DEFAULT_RUNS,
    seed: int = 0,
) -> list[tuple[str, Fleet, GoodputResult]]:
    """(level, fleet, goodput) of ``job`` at each fleet's rate, fleets ordered and named by
    :func:`collsim.study.goodput.fleets.levels`, each with ``runs`` seeded Monte Carlo runs."""

    return [
        (
            level,
            fleet,
            job_goodput(
                job_at_rate(job, fleet.per_1000_node_days), days=days, runs=runs, seed=seed
            ),
        )
        for level, fleet in levels(list(fleets))
    ]
