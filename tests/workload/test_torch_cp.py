"""torch's context parallelism for SDPA, counted by hand: the SDPA calls of each rank (load
balanced or not), the bytes of the merges and of the backward accumulations, and the ops of
one layer (pytorch _context_parallel/_attention.py at 09b101c)."""

from __future__ import annotations

import pytest

from collsim.core.errors import ConfigError
from collsim.workload.torch_cp import (
    SdpaCall,
    accumulate_bytes,
    buffer_bytes,
    merge_bytes,
    merge_kernels,
    sdpa_calls,
    torch_cp_attention_ops,
)


def _shapes(calls: list[SdpaCall]) -> list[tuple[int, int, bool, bool]]:
    return [(c.q_tokens, c.k_tokens, c.causal, c.partial) for c in calls]


def test_load_balanced_calls_of_each_rank() -> None:
    # 4 ranks, 8 tokens each (two chunks of 4): step 0 causal on the own block; steps i <= rank
    # the whole query against the first half of the keys; steps i > rank the second half of
    # the queries against all the keys.
    assert _shapes(sdpa_calls(8, 4, rank=3)) == [(8, 8, True, False)] + [(8, 4, False, False)] * 3
    assert _shapes(sdpa_calls(8, 4, rank=0)) == [(8, 8, True, False)] + [(4, 8, False, True)] * 3
    assert _shapes(sdpa_calls(8, 4, rank=1)) == [
        (8, 8, True, False),
        (8, 4, False, False),
        (4, 8, False, True),
        (4, 8, False, True),
    ]
    assert sdpa_calls(8, 4) == sdpa_calls(8, 4, rank=3)  # the busiest rank by default


def test_every_rank_computes_the_same_causal_work() -> None:
    # score-matrix entries per rank: causal s_q^2 / 2 at step 0, q x k after; with s = 32
    # tokens on 4 ranks the causal total 32 x 32 / 2 = 512 splits into 128 per rank
    for rank in range(4):
        work = sum(
            c.q_tokens * c.k_tokens * (0.5 if c.causal else 1.0)
            for c in sdpa_calls(8, 4, rank=rank)
        )
        assert work == 128


def test_without_load_balancing_the_last_rank_computes_every_block() -> None:
    assert (
        _shapes(sdpa_calls(8, 4, rank=3, load_balance=False))
        == [(8, 8, True, False)] + [(8, 8, False, False)] * 3
    )
    assert _shapes(sdpa_calls(8, 4, rank=0, load_balance=False)) == [(8, 8, True, False)]
    assert len(sdpa_calls(8, 4, rank=2, load_balance=False)) == 3


def test_bad_ranks_and_odd_chunks_are_refused() -> None:
    with pytest.raises(ConfigError, match="rank"):
        sdpa_calls(8, 4, rank=4)
    with pytest.raises(ConfigError, match="cp_load_balance"):
        sdpa_calls(7, 2)


def test_merge_bytes_by_hand() -> None:
    # O = 100 output elements, L = 10 lse values, KV = 50 elements, bf16, cp = 3
    kw = {"cp": 3, "out_elements": 100.0, "lse_elements": 10.0, "kv_elements_local": 50.0}
    full = SdpaCall(8, 4, False)
    # step 0: K, V concatenated to send (50 x 4) + out to fp32 (100 x 6)
    assert merge_bytes(0, SdpaCall(8, 8, True), element_bytes=2, **kw) == 200 + 600
    # step 1: concat 200 + cast 600 + out update 100 x 32 + 10 x 24 + lse update 10 x 32
    assert merge_bytes(1, full, element_bytes=2, **kw) == 200 + 600 + 3200 + 240 + 320
    # last step: no concat, the final cast back 100 x 6
    assert merge_bytes(2, full, element_bytes=2, **kw) == 600 + 3200 + 240 + 320 + 600
    # a partial step updates half and copies the halves together (100 x 8 + 10 x 8)
    half = SdpaCall(4, 8, False, partial=True)
    assert merge_bytes(1, half, element_bytes=2, **kw) == 200 + 300 + 1600 + 120 + 160 + 880
    assert merge_kernels(0, full, cp=3) == 2
    assert merge_kernels(1, full, cp=3) == 10
    assert merge_kernels(2, half, cp=3) == 12


def test_accumulate_bytes_by_hand() -> None:
    kw = {"cp": 3, "q_elements": 80.0, "kv_elements_local": 50.0, "element_bytes": 2}
    # step 0: KV concat 200, fp32 zeros (80 + 50) x 4, dK dV += 50 x 10, dKV concat 50 x 8,
    # dQ += 80 x 10
    assert accumulate_bytes(0, SdpaCall(8, 8, True), **kw) == 200 + 520 + 500 + 400 + 800
    # step 1 on half the keys: half the dKV added (25 x 10) and the halves copied (50 x 8)
    assert accumulate_bytes(1, SdpaCall(8, 4, False), **kw) == 200 + 250 + 400 + 400 + 800
    # last step: no KV concat; dQ and dKV cast back (80 + 50) x 6
    assert accumulate_bytes(2, SdpaCall(8, 4, False), **kw) == 250 + 400 + 400 + 800 + 780
    # a partial step: the whole dKV added, half of dQ added and the halves copied (80 x 8)
    part = SdpaCall(4, 8, False, partial=True)
    assert accumulate_bytes(1, part, **kw) == 200 + 500 + 400 + 400 + 640


