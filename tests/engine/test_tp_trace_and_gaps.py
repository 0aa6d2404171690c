"""TP collectives in the trace, and the Megatron details the engine models.

- every blocking TP collective priced inside a fused op is a slice on the ``tp`` stream, at its
  time inside the op; counts come from the plan, durations add up to the collective statistics;
- sequence parallelism re-gathers each column-parallel linear's input in backward (Korthikanti
  2022, sec. 4.2.2), overlapped with the dgrad GEMM;
- the vocab-parallel cross-entropy's three all-reduces (Megatron ``_VocabParallelCrossEntropy``);
- the pipeline scatter/gather (Narayanan 2021, sec. 4.1): the receiver all-gathers over TP;
- torch DDP's bucket tensors beside ``param.grad`` (``gradient_as_bucket_view=False``).
"""

from __future__ import annotations

import dataclasses
from collections import defaultdict
from pathlib import Path

import pytest

from collsim.collectives import CollectiveOp, Group, cost
from collsim.parallel.config import DDPConfig, ParallelConfig, TrainingConfig
from collsim.play.engine import simulate_step
from collsim.play.engine.step import prepare_step
from collsim.report.trace import to_chrome_trace
from collsim.workload.compute import ComputeModel

from .conftest import topology

ACT_BYTES = 2  # bf16


def expected_tp_calls(spec, *, stage: int, pp: int, m: int, sp: bool, recompute: str) -> int:
    """TP collectives of one rank in one step, counted from the plan (1F1B, one chunk)."""
    layers = spec.num_layers // pp
    fwd = 4 if sp else 2  # (AG + RS) x 2 with SP, else 2 all-reduces
    bwd = 6 if sp else 2  # the conjugates, + 2 input re-gathers with SP
    per_mb = layers * (fwd + bwd + (fwd if recompute == "full" else 0))
    if stage == 0:
        per_mb += 1  # embedding: all-reduce (reduce-scatter with SP)
    if stage == pp - 1:
        per_mb += 3  # vocab-parallel cross-entropy
        per_mb += 1  # LM head backward: input-gradient AR (RS with SP)
        per_mb += 2 if sp else 0  # LM head: forward input AG, backward re-gather
    gathers = 0 if sp else m * ((stage > 0) + (stage < pp - 1))  # pipeline scatter/gather
    return m * per_mb + gathers


CASES = [
    (False, "none", "auto"),
    (False, "full", "auto"),
    (True, "full", "auto"),
    (True, "none", "layer"),
    (False, "selective", "layer"),
]


@pytest.mark.parametrize("sp, recompute, fidelity", CASES)
def test_tp_slices_per_rank_match_the_plan_and_the_statistics(
    small_spec, sp: bool, recompute: str, fidelity: str
) -> None:
    tp, pp, dp, m = 2, 2, 2, 4
    tr = TrainingConfig(global_batch=m * dp, micro_batch=1, recompute=recompute)
    par = ParallelConfig(tp=tp, pp=pp, dp=dp, sequence_parallel=sp)
    r = simulate_step(topology(), small_spec, tr, par, trace=True, fidelity=fidelity)
    ranks = r.simulated_ranks
    assert ranks == [0, tp * dp]  # one rank per stage, pp outermost (the default order)
    tp_events = [e for e in r.trace_events if e.stream == "tp"]
    for rank in ranks:
        mine = [e for e in tp_events if e.rank == rank]
        want = expected_tp_calls(
            small_spec, stage=rank // (tp * dp), pp=pp, m=m, sp=sp, recompute=recompute
        )
        assert len(mine) == want
        for e in mine:
            assert e.end_s > e.start_s
            assert e.args["bytes"] > 0 and e.args["algorithm"] not in ("", "none")
    # the slices are the statistics: per kind, calls and link time per issuing rank
    by_kind: dict[tuple, list] = defaultdict(lambda: [0, 0.0, set()])
    for e in tp_events:
        slot = by_kind[(e.args["op"], float(e.args["size_bytes"]), e.args["algorithm"])]
        slot[0] += 1
        slot[1] += e.end_s - e.start_s
        slot[2].add(e.rank)
    stats = {(c.op, c.size_bytes, c.algorithm): c for c in r.collectives if c.axis == "tp"}
    assert set(stats) == set(by_kind)
    for key, (count, time_s, issuers) in by_kind.items():
        assert stats[key].count == round(count / len(issuers))
        assert stats[key].time_s == pytest.approx(time_s / len(issuers), rel=1e-9)
    total_link = sum(
        c.time_s * len(by_kind[(c.op, c.size_bytes, c.algorithm)][2])
        for c in r.collectives
        if c.axis == "tp"
    )
    assert sum(e.end_s - e.start_s for e in tp_events) == pytest.approx(total_link, rel=1e-9)


