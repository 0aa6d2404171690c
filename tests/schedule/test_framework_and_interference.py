"""Framework costs and compute slowed by overlapping collectives, as named parts of the step
in both fidelities.

compute.md: NCCL holds 16 SMs on an 8-NIC node (the H100's 132); a collective's bus traffic
also takes HBM bandwidth (3 bytes per bus byte for a reduction). While it runs, compute runs
``factor = (1 - m)/(1 - 16/132) + m/(1 - 3 busbw / (0.9 HBM))`` times slower, m the
memory-bound share of the compute; over the overlap window w the step grows by
``w (1 - 1/factor)``."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest

from collsim.cluster.topology import load_topology
from collsim.parallel.config import FSDPConfig, ParallelConfig, TrainingConfig
from collsim.play.engine.comm import CommPricer
from collsim.play.engine.core import Engine, EngineOptions
from collsim.play.engine.program import RankProgram
from collsim.play.walk import walk
from collsim.step.assemble import assemble
from collsim.step.build import build_schedule
from collsim.step.dataparallel import GRAD_NORM_BYTES
from collsim.workload import get_preset

FSDP = ParallelConfig(dp=8, zero=3, fsdp=FSDPConfig(prefetch=1))
TRAINING = TrainingConfig(global_batch=16, micro_batch=2, stack="llm_foundry")


def _play(schedule):
    topo = schedule.plan.topology
    engine = Engine(schedule, CommPricer(topo), EngineOptions(), program=RankProgram)
    engine.run()
    return engine, assemble(
        schedule.plan, engine, fidelity="fused", contended=[], zero_communication=False
    )


def test_overlapped_fsdp_step_is_slower_by_the_hand_computed_interference() -> None:
    topo = load_topology("dgx_h100")
    schedule = build_schedule(topo, get_preset("gpt3-1.3b"), TRAINING, FSDP)
    assert schedule.interference
    engine, on = _play(schedule)
    _, off = _play(dataclasses.replace(schedule, interference=False))
    # by hand, from the engine's own tallies of rank 0's data-parallel calls
    # (the clipping's 4-byte norm all-reduce runs after backward, beside no compute)
    reductions = [
        t
        for k, t in engine.stats.items()
        if k.rank == 0 and k.axis == "dp" and k.size_bytes != GRAD_NORM_BYTES
    ]
    link = sum(t.time_s for t in reductions)
    busbw = max(t.busbw_bps for t in reductions)
    dev = topo.device
    f_sm = 16 / 132
    f_hbm = 3 * busbw / (0.9 * dev.memory_bandwidth_bps)
    m = schedule.memory_bound_share
    factor = (1 - m) / (1 - f_sm) + m / (1 - f_hbm)
    window = min(link, off.breakdown_s["compute"])
    want = window * (1 - 1 / factor)
    assert want > 0.01 * off.step_time_s  # a visible effect
    assert on.step_time_s - off.step_time_s == pytest.approx(want, rel=1e-9)
    assert on.breakdown_s["interference"] == pytest.approx(want, rel=1e-9)
    assert off.breakdown_s["interference"] == 0
    # the closed form walks the same schedule and agrees
    closed = walk(schedule)
    assert closed.step_time_s == pytest.approx(on.step_time_s, rel=1e-9)
    assert closed.breakdown_s["interference"] == pytest.approx(want, rel=1e-9)


def test_framework_costs_are_named_in_the_breakdown_and_the_json(tmp_path: Path) -> None:
    from click.testing import CliRunner

    from collsim.cli import cli

    scenario = tmp_path / "s.yaml"
    scenario.write_text(
        "name: fsdp\ncluster: {topology: dgx_h100, nodes: 1}\nmodel: {preset: gpt3-1.3b}\n"
        "training: {global_batch: 16, micro_batch: 2, stack: llm_foundry}\n"
        "parallel: {tp: 1, pp: 1, dp: 8, zero: 3}\n"
    )
    out = tmp_path / "r.json"
    res = CliRunner().invoke(cli, ["run", str(scenario), "--json", str(out)])
    assert res.exit_code == 0, res.output
    assert "framework" in res.output and "comm interference" in res.output
    data = json.loads(out.read_text())
    assert data["breakdown_s"]["framework"] > 0 and data["breakdown_s"]["interference"] > 0
    # FSDP copy-in / grad copy-out per unit, and the per-step part (clipping, host time)
    schedule = build_schedule(load_topology("dgx_h100"), get_preset("gpt3-1.3b"), TRAINING, FSDP)
    segs = [s for c in schedule.stages[0].chunks for s in c.forward + c.backward]
    assert all(s.framework_s > 0 for s in segs if isinstance(s.key, int))
    assert schedule.framework_step_s[0] > 0
    per_step = schedule.framework_step_s[0]
    m = schedule.num_microbatches
    in_segments = m * sum(s.framework_s for s in segs)
    assert data["breakdown_s"]["framework"] == pytest.approx(in_segments + per_step, rel=1e-9)
