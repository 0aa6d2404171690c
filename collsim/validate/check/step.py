"""Step-level validation, the predicting half: simulate the steps that
:mod:`collsim.validate.measure.step` timed on real ranks, and compare the two.

Derivations, measurements and sources: docs/derivations.md, ``collsim.validate.measure.step``.
"""

from __future__ import annotations

import dataclasses
import os
import statistics
from dataclasses import dataclass, field
from typing import Any

from collsim.cluster.hardware import get_device
from collsim.cluster.topology import resolve_topology_path
from collsim.core.vocab import Dtype, Optimizer
from collsim.parallel.config import DDPConfig, FSDPConfig, ParallelConfig, TrainingConfig
from collsim.play.engine.step import simulate_step
from collsim.step.stragglers import SlowGPU, StragglerConfig
from collsim.validate.measure.concurrency import cpu_share
from collsim.validate.measure.insitu import (
    insitu_topology,
    peer_idle_boost,
    sharing_factor,
    straggler_span_s,
)
from collsim.validate.measure.step_model import STRAGGLER_SUFFIX, StepConfig, model_spec
from collsim.workload.compute import ComputeModel

__all__ = [
    "SimulatedMode",
    "simulate_modes",
    "on_these_cores",
    "profile_device",
    "straggler_ratios",
    "cores_busy",
]


@dataclass
class SimulatedMode:
    """The simulated step of one mode."""

    mode: str
    step_time_s: float
    breakdown_s: dict[str, float] = field(default_factory=dict)
    num_collectives: int = 0
    clock_factor: float = 1.0
    """The simulated clock factor of the slowed rank (``+straggler`` modes; 1 otherwise)."""


def simulate_modes(
    report: dict[str, Any],
    topology: Any,
    overlap: bool | None = None,
    scale_compute: bool = True,
    measured_factor: bool = False,
    device_profile: str | None = None,
    insitu: bool = True,
) -> dict[str, SimulatedMode]:
    """Simulate every measured mode of ``report`` on ``topology``.

    Args:
        report: a :func:`run_step` report.
        topology: the calibrated topology.
        overlap: DDP all-reduces overlap backward; None decides by :func:`cores_busy`.
        scale_compute: (without a profile) scale the profiled blocks by the report's
            ``compute_scale`` (the measured local step over the sum of the blocks).
        device_profile: a device profile from ``collsim validate compute``: compute comes
            from the compute MODEL fed by that profile (its generic kernel grid, none of this
            model's shapes), not from the blocks profiled on this model and with no scaling
            to the measured step. When the ranks' threads exceed the cores, every rate is
            divided by :func:`collsim.validate.measure.concurrency.cpu_share` (the OS shares the
            cores evenly between the busy threads).
        measured_factor: simulate a ``+straggler`` mode's slowed rank at its measured speed
            (local step over local step plus its measured extra seconds) instead of the
            nominal 1 / ``straggler_repeat``.
        insitu: price the collectives on ``topology`` fitted to the collectives the report
            timed in its own loop, and add DDP's measured gradient copies
            (:func:`on_these_cores`); False: ``topology`` as given, no copies.
    """
    if device_profile is not None:
        return _simulate_from_profile(report, topology, overlap, device_profile, insitu)

    fields: dict[str, Any] = {
        k: (tuple(v) if k == "modes" else v) for k, v in report["config"].items()
    }
    cfg = StepConfig(**fields)
    spec = model_spec(cfg)
    n = int(report["world_size"])
    training = TrainingConfig(
        global_batch=cfg.micro_batch * n,
        micro_batch=cfg.micro_batch,
        dtype=Dtype.FP32,
        optimizer=Optimizer.SGD,
    )
    scale = float(report.get("compute_scale", 1.0)) if scale_compute else 1.0

    def stragglers_for(mode: str) -> Any:
        """The simulated straggler of a ``+straggler`` mode (:func:`_slowed_rank`), with the
        slowed rank's measured extra seconds when ``measured_factor``."""
        extra = report["modes"][mode].get("extra_median_s")
        measured = float(extra) if measured_factor and extra else None
        return _slowed_rank(cfg, float(report["local_step_s"]), measured, boost)

    overrides = {k: float(v) * scale for k, v in report["profile"].items()}
    if overlap is None:
        overlap = not cores_busy(report)
    topology, copies_s = on_these_cores(report, topology, insitu)
    boost = 1.0
    if copies_s > 0:  # the sharing of the cores prices the overlap (_on_busy_cores)
        overlap = True
        boost = peer_idle_boost(report)
    out: dict[str, SimulatedMode] = {}
    for mode in report["modes"]:
        slowed = mode.endswith(STRAGGLER_SUFFIX)
        base_mode = mode.removesuffix(STRAGGLER_SUFFIX)
        if base_mode == "fsdp":
            parallel = ParallelConfig(
                dp=n, zero=3, fsdp=FSDPConfig(prefetch=0, reshard_after_forward=False)
            )
        else:
            parallel = ParallelConfig(
                dp=n, ddp=DDPConfig(bucket_mb=float(base_mode[5:]), overlap=overlap)
            )
        straggler = stragglers_for(mode) if slowed else None
        result = simulate_step(
            topology,
            spec,
            training,
            parallel,
            op_time_overrides=overrides,
            stragglers=straggler,
        )
        step_s, breakdown = _on_busy_cores(report, base_mode, result, copies_s)
        out[mode] = SimulatedMode(
            mode,
            step_s,
            breakdown,
            sum(c.count for c in result.collectives),
            straggler.slow_gpu.clock_factor if straggler is not None else 1.0,
        )
    return out


