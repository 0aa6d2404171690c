"""FP8 amax reductions counted by hand: delayed scaling reduces one buffer per model chunk
and phase over a stage's tp x dp x cp ranks; current scaling reduces one amax per sequence-
parallel gather over TP; blockwise and MXFP8 reduce nothing."""

from __future__ import annotations

import warnings

import pytest

from collsim.cluster.topology import load_topology
from collsim.core.errors import CollsimWarning
from collsim.parallel.amax import (
    AMAX_HISTORY_LEN,
    AmaxPlan,
    amax_plan,
    history_update_bytes,
    tp_amax_reduce,
)
from collsim.parallel.config import ParallelConfig, TrainingConfig
from collsim.parallel.plan import build_plan
from collsim.workload import get_preset


def _plan(recipe: str | None, **par):  # type: ignore[no-untyped-def]
    spec = get_preset("llama3-8b", num_layers=8)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", CollsimWarning)
        return build_plan(
            load_topology("dgx_h100", nodes=2),
            spec,
            TrainingConfig(global_batch=64, micro_batch=1, dtype="fp8", fp8_recipe=recipe),
            ParallelConfig(**par),
            for_simulation=False,
        )


def test_delayed_scaling_one_reduction_per_chunk_and_phase() -> None:
    plan = _plan("delayed", tp=2, cp=2, pp=2, dp=2, sequence_parallel=True)
    a = amax_plan(plan, linears_per_layer=4, layers_per_chunk=4)
    (fwd,) = a.of("chunk", "forward")
    (bwd,) = a.of("chunk", "backward")
    # 4 linears x 4 layers = 16 GEMMs: 3 fp32 amaxes each forward (192 B), 2 backward (128 B)
    assert (fwd.size_bytes, bwd.size_bytes) == (192, 128)
    assert fwd.axis == bwd.axis == "tp_dp_cp"
    # the group is every rank of the stage: 2 x 2 x 2 = 8 of the 16
    group = plan.group_of(0, "tp_dp_cp")
    assert len(group) == 8 and all(plan.coords(r).pp == 0 for r in group)
    assert a.of("layer", "forward") == []
    # the history update: 48 forward histories of 1024 fp32, read and written, + 3 fp32 each
    assert a.update_bytes[0] == 48 * (2 * 1024 * 4 + 12)
    assert history_update_bytes(1, AMAX_HISTORY_LEN) == 8204


def test_current_scaling_reduces_over_tp_with_sequence_parallelism() -> None:
    assert tp_amax_reduce(_plan("tensorwise", tp=8, dp=2, sequence_parallel=True))
    assert tp_amax_reduce(_plan(None, tp=8, dp=2, sequence_parallel=True))  # None: tensorwise
    # without sequence parallelism nothing is gathered over TP, so nothing is reduced
    assert not tp_amax_reduce(_plan("tensorwise", tp=8, dp=2))
    assert not tp_amax_reduce(_plan("delayed", tp=8, dp=2, sequence_parallel=True))
    # and current scaling has no once-per-chunk reduction
    plan = _plan("tensorwise", tp=8, dp=2, sequence_parallel=True)
    assert amax_plan(plan, linears_per_layer=4, layers_per_chunk=32) == AmaxPlan()


def test_local_scales_reduce_nothing() -> None:
    for recipe in ("blockwise", "mxfp8"):
        a = amax_plan(
            _plan(recipe, tp=8, dp=2, sequence_parallel=True),
            linears_per_layer=4,
            layers_per_chunk=32,
        )
        assert not a.reductions and a.update_bytes == (0.0, 0.0)


def test_delayed_reductions_sit_at_each_chunk_end() -> None:
    from collsim.step.build import build_schedule

    spec = get_preset("llama3-8b", num_layers=8)
    topology = load_topology("dgx_h100", nodes=2)
    training = TrainingConfig(global_batch=8, micro_batch=1, dtype="fp8", fp8_recipe="delayed")
    parallel = ParallelConfig(
        tp=2, pp=2, dp=4, schedule="interleaved", virtual_stages=2, sequence_parallel=True
    )
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", CollsimWarning)
        sched = build_schedule(topology, spec, training, parallel)
    for stage in sched.stages.values():
        assert len(stage.chunks) == 2
        for chunk in stage.chunks:
            layers = list(chunk.layers)  # 2 layers per chunk, 4 FP8 linears each: 8 GEMMs
            calls = [
                (seg.key, st.size_bytes)
                for segs in (chunk.forward, chunk.backward)
                for seg in segs
                for st in seg.steps
                if st.axis == "tp_dp_cp"
            ]
            # forward: 8 x 3 amaxes after the last layer; backward: 8 x 2 after the first
            assert calls == [(layers[-1], 8 * 3 * 4), (layers[0], 8 * 2 * 4)]


@pytest.mark.parametrize("stack", ["torchtitan", "megatron_te"])
def test_current_scaling_amax_reductions_in_the_layer(stack: str) -> None:
    from collsim.step.build import build_schedule

    spec = get_preset("llama3-8b", num_layers=2)
    topology = load_topology("dgx_h100", nodes=2)
    training = TrainingConfig(global_batch=8, micro_batch=1, dtype="fp8", stack=stack)
    parallel = ParallelConfig(tp=2, dp=8, sequence_parallel=True)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", CollsimWarning)
        sched = build_schedule(topology, spec, training, parallel)
    chunk = sched.stages[0].chunks[0]
    fwd = next(s for s in chunk.forward if s.key == 0)
    bwd = next(s for s in chunk.backward if s.key == 0)

    def amax(seg):  # type: ignore[no-untyped-def]
        return [st for st in seg.steps if st.op == "all_reduce" and st.size_bytes == 4]

    # before the QKV and MLP-up gathers; before the out-proj and MLP-down gradient gathers
    assert len(amax(fwd)) == 2 and len(amax(bwd)) == 2