@pytest.mark.parametrize("sp", [False, True])
def test_tp_slices_nest_in_their_ops_and_never_overlap(small_spec, sp: bool) -> None:
    tr = TrainingConfig(global_batch=8, micro_batch=1, recompute="full")
    par = ParallelConfig(tp=2, pp=2, dp=2, sequence_parallel=sp)
    r = simulate_step(topology(), small_spec, tr, par, trace=True)
    eps = 1e-12
    for rank in r.simulated_ranks:
        ops = sorted(
            (e for e in r.trace_events if e.rank == rank and e.stream == "compute"),
            key=lambda e: e.start_s,
        )
        tps = sorted(
            (e for e in r.trace_events if e.rank == rank and e.stream == "tp"),
            key=lambda e: e.start_s,
        )
        for a, b in zip(tps, tps[1:]):
            assert b.start_s >= a.end_s - eps
        for e in tps:
            inside = [o for o in ops if o.start_s - eps <= e.start_s and e.end_s <= o.end_s + eps]
            if e.name.startswith("all_gather pp recv"):
                assert not inside  # before the op it feeds, which waits for it
                nxt = [o for o in ops if o.start_s >= e.end_s - eps]
                assert nxt and nxt[0].start_s == pytest.approx(e.end_s, abs=1e-12)
            else:
                assert len(inside) == 1
    threads = {
        ev["args"]["name"]
        for ev in to_chrome_trace(r)["traceEvents"]
        if ev["ph"] == "M" and ev["name"] == "thread_name"
    }
    assert "tp" in threads and not any("#" in t for t in threads)


def test_untraced_run_records_no_tp_slices(small_spec) -> None:
    tr = TrainingConfig(global_batch=8, micro_batch=1)
    r = simulate_step(topology(), small_spec, tr, ParallelConfig(tp=2, pp=2, dp=2))
    assert r.trace_events == []
    assert sum(c.count for c in r.collectives if c.axis == "tp") > 0


