"""Plan search: enumerate parallel plans for a model on N GPUs, rank them, re-simulate the best.

``collsim search SCENARIO --gpus N`` keeps the scenario's model, cluster type, global batch,
dtype and optimizer, and varies the plan: tp, pp, dp, micro-batch size, pipeline schedule and
virtual stages, ZeRO stage, activation recompute and sequence parallelism.

1. :func:`enumerate_plans` walks the grid and drops plans that cannot be built, counting why
   (``tp_heads``: heads or ffn not divisible by tp; ``tp_node``: tp larger than a node;
   ``pp_layers``: layers not divisible by pp x v; ``batch``: global batch not divisible by
   dp x micro-batch; ``interleaved_m``: Megatron's interleaving needs m divisible by pp;
   ``zero_pp``: ZeRO-2/3 with pipeline parallelism, which DeepSpeed and Megatron do not support
   because gradients are reduced once per step, not per micro-batch).
2. Plans whose memory floor exceeds the GPU are dropped (``memory_bound``); the others are
   estimated by the closed form (:mod:`collsim.estimate`) best-first by a floor on their step
   time, until no floor left can beat the best kept (``bound``); estimated plans whose memory
   exceeds the GPU's are counted as ``memory``. ``jobs`` processes estimate in parallel.
3. The best ``top_k`` by estimate are simulated with the discrete-event engine, which has the
   last word on step time and memory (a simulated plan that does not fit is ``memory (DES)``).

Nothing here prints; a callback reports progress.
"""

from __future__ import annotations

import dataclasses
import heapq
import time
import warnings
from collections import Counter
from collections.abc import Callable, Iterable, Iterator, Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from collsim.collectives import Group, cost
from collsim.errors import CollsimWarning, ConfigError, InfeasibleError
from collsim.estimate import Estimator
from collsim.jobs import SchedulerLost, Workers
from collsim.parallel.config import ParallelConfig as Parallel
from collsim.parallel.config import Recompute
from collsim.parallel.layer_comms import layer_comms
from collsim.parallel.pipeline import Phase, flow, get_schedule
from collsim.parallel.plan import build_plan, default_order, grid_rank, rank_axes
from collsim.parallel.states import rank_model_states
from collsim.schedule.build import bytes_per
from collsim.schedule.pricing import ClosedPricer as Pricer
from collsim.schedule.result import BREAKDOWN_KEYS, MEMORY_KEYS, Breakdown
from collsim.schedule.result import StepResult as Result
from collsim.study.job import StepInputs, simulate_inputs
from collsim.vocab import ScheduleKind
from collsim.workload.compute import ComputeModel
from collsim.workload.memory import layer_parameters_per_rank, layers_per_stage, parameters_per_rank

if TYPE_CHECKING:  # pragma: no cover
    import pandas as pd

    from collsim.parallel.config import ParallelConfig, TrainingConfig
    from collsim.schedule.pricing import ClosedPricer
    from collsim.schedule.result import StepResult
    from collsim.topology import Topology
    from collsim.workload.model import TransformerSpec

__all__ = [
    "SearchSpace",
    "Candidate",
    "Ranked",
    "SearchResult",
    "enumerate_plans",
    "search_plans",
    "search_frame",
    "collapse",
    "shape_of",
    "MINOR_KNOBS",
    "known_from_frame",
]

REASONS = {
    "tp_heads": "heads or ffn_hidden not divisible by tp",
    "tp_node": "tp larger than the space's max_tp",
    "pp_layers": "layers not divisible by pp x virtual stages",
    "batch": "global batch not divisible by dp x micro-batch",
    "interleaved_m": "interleaved needs micro-batches divisible by pp",
    "schedule_m": "too few micro-batches for the schedule (DualPipeV: 2 x pp)",
    "zero_pp": "ZeRO-2/3 with pipeline parallelism (left out of this space)",
    "no_dp": "a bucket size other than the first without data parallelism (same plan)",
    "cp_gpus": "cp does not divide the GPUs",
    "cp_seq": "cp (2 x cp with load balancing) does not divide the sequence",
    "ep_experts": "ep does not divide the routed experts",
    "ep_fold": "ep x etp does not divide tp x cp x dp",
    "memory": "estimated memory exceeds the GPU",
    "memory_bound": "pruned: its memory floor (model states and the activations held at once) "
    "exceeds the GPU",
    "memory (DES)": "simulated memory exceeds the GPU",
    "bound": "pruned: its step-time floor (compute stream, pipeline order, data-parallel calls) "
    "cannot beat the best kept",
}


@dataclass(frozen=True, slots=True, kw_only=True)
class SearchSpace:
    """What the search varies. Defaults cover what Megatron-LM and DeepSpeed offer."""

    micro_batches: tuple[int, ...] = (1, 2, 4, 8, 16, 32, 64)
    schedules: tuple[str, ...] = ("gpipe", "1f1b", "interleaved")
    """Pipeline schedules tried (``zb_h1`` and ``dualpipev`` too when named)."""
    virtual_stages: tuple[int, ...] = (2, 3, 4, 6, 8, 12, 16, 24)
    """Chunks per stage tried with the interleaved schedule."""
    zero_stages: tuple[int, ...] = (0, 1, 2, 3)
    recomputes: tuple[str, ...] = ("none", "selective", "full")
    sequence_parallel: tuple[bool, ...] = (False, True)
    bucket_mbs: tuple[float, ...] = (10.0, 25.0, 100.0, 400.0)
    """DDP / ZeRO-1/2 bucket sizes tried (MiB; torch's default is 25)."""
    overlaps: tuple[bool, ...] = (True, False)
    """DDP / ZeRO-1/2 gradient reduction overlapped with backward, or after it."""
    bucket_views: tuple[bool, ...] = (False, True)
    """DDP (ZeRO 0): torch's ``gradient_as_bucket_view`` (gradients not held twice)."""
    prefetches: tuple[int, ...] = (0, 1, 2, 4)
    """ZeRO-3 / FSDP prefetch depths tried."""
    offloads: tuple[bool, ...] = (False, True)
    """ZeRO-3 with and without CPU offload of the shards."""
    reshards: tuple[bool, ...] = (True, False)
    """ZeRO-3 parameters resharded after forward (FULL_SHARD) or kept (SHARD_GRAD_OP)."""
    max_tp: int | None = None
    """Largest tp; None = any (TP across nodes is tried too; the network prices it)."""
    zero_with_pp: bool = True
    """Try ZeRO-2/3 with pipeline parallelism (the engine reduces per micro-batch)."""
    cps: tuple[int, ...] | None = None
    """Context-parallel sizes tried (None: the scenario's)."""
    eps: tuple[int, ...] | None = None
    """Expert-parallel sizes tried (None: the scenario's; MoE models only)."""
    tps: tuple[int, ...] | None = None
    """Tensor-parallel sizes tried (None: every divisor of the GPUs); others are outside the
    space, not counted."""
    pps: tuple[int, ...] | None = None
    """Pipeline-parallel sizes tried (None: every divisor); others are outside the space."""

    def dp_variants(self) -> list[DPVariant]:
        """Data-parallel knob combinations: buckets and overlap for ZeRO 0-2, prefetch,
        offload and resharding for ZeRO-3."""
        out: list[DPVariant] = []
        for zero in self.zero_stages:
            if zero < 3:
                out += [
                    DPVariant(zero=zero, bucket_mb=b, overlap=o, bucket_view=view)
                    for b in self.bucket_mbs
                    for o in self.overlaps
                    for view in (self.bucket_views if zero == 0 else (False,))
                ]
            else:
                out += [
                    DPVariant(zero=zero, prefetch=p, offload=f, reshard=r)
                    for p in self.prefetches
                    for f in self.offloads
                    for r in self.reshards
                ]
        return out


@dataclass(frozen=True, slots=True)
class DPVariant:
    """One combination of the data-parallel knobs."""

    zero: int
    bucket_mb: float = 25.0
    overlap: bool = True
    bucket_view: bool = False
    prefetch: int = 1
    offload: bool = False
    reshard: bool = True


