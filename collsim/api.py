"""The notebook API: the commands of ``collsim`` as functions that return data.

::

    import collsim

    sim = collsim.simulate("scenarios/3d_175b.yaml", overrides={"parallel.dp": 8,
                                                                "cluster.nodes": 64})
    sim.step_time_s                  # seconds (every StepResult field reads through)
    sim.breakdown                    # {"compute": ..., "tp_exposed": ..., ...} in seconds
    sim.memory_timeline              # DataFrame: rank, time_s, bytes
    sim.to_frame()                   # one row: the plan, then every result field
    fig = sim.plot("step")           # matplotlib Figure ("step" or "timeline")

    collsim.sweep("scenarios/ddp_gpt3_1.3b.yaml", gpus=[8, 16, 32])     # DataFrame, one row a point
    collsim.collective("all_reduce", [2**20, 2**30], topology="dgx_h100", gpus=8)
    collsim.goodput(...)             # collsim.goodput, where this version has it

Units follow the rest of collsim: seconds, bytes, bytes per second in data; GiB and GB/s only
in printed text. Errors are the CLI's (:mod:`collsim.errors`): a bad key is a ConfigError with
its file and line, a plan beyond a resource limit a LimitError (pass ``limits=Limits(...)`` to
raise it), an impossible plan an InfeasibleError.

Nothing here is imported by ``import collsim``: the package's ``__getattr__`` loads this module
the first time one of these names is used, so the command line stays as fast as before.
"""

from __future__ import annotations

import json
import warnings
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from collsim.errors import CollsimWarning, ConfigError, UnavailableError

if TYPE_CHECKING:
    import pandas as pd
    from matplotlib.figure import Figure

    from collsim.limits import Limits
    from collsim.scenario import Scenario
    from collsim.schedule.result import StepResult
    from collsim.topology import Topology

__all__ = ["Simulation", "load", "simulate", "sweep", "collective", "goodput"]

Overrides = Mapping[str, Any] | Sequence[str] | None


def _override_texts(overrides: Overrides) -> list[str]:
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
    """A scenario from a file, a loaded :class:`~collsim.scenario.Scenario` or a mapping.

    Overrides are applied as ``--set`` would (same checks, same error locations).
    """
    # start-up: `import collsim` stays cheap; each layer loads on first use
    from collsim.scenario import Scenario, load_scenario, scenario_from_doc
    from collsim.yamlio import YamlDoc

    texts = _override_texts(overrides)
    if isinstance(scenario, Scenario):
        if not texts:
            return scenario
        if scenario.doc is None:
            raise ConfigError("this scenario has no document to apply overrides to")
        base = scenario.doc
        texts = [o.text for o in scenario.overrides] + texts
        return scenario_from_doc(base, texts, source=scenario.source)
    if isinstance(scenario, Mapping):
        doc = YamlDoc(data=dict(scenario), file="<scenario>")
        return scenario_from_doc(doc, texts)
    return load_scenario(scenario, texts)


