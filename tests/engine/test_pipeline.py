"""Pipeline schedules in the engine with communication priced at zero (Narayanan 2021).

With per-stage forward time t_f and backward time t_b and no communication, GPipe and 1F1B take
(m + p - 1)(t_f + t_b) and idle a share (p - 1)/(m + p - 1) of the step in the bubble;
interleaving v chunks per stage divides the bubble time by v. 1F1B keeps p micro-batches of
activations on stage 0, GPipe keeps m.
"""

from __future__ import annotations

import warnings

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from collsim.core.errors import CollsimWarning
from collsim.parallel.config import ParallelConfig, TrainingConfig
from collsim.parallel.pipeline import Phase, stage_schedule
from collsim.play.engine import simulate_step
from collsim.workload.memory import activation_bytes_per_layer
from collsim.workload.model import TransformerSpec
from collsim.workload.ops import embedding_ops

from .conftest import topology

LAYER_F, LAYER_B = 1e-3, 2e-3
NO_EDGES = {
    "layer.forward": LAYER_F,
    "layer.backward": LAYER_B,
    "layer.recompute": 0.0,
    "embedding.forward": 0.0,
    "embedding.backward": 0.0,
    "head.forward": 0.0,
    "head.backward": 0.0,
    "optimizer": 0.0,
}


def _step(spec, p: int, m: int, schedule: str, v: int = 1, overrides=NO_EDGES):
    dp = 8 // p
    return simulate_step(
        topology(),
        spec,
        TrainingConfig(global_batch=m * dp, micro_batch=1),
        ParallelConfig(tp=1, pp=p, dp=dp, schedule=schedule, virtual_stages=v),
        op_time_overrides=overrides,
        zero_communication=True,
    )


@pytest.mark.parametrize("schedule", ["gpipe", "1f1b"])
@pytest.mark.parametrize("p, m", [(2, 4), (4, 4), (4, 12), (8, 8)], ids=lambda x: str(x))
def test_step_and_bubble_share(small_spec, schedule: str, p: int, m: int) -> None:
    r = _step(small_spec, p, m, schedule)
    layers = small_spec.num_layers // p
    t_f, t_b = layers * LAYER_F, layers * LAYER_B
    assert r.step_time_s == pytest.approx((m + p - 1) * (t_f + t_b), rel=1e-9)
    assert r.breakdown_s["bubble"] / r.step_time_s == pytest.approx((p - 1) / (m + p - 1), rel=1e-9)
    assert r.breakdown_s["compute"] == pytest.approx(m * (t_f + t_b), rel=1e-9)
    assert r.breakdown_s["pp_exposed"] == 0.0


@pytest.mark.parametrize("v", [2, 4])
@pytest.mark.parametrize("p, m", [(2, 4), (4, 8)], ids=lambda x: str(x))
def test_interleaving_divides_bubble_by_v(small_spec, p: int, m: int, v: int) -> None:
    base = _step(small_spec, p, m, "1f1b")
    inter = _step(small_spec, p, m, "interleaved", v)
    assert inter.breakdown_s["bubble"] == pytest.approx(base.breakdown_s["bubble"] / v, rel=1e-9)
    assert inter.breakdown_s["compute"] == pytest.approx(base.breakdown_s["compute"], rel=1e-9)
    layers = small_spec.num_layers // p
    bubble = (p - 1) * layers * (LAYER_F + LAYER_B) / v  # (1/v)(p-1)(t_f + t_b)
    assert inter.breakdown_s["bubble"] == pytest.approx(bubble, rel=1e-9)


@pytest.mark.parametrize("schedule", ["1f1b", "gpipe"])
def test_activations_in_flight_on_stage_0(small_spec, schedule: str) -> None:
    p, m = 4, 12
    r = _step(small_spec, p, m, schedule)
    # one micro-batch through stage 0: the embedding's saved tensors + 4 layers (Korthikanti's
    # sbh(34 + 5as/h) each, from the workload's memory formulas, not from the engine)
    emb = sum(op.saved_bytes for op in embedding_ops(small_spec, micro_batch=1))
    layer = activation_bytes_per_layer(small_spec, micro_batch=1)
    per_mb = emb + (small_spec.num_layers // p) * layer
    in_flight = p if schedule == "1f1b" else m
    assert r.activation_peak_bytes_by_rank[0] == pytest.approx(in_flight * per_mb, rel=1e-12)


@settings(max_examples=25, deadline=None)
@given(
    p=st.sampled_from([1, 2, 4, 8]),
    m=st.integers(1, 12),
    schedule=st.sampled_from(["gpipe", "1f1b"]),
    t_f=st.floats(1e-4, 1e-2),
    ratio=st.floats(1.0, 3.0),
)
def test_bubble_share_property(p: int, m: int, schedule: str, t_f: float, ratio: float) -> None:
    spec = TransformerSpec(
        name="p", num_layers=8, hidden=256, num_heads=4, ffn_hidden=1024, seq_len=64, vocab=512
    )
    times = dict(NO_EDGES, **{"layer.forward": t_f, "layer.backward": ratio * t_f})
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", CollsimWarning)  # m < p: bubble warning
        r = _step(spec, p, m, schedule, overrides=times)
    per_stage = spec.num_layers // p * t_f * (1 + ratio)
    assert r.step_time_s == pytest.approx((m + p - 1) * per_stage, rel=1e-9)
    assert r.breakdown_s["bubble"] / r.step_time_s == pytest.approx(
        (p - 1) / (m + p - 1), rel=1e-9, abs=1e-12
    )


def test_interleaved_holds_more_in_flight_on_stage_0(small_spec) -> None:
    """Megatron's interleaved warm-up on stage 0 is (p - 1) * 2 + (v - 1) * p forwards; the
    next forward runs before the first backward frees anything, so warm-up + 1 chunk-forwards
    are in flight: with p = 4, v = 2, m = 8 that is 11, i.e. 5.5 micro-batches of a whole stage
    against 1F1B's 4. Order: F0-3.c0 F0-3.c1 F4.c0 F5.c0 | F6.c0 B0.c1 F7.c0 ...; the peak is
    after F7.c0: chunk 0 of micro-batches 0-7 (8 embeddings) and chunk 1 of 1-3."""
    p, v, m = 4, 2, 8
    r = _step(small_spec, p, m, "interleaved", v)
    emb = sum(op.saved_bytes for op in embedding_ops(small_spec, micro_batch=1))
    layer = activation_bytes_per_layer(small_spec, micro_batch=1)
    per_chunk = small_spec.num_layers // (p * v) * layer
    want = 11 * per_chunk + 8 * emb
    # the same peak replayed from the schedule alone: a forward keeps its chunk's activations
    # (chunk 0 also the embedding's), its backward frees them
    live = peak = 0.0
    for op in stage_schedule(
        "interleaved", num_stages=p, num_microbatches=m, stage=0, virtual_stages=v
    ):
        kept = per_chunk + (emb if op.chunk == 0 else 0.0)
        live += kept if op.phase is Phase.FORWARD else -kept
        peak = max(peak, live)
    assert peak == pytest.approx(want, rel=1e-12)
    assert r.activation_peak_bytes_by_rank[0] == pytest.approx(want, rel=1e-12)
    one_f_one_b = _step(small_spec, p, m, "1f1b").activation_peak_bytes_by_rank[0]
    assert r.activation_peak_bytes_by_rank[0] > one_f_one_b
