"""A search's estimator reuses what it priced (op tables per pipeline shape, blocks, segment
plans, bucket prices) across plans and within a walk: each plan's estimate is the very result
of a fresh ``estimate_step``, whatever plans came before it."""

from __future__ import annotations

import dataclasses
import warnings
from operator import attrgetter
from typing import Any

import pytest

import collsim.play.walk as walk_module
import collsim.play.walk_pipe as walk_pipe
import collsim.step.stage as stage_module
from collsim.cluster.topology import load_topology
from collsim.core.errors import CollsimWarning
from collsim.parallel.config import DDPConfig, FSDPConfig, ParallelConfig, TrainingConfig
from collsim.play.walk import Estimator, estimate_step, walk
from collsim.step.build import StepSchedule, build_schedule, ddp_variant, layer_kind_of
from collsim.step.pricing import ClosedPricer
from collsim.step.result import StepResult
from collsim.step.shapes import ShapeCache
from collsim.workload import get_preset
from tests.schedule.helpers import float_bits, plan16


def _plans() -> list[tuple[TrainingConfig, ParallelConfig]]:
    out = []
    for zero, pp, schedule, overlap in [
        (1, 4, "interleaved", True),
        (0, 2, "1f1b", False),
        (2, 1, "1f1b", True),
        (2, 1, "1f1b", False),
        (3, 1, "1f1b", True),
        (1, 4, "interleaved", False),
        (1, 2, "gpipe", True),
    ]:
        m = 2 * pp if schedule == "interleaved" else 4
        ddp = DDPConfig(bucket_mb=5.0, overlap=overlap)
        out.append(plan16(pp, schedule, zero, m, ddp=ddp, fsdp=FSDPConfig(prefetch=1)))
    return out


def _facts(r: StepResult) -> tuple[object, ...]:
    """What an estimate says, floats by their bits (:func:`float_bits`)."""
    return float_bits(
        (
            r.step_time_s,
            dict(r.breakdown_s.items()),
            r.memory_peak_bytes,
            r.memory_bytes,
            r.activation_peak_bytes_by_rank,
            r.memory_peak_bytes_by_rank,
            [
                (c.axis, c.op, c.size_bytes, c.count, c.time_s, c.algorithm, c.busbw_bps)
                for c in r.collectives
            ],
            r.critical_rank,
            r.stage_end_s,
            r.breakdown_by_stage_s,
            r.fits,
            r.mfu,
            r.mapping,
        )
    )


INTERLEAVED_GRID: dict[str, Any] = {
    "tp": 2,
    "pp": 4,
    "dp": 2,
    "schedule": "interleaved",
    "virtual_stages": 2,
}
"""16 GPUs: tp 2 x pp 4 (two chunks a stage, interleaved) x dp 2."""


CUTS = attrgetter("bucket_mb", "first_bucket_mb")
"""What a DDP config's buckets are cut by."""


def _interleaved(zero: int, ddp: DDPConfig, sequence_parallel: bool = False) -> ParallelConfig:
    return ParallelConfig(
        **INTERLEAVED_GRID, sequence_parallel=sequence_parallel, zero=zero, ddp=ddp
    )


def test_estimates_across_plans_equal_fresh_walks() -> None:
    spec = get_preset("gpt3-350m")
    topology = load_topology("dgx_h100", nodes=2)
    plans = _plans()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", CollsimWarning)
        fresh = [_facts(estimate_step(topology, spec, *p)) for p in plans]
        est = Estimator(topology, spec)
        for _ in range(2):  # the second round reads every cache the first one filled
            for plan, expected in zip(plans, fresh, strict=True):
                assert _facts(est.estimate(*plan)) == expected, plan[1]


