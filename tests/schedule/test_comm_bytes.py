"""Bytes the step moves, read from the engine's counters, against the volume formulas.

EP dispatch + combine (collsim.parallel.moe), ring attention and all-gather KV
(collsim.parallel.context) and the HSDP reduce-scatter inside + all-reduce across
(collsim.parallel.sharding). The DES tests run the layer fidelity on one node and read
``FlowNetwork.bytes_sent`` of rank 0 at the end of its last backward: with ``ddp.overlap``
off the gradient reduction starts only after it, so what rank 0 has sent by then is the
traffic of the segments alone.
"""

from __future__ import annotations

import warnings

import pytest

from collsim.cluster.topology import load_topology
from collsim.core.errors import CollsimWarning
from collsim.parallel.config import DDPConfig, FSDPConfig, ParallelConfig, TrainingConfig
from collsim.parallel.context import cp_volumes, kv_block_bytes
from collsim.parallel.moe import ep_volumes
from collsim.parallel.sharding import hsdp_gradient_volumes
from collsim.play.engine import simulate_step
from collsim.play.engine.step import prepare_step
from collsim.workload import get_preset


@pytest.fixture(autouse=True)
def _quiet():  # type: ignore[no-untyped-def]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", CollsimWarning)
        yield


def _sent_before_reduction(topo, spec, training, parallel) -> float:  # type: ignore[no-untyped-def]
    """Bytes rank 0 has sent on the DES when its last backward op ends."""
    first = prepare_step(topo, spec, training, parallel, fidelity="layer", trace=True)
    first.run()
    t_end = max(
        ev.end_s
        for ev in first.trace_events
        if ev.rank == 0 and ev.stream == "compute" and ev.name != "optimizer"
    )
    engine = prepare_step(topo, spec, training, parallel, fidelity="layer")
    seen: dict[int, float] = {}

    def watch():  # type: ignore[no-untyped-def]
        yield engine.env.timeout(t_end)
        assert engine.pricer.network is not None
        seen.update(engine.pricer.network.bytes_sent)

    engine.env.process(watch())
    engine.run()
    return seen.get(0, 0.0)


def test_ep_dispatch_and_combine_bytes_on_the_network() -> None:
    topo = load_topology("dgx_h100", nodes=1)
    spec = get_preset("qwen3-30b-a3b", num_layers=2, seq_len=1024)
    m = 2
    training = TrainingConfig(global_batch=8 * m, micro_batch=1)
    parallel = ParallelConfig(dp=8, ep=8, ddp=DDPConfig(overlap=False))
    sent = _sent_before_reduction(topo, spec, training, parallel)
    v = ep_volumes(tokens=1024, top_k=spec.moe_top_k, hidden=spec.hidden, element_bytes=2, ep=8)
    # forward 2 T k h e (ep - 1) / ep per MoE layer, backward the same again
    assert v.forward_bytes == 2 * 1024 * spec.moe_top_k * spec.hidden * 2 * 7 / 8
    assert v.backward_bytes == v.forward_bytes
    assert sent == pytest.approx((v.forward_bytes + v.backward_bytes) * spec.num_layers * m)


def test_ep_calls_per_step_and_full_recompute() -> None:
    """The call counters: 2 all-to-alls per MoE layer in forward, 2 in backward, 2 more with a
    full recompute; dense-first layers have none (DeepSeek-V3's first_k_dense)."""
    topo = load_topology("dgx_h100", nodes=1)
    spec = get_preset("deepseek-v3", num_layers=4, seq_len=512)  # first 3 dense, 1 MoE
    assert [spec.is_moe_layer(i) for i in range(4)] == [False, False, False, True]
    for recompute, per_layer in (("none", 4), ("full", 6)):
        training = TrainingConfig(global_batch=8, micro_batch=1, recompute=recompute)
        r = simulate_step(topo, spec, training, ParallelConfig(dp=8, ep=8), fidelity="fused")
        (a2a,) = [c for c in r.collectives if c.axis == "ep"]
        assert a2a.op == "all_to_all" and a2a.group_size == 8
        assert a2a.size_bytes == 512 * spec.moe_top_k * spec.hidden * 2
        assert a2a.count == per_layer * 1  # one MoE layer, one micro-batch
        assert r.breakdown_s["ep_exposed"] > 0


