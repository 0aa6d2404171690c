"""The notebook API: the commands of ``collsim`` as functions that return data, each a thin layer
over the job every command runs (:mod:`collsim.study.job`), so that ``collsim.simulate(path)``
and ``collsim run path`` give the same step. Units are collsim's (seconds, bytes, bytes per
second); errors are the CLI's (:mod:`collsim.core.errors`). ``import collsim`` loads this module on
first use of one of its names, so the command line stays fast::

    sim = collsim.simulate("scenarios/3d_175b.yaml", overrides={"parallel.dp": 8})
    sim.step_time_s, sim.breakdown, sim.memory_timeline, sim.to_frame(), sim.plot("step")
    collsim.sweep("scenarios/ddp_gpt3_1.3b.yaml", gpus=[8, 16, 32])
    collsim.collective("all_reduce", [2**20, 2**30], topology="dgx_h100", gpus=8)
    collsim.goodput("scenarios/published/goodput_llama3_405b_16384.yaml", days=30)
"""

from __future__ import annotations

import json
import warnings
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from collsim.core.errors import CollsimWarning, ConfigError
from collsim.study.job import DEFAULT_RUNS, Overrides, load

if TYPE_CHECKING:
    import pandas as pd
    from matplotlib.figure import Figure

    from collsim.cluster.topology import Topology
    from collsim.step.result import StepResult
    from collsim.study.goodput.estimate import GoodputResult
    from collsim.study.limits import Limits
    from collsim.study.scenario import Scenario

__all__ = ["Simulation", "load", "simulate", "sweep", "collective", "goodput"]

ScenarioLike = str | Path | Mapping[str, Any]


@dataclass
class Simulation:
    """One simulated step: the scenario, its cluster, the result (every field of
    :class:`~collsim.step.result.StepResult` reads through) and the run's CollsimWarnings."""

    scenario: Scenario
    topology: Topology
    result: StepResult
    warnings: list[str] = field(default_factory=list)
    options: dict[str, Any] = field(default_factory=dict, repr=False)
    """How the step was simulated (``fidelity``, ``all_ranks``, ``limits``), to trace it again."""

    def __getattr__(self, name: str) -> Any:
        if name.startswith("_") or name in ("scenario", "topology", "result", "warnings"):
            raise AttributeError(name)
        return getattr(self.result, name)

    def traced(self) -> StepResult:
        """The step with its trace: this result when it kept one, else the same step simulated
        again with ``trace=True`` (once; a trace changes no figure beyond rounding)."""
        if not self.result.trace_events:
            # start-up: `import collsim` stays cheap; each layer loads on first use
            from collsim.study.job import run_job

            self.result = run_job(self.scenario, trace=True, **self.options).result
        return self.result

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
        """Draw the step (``"step"``: a row per pipeline stage over memory) or the memory of
        one rank (``"timeline"``); save it too when ``path`` ends in .png or .svg."""
        # start-up: `import collsim` stays cheap; each layer loads on first use
        from collsim.report import plots

        if kind == "step":
            fig = plots.plot_step(self.traced(), **{"title": self.scenario.name, **kwargs})
        elif kind == "timeline":
            fig = plots.plot_memory_timeline(self.result, **kwargs)
        else:
            raise ConfigError(f"must be step or timeline, got {kind!r}", key_path="kind")
        if path is not None:
            plots.save_figure(fig, path)
        return fig


def simulate(
    scenario: ScenarioLike | Scenario,
    overrides: Overrides = None,
    *,
    fidelity: str = "auto",
    all_ranks: bool = False,
    trace: bool = False,
    limits: Limits | None = None,
) -> Simulation:
    """Simulate one training step as ``collsim run`` does (stragglers included): the same
    figures as ``collsim run PATH --json`` (a kept trace sums some parts in another order).

    ``fidelity``: ``auto``, ``fused``, ``layer`` or ``closed``; ``trace`` keeps the per-op
    trace (:meth:`Simulation.plot` traces the step when it needs to); ``limits`` the resource
    limits.

    Raises:
        ConfigError: bad input; LimitError: beyond a limit; InfeasibleError: cannot run.
    """
    # start-up: `import collsim` stays cheap; each layer loads on first use
    from collsim.study.job import run_job

    job = run_job(
        scenario, overrides, fidelity=fidelity, all_ranks=all_ranks, trace=trace, limits=limits
    )
    messages = list(dict.fromkeys(job.warnings))
    options = {"fidelity": fidelity, "all_ranks": all_ranks, "limits": limits}
    return Simulation(job.scenario, job.topology, job.result, messages, options)


