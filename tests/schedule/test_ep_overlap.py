"""EP all-to-all overlap (``parallel.ep_overlap``, Megatron-Core's combined 1F1B) and the rank
order on the topology: the overlap hides what the paired compute can hide and no more, the
fidelities agree on it, and EP groups that the order keeps inside a node cost less."""

from __future__ import annotations

import dataclasses
import warnings

import pytest

from collsim.cluster.topology import load_topology
from collsim.core.errors import CollsimWarning, ConfigError
from collsim.parallel.config import DDPConfig, ParallelConfig, TrainingConfig
from collsim.parallel.pipeline import paired_ops, stage_schedule
from collsim.parallel.plan import build_plan
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


TOPO = load_topology("dgx_h100", nodes=2)
SPEC = get_preset("qwen3-30b-a3b", num_layers=2, seq_len=1024)
M = 4
TRAINING = TrainingConfig(global_batch=16 * M, micro_batch=1)


def _parallel(**kw):  # type: ignore[no-untyped-def]
    base = dict(dp=16, ep=16, ddp=DDPConfig(overlap=False))
    base.update(kw)
    return ParallelConfig(**base)


def test_paired_ops_follow_megatrons_combined_1f1b() -> None:
    # pp 1: F0 alone, (B_i, F_i+1) together, the last B alone
    assert paired_ops("1f1b", num_stages=1, num_microbatches=4, stage=0) == frozenset(range(1, 7))
    # interleaved, p 2, v 2, m 4: the steady state of each stage, every op in it once
    for stage in range(2):
        ops = stage_schedule(
            "interleaved", num_stages=2, num_microbatches=4, stage=stage, virtual_stages=2
        )
        paired = paired_ops(
            "interleaved", num_stages=2, num_microbatches=4, stage=stage, virtual_stages=2
        )
        steady = [ops[i] for i in sorted(paired)]
        assert [op.phase.value for op in steady] == ["F", "B"] * (len(steady) // 2)
        assert all(ops[i].phase.value == "F" for i in range(min(paired)))
        assert all(ops[i].phase.value == "B" for i in range(max(paired) + 1, len(ops)))
    assert paired_ops("gpipe", num_stages=2, num_microbatches=4, stage=0) == frozenset()


def _hidden_s(schedule) -> tuple[float, float, int, float]:  # type: ignore[no-untyped-def]
    """(seconds the paired segments' all-to-alls can hide: min(call, window) summed over the
    step; all EP link seconds of the step; paired all-to-all calls; what the compute beside
    them loses while they run).

    By hand from compute.md 4: the pieces beside the all-to-alls are GEMMs and attention
    (compute-bound), so they run ``f = 1 / (1 - nccl_sms / sm_count)`` times slower while a
    call runs; a window W beside a call of t seconds then takes ``t + max(0, W - t / f)``
    instead of ``max(t, W)``."""
    plan = schedule.plan
    prices = SegmentPrices(plan, ClosedPricer(plan.topology))
    rank = plan.rank(dp=0, pp=0, tp=0)
    device = plan.topology.device
    f = 1 / (1 - device.nccl_sms / device.sm_count)
    hidden = link = slowed = 0.0
    calls = 0
    for i, op in enumerate(schedule.pipeline[0]):
        chunk = schedule.stages[0].chunks[op.chunk]
        for seg in schedule.segments(0, i, chunk):
            for st in seg.steps:
                if st.axis == "ep" and st.op == "all_to_all":
                    t = prices.collective_s(rank, st)
                    link += t
                    if st.overlap_s:
                        hidden += min(t, st.overlap_s)
                        slowed += t + max(0.0, st.overlap_s - t / f) - max(t, st.overlap_s)
                        calls += 1
    return hidden, link, calls, slowed


def test_overlap_hides_what_the_paired_compute_can_and_no_more() -> None:
    blocking = estimate_step(TOPO, SPEC, TRAINING, _parallel())
    overlapped = estimate_step(TOPO, SPEC, TRAINING, _parallel(ep_overlap=True))
    schedule = build_schedule(TOPO, SPEC, TRAINING, _parallel(ep_overlap=True))
    hidden, link, calls, slowed = _hidden_s(schedule)
    # 2 MoE layers x 2 all-to-alls in each of the 2 M - 2 paired ops (F0 and the last B alone)
    assert calls == 2 * SPEC.num_layers * (2 * M - 2)
    b, o = blocking.breakdown_s, overlapped.breakdown_s
    assert b["ep_exposed"] == pytest.approx(link, rel=1e-9)  # blocking: every call exposed
    assert 0 < hidden < link
    assert b["ep_exposed"] - o["ep_exposed"] == pytest.approx(hidden, rel=1e-9)
    assert o["compute"] == pytest.approx(b["compute"], rel=1e-12)
    # the overlapped pieces run slower while their all-to-alls run (interference)
    assert slowed > 0
    assert o["interference"] - b["interference"] == pytest.approx(slowed, rel=1e-9)
    assert blocking.step_time_s - overlapped.step_time_s == pytest.approx(hidden - slowed, rel=1e-9)
    # the unpaired first forward and last backward keep their all-to-alls exposed: at least
    # 2 layers x 2 calls x 2 ops of the per-call time
    per_call = link / (4 * SPEC.num_layers * M)
    assert o["ep_exposed"] >= 2 * SPEC.num_layers * 2 * per_call * (1 - 1e-9)


def test_overlap_hides_nothing_without_compute_beside_it() -> None:
    """With a layer pass priced at 1 ns, a pass hides at most 1 ns (its own compute), however
    long its all-to-alls are."""
    tiny = {"layer.forward": 1e-9, "layer.backward": 1e-9}
    kw = dict(op_time_overrides=tiny)
    blocking = estimate_step(TOPO, SPEC, TRAINING, _parallel(), **kw)
    overlapped = estimate_step(TOPO, SPEC, TRAINING, _parallel(ep_overlap=True), **kw)
    saved = blocking.breakdown_s["ep_exposed"] - overlapped.breakdown_s["ep_exposed"]
    passes = SPEC.num_layers * (2 * M - 2)  # layer passes of the paired ops
    assert 0 < saved <= passes * 1e-9 * (1 + 1e-6)
    assert saved < 1e-5 * blocking.breakdown_s["ep_exposed"]


@pytest.mark.parametrize("fidelity", ["fused", "auto", "layer"])
def test_fidelities_agree_on_the_overlap(fidelity: str) -> None:
    # one node (EP 8 on NVSwitch: no shared link), so the DES of every call is its closed form
    topo = load_topology("dgx_h100", nodes=1)
    training = TrainingConfig(global_batch=8 * M, micro_batch=1)
    par = _parallel(dp=8, ep=8, ep_overlap=True)
    closed = estimate_step(topo, SPEC, training, par)
    des = simulate_step(topo, SPEC, training, par, fidelity=fidelity)
    assert des.step_time_s == pytest.approx(closed.step_time_s, rel=1e-6)
    assert des.breakdown_s["ep_exposed"] == pytest.approx(
        closed.breakdown_s["ep_exposed"], rel=1e-6, abs=1e-12
    )
    blocking = simulate_step(topo, SPEC, training, _parallel(dp=8, ep=8), fidelity=fidelity)
    assert des.breakdown_s["ep_exposed"] < blocking.breakdown_s["ep_exposed"]


def test_overlap_moves_the_same_bytes() -> None:
    """The overlap reorders the calls, not their bytes: the same all-to-all calls and sizes."""
    a = simulate_step(TOPO, SPEC, TRAINING, _parallel(), fidelity="fused")
    b = simulate_step(TOPO, SPEC, TRAINING, _parallel(ep_overlap=True), fidelity="fused")
    ea = [(c.op, c.count, c.size_bytes) for c in a.collectives if c.axis == "ep"]
    eb = [(c.op, c.count, c.size_bytes) for c in b.collectives if c.axis == "ep"]
    assert ea == eb and ea


@pytest.mark.parametrize(
    ("par", "recompute", "match"),
    [
        (dict(dp=16, ep=1), "none", "needs expert parallelism"),
        (dict(dp=8, pp=2, ep=8), "none", "needs schedule: interleaved"),
        (dict(dp=16, ep=16), "full", "does not combine with training.recompute: full"),
    ],
)
def test_overlap_rules(par: dict, recompute: str, match: str) -> None:
    with pytest.raises(ConfigError, match=match) as info:
        build_plan(
            TOPO,
            SPEC,
            dataclasses.replace(TRAINING, recompute=recompute),
            _parallel(ep_overlap=True, **par),
        )
    assert info.value.key_path == "parallel.ep_overlap"


def test_ep_inside_a_node_under_pp_outermost_costs_less() -> None:
    """ep 8 over tp 1 x dp 8 with pp 2 on 2 nodes: pipeline outermost keeps each stage (8
    consecutive ranks) and its EP group in one node; dp outermost spreads the EP group over
    both nodes, so its all-to-alls cross the network (closed form and DES alike)."""
    spec = get_preset("qwen3-30b-a3b", num_layers=4, seq_len=1024)
    training = TrainingConfig(global_batch=8 * 4, micro_batch=1)
    kw = dict(tp=1, pp=2, dp=8, ep=8, schedule="interleaved", virtual_stages=2)
    near = build_plan(TOPO, spec, training, ParallelConfig(**kw))
    far = build_plan(TOPO, spec, training, ParallelConfig(order="tp-cp-ep-pp-dp", **kw))
    assert {TOPO.node_of(r) for r in near.group_of(0, "ep")} == {0}
    assert {TOPO.node_of(r) for r in far.group_of(0, "ep")} == {0, 1}
    for fidelity in ("fused", "layer"):
        a = simulate_step(TOPO, spec, training, ParallelConfig(**kw), fidelity=fidelity)
        b = simulate_step(
            TOPO, spec, training, ParallelConfig(order="tp-cp-ep-pp-dp", **kw), fidelity=fidelity
        )
        assert a.breakdown_s["ep_exposed"] < 0.5 * b.breakdown_s["ep_exposed"]


def _oversubscribed(tmp_path, nodes: int):  # type: ignore[no-untyped-def]
    """dgx_h100 with every node on its own leaf and the spine 4:1 oversubscribed."""
    import yaml

    from collsim.cluster.topology import PRESET_DIR

    doc = yaml.safe_load((PRESET_DIR / "dgx_h100.yaml").read_text())
    doc["name"] = "dgx_h100_oversubscribed"
    doc["fabric"].update(rails=False, oversubscription=4.0, nodes_per_leaf=1)
    path = tmp_path / "over.yaml"
    path.write_text(yaml.safe_dump(doc))
    return load_topology(path, nodes=nodes)


def test_auto_fidelity_puts_contended_ep_groups_on_the_des(tmp_path) -> None:  # type: ignore[no-untyped-def]
    """Two EP groups of 8 over 4 nodes (dp outermost, pp 2: each group on 4 nodes) share the
    oversubscribed spine: auto runs ep on the DES, and the all-to-alls take longer than each
    group alone (the closed form); on the non-blocking fabric nothing contends."""
    spec = get_preset("qwen3-30b-a3b", num_layers=4, seq_len=1024)
    training = TrainingConfig(global_batch=16 * 4, micro_batch=1)
    par = ParallelConfig(
        pp=2, dp=16, ep=16, schedule="interleaved", virtual_stages=2, order="tp-cp-ep-pp-dp"
    )
    over = _oversubscribed(tmp_path, 4)
    auto = simulate_step(over, spec, training, par)
    closed = estimate_step(over, spec, training, par)
    assert "ep" in auto.contended_axes and "ep" in auto.des_axes
    assert auto.breakdown_s["ep_exposed"] > 1.05 * closed.breakdown_s["ep_exposed"]
    flat = load_topology("dgx_h100", nodes=4)
    auto = simulate_step(flat, spec, training, par)
    assert "ep" not in auto.contended_axes
    closed = estimate_step(flat, spec, training, par)
    assert auto.step_time_s == pytest.approx(closed.step_time_s, rel=1e-9)


def test_vectorised_flow_links_follow_the_topology_paths() -> None:
    """The contention check's vectorised paths (Topology.path_links) equal Topology.path on
    every shipped topology with several nodes (rails, leaves, NVL domains)."""
    import glob
    from pathlib import Path

    import numpy as np

    repo = Path(__file__).resolve().parents[2]
    for path in sorted(glob.glob(str(repo / "topologies" / "*.yaml"))):
        try:
            topo = load_topology(path, nodes=6)
        except ConfigError:
            topo = load_topology(path)
        rng = np.random.default_rng(0)
        src = rng.integers(0, topo.num_ranks, 300)
        dst = rng.integers(0, topo.num_ranks, 300)
        links = topo.path_links(src, dst)
        for i in range(300):
            got = tuple(int(x) for x in links[i] if x >= 0)
            assert got == topo.path(int(src[i]), int(dst[i])), (path, src[i], dst[i])