def test_plans_that_differ_in_buckets_share_one_pipeline_trace() -> None:
    spec = get_preset("gpt3-350m")
    topology = load_topology("dgx_h100", nodes=2)
    training = TrainingConfig(global_batch=16, micro_batch=1, recompute="selective")
    plans = [
        (
            training,
            _interleaved(zero, DDPConfig(bucket_mb=bucket_mb, overlap=overlap), sequence_parallel),
        )
        for sequence_parallel in (True, False)
        for zero in (1, 2)
        for bucket_mb, overlap in [(1.0, True), (5.0, True), (25.0, True), (5.0, False)]
    ]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", CollsimWarning)
        fresh = [_facts(estimate_step(topology, spec, *p)) for p in plans]
        est = Estimator(topology, spec)
        for plan, expected in zip(plans, fresh, strict=True):
            assert _facts(est.estimate(*plan)) == expected, plan[1]
    # one trace per sequence-parallel choice (a folded gather); the buckets and ZeRO-1/2
    # change only the dp stream
    assert est.shapes.sizes()["walk pipeline"] == 2


def test_plans_with_the_same_memory_events_share_their_peaks() -> None:
    # ZeRO-1 plans that differ only in their buckets record the same memory events on each
    # stage: the first plan's peaks serve the others. DDP with and without bucket views holds
    # other state bytes, and ZeRO-2 adds the reductions' buffers: those work theirs out.
    # Every estimate is a fresh walk's.
    spec = get_preset("gpt3-350m")
    topology = load_topology("dgx_h100", nodes=2)
    training = TrainingConfig(global_batch=16, micro_batch=1, recompute="selective")

    def plan(zero: int, bucket_mb: float, view: bool = False) -> ParallelConfig:
        return _interleaved(zero, DDPConfig(bucket_mb=bucket_mb, gradient_as_bucket_view=view))

    est = Estimator(topology, spec)
    counts = []
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", CollsimWarning)
        for parallel in [
            plan(1, 1.0),
            plan(1, 5.0),
            plan(1, 25.0),
            plan(0, 5.0),
            plan(0, 5.0, view=True),
            plan(2, 5.0),
        ]:
            expected = _facts(estimate_step(topology, spec, training, parallel))
            assert _facts(est.estimate(training, parallel)) == expected, parallel
            counts.append(est.shapes.sizes().get("walk peaks", 0))
    # 4 stages a plan: the ZeRO-1 plans share theirs, DDP without and with bucket views adds
    # 4 each, ZeRO-2 none
    assert counts == [4, 4, 4, 8, 12, 12]


def test_ddp_variants_that_alternate_bucket_views_keep_both_placements() -> None:
    # DDP variants with and without bucket views record one state allocation more or less
    # before the traced events: each rank keeps the placement of its patterns for both, so
    # the third and fourth variants make none; every estimate is a fresh walk's
    spec = get_preset("gpt3-350m")
    topology = load_topology("dgx_h100", nodes=2)
    training = TrainingConfig(global_batch=16, micro_batch=1, recompute="selective")
    plans = [
        (training, _interleaved(0, DDPConfig(bucket_mb=mb, gradient_as_bucket_view=view)))
        for mb in (5.0, 25.0)
        for view in (False, True)
    ]
    made: list[int] = []
    original = walk_pipe.placed_ops

    def counting(*args: Any) -> Any:
        made.append(1)
        return original(*args)

    with warnings.catch_warnings():
        warnings.simplefilter("ignore", CollsimWarning)
        fresh = [_facts(estimate_step(topology, spec, *p)) for p in plans]
        est = Estimator(topology, spec)
        walk_pipe.placed_ops = counting  # type: ignore[assignment]
        try:
            per_plan = []
            for plan, expected in zip(plans, fresh, strict=True):
                before = len(made)
                assert _facts(est.estimate(*plan)) == expected, plan[1]
                per_plan.append(len(made) - before)
        finally:
            walk_pipe.placed_ops = original  # type: ignore[assignment]
    assert per_plan == [4, 4, 0, 0]  # 4 stages


