"""Plan search and the closed-form estimate: grid accounting, formulas, agreement with the DES."""

from __future__ import annotations

import dataclasses
import warnings
from collections import Counter

import pytest

from collsim.cluster.topology import load_topology
from collsim.core.errors import CollsimWarning, ConfigError
from collsim.parallel.config import DDPConfig, ParallelConfig, TrainingConfig
from collsim.play.engine import simulate_step
from collsim.play.walk import Estimator, estimate_step
from collsim.step.allocator import allocator_limit_bytes
from collsim.study.search import SearchSpace, enumerate_plans, search_frame, search_plans
from collsim.workload import (
    ComputeModel,
    TransformerSpec,
    get_preset,
    model_state_bytes,
    parameters_per_rank,
)

TINY = TransformerSpec(
    name="tiny", num_layers=8, hidden=512, num_heads=8, ffn_hidden=2048, seq_len=256, vocab=4096
)


# the data-parallel knobs at one value each (the plan knobs as in the default space)
SMALL = SearchSpace(
    bucket_mbs=(25.0,),
    overlaps=(True,),
    bucket_views=(False,),
    prefetches=(1,),
    offloads=(False,),
    reshards=(True,),
)


@pytest.fixture(scope="module")
def h100x16():
    return load_topology("dgx_h100", nodes=2)


