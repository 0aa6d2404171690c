"""``simulate_step``: one training step of a plan on a cluster, as a StepResult.

Compute times come from the workload's roofline (``ComputeModel``), communication from the
collectives layer (closed form, or the FlowNetwork DES where links are shared), FLOPs from
Narayanan et al. 2021 (``collsim.workload.flops``); memory is read from the engine's timeline.
"""

from __future__ import annotations

import warnings
from typing import TYPE_CHECKING, Any

import simpy

from collsim.cluster.network import FlowNetwork
from collsim.core.errors import CollsimWarning, ConfigError
from collsim.core.runtime import collector_paused
from collsim.core.vocab import ParallelAxis
from collsim.parallel.config import ParallelConfig, TrainingConfig
from collsim.parallel.plan import Plan
from collsim.play.engine.comm import CommPricer, all_to_all_contends, axis_contends, shared_links
from collsim.play.engine.core import Engine, EngineOptions
from collsim.play.engine.program import RankProgram
from collsim.play.walk import walk
from collsim.step.assemble import assemble
from collsim.step.blocks import BLOCK_OVERRIDE_KEYS
from collsim.step.build import StepSchedule, build_schedule
from collsim.step.result import ContentionEffect, StepResult, StragglerReport
from collsim.step.stragglers import StragglerConfig, degrade_topology

TP, PP, DP = ParallelAxis.TP, ParallelAxis.PP, ParallelAxis.DP
_LAYER_AXES = frozenset((TP, ParallelAxis.EP, ParallelAxis.ETP, ParallelAxis.CP))
"""Axes whose calls sit inside a layer: simulating one on the DES needs per-layer ops."""

if TYPE_CHECKING:
    from collsim.cluster.topology import Topology
    from collsim.step.stragglers import StragglerConfig, StragglerPlan
    from collsim.workload.model import TransformerSpec

__all__ = ["simulate_step", "prepare_step", "FIDELITIES", "BLOCK_OVERRIDE_KEYS"]

FIDELITIES = ("auto", "fused", "layer")
"""fused: one event per op, communication in closed form. layer: every layer step an event,
all communication on the FlowNetwork DES (tp, ep, etp and cp collectives of the segments on
their groups' streams). auto: fused, except that the axes whose concurrent groups share a link
run on the DES: tp, pp, dp and the context-parallel groups (cp) when one ring step of all
their groups oversubscribes a link (:func:`~collsim.play.engine.comm.axis_contends`), the expert
groups (ep) when their all-to-alls together oversubscribe a link two of them share
(:func:`~collsim.play.engine.comm.all_to_all_contends`); a contended tp, ep or cp axis runs layer
by layer."""


def _contended_axes(plan: Plan, fidelity: str) -> list[str]:
    """Axes whose groups, all active at once, would slow each other down on shared links."""
    if fidelity not in FIDELITIES:
        raise ConfigError(
            f"must be one of {', '.join(FIDELITIES)}; got {fidelity!r}", key_path="fidelity"
        )
    if fidelity != "auto":
        return []
    topo = plan.topology
    contended: list[str] = []
    # every group of an axis may be active at once: all stages compute layers together, send
    # to their neighbours in the steady state, and reduce gradients near the end of the step
    capacity = topo.link_capacity_bps
    for axis, groups in plan.active_groups(node_local=True).items():
        check = all_to_all_contends if axis == "ep" else axis_contends
        if len(groups) and len(groups[0]) > 1 and check(topo, groups, capacity=capacity):
            contended.append(axis)
    return contended