def test_a_programs_first_ddp_variant_reads_the_chunks_its_stages_were_built_from() -> None:
    # build_stage leaves each stage's chunk entries in the cache: rebucket_stage finds them
    spec = get_preset("gpt3-350m")
    topology = load_topology("dgx_h100", nodes=2)
    training = TrainingConfig(global_batch=16, micro_batch=1, recompute="selective")
    parallel = _interleaved(1, DDPConfig(bucket_mb=5.0))
    cache = ShapeCache()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", CollsimWarning)
        schedule = build_schedule(topology, spec, training, parallel, cache=cache)
    assert cache.sizes()["stage chunks"] == 4
    calls: list[int] = []
    original = stage_module._chunk_entry

    def counting(*args: Any, **kwargs: Any) -> Any:
        calls.append(1)
        return original(*args, **kwargs)

    stage_module._chunk_entry = counting  # type: ignore[assignment]
    try:
        variant = ddp_variant(
            schedule, dataclasses.replace(parallel, ddp=DDPConfig(bucket_mb=25.0)), cache
        )
    finally:
        stage_module._chunk_entry = original  # type: ignore[assignment]
    assert calls == [] and cache.sizes()["stage chunks"] == 4
    fresh = build_schedule(
        topology, spec, training, dataclasses.replace(parallel, ddp=DDPConfig(bucket_mb=25.0))
    )
    assert [[list(c.buckets) for c in st.chunks] for st in variant.stages.values()] == [
        [list(c.buckets) for c in st.chunks] for st in fresh.stages.values()
    ]


def test_recent_keeps_the_newest_entries() -> None:
    cache = ShapeCache()
    made: list[int] = []
    for key in [1, 2, 3, 1, 4]:
        cache.recent("t", key, lambda key=key: made.append(key) or key, 3)
    assert made == [1, 2, 3, 4] and cache.sizes() == {"t": 3}
    assert cache.recent("t", 1, lambda: -1, 3) == -1  # 1 was the oldest when 4 came
    # an entry ``valid`` refuses is made again in its place, the others found
    assert cache.recent("t", 4, lambda: 40, 3, valid=lambda v: v != 4) == 40
    assert cache.recent("t", 4, lambda: -4, 3, valid=lambda v: v != 4) == 40
    assert cache.sizes() == {"t": 3}


def _program(schedule: StepSchedule) -> tuple[object, ...]:
    """What a program holds, by value (the segments compared by what they hold)."""
    return (
        schedule.plan.parallel,
        {
            s: [
                (c.index, c.layers, c.buckets, c.units, c.forward, c.backward) for c in stage.chunks
            ]
            for s, stage in schedule.stages.items()
        },
        schedule.pipeline,
        schedule.dp,
        schedule.optimizer_s,
        schedule.framework_step_s,
        schedule.interference,
        schedule.memory_bound_share,
        schedule.paired,
        schedule.p2p_bytes,
    )


@pytest.mark.parametrize("zero", [0, 1, 2, 3])
def test_a_ddp_variant_is_the_program_built_anew(zero: int) -> None:
    spec = get_preset("gpt3-350m")
    topology = load_topology("dgx_h100", nodes=2)
    training = TrainingConfig(global_batch=16, micro_batch=1, recompute="selective")
    base = _interleaved(zero, DDPConfig(bucket_mb=25.0, overlap=True))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", CollsimWarning)
        schedule = build_schedule(topology, spec, training, base)
        for ddp in [
            DDPConfig(bucket_mb=1.0, overlap=True),
            DDPConfig(bucket_mb=5.0, first_bucket_mb=2.0, overlap=False),
            DDPConfig(bucket_mb=25.0, gradient_as_bucket_view=True),
        ]:
            parallel = dataclasses.replace(base, ddp=ddp)
            variant = ddp_variant(schedule, parallel)
            fresh = build_schedule(topology, spec, training, parallel)
            assert _program(variant) == _program(fresh)
            assert variant.plan == fresh.plan  # checked once per program (dp_variant_plan)
            if CUTS(ddp) == CUTS(base.ddp):
                assert variant.stages is schedule.stages  # the same cuts: the base's stages
                continue
            # the segments are the base's own objects, the chunks new
            chunk, old = variant.stages[1].chunks[0], schedule.stages[1].chunks[0]
            assert chunk is not old and chunk.forward is old.forward
            # its data-parallel rules the base's with the knobs replaced, their tables its own
            assert variant.dp._bucket_calls is not schedule.dp._bucket_calls
        if zero == 3:  # the prefetch depth: the data-parallel rules' own knob
            for prefetch in (0, 2):
                fsdp = dataclasses.replace(base.fsdp, prefetch=prefetch)
                parallel = dataclasses.replace(base, fsdp=fsdp)
                variant = ddp_variant(schedule, parallel)
                fresh = build_schedule(topology, spec, training, parallel)
                assert _program(variant) == _program(fresh)
                assert variant.plan == fresh.plan
                assert variant.dp.prefetch == prefetch
        with pytest.raises(ValueError, match="DDP knobs"):
            ddp_variant(schedule, dataclasses.replace(base, zero=(zero + 1) % 4))
        with pytest.raises(ValueError, match="DDP knobs"):
            fsdp = dataclasses.replace(base.fsdp, reshard_after_forward=False)
            ddp_variant(schedule, dataclasses.replace(base, fsdp=fsdp))


