"""The one way a scenario becomes a simulated step: every caller (``collsim run``, ``sweep``,
``search``, ``goodput``, ``plot`` and the notebook API) loads, checks and simulates through
here, so two callers given the same file and options cannot give different steps. A job is a
scenario (a file, a loaded scenario or a mapping) with ``--set`` overrides, checked against the
resource limits before its cluster is built, then its cluster, its validated step inputs
(:class:`StepInputs`, the scenario's stragglers included) and the step of the chosen fidelity
(the engine, or the closed form of the same schedule), with the CollsimWarnings raised on the way.
"""

from __future__ import annotations

import dataclasses
import json
import math
import warnings
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from collsim.core.errors import CollsimWarning, ConfigError
from collsim.core.yamlio import YamlDoc
from collsim.play.engine import simulate_step
from collsim.play.walk import estimate_step
from collsim.study.goodput.costs import checkpoint_state, job_costs
from collsim.study.goodput.estimate import estimate_goodput
from collsim.study.goodput.fleets import at_rate, find_fleets, levels
from collsim.study.limits import check_scenario
from collsim.study.scenario import Scenario, load_scenario, scenario_from_doc

if TYPE_CHECKING:
    from collsim.cluster.topology import Topology
    from collsim.parallel.config import ParallelConfig, TrainingConfig
    from collsim.step.result import StepResult
    from collsim.step.stragglers import StragglerConfig
    from collsim.study.goodput.costs import JobCosts
    from collsim.study.goodput.estimate import GoodputResult
    from collsim.study.goodput.fleets import Fleet
    from collsim.study.limits import Limits
    from collsim.study.scenario import Scenario
    from collsim.workload.model import TransformerSpec

__all__ = [
    "FIDELITIES",
    "DEFAULT_DAYS",
    "DEFAULT_RUNS",
    "Overrides",
    "StepInputs",
    "Job",
    "load",
    "scenario_topology",
    "simulate_inputs",
    "scenario_step",
    "run_job",
    "scenario_costs",
    "job_goodput",
    "scenario_goodput",
    "require_reliability",
    "job_at_rate",
    "job_fleet_goodput",
]

FIDELITIES = ("auto", "fused", "layer", "closed")
"""The engine's granularities (``collsim.play.engine.step.FIDELITIES``) and ``closed``, the closed
form of the same schedule (``collsim.play.walk``)."""

DEFAULT_DAYS = 30.0
"""Run length of a goodput estimate when neither the caller nor ``reliability.duration_days``
gives one (issue 14)."""

DEFAULT_RUNS = 1000
"""Monte Carlo runs of a goodput estimate when the caller gives none."""

Overrides = Mapping[str, Any] | Sequence[str] | None
"""``{"parallel.dp": 16}`` or ``["parallel.dp=16"]``: applied as ``--set`` is."""


def override_texts(overrides: Overrides) -> list[str]:
    """``{"parallel.dp": 16}`` or ``["parallel.dp=16"]`` as ``--set`` strings."""
    if overrides is None:
        return []
    if isinstance(overrides, Mapping):
        return [f"{key}={json.dumps(value)}" for key, value in overrides.items()]
    if isinstance(overrides, str):
        raise ConfigError("give overrides as a mapping or a list of 'key=value' strings")
    return [str(text) for text in overrides]


def load(
    scenario: str | Path | Scenario | Mapping[str, Any], overrides: Overrides = None
) -> Scenario:
    """A scenario from a file, a loaded :class:`~collsim.study.scenario.Scenario` or a mapping, with
    the overrides applied as ``--set`` applies them (same checks, same error locations)."""

    texts = override_texts(overrides)
    if isinstance(scenario, Scenario):
        if not texts:
            return scenario
        if scenario.doc is None:
            raise ConfigError("this scenario has no document to apply overrides to")
        texts = [o.text for o in scenario.overrides] + texts
        return scenario_from_doc(scenario.doc, texts, source=scenario.source)
    if isinstance(scenario, Mapping):
        return scenario_from_doc(YamlDoc(data=dict(scenario), file="<scenario>"), texts)
    return load_scenario(scenario, texts)


