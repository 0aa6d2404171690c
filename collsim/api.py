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

from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from collsim.report.notebook import (
    ScenarioLike,
    Simulation,
    collective_frame,
    simulation,
    sweep_table,
)
from collsim.study.job import Overrides, load
from collsim.study.job_goodput import DEFAULT_RUNS, scenario_goodput

if TYPE_CHECKING:
    import pandas as pd

    from collsim.study.goodput.estimate import GoodputResult
    from collsim.study.limits import Limits
    from collsim.study.scenario import Scenario

__all__ = ["Simulation", "load", "simulate", "sweep", "collective", "goodput"]


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
    return simulation(
        scenario, overrides, fidelity=fidelity, all_ranks=all_ranks, trace=trace, limits=limits
    )


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
    return scenario_goodput(
        scenario,
        overrides,
        days=days,
        runs=runs,
        seed=seed,
        monte_carlo=monte_carlo,
        limits=limits,
        fleet=fleet,
    )


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
    return sweep_table(scenario, gpus=gpus, sets=sets, grow=grow, strong=strong)


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
    return collective_frame(
        op, sizes_bytes, topology=topology, gpus=gpus, nodes=nodes, algorithms=algorithms
    )