def test_ddp_variants_reuse_the_stages_cut_for_their_bucket_sizes() -> None:
    # with a cache, a variant whose bucket sizes an earlier variant of the program cut (the
    # search's second pass over the bucket sizes, with the other overlap) gets those stages;
    # another build of the program (other segments) has its own cut
    spec = get_preset("gpt3-350m")
    topology = load_topology("dgx_h100", nodes=2)
    training = TrainingConfig(global_batch=16, micro_batch=1, recompute="selective")
    base = _interleaved(1, DDPConfig(bucket_mb=25.0, overlap=True))
    cache = ShapeCache()

    def variant_of(schedule: StepSchedule, bucket_mb: float, overlap: bool) -> StepSchedule:
        parallel = dataclasses.replace(base, ddp=DDPConfig(bucket_mb=bucket_mb, overlap=overlap))
        out = ddp_variant(schedule, parallel, cache)
        assert _program(out) == _program(build_schedule(topology, spec, training, parallel))
        return out

    with warnings.catch_warnings():
        warnings.simplefilter("ignore", CollsimWarning)
        schedule = build_schedule(topology, spec, training, base, cache=cache)
        five = variant_of(schedule, 5.0, True)
        assert five.stages[1].chunks[0] is not schedule.stages[1].chunks[0]
        again = variant_of(five, 25.0, False)
        assert again.stages is schedule.stages
        assert variant_of(again, 5.0, False).stages is five.stages
        other = build_schedule(topology, spec, training, base)  # no cache: its own segments
        assert other.stages[1].chunks[0].forward is not schedule.stages[1].chunks[0].forward
        mine = variant_of(other, 5.0, True)
        assert mine.stages is not five.stages
        assert mine.stages[1].chunks[0].forward is other.stages[1].chunks[0].forward
        assert variant_of(variant_of(mine, 25.0, False), 5.0, False).stages is mine.stages


def test_an_estimator_keeps_the_programs_a_search_comes_back_to() -> None:
    # six programs estimated in turn, then each again with its other overlap (a search's
    # outer DDP knob): each program built once, its variants made from it
    spec = get_preset("gpt3-350m")
    topology = load_topology("dgx_h100", nodes=2)
    training = TrainingConfig(global_batch=16, micro_batch=1, recompute="selective")
    plans = [
        (training, _interleaved(zero, DDPConfig(bucket_mb=5.0, overlap=overlap), sp))
        for overlap in (True, False)
        for zero in (0, 1, 2)
        for sp in (True, False)
    ]
    est, fresh, estimates, built = _fresh_and_estimated(topology, spec, plans)
    assert estimates == fresh
    assert built == 6 and est.shapes.sizes()["shared walks"] == 6


