"""Turn a finished engine run into a :class:`~collsim.step.result.StepResult`.

Step time is the latest end over the simulated ranks; its breakdown is that rank's compute
stream account (compute, tp_exposed, pp_exposed, dp_exposed, bubble, optimizer), which adds up
to its end time by construction (checked). FLOP/s, MFU and HFU follow Narayanan et al. 2021
(``collsim.workload.flops``); memory is the peak of the most loaded rank's timeline.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Protocol

from collsim.core.errors import SimulationError
from collsim.core.units import GiB
from collsim.parallel.describe import describe_mapping
from collsim.parallel.plan import Plan
from collsim.step.allocator import allocator_limit_bytes, expandable_segments_of, reserved_memory
from collsim.step.memory import Timelines
from collsim.step.result import MEMORY_KEYS, Breakdown, CollectiveStat, StepResult
from collsim.workload import flops

if TYPE_CHECKING:
    from collections.abc import Iterable, Mapping

    from collsim.parallel.plan import RankCoords
    from collsim.step.memory import MemoryLedger
    from collsim.step.result import TraceEvent
    from collsim.step.shapes import ShapeCache
    from collsim.step.stats import CallKey, CallTally


class RankRecord(Protocol):
    """What one played rank leaves behind."""

    rank: int
    coords: RankCoords
    end_s: float
    breakdown_s: dict[str, float]
    ledger: MemoryLedger


class PlayedStep(Protocol):
    """A step played by either fidelity: its ranks, call tallies and trace."""

    @property
    def programs(self) -> Mapping[int, RankRecord]: ...

    @property
    def des_axes(self) -> frozenset[str]: ...

    @property
    def trace_events(self) -> list[TraceEvent]: ...

    def stat_items(self) -> Iterable[tuple[CallKey, CallTally]]: ...


__all__ = ["assemble"]


def _collectives(engine: PlayedStep) -> list[CollectiveStat]:
    """Per (axis, op, size, group, algorithm): calls per issuing rank and their link time."""
    merged: dict[tuple[Any, ...], list[Any]] = {}
    for k, tally in engine.stat_items():
        key = k[1:]  # (axis, op, size, group size, algorithm): CallKey less the rank
        slot = merged.get(key)
        if slot is None:  # [calls, seconds, the first tally's busbw, the issuing ranks]
            merged[key] = [tally.count, 0.0 + tally.time_s, tally.busbw_bps, {k.rank}]
        else:
            slot[0] += tally.count
            slot[1] += tally.time_s
            slot[3].add(k.rank)
    out = []
    for key, (count, time_s, busbw, ranks) in sorted(merged.items(), key=lambda kv: kv[0][:2]):
        axis, op, size, n, algo = key
        issuers = len(ranks)
        out.append(
            CollectiveStat(
                axis=axis,
                op=op,
                group_size=n,
                algorithm=algo,
                count=round(count / issuers),
                size_bytes=float(size),
                time_s=time_s / issuers,
                busbw_bps=busbw,
            )
        )
    return out


def _memory_fit(
    plan: Plan,
    engine: PlayedStep,
    allocated_peaks: dict[int, float],
    top_rank: int,
    timeline: bool,
    memo: ShapeCache | None = None,
) -> tuple[bool, float | None, dict[str, Any] | None, str]:
    """Whether the plan fits, the peak reserved memory, the allocator's facts and the
    warning when it does not fit. On a GPU, PyTorch's caching allocator is replayed
    (:mod:`collsim.step.allocator`) with the run's timeline kept, and in a search's inner loop
    for the plans whose allocated peak lies between the usable capacity and what the allocator
    can hold: the plan fits when no request fails after the allocator's release-and-retry;
    else the allocated peak against the usable capacity."""
    device = plan.topology.device
    capacity = float(device.usable_memory_bytes)
    peak = allocated_peaks[top_rank]
    # a search (no timeline) replays only the plans the allocated rule would refuse but the
    # allocator could still hold, so it never refuses a plan that ``collsim run`` keeps
    near_limit = capacity < peak <= allocator_limit_bytes(device)
    if device.generation == "cpu" or (not timeline and not near_limit):
        if peak <= capacity:
            return True, None, None, ""
        return (
            False,
            None,
            None,
            f"does not fit: {peak / GiB:.1f} GiB needed of {capacity / GiB:.1f} GiB",
        )
    tr = plan.training
    reserved, allocator = reserved_memory(
        {rank: prog.ledger for rank, prog in engine.programs.items()},
        expandable_segments=expandable_segments_of(tr.stack, tr.expandable_segments),
        limit_bytes=allocator_limit_bytes(device),
        allocated_peaks=allocated_peaks,
        schedule=getattr(engine, "schedule", None),
        memo=memo,
    )
    if not allocator["oom"]:
        return True, reserved, allocator, ""
    return (
        False,
        reserved,
        allocator,
        f"does not fit: the caching allocator runs out of memory on rank {allocator['rank']} "
        f"({peak / GiB:.1f} GiB allocated at the peak, {allocator['limit_bytes'] / GiB:.1f} "
        "GiB the allocator can hold)",
    )


def assemble(
    plan: Plan,
    engine: PlayedStep,
    *,
    fidelity: str,
    contended: list[str],
    zero_communication: bool,
    timeline: bool = True,
    mapping: str | None = None,
    shapes: ShapeCache | None = None,
) -> StepResult:
    """The step's result from what ``engine`` played; ``mapping``: the plan's rank layout
    in words when the caller has it (:func:`~collsim.parallel.describe.describe_mapping`);
    ``shapes``: a search's shape cache, which keeps the allocator's replays."""
    programs = engine.programs
    critical = max(programs.values(), key=lambda p: (p.end_s, -p.rank))
    step = critical.end_s
    if step <= 0:
        raise SimulationError("the step took no time")
    breakdown = Breakdown.of(critical.breakdown_s)
    total = breakdown.total_s
    if abs(total - step) > 1e-9 * max(1.0, step):
        raise SimulationError(f"breakdown {total} != step time {step} on rank {critical.rank}")
    spec, tr = plan.spec, plan.training
    gpus = plan.num_gpus
    peak_flops = plan.topology.device.peak_flops_for(str(tr.dtype))
    model_tf = flops.model_tflops_per_gpu(spec, tr.global_batch, step, gpus)
    hw_tf = flops.hardware_tflops_per_gpu(spec, tr.global_batch, step, gpus, str(tr.recompute))
    peaks = {rank: prog.ledger.peak() for rank, prog in programs.items()}
    top_rank = max(peaks, key=lambda r: (peaks[r].total_bytes, -r))
    top = peaks[top_rank]
    # before the allocator's replay, which expands a rank's events (their arrays are then
    # made again)
    activation_peaks = {r: prog.ledger.category_peak("activations") for r, prog in programs.items()}
    # what PyTorch reports minus the CUDA context, NCCL buffers and fragmentation
    device = plan.topology.device
    capacity = float(device.usable_memory_bytes)
    reserve = float(device.memory_reserve_bytes)
    warnings_out = list(plan.warnings)
    fits, reserved, allocator, verdict = _memory_fit(
        plan, engine, {r: p.total_bytes for r, p in peaks.items()}, top_rank, timeline, shapes
    )
    if verdict:
        warnings_out.append(verdict)
    # the first rank (dp 0, tp 0) of each simulated stage
    firsts = [prog for prog in programs.values() if prog.coords.dp == 0 and prog.coords.tp == 0]
    return StepResult(
        step_time_s=step,
        tokens_per_s=tr.global_batch * spec.seq_len / step,
        model_tflops_per_gpu=model_tf,
        hardware_tflops_per_gpu=hw_tf,
        mfu=model_tf * 1e12 / peak_flops,
        hfu=hw_tf * 1e12 / peak_flops,
        breakdown_s=breakdown,
        memory_peak_bytes=top.total_bytes,
        memory_bytes={k: top.by_category.get(k, 0.0) for k in MEMORY_KEYS},
        memory_capacity_bytes=capacity,
        fits=fits,
        num_gpus=gpus,
        collectives=_collectives(engine),
        warnings=warnings_out,
        mapping=describe_mapping(plan) if mapping is None else mapping,
        memory_timeline=(
            Timelines({rank: prog.ledger for rank, prog in programs.items()}) if timeline else {}
        ),
        trace_events=sorted(engine.trace_events, key=lambda e: (e.start_s, e.rank)),
        memory_reserve_bytes=reserve,
        memory_datasheet_bytes=float(device.memory_bytes),
        num_microbatches=plan.num_microbatches,
        critical_rank=critical.rank,
        peak_memory_rank=top_rank,
        fidelity=fidelity,
        contended_axes=list(contended),
        des_axes=sorted(engine.des_axes),
        zero_communication=zero_communication,
        simulated_ranks=sorted(programs),
        stage_end_s={prog.coords.pp: prog.end_s for prog in firsts},
        breakdown_by_stage_s={prog.coords.pp: dict(prog.breakdown_s) for prog in firsts},
        memory_peak_bytes_by_rank={r: p.total_bytes for r, p in peaks.items()},
        activation_peak_bytes_by_rank=activation_peaks,
        rank_stages={rank: plan.stage_of(rank) for rank in programs},
        memory_reserved_bytes=reserved,
        allocator=allocator,
    )