@collector_paused()
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
    stragglers: StragglerConfig | StragglerPlan | None = None,
) -> StepResult:
    """Simulate one training step and report its time, breakdown, memory and collectives.

    Args:
        topology: the cluster (``collsim.cluster.topology.Topology``).
        spec: the model (``collsim.workload.TransformerSpec``).
        training: the ``training`` section.
        parallel: the ``parallel`` section.
        all_ranks: simulate every rank instead of one representative per pipeline stage.
        trace: record trace events (one per op and per communication call).
        op_time_overrides: measured seconds by op name, or by block (BLOCK_OVERRIDE_KEYS).
        fidelity: ``auto``, ``fused`` or ``layer`` (see FIDELITIES).
        zero_communication: price every communication at 0 s (an ideal network).
        stragglers: slow ranks and degraded links (the ``stragglers`` section). The step is
            then simulated twice, without and with them, and ``StepResult.stragglers`` holds
            the baseline step, the slowdown and who waited for whom (:func:`straggler_details`).

    Raises:
        ConfigError: the plan does not match the model or the cluster (see build_plan), or a
            straggler names a rank, node or link the cluster does not have.
    """
    resolved = _resolve(stragglers, topology)
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
        stragglers=resolved,
    )
    if resolved is not None:
        result = _play(engine, zero_communication)
        # the same step at full speed: the schedule built once is played again (a degraded
        # link changed the topology it was priced on: then it is built on the cluster as is)
        reuse = None if resolved.link_factors else engine.schedule
        full_speed = prepare_step(
            topology,
            spec,
            training,
            parallel,
            all_ranks=all_ranks,
            op_time_overrides=op_time_overrides,
            fidelity=fidelity,
            zero_communication=zero_communication,
            schedule=reuse,
        )
        baseline = _play(full_speed, zero_communication)
        full_speed.release()
        result.stragglers = straggler_details(engine, result, baseline)
        engine.release()
        return result
    result = _play(engine, zero_communication)
    if engine.contended and fidelity == "auto" and not all_ranks and not zero_communication:
        result.contention = contention_effects(
            engine.schedule, result, op_time_overrides=op_time_overrides
        )
    engine.release()
    return result


def _play(engine: Engine, zero_communication: bool) -> StepResult:
    """Run a wired engine and turn it into its StepResult."""

    engine.run()
    return assemble(
        engine.plan,
        engine,
        fidelity="layer" if engine.layer_mode else "fused",
        contended=engine.contended,
        zero_communication=zero_communication,
    )


def contention_effects(
    schedule: StepSchedule,
    result: StepResult,
    *,
    op_time_overrides: dict[str, float] | None = None,
) -> list[ContentionEffect]:
    """What link sharing adds to the step, axis by axis, with the links shared.

    The closed form of the schedule prices every call alone on its links; the engine puts the
    contended axes on the flow-level DES. The gap is attributed by adding the contended axes to
    the DES one at a time, in the order tp, pp, dp, ep, cp: each axis's effect is the step with
    it (and the axes before it) on the DES minus the step without it, so the effects add up to
    the gap
    between the closed form and the engine exactly. An axis on the DES also runs its layers
    step by step (tp: layer granularity), which is part of its effect.

    Returns:
        One effect per contended axis: ``axis``, ``delta_s``, ``links`` (names of the links a
        ring step of all its groups oversubscribes) and ``closed_s`` / ``des_s`` on the first.
    """

    plan = schedule.plan
    topology, spec = plan.topology, plan.spec
    training, parallel = plan.training, plan.parallel
    closed = walk(schedule)  # the closed form of the very schedule the engine played
    contended = list(result.contended_axes)
    order = [a for a in (TP, PP, DP, ParallelAxis.EP, ParallelAxis.CP) if a in contended]
    groups = plan.active_groups()
    out: list[ContentionEffect] = []
    previous = closed.step_time_s
    for k, axis in enumerate(order):
        if k == len(order) - 1:
            step = result.step_time_s
        else:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore", CollsimWarning)
                engine = prepare_step(
                    topology,
                    spec,
                    training,
                    parallel,
                    op_time_overrides=op_time_overrides,
                    des_axes=frozenset(order[: k + 1]),
                    schedule=schedule,
                )
                engine.run()
            step = max(p.end_s for p in engine.programs.values())
        out.append(ContentionEffect(axis, step - previous, shared_links(topology, groups[axis])))
        previous = step
    if out:
        out[0].closed_s = closed.step_time_s
        out[0].des_s = result.step_time_s
    return out


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
    des_axes: frozenset[str] | None = None,
    stragglers: StragglerConfig | StragglerPlan | None = None,
    schedule: StepSchedule | None = None,
) -> Engine:
    """The wired, not yet run, :class:`~collsim.play.engine.core.Engine` of ``simulate_step``.

    Tests and tools use it to inspect a run beyond the StepResult (memory ledgers with labels,
    per-rank accounts): ``engine = prepare_step(...); engine.run()``. ``schedule``: one built
    already for these inputs on this very topology (a re-run with other pricing: the
    contention attribution, the straggler baseline), played again instead of rebuilt.
    """
    resolved = _resolve(stragglers, topology)
    if resolved is not None and resolved.link_factors:
        topology = degrade_topology(topology, resolved.link_factors)
    if schedule is None:
        schedule = build_schedule(
            topology, spec, training, parallel, op_time_overrides=op_time_overrides
        )
    plan = schedule.plan
    contended = _contended_axes(plan, fidelity)
    if des_axes is not None:  # forced (the contention attribution of simulate_step)
        pass
    elif fidelity == "layer":
        des_axes = frozenset((TP, PP, DP, ParallelAxis.EP, ParallelAxis.ETP, ParallelAxis.CP))
    else:
        des_axes = frozenset(contended)
    layer_mode = fidelity == "layer" or bool(des_axes & _LAYER_AXES)
    if zero_communication:
        des_axes = frozenset()

    env = simpy.Environment()
    net = None
    if des_axes:
        net = FlowNetwork(env, topology)
    pricer = CommPricer(topology, zero=zero_communication, network=net, env=env)
    options = EngineOptions(
        all_ranks=all_ranks,
        layer_mode=layer_mode,
        des_axes=des_axes,
        trace=trace,
        contended=tuple(contended),
        zero_communication=zero_communication,
        stragglers=resolved,
    )
    return Engine(schedule, pricer, options, program=RankProgram, env=env)


