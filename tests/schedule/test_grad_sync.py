"""Gradient synchronisation per step, counted by hand: FSDP and HSDP reduce in every
micro-batch without pipelining (torchtitan's plain ``loss.backward()`` per micro-batch), once
per step under torch's pipeline stage with FSDP2 (``grad_sync: step``: the unsharded fp32
accumulators then stay for the step); ZeRO-1 reduce-scatters each bucket once per step (no_sync
before the last micro-batch), ZeRO-2 in every micro-batch, with and without pipelining.

Llama-2-7B cut to 4 layers on one DGX H100, M = 4 micro-batches per replica; the parameter
counts come from collsim.workload.memory, the call counts from the schedule by hand."""

from __future__ import annotations

import dataclasses
import warnings
from collections import defaultdict
from typing import Any

import pytest

from collsim.cluster.topology import load_topology
from collsim.core.errors import CollsimWarning, ConfigError
from collsim.parallel.config import FSDPConfig, ParallelConfig, TrainingConfig
from collsim.parallel.fsdp import grad_sync_of
from collsim.play.engine import simulate_step
from collsim.play.engine.step import prepare_step
from collsim.play.walk import estimate_step
from collsim.step.build import build_schedule
from collsim.workload import get_preset
from collsim.workload.memory import layer_parameters_per_rank

TOPO = load_topology("dgx_h100", nodes=1)
SPEC = get_preset("llama2-7b", num_layers=4, seq_len=1024)
LAYER = layer_parameters_per_rank(SPEC, 1)  # one FSDP unit (tp 1)
WORD = SPEC.vocab * SPEC.hidden
HEAD = WORD + SPEC.norm_parameters()  # final norm + LM head (untied)
M = 4


@pytest.fixture(autouse=True)
def _quiet():  # type: ignore[no-untyped-def]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", CollsimWarning)
        yield


def _calls(training: TrainingConfig, parallel: ParallelConfig) -> dict[tuple[str, str], list[Any]]:
    """(axis, op) -> [calls per step, bytes per step (nccl-tests sizes)] on rank 0."""
    r = simulate_step(TOPO, SPEC, training, parallel, fidelity="fused")
    closed = estimate_step(TOPO, SPEC, training, parallel)
    assert closed.step_time_s == pytest.approx(r.step_time_s, rel=0.01)
    assert closed.memory_peak_bytes == r.memory_peak_bytes
    out: dict[tuple[str, str], list[Any]] = defaultdict(lambda: [0, 0.0])
    for c in r.collectives:
        if c.size_bytes > 8:  # leave out the 4-byte gradient-norm all-reduces
            out[(c.axis, c.op)][0] += c.count
            out[(c.axis, c.op)][1] += c.count * c.size_bytes
    return out


def test_fsdp_reduces_every_microbatch_without_pipelining() -> None:
    tr = TrainingConfig(global_batch=8 * M, micro_batch=1)
    calls = _calls(tr, ParallelConfig(dp=8, zero=3))
    units = SPEC.num_layers + 1  # one unit per layer, the root (embedding + head)
    assert calls[("dp", "reduce_scatter")] == [
        units * M,
        pytest.approx(M * 2 * (4 * LAYER + WORD + HEAD)),
    ]
    # layers gathered for forward and again for backward; the root once per micro-batch
    assert calls[("dp", "all_gather")][0] == (2 * SPEC.num_layers + 1) * M


def test_hsdp_reduce_scatter_inside_all_reduce_across_every_microbatch() -> None:
    tr = TrainingConfig(global_batch=8 * M, micro_batch=1)
    calls = _calls(tr, ParallelConfig(dp=8, zero=3, fsdp=FSDPConfig(shard_group_size=4)))
    grads = 2 * (4 * LAYER + WORD + HEAD)  # bf16 (no stack)
    assert calls[("dp", "reduce_scatter")] == [5 * M, pytest.approx(M * grads)]
    # the shard (1 / g of the unit) all-reduced across the 2 replicas
    assert calls[("dp", "all_reduce")] == [5 * M, pytest.approx(M * grads / 4)]


def _by_size(training: TrainingConfig, parallel: ParallelConfig, op: str) -> dict[int, int]:
    """Calls per step of one dp op on rank 0 (stage 0), by call size in bytes."""
    engine = prepare_step(TOPO, SPEC, training, parallel, fidelity="fused")
    engine.run()
    out: dict[int, int] = {}
    for k, tally in engine.stat_items():
        if k.rank == 0 and k.op == op and k.size_bytes > 8:
            out[round(k.size_bytes)] = out.get(round(k.size_bytes), 0) + tally.count
    return out


