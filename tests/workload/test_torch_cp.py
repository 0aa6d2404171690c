"""torch's context parallelism for SDPA, counted by hand: the SDPA calls of each rank (load
balanced or not), the bytes of the merges and of the backward accumulations, and the ops of
one layer (pytorch _context_parallel/_attention.py at 09b101c)."""

from __future__ import annotations

import pytest

from collsim.core.errors import ConfigError
from collsim.workload.torch_cp import (
    SdpaCall,
    accumulate_bytes,
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
