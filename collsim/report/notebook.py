"""What the notebook API (:mod:`collsim.api`) returns, built on the job every command runs
(:mod:`collsim.study.job`): :class:`Simulation`, one simulated step that frames and draws itself
and traces itself again when a figure needs the trace; the sweep of a scenario file as a frame;
and the closed-form time of one collective over sizes and algorithms as an nccl-tests frame.
pandas and matplotlib load only when a frame or a figure is made.
"""

from __future__ import annotations

import json
import warnings
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from collsim.cluster.topology import Topology
from collsim.collectives import Group
from collsim.core.errors import CollsimWarning, ConfigError, InfeasibleError
from collsim.core.vocab import Algorithm, CollectiveOp
from collsim.step.result import StepResult
from collsim.study import sweep as sweeping
from collsim.study.job import Overrides, run_job
from collsim.study.limits import Limits
from collsim.study.scenario import Scenario

if TYPE_CHECKING:
    import pandas as pd
    from matplotlib.figure import Figure

__all__ = ["ScenarioLike", "Simulation", "collective_frame", "simulation", "sweep_table"]

ScenarioLike = str | Path | Mapping[str, Any]
"""A scenario file, or a scenario as a mapping (the YAML's keys)."""


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
            self.result = run_job(self.scenario, trace=True, **self.options).result
        return self.result

    @property
    def breakdown(self) -> dict[str, float]:
        """Parts of the step time in seconds (``compute``, ``tp_exposed``, ..., ``optimizer``)."""
        return dict(self.result.breakdown_s)

    @property
    def memory_timeline(self) -> pd.DataFrame:
        """Memory in use over the step: ``rank, time_s, bytes`` (simulated ranks)."""
        # pandas loads only when a frame is made
        from collsim.report.frames import memory_timeline_frame

        return memory_timeline_frame(self.result)

    def to_frame(self) -> pd.DataFrame:
        """One row: the plan (``num_gpus, tp, pp, dp, ...``) then every result field."""
        # pandas loads only when a frame is made
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
        # matplotlib loads only when a figure is made
        from collsim.report.plots import plot_memory_timeline, plot_step, save_figure

        if kind == "step":
            fig = plot_step(self.traced(), **{"title": self.scenario.name, **kwargs})
        elif kind == "timeline":
            fig = plot_memory_timeline(self.result, **kwargs)
        else:
            raise ConfigError(f"must be step or timeline, got {kind!r}", key_path="kind")
        if path is not None:
            save_figure(fig, path)
        return fig


def simulation(
    scenario: ScenarioLike | Scenario,
    overrides: Overrides = None,
    *,
    fidelity: str = "auto",
    all_ranks: bool = False,
    trace: bool = False,
    limits: Limits | None = None,
) -> Simulation:
    """The job of ``scenario`` (:func:`~collsim.study.job.run_job`) as a :class:`Simulation`,
    its warnings without repeats."""
    job = run_job(
        scenario, overrides, fidelity=fidelity, all_ranks=all_ranks, trace=trace, limits=limits
    )
    messages = list(dict.fromkeys(job.warnings))
    options = {"fidelity": fidelity, "all_ranks": all_ranks, "limits": limits}
    return Simulation(job.scenario, job.topology, job.result, messages, options)


def sweep_table(
    scenario: str | Path,
    *,
    gpus: Sequence[int] | None = None,
    sets: Mapping[str, Sequence[Any]] | None = None,
    grow: str = "dp",
    strong: bool = False,
) -> pd.DataFrame:
    """The points of ``collsim sweep`` (``gpus`` x the product of ``sets``, each value as
    ``--set`` reads it), checked before any runs, simulated, one row per point."""
    # pandas loads only when a frame is made
    from collsim.report.frames import sweep_frame

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


def collective_frame(
    op: str,
    sizes_bytes: int | Sequence[int],
    *,
    topology: str = "dgx_h100",
    gpus: int | None = 8,
    nodes: int | None = None,
    algorithms: Sequence[str] | None = None,
) -> pd.DataFrame:
    """Closed-form time of ``op`` over ``sizes_bytes`` on all GPUs of the cluster, per
    algorithm that applies (all when ``algorithms`` is None).

    Raises:
        ConfigError: an unknown op or algorithm, a size <= 0, or a GPU count the topology
            cannot make.
    """
    # pandas loads only when a frame is made
    from collsim.report.frames import collective_cost_frame

    _choice(op, [o.value for o in CollectiveOp], "op")
    sizes = [sizes_bytes] if isinstance(sizes_bytes, int) else list(sizes_bytes)
    if not sizes or any(int(s) <= 0 for s in sizes):
        raise ConfigError(f"sizes must be > 0 bytes, got {sizes}", key_path="sizes_bytes")
    names = list(algorithms) if algorithms is not None else [a.value for a in Algorithm]
    for name in names:
        _choice(name, [a.value for a in Algorithm], "algorithms")
    try:
        topo = sweeping.cluster_for(topology, gpus, nodes)
    except InfeasibleError as exc:
        raise ConfigError(str(exc), key_path="gpus") from None
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", CollsimWarning)
        return collective_cost_frame(op, [int(s) for s in sizes], Group.all(topo), names)


def _choice(value: str, choices: list[str], key: str) -> None:
    if value not in choices:
        raise ConfigError(f"must be one of {', '.join(choices)}; got {value!r}", key_path=key)
