"""Overlapped tensor parallelism (``parallel.tp_overlap``): the time of one layer against a
hand computation, the fidelities agreeing on it, and the plan rules (exit 2)."""

from __future__ import annotations

import dataclasses
import warnings
from pathlib import Path

import pytest
from click.testing import CliRunner

from collsim.cli import cli
from collsim.cluster.topology import load_topology
from collsim.core.errors import CollsimWarning, ConfigError
from collsim.parallel.config import DDPConfig, ParallelConfig, TrainingConfig
from collsim.parallel.plan import build_plan
from collsim.parallel.tp_overlap import pipelined_scatter_s, ring_gather_s, ring_scatter_s
from collsim.play.engine import simulate_step
from collsim.play.walk import estimate_step
from collsim.step.build import build_schedule
from collsim.step.pricing import ClosedPricer, SegmentPrices
from collsim.workload import get_preset


@pytest.fixture(autouse=True)
def _quiet():  # type: ignore[no-untyped-def]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", CollsimWarning)
        yield


TOPO = load_topology("dgx_h100", nodes=1)
SPEC = get_preset("llama2-7b", num_layers=2)
TRAINING = TrainingConfig(global_batch=4, micro_batch=1, stack="megatron_te")


def _parallel(**kw):  # type: ignore[no-untyped-def]
    base = dict(tp=8, sequence_parallel=True, ddp=DDPConfig(overlap=False))
    base.update(kw)
    return ParallelConfig(**base)


def test_closed_forms_by_hand() -> None:
    # 8 pieces of 1 s; a ring step of 0.5 s hides under each piece, 2 s does not
    assert ring_gather_s(8.0, 0.5, 8) == pytest.approx(7 * 1.0 + 1.0)
    assert ring_gather_s(8.0, 2.0, 8) == pytest.approx(7 * 2.0 + 1.0)
    # slowed 1.25x while the step runs: 0.5 s of step does 0.4 s of a 1 s piece, 0.6 s after
    assert ring_scatter_s(8.0, 0.5, 8, 1.25) == pytest.approx(1.0 + 7 * (0.5 + 0.6))
    # TE's pipeline: 4 pieces on 1.25x fewer SMs, 0.5 s reduce-scatters, the last exposed
    assert pipelined_scatter_s(4.0, 0.5, 4, 1.25) == pytest.approx(1.25 + 3 * 1.25 + 0.5)


def _layer_by_hand(schedule, pricer: ClosedPricer) -> tuple[float, float]:  # type: ignore[no-untyped-def]
    """Forward and backward seconds of one layer with userbuffers, from the block's GEMM
    times and the closed-form call costs (docs/tp_overlap.md)."""
    blk = schedule.layer
    lin = {n: (f, d, w) for n, f, d, w in blk.linears_s}
    size = 1 * SPEC.seq_len * SPEC.hidden * 2  # b s h bf16 bytes
    group = tuple(range(8))
    p2p = pricer.cost("send_recv", size / 8, (0, 1)).time_s
    rs4 = pricer.cost("reduce_scatter", size / 4, group).time_s
    ag = pricer.cost("all_gather", size, group).time_s
    rs = pricer.cost("reduce_scatter", size, group).time_s
    sm = TOPO.device.sm_count or 132
    one_sm = 1 / (1 - 1 / sm)  # the ring exchange's one SM, while it runs
    margin = sm / (sm - 16)  # the pipelined and bulk kernels' 16 SMs, TE's SM margin
    fwd = blk.forward_s - sum(v[0] for v in lin.values())
    fwd += ring_gather_s(lin["qkv_proj"][0], p2p, 8, one_sm)
    fwd += pipelined_scatter_s(lin["out_proj"][0], rs4, 4, margin)
    fwd += ring_gather_s(lin["mlp_up"][0], p2p, 8, one_sm)
    fwd += pipelined_scatter_s(lin["mlp_down"][0], rs4, 4, margin)
    # backward: each half's row dgrad under a ring of the output gradient, the column
    # linear's re-gather beside its dgrad and its dgrad reduce-scatter beside its wgrad
    d_up, d_qkv = blk.column_dgrad_s
    bwd = blk.backward_s
    for row, col, d_col in (("mlp_down", "mlp_up", d_up), ("out_proj", "qkv_proj", d_qkv)):
        bwd -= lin[row][1] + d_col + lin[col][2]
        bwd += ring_gather_s(lin[row][1], p2p, 8, one_sm)
        bwd += max(ag, d_col * margin) + max(rs, lin[col][2] * margin)
    return fwd, bwd


