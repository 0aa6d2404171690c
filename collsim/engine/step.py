"""``simulate_step``: one training step of a plan on a cluster, as a StepResult.

Compute times come from the workload's roofline (``ComputeModel``), communication from the
collectives layer (closed form, or the FlowNetwork DES where links are shared), FLOPs from
Narayanan et al. 2021 (``collsim.workload.flops``); memory is read from the engine's timeline.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from collsim.engine.comm import CommPricer, axis_contends
from collsim.engine.core import Engine, EngineOptions
from collsim.errors import ConfigError
from collsim.parallel.config import ParallelConfig, TrainingConfig
from collsim.parallel.plan import Plan
from collsim.schedule.build import BLOCK_OVERRIDE_KEYS, build_schedule
from collsim.schedule.result import StepResult

if TYPE_CHECKING:
    from collsim.topology import Topology
    from collsim.workload.model import TransformerSpec

__all__ = ["simulate_step", "prepare_step", "FIDELITIES", "BLOCK_OVERRIDE_KEYS"]

FIDELITIES = ("auto", "fused", "layer")
"""fused: one event per op, communication in closed form. layer: every layer step an event,
all communication on the FlowNetwork DES (tp, ep, etp and cp collectives of the segments on
their groups' streams). auto: fused, except that the tp, pp and dp axes whose concurrent
groups share a link run on the DES (and a contended tp axis runs layer by layer); the expert-
and context-parallel collectives stay in closed form under auto (``--fidelity layer`` puts
them on the DES with their peers)."""


def _contended_axes(plan: Plan, fidelity: str) -> list[str]:
    """Axes whose groups, all active at once, would slow each other down on shared links."""
    if fidelity not in FIDELITIES:
        raise ConfigError(
            f"must be one of {', '.join(FIDELITIES)}; got {fidelity!r}", key_path="fidelity"
        )
    if fidelity != "auto":
        return []
    topo = plan.topology
    cache = getattr(topo, "cache", None)
    key = ("collsim.engine.contended_axes", plan.tp, plan.pp, plan.dp, plan.cp)
    if cache is not None and key in cache:
        return list(cache[key])
    contended: list[str] = []
    # every group of an axis may be active at once: all stages compute layers together, send
    # to their neighbours in the steady state, and reduce gradients near the end of the step
    # (with context parallelism the dense gradients are reduced over dp x cp)
    stage_groups: dict[str, list[tuple[int, ...]]] = {
        "tp": _node_local(plan, plan.groups("tp")),
        "dp": _node_local(plan, plan.groups("dp" if plan.cp == 1 else "dp_cp")),
        "pp": [
            (plan.rank(dp=d, pp=s, tp=t, cp=k), plan.rank(dp=d, pp=s + 1, tp=t, cp=k))
            for d in range(plan.dp)
            for s in range(plan.pp - 1)
            for k in range(plan.cp)
            for t in range(plan.tp)
        ],
    }
    for axis, groups in stage_groups.items():
        if groups and len(groups[0]) > 1 and axis_contends(topo, groups):
            contended.append(axis)
    if cache is not None:
        cache[key] = tuple(contended)
    return contended


def _node_local(plan: Plan, groups: list[tuple[int, ...]]) -> list[tuple[int, ...]]:
    """When every group lies inside one node, only the groups of the first node: transfers
    inside a node use that node's links only, and the nodes are alike, so groups on other
    nodes neither slow these down nor contend differently among themselves."""
    gpn = plan.topology.gpus_per_node
    if all(g[0] // gpn == g[-1] // gpn for g in groups) and all(
        len({r // gpn for r in g}) == 1 for g in groups
    ):
        return [g for g in groups if g[0] // gpn == 0]
    return groups


def simulate_step(
    topology: Topology,
    spec: TransformerSpec,
    training: TrainingConfig,
    parallel: ParallelConfig,
    *,
    all_ranks: bool = False,
    trace: bool = False,
    op_time_overrides: dict[str, float] | None = None,
    fidelity: str = "auto",
    zero_communication: bool = False,
) -> StepResult:
    """Simulate one training step and report its time, breakdown, memory and collectives.

    Args:
        topology: the cluster (``collsim.topology.Topology``).
        spec: the model (``collsim.workload.TransformerSpec``).
        training: the ``training`` section.
        parallel: the ``parallel`` section.
        all_ranks: simulate every rank instead of one representative per pipeline stage.
        trace: record trace events (one per op and per communication call).
        op_time_overrides: measured seconds by op name, or by block (BLOCK_OVERRIDE_KEYS).
        fidelity: ``auto``, ``fused`` or ``layer`` (see FIDELITIES).
        zero_communication: price every communication at 0 s (an ideal network).

    Raises:
        ConfigError: the plan does not match the model or the cluster (see build_plan).
    """
    engine = prepare_step(
        topology,
        spec,
        training,
        parallel,
        all_ranks=all_ranks,
        trace=trace,
        op_time_overrides=op_time_overrides,
        fidelity=fidelity,
        zero_communication=zero_communication,
    )
    engine.run()
    from collsim.schedule.assemble import assemble

    return assemble(
        engine.plan,
        engine,
        fidelity="layer" if engine.layer_mode else "fused",
        contended=engine.contended,
        zero_communication=zero_communication,
    )


def prepare_step(
    topology: Topology,
    spec: TransformerSpec,
    training: TrainingConfig,
    parallel: ParallelConfig,
    *,
    all_ranks: bool = False,
    trace: bool = False,
    op_time_overrides: dict[str, float] | None = None,
    fidelity: str = "auto",
    zero_communication: bool = False,
) -> Engine:
    """The wired, not yet run, :class:`~collsim.engine.core.Engine` of ``simulate_step``.

    Tests and tools use it to inspect a run beyond the StepResult (memory ledgers with labels,
    per-rank accounts): ``engine = prepare_step(...); engine.run()``.
    """
    schedule = build_schedule(
        topology, spec, training, parallel, op_time_overrides=op_time_overrides
    )
    plan = schedule.plan
    contended = _contended_axes(plan, fidelity)
    if fidelity == "layer":
        des_axes = frozenset(("tp", "pp", "dp", "ep", "etp", "cp"))
    else:
        des_axes = frozenset(contended)
    layer_mode = fidelity == "layer" or bool(des_axes & {"tp", "ep", "etp", "cp"})
    if zero_communication:
        des_axes = frozenset()
    import simpy

    env = simpy.Environment()
    net = None
    if des_axes:
        from collsim.network import FlowNetwork

        net = FlowNetwork(env, topology)
    pricer = CommPricer(topology, zero=zero_communication, network=net, env=env)
    options = EngineOptions(
        all_ranks=all_ranks,
        layer_mode=layer_mode,
        des_axes=des_axes,
        trace=trace,
        contended=tuple(contended),
        zero_communication=zero_communication,
    )
    return Engine(schedule, pricer, options, env=env)
