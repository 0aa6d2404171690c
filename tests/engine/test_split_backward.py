"""ZB-H1 and DualPipeV in the engine and the closed form: the bubble of ZB-H1 against its
paper's formula and against 1F1B at equal micro-batches (op times set, communication free),
the closed form equal to the DES (step within 1 %, peak memory exact) on several plans, and
the weight-gradient ops carrying what a backward carries (compute, frees, gradient buckets)."""

from __future__ import annotations

import warnings

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from collsim.cluster.topology import load_topology
from collsim.core.errors import CollsimWarning
from collsim.parallel.config import DDPConfig, FSDPConfig, ParallelConfig, TrainingConfig
from collsim.play.engine import simulate_step
from collsim.play.walk import estimate_step
from collsim.step import build_schedule
from collsim.workload import get_preset
from collsim.workload.kernels import slowest_gpu_factor
from collsim.workload.memory import activation_bytes_per_layer
from collsim.workload.ops import head_ops, layer_ops

from .conftest import topology

LAYER_F, LAYER_B, LAYER_W = 1e-3, 3e-3, 1e-3
TIMES = {
    "layer.forward": LAYER_F,
    "layer.backward": LAYER_B,
    "layer.wgrad": LAYER_W,
    "layer.recompute": 0.0,
    "embedding.forward": 0.0,
    "embedding.backward": 0.0,
    "head.forward": 0.0,
    "head.backward": 0.0,
    "optimizer": 0.0,
}


def _run(spec, p: int, m: int, schedule: str, fidelity: str = "fused"):
    dp = 8 // p
    args = (
        topology(),
        spec,
        TrainingConfig(global_batch=m * dp, micro_batch=1),
        ParallelConfig(tp=1, pp=p, dp=dp, schedule=schedule),
    )
    kw = dict(op_time_overrides=TIMES, zero_communication=True)
    if fidelity == "closed":
        return estimate_step(*args, **kw)
    return simulate_step(*args, fidelity=fidelity, **kw)


@pytest.mark.parametrize("fidelity", ["closed", "fused", "layer"])
@pytest.mark.parametrize(("p", "m"), [(2, 4), (4, 8), (4, 4), (8, 16)], ids=str)
def test_zb_h1_bubble_by_hand(small_spec, p: int, m: int, fidelity: str) -> None:
    # per stage (16 layers / p): T_F = n 1 ms, T_I = n (3 - 1) ms, T_W = n 1 ms (T_W <= T_F).
    # Qi et al. 2024, section 2.1: 1F1B idles (p - 1)(T_F + T_B + T_W) with T_B + T_W the
    # whole backward; ZB-H1 (p - 1)(T_F + T_B - T_W), T_B the input gradient alone
    n = small_spec.num_layers // p
    t_f, t_i, t_w = n * LAYER_F, n * (LAYER_B - LAYER_W), n * LAYER_W
    ideal = m * (t_f + t_i + t_w)
    one = _run(small_spec, p, m, "1f1b", fidelity)
    zb = _run(small_spec, p, m, "zb_h1", fidelity)
    assert one.step_time_s == pytest.approx(ideal + (p - 1) * (t_f + t_i + t_w), rel=1e-9)
    assert zb.step_time_s == pytest.approx(ideal + (p - 1) * (t_f + t_i - t_w), rel=1e-9)
    # the same work, less idle: on p = 4, m = 8, 88 ms against 76 ms
    assert zb.breakdown_s["compute"] == pytest.approx(one.breakdown_s["compute"], rel=1e-9)
    assert zb.breakdown_s["compute"] == pytest.approx(ideal, rel=1e-9)
    saved = one.breakdown_s["bubble"] - zb.breakdown_s["bubble"]
    assert saved == pytest.approx(2 * (p - 1) * t_w, rel=1e-9)