def test_one_layer_against_a_hand_computation() -> None:
    schedule = build_schedule(TOPO, SPEC, TRAINING, _parallel(tp_overlap="userbuffers"))
    pricer = ClosedPricer(TOPO)
    prices = SegmentPrices(schedule.plan, pricer, schedule.overlap_factor)
    chunk = schedule.stages[0].chunks[0]
    fwd_seg = next(s for s in chunk.forward if s.key == 1)
    bwd_seg = next(s for s in chunk.backward if s.key == 1)
    fwd = sum(prices.step_s(0, st) for st in fwd_seg.steps)
    bwd = sum(prices.step_s(0, st) for st in bwd_seg.steps)
    hand_fwd, hand_bwd = _layer_by_hand(schedule, pricer)
    assert fwd == pytest.approx(hand_fwd, rel=1e-9)
    assert bwd == pytest.approx(hand_bwd, rel=1e-9)
    # and it exposes less than the blocking calls of the same layer
    blocking = build_schedule(TOPO, SPEC, TRAINING, _parallel())
    b_prices = SegmentPrices(blocking.plan, pricer, blocking.overlap_factor)
    b_chunk = blocking.stages[0].chunks[0]
    b_fwd = sum(b_prices.step_s(0, st) for st in b_chunk.forward[1].steps)
    assert fwd < b_fwd


@pytest.mark.parametrize("mode", ["userbuffers", "async_tp"])
@pytest.mark.parametrize("fidelity", ["fused", "layer"])
def test_fidelities_agree_on_overlapped_tp(mode: str, fidelity: str) -> None:
    training = TrainingConfig(
        global_batch=4, micro_batch=1, stack="megatron_te", execution="compiled"
    )
    par = _parallel(tp_overlap=mode)
    closed = estimate_step(TOPO, SPEC, training, par)
    des = simulate_step(TOPO, SPEC, training, par, fidelity=fidelity)
    assert des.step_time_s == pytest.approx(closed.step_time_s, rel=1e-6)
    assert des.breakdown_s["tp_exposed"] == pytest.approx(
        closed.breakdown_s["tp_exposed"], rel=1e-6
    )


def test_overlap_rules() -> None:
    with pytest.raises(ConfigError, match="needs sequence_parallel: true") as info:
        ParallelConfig(tp=8, tp_overlap=True)
    assert info.value.key_path == "parallel.tp_overlap"
    with pytest.raises(ConfigError, match="needs sequence_parallel"):
        ParallelConfig(tp=1, tp_overlap="userbuffers")
    with pytest.raises(ConfigError, match="must be true, false or one of"):
        ParallelConfig(tp=8, sequence_parallel=True, tp_overlap="nccl")
    with pytest.raises(ConfigError, match="needs training.execution: compiled") as info:
        build_plan(TOPO, SPEC, TRAINING, _parallel(tp_overlap="async_tp"))
    assert info.value.key_path == "parallel.tp_overlap"
    # true under torchtitan is AsyncTP, which needs torch.compile
    titan = TrainingConfig(global_batch=4, micro_batch=1, stack="torchtitan")
    with pytest.raises(ConfigError, match="async_tp"):
        build_plan(TOPO, SPEC, titan, _parallel(tp_overlap=True))


SCENARIO = """\
name: tp-overlap-no-sp
cluster: {topology: dgx_h100, nodes: 1}
model: {preset: llama2-7b, layers: 2}
training: {global_batch: 4, micro_batch: 1, stack: megatron_te}
parallel: {tp: 8, tp_overlap: true}
"""


def test_cli_overlap_without_sp_is_one_line_exit_2(tmp_path: Path) -> None:
    path = tmp_path / "s.yaml"
    path.write_text(SCENARIO)
    res = CliRunner().invoke(cli, ["run", str(path), "--fidelity", "closed"])
    assert res.exit_code == 2, res.output
    lines = res.stderr.strip().splitlines()
    assert len(lines) == 1 and "parallel.tp_overlap" in lines[0], lines
    assert "sequence_parallel" in lines[0]
    fp8 = SCENARIO.replace("tp_overlap: true", "sequence_parallel: true").replace(
        "stack: megatron_te", "stack: torchtitan, fp8_weight_cache: true, dtype: fp8"
    )
    path.write_text(fp8)
    res = CliRunner().invoke(cli, ["run", str(path), "--fidelity", "closed"])
    assert res.exit_code == 2 and "training.fp8_weight_cache" in res.stderr, res.output
    assert len(res.stderr.strip().splitlines()) == 1


