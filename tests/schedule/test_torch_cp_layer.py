"""One layer under torch's context parallelism against a hand computation: the CP steps of
the step program are the SDPA calls with their merges, the KV all-gather (or the rotation)
beside the calls it overlaps, the fp32 dK, dV rotation in backward with the last one exposed,
and the pass keeps its total compute (pytorch _context_parallel/_attention.py at 09b101c)."""

from __future__ import annotations

import warnings

import pytest

from collsim.cluster.topology import load_topology
from collsim.core.errors import CollsimWarning
from collsim.parallel.config import ParallelConfig, TrainingConfig
from collsim.parallel.plan import build_plan
from collsim.play.engine import simulate_step
from collsim.play.walk import estimate_step
from collsim.step.build import build_schedule
from collsim.step.pricing import ClosedPricer, SegmentPrices
from collsim.workload import get_preset


def _schedule(algorithm: str, cp: int = 4):  # type: ignore[no-untyped-def]
    spec = get_preset("llama3-8b", num_layers=2, seq_len=32768)
    topology = load_topology("dgx_h100", nodes=2)
    training = TrainingConfig(global_batch=4, micro_batch=1)
    parallel = ParallelConfig(
        tp=2, cp=cp, dp=8 // cp, sequence_parallel=True, cp_algorithm=algorithm
    )
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", CollsimWarning)
        plan = build_plan(topology, spec, training, parallel)
        return plan, build_schedule(topology, spec, training, parallel, plan=plan)


@pytest.mark.parametrize("algorithm", ["torch_allgather", "torch_alltoall"])
def test_one_layer_by_hand(algorithm: str) -> None:
    plan, sched = _schedule(algorithm)
    blk = sched.layer
    fwd_chunks, bwd_chunks = blk.cp_chunks_s
    assert len(fwd_chunks) == len(bwd_chunks) == 4  # one SDPA call per KV chunk
    chunk = sched.stages[0].chunks[0]
    fwd, bwd = chunk.forward[1], chunk.backward[-2]  # layer 0 (after the embedding)
    assert fwd.key == bwd.key == 0
    # the pass keeps its compute total: plain steps plus the compute beside collectives
    assert fwd.compute_s == pytest.approx(blk.forward_s, rel=1e-12)
    assert bwd.compute_s == pytest.approx(blk.backward_s, rel=1e-12)
    # hand prices of the exchange: K and V of 32768 / 4 tokens x 32 / 2 heads x 256 x 2 B
    block = 8192 * 16 * 256 * 2
    pricer = ClosedPricer(plan.topology)
    cp_group = plan.group_of(0, "cp")
    pair = (cp_group[0], cp_group[1])
    t_kv = pricer.cost("send_recv", block, pair).time_s
    t_dkv = pricer.cost("send_recv", 2 * block, pair).time_s
    t_ag = pricer.cost("all_gather", 4 * block, cp_group).time_s
    if algorithm == "torch_allgather":
        hand_fwd_cp = max(t_ag, fwd_chunks[0]) + sum(fwd_chunks[1:])
        hand_bwd_cp = max(t_ag, bwd_chunks[0]) + sum(max(t_dkv, c) for c in bwd_chunks[1:]) + t_dkv
    else:
        hand_fwd_cp = sum(max(t_kv, c) for c in fwd_chunks[:3]) + fwd_chunks[3]
        t_both = pricer.cost("send_recv", 3 * block, pair).time_s
        hand_bwd_cp = (
            max(t_kv, bwd_chunks[0])
            + sum(max(t_both, c) for c in bwd_chunks[1:3])
            + max(t_dkv, bwd_chunks[3])
            + t_dkv
        )
    prices = SegmentPrices(plan, pricer)  # no slowdown of the compute beside the calls
    cp_steps = [st for st in fwd.steps if st.axis == "cp" and st.op]
    got_fwd = sum(prices.step_s(0, st) for st in cp_steps) + sum(fwd_chunks[len(cp_steps) :])
    assert got_fwd == pytest.approx(hand_fwd_cp, rel=1e-9)
    cp_b = [st for st in bwd.steps if st.axis == "cp" and st.op]
    assert len(cp_b) == 5  # the KV exchange and dKV at 3 steps, then the last dKV, exposed
    assert sum(prices.step_s(0, st) for st in cp_b) == pytest.approx(hand_bwd_cp, rel=1e-9)