@dataclass
class Simulation:
    """One simulated step: the scenario, its cluster and the engine's result.

    Every field of :class:`~collsim.schedule.result.StepResult` reads through
    (``sim.step_time_s``, ``sim.mfu``, ``sim.fits``, ...).
    """

    scenario: Scenario
    topology: Topology
    result: StepResult
    warnings: list[str] = field(default_factory=list)
    """The CollsimWarnings of the run (poor but legal settings), each once."""

    def __getattr__(self, name: str) -> Any:
        if name.startswith("_") or name in ("scenario", "topology", "result", "warnings"):
            raise AttributeError(name)
        return getattr(self.result, name)

    @property
    def breakdown(self) -> dict[str, float]:
        """Parts of the step time in seconds (``compute``, ``tp_exposed``, ..., ``optimizer``)."""
        return dict(self.result.breakdown_s)

    @property
    def memory_timeline(self) -> pd.DataFrame:
        """Memory in use over the step: ``rank, time_s, bytes`` (simulated ranks)."""
        # start-up: `import collsim` stays cheap; each layer loads on first use
        from collsim.report.frames import memory_timeline_frame

        return memory_timeline_frame(self.result)

    def to_frame(self) -> pd.DataFrame:
        """One row: the plan (``num_gpus, tp, pp, dp, ...``) then every result field."""
        # start-up: `import collsim` stays cheap; each layer loads on first use
        from collsim.report.frames import results_frame

        par, train = self.scenario.parallel, self.scenario.training
        params = {
            "scenario": self.scenario.name,
            "num_gpus": self.topology.num_ranks,
            "tp": par.tp,
            "pp": par.pp,
            "dp": par.dp,
            "zero": par.zero,
            "schedule": str(par.schedule),
            "global_batch": train.global_batch,
            "micro_batch": train.micro_batch,
        }
        return results_frame([(params, self.result)])

    def plot(self, kind: str = "step", path: str | Path | None = None, **kwargs: Any) -> Figure:
        """Draw the step (``"step"``: compute and communication lanes over memory) or the
        memory of one rank (``"timeline"``); save it too when ``path`` ends in .png or .svg."""
        # start-up: `import collsim` stays cheap; each layer loads on first use
        from collsim.report import plots

        if kind == "step":
            par = self.scenario.parallel
            kwargs.setdefault("title", self.scenario.name)
            kwargs.setdefault("stage_of", lambda r: (r // par.tp) % par.pp)
            fig = plots.plot_step(self.result, **kwargs)
        elif kind == "timeline":
            fig = plots.plot_memory_timeline(self.result, **kwargs)
        else:
            raise ConfigError(f"must be step or timeline, got {kind!r}", key_path="kind")
        if path is not None:
            plots.save_figure(fig, path)
        return fig


def simulate(
    scenario: str | Path | Scenario | Mapping[str, Any],
    overrides: Overrides = None,
    *,
    fidelity: str = "auto",
    all_ranks: bool = False,
    trace: bool = True,
    limits: Limits | None = None,
) -> Simulation:
    """Simulate one training step, as ``collsim run`` does.

    Args:
        scenario: a scenario file, a loaded scenario, or the scenario as a mapping.
        overrides: ``{"parallel.dp": 16}`` (or ``["parallel.dp=16"]``), applied as ``--set``.
        fidelity: ``auto``, ``fused`` or ``layer`` (``collsim run --fidelity``).
        all_ranks: simulate every rank, not one per symmetry class.
        trace: keep the per-op trace (needed by :meth:`Simulation.plot` ``"step"``).
        limits: resource limits (:class:`collsim.limits.Limits`; defaults otherwise).

    Raises:
        ConfigError: bad input; LimitError: beyond a limit; InfeasibleError: cannot run.
    """
    # start-up: `import collsim` stays cheap; each layer loads on first use
    from collsim.engine import simulate_step
    from collsim.limits import check_scenario

    loaded = load(scenario, overrides)
    check_scenario(loaded, limits, all_ranks=all_ranks)
    try:
        topology = loaded.cluster.load()
    except ConfigError as exc:
        if exc.file is not None:
            raise
        raise loaded.locate(ConfigError(exc.message, key_path="cluster.topology")) from None
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always", CollsimWarning)
        try:
            result = simulate_step(
                topology,
                loaded.model,
                loaded.training,
                loaded.parallel,
                all_ranks=all_ranks,
                trace=trace,
                fidelity=fidelity,
            )
        except ConfigError as exc:
            raise loaded.locate(exc) from None
    messages = list(
        dict.fromkeys(str(w.message) for w in caught if issubclass(w.category, CollsimWarning))
    )
    return Simulation(scenario=loaded, topology=topology, result=result, warnings=messages)


def sweep(
    scenario: str | Path,
    *,
    gpus: Sequence[int] | None = None,
    sets: Mapping[str, Sequence[Any]] | None = None,
    grow: str = "dp",
    strong: bool = False,
) -> pd.DataFrame:
    """Simulate a scenario file over GPU counts and key values, as ``collsim sweep`` does.

    Args:
        scenario: the scenario file.
        gpus: GPU counts (the parallel axis ``grow`` grows with them).
        sets: ``{"parallel.zero": [0, 1, 3]}``: the product of the values is swept.
        grow: ``dp``, ``tp`` or ``pp``.
        strong: keep the global batch (strong scaling) instead of growing it with dp.

    Returns:
        One row per point (``collsim.study.sweep.sweep_frame``): coordinates, ``feasible``,
        ``reason`` and every result field, in seconds and bytes.
    """
    # start-up: `import collsim` stays cheap; each layer loads on first use
    from collsim.study import sweep as sweeping

    pairs = [
        (key, [json.dumps(v) if not isinstance(v, str) else v for v in values])
        for key, values in (sets or {}).items()
    ]
    gpu_list = list(gpus) if gpus is not None else None
    sweeping.check_overrides(scenario, pairs, gpus=gpu_list, grow=grow, plans=None)
    points = sweeping.build_points(gpus=gpu_list, sets=pairs, plans=None)
    outcomes = sweeping.run_sweep(scenario, points, grow=grow, strong=strong)
    frame: pd.DataFrame = sweeping.sweep_frame(outcomes)
    return frame


def collective(
    op: str,
    sizes_bytes: int | Sequence[int],
    *,
    topology: str = "dgx_h100",
    gpus: int | None = 8,
    nodes: int | None = None,
    algorithms: Sequence[str] | None = None,
) -> pd.DataFrame:
    """Closed-form time of one collective over sizes, per algorithm that applies.

    Returns:
        ``op, algorithm, protocol, size_bytes, time_s, algbw_bps, busbw_bps`` (nccl-tests
        conventions for the bandwidths).
    """
    # start-up: `import collsim` stays cheap; each layer loads on first use
    from collsim.collectives import Group
    from collsim.errors import InfeasibleError
    from collsim.report.frames import collective_cost_frame
    from collsim.study.sweep import cluster_for
    from collsim.vocab import Algorithm, CollectiveOp

    try:
        CollectiveOp(op)
    except ValueError:
        choices = ", ".join(o.value for o in CollectiveOp)
        raise ConfigError(f"must be one of {choices}; got {op!r}", key_path="op") from None
    sizes = [sizes_bytes] if isinstance(sizes_bytes, int) else list(sizes_bytes)
    if not sizes or any(int(s) <= 0 for s in sizes):
        raise ConfigError(f"sizes must be > 0 bytes, got {sizes}", key_path="sizes_bytes")
    names = list(algorithms) if algorithms is not None else [a.value for a in Algorithm]
    for name in names:
        try:
            Algorithm(name)
        except ValueError:
            choices = ", ".join(a.value for a in Algorithm)
            raise ConfigError(
                f"must be one of {choices}; got {name!r}", key_path="algorithms"
            ) from None
    try:
        topo = cluster_for(topology, gpus, nodes)
    except InfeasibleError as exc:
        raise ConfigError(str(exc), key_path="gpus") from None
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", CollsimWarning)
        return collective_cost_frame(op, [int(s) for s in sizes], Group.all(topo), names)


def goodput(*args: Any, **kwargs: Any) -> Any:
    """``collsim.goodput.goodput(...)``: training goodput under failures, where this version
    of collsim has the :mod:`collsim.goodput` module.

    Raises:
        UnavailableError: this version has no goodput model.
    """
    # start-up: `import collsim` stays cheap; each layer loads on first use
    import importlib

    try:
        module = importlib.import_module("collsim.goodput")
    except ModuleNotFoundError as exc:
        if exc.name != "collsim.goodput":
            raise
        raise UnavailableError(
            "collsim.goodput is not available in this version of collsim"
        ) from None
    function = getattr(module, "goodput", None)
    if function is None or not callable(function):
        raise UnavailableError("collsim.goodput has no goodput() function in this version")
    return function(*args, **kwargs)