def test_fsdp2_with_pipelining_reduces_once_per_step_in_fp32() -> None:
    tr = TrainingConfig(global_batch=4 * M, micro_batch=1, stack="torchtitan")
    par = ParallelConfig(dp=4, pp=2, zero=3)
    assert grad_sync_of(par, tr) == "step"
    _calls(tr, par)  # the two fidelities agree
    # stage 0 holds layers 0-1 and the embedding; each unit is reduced once per step, in
    # fp32 (torchtitan's reduce dtype)
    assert _by_size(tr, par, "reduce_scatter") == {round(4 * LAYER): 2, round(4 * WORD): 1}
    # 1F1B on 2 stages, stage 0 runs F0 F1 B0 F2 B1 F3 B2 B3: resharded after each forward,
    # kept after a backward until the next forward, so gathered at F0, F1, B0, B1, B2
    gathers = _by_size(tr, par, "all_gather")
    assert gathers[round(2 * LAYER)] == 5 * 2
    assert gathers[round(2 * WORD)] == 5


def test_fsdp2_with_pipelining_keeps_fp32_accumulators() -> None:
    tr = TrainingConfig(global_batch=4 * M, micro_batch=1, stack="torchtitan")
    once = ParallelConfig(dp=4, pp=2, zero=3)
    every = ParallelConfig(dp=4, pp=2, zero=3, fsdp=FSDPConfig(grad_sync="microbatch"))
    a = simulate_step(TOPO, SPEC, tr, once, fidelity="fused")
    b = simulate_step(TOPO, SPEC, tr, every, fidelity="fused")
    stage0 = 2 * LAYER + WORD
    # sharded bf16 gradients (2 / N) plus the unsharded fp32 accumulators of the stage
    assert a.memory_bytes["gradients"] == pytest.approx(stage0 * (2 / 4 + 4))
    assert b.memory_bytes["gradients"] == pytest.approx(stage0 * 2 / 4)
    # per micro-batch when the scenario asks for it
    assert _by_size(tr, every, "reduce_scatter") == {round(4 * LAYER): 2 * M, round(4 * WORD): M}


def test_hsdp_with_pipelining_all_reduces_once_per_step() -> None:
    tr = TrainingConfig(global_batch=4 * M, micro_batch=1, stack="torchtitan")
    par = ParallelConfig(dp=4, pp=2, zero=3, fsdp=FSDPConfig(shard_group_size=2))
    _calls(tr, par)
    assert _by_size(tr, par, "reduce_scatter")[round(4 * LAYER)] == 2
    assert _by_size(tr, par, "all_reduce")[round(4 * LAYER / 2)] == 2


def test_zero1_reduces_each_bucket_once_per_step() -> None:
    tr = TrainingConfig(global_batch=8 * M, micro_batch=1)
    calls = _calls(tr, ParallelConfig(dp=8, zero=1))
    params = 4 * LAYER + WORD + HEAD
    rs_calls, rs_bytes = calls[("dp", "reduce_scatter")]
    assert rs_bytes == pytest.approx(2 * params)  # every gradient once, bf16
    ag_calls, ag_bytes = calls[("dp", "all_gather")]
    assert (ag_calls, ag_bytes) == (rs_calls, pytest.approx(2 * params))  # updated params


def test_zero1_with_pipelining_reduces_each_bucket_once_per_step() -> None:
    tr = TrainingConfig(global_batch=4 * M, micro_batch=1)
    par = ParallelConfig(dp=4, pp=2, zero=1)
    _calls(tr, par)
    calls = _by_size(tr, par, "reduce_scatter")
    assert sum(size * n for size, n in calls.items()) == pytest.approx(2 * (2 * LAYER + WORD))


@pytest.mark.parametrize("pp", [1, 2])
def test_zero2_reduces_every_microbatch(pp: int) -> None:
    dp = 8 // pp
    tr = TrainingConfig(global_batch=dp * M, micro_batch=1)
    once = _by_size(tr, ParallelConfig(dp=dp, pp=pp, zero=1), "reduce_scatter")
    every = _by_size(tr, ParallelConfig(dp=dp, pp=pp, zero=2), "reduce_scatter")
    assert every == {size: M * n for size, n in once.items()}


def _start(event: Any) -> float:
    return float(event.start_s)