def _brute_grid_size(spec: TransformerSpec, gpus: int, per_node: int, space: SearchSpace) -> int:
    """Every combination of the knobs, buildable or not (independent of enumerate_plans)."""
    total = 0
    for tp in range(1, gpus + 1):
        if gpus % tp:
            continue
        for pp in range(1, gpus // tp + 1):
            if (gpus // tp) % pp:
                continue
            scheds = (
                1
                if pp == 1
                else sum(
                    len(space.virtual_stages) if s == "interleaved" else 1 for s in space.schedules
                )
            )
            sps = 2 if tp > 1 else 1
            variants = len(space.dp_variants())
            total += len(space.micro_batches) * scheds * variants * len(space.recomputes) * sps
    return total


def test_every_plan_of_the_grid_is_kept_or_counted(h100x16) -> None:
    # a space kept inside a node and without ZeRO-2/3 under pipelines: both rules counted
    space = SearchSpace(max_tp=8, zero_with_pp=False)
    rejected: Counter[str] = Counter()
    plans = list(enumerate_plans(TINY, 16, 8, 64, space, rejected))
    assert len(plans) + sum(rejected.values()) == _brute_grid_size(TINY, 16, 8, space)
    assert len(set(plans)) == len(plans)
    for plan in plans:
        assert plan.tp * plan.pp * plan.dp == 16 and plan.tp <= 8
        assert TINY.num_layers % (plan.pp * plan.virtual_stages) == 0
        assert 64 % (plan.dp * plan.micro_batch) == 0
        assert not (plan.zero >= 2 and plan.pp > 1)
        m = 64 // (plan.dp * plan.micro_batch)
        assert plan.schedule != "interleaved" or m % plan.pp == 0
    assert rejected["tp_node"] > 0 and rejected["pp_layers"] > 0 and rejected["zero_pp"] > 0


def test_zero2_under_pipelines_is_counted_unless_the_space_asks_for_it(h100x16) -> None:
    # by default ZeRO-2 meets no pipeline (no stack runs it) while ZeRO-3 does (FSDP2 with
    # pipelining); every plan left out is counted, and the space's zero2_with_pp brings back
    # exactly those plans
    rejected: Counter[str] = Counter()
    plans = list(enumerate_plans(TINY, 16, 8, 64, SearchSpace(max_tp=8), rejected))
    assert not any(p.zero == 2 and p.pp > 1 for p in plans)
    assert any(p.zero == 2 and p.pp == 1 for p in plans)
    assert any(p.zero == 3 and p.pp > 1 for p in plans)
    wide: Counter[str] = Counter()
    space = SearchSpace(max_tp=8, zero2_with_pp=True)
    more = list(enumerate_plans(TINY, 16, 8, 64, space, wide))
    extra = [p for p in more if p.zero == 2 and p.pp > 1]
    assert extra and set(more) - set(plans) == set(extra)
    # the same grid either way: what one keeps or counts, the other does too
    assert len(plans) + sum(rejected.values()) == len(more) + sum(wide.values())
    assert rejected["zero2_pp"] >= len(extra) and wide["zero2_pp"] == 0


def _configs(**knobs):
    train = {k: knobs.pop(k) for k in ("micro_batch", "recompute", "global_batch") if k in knobs}
    training = TrainingConfig(global_batch=train.pop("global_batch", 64), **train)
    return training, ParallelConfig(**knobs)


def test_estimate_of_pure_data_parallel_adds_up(h100x16) -> None:
    # DDP without overlap on 16 GPUs: compute is m x (fwd + bwd) of the whole model from the
    # workload layer's ComputeModel, and every bucket's all-reduce is exposed.
    training, parallel = _configs(dp=16, micro_batch=2)
    parallel = dataclasses.replace(parallel, ddp=DDPConfig(overlap=False, bucket_mb=1.0))
    est = Estimator(h100x16, TINY).estimate(training, parallel)
    model = ComputeModel(h100x16.device, "bf16")
    layer = model.layer_times(TINY, micro_batch=2)
    emb, head = model.embedding_times(TINY, micro_batch=2), model.head_times(TINY, micro_batch=2)
    per_mb = (
        8 * (layer.forward_s + layer.backward_s)
        + emb.forward_s
        + emb.backward_s
        + head.forward_s
        + head.backward_s
    )
    assert est.num_microbatches == 2  # 64 / (16 x 2)
    # the slowest of the 16 GPUs sets the pace (compute.md 1a; collsim.workload.kernels)
    from collsim.workload.kernels import slowest_gpu_factor

    assert est.breakdown_s["compute"] == pytest.approx(2 * per_mb * slowest_gpu_factor(16))
    assert est.breakdown_s["bubble"] == 0 and est.breakdown_s["tp_exposed"] == 0
    from collsim.collectives import Group, cost

    # torch's reducer packs whole tensors (registration order reversed) into 1 MiB buckets
    # (the first one 1 MiB too): the closed form reduces exactly those buckets, one by one.
    from collsim.parallel.buckets import build_buckets
    from collsim.parallel.params import chunk_tensors

    tensors = chunk_tensors(TINY, range(TINY.num_layers), tp=1, first=True, last=True, pp=1)
    buckets = build_buckets(tensors, bucket_mb=1.0, first_bucket_mb=1.0, grad_bytes=2)
    assert sum(b.size_bytes for b in buckets) == pytest.approx(parameters_per_rank(TINY) * 2)
    group = Group(h100x16, tuple(range(16)))
    want = sum(cost("all_reduce", int(b.size_bytes), group).time_s for b in buckets)
    assert est.breakdown_s["dp_exposed"] == pytest.approx(want)
    assert est.step_time_s == pytest.approx(sum(est.breakdown_s.values()))


BALANCED = {
    "layer.forward": 1e-3,
    "layer.backward": 2e-3,
    "embedding.forward": 0.0,
    "embedding.backward": 0.0,
    "head.forward": 0.0,
    "head.backward": 0.0,
}


def test_interleaving_divides_the_bubble_and_zero3_shards_parameters(h100x16) -> None:
    # The closed form walks the real op order: on an ideal network (communication at 0 s),
    # with balanced stages (no embedding or head time), the bubble is Narayanan's
    # (p - 1)/v x (t_f + t_b), so two chunks per stage halve it.
    estimator = Estimator(h100x16, TINY)
    training = TrainingConfig(global_batch=64, micro_batch=1)
    plans = {
        1: ParallelConfig(tp=2, pp=4, dp=2, schedule="1f1b"),
        2: ParallelConfig(tp=2, pp=4, dp=2, schedule="interleaved", virtual_stages=2),
    }
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", CollsimWarning)
        ideal = {
            v: estimate_step(
                h100x16, TINY, training, par, zero_communication=True, op_time_overrides=BALANCED
            )
            for v, par in plans.items()
        }
    assert ideal[2].breakdown_s["bubble"] == pytest.approx(ideal[1].breakdown_s["bubble"] / 2)
    assert ideal[1].breakdown_s["bubble"] > 0
    one, two = (estimator.estimate(training, par) for par in plans.values())
    assert 0 < two.breakdown_s["bubble"] < one.breakdown_s["bubble"]
    zero3_plan = ParallelConfig(dp=16, zero=3)
    zero3 = estimator.estimate(training, zero3_plan)
    psi = parameters_per_rank(TINY)
    shard = model_state_bytes(psi, zero=3, dp=16).parameters
    assert shard == pytest.approx(2 * psi / 16)
    # at the peak the rank holds its shard plus the units gathered at that moment
    assert zero3.memory_bytes["parameters"] > shard
    des = simulate_step(h100x16, TINY, training, zero3_plan, fidelity="fused")
    assert zero3.memory_bytes == des.memory_bytes
    # one world-size check for both fidelities (build_plan's)
    with pytest.raises(ConfigError, match="must equal the GPUs of the cluster"):
        estimator.estimate(training, ParallelConfig(dp=8))


@pytest.mark.parametrize(
    "knobs",
    [
        dict(dp=16, micro_batch=4),
        dict(tp=2, pp=2, dp=4, micro_batch=2, zero=1),
        dict(tp=4, pp=1, dp=4, micro_batch=1, zero=2, recompute="selective"),
        dict(tp=2, pp=4, dp=2, micro_batch=1, schedule="interleaved", virtual_stages=2, zero=1),
        dict(tp=2, pp=8, dp=1, micro_batch=2, schedule="gpipe", recompute="full"),
        dict(tp=8, pp=2, dp=1, micro_batch=8, sequence_parallel=True),
    ],
    ids=["ddp", "3d", "zero2-tp", "interleaved", "gpipe-full", "tp8-sp"],
)
def test_estimate_agrees_with_the_engine(h100x16, knobs) -> None:
    training, parallel = _configs(**knobs)
    est = Estimator(h100x16, TINY).estimate(training, parallel)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", CollsimWarning)
        sim = simulate_step(h100x16, TINY, training, parallel)
    # The estimate walks the same step program as the engine: on an uncontended job the two
    # agree to rounding (measured: equal to 1e-15 on every plan here).
    assert est.step_time_s == pytest.approx(sim.step_time_s, rel=1e-9)


def test_search_ranks_by_estimate_and_resimulates_the_best(h100x16) -> None:
    training = TrainingConfig(global_batch=64, micro_batch=1)
    space = SearchSpace(micro_batches=(1, 4), recomputes=("none", "full"))
    result = search_plans(h100x16, TINY, training, ParallelConfig(dp=16), space=space, top_k=2)
    times = [r.estimate.step_time_s for r in result.ranked]
    assert times == sorted(times) and len(times) <= result.estimated <= result.buildable
    assert len(result.simulated) == 2
    assert {id(r) for r in result.simulated} == {id(r) for r in result.ranked[:2]}
    best = result.best
    assert best is not None and best.result is not None and best.result.fits
    assert best.step_time_s == min(r.result.step_time_s for r in result.simulated)
    frame = search_frame(result)
    assert len(frame) == len(result.ranked)
    assert frame["simulated"].sum() == 2
    assert {
        "est_step_time_s",
        "sim_step_time_s",
        "est_mem_activations_bytes",
        "sim_mfu",
        "plan",
    } <= set(frame.columns)


def test_a_search_makes_full_collector_passes_rarer_and_restores_them(h100x16) -> None:
    # collsim.core.runtime.collector_relaxed over the whole search (its bounds and estimates):
    # the engine's re-simulation inside it sees the scaled threshold, the caller the old one
    import gc

    from collsim.core.runtime import FULL_PASS_SCALE

    before = gc.get_threshold()
    seen: list[tuple[int, int, int]] = []

    def simulate(*args: object) -> object:
        seen.append(gc.get_threshold())
        return simulate_step(*args)  # type: ignore[arg-type]

    training = TrainingConfig(global_batch=64, micro_batch=1)
    space = SearchSpace(micro_batches=(1,), recomputes=("none",))
    search_plans(
        h100x16, TINY, training, ParallelConfig(dp=16), space=space, top_k=1, simulate=simulate
    )
    assert seen == [(before[0], before[1], before[2] * FULL_PASS_SCALE)]
    assert gc.get_threshold() == before


def test_search_counts_plans_that_do_not_fit() -> None:
    # GPT-3 175B on 64 A100s: DDP replicas (16 x 175e9 bytes / (tp x pp)) mostly do not fit.
    topology = load_topology("dgx_a100", nodes=8)
    training = TrainingConfig(global_batch=64, micro_batch=1, recompute="full")
    result = search_plans(
        topology,
        get_preset("gpt3-175b"),
        training,
        ParallelConfig(dp=64),
        space=dataclasses.replace(SMALL, micro_batches=(1,), recomputes=("full",)),
        top_k=0,
    )
    # most do not fit by their memory floor alone (never estimated), some only by estimate
    assert result.rejected["memory_bound"] > 0
    assert result.rejected["memory_bound"] + result.rejected["memory"] + len(result.ranked) == (
        result.buildable - result.rejected["bound"]
    )
    assert result.ranked, "some plan of 175B fits on 64 A100 80GB"
    # each ranked plan fits as `collsim run` judges it (the closed form with its memory
    # timeline, the caching allocator replayed): checked on every plan whose allocated peak
    # lies above the usable capacity, where the older rule and the replay part
    limit = allocator_limit_bytes(topology.device)
    near = [
        e
        for e in result.ranked
        if e.estimate.memory_peak_bytes > topology.device.usable_memory_bytes
    ]
    assert near, "some ranked plan lies between the usable capacity and the allocator's limit"
    for entry in result.ranked:
        assert entry.estimate.memory_peak_bytes <= limit
    for entry in near:
        configs = entry.candidate.configs(training, ParallelConfig(dp=64))
        assert estimate_step(topology, get_preset("gpt3-175b"), *configs).fits


@pytest.mark.parametrize(
    "knobs",
    [
        dict(tp=4, pp=4, dp=2, micro_batch=4, sequence_parallel=True),
        dict(tp=1, pp=4, dp=8, micro_batch=8, zero=1, recompute="selective"),
        dict(tp=2, pp=2, dp=8, micro_batch=2, schedule="gpipe", zero=1, recompute="full"),
        dict(tp=2, pp=1, dp=16, micro_batch=2, zero=3),
    ],
    ids=["3d-sp", "pp-zero1", "gpipe-full", "zero3"],
)
def test_estimated_memory_agrees_with_the_engine(knobs) -> None:
    # GPT-3 13B on 4 DGX A100 nodes, global batch 64: the ZeRO and Korthikanti closed forms
    # against the engine's memory timeline peak.
    topology = load_topology("dgx_a100", nodes=4)
    spec = get_preset("gpt3-13b")
    training, parallel = _configs(global_batch=64, **knobs)
    est = Estimator(topology, spec).estimate(training, parallel)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", CollsimWarning)
        sim = simulate_step(topology, spec, training, parallel)
    # one step program for both: they agree to rounding (measured: equal to 1e-15)
    assert est.memory_peak_bytes == pytest.approx(sim.memory_peak_bytes, rel=1e-9)
    assert est.memory_bytes["optimizer"] == pytest.approx(sim.memory_bytes["optimizer"], rel=1e-9)
    assert est.step_time_s == pytest.approx(sim.step_time_s, rel=1e-9)


def test_pruning_by_bound_returns_the_same_best_plans(h100x16) -> None:
    # branch and bound against estimating every plan of the grid (a tiny model on 16 GPUs)
    training = TrainingConfig(global_batch=64, micro_batch=1)
    space = dataclasses.replace(SMALL, micro_batches=(1, 2, 4))
    args = (h100x16, TINY, training, ParallelConfig(dp=16))
    pruned = search_plans(*args, space=space, top_k=0, prune_keep=10)
    full = search_plans(*args, space=space, top_k=0, prune_keep=0)
    assert full.considered > 1_000
    assert pruned.rejected["bound"] > 0 and pruned.estimated < full.estimated
    assert full.rejected["bound"] == 0 and full.estimated == full.buildable
    best = [(r.candidate, r.estimate.step_time_s) for r in full.ranked[:10]]
    assert [(r.candidate, r.estimate.step_time_s) for r in pruned.ranked[:10]] == best


def test_the_default_space_of_gpt3_175b_on_1024_gpus_is_large() -> None:
    # TP across nodes, ZeRO-1/2/3 with pipelines, bucket sizes, prefetch depths, offload
    rejected: Counter[str] = Counter()
    spec = get_preset("gpt3-175b")
    plans = sum(1 for _ in enumerate_plans(spec, 1024, 8, 1536, SearchSpace(), rejected))
    assert plans + sum(rejected.values()) >= 1_000_000
    assert any(p.tp > 8 for p in enumerate_plans(spec, 1024, 8, 1536, SearchSpace()))


def _every_nth(plans: list, n: int) -> list:
    return plans[:: max(1, len(plans) // n)]


@pytest.mark.parametrize(
    ("preset", "nodes", "global_batch"),
    [("tiny", 2, 64), ("gpt3-13b", 8, 256)],
    ids=["tiny-16", "13b-64"],
)
def test_the_bounds_are_floors_of_the_estimate(preset, nodes, global_batch) -> None:
    # Branch and bound is exact only if no bound exceeds what it bounds: a spread of plans of
    # the whole default space (every knob), each estimated, none below its floors.
    from collsim.study.search.bounds import Bounds

    topology = load_topology("dgx_h100", nodes=nodes)
    spec = TINY if preset == "tiny" else get_preset(preset)
    training = TrainingConfig(global_batch=global_batch, micro_batch=1)
    plans = list(enumerate_plans(spec, topology.num_ranks, 8, global_batch, SearchSpace()))
    bounds = Bounds(topology, spec, training)
    estimator = Estimator(topology, spec)
    checked = tightest = 0
    for plan in _every_nth(plans, 120):
        est = estimator.estimate(*plan.configs(training, ParallelConfig(dp=topology.num_ranks)))
        floor, refined = bounds.step_s(plan), bounds.refined_s(plan)
        assert floor <= refined <= est.step_time_s, plan.label
        assert bounds.memory_bytes(plan) <= est.memory_peak_bytes, plan.label
        checked += 1
        tightest = max(tightest, refined / est.step_time_s)
    assert checked >= 100
    assert tightest > 0.9  # the floors are close for some plans, not vacuous


def test_the_memory_floor_is_below_the_engine_peak() -> None:
    from collsim.study.search import Candidate
    from collsim.study.search.bounds import Bounds

    topology = load_topology("dgx_a100", nodes=4)
    spec = get_preset("gpt3-13b")
    training = TrainingConfig(global_batch=64, micro_batch=1)
    bounds = Bounds(topology, spec, training)
    for knobs in (
        dict(tp=4, pp=4, dp=2, micro_batch=4, schedule="1f1b", virtual_stages=1, zero=0),
        dict(tp=2, pp=4, dp=4, micro_batch=2, schedule="interleaved", virtual_stages=2, zero=1),
        dict(tp=2, pp=2, dp=8, micro_batch=2, schedule="gpipe", virtual_stages=1, zero=2),
        dict(tp=2, pp=1, dp=16, micro_batch=2, schedule="1f1b", virtual_stages=1, zero=3),
    ):
        plan = Candidate(**knobs, recompute="selective", sequence_parallel=True, reshard=False)
        train_c, par_c = plan.configs(training, ParallelConfig(dp=32))
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", CollsimWarning)
            sim = simulate_step(topology, spec, train_c, par_c)
        assert bounds.memory_bytes(plan) <= sim.memory_peak_bytes, plan.label
        assert bounds.refined_s(plan) <= sim.step_time_s, plan.label


def test_jobs_find_the_same_best_plans(h100x16) -> None:
    training = TrainingConfig(global_batch=64, micro_batch=1)
    space = dataclasses.replace(SMALL, micro_batches=(1, 2))
    args = (h100x16, TINY, training, ParallelConfig(dp=16))
    one = search_plans(*args, space=space, top_k=2, jobs=1)
    two = search_plans(*args, space=space, top_k=2, jobs=2)
    assert [(r.candidate, r.estimate.step_time_s) for r in two.ranked[:10]] == [
        (r.candidate, r.estimate.step_time_s) for r in one.ranked[:10]
    ]
    assert [(r.candidate, r.step_time_s) for r in two.simulated] == [
        (r.candidate, r.step_time_s) for r in one.simulated
    ]


@pytest.mark.slow
@pytest.mark.timeout(3600)
def test_pruning_on_a_space_of_20000_plans_returns_the_same_best_ten(h100x16) -> None:
    # the whole default space (every data-parallel knob, ZeRO-2 under pipelines too) of a
    # tiny model on 16 GPUs
    training = TrainingConfig(global_batch=64, micro_batch=1)
    space = SearchSpace(micro_batches=(1, 2, 4, 8), zero2_with_pp=True)
    args = (h100x16, TINY, training, ParallelConfig(dp=16))
    pruned = search_plans(*args, space=space, top_k=0, prune_keep=10, jobs=2)
    full = search_plans(*args, space=space, top_k=0, prune_keep=0, jobs=2)
    assert full.buildable >= 20_000 and full.estimated == full.buildable
    assert pruned.estimated < full.estimated / 5
    best = [(r.candidate, r.estimate.step_time_s) for r in full.ranked[:10]]
    assert [(r.candidate, r.estimate.step_time_s) for r in pruned.ranked[:10]] == best


@pytest.mark.parametrize("order", ["tp-cp-ep-dp-pp", "tp-cp-ep-pp-dp"])
def test_the_bound_prices_the_plans_own_data_parallel_groups(order: str) -> None:
    # the data-parallel floor of a DDP plan is one all-reduce of the stage's gradients in the
    # dp group the plan's own rank order gives its first rank (dp inside or outside pp)
    from collsim.parallel.plan import build_plan
    from collsim.step.build import bytes_per
    from collsim.step.pricing import ClosedPricer
    from collsim.study.search import Candidate
    from collsim.study.search.bounds import Bounds
    from collsim.workload.memory import parameters_per_rank

    topology = load_topology("dgx_h100", nodes=4)
    spec = get_preset("gpt3-13b")
    training = TrainingConfig(global_batch=64, micro_batch=1)
    parallel = ParallelConfig(dp=32, order=order)
    bounds = Bounds(topology, spec, training, parallel)
    plan_c = Candidate(
        tp=2, pp=4, dp=4, micro_batch=1, schedule="1f1b", virtual_stages=1, zero=0,
        recompute="none", sequence_parallel=False,
    )  # fmt: skip
    train_c, par_c = plan_c.configs(training, parallel)
    plan = build_plan(topology, spec, train_c, par_c)
    pricer = ClosedPricer(topology)
    before = bounds._program_dp(plan_c)[0]
    for i, stage in enumerate((0, 3)):
        group = plan.group_of(plan.rank(dp=0, pp=stage, tp=0), "dp")
        numel = parameters_per_rank(spec, tp=2, pp=4, stage=stage)
        size = numel * bytes_per(training).grad
        assert before[i] == pytest.approx(pricer.cost("all_reduce", size, group).time_s)
    assert len(set(group)) == 4


@pytest.mark.parametrize(
    ("preset", "nodes", "space"),
    [
        ("tiny", 2, SearchSpace(cps=(1, 2, 4), micro_batches=(1, 2))),
        ("qwen3-30b-a3b", 2, SearchSpace(eps=(1, 2, 8), micro_batches=(1,))),
    ],
    ids=["cp", "ep"],
)
def test_context_and_expert_parallel_plans_are_searched_under_floors(preset, nodes, space) -> None:
    # the search varies cp and ep; for such plans only the compute stream is bounded (the
    # cheapest layer kind), and that floor holds
    from collsim.study.search.bounds import Bounds

    topology = load_topology("dgx_h100", nodes=nodes)
    spec = TINY if preset == "tiny" else dataclasses.replace(get_preset(preset), seq_len=1024)
    training = TrainingConfig(global_batch=32, micro_batch=1)
    base = ParallelConfig(dp=topology.num_ranks)
    plans = list(enumerate_plans(spec, topology.num_ranks, 8, 32, space, Counter(), base=base))
    varied = {p.cp for p in plans} | {p.ep for p in plans}
    assert varied >= ({1, 2, 4} if preset == "tiny" else {1, 2, 8})
    bounds = Bounds(topology, spec, training, base)
    estimator = Estimator(topology, spec)
    checked = held = 0
    for plan in _every_nth([p for p in plans if p.cp > 1 or p.ep > 1], 25):
        try:
            est = estimator.estimate(*plan.configs(training, base))
        except ConfigError:
            continue
        assert bounds.step_s(plan) <= bounds.refined_s(plan) <= est.step_time_s, plan.label
        memory = bounds.memory_bytes(plan)
        assert memory <= est.memory_peak_bytes, plan.label
        # a dense model's context-parallel plans keep a memory floor (states over dp x cp);
        # an expert model's floor holds activations on top of its states
        if spec.is_moe:
            held += memory > max(bounds._plan_states(plan), default=0.0)
        else:
            held += plan.cp > 1 and memory > 0
        checked += 1
    assert checked >= 10
    assert held


SMALL_MOE = TransformerSpec(
    name="small-moe",
    num_layers=4,
    hidden=1024,
    num_heads=16,
    num_kv_heads=4,
    ffn_hidden=4096,
    seq_len=2048,
    vocab=1000,
    num_experts=16,
    moe_top_k=4,
    moe_ffn_hidden=1024,
    first_k_dense=1,
    gated_mlp=True,
)


@pytest.mark.parametrize(
    ("dispatcher", "ep_overlap"),
    [(d, o) for d in ("alltoall", "deepep", "hybridep") for o in (False, True)]
    + [("allgather", False)],  # EP overlap needs an all-to-all dispatcher (a ConfigError)
    ids=lambda v: {False: "serial", True: "ep-overlap"}.get(v, v),
)
@pytest.mark.parametrize("stack", [None, "megatron_te", "torchtitan"])
def test_expert_step_floor_holds_for_every_dispatcher(stack, dispatcher, ep_overlap) -> None:
    # expert plans of a small MoE model on 2 nodes (ep 16 spans them: the network leg and
    # the NVLink leg side by side) under each dispatcher, with and without EP overlap and
    # with the kernels a stack chooses (attention kernel, fused kernels): the step floors
    # never exceed the closed form's step (their tightness: the published run's slow test);
    # compute-bound enough (2k tokens, 256 sequences) that a floor priced with other
    # kernels than the schedule's overshoots
    from collsim.study.search.bounds import Bounds

    topology = load_topology("dgx_h100", nodes=2)
    training = TrainingConfig(global_batch=256, micro_batch=1, stack=stack)
    base = ParallelConfig(dp=16, dispatcher=dispatcher, ep_overlap=ep_overlap)
    space = SearchSpace(eps=(2, 8, 16), micro_batches=(1,), zero_stages=(1,))
    plans = list(enumerate_plans(SMALL_MOE, 16, 8, 256, space, Counter(), base=base))
    assert {p.ep for p in plans} >= {2, 8, 16}
    bounds = Bounds(topology, SMALL_MOE, training, base)
    estimator = Estimator(topology, SMALL_MOE)
    checked: set[int] = set()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for ep in (2, 8, 16):
            # Megatron-Core's rule: ep under tp needs sequence parallelism
            valid = [p for p in plans if p.ep == ep and (p.tp == 1 or p.sequence_parallel)]
            for plan in _every_nth(valid, 3):
                try:
                    est = estimator.estimate(*plan.configs(training, base))
                except ConfigError:
                    continue
                step = bounds.refined_s(plan)
                assert bounds.step_s(plan) <= step <= est.step_time_s, plan.label
                checked.add(ep)
    assert checked == {2, 8, 16}


@pytest.mark.slow
def test_expert_plans_floors_hold_on_the_published_moe_run() -> None:
    # Qwen3-30B-A3B at 4k tokens in fp8 on 16 H100 (scenarios/published): the memory floor
    # (states plus the activations held at once) never exceeds the estimate's peak, the step
    # floor (compute and the blocking all-to-alls) never its step, and both are tight enough
    # to drop plans before they are estimated
    from collsim.study.scenario import load_scenario
    from collsim.study.search.bounds import Bounds

    sc = load_scenario("scenarios/published/moe_qwen3_30b_a3b_h100_16_fp8.yaml")
    topology = sc.cluster.load()
    space = SearchSpace(eps=(1, 2, 4, 8, 16), micro_batches=(1, 2))
    plans = list(
        enumerate_plans(
            sc.model, topology.num_ranks, 8, sc.training.global_batch, space, Counter(),
            base=sc.parallel,
        )
    )  # fmt: skip
    bounds = Bounds(topology, sc.model, sc.training, sc.parallel)
    estimator = Estimator(topology, sc.model)
    checked = tight = fast = 0
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for plan in _every_nth(plans, len(plans) // 120):
            try:
                est = estimator.estimate(*plan.configs(sc.training, sc.parallel))
            except ConfigError:
                continue
            floor = bounds.memory_bytes(plan)
            assert floor <= est.memory_peak_bytes, plan.label
            # the step floor holds the blocking expert all-to-alls as well as the compute
            step = bounds.refined_s(plan)
            assert bounds.step_s(plan) <= step <= est.step_time_s, plan.label
            tight += floor >= 0.5 * est.memory_peak_bytes
            fast += step >= 0.8 * est.step_time_s
            checked += 1
    assert checked >= 40
    assert tight >= checked // 2
    assert fast >= checked // 2


@pytest.mark.parametrize(
    ("preset", "nodes", "global_batch"),
    [("tiny", 2, 64), ("gpt3-13b", 4, 128)],
    ids=["tiny-16", "13b-32"],
)
def test_split_backward_schedules_are_searched_under_floors(preset, nodes, global_batch) -> None:
    # ZB-H1 and DualPipeV in the space: a spread of their plans (every knob), each estimated,
    # none below its floors; ZeRO-3 and DualPipeV with fewer than 2 pp micro-batches counted
    from collsim.study.search.bounds import Bounds

    topology = load_topology("dgx_h100", nodes=nodes)
    spec = TINY if preset == "tiny" else get_preset(preset)
    training = TrainingConfig(global_batch=global_batch, micro_batch=1)
    # (ZeRO-2 under pipelines asked for: the floors hold for the plans a space file adds)
    space = SearchSpace(schedules=("zb_h1", "dualpipev"), zero2_with_pp=True)
    rejected: Counter[str] = Counter()
    plans = [
        p
        for p in enumerate_plans(spec, topology.num_ranks, 8, global_batch, space, rejected)
        if p.pp > 1
    ]
    assert {p.schedule for p in plans} == {"zb_h1", "dualpipev"}
    assert rejected["schedule_m"] > 0
    assert {p.zero for p in plans} == {0, 1, 2, 3}
    assert all(p.virtual_stages == (2 if p.schedule == "dualpipev" else 1) for p in plans)
    bounds = Bounds(topology, spec, training)
    estimator = Estimator(topology, spec)
    checked = tightest = 0
    for plan in _every_nth(plans, 80):
        est = estimator.estimate(*plan.configs(training, ParallelConfig(dp=topology.num_ranks)))
        floor, refined = bounds.step_s(plan), bounds.refined_s(plan)
        assert floor <= refined <= est.step_time_s, plan.label
        assert bounds.memory_bytes(plan) <= est.memory_peak_bytes, plan.label
        checked += 1
        tightest = max(tightest, refined / est.step_time_s)
    assert checked >= 60
    assert tightest > 0.8


def test_search_chooses_a_split_backward_schedule(h100x16) -> None:
    # asked for 1F1B and ZB-H1, the search estimates both; at every pipelined shape ZB-H1's
    # weight-gradient ops fill the cooldown, so it ranks above 1F1B
    training = TrainingConfig(global_batch=64, micro_batch=1)
    space = dataclasses.replace(
        SMALL,
        micro_batches=(1,),
        schedules=("1f1b", "zb_h1"),
        zero_stages=(0,),
        recomputes=("none",),
        sequence_parallel=(False,),
    )
    result = search_plans(
        h100x16, TINY, training, ParallelConfig(dp=16), space=space, top_k=0, prune_keep=0
    )
    by_shape: dict[tuple[int, int, int], dict[str, float]] = {}
    for r in result.ranked:
        c = r.candidate
        if c.pp > 1:
            by_shape.setdefault((c.tp, c.pp, c.dp), {})[c.schedule] = r.estimate.step_time_s
    pairs = [t for t in by_shape.values() if len(t) == 2]
    assert len(pairs) >= 3
    assert all(t["zb_h1"] < t["1f1b"] for t in pairs)
    pipelined = [r.candidate for r in result.ranked if r.candidate.pp > 1]
    assert pipelined[0].schedule == "zb_h1", pipelined[0].label


DEEP = TransformerSpec(
    name="deep", num_layers=16, hidden=1024, num_heads=16, ffn_hidden=4096, seq_len=1024, vocab=4096
)


def test_search_chooses_dualpipev_where_the_bubble_dominates(h100x16) -> None:
    # an 8-stage pipeline with 16 micro-batches: the bubble is a large part of the step
    # ((p - 1) / m of it under 1F1B), so the schedules that shrink it win; asked for all five,
    # the pruned search finds DualPipeV best (its two chunks per stage in a V and its
    # overlapped forward-backward pairs), ZB-H1 ahead of 1F1B, as the exhaustive one does
    training = TrainingConfig(global_batch=32, micro_batch=1)
    space = dataclasses.replace(
        SMALL,
        micro_batches=(1,),
        schedules=("gpipe", "1f1b", "interleaved", "zb_h1", "dualpipev"),
        virtual_stages=(2,),
        zero_stages=(0, 1),
        recomputes=("none", "full"),
        tps=(1,),
        pps=(8,),
    )
    args = (h100x16, DEEP, training, ParallelConfig(dp=16))
    pruned = search_plans(*args, space=space, top_k=0, prune_keep=3)
    full = search_plans(*args, space=space, top_k=0, prune_keep=0)
    assert {r.candidate.schedule for r in full.ranked} == {
        "gpipe", "1f1b", "interleaved", "zb_h1", "dualpipev",
    }  # fmt: skip
    best = full.ranked[0]
    assert best.candidate.schedule == "dualpipev", best.candidate.label
    assert pruned.ranked[0].candidate == best.candidate
    assert pruned.estimated < full.estimated
    times = {
        r.candidate.schedule: r.estimate.step_time_s
        for r in reversed(full.ranked)
        if (r.candidate.zero, r.candidate.recompute) == (1, "none")
    }
    assert times["dualpipev"] < times["zb_h1"] < times["1f1b"]


def _moe_cp_space(large: bool) -> SearchSpace:
    """Expert- and context-parallel plans of SMALL_MOE on 16 GPUs (global batch 16): 1,782 that
    build (of 11,196 in the grid), or 27,090 with ``large`` (both CP algorithms)."""
    if large:
        return SearchSpace(
            cps=(1, 2, 4),
            cp_algorithms=("ring", "all_gather"),
            eps=(1, 2, 4, 8, 16),
            micro_batches=(1, 2),
            bucket_mbs=(25.0, 100.0),
            overlaps=(True, False),
            bucket_views=(False,),
            prefetches=(1, 2),
            offloads=(False,),
            reshards=(True, False),
        )
    return dataclasses.replace(
        SMALL, cps=(1, 2, 4), eps=(1, 2, 4, 16), micro_batches=(1,), zero_stages=(0, 1, 3)
    )


@pytest.mark.parametrize(
    "large",
    [False, pytest.param(True, marks=[pytest.mark.slow, pytest.mark.timeout(7200)])],
    ids=["1700", "27000"],
)
def test_pruning_expert_and_context_parallel_plans_keeps_the_best_ten(h100x16, large) -> None:
    # branch and bound over a space of expert- and context-parallel plans of a small MoE
    # model against estimating every one of them: the same ten best plans, in the same order
    # with the same estimates, and fewer estimated
    training = TrainingConfig(global_batch=16, micro_batch=1)
    space = _moe_cp_space(large)
    args = (h100x16, SMALL_MOE, training, ParallelConfig(dp=16))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        pruned = search_plans(*args, space=space, top_k=0, prune_keep=10, jobs=2)
        full = search_plans(*args, space=space, top_k=0, prune_keep=0, jobs=2)
    assert full.estimated == full.buildable
    assert full.buildable >= (20_000 if large else 1_500)
    kinds = Counter((r.candidate.cp > 1, r.candidate.ep > 1) for r in full.ranked)
    assert min(kinds.values()) > 0 and len(kinds) == 4  # dense, cp, ep and cp x ep all fit
    assert pruned.estimated < full.estimated / 2
    best = [(r.candidate, r.estimate.step_time_s) for r in full.ranked[:10]]
    assert [(r.candidate, r.estimate.step_time_s) for r in pruned.ranked[:10]] == best


def test_floors_hold_on_expert_and_context_parallel_plans_together(h100x16) -> None:
    # plans with both cp and ep (and every ZeRO stage of the space), each estimated: no
    # floor above what it bounds
    from collsim.study.search.bounds import Bounds

    training = TrainingConfig(global_batch=16, micro_batch=1)
    base = ParallelConfig(dp=16)
    plans = [
        p
        for p in enumerate_plans(SMALL_MOE, 16, 8, 16, _moe_cp_space(False), Counter(), base=base)
        if p.cp > 1 and p.ep > 1
    ]
    bounds = Bounds(h100x16, SMALL_MOE, training, base)
    estimator = Estimator(h100x16, SMALL_MOE)
    checked = 0
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for plan in _every_nth(plans, 40):
            try:
                est = estimator.estimate(*plan.configs(training, base))
            except ConfigError:
                continue
            step = bounds.refined_s(plan)
            assert bounds.step_s(plan) <= step <= est.step_time_s, plan.label
            assert bounds.memory_bytes(plan) <= est.memory_peak_bytes, plan.label
            checked += 1
    assert checked >= 20