def _fresh_and_estimated(
    topology: Any, spec: Any, plans: list[tuple[TrainingConfig, ParallelConfig]]
) -> tuple[Estimator, list[object], list[object], int]:
    """(an Estimator, each plan's fresh estimate, its estimate by that Estimator in order, how
    many programs the Estimator built anew)."""
    est = Estimator(topology, spec)
    built = []
    original = walk_module.build_schedule

    def counting(*args: Any, **kwargs: Any) -> StepSchedule:
        built.append(1)
        return original(*args, **kwargs)

    with warnings.catch_warnings():
        warnings.simplefilter("ignore", CollsimWarning)
        fresh = [_facts(estimate_step(topology, spec, *plan)) for plan in plans]
        walk_module.build_schedule = counting  # type: ignore[assignment]
        try:
            estimates = [_facts(est.estimate(*plan)) for plan in plans]
        finally:
            walk_module.build_schedule = original  # type: ignore[assignment]
    return est, fresh, estimates, len(built)


def test_an_estimator_builds_a_plans_ddp_variants_from_it() -> None:
    # a run of plans that differ only in their DDP knobs: one program built, the others made
    # from it, their op bodies priced once (one family in the cache); each estimate a fresh
    # walk's
    spec = get_preset("gpt3-350m")
    topology = load_topology("dgx_h100", nodes=2)
    training = TrainingConfig(global_batch=16, micro_batch=1, recompute="selective")
    plans = [
        _interleaved(2, DDPConfig(bucket_mb=bucket_mb, overlap=overlap))
        for bucket_mb, overlap in [(1.0, True), (5.0, True), (25.0, False)]
    ]
    est, fresh, estimates, built = _fresh_and_estimated(
        topology, spec, [(training, p) for p in plans]
    )
    assert estimates == fresh
    assert built == 1 and est.shapes.sizes()["shared walks"] == 1


@pytest.mark.parametrize(("raf", "sync"), [(False, "step"), (True, "microbatch")])
def test_fsdp_prefetch_variants_share_a_program_and_estimate_as_fresh_walks(
    raf: bool, sync: str
) -> None:
    # ZeRO-3 plans that differ only in how far ahead they gather (and their buckets), in a
    # search's order (the recompute choice innermost, so a plan's variant is two plans back):
    # one program built per recompute choice, the others made from it (the prefetch depth is
    # read by the data-parallel rules alone), the settled blocks worked out once, a depth's
    # issue plans read again by a later variant of that depth; each estimate a fresh walk's,
    # bit for bit, whether the units stay gathered (most ops settle) or not
    spec = get_preset("gpt3-350m")
    topology = load_topology("dgx_h100", nodes=2)
    plans = [
        (
            TrainingConfig(global_batch=16, micro_batch=1, recompute=recompute),
            dataclasses.replace(
                _interleaved(3, DDPConfig(bucket_mb=bucket_mb)),
                fsdp=FSDPConfig(prefetch=prefetch, reshard_after_forward=raf, grad_sync=sync),
            ),
        )
        for prefetch, bucket_mb in [(4, 25.0), (2, 25.0), (1, 5.0), (0, 5.0), (2, 10.0)]
        for recompute in ("none", "selective")
    ]
    est, fresh, estimates, built = _fresh_and_estimated(topology, spec, plans)
    assert estimates == fresh
    assert built == 2 and est.shapes.sizes()["shared walks"] == 2
    if raf:  # regathered every forward: the prefetch depth shows in the step
        assert len({f[0] for f in fresh}) > 2


MOE = get_preset("qwen3-30b-a3b", num_layers=4, seq_len=1024)