def test_sequence_parallel_backward_regathers_and_hides_behind_dgrad(small_spec) -> None:
    """tp 8, SP, one stage: the exposed TP time is each collective's closed form, except the
    backward re-gathers, exposed only beyond their linear's dgrad GEMM (half its backward)."""
    tp, m = 8, 4
    tr = TrainingConfig(global_batch=m, micro_batch=1)
    par = ParallelConfig(tp=tp, sequence_parallel=True)
    topo = topology()
    r = simulate_step(topo, small_spec, tr, par)
    group = Group(topo, tuple(range(tp)))
    size = small_spec.seq_len * small_spec.hidden * ACT_BYTES

    def t(op: str, nbytes: float) -> float:
        return cost(CollectiveOp(op), int(nbytes), group).time_s

    model = ComputeModel(topo.device, "bf16")
    kw = dict(micro_batch=1, tp=tp, sequence_parallel=True)
    # the slowest of the 8 GPUs sets the pace of every compute step (compute.md 1a)
    from collsim.workload.kernels import slowest_gpu_factor

    pace = slowest_gpu_factor(tp)

    def paced(times):
        return dataclasses.replace(
            times,
            forward_s=times.forward_s * pace,
            backward_s=times.backward_s * pace,
            ops=tuple(dataclasses.replace(o, time_s=o.time_s * pace) for o in times.ops),
        )

    lt = paced(model.layer_times(small_spec, **kw))
    et = paced(model.embedding_times(small_spec, **kw))
    ht = paced(model.head_times(small_spec, **kw))

    def dgrad(times, name: str) -> float:
        return next(o.time_s for o in times.ops if o.name == name and o.phase == "backward") / 2

    ag, rs = t("all_gather", size), t("reduce_scatter", size)
    loss = 3 * t("all_reduce", small_spec.seq_len * 4)
    layer = 4 * (ag + rs) + sum(
        max(0.0, ag - min(dgrad(lt, n), lt.backward_s / 2)) for n in ("qkv_proj", "mlp_up")
    )
    head = ag + loss + rs + max(0.0, ag - dgrad(ht, "lm_head"))
    want = m * (small_spec.num_layers * layer + rs + head)
    assert r.breakdown_s["tp_exposed"] == pytest.approx(want, rel=1e-9)
    # the overlapped dgrad is compute, counted once
    compute = m * (
        small_spec.num_layers * (lt.forward_s + lt.backward_s)
        + et.forward_s
        + et.backward_s
        + ht.forward_s
        + ht.backward_s
    )
    assert r.breakdown_s["compute"] == pytest.approx(compute, rel=1e-9)
    gathers = next(c for c in r.collectives if c.axis == "tp" and c.op == "all_gather")
    assert gathers.count == m * (6 * small_spec.num_layers + 2)
    assert gathers.time_s == pytest.approx(gathers.count * ag, rel=1e-9)
    blocking = m * (small_spec.num_layers * 4 * (ag + rs) + rs + ag + loss + rs)
    regathers_exposed = r.breakdown_s["tp_exposed"] - blocking
    regathers_link = m * (2 * small_spec.num_layers + 1) * ag
    assert 0 <= regathers_exposed < regathers_link  # the dgrad GEMMs hide part of them


def test_vocab_parallel_loss_all_reduces_on_the_last_stage_only(small_spec) -> None:
    tr = TrainingConfig(global_batch=8, micro_batch=2)
    par = ParallelConfig(tp=2, pp=2, dp=2)
    engine = prepare_step(topology(), small_spec, tr, par)
    engine.run()
    m = 8 // (2 * 2)
    loss_size = 2 * small_spec.seq_len * 4.0  # micro-batch x seq fp32
    for rank in (0, 4):  # the stages' representatives (pp outermost: stage 1 from tp x dp)
        calls = sum(
            v.count
            for k, v in engine.stats.items()
            if k.rank == rank
            and k.axis == "tp"
            and k.op == "all_reduce"
            and k.size_bytes == loss_size
        )
        assert calls == (3 * m if rank == 4 else 0)
    no_tp = simulate_step(
        topology(),
        small_spec,
        TrainingConfig(global_batch=16, micro_batch=2),
        ParallelConfig(pp=2, dp=4),
    )
    assert not [c for c in no_tp.collectives if c.axis == "tp"]


def test_pipeline_gather_blocks_the_receiver(small_spec) -> None:
    """Without SP each received message is all-gathered over TP before its op; that time is
    pipeline communication (pp_exposed) on the receiving rank."""
    tr = TrainingConfig(global_batch=4, micro_batch=1)
    topo = topology()
    r = simulate_step(topo, small_spec, tr, ParallelConfig(tp=4, pp=2), trace=True)
    gathers = [e for e in r.trace_events if e.name.startswith("all_gather pp recv")]
    assert len(gathers) == 2 * 4  # stage 1: 4 forwards, stage 0: 4 backwards
    full = small_spec.seq_len * small_spec.hidden * ACT_BYTES
    one = cost(CollectiveOp.ALL_GATHER, full, Group(topo, (0, 1, 2, 3))).time_s
    for e in gathers:
        assert e.args["bytes"] == full and e.end_s - e.start_s == pytest.approx(one)
    last = r.breakdown_by_stage_s[1]
    assert last["pp_exposed"] >= 4 * one - 1e-12
    sp = simulate_step(
        topo, small_spec, tr, ParallelConfig(tp=4, pp=2, sequence_parallel=True), trace=True
    )
    assert not [e for e in sp.trace_events if e.name.startswith("all_gather pp recv")]