@pytest.mark.parametrize("fidelity", ["auto", "layer"])
def test_fidelities_agree_on_an_fp8_megatron_plan(fidelity: str) -> None:
    """Transformer Engine's FP8 casts (weight casts once per step, FP8 parameters gathered in
    FP8, FP8 sequence-parallel gathers) with userbuffers, over two nodes: within 1 %."""
    topo = load_topology("dgx_h100", nodes=2)
    training = TrainingConfig(
        global_batch=8, micro_batch=1, stack="megatron_te", dtype="fp8", fp8_recipe="tensorwise"
    )
    par = _parallel(dp=2, zero=1, tp_overlap="userbuffers")
    closed = estimate_step(topo, SPEC, training, par)
    des = simulate_step(topo, SPEC, training, par, fidelity=fidelity)
    assert des.step_time_s == pytest.approx(closed.step_time_s, rel=0.01)
    assert closed.breakdown_s["framework"] > 0  # the once-per-step weight casts
    plain = estimate_step(
        topo, SPEC, TrainingConfig(global_batch=8, micro_batch=1, dtype="fp8"), _parallel(dp=2)
    )
    assert closed.step_time_s != plain.step_time_s


def test_te_fp8_gathers_the_quantized_input() -> None:
    """Under megatron_te with fp8, TE casts the local rows and all-gathers FP8: the
    sequence-parallel gathers of the QKV and MLP-up inputs move 1 byte per element."""
    size = SPEC.seq_len * SPEC.hidden * 2
    fp8 = TrainingConfig(global_batch=4, micro_batch=1, stack="megatron_te", dtype="fp8")
    result = estimate_step(TOPO, SPEC, fp8, _parallel())
    gathers = {c.size_bytes for c in result.collectives if c.axis == "tp" and c.op == "all_gather"}
    assert size / 2 in gathers  # the QKV / MLP-up inputs, forward and the backward re-gather
    # current scaling: an fp32 amax all-reduce over tp before each gathered cast, the QKV and
    # MLP-up inputs forward and the out / MLP-down output gradients backward: 4 per layer and
    # micro-batch, 2 layers x 4 micro-batches
    amax = [
        c
        for c in result.collectives
        if c.op == "all_reduce" and c.size_bytes == 4 and c.axis == "tp"
    ]
    assert sum(c.count for c in amax) == 4 * 2 * 4
    delayed = dataclasses.replace(fp8, fp8_recipe="delayed")
    quiet = estimate_step(TOPO, SPEC, delayed, _parallel())
    assert not [c for c in quiet.collectives if c.size_bytes == 4 and c.axis == "tp"]
    bf16 = estimate_step(TOPO, SPEC, TRAINING, _parallel())
    assert {c.size_bytes for c in bf16.collectives if c.axis == "tp" and c.op == "all_gather"} == {
        size
    }


def test_tp_overlap_leaves_the_ep_overlap_of_paired_ops_alone() -> None:
    """With parallel.ep_overlap the paired ops keep their compute runs for the all-to-alls:
    adding tp_overlap does not expose more EP time, and it hides TP time in the other ops."""
    moe = get_preset("qwen3-30b-a3b", num_layers=2, seq_len=1024)
    training = TrainingConfig(global_batch=16, micro_batch=1, stack="megatron_te")
    base = dict(tp=2, dp=4, ep=8, sequence_parallel=True, ep_overlap=True, dispatcher="alltoall")
    plain = estimate_step(TOPO, moe, training, ParallelConfig(**base))
    both = estimate_step(TOPO, moe, training, ParallelConfig(**base, tp_overlap="userbuffers"))
    assert both.breakdown_s["ep_exposed"] == pytest.approx(plain.breakdown_s["ep_exposed"])
    assert both.breakdown_s["tp_exposed"] < plain.breakdown_s["tp_exposed"]


def test_async_tp_forward_against_a_hand_computation() -> None:
    """AsyncTP: every forward collective a ring of tp steps moved by the copy engines (no
    SMs held, no slowdown): rest + 2 rings under the column GEMMs + 2 under the row GEMMs."""
    training = TrainingConfig(
        global_batch=4, micro_batch=1, stack="megatron_te", execution="compiled"
    )
    schedule = build_schedule(TOPO, SPEC, training, _parallel(tp_overlap="async_tp"))
    pricer = ClosedPricer(TOPO)
    prices = SegmentPrices(schedule.plan, pricer, schedule.overlap_factor)
    seg = next(s for s in schedule.stages[0].chunks[0].forward if s.key == 1)
    lin = {n: f for n, f, _, _ in schedule.layer.linears_s}
    p2p = pricer.cost("send_recv", SPEC.seq_len * SPEC.hidden * 2 / 8, (0, 1)).time_s
    hand = schedule.layer.forward_s - sum(lin.values())
    hand += ring_gather_s(lin["qkv_proj"], p2p, 8) + ring_scatter_s(lin["out_proj"], p2p, 8)
    hand += ring_gather_s(lin["mlp_up"], p2p, 8) + ring_scatter_s(lin["mlp_down"], p2p, 8)
    assert sum(prices.step_s(0, st) for st in seg.steps) == pytest.approx(hand, rel=1e-9)