@pytest.mark.parametrize("pp", [1, 2])
def test_zero2_waits_for_each_backward_s_reductions(pp: int) -> None:
    # DeepSpeed's stage 2 with overlap_comm synchronizes at the end of every micro-step's
    # backward: no op starts before the reductions of the backward before it have ended (the
    # last bucket is ready when its backward ends, so every reducing backward waits), and the
    # closed form walks the same step
    dp = 8 // pp
    tr = TrainingConfig(global_batch=dp * M, micro_batch=1)
    par = ParallelConfig(dp=dp, pp=pp, zero=2)
    traced = simulate_step(TOPO, SPEC, tr, par, fidelity="fused", trace=True)
    mine = [e for e in traced.trace_events if e.rank == 0]
    ops = sorted((e for e in mine if e.stream == "compute" and "mb" in e.name), key=_start)
    ends: dict[int, float] = defaultdict(float)  # the reductions of each micro-batch
    for e in mine:
        if e.stream == "dp" and e.name.startswith("reduce_scatter"):
            mb = int(e.name.rsplit("mb", 1)[1])
            ends[mb] = max(ends[mb], e.end_s)
    backwards = [i for i, e in enumerate(ops[:-1]) if e.name.startswith("B ")]
    assert len(backwards) == M - 1  # (the last backward is followed by no op)
    for i in backwards:
        mb = ops[i].args["microbatch"]
        assert ops[i].end_s < ends[mb] <= ops[i + 1].start_s  # it waited, then went on
    closed = estimate_step(TOPO, SPEC, tr, par)
    assert closed.step_time_s == pytest.approx(traced.step_time_s, rel=1e-9)
    assert closed.breakdown_s["dp_exposed"] == pytest.approx(
        traced.breakdown_s["dp_exposed"], rel=1e-9
    )
    late = dataclasses.replace(par, ddp=dataclasses.replace(par.ddp, overlap=False))
    assert estimate_step(TOPO, SPEC, tr, late).step_time_s > closed.step_time_s


def test_grad_sync_key_is_checked() -> None:
    with pytest.raises(ConfigError, match="parallel.fsdp.grad_sync"):
        FSDPConfig(grad_sync="sometimes")


@pytest.mark.parametrize(("reduce", "grad_bytes"), [("fp32", 4), ("bf16", 2)])
def test_megatron_main_grads_are_fp32_when_reduced_in_fp32(reduce: str, grad_bytes: int) -> None:
    """Megatron-Core's DDP keeps main_grad buffers in fp32 with grad_reduce_in_fp32: the
    gradients of a ZeRO-1 rank take 4 bytes each (the whole buffer stays) and reduce in 4."""
    tr = TrainingConfig(global_batch=8 * M, stack="megatron_te", grad_reduce_dtype=reduce)
    r = simulate_step(TOPO, SPEC, tr, ParallelConfig(dp=8, zero=1), fidelity="fused")
    params = 4 * LAYER + WORD + HEAD
    assert r.memory_bytes["gradients"] == pytest.approx(grad_bytes * params)
    sent = sum(c.count * c.size_bytes for c in r.collectives if c.op == "reduce_scatter")
    assert sent == pytest.approx(grad_bytes * params)


def test_automodel_trains_bf16_parameters_without_fp32_masters() -> None:
    """NeMo Automodel's recipes build the model in bf16 (from_config) and run torch Adam on
    it: 2 + 2 bytes of moments per parameter instead of 12 (fp32 master, m, v)."""
    par = ParallelConfig(dp=8, zero=3)
    plain = simulate_step(TOPO, SPEC, TrainingConfig(global_batch=8), par, fidelity="fused")
    auto = simulate_step(
        TOPO, SPEC, TrainingConfig(global_batch=8, stack="nemo_automodel"), par, fidelity="fused"
    )
    params = 4 * LAYER + WORD + HEAD
    assert plain.memory_bytes["optimizer"] == pytest.approx(12 * params / 8)
    assert auto.memory_bytes["optimizer"] == pytest.approx(4 * params / 8)


@pytest.mark.parametrize(
    "parallel",
    [
        ParallelConfig(dp=8, zero=0),
        ParallelConfig(dp=8, zero=1),
        ParallelConfig(dp=4, pp=2, zero=2),
        ParallelConfig(dp=8, zero=3),
        ParallelConfig(tp=8, zero=2),  # nothing to reduce across one replica
    ],
    ids=["ddp", "zero1", "zero2-pp", "fsdp", "one-replica"],
)
def test_the_reducing_micro_batches_are_reduces_in_of_each(parallel: ParallelConfig) -> None:
    rules = build_schedule(TOPO, SPEC, TrainingConfig(global_batch=8 * M), parallel).dp
    counts = [0, 1, rules.num_microbatches, rules.num_microbatches + 2]
    for n in counts:
        each = tuple([rules.uses_buckets and rules.reduces_in(m) for m in range(n)])
        assert rules.reducing(n) == each
    assert any(rules.reducing(rules.num_microbatches)) == (parallel.zero < 3 and parallel.dp > 1)
