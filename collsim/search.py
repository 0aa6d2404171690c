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
2. Every remaining plan is ranked by the closed form (:mod:`collsim.estimate`); plans whose
   estimated memory exceeds the GPU's are counted as ``memory``.
3. The best ``top_k`` by estimate are simulated with the discrete-event engine, which has the
   last word on step time and memory (a simulated plan that does not fit is ``memory (DES)``).

Nothing here prints; a callback reports progress.
"""

from __future__ import annotations

import heapq
import time
import warnings
from collections import Counter
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from collsim.errors import CollsimWarning, ConfigError, InfeasibleError

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
]

REASONS = {
    "tp_heads": "heads or ffn_hidden not divisible by tp",
    "tp_node": "tp larger than the space's max_tp",
    "pp_layers": "layers not divisible by pp x virtual stages",
    "batch": "global batch not divisible by dp x micro-batch",
    "interleaved_m": "interleaved needs micro-batches divisible by pp",
    "zero_pp": "ZeRO-2/3 with pipeline parallelism (left out of this space)",
    "no_dp": "a bucket size other than the first without data parallelism (same plan)",
    "memory": "estimated memory exceeds the GPU",
    "memory (DES)": "simulated memory exceeds the GPU",
    "bound": "pruned: its lower bound (the compute stream's own work) cannot beat the best kept",
}


@dataclass(frozen=True, slots=True, kw_only=True)
class SearchSpace:
    """What the search varies. Defaults cover what Megatron-LM and DeepSpeed offer."""

    micro_batches: tuple[int, ...] = (1, 2, 4, 8, 16, 32, 64)
    schedules: tuple[str, ...] = ("gpipe", "1f1b", "interleaved")
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

    @property
    def label(self) -> str:
        """``tp8 pp8 dp16 mb1 interleaved v2 zero1 rc=full sp``, plus the non-default
        bucket size (``b100``), prefetch depth (``pf2``) or ``offload``."""
        parts = [f"tp{self.tp}", f"pp{self.pp}", f"dp{self.dp}", f"mb{self.micro_batch}"]
        if self.pp > 1:
            parts.append(
                self.schedule + (f" v{self.virtual_stages}" if self.virtual_stages > 1 else "")
            )
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
        import dataclasses

        from collsim.parallel.config import Recompute
        from collsim.vocab import ScheduleKind

        training = dataclasses.replace(
            base_training, micro_batch=self.micro_batch, recompute=Recompute(self.recompute)
        )
        parallel = dataclasses.replace(
            base_parallel,
            tp=self.tp,
            pp=self.pp,
            dp=self.dp,
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
) -> Iterator[Candidate]:
    """Every buildable plan of ``spec`` on ``num_gpus`` GPUs; the others are counted by reason
    in ``rejected`` (one count per plan of the full grid that is dropped)."""
    space = space or SearchSpace()
    rejected = rejected if rejected is not None else Counter()
    max_tp = space.max_tp or num_gpus
    variants = space.dp_variants()
    per_variant = len(variants) * len(space.recomputes)
    for tp in _divisors(num_gpus):
        sps = [sp for sp in space.sequence_parallel if tp > 1 or not sp] or [False]
        for pp in _divisors(num_gpus // tp):
            dp = num_gpus // (tp * pp)
            scheds: list[tuple[str, int]] = (
                [("1f1b", 1)]
                if pp == 1
                else [
                    (s, v)
                    for s in space.schedules
                    for v in (space.virtual_stages if s == "interleaved" else (1,))
                ]
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
) -> SearchResult:
    """Enumerate, bound, estimate and rank the plans; re-simulate the ``top_k`` best.

    Plans whose model states alone exceed the GPU are dropped before any estimate (counted as
    ``memory``). The rest are estimated best-first by a lower bound on their step (the compute
    stream's own work: every micro-batch's forward, backward and recompute of the busiest
    stage, and its optimizer step); once that bound cannot beat the ``max(top_k,
    prune_keep)``-th best estimate, the remaining plans are counted as ``bound`` and not
    estimated. The best ``max(top_k, prune_keep)`` plans are exactly those a full
    enumeration finds (a test checks it); ``prune_keep=0`` estimates every plan.

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
            the last call) or ``simulate`` (1 per simulated plan).
    """
    from collsim.estimate import Estimator

    started = time.perf_counter()
    num_gpus = topology.num_ranks
    rejected: Counter[str] = Counter()
    estimator = Estimator(topology, spec)
    bounds = _Bounds(topology, spec, training)
    dropped: Counter[str] = Counter()
    # 1. cheap bounds for every buildable plan: model states alone must fit, and the compute
    #    stream's own work is a lower bound on the step
    candidates: list[tuple[float, int, Candidate]] = []
    total = 0
    for candidate in enumerate_plans(
        spec, num_gpus, topology.gpus_per_node, training.global_batch, space, dropped
    ):
        total += 1
        if bounds.states_bytes(candidate) > topology.device.usable_memory_bytes:
            rejected["memory"] += 1
            continue
        candidates.append(
            (max(bounds.step_s(candidate), bounds.dp_stream_s(candidate)), total, candidate)
        )
    # 2. best-first: estimate in increasing lower bound; once the bound cannot beat the
    #    keep-th best estimate, no later plan can (branch and bound: same top plans as
    #    estimating all of them)
    candidates.sort(key=lambda c: (c[0], c[1]))
    keep = max(top_k, prune_keep) if prune_keep > 0 else 0
    best: list[float] = []  # the keep best estimated step times, max-heap by negation
    ranked: list[Ranked] = []
    pending = 0
    evaluated = 0
    for index, (bound, _, candidate) in enumerate(candidates):
        if keep and len(best) >= keep and bound >= -best[0]:
            rejected["bound"] += len(candidates) - index
            break
        train_c, par_c = candidate.configs(training, parallel)
        evaluated += 1
        try:
            estimate = estimator.estimate(train_c, par_c)
        except (InfeasibleError, ConfigError) as exc:
            rejected[getattr(exc, "reason", "config")] += 1
            continue
        if not estimate.fits:
            rejected["memory"] += 1
        else:
            ranked.append(Ranked(candidate, estimate))
            if keep:
                heapq.heappush(best, -estimate.step_time_s)
                if len(best) > keep:
                    heapq.heappop(best)
        pending += 1
        if progress is not None and pending >= 200:
            progress("estimate", pending)
            pending = 0
    if progress is not None and pending:
        progress("estimate", pending)
    structural = sum(dropped.values())
    rejected.update(dropped)
    ranked.sort(key=lambda r: (r.estimate.step_time_s, r.estimate.memory_peak_bytes))
    estimate_s = time.perf_counter() - started

    simulated: list[Ranked] = []
    sim_started = time.perf_counter()
    for entry in ranked[: max(0, top_k)]:
        train_c, par_c = entry.candidate.configs(training, parallel)
        t0 = time.perf_counter()
        try:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore", CollsimWarning)
                entry.result = (simulate or _simulate)(topology, spec, train_c, par_c)
            if not entry.result.fits:
                entry.reason = "memory (DES)"
        except (InfeasibleError, ConfigError) as exc:
            entry.reason = f"{getattr(exc, 'reason', 'config')}: {exc}"
        entry.simulate_s = time.perf_counter() - t0
        simulated.append(entry)
        if progress is not None:
            progress("simulate", 1)
    for entry in simulated:
        if entry.reason and entry.reason.startswith("memory"):
            rejected["memory (DES)"] += 1
    simulated.sort(key=lambda r: (r.reason is not None, r.step_time_s))
    considered = total + structural
    return SearchResult(
        num_gpus=num_gpus,
        considered=considered,
        ranked=ranked,
        simulated=simulated,
        rejected=rejected,
        estimated=evaluated,
        buildable=total,
        estimate_s=estimate_s,
        simulate_s=time.perf_counter() - sim_started,
    )


class _Bounds:
    """Cheap bounds of a candidate from the workload layer alone (no schedule).

    ``states_bytes``: the model states every rank holds for the whole step (ZeRO table; the
    schedule allocates them at time 0, so the peak is at least this). ``step_s``: the compute
    stream's own work on the busiest stage, m micro-batches x (layers x (forward + backward +
    recompute) + embedding / head), plus its optimizer step; the stream runs them one after
    another, so no plan's step is shorter (communication, bubble and waits only add).
    """

    def __init__(self, topology: Topology, spec: TransformerSpec, training: TrainingConfig):
        from collsim.schedule.build import bytes_per

        self.topology = topology
        self.spec = spec
        self.training = training
        self.per = bytes_per(training)
        self._models: dict[str, Any] = {}
        self._pricer: ClosedPricer | None = None
        self._step: dict[tuple[Any, ...], float] = {}
        self._dp: dict[tuple[Any, ...], float] = {}

    def _stage_params(self, c: Candidate) -> list[float]:
        from collsim.workload.memory import parameters_per_rank

        return [
            float(parameters_per_rank(self.spec, tp=c.tp, pp=c.pp, stage=s))
            for s in sorted({0, c.pp - 1})
        ]

    def states_bytes(self, c: Candidate) -> float:
        if c.offload:
            return 0.0  # the shards live in host memory
        n, per = float(c.dp), self.per
        out = 0.0
        for numel in self._stage_params(c):
            params = numel * per.param / (n if c.zero >= 3 else 1.0)
            grads = numel * per.grad / (n if c.zero >= 2 else 1.0)
            states = numel * per.optimizer / (n if c.zero >= 1 else 1.0)
            out = max(out, params + grads + states)
        return out * (1 - 1e-9)

    def step_s(self, c: Candidate) -> float:
        key: tuple[Any, ...] = (c.tp, c.pp, c.dp, c.micro_batch, c.schedule, c.virtual_stages)
        key += (c.zero, c.recompute, c.sequence_parallel)
        hit = self._step.get(key)
        if hit is None:
            hit = self._step[key] = self._step_s(c)
        return hit

    def dp_stream_s(self, c: Candidate) -> float:
        """The data-parallel stream's own work: every gradient reduction (one call of all the
        stage's gradients bounds the bucketed ones from below: a collective's closed form is
        latency plus bytes over bandwidth, sub-additive in the bytes), and with ZeRO-3 every
        unit's gathers and reduce-scatters of every micro-batch. The step ends after it."""
        if c.dp < 2:
            return 0.0
        key = (c.tp, c.pp, c.dp, c.micro_batch, c.zero, c.reshard, c.offload)
        hit = self._dp.get(key)
        if hit is not None:
            return hit
        from collsim.workload.memory import layer_parameters_per_rank, layers_per_stage

        if self._pricer is None:
            from collsim.schedule.pricing import ClosedPricer as Pricer

            self._pricer = Pricer(self.topology)
        group = tuple(range(0, c.tp * c.pp * c.dp, c.tp * c.pp))
        per = self.per
        params = max(self._stage_params(c))
        m = self.training.global_batch // (c.micro_batch * c.dp)
        cost = self._pricer.cost
        if c.zero == 3:
            unit = float(layer_parameters_per_rank(self.spec, c.tp))
            units = max(layers_per_stage(self.spec.num_layers, c.pp))
            gathers = 2 if c.reshard else 1
            per_mb = units * (
                gathers * cost("all_gather", unit * per.param, group).time_s
                + cost("reduce_scatter", unit * per.grad, group).time_s
            )
            work = m * per_mb
        else:
            op = "all_reduce" if c.zero == 0 else "reduce_scatter"
            reductions = m if c.zero == 2 else 1
            work = reductions * cost(op, params * per.grad, group).time_s
            if c.zero in (1, 2):
                work += cost("all_gather", params * per.param, group).time_s
        hit = self._dp[key] = work * (1 - 1e-9)
        return hit

    def _step_s(self, c: Candidate) -> float:
        from collsim.workload.compute import ComputeModel
        from collsim.workload.memory import layers_per_stage

        dtype = str(self.training.dtype)
        model = self._models.get(dtype)
        if model is None:
            model = self._models[dtype] = ComputeModel(self.topology.device, dtype)
        spec, mb, sp = self.spec, c.micro_batch, c.sequence_parallel and c.tp > 1
        lt = model.layer_times(
            spec, micro_batch=mb, tp=c.tp, sequence_parallel=sp, recompute=c.recompute
        )
        et = model.embedding_times(spec, micro_batch=mb, tp=c.tp, sequence_parallel=sp)
        ht = model.head_times(spec, micro_batch=mb, tp=c.tp, sequence_parallel=sp)
        fwd = lt.forward_s + self._tp_s(c, 2)
        bwd = lt.backward_s + lt.recompute_s + self._tp_s(c, 4 if c.recompute == "full" else 2)
        counts = layers_per_stage(spec.num_layers, c.pp)
        m = self.training.global_batch // (mb * c.dp)
        v = c.virtual_stages if c.schedule == "interleaved" else 1

        def work(s: int) -> tuple[float, float]:
            f, b = counts[s] * fwd, counts[s] * bwd
            if s == 0:
                f, b = f + et.forward_s, b + et.backward_s
            if s == c.pp - 1:
                f, b = f + ht.forward_s, b + ht.backward_s
            return f, b

        last = c.pp - 1
        f_last, b_last = work(last)
        params = self._stage_params(c)
        opts = [
            model.optimizer_time_s(n / (c.dp if c.zero >= 1 else 1), str(self.training.optimizer))
            for n in params
        ]
        # the last stage waits for the first micro-batch's first chunk to cross the stages
        # before it, and stage 0 finishes the last one's backward (then its optimizer step)
        # after the last stage is done
        fill = sum(sum(work(s)) for s in range(last)) / v
        bound = m * (f_last + b_last) + fill + min(opts)
        f0, b0 = work(0)
        bound = max(bound, m * (f0 + b0) + opts[0])
        return bound * (1 - 1e-9)

    def _tp_s(self, c: Candidate, calls: int) -> float:
        """Blocking TP collectives of one layer's forward or backward (closed form)."""
        if c.tp < 2:
            return 0.0
        if self._pricer is None:
            from collsim.schedule.pricing import ClosedPricer as Pricer

            self._pricer = Pricer(self.topology)
        size = float(c.micro_batch * self.spec.seq_len * self.spec.hidden * self.per.activation)
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
    from collsim.engine import simulate_step

    return simulate_step(topology, spec, training, parallel)


def search_frame(result: SearchResult, *, limit: int | None = None) -> pd.DataFrame:
    """One row per feasible plan, best estimate first: the plan's knobs, ``est_*`` columns of
    the closed form (step time, breakdown, memory, MFU) and ``sim_*`` columns for the
    re-simulated ones (NaN otherwise)."""
    import pandas as pd

    from collsim.schedule.result import BREAKDOWN_KEYS, MEMORY_KEYS

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