@pytest.mark.parametrize(
    "view, zero, dp, extra",
    [(False, 0, 8, True), (True, 0, 8, False), (False, 1, 8, False), (False, 0, 1, False)],
)
def test_ddp_bucket_tensors_double_the_gradients(
    small_spec, view: bool, zero: int, dp: int, extra: bool
) -> None:
    tr = TrainingConfig(global_batch=8, micro_batch=1)
    pp = 8 // dp
    par = ParallelConfig(pp=pp, dp=dp, zero=zero, ddp=DDPConfig(gradient_as_bucket_view=view))
    engine = prepare_step(topology(), small_spec, tr, par)
    engine.run()
    for prog in engine.programs.values():
        got = sum(e.delta_bytes for e in prog.ledger.events if e.label == "ddp buckets")
        assert got == (prog.stage.numel * 2.0 if extra else 0.0)
    if extra:
        r = simulate_step(topology(), small_spec, tr, par)
        viewed = simulate_step(
            topology(),
            small_spec,
            tr,
            ParallelConfig(pp=pp, dp=dp, zero=zero, ddp=DDPConfig(gradient_as_bucket_view=True)),
        )
        numel = engine.programs[0].stage.numel
        assert r.memory_peak_bytes - viewed.memory_peak_bytes == pytest.approx(2.0 * numel)
        assert r.memory_bytes["buffers"] >= 2.0 * numel


def test_scenario_reads_gradient_as_bucket_view(tmp_path: Path) -> None:
    from collsim.study.scenario import load_scenario

    path = tmp_path / "s.yaml"
    path.write_text(
        "name: s\ncluster: {topology: dgx_a100, nodes: 1}\n"
        "model: {preset: gpt3-125m}\ntraining: {global_batch: 8}\n"
        "parallel: {dp: 8, ddp: {gradient_as_bucket_view: true}}\n"
    )
    assert load_scenario(path).parallel.ddp.gradient_as_bucket_view is True
    assert (
        load_scenario(
            path, ["parallel.ddp.gradient_as_bucket_view=false"]
        ).parallel.ddp.gradient_as_bucket_view
        is False
    )


@pytest.mark.parametrize("zero", [0, 3])
def test_pipeline_and_data_parallel_traffic_is_on_its_threads(small_spec, zero: int) -> None:
    """Sends on the sender's pp thread, the same transfers on the receiver's ``pp recv``
    thread, DP / FSDP collectives on dp: each with bytes and algorithm."""
    tp, pp, dp, m = 2, 2, 2, 4
    tr = TrainingConfig(global_batch=m * dp, micro_batch=1)
    r = simulate_step(
        topology(), small_spec, tr, ParallelConfig(tp=tp, pp=pp, dp=dp, zero=zero), trace=True
    )
    p2p = small_spec.seq_len * small_spec.hidden * ACT_BYTES / tp
    sends = [e for e in r.trace_events if e.stream == "pp" and e.name.startswith("send")]
    recvs = [e for e in r.trace_events if e.stream == "pp recv"]
    assert len(sends) == len(recvs) == 2 * m  # m forwards 0->1, m backwards 1->0
    for e in sends + recvs:
        assert e.args["bytes"] == p2p and e.args["algorithm"] == "direct"
    assert sorted((e.start_s, e.end_s) for e in sends) == sorted(
        (e.start_s, e.end_s) for e in recvs
    )
    assert {e.rank for e in recvs if e.name.startswith("recv F")} == {tp * dp}  # stage 1
    assert {e.rank for e in recvs if e.name.startswith("recv B")} == {0}
    dps = [e for e in r.trace_events if e.stream == "dp"]
    ops = {e.args["op"] for e in dps}
    assert ops == ({"all_reduce"} if zero == 0 else {"all_gather", "reduce_scatter"})
    for e in dps:
        assert e.args["bytes"] > 0 and e.args["algorithm"] not in ("", "none")
        assert e.end_s > e.start_s
    stats = {(c.axis, c.op) for c in r.collectives}
    assert {("dp", op) for op in ops} <= stats and ("pp", "send_recv") in stats
