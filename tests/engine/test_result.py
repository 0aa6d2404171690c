"""Every StepResult field is filled and consistent; trace events; overrides; errors."""

from __future__ import annotations

import json

import pytest

from collsim.core.errors import ConfigError
from collsim.parallel.config import ParallelConfig, TrainingConfig
from collsim.play.engine import simulate_step
from collsim.step.result import BREAKDOWN_KEYS, MEMORY_KEYS

from .conftest import topology

TR = TrainingConfig(global_batch=32, micro_batch=2, recompute="selective")
PAR = ParallelConfig(tp=2, pp=2, dp=4, zero=1, schedule="interleaved", virtual_stages=2)


@pytest.fixture(scope="module")
def result():
    from .conftest import TransformerSpec

    spec = TransformerSpec(
        name="small",
        num_layers=16,
        hidden=512,
        num_heads=8,
        ffn_hidden=2048,
        seq_len=256,
        vocab=4096,
    )
    return spec, simulate_step(topology(nodes=2), spec, TR, PAR, trace=True)


def test_fields_are_filled_and_consistent(result) -> None:
    spec, r = result
    assert r.step_time_s > 0 and r.num_gpus == 16
    assert set(r.breakdown_s) == set(BREAKDOWN_KEYS)
    assert sum(r.breakdown_s.values()) == pytest.approx(r.step_time_s, rel=1e-12)
    assert min(r.breakdown_s.values()) >= 0
    for key in ("compute", "tp_exposed", "bubble", "optimizer"):
        assert r.breakdown_s[key] > 0
    assert r.tokens_per_s == pytest.approx(32 * spec.seq_len / r.step_time_s)
    peak = topology().device.peak_flops_for("bf16")
    assert r.mfu == pytest.approx(r.model_tflops_per_gpu * 1e12 / peak)
    assert r.hfu == pytest.approx(r.hardware_tflops_per_gpu * 1e12 / peak)
    assert r.hardware_tflops_per_gpu > r.model_tflops_per_gpu > 0  # selective recompute
    assert set(r.memory_bytes) == set(MEMORY_KEYS) and r.fits
    assert {c.axis for c in r.collectives} == {"tp", "pp", "dp"}
    for c in r.collectives:
        assert c.count > 0 and c.size_bytes > 0 and c.time_s > 0 and c.busbw_bps > 0
        assert c.algorithm
    tp_calls = sum(c.count for c in r.collectives if c.axis == "tp")
    # per layer and micro-batch: 2 all-reduces forward, 2 backward (selective: no TP in the
    # recompute); 8 layers per stage, 32 / (2 x 4) = 4 micro-batches, plus one call per
    # micro-batch for the embedding (stage 0) or the LM head backward (stage 1); averaged over
    # the two stages, as both issue calls of that kind
    m, v = 4, 2
    layer_and_ends = 8 * 4 * m + m
    # the vocab-parallel loss: 3 small all-reduces per micro-batch, on the last stage only
    loss = 3 * m
    # pipeline scatter/gather: every received message is all-gathered over TP; each stage
    # runs 2 m v ops, of which m read nothing remote (stage 0's first-chunk forwards, the
    # last stage's last-chunk backwards); averaged over the two stages
    gathers = 2 * m * v - m
    assert tp_calls == layer_and_ends + loss + gathers
    assert "tp groups: 8 of 2" in r.mapping
    # one rank per stage: pp outermost (the default order), stage 1 starts at tp x dp = 8
    assert sorted(r.memory_timeline) == sorted(r.simulated_ranks) == [0, 8]
    json.dumps(r.to_dict())


def test_trace_has_one_event_per_op(result) -> None:
    _, r = result
    m, v = 4, 2
    for rank in (0, 8):  # the representatives of the two stages (pp outermost)
        ops = [
            e
            for e in r.trace_events
            if e.rank == rank and e.stream == "compute" and e.name[0] in "FB"
        ]
        assert len(ops) == 2 * m * v
        assert all(e.end_s > e.start_s for e in ops)
        starts = [e.start_s for e in ops]
        assert starts == sorted(starts)
        for a, b in zip(ops, ops[1:]):  # one compute stream: no overlap
            assert b.start_s >= a.end_s - 1e-12
    streams = {e.stream for e in r.trace_events}
    assert {"compute", "pp", "dp"} <= streams
    assert max(e.end_s for e in r.trace_events) == pytest.approx(r.step_time_s)


def test_no_trace_by_default(small_spec) -> None:
    r = simulate_step(topology(), small_spec, TrainingConfig(global_batch=8), ParallelConfig(dp=8))
    assert r.trace_events == []


def test_op_time_overrides(small_spec) -> None:
    tr, par = TrainingConfig(global_batch=8), ParallelConfig(dp=8)
    base = simulate_step(topology(), small_spec, tr, par)
    slow = simulate_step(topology(), small_spec, tr, par, op_time_overrides={"qkv_proj": 1e-3})
    # one extra millisecond forward per layer (16 layers, one micro-batch)
    assert slow.breakdown_s["compute"] > base.breakdown_s["compute"] + 16 * 0.9e-3
    fixed = simulate_step(
        topology(),
        small_spec,
        tr,
        par,
        op_time_overrides={"layer.forward": 1e-3, "layer.backward": 2e-3, "optimizer": 5e-3},
    )
    assert fixed.breakdown_s["optimizer"] == pytest.approx(5e-3, rel=1e-9)
    with pytest.raises(ConfigError):
        simulate_step(topology(), small_spec, tr, par, op_time_overrides={"no_such_op": 1.0})
    with pytest.raises(ConfigError, match="fidelity"):
        simulate_step(topology(), small_spec, tr, par, fidelity="exact")


def test_plan_errors_surface(small_spec) -> None:
    with pytest.raises(ConfigError) as info:
        simulate_step(
            topology(), small_spec, TrainingConfig(global_batch=8), ParallelConfig(tp=2, dp=2)
        )
    assert info.value.key_path == "parallel"


def test_breakdown_is_a_record_whose_parts_sum_to_the_step(result) -> None:
    from collsim.step.result import Breakdown

    _, r = result
    parts = r.breakdown_s
    assert isinstance(parts, Breakdown)
    assert parts.total_s == pytest.approx(r.step_time_s, rel=1e-12)
    assert parts.compute == parts["compute"] > 0 and list(parts) == list(BREAKDOWN_KEYS)
    # the typed fields are what --json writes under details
    assert r.details["critical_rank"] == r.critical_rank in r.simulated_ranks
    assert r.details["num_microbatches"] == r.num_microbatches == 32 // (2 * 4)
    assert r.stragglers is None and r.contention is None and "stragglers" not in r.details
    # the stage of each simulated rank, as the plan places it (pp outermost: 8 ranks a stage)
    assert r.rank_stages == {0: 0, 8: 1}
