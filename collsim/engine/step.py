"""``simulate_step``: one training step of a plan on a cluster, as a StepResult.

Compute times come from the workload's roofline (``ComputeModel``), communication from the
collectives layer (closed form, or the FlowNetwork DES where links are shared), FLOPs from
Narayanan et al. 2021 (``collsim.workload.flops``); memory is read from the engine's timeline.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from collsim.engine.comm import CommPricer, axis_contends
from collsim.engine.core import Engine
from collsim.engine.result import StepResult
from collsim.engine.stage import BlockTimes, build_stage
from collsim.errors import ConfigError
from collsim.parallel.config import Dtype, ParallelConfig, TrainingConfig
from collsim.parallel.plan import Plan, build_plan

if TYPE_CHECKING:
    from collsim.hardware import Device
    from collsim.topology import Topology
    from collsim.workload.compute import ComputeModel, LayerTimes
    from collsim.workload.model import TransformerSpec

__all__ = ["simulate_step", "prepare_step", "FIDELITIES", "BLOCK_OVERRIDE_KEYS"]

FIDELITIES = ("auto", "fused", "layer")
"""fused: one event per op, communication in closed form. layer: every layer step an event,
all communication on the FlowNetwork DES. auto: fused, except that the axes whose concurrent
groups share a link run on the DES (and a contended tp axis runs layer by layer)."""

BLOCK_OVERRIDE_KEYS = (
    "layer.forward",
    "layer.backward",
    "layer.recompute",
    "embedding.forward",
    "embedding.backward",
    "head.forward",
    "head.backward",
    "optimizer",
)
"""Override keys for whole blocks (seconds per micro-batch; optimizer: per step). Any other key
is an op name of the workload (``qkv_proj``, ``softmax.backward``, ...)."""


def _bytes_per(training: TrainingConfig) -> dict[str, float]:
    """Bytes per parameter (ZeRO paper, mixed-precision Adam K = 12) and per activation."""
    dtype = Dtype(training.dtype)
    mixed = dtype is not Dtype.FP32
    if mixed:
        param = grad = 2.0
        opt = 12.0 if str(training.optimizer) == "adam" else 8.0
    else:
        param = grad = 4.0
        opt = 8.0 if str(training.optimizer) == "adam" else 4.0
    from collsim.workload.ops import activation_element_bytes

    return {
        "param": param,
        "grad": grad,
        "optimizer": opt,
        "activation": float(activation_element_bytes(dtype.value)),
    }


def _blocks(
    plan: Plan, device: Device, overrides: dict[str, float]
) -> tuple[BlockTimes, BlockTimes, BlockTimes, ComputeModel]:
    from collsim.workload.compute import ComputeModel

    op_over = {k: v for k, v in overrides.items() if k not in BLOCK_OVERRIDE_KEYS}
    model = ComputeModel(device, str(plan.training.dtype), overrides=op_over)
    mb, tp, sp = plan.training.micro_batch, plan.tp, plan.parallel.sequence_parallel
    lt = model.layer_times(
        plan.spec,
        micro_batch=mb,
        tp=tp,
        sequence_parallel=sp,
        recompute=str(plan.training.recompute),
    )
    et = model.embedding_times(plan.spec, micro_batch=mb, tp=tp, sequence_parallel=sp)
    ht = model.head_times(plan.spec, micro_batch=mb, tp=tp, sequence_parallel=sp)

    def pick(key: str, value: float) -> float:
        return float(overrides.get(key, value))

    def dgrad(times: LayerTimes, names: tuple[str, ...], backward_s: float) -> tuple[float, ...]:
        """Half the backward of each named linear (its dgrad GEMM: 2 of its 4 backward FLOPs
        per weight element), scaled like the block when a block override replaced it."""
        scale = backward_s / times.backward_s if times.backward_s > 0 else 0.0
        by_name = {o.name: o.time_s for o in times.ops if o.phase == "backward"}
        return tuple(by_name.get(n, 0.0) / 2 * scale for n in names)

    layer_bwd = pick("layer.backward", lt.backward_s)
    head_bwd = pick("head.backward", ht.backward_s)
    layer = BlockTimes(
        pick("layer.forward", lt.forward_s),
        layer_bwd,
        pick("layer.recompute", lt.recompute_s),
        lt.activation_bytes,
        lt.transient_bytes,
        column_dgrad_s=dgrad(lt, ("mlp_up", "qkv_proj"), layer_bwd),
    )
    emb = BlockTimes(
        pick("embedding.forward", et.forward_s),
        pick("embedding.backward", et.backward_s),
        0.0,
        et.activation_bytes,
    )
    head = BlockTimes(
        pick("head.forward", ht.forward_s),
        head_bwd,
        0.0,
        ht.activation_bytes,
        column_dgrad_s=dgrad(ht, ("lm_head",), head_bwd),
    )
    return layer, emb, head, model


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
    key = ("collsim.engine.contended_axes", plan.tp, plan.pp, plan.dp)
    if cache is not None and key in cache:
        return list(cache[key])
    contended: list[str] = []
    # every group of an axis may be active at once: all stages compute layers together, send
    # to their neighbours in the steady state, and reduce gradients near the end of the step
    stage_groups: dict[str, list[tuple[int, ...]]] = {
        "tp": plan.groups("tp"),
        "dp": plan.groups("dp"),
        "pp": [
            (plan.rank(dp=d, pp=s, tp=t), plan.rank(dp=d, pp=s + 1, tp=t))
            for d in range(plan.dp)
            for s in range(plan.pp - 1)
            for t in range(plan.tp)
        ],
    }
    for axis, groups in stage_groups.items():
        if groups and len(groups[0]) > 1 and axis_contends(topo, groups):
            contended.append(axis)
    if cache is not None:
        cache[key] = tuple(contended)
    return contended


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
    from collsim.engine.assemble import assemble

    return assemble(
        engine.plan,
        engine,
        layer_mode=engine.layer_mode,
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
    plan = build_plan(topology, spec, training, parallel)
    overrides = dict(op_time_overrides or {})
    device = topology.device
    layer, emb, head, model = _blocks(plan, device, overrides)
    bytes_per = _bytes_per(training)
    contended = _contended_axes(plan, fidelity)
    if fidelity == "layer":
        des_axes = frozenset(("tp", "pp", "dp"))
    else:
        des_axes = frozenset(contended)
    layer_mode = fidelity == "layer" or "tp" in des_axes
    if zero_communication:
        des_axes = frozenset()
    net = None
    if des_axes:
        import simpy

        from collsim.network import FlowNetwork

        env = simpy.Environment()
        net = FlowNetwork(env, topology)
    else:
        import simpy

        env = simpy.Environment()
    pricer = CommPricer(topology, zero=zero_communication, network=net, env=env)
    cpu_model: ComputeModel | None = None

    def optimizer_time(local_params: float, on_cpu: bool) -> float:
        nonlocal cpu_model
        if "optimizer" in overrides:
            return float(overrides["optimizer"])
        if on_cpu:
            if cpu_model is None:
                from collsim.hardware import get_device
                from collsim.workload.compute import ComputeModel

                cpu_model = ComputeModel(get_device("cpu"), "fp32")
            return cpu_model.optimizer_time_s(local_params, str(training.optimizer))
        return model.optimizer_time_s(local_params, str(training.optimizer))

    stages = {
        s: build_stage(
            plan,
            s,
            layer=layer,
            embedding=emb,
            head=head,
            grad_bytes=int(bytes_per["grad"]),
            act_element_bytes=int(bytes_per["activation"]),
        )
        for s in range(plan.pp)
    }
    return Engine(
        plan,
        stages,
        pricer,
        all_ranks=all_ranks,
        layer_mode=layer_mode,
        des_axes=des_axes,
        trace=trace,
        optimizer_time=optimizer_time,
        bytes_per=bytes_per,
        host_bps=float(topology.host_bandwidth_bps),
        env=env,
        contended=contended,
        zero_communication=zero_communication,
    )