def goodput(
    scenario: ScenarioLike | Scenario,
    overrides: Overrides = None,
    *,
    days: float | None = None,
    runs: int = DEFAULT_RUNS,
    seed: int = 0,
    monte_carlo: bool = True,
    limits: Limits | None = None,
    fleet: str | None = None,
) -> GoodputResult:
    """Goodput of a scenario with a ``reliability`` section over ``days`` as ``collsim goodput``
    computes it: the closed form and, with ``monte_carlo``, ``runs`` seeded runs; ``fleet``
    (a published fleet's name, ``meta_rsc2``..., or a YAML file of one fleet) puts the plan at
    that fleet's failure rate, as ``collsim goodput --fleet``.

    Raises:
        ConfigError: bad input, no reliability section, or a fleet that is not one fleet.
    """
    # start-up: `import collsim` stays cheap; each layer loads on first use
    from collsim.study.goodput.fleets import find_fleets
    from collsim.study.job import job_at_rate, job_goodput, require_reliability, run_job

    fleets = find_fleets(fleet) if fleet is not None else []
    if len(fleets) > 1:
        raise ConfigError(f"{fleet} holds {len(fleets)} fleets; give one", key_path="fleet")
    loaded = load(scenario, overrides)
    require_reliability(loaded)
    job = run_job(loaded, limits=limits)
    if fleets:
        job = job_at_rate(job, fleets[0].per_1000_node_days)
    return job_goodput(job, days=days, runs=runs, seed=seed, monte_carlo=monte_carlo)


def sweep(
    scenario: str | Path,
    *,
    gpus: Sequence[int] | None = None,
    sets: Mapping[str, Sequence[Any]] | None = None,
    grow: str = "dp",
    strong: bool = False,
) -> pd.DataFrame:
    """Simulate a scenario file over GPU counts (``grow``: the axis that grows with them) and
    the product of ``sets`` (``{"parallel.zero": [0, 1, 3]}``), as ``collsim sweep`` does.
    ``strong`` keeps the global batch. One row per point (``collsim.report.frames.sweep_frame``)."""
    # start-up: `import collsim` stays cheap; each layer loads on first use
    from collsim.report.frames import sweep_frame
    from collsim.study import sweep as sweeping

    pairs = [
        (key, [v if isinstance(v, str) else json.dumps(v) for v in values])
        for key, values in (sets or {}).items()
    ]
    gpu_list = list(gpus) if gpus is not None else None
    sweeping.check_overrides(scenario, pairs, gpus=gpu_list, grow=grow, plans=None)
    points = sweeping.build_points(gpus=gpu_list, sets=pairs, plans=None)
    outcomes = sweeping.run_sweep(scenario, points, grow=grow, strong=strong)
    frame: pd.DataFrame = sweep_frame(outcomes)
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
    """Closed-form time of one collective over sizes, per algorithm that applies:
    ``op, algorithm, protocol, size_bytes, time_s, algbw_bps, busbw_bps`` (nccl-tests)."""
    # start-up: `import collsim` stays cheap; each layer loads on first use
    from collsim.collectives import Group
    from collsim.core.errors import InfeasibleError
    from collsim.core.vocab import Algorithm, CollectiveOp
    from collsim.report.frames import collective_cost_frame
    from collsim.study.sweep import cluster_for

    _choice(op, [o.value for o in CollectiveOp], "op")
    sizes = [sizes_bytes] if isinstance(sizes_bytes, int) else list(sizes_bytes)
    if not sizes or any(int(s) <= 0 for s in sizes):
        raise ConfigError(f"sizes must be > 0 bytes, got {sizes}", key_path="sizes_bytes")
    names = list(algorithms) if algorithms is not None else [a.value for a in Algorithm]
    for name in names:
        _choice(name, [a.value for a in Algorithm], "algorithms")
    try:
        topo = cluster_for(topology, gpus, nodes)
    except InfeasibleError as exc:
        raise ConfigError(str(exc), key_path="gpus") from None
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", CollsimWarning)
        return collective_cost_frame(op, [int(s) for s in sizes], Group.all(topo), names)


def _choice(value: str, choices: list[str], key: str) -> None:
    if value not in choices:
        raise ConfigError(f"must be one of {', '.join(choices)}; got {value!r}", key_path=key)