def _slowed_rank(cfg: StepConfig, local_s: float, extra_s: float | None, boost: float) -> Any:
    """The ``stragglers`` of a ``+straggler`` mode: the slowed rank at the nominal clock
    factor 1 / repeat, or with a delay the local step over local step + delay, or with
    ``extra_s`` (measured) local step / (local step + extra); with ``boost`` > 1 the span is
    :func:`collsim.validate.measure.insitu.straggler_span_s` (its compute gets the CPU of its
    waiting peers)."""

    assert cfg.straggler_rank is not None
    factor = 1 / cfg.straggler_repeat
    if cfg.straggler_delay_s > 0:  # nominally: the delay added to a local step
        factor = local_s / (local_s + cfg.straggler_delay_s)
    if extra_s:
        factor = local_s / (local_s + extra_s)
    if boost > 1.0:  # its peers idle at the all-reduce: it gets their CPU (insitu)
        factor = local_s / straggler_span_s(local_s, local_s / factor - local_s, boost)
    return StragglerConfig(slow_gpu=SlowGPU(ranks=(cfg.straggler_rank,), clock_factor=factor))


def on_these_cores(report: dict[str, Any], topology: Any, insitu: bool = True) -> tuple[Any, float]:
    """The topology and the DDP gradient copies' seconds a simulation of ``report`` uses.

    With ``insitu`` and a report that timed its collectives in its own loop
    (:mod:`collsim.validate.measure.insitu`): ``topology`` fitted to those points, and the measured
    copies; else ``topology`` itself and 0 (the report says why in ``insitu_note``)."""
    if not insitu:
        return topology, 0.0

    n = int(report["world_size"])
    per_node = int(report.get("local_world_size", n))
    base = str(getattr(topology, "name", "") or "localhost")
    try:
        resolve_topology_path(base)
    except Exception:  # a topology built in code, or from a file moved since: its shape only
        base = "localhost"
    fitted, text, why = insitu_topology(
        report, base, nodes=max(1, n // per_node), gpus_per_node=per_node
    )
    report["insitu_note"] = why
    if fitted is None:
        return topology, 0.0
    report["insitu_topology_yaml"] = text
    return fitted, float(report.get("ddp_copies_s", 0.0))


def _on_busy_cores(
    report: dict[str, Any], base_mode: str, result: Any, copies_s: float
) -> tuple[float, dict[str, float]]:
    """The simulated step and breakdown of a mode on CPU ranks (gloo) with in-situ data
    (``copies_s`` > 0): a DDP mode adds its gradient copies (``framework``, on the compute
    thread); every mode adds ``dp_on_busy_cores``, the data-parallel link time the engine hid
    under compute times (f - 1), f of
    :func:`collsim.validate.measure.insitu.sharing_factor`: while a
    collective runs beside the compute, both share the cores with every other runnable thread
    (f = 2 on a quiet host whose cores the ranks fill: nothing is hidden)."""
    step_s = float(result.step_time_s)
    breakdown = dict(result.breakdown_s)
    if report.get("backend") != "gloo" or copies_s <= 0:
        return step_s, breakdown

    if base_mode.startswith("ddp"):
        breakdown["framework"] = breakdown.get("framework", 0.0) + copies_s
        step_s += copies_s
    link = sum(c.time_s for c in result.collectives if c.axis == "dp")
    hidden = max(0.0, link - float(breakdown.get("dp_exposed", 0.0)))
    extra = hidden * (sharing_factor(report) - 1.0)
    if extra > 0:
        breakdown["dp_on_busy_cores"] = extra
        step_s += extra
    return step_s, breakdown


def straggler_ratios(
    report: dict[str, Any], simulated: dict[str, SimulatedMode]
) -> dict[str, dict[str, float]]:
    """Per DDP mode timed with a straggler: the slowdown ratio measured and simulated, and the
    ratio's relative error (simulated - measured) / measured.

    The measured ratio is the median over iterations of the paired ratio, straggler step over
    normal step of the same iteration (the two are timed back to back, so that a burst of load
    from other processes falls on both); the ratio of the two medians is kept beside it
    (``measured_ratio_of_medians``)."""
    out: dict[str, dict[str, float]] = {}
    modes = report["modes"]
    for slowed, meas in modes.items():
        if not slowed.endswith(STRAGGLER_SUFFIX):
            continue
        base = slowed.removesuffix(STRAGGLER_SUFFIX)
        paired = [a / b for a, b in zip(meas["times_s"], modes[base]["times_s"])]
        measured = statistics.median(paired)
        sim = simulated[slowed].step_time_s / simulated[base].step_time_s
        out[base] = {
            "measured_ratio": measured,
            "simulated_ratio": sim,
            "error": (sim - measured) / measured,
            "measured_ratio_of_medians": meas["median_s"] / modes[base]["median_s"],
            "measured_ratio_min": min(paired),
            "measured_ratio_max": max(paired),
            "measured_straggler_s": meas["median_s"],
            "measured_normal_s": modes[base]["median_s"],
            "simulated_straggler_s": simulated[slowed].step_time_s,
            "simulated_normal_s": simulated[base].step_time_s,
            "simulated_clock_factor": simulated[slowed].clock_factor,
            "measured_extra_s": float(meas.get("extra_median_s", 0.0)),
        }
    return out


def profile_device(report: dict[str, Any], device_profile: str) -> tuple[Any, float, float]:
    """The profile's device as one rank of ``report`` sees it, and the CPU shares applied to
    its compute and to its memory-bound rates."""

    device = get_device(device_profile)
    if device.measured is None:
        raise ValueError(f"{device_profile}: not a measured profile (no 'measured' section)")
    profile_threads = int(device.measured.extra.get("threads", 1))
    cores = int(report.get("cpu_count") or os.cpu_count() or 1)
    ranks = int(report.get("local_world_size", report["world_size"]))
    threads = int(report.get("threads_per_rank", 1))
    extra = device.measured.extra
    slowdown = float(extra.get("concurrent_slowdown", 1.0))
    memory_slowdown = float(extra.get("concurrent_memory_slowdown", slowdown))
    gloo = report.get("backend") == "gloo"
    share = cpu_share(ranks, threads, cores, profile_threads, slowdown) if gloo else 1.0
    memory_share = (
        cpu_share(ranks, threads, cores, profile_threads, memory_slowdown) if gloo else 1.0
    )
    if gloo and ranks * threads > cores:
        # ranks time-sharing a core run slower than the even share: a trace profile's
        # slowdown measured from the step traced pinned (collsim.validate.fit.trace_profile)
        sharing = float(extra.get("time_sharing_slowdown", 1.0))
        share *= sharing
        memory_share *= sharing
    if share != 1.0 or memory_share != 1.0:
        device = dataclasses.replace(device, measured=device.measured.shared(share, memory_share))
    return device, share, memory_share


def _simulate_from_profile(
    report: dict[str, Any],
    topology: Any,
    overlap: bool | None,
    device_profile: str,
    insitu: bool = True,
) -> dict[str, SimulatedMode]:
    fields: dict[str, Any] = {
        k: (tuple(v) if k == "modes" else v) for k, v in report["config"].items()
    }
    cfg = StepConfig(**fields)
    # the measured model runs F.scaled_dot_product_attention: a fused attention kernel
    spec = dataclasses.replace(model_spec(cfg), flash_attention=True)
    n = int(report["world_size"])
    training = TrainingConfig(
        global_batch=cfg.micro_batch * n,
        micro_batch=cfg.micro_batch,
        dtype=Dtype.FP32,
        optimizer=Optimizer.SGD,
    )
    device, _, _ = profile_device(report, device_profile)
    fitted, _ = on_these_cores(report, topology, insitu)
    topo = fitted.replaced(device=device)
    # DDP's gradient copies from the profile, not from the probe timed on this model: 16
    # bytes per parameter (collsim.validate.measure.insitu) at the profile's memory-bound rate
    copies_s = 0.0
    if insitu and fitted is not topology:
        # one kernel per gradient tensor each way: 12 per block (LayerNorm x 2, QKV, output
        # projection, MLP up and down, weights and biases), 4 outside (embeddings, ln_f)
        tensors = 12 * cfg.num_layers + 4
        # DDP's reducer issues them from C++: a tiny op's floor, not the host cost per launch
        # of a trace profile (collsim.validate.fit.trace_host.host_per_launch)
        floor_us = device.measured.extra.get("op_floor_us")
        copier = device
        if floor_us is not None:
            scaled = float(floor_us) * float(device.measured.extra.get("cpu_share", 1.0))
            copier = dataclasses.replace(
                device, measured=dataclasses.replace(device.measured, host_us=scaled)
            )
        copies_s = ComputeModel(copier, "fp32").memory_time_s(
            16.0 * float(report["num_parameters"]), kernels=2 * tensors
        )
    if overlap is None or copies_s > 0:
        overlap = copies_s > 0 or not cores_busy(report)
    boost = 1.0
    if copies_s > 0:
        boost = peer_idle_boost(report)
    out: dict[str, SimulatedMode] = {}
    # the normal modes first: a straggler mode's slowed rank is relative to its simulated
    # compute (the profile's, not the measured local step)
    order = sorted(report["modes"], key=lambda m: m.endswith(STRAGGLER_SUFFIX))
    for mode in order:
        base_mode = mode.removesuffix(STRAGGLER_SUFFIX)
        if base_mode == "fsdp":
            parallel = ParallelConfig(
                dp=n, zero=3, fsdp=FSDPConfig(prefetch=0, reshard_after_forward=False)
            )
        else:
            parallel = ParallelConfig(
                dp=n, ddp=DDPConfig(bucket_mb=float(base_mode[5:]), overlap=overlap)
            )
        straggler = None
        if mode != base_mode:
            parts = out[base_mode].breakdown_s
            local = parts.get("compute", 0.0) + parts.get("optimizer", 0.0)
            extra = report["modes"][mode].get("extra_median_s")
            straggler = _slowed_rank(cfg, local, float(extra) if extra else None, boost)
        result = simulate_step(topo, spec, training, parallel, stragglers=straggler)
        step_s, breakdown = _on_busy_cores(report, base_mode, result, copies_s)
        out[mode] = SimulatedMode(
            mode,
            step_s,
            breakdown,
            sum(c.count for c in result.collectives),
            straggler.slow_gpu.clock_factor if straggler is not None else 1.0,
        )
    return {m: out[m] for m in report["modes"]}


def cores_busy(report: dict[str, Any]) -> bool:
    """True when CPU ranks fill every core (gloo, ranks x threads >= cores): nothing is left
    to run gloo's copies and reductions beside backward, so DDP's all-reduces cannot overlap
    it and the engine is run with ``ddp.overlap = False``. GPUs (nccl) always overlap."""
    if report.get("backend") != "gloo":
        return False
    cores = int(report.get("cpu_count") or 0)
    ranks_per_node = int(report.get("local_world_size", report["world_size"]))
    return cores > 0 and ranks_per_node * int(report.get("threads_per_rank", 1)) >= cores