@dataclass(frozen=True, slots=True, kw_only=True)
class Candidate:
    """One plan: the knobs the search turns."""

    tp: int
    pp: int
    dp: int
    micro_batch: int
    schedule: str
    virtual_stages: int
    zero: int
    recompute: str
    sequence_parallel: bool
    bucket_mb: float = 25.0
    overlap: bool = True
    bucket_view: bool = False
    prefetch: int = 1
    offload: bool = False
    reshard: bool = True
    cp: int = 1
    ep: int = 1

    @property
    def label(self) -> str:
        """``tp8 pp8 dp16 mb1 interleaved v2 zero1 rc=full sp``, plus the non-default
        bucket size (``b100``), prefetch depth (``pf2``) or ``offload``."""
        parts = [f"tp{self.tp}"] + ([f"cp{self.cp}"] if self.cp > 1 else [])
        parts += [f"pp{self.pp}", f"dp{self.dp}"] + ([f"ep{self.ep}"] if self.ep > 1 else [])
        parts.append(f"mb{self.micro_batch}")
        if self.pp > 1:
            interleaved = self.schedule == "interleaved" and self.virtual_stages > 1
            parts.append(self.schedule + (f" v{self.virtual_stages}" if interleaved else ""))
        parts += [f"zero{self.zero}", f"rc={self.recompute}"]
        if self.sequence_parallel:
            parts.append("sp")
        if self.zero < 3 and self.bucket_mb != 25.0:
            parts.append(f"b{self.bucket_mb:g}")
        if self.zero < 3 and not self.overlap:
            parts.append("no-overlap")
        if self.bucket_view:
            parts.append("grad-view")
        if self.zero == 3 and self.prefetch != 1:
            parts.append(f"pf{self.prefetch}")
        if self.offload:
            parts.append("offload")
        if self.zero == 3 and not self.reshard:
            parts.append("keep-params")
        return " ".join(parts)

    def configs(
        self, base_training: TrainingConfig, base_parallel: ParallelConfig
    ) -> tuple[TrainingConfig, ParallelConfig]:
        """The scenario's training and parallel sections with this plan's knobs."""

        training = dataclasses.replace(
            base_training, micro_batch=self.micro_batch, recompute=Recompute(self.recompute)
        )
        parallel = dataclasses.replace(
            base_parallel,
            tp=self.tp,
            pp=self.pp,
            dp=self.dp,
            cp=self.cp,
            ep=self.ep,
            schedule=ScheduleKind(self.schedule),
            virtual_stages=self.virtual_stages,
            zero=self.zero,
            sequence_parallel=self.sequence_parallel,
            ddp=dataclasses.replace(
                base_parallel.ddp,
                bucket_mb=self.bucket_mb,
                overlap=self.overlap,
                gradient_as_bucket_view=self.bucket_view,
            ),
            fsdp=dataclasses.replace(
                base_parallel.fsdp,
                prefetch=self.prefetch,
                offload=self.offload,
                reshard_after_forward=self.reshard,
            ),
        )
        return training, parallel

    def as_dict(self) -> dict[str, Any]:
        return {
            "plan": self.label,
            "tp": self.tp,
            "pp": self.pp,
            "dp": self.dp,
            "micro_batch": self.micro_batch,
            "schedule": self.schedule,
            "virtual_stages": self.virtual_stages,
            "zero": self.zero,
            "recompute": self.recompute,
            "sequence_parallel": self.sequence_parallel,
            "bucket_mb": self.bucket_mb,
            "overlap": self.overlap,
            "gradient_as_bucket_view": self.bucket_view,
            "prefetch": self.prefetch,
            "offload": self.offload,
            "reshard_after_forward": self.reshard,
            "cp": self.cp,
            "ep": self.ep,
        }


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def enumerate_plans(
    spec: TransformerSpec,
    num_gpus: int,
    gpus_per_node: int,
    global_batch: int,
    space: SearchSpace | None = None,
    rejected: Counter[str] | None = None,
    *,
    base: ParallelConfig | None = None,
) -> Iterator[Candidate]:
    """Every buildable plan of ``spec`` on ``num_gpus`` GPUs; the others are counted by reason
    in ``rejected`` (one count per plan of the full grid that is dropped). ``base`` (the
    scenario's parallel section) gives the cp and ep sizes the space leaves unset, the
    expert tensor-parallel size and CP's load balancing."""

    space = space or SearchSpace()
    rejected = rejected if rejected is not None else Counter()
    base = base if base is not None else Parallel()
    cps = space.cps or (base.cp,)
    eps = (space.eps or (base.ep,)) if spec.num_experts else (1,)
    for cp in cps:
        chunks = 2 * cp if (cp > 1 and base.cp_load_balance) else cp
        for ep in eps:
            if num_gpus % cp or spec.seq_len % chunks:
                rejected["cp_gpus" if num_gpus % cp else "cp_seq"] += _grid_size(
                    num_gpus // cp if num_gpus % cp == 0 else num_gpus, space
                )
                continue
            if spec.num_experts % ep:
                rejected["ep_experts"] += _grid_size(num_gpus // cp, space)
                continue
            yield from _grid(spec, num_gpus // cp, global_batch, space, rejected, cp, ep, base)


def _within(sizes: list[int], allowed: tuple[int, ...] | None) -> list[int]:
    """``sizes`` that the space allows (all when ``allowed`` is None)."""
    return sizes if allowed is None else [n for n in sizes if n in allowed]


def _grid_size(num_gpus: int, space: SearchSpace) -> int:
    """Plans of the tp x pp x dp grid on ``num_gpus`` GPUs, buildable or not."""
    per_variant = len(space.dp_variants()) * len(space.recomputes)
    total = 0
    for tp in _divisors(num_gpus):
        sps = len([sp for sp in space.sequence_parallel if tp > 1 or not sp] or [False])
        for pp in _divisors(num_gpus // tp):
            scheds = 1 if pp == 1 else sum(len(_chunk_counts(k, space)) for k in space.schedules)
            total += len(space.micro_batches) * scheds * per_variant * sps
    return total


def _head_stage(c: Candidate) -> int:
    """The stage where ``c``'s schedule places the last model part (the head)."""
    v = c.virtual_stages
    return get_schedule(c.schedule).where(c.pp * v - 1, c.pp, v)[0]


def _chunk_counts(schedule: str, space: SearchSpace) -> tuple[int, ...]:
    """Chunks per stage tried with ``schedule``: the space's virtual stages where the
    schedule takes them (interleaved), else the schedule's own count."""
    if schedule == "interleaved":
        return space.virtual_stages
    return (get_schedule(schedule).chunks(1),)


def _grid(
    spec: TransformerSpec,
    num_gpus: int,
    global_batch: int,
    space: SearchSpace,
    rejected: Counter[str],
    cp: int,
    ep: int,
    base: ParallelConfig,
) -> Iterator[Candidate]:
    """The buildable plans of the tp x pp x dp grid on ``num_gpus`` (the GPUs of one cp
    index) at fixed cp and ep; the others counted by reason."""
    max_tp = space.max_tp or num_gpus
    variants = space.dp_variants()
    per_variant = len(variants) * len(space.recomputes)
    for tp in _within(_divisors(num_gpus), space.tps):
        sps = [sp for sp in space.sequence_parallel if tp > 1 or not sp] or [False]
        for pp in _within(_divisors(num_gpus // tp), space.pps):
            dp = num_gpus // (tp * pp)
            scheds: list[tuple[str, int]] = (
                [("1f1b", 1)]
                if pp == 1
                else [(s, v) for s in space.schedules for v in _chunk_counts(s, space)]
            )
            grid = len(space.micro_batches) * len(scheds) * per_variant * len(sps)
            if tp > max_tp:
                rejected["tp_node"] += grid
                continue
            if spec.num_heads % tp or spec.ffn_hidden % tp:
                rejected["tp_heads"] += grid
                continue
            if pp > spec.num_layers:
                rejected["pp_layers"] += grid
                continue
            if (tp * cp * dp) % (ep * base.etp):
                rejected["ep_fold"] += grid
                continue
            for mb in space.micro_batches:
                per_mb = len(scheds) * per_variant * len(sps)
                if global_batch % (dp * mb):
                    rejected["batch"] += per_mb
                    continue
                m = global_batch // (dp * mb)
                for schedule, v in scheds:
                    per_sched = per_variant * len(sps)
                    if spec.num_layers % (pp * v):
                        rejected["pp_layers"] += per_sched
                        continue
                    if schedule == "interleaved" and m % pp:
                        rejected["interleaved_m"] += per_sched
                        continue
                    pipeline = get_schedule(schedule)
                    try:
                        pipeline.check(num_stages=pp, num_microbatches=m, virtual_stages=v)
                    except ConfigError:
                        rejected["schedule_m"] += per_sched
                        continue
                    for var in variants:
                        zero = var.zero
                        if zero >= 2 and pp > 1 and not space.zero_with_pp:
                            rejected["zero_pp"] += len(space.recomputes) * len(sps)
                            continue
                        if dp == 1 and (var.bucket_mb, var.overlap, var.bucket_view) != (
                            variants[0].bucket_mb,
                            variants[0].overlap,
                            variants[0].bucket_view,
                        ):
                            # no data parallelism: buckets and their overlap change nothing
                            rejected["no_dp"] += len(space.recomputes) * len(sps)
                            continue
                        for recompute in space.recomputes:
                            for sp in sps:
                                yield Candidate(
                                    tp=tp,
                                    pp=pp,
                                    dp=dp,
                                    micro_batch=mb,
                                    schedule=schedule,
                                    virtual_stages=v,
                                    zero=zero,
                                    recompute=recompute,
                                    sequence_parallel=sp,
                                    bucket_mb=var.bucket_mb,
                                    overlap=var.overlap,
                                    bucket_view=var.bucket_view,
                                    prefetch=var.prefetch,
                                    offload=var.offload,
                                    reshard=var.reshard,
                                    cp=cp,
                                    ep=ep,
                                )


@dataclass(slots=True)
class Ranked:
    """A plan with its estimate and, for the best few, its simulation."""

    candidate: Candidate
    estimate: StepResult
    result: StepResult | None = None
    reason: str | None = None
    """Why the simulation could not run or the plan does not fit (None when fine)."""
    simulate_s: float = 0.0
    alike: list[Ranked] = field(default_factory=list)
    """Plans collapsed into this row (:func:`collapse`): same shape, estimate within the
    tolerance, other minor knobs."""

    @property
    def step_time_s(self) -> float:
        """The simulated step time when there is one, else the estimate."""
        return self.result.step_time_s if self.result is not None else self.estimate.step_time_s


@dataclass(slots=True)
class SearchResult:
    """What a search found."""

    num_gpus: int
    considered: int
    """Plans of the full grid (buildable + rejected)."""
    ranked: list[Ranked]
    """Feasible plans by estimated step time, best first."""
    simulated: list[Ranked]
    """The re-simulated best plans, by simulated step time (those that fit first)."""
    rejected: Counter[str] = field(default_factory=Counter)
    estimated: int = 0
    """Plans the closed form was evaluated for (buildable, not dropped by a bound)."""
    buildable: int = 0
    """Plans that passed the structural checks (estimated + dropped by a bound)."""
    estimate_s: float = 0.0
    simulate_s: float = 0.0
    rows: list[Ranked] = field(default_factory=list)
    """One row per family of alike plans (:func:`collapse`), best first."""
    tolerance: float = 0.0
    stopped: str | None = None
    """Why the search ended early (Ctrl-C, a lost scheduler); None when it ran to its end."""

    @property
    def best(self) -> Ranked | None:
        fits = [r for r in self.simulated if r.reason is None]
        if fits:
            return fits[0]
        return self.ranked[0] if self.ranked and not self.simulated else None


def search_plans(
    topology: Topology,
    spec: TransformerSpec,
    training: TrainingConfig,
    parallel: ParallelConfig,
    *,
    space: SearchSpace | None = None,
    top_k: int = 10,
    simulate: Callable[..., StepResult] | None = None,
    progress: Callable[[str, int], None] | None = None,
    prune_keep: int = 10,
    jobs: int = 1,
    scheduler: str | None = None,
    tolerance: float = 0.0,
    known: Mapping[str, StepResult] | None = None,
    on_estimate: Callable[[list[Ranked]], None] | None = None,
) -> SearchResult:
    """Enumerate, bound, estimate and rank the plans; re-simulate the ``top_k`` best.

    Plans whose memory floor (model states and the activations held at once,
    :meth:`_Bounds.memory_bytes`) exceeds the GPU are dropped before any estimate (counted as
    ``memory_bound``). The rest are estimated best-first by a lower bound on their step
    (:meth:`_Bounds.step_s`: the compute stream's own work, the data-parallel calls, their
    interference floor, the optimizer; at the front of the queue a plan's bound is tightened
    by walking its pipeline schedule, :meth:`_Bounds.refined_s`); once the front's bound
    cannot beat the ``max(top_k, prune_keep)``-th best estimate, the remaining plans are
    counted as ``bound`` and not estimated. The best ``max(top_k, prune_keep)`` plans are
    exactly those a full enumeration finds (a test checks it); ``prune_keep=0`` estimates
    every plan (no bound of either kind). With a ``tolerance``, plans alike (:func:`collapse`)
    are one row (:attr:`SearchResult.rows`), the bound keeps that many distinct shapes exact
    and the engine re-simulates the best plan of each of the ``top_k`` first rows.

    Ctrl-C (``KeyboardInterrupt``) or a lost Dask scheduler during the estimates ends the
    search with what it has: the plans estimated so far, ranked, none re-simulated, and
    :attr:`SearchResult.stopped` saying why.

    Args:
        topology: the cluster with the GPU count to search (tp x pp x dp = its ranks).
        spec: the model.
        training, parallel: the scenario's sections; the global batch, dtype, optimizer and
            the DDP/FSDP knobs are kept, the plan knobs replaced.
        space: what to vary.
        top_k: how many of the best estimates the engine re-simulates (0: none).
        prune_keep: how many best plans the bound must keep exact (0: no pruning).
        simulate: ``simulate(topology, spec, training, parallel) -> StepResult``; default the
            engine's ``simulate_step``.
        progress: called as ``progress(phase, n)`` with phase ``estimate`` (n plans done since
            the last call), ``bound`` (n plans dropped by a bound) or ``simulate`` (1 per
            simulated plan).
        jobs: processes that estimate and simulate (:class:`collsim.jobs.Workers`); with
            more than one, plans are estimated in batches from the front of the queue
            (:attr:`collsim.jobs.Workers.batch_size`; the best plans are the same, a few more
            may be estimated).
        scheduler: a Dask scheduler's address: the batches go to its workers instead (the
            same results).
        tolerance: relative step-time difference under which plans alike are one row.
        known: estimates from an earlier run of the same search, by plan label (``--resume``):
            used as they are, not estimated again.
        on_estimate: called with each batch of plans that were estimated and fit (and first
            with the ``known`` ones), as they arrive.
    """

    started = time.perf_counter()
    num_gpus = topology.num_ranks
    rejected: Counter[str] = Counter()
    bounds = _Bounds(topology, spec, training, parallel)
    dropped: Counter[str] = Counter()
    # 1. cheap bounds for every buildable plan: its memory floor must fit, and the compute
    #    stream's own work is a lower bound on the step
    capacity = topology.device.usable_memory_bytes
    plans = enumerate_plans(
        spec, num_gpus, topology.gpus_per_node, training.global_batch, space, dropped, base=parallel
    )
    candidates, total = _bounded_candidates(
        plans, bounds, capacity if prune_keep > 0 else None, rejected
    )
    if progress is not None and rejected["memory_bound"]:
        progress("bound", rejected["memory_bound"])
    loop = _Loop(
        candidates,
        bounds,
        keep=max(top_k, prune_keep) if prune_keep > 0 else 0,
        tolerance=tolerance,
        progress=progress,
        on_estimate=on_estimate,
    )
    loop.take_known(known or {})
    with Workers(jobs, _SearchContext, (topology, spec), scheduler=scheduler) as workers:
        loop.run(workers, training, parallel)
        structural = sum(dropped.values())
        rejected.update(dropped)
        rejected.update(loop.rejected)
        ranked = sorted(
            loop.ranked, key=lambda r: (r.estimate.step_time_s, r.estimate.memory_peak_bytes)
        )
        rows = collapse(ranked, tolerance)
        estimate_s = time.perf_counter() - started

        sim_started = time.perf_counter()
        simulated = [] if loop.stopped else rows[: max(0, top_k)]
        configs = [entry.candidate.configs(training, parallel) for entry in simulated]
        if simulate is None:
            outcomes = _map_or_stop(workers, configs, loop)
        else:
            own = _SearchContext(topology, spec, simulate)
            outcomes = [_simulate_job(own, c) for c in configs]
    simulated = _record_simulated(simulated[: len(outcomes)], outcomes, rejected, progress)
    return SearchResult(
        num_gpus=num_gpus,
        considered=total + structural,
        ranked=ranked,
        simulated=simulated,
        rejected=rejected,
        estimated=loop.evaluated,
        buildable=total,
        estimate_s=estimate_s,
        simulate_s=time.perf_counter() - sim_started,
        rows=rows,
        tolerance=tolerance,
        stopped=loop.stopped,
    )


def _map_or_stop(
    workers: Any, configs: list[tuple[TrainingConfig, ParallelConfig]], loop: _Loop
) -> list[tuple[StepResult | None, str | None, float]]:
    """The engine's steps of ``configs``; none (and ``loop.stopped`` set) on Ctrl-C or a lost
    scheduler."""

    try:
        return list(workers.map(_simulate_job, configs))
    except KeyboardInterrupt:
        loop.stopped = "interrupted (Ctrl-C) while re-simulating"
    except SchedulerLost as exc:
        loop.stopped = str(exc)
    return []


#: Knobs that make two plans alike when their estimates are within the tolerance: how the
#: data-parallel reduction is bucketed and overlapped, FSDP's prefetch, offload and
#: resharding, sequence parallelism and recompute. The others (tp, cp, pp, dp, ep,
#: micro-batch, schedule, virtual stages, ZeRO stage) set a plan's shape.
MINOR_KNOBS = (
    "bucket_mb",
    "overlap",
    "bucket_view",
    "prefetch",
    "offload",
    "reshard",
    "sequence_parallel",
    "recompute",
)


def shape_of(candidate: Candidate) -> tuple[Any, ...]:
    """The knobs of ``candidate`` that are not in :data:`MINOR_KNOBS`."""
    c = candidate
    return (c.tp, c.cp, c.pp, c.dp, c.ep, c.micro_batch, c.schedule, c.virtual_stages, c.zero)


def collapse(ranked: list[Ranked], tolerance: float) -> list[Ranked]:
    """One row per family of alike plans, best first: walking ``ranked`` (by estimate), a
    plan joins the first row of its shape (:func:`shape_of`) whose best estimate it is within
    ``tolerance`` of (relative), and is listed in that row's :attr:`Ranked.alike`; otherwise
    it starts a row. ``tolerance <= 0``: every plan is a row."""
    for entry in ranked:
        entry.alike = []
    if tolerance <= 0:
        return list(ranked)
    rows: list[Ranked] = []
    open_rows: dict[tuple[Any, ...], list[Ranked]] = {}
    for entry in ranked:
        time_s = entry.estimate.step_time_s
        family = open_rows.setdefault(shape_of(entry.candidate), [])
        for row in family:
            if time_s <= row.estimate.step_time_s * (1 + tolerance):
                row.alike.append(entry)
                break
        else:
            family.append(entry)
            rows.append(entry)
    return rows


class _Loop:
    """The best-first estimate loop of :func:`search_plans`: estimate in increasing lower
    bound; once the bound cannot beat the keep-th best estimate (of distinct shapes when plans
    alike collapse), no later plan can (branch and bound: same top plans as estimating all of
    them). A plan reaching the front is first given its tighter bound (the pipeline schedule
    walked) and put back; it is estimated when it is still ahead."""

    def __init__(
        self,
        candidates: list[tuple[float, int, Candidate]],
        bounds: _Bounds,
        *,
        keep: int,
        tolerance: float,
        progress: Callable[[str, int], None] | None,
        on_estimate: Callable[[list[Ranked]], None] | None,
    ) -> None:
        heapq.heapify(candidates)
        self.candidates = candidates
        self.bounds = bounds
        self.keep, self.tolerance = keep, tolerance
        self.progress, self.on_estimate = progress, on_estimate
        self.refined: set[int] = set()
        self.best: list[float] = []  # the keep best step times, max-heap by negation
        self.shapes: dict[tuple[Any, ...], float] = {}  # best step time per shape
        self.ranked: list[Ranked] = []
        self.rejected: Counter[str] = Counter()
        self.evaluated = 0
        self.stopped: str | None = None

    def take_known(self, known: Mapping[str, StepResult]) -> None:
        """Rank the plans of an earlier run (by label) without estimating them again."""
        if not known:
            return
        kept, taken = [], []
        for item in self.candidates:
            estimate = known.get(item[2].label)
            if estimate is None:
                kept.append(item)
            else:
                taken.append(item[2])
        heapq.heapify(kept)
        self.candidates[:] = kept
        self._record(taken, [(known[c.label], None) for c in taken], report=False)

    def run(self, workers: Any, training: TrainingConfig, parallel: ParallelConfig) -> None:
        """Estimate until the bound stops it, the plans run out, Ctrl-C or a lost scheduler."""

        batch_size = workers.batch_size
        try:
            while self.candidates:
                threshold = self._threshold()
                batch = _next_batch(
                    self.candidates,
                    self.refined,
                    threshold,
                    self.bounds,
                    batch_size,
                    refine=self.keep > 0,
                )
                if not batch:
                    self.rejected["bound"] += len(self.candidates)
                    if self.progress is not None and self.candidates:
                        self.progress("bound", len(self.candidates))
                    break
                configs = [c.configs(training, parallel) for c in batch]
                estimates = workers.map(_estimate_job, configs)
                self.evaluated += len(batch)
                self._record(batch, estimates)
        except KeyboardInterrupt:
            self.stopped = "interrupted (Ctrl-C)"
        except SchedulerLost as exc:
            self.stopped = str(exc)

    def _threshold(self) -> float | None:
        """The step time a plan's bound must beat to be estimated (None: no bound yet)."""
        if not self.keep:
            return None
        if self.tolerance > 0:
            if len(self.shapes) < self.keep:
                return None
            return heapq.nsmallest(self.keep, self.shapes.values())[-1]
        return -self.best[0] if len(self.best) >= self.keep else None

    def _record(
        self,
        batch: list[Candidate],
        estimates: list[tuple[StepResult | None, str | None]],
        *,
        report: bool = True,
    ) -> None:
        fresh = len(self.ranked)
        _record_estimates(batch, estimates, self.ranked, self.rejected, self.best, self.keep)
        for entry in self.ranked[fresh:]:
            shape = shape_of(entry.candidate)
            time_s = entry.estimate.step_time_s
            self.shapes[shape] = min(time_s, self.shapes.get(shape, time_s))
        if self.on_estimate is not None and len(self.ranked) > fresh:
            self.on_estimate(self.ranked[fresh:])
        if report and self.progress is not None:
            self.progress("estimate", len(batch))


def _bounded_candidates(
    plans: Iterable[Candidate],
    bounds: _Bounds,
    capacity_bytes: float | None,
    rejected: Counter[str],
) -> tuple[list[tuple[float, int, Candidate]], int]:
    """(step lower bound, order, plan) of every plan whose memory floor fits in
    ``capacity_bytes`` (None: no memory bound), and the number of plans; the others are
    counted as ``memory_bound``."""
    candidates: list[tuple[float, int, Candidate]] = []
    total = 0
    for candidate in plans:
        total += 1
        if capacity_bytes is not None and bounds.memory_bytes(candidate) > capacity_bytes:
            rejected["memory_bound"] += 1
            continue
        candidates.append((bounds.step_s(candidate), total, candidate))
    return candidates, total


def _next_batch(
    candidates: list[tuple[float, int, Candidate]],
    refined: set[int],
    threshold: float | None,
    bounds: _Bounds,
    batch_size: int,
    *,
    refine: bool = True,
) -> list[Candidate]:
    """Up to ``batch_size`` plans popped from the front of the heap ``candidates``; a plan
    reaching the front for the first time is given its tighter bound and put back, and none
    is taken once the front's bound cannot beat ``threshold`` (the keep-th best estimate;
    None: no pruning yet, or none at all); ``refine=False`` (no pruning) takes them as they
    are."""
    batch: list[Candidate] = []
    while candidates and len(batch) < batch_size:
        bound, order, candidate = candidates[0]
        if threshold is not None and bound >= threshold:
            break
        if refine and order not in refined:
            refined.add(order)
            tight = bounds.refined_s(candidate)
            heapq.heapreplace(candidates, (tight, order, candidate))
            continue
        heapq.heappop(candidates)
        batch.append(candidate)
    return batch


def _record_estimates(
    batch: list[Candidate],
    estimates: list[tuple[StepResult | None, str | None]],
    ranked: list[Ranked],
    rejected: Counter[str],
    best: list[float],
    keep: int,
) -> None:
    """Rank the plans that were built and fit, count the others in ``rejected`` by why, and
    keep the ``keep`` best step times in ``best``."""
    for candidate, (estimate, reason) in zip(batch, estimates, strict=True):
        if estimate is None:
            rejected[reason or "config"] += 1
        elif not estimate.fits:
            rejected["memory"] += 1
        else:
            ranked.append(Ranked(candidate, estimate))
            if keep:
                heapq.heappush(best, -estimate.step_time_s)
                if len(best) > keep:
                    heapq.heappop(best)


def _record_simulated(
    simulated: list[Ranked],
    outcomes: list[tuple[StepResult | None, str | None, float]],
    rejected: Counter[str],
    progress: Callable[[str, int], None] | None,
) -> list[Ranked]:
    """The simulated plans with their engine results, those that ran first and by step time;
    plans the engine found out of memory are counted as ``memory (DES)``."""
    for entry, (result, reason, seconds) in zip(simulated, outcomes, strict=True):
        entry.result, entry.reason, entry.simulate_s = result, reason, seconds
        if progress is not None:
            progress("simulate", 1)
    for entry in simulated:
        if entry.reason and entry.reason.startswith("memory"):
            rejected["memory (DES)"] += 1
    return sorted(simulated, key=lambda r: (r.reason is not None, r.step_time_s))


class _SearchContext:
    """What a search worker keeps: the cluster, the model, one estimator (its price cache)."""

    def __init__(
        self,
        topology: Topology,
        spec: TransformerSpec,
        simulate: Callable[..., StepResult] | None = None,
    ) -> None:
        self.topology = topology
        self.spec = spec
        self.estimator = Estimator(topology, spec)
        self.simulate = simulate or _simulate


def _estimate_job(
    ctx: _SearchContext, configs: tuple[TrainingConfig, ParallelConfig]
) -> tuple[StepResult | None, str | None]:
    """The closed form of one plan, or why it cannot be built."""
    try:
        return ctx.estimator.estimate(*configs), None
    except (InfeasibleError, ConfigError) as exc:
        return None, str(getattr(exc, "reason", "config"))


def _simulate_job(
    ctx: _SearchContext, configs: tuple[TrainingConfig, ParallelConfig]
) -> tuple[StepResult | None, str | None, float]:
    """The engine's step of one plan: (result, why it failed or does not fit, seconds)."""
    t0 = time.perf_counter()
    result: StepResult | None = None
    reason: str | None = None
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", CollsimWarning)
            result = ctx.simulate(ctx.topology, ctx.spec, *configs)
        if not result.fits:
            reason = "memory (DES)"
    except (InfeasibleError, ConfigError) as exc:
        reason = f"{getattr(exc, 'reason', 'config')}: {exc}"
    return result, reason, time.perf_counter() - t0


class _Bounds:
    """Cheap bounds of a candidate from the workload layer alone (no schedule).

    ``states_bytes``: the model states every rank holds for the whole step (ZeRO table; the
    schedule allocates them at time 0, so the peak is at least this). ``step_s``: the compute
    stream's own work on the busiest stage, m micro-batches x (layers x (forward + backward +
    recompute) + embedding / head), plus its optimizer step; the stream runs them one after
    another, so no plan's step is shorter (communication, bubble and waits only add).
    """

    def __init__(
        self,
        topology: Topology,
        spec: TransformerSpec,
        training: TrainingConfig,
        parallel: ParallelConfig | None = None,
    ):
        base = parallel if parallel is not None else Parallel()
        self.base = base
        self.etp = base.etp
        self.order = base.order or default_order(spec, base)
        """The plans' rank layout (the scenario's ``parallel.order``): it places the dp
        groups whose calls the bound prices."""
        self.topology = topology
        self.spec = spec
        self.training = training
        self.per = bytes_per(training)
        self._models: dict[str, Any] = {}
        self._pricer: ClosedPricer | None = None
        self._step: dict[tuple[Any, ...], float] = {}
        self._dp: dict[tuple[Any, ...], tuple[list[float], list[float]]] = {}
        self._params: dict[tuple[int, int], list[float]] = {}
        self._acts: dict[tuple[Any, ...], float] = {}
        self._moe_states: dict[tuple[Any, ...], list[float]] = {}
        self._moe_comms: dict[tuple[Any, ...], tuple[float, float]] = {}
        self._refined: dict[tuple[Any, ...], float] = {}
        self._pipes: dict[tuple[Any, ...], list[float]] = {}

    def _stage_params(self, c: Candidate) -> list[float]:
        """Parameters per rank of the first and the last stage (the others hold fewer)."""

        key = (c.tp, c.pp)
        hit = self._params.get(key)
        if hit is None:
            hit = self._params[key] = [
                float(parameters_per_rank(self.spec, tp=c.tp, pp=c.pp, stage=s))
                for s in sorted({0, c.pp - 1})
            ]
        if c.pp > 1 and _head_stage(c) != c.pp - 1:
            # a V: the head sits on the first stage; the last holds its layers only
            head = parameters_per_rank(self.spec, tp=c.tp, pp=c.pp, stage=c.pp - 1, stage_layers=[])
            return [hit[0], hit[1] - float(head)]
        return hit

    def _states(self, c: Candidate) -> list[float]:
        """Model-state bytes per rank of the first and the last stage (ZeRO table)."""
        if c.offload:
            return [0.0] * len(self._stage_params(c))  # the shards live in host memory
        n, per = float(c.dp * c.cp), self.per  # Megatron shards over the dp x cp ranks
        out = []
        for numel in self._stage_params(c):
            params = numel * per.param / (n if c.zero >= 3 else 1.0)
            grads = numel * per.grad / (n if c.zero >= 2 else 1.0)
            states = numel * per.optimizer / (n if c.zero >= 1 else 1.0)
            out.append(params + grads + states)
        return out

    def states_bytes(self, c: Candidate) -> float:
        return max(self._states(c)) * (1 - 1e-9)

    def memory_bytes(self, c: Candidate) -> float:
        """A lower bound on the peak: the model states plus the activations that are held at
        once. A stage keeps every layer's activations of a micro-batch from its forward to its
        backward; GPipe runs all m forwards first, 1F1B (Narayanan 2021, sec. 2.2) runs
        ``min(pp - s, m)`` forwards on stage s before its first backward, and interleaving
        runs more chunk forwards than that (warm-up ``2 (pp - s - 1) + (v - 1) pp`` chunks of
        ``layers / (pp v)``), so ``min(pp - s, m)`` stage-sets of activations is a floor for
        both. Transient buffers and gathered ZeRO-3 units only add."""
        key: tuple[Any, ...] = (c.tp, c.pp, c.dp, c.micro_batch, c.schedule, c.zero)
        key += (c.recompute, c.sequence_parallel, c.offload, c.reshard, c.cp, c.ep)
        hit = self._acts.get(key)
        if hit is not None:
            return hit

        if self._variant(c) and (c.cp == 1 or self._kinds_vary()):
            hit = self._acts[key] = self._moe_floor(c) if self.spec.is_moe else 0.0
            return hit
        states = self._states(c)
        if len(self.spec.layer_kinds()) > 1:
            hit = self._acts[key] = max(states) * (1 - 1e-9)
            return hit  # layer kinds keep different activations: states only
        model = self._model()
        mb, sp = c.micro_batch, c.sequence_parallel and c.tp > 1
        per_layer = model.layer_times(
            self.spec,
            micro_batch=mb,
            tp=c.tp,
            sequence_parallel=sp,
            recompute=c.recompute,
            cp=c.cp,
        ).activation_bytes
        emb = head = 0.0  # with context parallelism: a floor without them
        if c.cp == 1:
            emb = model.embedding_times(
                self.spec, micro_batch=mb, tp=c.tp, sequence_parallel=sp
            ).activation_bytes
            head = model.head_times(
                self.spec, micro_batch=mb, tp=c.tp, sequence_parallel=sp
            ).activation_bytes
        counts = layers_per_stage(self.spec.num_layers, c.pp)
        m = self.training.global_batch // (mb * c.dp)
        gathered = 0.0
        if c.zero == 3 and not c.reshard and c.dp > 1:
            # kept after forward: every layer unit stays gathered until its backward (the
            # gather dtype may be fp8: one byte per element at least)
            unit = float(layer_parameters_per_rank(self.spec, c.tp))
            gathered = unit * min(self.per.param, 1.0)
        out = 0.0
        for state, s in zip(states, sorted({0, c.pp - 1}), strict=True):
            held = m if c.schedule == "gpipe" else min(c.pp - s, m)
            acts = counts[s] * per_layer + (emb if s == 0 else 0.0)
            acts += head if s == c.pp - 1 else 0.0
            out = max(out, state + held * acts + counts[s] * gathered)
        hit = self._acts[key] = out * (1 - 1e-9)
        return hit

    def _model(self) -> Any:
        # the kernels the schedule prices (collsim.schedule.build._blocks): attention kernel,
        # execution mode and fused kernels change every block's seconds, so the floor uses them
        tr = self.training
        dtype = str(tr.dtype)
        model = self._models.get(dtype)
        if model is None:
            model = self._models[dtype] = ComputeModel(
                self.topology.device,
                dtype,
                attention_kernel=tr.attention_kernel,
                execution=str(tr.execution),
                fused_kernels=bool(tr.fused_kernels),
            )
        return model

    def step_s(self, c: Candidate) -> float:
        """A lower bound on the step (seconds): the largest :meth:`stage_bounds`."""
        key: tuple[Any, ...] = (c.tp, c.pp, c.dp, c.micro_batch, c.schedule, c.virtual_stages)
        key += (c.zero, c.recompute, c.sequence_parallel, c.overlap, c.reshard, c.offload)
        key += (c.cp, c.ep)
        hit = self._step.get(key)
        if hit is None:
            hit = self._step[key] = max(self.stage_bounds(c)) * (1 - 1e-9)
        return hit

    def refined_s(self, c: Candidate) -> float:
        """A tighter lower bound (seconds): :meth:`stage_bounds` with the compute stream's
        end taken from a walk of the pipeline schedule itself (:meth:`_pipeline_ends`)."""
        key: tuple[Any, ...] = (c.tp, c.pp, c.dp, c.micro_batch, c.schedule, c.virtual_stages)
        key += (c.zero, c.recompute, c.sequence_parallel, c.overlap, c.reshard, c.offload)
        key += (c.cp, c.ep)
        hit = self._refined.get(key)
        if hit is None:
            stream = self._pipeline_ends(c)
            hit = self._refined[key] = max(self.stage_bounds(c, stream)) * (1 - 1e-9)
        return hit

    def _pipeline_ends(self, c: Candidate) -> list[float]:
        """When the first and the last stage finish their last op, walking the schedule's op
        order (:meth:`collsim.parallel.pipeline.PipelineSchedule.order`) with each op's own work
        (blocks and blocking TP collectives of its chunk, as in :meth:`_compute`), each op
        starting after the op before it on its stage and after the op whose output it reads
        (:meth:`~collsim.parallel.pipeline.PipelineSchedule.input_of`); sends take no time.
        Both fidelities run these ops in this order with these dependencies and more work, so
        they end later."""

        p = c.pp
        v = c.virtual_stages
        m = self.training.global_batch // (c.micro_batch * c.dp)
        fwd, bwd, emb, head = self._block_work(c)
        counts = layers_per_stage(self.spec.num_layers, p)
        key = (p, v, m, c.schedule, fwd, bwd, emb, head)
        hit = self._pipes.get(key)
        if hit is not None:
            return hit
        pipeline = get_schedule(c.schedule)
        durations = self._op_work(c, counts, pipeline)
        orders = [
            pipeline.order(num_stages=p, num_microbatches=m, stage=s, virtual_stages=v)
            for s in range(p)
        ]
        done: list[dict[Any, float]] = [{} for _ in range(p)]
        clock = [0.0] * p
        at = [0] * p
        remaining = sum(len(o) for o in orders)
        while remaining:
            moved = 0
            for s in range(p):
                order, mine = orders[s], done[s]
                i, now = at[s], clock[s]
                while i < len(order):
                    op = order[i]
                    src = pipeline.input_of(op, stage=s, num_stages=p, virtual_stages=v)
                    if src is not None:
                        ready = done[src[0]].get(src[1])
                        if ready is None:
                            break
                        now = max(now, ready)
                    now += durations[(s, op.phase, op.chunk)]
                    mine[op._replace(phase=flow(op.phase))] = now
                    i += 1
                moved += i - at[s]
                at[s], clock[s] = i, now
            if not moved:  # pragma: no cover - every schedule here is deadlock free
                raise RuntimeError(f"pipeline walk stalled for {c.label}")
            remaining -= moved
        hit = self._pipes[key] = [clock[s] for s in sorted({0, p - 1})]
        return hit

    def _op_work(
        self, c: Candidate, counts: list[int], pipeline: Any
    ) -> dict[tuple[int, Phase, int], float]:
        """Each (stage, phase, chunk) op's own work for :meth:`_pipeline_ends`: its share of
        the stage's layers, and the embedding or the head where the schedule places the first
        or the last model part; a split backward as its input-gradient part (the backward
        less the largest weight-gradient time) and its weight-gradient part (the smallest),
        each a floor of what the schedule builds (schedule.ops._split_backward)."""
        p, v = c.pp, c.virtual_stages
        fwd, bwd, emb, head = self._block_work(c)
        w_min, w_max, w_head = self._wgrad_work(c)
        out: dict[tuple[int, Phase, int], float] = {}
        for s in range(p):
            for k in range(v):
                part = pipeline.part_of(s, k, p, v)
                n = counts[s] / v
                first, last = part == 0, part == p * v - 1
                e = emb if first else (0.0, 0.0)
                h = head if last else (0.0, 0.0)
                hw = w_head if last else 0.0
                out[(s, Phase.FORWARD, k)] = n * fwd + e[0] + h[0]
                out[(s, Phase.BACKWARD, k)] = n * bwd + e[1] + h[1]
                out[(s, Phase.BACKWARD_INPUT, k)] = n * max(0.0, bwd - w_max) + max(0.0, h[1] - hw)
                out[(s, Phase.BACKWARD_WEIGHT, k)] = n * w_min + e[1] + min(hw, h[1])
        return out

    def _wgrad_work(self, c: Candidate) -> tuple[float, float, float]:
        """Weight-gradient seconds of one micro-batch: the smallest and the largest of a
        layer's kinds, and the head's (compute model, :attr:`LayerTimes.wgrad_s`)."""
        model = self._model()
        spec, mb, sp = self.spec, c.micro_batch, c.sequence_parallel and c.tp > 1
        kinds: list[dict[str, int]] = [{}]
        if self._variant(c):
            kinds = [
                {"layer": rep, "ep": c.ep, "etp": self.etp, "cp": c.cp}
                for rep, _ in spec.layer_kinds()
            ]
        w = [
            model.layer_times(
                spec, micro_batch=mb, tp=c.tp, sequence_parallel=sp, recompute=c.recompute, **kw
            ).wgrad_s
            for kw in kinds
        ]
        ht = model.head_times(spec, micro_batch=mb, tp=c.tp, sequence_parallel=sp)
        return min(w), max(w), ht.wgrad_s / c.cp

    def stage_bounds(self, c: Candidate, stream: list[float] | None = None) -> list[float]:
        """Per stage (the first and the last), a floor on when its rank ends the step.

        The rank's compute stream runs its work one piece after another (:meth:`_compute`),
        and its data-parallel calls one after another (:meth:`_dp_stage`); without overlap
        the last gradient reduction starts after the last backward. After the walk both
        fidelities add the interference of the overlapped data-parallel calls,
        ``min(dp link, compute) x (1 - 1/factor)`` (:meth:`StepSchedule.interference_s`),
        whose factor is at least its SM term ``(1 - m) / (1 - f_sm) + m`` (the HBM term only
        adds, :func:`collsim.workload.interference.overlap_slowdown`), then the optimizer
        step and ZeRO-1/2's all-gathers of the updated parameters. Without overlap every
        reduction waits for the end of the rank's whole backward (``launch_deferred``)."""
        floor, busy, share, opts = self._compute(c)
        stream = (
            floor if stream is None else [max(a, b) for a, b in zip(floor, stream, strict=True)]
        )
        if self._variant(c):
            return list(stream)
        before, after = self._dp_stage(c)
        serial = c.zero < 3 and not c.overlap
        interferes = c.dp > 1 and (c.zero == 3 or c.overlap)
        factor = 1.0
        if interferes:
            # the SM term alone: busbw -> 0+ leaves f_hbm -> 0 (formula above)
            device = self.topology.device
            sms = int(getattr(device, "sm_count", None) or 108)
            f_sm = min(0.9, max(0.0, getattr(device, "nccl_sms", 16) / sms))
            factor = (1.0 - share) / (1.0 - f_sm) + share
        out = []
        for i in range(len(stream)):
            walk = stream[i] + before[i] if serial else max(stream[i], before[i])
            interference = min(before[i], busy[i]) * (1.0 - 1.0 / factor) if interferes else 0.0
            out.append(walk + interference + opts[i] + after[i])
        return out

    def _reductions(self, c: Candidate) -> int:
        """Gradient reductions per step: ZeRO-2 reduces per micro-batch, ZeRO-0/1 once."""
        return self.training.global_batch // (c.micro_batch * c.dp) if c.zero == 2 else 1

    def dp_stream_s(self, c: Candidate) -> float:
        """The data-parallel stream's own work on the busiest stage (see :meth:`_dp_stage`)."""
        before, after = self._dp_stage(c)
        return max(b + a for b, a in zip(before, after, strict=True)) * (1 - 1e-9)

    def _dp_stage(self, c: Candidate) -> tuple[list[float], list[float]]:
        """Per stage (first, last): the data-parallel calls' seconds before the optimizer and
        after it. Every gradient reduction: one call of all the stage's gradients bounds the
        bucketed ones from below (a collective's closed form is latency plus bytes over
        bandwidth, sub-additive in the bytes); with ZeRO-3 every unit's gathers and
        reduce-scatters of every micro-batch; after the optimizer, ZeRO-1/2's all-gather of
        the updated parameters."""
        params = self._stage_params(c)
        if c.dp < 2 or self._variant(c):
            return [0.0] * len(params), [0.0] * len(params)
        key = (c.tp, c.pp, c.dp, c.micro_batch, c.zero, c.reshard, c.offload)
        cached = self._dp.get(key)
        if cached is not None:
            return cached

        if self._pricer is None:
            self._pricer = Pricer(self.topology)
        per = self.per
        m = self.training.global_batch // (c.micro_batch * c.dp)
        cost = self._pricer.cost
        before: list[float] = []
        after: list[float] = []
        counts = layers_per_stage(self.spec.num_layers, c.pp)
        for numel, s in zip(params, sorted({0, c.pp - 1}), strict=True):
            group = self._dp_group(c, s)
            if c.zero == 3:
                unit = float(layer_parameters_per_rank(self.spec, c.tp))
                gathers = 2 if c.reshard else 1
                per_mb = counts[s] * (
                    gathers * cost("all_gather", unit * per.param, group).time_s
                    + cost("reduce_scatter", unit * per.grad, group).time_s
                )
                before.append(m * per_mb)
                after.append(0.0)
                continue
            op = "all_reduce" if c.zero == 0 else "reduce_scatter"
            before.append(self._reductions(c) * cost(op, numel * per.grad, group).time_s)
            gather = cost("all_gather", numel * per.param, group).time_s if c.zero else 0.0
            after.append(gather)
        self._dp[key] = (before, after)
        return before, after

    def _moe_floor(self, c: Candidate) -> float:
        """A mixture-of-experts plan's memory floor: per stage, its model states as the
        schedule allocates them (:meth:`_plan_states`) plus the activations it holds at once
        (as :meth:`memory_bytes`: ``min(pp - s, m)`` micro-batches of its layers, ``m`` with
        GPipe), each layer at the smallest activation of the model's layer kinds (dense or
        expert, as the schedule builds them: :meth:`_block_work`'s kinds); the embedding and
        the head left out. The fullest stage bounds the peak."""

        states = self._plan_states(c)
        if not states:
            return 0.0
        model = self._model()
        sp = c.sequence_parallel and c.tp > 1
        per_layer = min(
            model.layer_times(
                self.spec,
                micro_batch=c.micro_batch,
                tp=c.tp,
                sequence_parallel=sp,
                recompute=c.recompute,
                layer=rep,
                ep=c.ep,
                etp=self.etp,
                cp=c.cp,
            ).activation_bytes
            for rep, _ in self.spec.layer_kinds()
        )
        counts = layers_per_stage(self.spec.num_layers, c.pp)
        m = self.training.global_batch // (c.micro_batch * c.dp)
        out = 0.0
        for s, state in enumerate(states):
            held = m if c.schedule == "gpipe" else min(c.pp - s, m)
            out = max(out, state + held * counts[s] * per_layer)
        return out * (1 - 1e-9)

    def _plan_states(self, c: Candidate) -> list[float]:
        """A mixture-of-experts plan's model states per stage as the schedule allocates them
        (:func:`collsim.parallel.states.rank_model_states`: dense states over the dp x cp
        shard group, routed experts over the expert data-parallel one; FP8 copies and kept
        gathers left out), from the plan itself; empty when no plan builds or the states live
        in host memory (offload). Kept per shape (the knobs the states depend on)."""
        key = (c.tp, c.pp, c.dp, c.cp, c.ep, c.zero, c.offload, c.virtual_stages)
        hit = self._moe_states.get(key)
        if hit is not None:
            return hit

        plan = None if c.offload else self._plan_of(c)  # offloaded shards live on the host
        hit = (
            []
            if plan is None
            else [rank_model_states(plan, s).states.total for s in range(plan.pp)]
        )
        self._moe_states[key] = hit
        return hit

    def _plan_of(self, c: Candidate) -> Any:
        """The checked plan of ``c`` (``collsim.parallel.plan.Plan``; its warnings
        silenced), or None when it does not build."""

        try:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                return build_plan(self.topology, self.spec, *c.configs(self.training, self.base))
        except ConfigError:
            return None

    def _kinds_vary(self) -> bool:
        """Experts, latent attention or windows: layers that the tables here do not follow."""
        spec = self.spec
        return bool(spec.is_moe or spec.is_mla or spec.sliding_window is not None)

    def _variant(self, c: Candidate) -> bool:
        """Layer kinds, experts or context parallelism: the step is bounded by the compute
        stream only (per layer the cheapest kind; no data-parallel or optimizer floor, whose
        shard groups the simple tables here do not follow); :meth:`memory_bytes` keeps a
        narrower floor for them."""
        return self._kinds_vary() or c.cp > 1

    def _dp_group(self, c: Candidate, stage: int) -> tuple[int, ...]:
        """The data-parallel group of stage ``stage``'s first tp rank (the plan's mapping,
        :meth:`collsim.parallel.plan.Plan.rank`)."""

        axes = rank_axes(self.order, {"dp": c.dp, "pp": c.pp, "cp": c.cp, "tp": c.tp})
        return tuple(grid_rank(axes, {"dp": d, "pp": stage}) for d in range(c.dp))

    def _block_work(
        self, c: Candidate
    ) -> tuple[float, float, tuple[float, float], tuple[float, float]]:
        """Compute-stream seconds of one micro-batch: a layer's forward and backward (with
        recompute and the blocking TP collectives), the embedding's and the head's
        (forward, backward). :meth:`_wgrad_work` gives the weight-gradient parts."""
        model = self._model()
        spec, mb, sp = self.spec, c.micro_batch, c.sequence_parallel and c.tp > 1
        kinds: list[dict[str, int]] = [{}]
        if self._variant(c):  # each layer kind as the schedule builds it; the cheapest bounds
            kinds = [
                {"layer": rep, "ep": c.ep, "etp": self.etp, "cp": c.cp}
                for rep, _ in spec.layer_kinds()
            ]
        times = [
            model.layer_times(
                spec, micro_batch=mb, tp=c.tp, sequence_parallel=sp, recompute=c.recompute, **kw
            )
            for kw in kinds
        ]
        et = model.embedding_times(spec, micro_batch=mb, tp=c.tp, sequence_parallel=sp)
        ht = model.head_times(spec, micro_batch=mb, tp=c.tp, sequence_parallel=sp)
        comms = [self._moe_comm_s(c, kw.get("layer")) for kw in kinds]
        fwd = min(lt.forward_s + cf for lt, (cf, _) in zip(times, comms)) + self._tp_s(c, 2)
        calls = 4 if c.recompute == "full" else 2
        bwd = min(lt.backward_s + lt.recompute_s + cb for lt, (_, cb) in zip(times, comms))
        bwd += self._tp_s(c, calls)
        k = 1.0 / c.cp  # a CP rank embeds and scores its s / cp tokens (schedule.build)
        return (
            fwd,
            bwd,
            (et.forward_s * k, et.backward_s * k),
            (ht.forward_s * k, ht.backward_s * k),
        )

    def _moe_comm_s(self, c: Candidate, layer: int | None) -> tuple[float, float]:
        """The expert-parallel collectives of one micro-batch of layer kind ``layer`` that
        block the compute stream (forward, backward seconds): without EP overlap the schedule
        runs each dispatch, combine, etp gather and scatter as a step of its own
        (:func:`collsim.schedule.ops._ep_steps`), priced in closed form on the rank's group
        at no less than the balanced size; here each at its balanced size (times the routing
        imbalance when that is below 1) on the cheapest of the stages' groups. 0 for dense
        layers, with EP overlap, or when no plan builds."""
        if layer is None or not self.spec.is_moe or self.base.ep_overlap:
            return 0.0, 0.0
        key = (c.tp, c.pp, c.dp, c.cp, c.ep, c.micro_batch, c.sequence_parallel, layer)
        hit = self._moe_comms.get(key)
        if hit is not None:
            return hit

        hit = (0.0, 0.0)
        plan = self._plan_of(c)
        if plan is not None:
            scale = min(1.0, float(self.spec.load_imbalance))
            out = {"forward": 0.0, "backward": 0.0}
            for comm in layer_comms(plan, layer):
                if comm.axis not in ("ep", "etp", "ep_node") or comm.overlappable:
                    continue  # (DeepEP's NVLink leg runs beside its network leg)
                size = comm.size_bytes * (scale if comm.op == "all_to_all" else 1.0)
                groups = {
                    plan.group_of(plan.rank(dp=0, pp=s, tp=0), comm.axis) for s in range(c.pp)
                }
                seconds = min(
                    cost(comm.op, int(size), Group(self.topology, g)).time_s if len(g) > 1 else 0.0
                    for g in groups
                )
                out[comm.phase] += comm.calls * seconds
            hit = (out["forward"], out["backward"])
        hit = self._moe_comms[key] = (hit[0] * (1 - 1e-9), hit[1] * (1 - 1e-9))
        return hit

    def _compute(self, c: Candidate) -> tuple[list[float], list[float], float, list[float]]:
        """Per stage (first, last): the compute stream's own work (blocks and blocking TP
        collectives of every micro-batch, and for the last stage the pipeline fill and drain
        of the stages before it), the compute seconds alone, the memory-bound share of a
        layer, and the optimizer step."""

        model = self._model()
        spec, mb, sp = self.spec, c.micro_batch, c.sequence_parallel and c.tp > 1
        lt = model.layer_times(
            spec, micro_batch=mb, tp=c.tp, sequence_parallel=sp, recompute=c.recompute
        )
        et = model.embedding_times(spec, micro_batch=mb, tp=c.tp, sequence_parallel=sp)
        ht = model.head_times(spec, micro_batch=mb, tp=c.tp, sequence_parallel=sp)
        layer_s = lt.forward_s + lt.backward_s + lt.recompute_s
        share = min(1.0, lt.memory_bound_s / layer_s) if layer_s > 0 else 0.0
        fwd, bwd, _, _ = self._block_work(c)
        counts = layers_per_stage(spec.num_layers, c.pp)
        m = self.training.global_batch // (mb * c.dp)
        v = c.virtual_stages
        pipeline = get_schedule(c.schedule)
        head_at = _head_stage(c)

        def work(s: int) -> tuple[float, float]:
            f, b = counts[s] * fwd, counts[s] * bwd
            if s == 0:
                f, b = f + et.forward_s, b + et.backward_s
            if s == head_at:
                f, b = f + ht.forward_s, b + ht.backward_s
            return f, b

        def busy(s: int) -> float:
            out: float = counts[s] * layer_s
            out += et.forward_s + et.backward_s if s == 0 else 0.0
            out += ht.forward_s + ht.backward_s if s == head_at else 0.0
            return m * out

        stages = sorted({0, c.pp - 1})
        # with offload the step runs on the host, slower than this GPU floor
        optimizer = str(self.training.optimizer)
        implementation = str(self.training.optimizer_implementation)
        opts = [
            model.optimizer_time_s(n / (c.dp if c.zero >= 1 else 1), optimizer, implementation)
            for n in self._stage_params(c)
        ]
        # the last stage starts when the first micro-batch's first chunk has crossed the
        # stages before it (fill), and stage 0 ends after the last micro-batch's last backward
        # chunk has crossed them back (drain); a chunk is 1/v of a stage's layers
        last = c.pp - 1
        f_last, b_last = work(last)
        fill = sum(work(r)[0] for r in range(last)) / v
        drain = sum(work(r)[1] for r in range(last)) / v
        f0, b0 = work(0)
        if pipeline.splits_backward or head_at != last:
            # weight-gradient ops may run after the last stage's last backward, and a V
            # places the stages' chunks otherwise: each stage's own work only (the walk of
            # the schedule, :meth:`_pipeline_ends`, adds the fill and the drain)
            fill = drain = 0.0
        stream = [max(m * (f0 + b0), fill + m * (f_last + b_last) + drain)]
        if last:
            stream.append(fill + m * (f_last + b_last))
        return stream, [busy(s) for s in stages], share, opts

    def _tp_s(self, c: Candidate, calls: int) -> float:
        """Blocking TP collectives of one layer's forward or backward (closed form)."""
        if c.tp < 2:
            return 0.0
        if self._pricer is None:
            self._pricer = Pricer(self.topology)
        size = float(
            c.micro_batch * (self.spec.seq_len // c.cp) * self.spec.hidden * self.per.activation
        )
        group = tuple(range(c.tp))
        if c.sequence_parallel:
            one = (
                self._pricer.cost("all_gather", size, group).time_s
                + self._pricer.cost("reduce_scatter", size, group).time_s
            )
        else:
            one = self._pricer.cost("all_reduce", size, group).time_s
        # the SP re-gathers in backward overlap their dgrad GEMMs: counted once per half
        return calls * one


def _simulate(
    topology: Topology, spec: TransformerSpec, training: TrainingConfig, parallel: ParallelConfig
) -> StepResult:
    """The engine's step of one candidate, as every caller simulates one
    (:mod:`collsim.study.job`; no stragglers: the candidates are the plans, not the job)."""
    return simulate_inputs(StepInputs(topology, spec, training, parallel))


def search_frame(result: SearchResult, *, limit: int | None = None) -> pd.DataFrame:
    """One row per feasible plan, best estimate first: the plan's knobs, ``est_*`` columns of
    the closed form (step time, breakdown, memory, MFU) and ``sim_*`` columns for the
    re-simulated ones (NaN otherwise)."""
    # start-up: pandas loads only when a frame is asked for (the run path stays light)
    import pandas as pd

    rows = []
    for index, entry in enumerate(result.ranked[:limit] if limit else result.ranked):
        est = entry.estimate
        row: dict[str, Any] = {
            "rank_estimate": index + 1,
            **entry.candidate.as_dict(),
            "num_microbatches": est.num_microbatches,
            "est_step_time_s": est.step_time_s,
            "est_tokens_per_s": est.tokens_per_s,
            "est_mfu": est.mfu,
        }
        for key in BREAKDOWN_KEYS:
            row[f"est_{key}_s"] = est.breakdown_s[key]
        row["est_memory_peak_bytes"] = est.memory_peak_bytes
        for key in MEMORY_KEYS:
            row[f"est_mem_{key}_bytes"] = est.memory_bytes[key]
        res = entry.result
        row["simulated"] = res is not None
        row["sim_reason"] = entry.reason or ""
        row["sim_step_time_s"] = res.step_time_s if res is not None else float("nan")
        row["sim_mfu"] = res.mfu if res is not None else float("nan")
        row["sim_memory_peak_bytes"] = res.memory_peak_bytes if res is not None else float("nan")
        row["sim_fits"] = res.fits if res is not None else pd.NA
        for key in BREAKDOWN_KEYS:
            row[f"sim_{key}_s"] = res.breakdown_s.get(key, 0.0) if res is not None else float("nan")
        rows.append(row)
    return pd.DataFrame.from_records(rows)


def known_from_frame(frame: pd.DataFrame) -> dict[str, StepResult]:
    """The estimates a :func:`search_frame` table holds, by plan label (``--resume``): each
    rebuilt from its ``est_*`` columns (what the table and a new frame show of it), so that a
    resumed search ranks and writes them as the earlier run did.

    Raises:
        ConfigError: the table lacks a column a search writes.
    """

    needed = ["plan", "num_microbatches", "est_step_time_s", "est_tokens_per_s", "est_mfu"]
    needed += [f"est_{key}_s" for key in BREAKDOWN_KEYS] + ["est_memory_peak_bytes"]
    needed += [f"est_mem_{key}_bytes" for key in MEMORY_KEYS]
    missing = [c for c in needed if c not in frame.columns]
    if missing:
        raise ConfigError(f"not a search table: no column {missing[0]!r}", key_path="--resume")
    out: dict[str, StepResult] = {}
    for row in frame.to_dict("records"):
        out[str(row["plan"])] = Result(
            step_time_s=float(row["est_step_time_s"]),
            tokens_per_s=float(row["est_tokens_per_s"]),
            model_tflops_per_gpu=float("nan"),
            hardware_tflops_per_gpu=float("nan"),
            mfu=float(row["est_mfu"]),
            hfu=float("nan"),
            breakdown_s=Breakdown.of({key: float(row[f"est_{key}_s"]) for key in BREAKDOWN_KEYS}),
            memory_peak_bytes=float(row["est_memory_peak_bytes"]),
            memory_bytes={key: float(row[f"est_mem_{key}_bytes"]) for key in MEMORY_KEYS},
            memory_capacity_bytes=float("nan"),
            fits=True,
            num_microbatches=int(row["num_microbatches"]),
        )
    return out