@pytest.mark.parametrize(
    ("schedule", "pp", "zero", "dtype", "ep_overlap"),
    [
        ("1f1b", 1, 1, "fp8", True),
        ("zb_h1", 2, 2, "bf16", False),
        ("dualpipev", 2, 0, "fp8", True),
        ("interleaved", 2, 2, "bf16", True),
    ],
)
def test_moe_ddp_variants_estimate_as_fresh_walks(
    schedule: str, pp: int, zero: int, dtype: str, ep_overlap: bool
) -> None:
    # expert and dense buckets, FP8 copies, paired (EP overlap) and split-backward segments:
    # each DDP variant built from the plan before it estimates as a fresh walk, every field
    topology = load_topology("dgx_h100", nodes=2)
    v = 2 if schedule == "interleaved" else 1
    training = TrainingConfig(global_batch=32, micro_batch=1, dtype=dtype)
    plans = [
        ParallelConfig(
            tp=1,
            pp=pp,
            dp=16 // pp,
            ep=8 // pp,
            schedule=schedule,
            virtual_stages=v,
            zero=zero,
            ep_overlap=ep_overlap,
            ddp=DDPConfig(bucket_mb=bucket_mb, overlap=overlap),
        )
        for bucket_mb, overlap in [(25.0, True), (1.0, True), (5.0, False), (400.0, True)]
    ]
    est = Estimator(topology, MOE)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", CollsimWarning)
        fresh = [_facts(estimate_step(topology, MOE, training, p)) for p in plans]
        estimates = [_facts(est.estimate(training, p)) for p in plans]
    assert estimates == fresh
    assert est.shapes.sizes()["shared walks"] == 1  # one program, three variants of it


def test_walks_through_one_cache_with_two_pricers_are_each_their_own() -> None:
    # the tables the walks of a program share hold prices: a walk by another pricer (here
    # one that prices communication at zero) through the same cache makes its own
    spec = get_preset("gpt3-350m")
    topology = load_topology("dgx_h100", nodes=2)
    training = TrainingConfig(global_batch=16, micro_batch=1, recompute="selective")
    shapes = ShapeCache()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", CollsimWarning)
        for zero in (0, 2, 3):
            parallel = _interleaved(zero, DDPConfig(bucket_mb=5.0))
            schedule = build_schedule(topology, spec, training, parallel, cache=shapes)
            for zero_comm in (False, True, False):
                pricer = ClosedPricer(topology, zero=zero_comm)
                got = walk(schedule, pricer, timeline=False, shapes=shapes)
                fresh = estimate_step(
                    topology, spec, training, parallel, zero_communication=zero_comm
                )
                assert _facts(got) == _facts(fresh), (zero, zero_comm)


def test_a_ddp_variant_of_a_program_with_measured_times_keeps_them() -> None:
    # measured op times stand in for the compute: the variant's DP calls slow nothing either
    spec = get_preset("gpt3-350m")
    topology = load_topology("dgx_h100", nodes=2)
    training = TrainingConfig(global_batch=16, micro_batch=1, recompute="selective")
    overrides = {"optimizer": 0.01}
    base = _interleaved(1, DDPConfig(bucket_mb=25.0, overlap=True))
    parallel = dataclasses.replace(base, ddp=DDPConfig(bucket_mb=5.0, overlap=True))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", CollsimWarning)
        schedule = build_schedule(topology, spec, training, base, op_time_overrides=overrides)
        variant = ddp_variant(schedule, parallel)
        fresh = build_schedule(topology, spec, training, parallel, op_time_overrides=overrides)
    assert _program(variant) == _program(fresh) and not variant.interference


def test_layer_kinds_are_kept_per_model_and_read_only() -> None:
    """``layer_kind_of`` keeps each model's table by the model's identity: a model of the same name
    with other layer kinds (windowed attention every other layer) gets its own table, the
    same model the kept one, which cannot be written."""
    dense = get_preset("gpt3-1.3b")
    windowed = dataclasses.replace(
        dense, sliding_window=512, sliding_window_layers=tuple(range(0, dense.num_layers, 2))
    )
    kinds = layer_kind_of(dense)
    assert set(kinds.values()) == {0} and len(kinds) == dense.num_layers
    assert layer_kind_of(dense) is kinds
    other = layer_kind_of(windowed)
    assert len(set(other.values())) == 2
    assert set(layer_kind_of(dense).values()) == {0}
    with pytest.raises(TypeError):
        kinds[0] = 1  # type: ignore[index]