def scenario_topology(scenario: Scenario) -> Topology:
    """The scenario's cluster; topology errors without a file are pointed at ``cluster``."""
    try:
        return scenario.cluster.load()
    except ConfigError as exc:
        if exc.file is not None:
            raise
        key = exc.key_path or ""
        if not key.startswith("cluster."):
            key = "cluster.nodes" if key.endswith("nodes") else "cluster.topology"
        raise scenario.locate(ConfigError(exc.message, key_path=key)) from None


@dataclass(frozen=True, slots=True)
class StepInputs:
    """What one step is simulated from: the cluster, the model, the training and parallel
    sections and the stragglers (None: every GPU and link at its nominal speed)."""

    topology: Topology
    spec: TransformerSpec
    training: TrainingConfig
    parallel: ParallelConfig
    stragglers: StragglerConfig | None = None

    @classmethod
    def of(cls, scenario: Scenario, topology: Topology) -> StepInputs:
        """The inputs of a loaded scenario on its cluster, its ``stragglers`` section included."""
        return cls(
            topology, scenario.model, scenario.training, scenario.parallel, scenario.stragglers
        )


def simulate_inputs(
    inputs: StepInputs, *, fidelity: str = "auto", all_ranks: bool = False, trace: bool = False
) -> StepResult:
    """The step of ``inputs`` at ``fidelity`` (:data:`FIDELITIES`): the engine's, or with
    ``closed`` the closed form of the same schedule.

    Raises:
        ConfigError: a bad plan (key path, no file), or ``closed`` with ``all_ranks`` or a
            trace (``--fidelity``).
    """
    if fidelity == "closed":
        if all_ranks or trace:
            raise ConfigError(
                "the closed form walks one rank per stage and keeps no trace; use --fidelity "
                "auto, fused or layer with --all-ranks, --trace or --plot",
                key_path="--fidelity",
            )

        return estimate_step(
            inputs.topology,
            inputs.spec,
            inputs.training,
            inputs.parallel,
            stragglers=inputs.stragglers,
        )

    return simulate_step(
        inputs.topology,
        inputs.spec,
        inputs.training,
        inputs.parallel,
        all_ranks=all_ranks,
        trace=trace,
        fidelity=fidelity,
        stragglers=inputs.stragglers,
    )


def scenario_step(
    scenario: Scenario,
    topology: Topology,
    *,
    fidelity: str = "auto",
    all_ranks: bool = False,
    trace: bool = False,
) -> StepResult:
    """The step of a loaded scenario on ``topology`` (its stragglers included); plan errors
    are located in the scenario file (or at the ``--set`` that set the key)."""
    try:
        return simulate_inputs(
            StepInputs.of(scenario, topology), fidelity=fidelity, all_ranks=all_ranks, trace=trace
        )
    except ConfigError as exc:
        raise scenario.locate(exc) from None


@dataclass(frozen=True, slots=True)
class Job:
    """A scenario simulated: the scenario as loaded, its cluster, the step and the
    CollsimWarnings raised on the way (in order, repeats kept)."""

    scenario: Scenario
    topology: Topology
    result: StepResult
    warnings: tuple[str, ...] = ()


def run_job(
    scenario: str | Path | Scenario | Mapping[str, Any],
    overrides: Overrides = None,
    *,
    fidelity: str = "auto",
    all_ranks: bool = False,
    trace: bool = False,
    limits: Limits | None = None,
) -> Job:
    """Load ``scenario`` with ``overrides``, check it against ``limits`` (the defaults when
    None) before its cluster is built, build the cluster and simulate the step.

    Warnings other than CollsimWarnings pass on as they came.

    Raises:
        ConfigError: bad input (exit 2), before any simulation.
        LimitError: the plan is beyond a resource limit.
        InfeasibleError: the plan cannot run.
    """

    loaded = load(scenario, overrides)
    check_scenario(loaded, limits, all_ranks=all_ranks)
    topology = scenario_topology(loaded)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always", CollsimWarning)
        result = scenario_step(
            loaded, topology, fidelity=fidelity, all_ranks=all_ranks, trace=trace
        )
    ours = tuple(str(w.message) for w in caught if issubclass(w.category, CollsimWarning))
    for other in caught:
        if not issubclass(other.category, CollsimWarning):
            warnings.warn_explicit(other.message, other.category, other.filename, other.lineno)
    return Job(loaded, topology, result, ours)


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