def test_zb_h1_keeps_1f1b_activation_peak_on_the_first_stage(small_spec) -> None:
    # every stage holds p micro-batches from forward to W: the first stage's 1F1B peak (the
    # paper's claim, for stages of equal activations); the last stage holds p micro-batches
    # of its layers and head where 1F1B holds one, so with a head heavier than the embedding
    # (fp32 logits) the GPU peak is the last stage's, above 1F1B's
    p, m = 4, 12
    one = _run(small_spec, p, m, "1f1b")
    zb = _run(small_spec, p, m, "zb_h1")
    peaks_1f1b = one.details["activation_peak_bytes_by_rank"]
    peaks_zb = zb.details["activation_peak_bytes_by_rank"]
    first, last = min(peaks_zb), max(peaks_zb)
    assert peaks_zb[first] == pytest.approx(peaks_1f1b[first], rel=1e-12)
    # one micro-batch through the last stage: its 4 layers (Korthikanti's sbh(34 + 5as/h)
    # each) and the head's saved tensors, from the workload's formulas
    head = sum(op.saved_bytes for op in head_ops(small_spec, micro_batch=1))
    per_mb = (small_spec.num_layers // p) * activation_bytes_per_layer(small_spec, micro_batch=1)
    assert peaks_zb[last] == pytest.approx(p * (per_mb + head), rel=1e-12)
    assert peaks_1f1b[last] < peaks_zb[last]


def _agree(topo, spec, training, parallel) -> None:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", CollsimWarning)
        des = simulate_step(topo, spec, training, parallel, fidelity="fused")
        closed = estimate_step(topo, spec, training, parallel)
    assert closed.step_time_s == pytest.approx(des.step_time_s, rel=0.01)
    assert closed.memory_peak_bytes == des.memory_peak_bytes
    for key, value in des.breakdown_s.items():
        assert closed.breakdown_s[key] == pytest.approx(value, rel=1e-6, abs=1e-12), key


PLANS = st.fixed_dictionaries(
    {
        "nodes": st.sampled_from([1, 2, 4]),
        "tp": st.sampled_from([1, 2, 4, 8]),
        "pp": st.sampled_from([1, 2, 4]),
        "mb": st.sampled_from([1, 2]),
        "extra": st.sampled_from([0, 1, 3]),
        "schedule": st.sampled_from(["zb_h1", "dualpipev"]),
        "zero": st.sampled_from([0, 1, 2, 3]),
        "prefetch": st.sampled_from([0, 1, 2]),
        "reshard": st.booleans(),
        "sp": st.booleans(),
        "recompute": st.sampled_from(["none", "selective", "full"]),
        "overlap": st.booleans(),
        "bucket_mb": st.sampled_from([1.0, 25.0]),
        "tied": st.booleans(),
    }
)


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(PLANS)
def test_closed_form_equals_the_engine(knobs: dict) -> None:
    import dataclasses

    spec = get_preset("gpt3-350m")  # 24 layers, 16 heads
    spec = dataclasses.replace(spec, tied_embeddings=knobs["tied"])
    gpus = 8 * knobs["nodes"]
    tp, pp = knobs["tp"], knobs["pp"]
    if gpus % (tp * pp):
        return
    dp = gpus // (tp * pp)
    m = 2 * pp + knobs["extra"]  # DualPipeV needs 2 pp
    training = TrainingConfig(
        global_batch=m * knobs["mb"] * dp, micro_batch=knobs["mb"], recompute=knobs["recompute"]
    )
    parallel = ParallelConfig(
        tp=tp,
        pp=pp,
        dp=dp,
        schedule=knobs["schedule"],
        zero=knobs["zero"],
        sequence_parallel=knobs["sp"] and tp > 1,
        ddp=DDPConfig(bucket_mb=knobs["bucket_mb"], overlap=knobs["overlap"]),
        fsdp=FSDPConfig(prefetch=knobs["prefetch"], reshard_after_forward=knobs["reshard"]),
    )
    _agree(load_topology("dgx_h100", nodes=knobs["nodes"]), spec, training, parallel)


@pytest.mark.slow
@pytest.mark.parametrize("schedule", ["zb_h1", "dualpipev"])
def test_layer_fidelity_and_contention_agree(schedule: str) -> None:
    # a plan with TP, SP, DDP buckets and pipeline sends: layer by layer on the DES (every
    # collective played) against the closed form
    spec = get_preset("gpt3-350m")
    topo = load_topology("dgx_h100", nodes=1)
    training = TrainingConfig(global_batch=16, micro_batch=1)
    parallel = ParallelConfig(tp=2, pp=2, dp=2, schedule=schedule, sequence_parallel=True)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", CollsimWarning)
        closed = estimate_step(topo, spec, training, parallel)
        layer = simulate_step(topo, spec, training, parallel, fidelity="layer")
    assert closed.step_time_s == pytest.approx(layer.step_time_s, rel=0.01)
    assert closed.memory_peak_bytes == layer.memory_peak_bytes


def test_weight_gradient_ops_take_the_dgrad_and_wgrad_parts() -> None:
    # the W op of a layer is its linears' dB GEMMs: I + W is the whole backward, W is about
    # half of the linears' backward (dA and dB of equal FLOPs), and the gradient buckets are
    # launched from W segments
    spec = get_preset("gpt3-350m")
    topo = load_topology("dgx_h100", nodes=1)
    training = TrainingConfig(global_batch=16, micro_batch=1)
    sched = build_schedule(topo, spec, training, ParallelConfig(pp=2, dp=4, schedule="zb_h1"))
    chunk = sched.stages[0].chunks[0]
    assert chunk.input_grad is not None and chunk.weight_grad is not None
    whole = {s.key: s.compute_s for s in chunk.backward}
    for i_seg, w_seg in zip(chunk.input_grad, chunk.weight_grad, strict=True):
        assert i_seg.compute_s + w_seg.compute_s == pytest.approx(whole[i_seg.key], rel=1e-12)
        assert not i_seg.frees and w_seg.frees
    # a layer's W: the dB GEMM of each of its linears (QKV, out, MLP up and down), priced
    # alone by the compute model, at the pace of the slowest of the 8 GPUs
    layer = [w for w in chunk.weight_grad if isinstance(w.key, int)][0]
    linears = [o for o in layer_ops(spec, micro_batch=1, tp=1) if o.weight_gradient]
    assert [o.name for o in linears] == ["qkv_proj", "out_proj", "mlp_up", "mlp_down"]
    d_weight = sum(sched.compute.gemm_time_s(o.backward_gemms[1])[0] for o in linears)
    assert layer.compute_s == pytest.approx(d_weight * slowest_gpu_factor(8), rel=1e-9)
    assert layer.compute_s < 0.5 * whole[layer.key]  # attention and norms are input gradient
    emb = [w for w in chunk.weight_grad if w.key == "embedding"][0]
    assert emb.compute_s == pytest.approx(whole["embedding"], rel=1e-12)  # a lookup: all dW


@pytest.mark.parametrize("schedule", ["zb_h1", "dualpipev"])
def test_fsdp_reduces_after_the_weight_gradient_op(schedule: str) -> None:
    # ZeRO-3: a unit is gathered for the forward and for the input-gradient op (dgrad needs
    # the weight), resharded after it, and its gradient reduce-scattered after the
    # weight-gradient op: as many gathers and reduce-scatters as with 1F1B, and the DES and
    # the closed form agree
    spec = get_preset("gpt3-350m")
    topo = load_topology("dgx_h100", nodes=1)
    training = TrainingConfig(global_batch=32, micro_batch=1)
    counts = {}
    for kind in ("1f1b", schedule):
        parallel = ParallelConfig(pp=2, dp=4, zero=3, schedule=kind)
        _agree(topo, spec, training, parallel)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", CollsimWarning)
            result = estimate_step(topo, spec, training, parallel)
        counts[kind] = {
            op: sum(s.count for s in result.collectives if s.axis == "dp" and s.op == op)
            for op in ("all_gather", "reduce_scatter")
        }
    assert counts[schedule] == counts["1f1b"]
    assert counts["1f1b"]["reduce_scatter"] > 0
