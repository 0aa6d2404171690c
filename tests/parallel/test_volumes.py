"""EP, CP, HSDP and FP8 volumes against hand computations."""

from __future__ import annotations

import pytest

from collsim.core.errors import ConfigError
from collsim.parallel.context import cp_volumes, kv_block_bytes
from collsim.parallel.moe import ep_step_bytes_per_rank, ep_volumes
from collsim.parallel.sharding import (
    DELAYED_AMAX_HISTORY,
    fp8_weight_bytes,
    fsdp_all_gather_bytes,
    hsdp_gradient_volumes,
)


def test_ep_dispatch_combine_by_hand() -> None:
    # DeepSeek-V3 plan row: micro-batch 1 x seq 4096 on a tp 1, cp 1 rank; top-8; h 7168;
    # bf16; ep 64.
    t, k, h, e, ep = 4096, 8, 7168, 2, 64
    v = ep_volumes(tokens=t, top_k=k, hidden=h, element_bytes=e, ep=ep)
    per_a2a = t * k * h * e * (ep - 1) / ep  # 469,762,048 x 63 / 64
    assert v.dispatch_bytes == v.combine_bytes == per_a2a == 462_422_016.0
    assert v.forward_bytes == 2 * per_a2a
    assert v.backward_bytes == v.forward_bytes
    assert v.all_to_all_size_bytes == t * k * h * e
    # a step: 58 MoE layers of DeepSeek-V3 on one PP stage of 15 of them, 32 micro-batches
    step = ep_step_bytes_per_rank(v, moe_layers=15, microbatches=32)
    assert step == 2 * 2 * per_a2a * 15 * 32
    assert (
        ep_step_bytes_per_rank(v, moe_layers=1, microbatches=1, recompute=True) == 3 * 2 * per_a2a
    )


def test_ep_one_moves_nothing_and_etp_adds_gathers() -> None:
    v = ep_volumes(tokens=1000, top_k=2, hidden=64, element_bytes=2, ep=1)
    assert v.forward_bytes == 0 and v.etp_bytes == 0
    v = ep_volumes(tokens=1000, top_k=2, hidden=64, element_bytes=2, ep=4, etp=2)
    assert v.etp_bytes == 2 * 1000 * 2 * 64 * 2 * (2 - 1)
    with pytest.raises(ConfigError):
        ep_volumes(tokens=1, top_k=1, hidden=1, element_bytes=2, ep=2, load_imbalance=0.9)


def test_ring_attention_bytes_by_hand() -> None:
    # Llama 3 405B: s 131072, cp 16, tp 8, 8 kv heads of 128, bf16, micro-batch 1.
    block = kv_block_bytes(
        micro_batch=1,
        seq_len=131072,
        cp=16,
        kv_heads=8,
        key_dim=128,
        value_dim=128,
        element_bytes=2,
        tp=8,
    )
    assert block == 8192 * 1 * 256 * 2  # s/cp tokens x 1 kv head x (k + v) 256 x 2 bytes
    ring = cp_volumes(block, cp=16, algorithm="ring")
    assert (ring.steps, ring.collective_size_bytes) == (15, block)
    assert ring.forward_bytes == 15 * block and ring.backward_bytes == 2 * 15 * block
    ag = cp_volumes(block, cp=16, algorithm="all_gather")
    assert ag.collective_size_bytes == 16 * block
    assert ag.forward_bytes == 15 * block == ag.backward_bytes


def test_mla_kv_block_uses_both_widths() -> None:
    block = kv_block_bytes(
        micro_batch=1,
        seq_len=4096,
        cp=2,
        kv_heads=128,
        key_dim=192,
        value_dim=128,
        element_bytes=2,
    )
    assert block == 2048 * 128 * (192 + 128) * 2
    assert cp_volumes(block, cp=1).forward_bytes == 0
    with pytest.raises(ConfigError) as info:
        cp_volumes(block, cp=2, algorithm="tree")
    assert info.value.key_path == "parallel.cp_algorithm"


def test_hsdp_reduce_scatter_inside_all_reduce_across() -> None:
    # 1e9 parameters, fp32 reduction, shard 8 inside a node, 4 replicas
    v = hsdp_gradient_volumes(1e9, element_bytes=4, shard=8, replicate=4)
    assert v.reduce_scatter_size_bytes == 4e9
    assert v.reduce_scatter_bytes == 4e9 * 7 / 8
    assert v.all_reduce_size_bytes == 4e9 / 8
    assert v.all_reduce_bytes == 2 * (4e9 / 8) * 3 / 4
    # full shard over 32: no all-reduce; the reduce-scatter over the 32
    full = hsdp_gradient_volumes(1e9, element_bytes=4, shard=32, replicate=1)
    assert full.all_reduce_bytes == 0 and full.reduce_scatter_bytes == 4e9 * 31 / 32
    # HSDP sends less across nodes than an all-reduce over all 32 would in total
    assert v.total_bytes < 2 * 4e9 * 31 / 32


def test_fsdp_all_gather_fp8_and_reshard() -> None:
    size, got = fsdp_all_gather_bytes(1e9, shard=8)
    assert size == 2e9 and got == 2 * 2e9 * 7 / 8
    size, got = fsdp_all_gather_bytes(1e9, shard=8, fp8=True, reshard_after_forward=False)
    assert size == 1e9 and got == 1e9 * 7 / 8


def test_fp8_copies_and_scales() -> None:
    n = 4096 * 4096
    assert fp8_weight_bytes(n, "tensorwise", num_tensors=1) == 2 * n + 8
    assert fp8_weight_bytes(n, "delayed", num_tensors=1) == 2 * n + 4 * (2 + DELAYED_AMAX_HISTORY)
    assert fp8_weight_bytes(n, "blockwise") == 2 * (n + 4 * n / (128 * 128))
    assert fp8_weight_bytes(n, "mxfp8") == 2 * (n + n / 32)
    assert fp8_weight_bytes(n, "tensorwise", transpose_copy=False) == n + 8
    with pytest.raises(ConfigError) as info:
        fp8_weight_bytes(n, "nvfp4")
    assert info.value.key_path == "training.fp8_recipe"
