"""The one way a scenario becomes a simulated step: every caller (``collsim run``, ``sweep``,
``search``, ``goodput``, ``plot`` and the notebook API) loads, checks and simulates through
here, so two callers given the same file and options cannot give different steps. A job is a
scenario (a file, a loaded scenario or a mapping) with ``--set`` overrides, checked against the
resource limits before its cluster is built, then its cluster, its validated step inputs
(:class:`StepInputs`, the scenario's stragglers included) and the step of the chosen fidelity
(the engine, or the closed form of the same schedule), with the CollsimWarnings raised on the way.
The goodput of a job is in :mod:`collsim.study.job_goodput`.
"""

from __future__ import annotations

import json
import warnings
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from collsim.core.errors import CollsimWarning, ConfigError
from collsim.core.yamlio import YamlDoc
from collsim.play.engine import simulate_step
from collsim.play.walk import estimate_step
from collsim.study.limits import check_scenario
from collsim.study.scenario import Scenario, load_scenario, scenario_from_doc

if TYPE_CHECKING:
    from collsim.cluster.topology import Topology
    from collsim.parallel.config import ParallelConfig, TrainingConfig
    from collsim.step.result import StepResult
    from collsim.step.stragglers import StragglerConfig
    from collsim.study.limits import Limits
    from collsim.study.scenario import Scenario
    from collsim.workload.model import TransformerSpec

__all__ = [
    "FIDELITIES",
    "Overrides",
    "StepInputs",
    "Job",
    "load",
    "scenario_topology",
    "simulate_inputs",
    "scenario_step",
    "run_job",
]

FIDELITIES = ("auto", "fused", "layer", "closed")
"""The engine's granularities (``collsim.play.engine.step.FIDELITIES``) and ``closed``, the closed
form of the same schedule (``collsim.play.walk``)."""

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
