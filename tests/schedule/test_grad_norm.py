"""The clipping's global gradient norm: one fp32 scalar all-reduced over a replica's
model-parallel ranks (and over data parallelism when the gradients are sharded) before the
optimizer, in both fidelities; the pipeline stages that finish first wait for the last."""

from __future__ import annotations

import dataclasses

import pytest

from collsim.cluster.topology import load_topology
from collsim.parallel.config import ParallelConfig, TrainingConfig
from collsim.play.engine.step import simulate_step
from collsim.play.walk import estimate_step
from collsim.step.dataparallel import GRAD_NORM_BYTES
from collsim.workload import get_preset

PLAN = ParallelConfig(tp=2, pp=4, dp=2, zero=1)
CLIPPED = TrainingConfig(global_batch=16, micro_batch=1, stack="megatron_te")


def _norm_calls(result):
    return {
        (c.axis, c.group_size): c
        for c in result.collectives
        if c.op == "all_reduce" and c.size_bytes == GRAD_NORM_BYTES
    }


def _run(training):
    topo = load_topology("dgx_h100", nodes=2)
    spec = get_preset("gpt3-1.3b")
    des = simulate_step(topo, spec, training, PLAN)
    closed = estimate_step(topo, spec, training, PLAN)
    return des, closed


def test_the_norm_is_all_reduced_over_the_model_and_data_parallel_groups() -> None:
    des, closed = _run(CLIPPED)
    calls = _norm_calls(des)
    assert set(calls) == {("mp", 8), ("dp", 2)}  # tp x pp of a replica; the ZeRO-1 dp group
    assert all(c.count == 1 for c in calls.values())
    assert all(c.time_s > 0 for c in calls.values())
    # the closed form walks the same rendezvous
    assert _norm_calls(closed).keys() == calls.keys()
    assert closed.step_time_s == pytest.approx(des.step_time_s, rel=1e-9)
    for key, value in des.breakdown_s.items():
        assert closed.breakdown_s[key] == pytest.approx(value, rel=1e-9, abs=1e-12), key


def test_without_clipping_there_is_no_norm_and_the_step_is_shorter() -> None:
    on, _ = _run(CLIPPED)
    off, off_closed = _run(dataclasses.replace(CLIPPED, grad_clip=False))
    assert _norm_calls(off) == {} and _norm_calls(off_closed) == {}
    norm_s = sum(c.time_s for c in _norm_calls(on).values())
    # the last stage to finish pays both calls; the step grows at least by them (the
    # clipping pass itself is in ``framework``)
    grown = on.step_time_s - off.step_time_s
    framework = on.breakdown_s["framework"] - off.breakdown_s["framework"]
    assert grown >= norm_s + framework - 1e-12


def test_the_stages_wait_for_the_last_one_at_the_norm() -> None:
    on, _ = _run(CLIPPED)
    off, _ = _run(dataclasses.replace(CLIPPED, grad_clip=False))
    by_stage_on = on.breakdown_by_stage_s
    by_stage_off = off.breakdown_by_stage_s
    waited = {s: by_stage_on[s]["bubble"] - by_stage_off[s]["bubble"] for s in by_stage_on}
    assert min(waited.values()) == pytest.approx(0.0, abs=1e-12)  # the last one waits for none
    assert max(waited.values()) > 0  # the others wait at the rendezvous
    # after it every stage starts its optimizer at the same instant (the trace's slices)
    topo = load_topology("dgx_h100", nodes=2)
    traced = simulate_step(topo, get_preset("gpt3-1.3b"), CLIPPED, PLAN, trace=True)
    starts = {e.rank: e.start_s for e in traced.trace_events if e.name == "optimizer"}
    assert len(starts) == 4
    assert max(starts.values()) - min(starts.values()) < 1e-12 * traced.step_time_s
    untraced = simulate_step(
        topo,
        get_preset("gpt3-1.3b"),
        dataclasses.replace(CLIPPED, grad_clip=False),
        PLAN,
        trace=True,
    )
    apart = {e.rank: e.start_s for e in untraced.trace_events if e.name == "optimizer"}
    assert max(apart.values()) - min(apart.values()) > 1e-6  # without the norm they differ