def test_layer_ops_one_sdpa_call_per_chunk() -> None:
    # s / cp = 32768 tokens, 16 heads of 128 on the rank, cp 8: 8 SDPA calls and 8 merges
    ops = torch_cp_attention_ops(
        micro_batch=1,
        local_tokens=32768,
        cp=8,
        heads=16,
        key_dim=128,
        value_dim=128,
        element_bytes=2,
    )
    names = [o.name for o in ops]
    assert names == ["flash_attention", "cp_lse_merge"] + ["cp_attention", "cp_lse_merge"] * 7
    sdpa = [o for o in ops if o.name != "cp_lse_merge"]
    assert [o.causal for o in sdpa] == [True] + [False] * 7
    assert [o.gemms[0].m for o in sdpa] == [32768] * 8
    assert [o.gemms[0].n for o in sdpa] == [32768] + [16384] * 7
    # each call 2 b h q k (d_k + d_v) with k halved by the mask at step 0: 2^42 FLOPs each,
    # cp x that = the causal attention of the whole sequence on 1 / cp of the queries
    per_call = 2.0 * 16 * 32768 * 16384 * 256
    assert all(o.flops == per_call for o in sdpa)
    assert sum(o.flops for o in sdpa) == 2.0 * 16 * 32768 * (8 * 32768 / 2) * 256
    # saved once: q, k, v of the rank (all 16 heads) and the lse
    assert ops[0].saved == {
        "q": 2 * 32768 * 16 * 128,
        "k": 2 * 32768 * 16 * 128,
        "v": 2 * 32768 * 16 * 128,
        "flash_attention.lse": 4 * 32768 * 16,
    }
    assert all(not o.saved for o in ops[1:])


def test_merge_ops_carry_their_eager_kernels() -> None:
    ops = torch_cp_attention_ops(
        micro_batch=1, local_tokens=64, cp=3, heads=2, key_dim=8, value_dim=8, element_bytes=2
    )
    merges = [o for o in ops if o.name == "cp_lse_merge"]
    # forward: concat + cast; concat + 9; 9 + final cast
    assert [o.kernels for o in merges] == [2, 10, 10]
    # backward: concat, 3 zeros, 2 adds, dKV concat, dQ add; concat, 2 adds + 2 copies, dKV
    # concat, dQ add; the same without the concat and with 3 casts at the last step
    assert [o.backward_kernels for o in merges] == [8, 7, 9]


def test_buffer_bytes_by_hand() -> None:
    # rank 3 of 4, 8 tokens (two chunks of 4), 2 heads of width 4 + 4, 2-byte elements:
    # KV = 8 x 2 x 8 = 128 elements, Q = O = 64, L = 16; calls (8, 8) causal, then (8, 4) x 3
    kw = {
        "micro_batch": 1,
        "local_tokens": 8,
        "cp": 4,
        "heads": 2,
        "key_dim": 4,
        "value_dim": 4,
        "element_bytes": 2,
    }
    # all-gather, forward: step 0 = gathered 4 KV + the local block (5 x 128 x 2 = 1280) +
    # SDPA out 64 x 2 + lse 16 x 4 + the fp32 out 64 x 4 = 1728; step i = gathered 1024 +
    # out 128 + lse 64 + merged fp32 (64 + 16) x 4 + fp32 block out 256 + two temporaries
    # 512 = 2304 (the peak). Backward: step 0 = 1280 + dQ fp32 256 + dq, dk, dv
    # (64 + 128) x 2 + fp32 dK, dV held and sent 2 x 128 x 4 = 2944; step i = 1024 + 256 +
    # (64 + 64) x 2 + 1024 + the accumulator rebuilt 512 = 3072.
    assert buffer_bytes(algorithm="torch_allgather", **kw) == (2304.0, 3072.0)
    # all-to-all: blocks held beside the rank's own, step 0: sent + received (2 x 128 x 2 =
    # 512), steps 1-2: attended + sent + received (768), step 3: attended (256)
    # forward: max(512 + 128 + 64 + 256, 768 + 128 + 64 + 1088) = 2048
    # backward: max(512 + 256 + 384 + 1024, 768 + 256 + 256 + 1536) = 2816
    assert buffer_bytes(algorithm="torch_alltoall", **kw) == (2048.0, 2816.0)
    with pytest.raises(ConfigError, match="cp_algorithm"):
        buffer_bytes(algorithm="ring", **kw)


def test_buffer_bytes_of_a_partial_rank() -> None:
    # rank 0 of 2 with load balancing: step 1 attends the second half of its 8 queries
    # against all 8 keys (partial), so the merge and the dQ accumulation rebuild the whole
    # tensor. KV = 128, Q = O = 64, L = 16 elements; 2-byte elements.
    kw = {"micro_batch": 1, "local_tokens": 8, "cp": 2, "heads": 2, "key_dim": 4}
    assert sdpa_calls(8, 2, rank=0)[1].partial
    got = buffer_bytes(algorithm="torch_allgather", value_dim=4, element_bytes=2, rank=0, **kw)
    # forward: step 0 = (2 + 1) x 128 x 2 + 128 + 64 + 256 = 1216; step 1 = gathered 512 +
    # out 32 x 2 + lse 8 x 4 + merged (64 + 16) x 4 + fp32 block out 32 x 4 + temporaries
    # 32 x 8 + the merged output anew 64 x 4 = 1568
    # backward: step 0 = 768 + 256 + (64 + 128) x 2 + 1024 = 2432; step 1 = 512 + dQ and its
    # rebuilt copy 2 x 256 + (32 + 128) x 2 + 1024 = 2368
    assert got == (1568.0, 2432.0)