def _resolve(
    stragglers: StragglerConfig | StragglerPlan | None, topology: Topology
) -> StragglerPlan | None:
    """The stragglers resolved on ``topology``; None when there are none (all factors 1)."""
    if stragglers is None:
        return None

    plan = stragglers.resolve(topology) if isinstance(stragglers, StragglerConfig) else stragglers
    return plan if plan.active else None


def straggler_details(engine: Engine, result: StepResult, baseline: StepResult) -> StragglerReport:
    """What the stragglers cost and who waited for whom (``StepResult.stragglers``).

    ``waits`` lists, per stream with two or more simulated members, the call whose rendezvous
    waited longest (:meth:`Engine.rendezvous_waits`): first those where a rank outside the
    slowed pipelines (same dp index as a straggler) waited for one inside them
    (``for_straggler``), longest first, then the others (e.g. the first and last stage waiting
    for each other at the tied-embedding all-reduce, as they do without stragglers);
    ``longest_wait`` is the first of them.
    """
    plan = engine.plan
    st = engine.stragglers
    assert st is not None
    slowed = {plan.coords(r).dp for r in [*engine.pace, *st.link_ranks] if r < plan.num_gpus}

    def for_straggler(wait: dict[str, Any]) -> bool:
        """A rank outside the slowed pipelines waited for one inside them."""
        inside = plan.coords(wait["waited_for"]).dp in slowed
        return inside and any(plan.coords(r).dp not in slowed for r in wait["waits_s"])

    waits = sorted(engine.rendezvous_waits(), key=lambda w: not for_straggler(w))
    for wait in waits:
        wait["for_straggler"] = for_straggler(wait)
    base = baseline.step_time_s
    return StragglerReport(
        clock_factors=dict(sorted(st.compute_factors.items())),
        tp_paced_ranks=sorted(engine.pace),
        stage_factors={f"dp{d}.pp{s}": f for (d, s), f in sorted(st.stage_factors(plan).items())},
        degraded_links={plan.topology.links[i].name: f for i, f in sorted(st.link_factors.items())},
        baseline_step_time_s=base,
        step_time_s=result.step_time_s,
        slowdown=result.step_time_s / base,
        extra_s=result.step_time_s - base,
        critical_rank=result.critical_rank,
        longest_wait=waits[0] if waits else None,
        waits=waits[:16],
    )