def test_torch_exchanges_every_query_head() -> None:
    # torchtitan repeats the 8 KV heads to all 32 before SDPA: torch's exchange carries 4 x
    # the heads of Transformer Engine's ring (kv_heads / tp = 4 against heads / tp = 16)
    _, ring = _schedule("ring")
    _, torch = _schedule("torch_allgather")
    ring_steps = [st for st in ring.stages[0].chunks[0].forward[1].steps if st.axis == "cp"]
    torch_steps = [st for st in torch.stages[0].chunks[0].forward[1].steps if st.axis == "cp"]
    ring_bytes = sum(st.size_bytes for st in ring_steps)
    (gather,) = torch_steps
    assert ring_bytes == 3 * 8192 * 4 * 256 * 2
    assert gather.op == "all_gather" and gather.size_bytes == 4 * 8192 * 16 * 256 * 2


@pytest.mark.parametrize(
    ("algorithm", "zero", "recompute"),
    [
        ("torch_allgather", 0, "none"),
        ("torch_allgather", 3, "full"),
        ("torch_alltoall", 1, "full"),
    ],
)
def test_buffers_in_memory_in_both_fidelities(algorithm: str, zero: int, recompute: str) -> None:
    # the attention's buffers (collsim.workload.torch_cp.buffer_bytes) held by the layer's
    # segments: K and V of 8192 tokens x 16 heads x 256 (E = 2), O, Q = 8192 x 16 x 128
    spec = get_preset("llama3-8b", num_layers=2, seq_len=32768)
    topology = load_topology("dgx_h100", nodes=2)
    training = TrainingConfig(global_batch=4, micro_batch=1, recompute=recompute)
    parallel = ParallelConfig(
        tp=2, cp=4, dp=2, sequence_parallel=True, cp_algorithm=algorithm, zero=zero
    )
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", CollsimWarning)
        sched = build_schedule(topology, spec, training, parallel)
        closed = estimate_step(topology, spec, training, parallel)
        fused = simulate_step(topology, spec, training, parallel, fidelity="fused")
        layer = simulate_step(topology, spec, training, parallel, fidelity="layer")
    kv, o = 8192 * 16 * 256, 8192 * 16 * 128
    lse = 8192 * 16
    if algorithm == "torch_allgather":
        # rank 3, step i > 0: gathered 4 KV x 2 + out o 2 + lse 4 + merged (O + L) 4 +
        # fp32 block out 4 + two temporaries 8; backward: gathered + dQ 4 + dq 2 + dk, dv of
        # half the keys 2 + dK, dV held, sent and rebuilt 12
        fwd = 4 * kv * 2 + o * 2 + lse * 4 + (o + lse) * 4 + o * 4 + o * 8
        bwd = 4 * kv * 2 + o * 4 + o * 2 + kv // 2 * 2 + kv * 12
    else:
        # steps 1-2: the attended, sent and received blocks 3 KV x 2
        fwd = 3 * kv * 2 + o * 2 + lse * 4 + (o + lse) * 4 + o * 4 + o * 8
        bwd = 3 * kv * 2 + o * 4 + o * 2 + kv // 2 * 2 + kv * 12
    assert sched.layer.cp_buffer_bytes == (fwd, bwd)
    chunk = sched.stages[0].chunks[0]
    assert chunk.forward[1].buffer_bytes == fwd
    assert chunk.backward[-2].buffer_bytes == bwd  # >= the recomputed forward's
    assert [s.buffer_bytes for s in chunk.forward if s.key in ("embedding", "head")] == [0.0] * 2
    for des in (fused, layer):
        assert des.memory_peak_bytes == closed.memory_peak_bytes
        assert des.memory_bytes == closed.memory_bytes
        assert des.memory_reserved_bytes == closed.memory_reserved_bytes
    assert (closed.allocator or {}).get("unmatched_bytes") == 0