@pytest.mark.parametrize("algorithm", ["ring", "all_gather"])
def test_cp_kv_bytes_on_the_network(algorithm: str) -> None:
    topo = load_topology("dgx_h100", nodes=1)
    spec = get_preset("llama2-7b", num_layers=2, seq_len=4096)
    m, cp = 2, 8
    training = TrainingConfig(global_batch=m, micro_batch=1)
    parallel = ParallelConfig(dp=1, cp=cp, cp_algorithm=algorithm, ddp=DDPConfig(overlap=False))
    sent = _sent_before_reduction(topo, spec, training, parallel)
    block = kv_block_bytes(
        micro_batch=1,
        seq_len=4096,
        cp=cp,
        kv_heads=spec.kv_heads,
        key_dim=spec.head_dim,
        value_dim=spec.head_dim,
        element_bytes=2,
    )
    assert block == 4096 / cp * spec.kv_heads * 2 * spec.head_dim * 2
    v = cp_volumes(block, cp=cp, algorithm=algorithm)
    # ring: (cp - 1) blocks forward, 2 (cp - 1) backward; all-gather: (cp - 1) each way
    expected = {"ring": 3 * (cp - 1) * block, "all_gather": 2 * (cp - 1) * block}[algorithm]
    assert v.forward_bytes + v.backward_bytes == expected
    assert sent == pytest.approx(expected * spec.num_layers * m)


def test_cp_ring_hides_behind_attention_and_gradients_reduce_over_dp_cp() -> None:
    topo = load_topology("dgx_h100", nodes=1)
    spec = get_preset("llama2-7b", num_layers=2, seq_len=32768)
    training = TrainingConfig(global_batch=2, micro_batch=1)
    r = simulate_step(topo, spec, training, ParallelConfig(dp=2, cp=4), fidelity="fused")
    ring = [c for c in r.collectives if c.axis == "cp"]
    assert ring and all(c.op == "send_recv" for c in ring)
    # 32 K tokens: each block's attention outlasts its NVLink send
    assert r.breakdown_s["cp_exposed"] < 0.05 * sum(c.time_s for c in ring)
    dp = [c for c in r.collectives if c.axis == "dp"]
    assert {c.group_size for c in dp} == {8}  # dp x cp


def test_causal_load_balancing_evens_the_attention() -> None:
    topo = load_topology("dgx_h100", nodes=1)
    spec = get_preset("llama2-7b", num_layers=2, seq_len=32768)
    training = TrainingConfig(global_batch=2, micro_batch=1)
    kw = dict(dp=2, cp=4)
    even = simulate_step(topo, spec, training, ParallelConfig(**kw), fidelity="fused")
    skew = simulate_step(
        topo, spec, training, ParallelConfig(**kw, cp_load_balance=False), fidelity="fused"
    )
    assert skew.breakdown_s["compute"] > even.breakdown_s["compute"]


def _hsdp_run(reduce_dtype: str | None = None, fp8: bool = False):  # type: ignore[no-untyped-def]
    topo = load_topology("dgx_h100", nodes=2)
    spec = get_preset("llama2-7b", num_layers=2, seq_len=1024)
    training = TrainingConfig(global_batch=16, micro_batch=1, dtype="fp8" if fp8 else "bf16")
    fsdp = FSDPConfig(shard_group_size=8, reduce_dtype=reduce_dtype, fp8_all_gather=fp8)
    parallel = ParallelConfig(dp=16, zero=3, fsdp=fsdp)
    return simulate_step(topo, spec, training, parallel, fidelity="fused"), spec


def test_hsdp_reduce_scatter_inside_all_reduce_across() -> None:
    r, spec = _hsdp_run()
    rs = [c for c in r.collectives if c.op == "reduce_scatter"]
    ar = [c for c in r.collectives if c.op == "all_reduce" and c.axis == "dp"]
    assert {c.group_size for c in rs} == {8} and {c.group_size for c in ar} == {2}
    from collsim.workload.memory import parameters_per_rank

    params = parameters_per_rank(spec, tp=1, pp=1)
    v = hsdp_gradient_volumes(params, element_bytes=2, shard=8, replicate=2)
    # one micro-batch per replica: every unit reduced once
    assert sum(c.total_bytes for c in rs) == pytest.approx(v.reduce_scatter_size_bytes)
    assert sum(c.total_bytes for c in ar) == pytest.approx(v.all_reduce_size_bytes)
    assert {c.size_bytes / 8 for c in rs} == {c.size_bytes for c in ar}
    gathers = [c for c in r.collectives if c.op == "all_gather"]
    assert {c.group_size for c in gathers} == {8}  # parameters gathered inside only


def test_fp32_reduction_doubles_and_fp8_gather_halves() -> None:
    base, _ = _hsdp_run()
    fp32, _ = _hsdp_run(reduce_dtype="fp32")
    fp8, _ = _hsdp_run(fp8=True)

    def total(r, op: str) -> float:  # type: ignore[no-untyped-def]
        return sum(c.total_bytes for c in r.collectives if c.op == op and c.axis == "dp")

    assert total(fp32, "reduce_scatter") == pytest.approx(2 * total(base, "reduce_scatter"))
    assert total(fp8, "all_gather") == pytest.approx(total(base, "all_gather") / 2)
