"""FP8 casts as Transformer Engine runs them (collsim.workload.fp8): cast bytes per step by
hand, with and without cached weights and FP8 parameters, and the stack's defaults."""

from __future__ import annotations

import pytest

from collsim.cluster.hardware import get_device
from collsim.core.errors import ConfigError
from collsim.workload import get_preset
from collsim.workload.compute import ComputeModel
from collsim.workload.fp8 import (
    FP8Casts,
    LinearShape,
    cast_bytes_per_step,
    fp8_param_gather_of,
    quantize_bytes,
    weight_cache_of,
)

# One dense GPT layer, h 1024, ffn 4096, 2048 tokens per micro-batch, tp 1:
# input m x k, weight k x n, output m x n of each linear
LAYER = [
    LinearShape("qkv_proj", m=2048, n=3072, k=1024),
    LinearShape("out_proj", m=2048, n=1024, k=1024),
    LinearShape("mlp_up", m=2048, n=4096, k=1024),
    LinearShape("mlp_down", m=2048, n=1024, k=4096),
]
# by hand: inputs 2048 x (1024 + 1024 + 1024 + 4096) = 14,680,064
#          weights 1024 x 3072 + 1024^2 + 1024 x 4096 + 4096 x 1024 = 12,582,912
#          outputs 2048 x (3072 + 1024 + 4096 + 1024) = 18,874,368
INPUTS, WEIGHTS, OUTPUTS = 14_680_064, 12_582_912, 18_874_368
M = 8  # micro-batches per step


def test_element_counts_by_hand() -> None:
    assert sum(s.input_elements for s in LAYER) == INPUTS
    assert sum(s.weight_elements for s in LAYER) == WEIGHTS
    assert sum(s.output_elements for s in LAYER) == OUTPUTS


def test_quantize_bytes_per_element() -> None:
    # delayed: read 2, write rowwise 1 + columnwise 1; current scaling: + an amax pass (2)
    assert quantize_bytes("delayed") == 4.0
    assert quantize_bytes("tensorwise") == 6.0
    # mxfp8: + one E8M0 scale per 32 elements of each copy
    assert quantize_bytes("mxfp8") == pytest.approx(2 + 2 * (1 + 1 / 32))
    # delayed fused into the norm: the norm writes 1 byte instead of 2, then a transpose (1 + 1)
    assert quantize_bytes("delayed", fused=True) == 1.0
    # current scaling fused: the amax comes from the norm, one cast kernel reads 2 writes 2
    assert quantize_bytes("tensorwise", fused=True) == 4.0


def test_cast_bytes_per_step_by_hand() -> None:
    delayed = FP8Casts(recipe="delayed")
    # every micro-batch casts inputs, weights and output gradients: 4 B per element each
    assert cast_bytes_per_step(LAYER, delayed, num_microbatches=M) == 8 * 4 * 46_137_344
    assert 8 * 4 * 46_137_344 == 1_476_395_008
    # weights cached across micro-batches (is_first_microbatch): once per step
    cached = FP8Casts(recipe="delayed", weight_cache=True)
    assert cast_bytes_per_step(LAYER, cached, num_microbatches=M) == (
        8 * 4 * (INPUTS + OUTPUTS) + 4 * WEIGHTS
    )
    assert 8 * 4 * (INPUTS + OUTPUTS) + 4 * WEIGHTS == 1_124_073_472
    # FP8 parameters over a shard of 8: the master shard cast (read 4, write 1) and a transpose
    params = FP8Casts(recipe="delayed", param_gather=True)
    got = cast_bytes_per_step(LAYER, params, num_microbatches=M, shard=8)
    assert got == 1_073_741_824 + 5 * WEIGHTS / 8 + 2 * WEIGHTS == 1_106_771_968
    # current scaling without a cache: 6 B per element everywhere
    current = FP8Casts(recipe="tensorwise")
    assert cast_bytes_per_step(LAYER, current, num_microbatches=M) == 8 * 6 * 46_137_344
    # fusing the QKV and MLP-up input casts into the norms saves 3 B on those inputs
    fused = FP8Casts(recipe="delayed", fused_norm=True)
    saved = 8 * 3 * (2048 * 1024 + 2048 * 1024)
    assert cast_bytes_per_step(LAYER, fused, num_microbatches=M) == 1_476_395_008 - saved


def test_cache_and_fp8_params_save_more_with_more_microbatches() -> None:
    plain = FP8Casts(recipe="tensorwise")
    cached = FP8Casts(recipe="tensorwise", weight_cache=True)
    for m in (1, 4, 64):
        saved = cast_bytes_per_step(LAYER, plain, num_microbatches=m) - cast_bytes_per_step(
            LAYER, cached, num_microbatches=m
        )
        assert saved == 6 * WEIGHTS * (m - 1)


def test_stack_defaults_and_rules() -> None:
    assert weight_cache_of("megatron_te", None) is True
    assert weight_cache_of("torchtitan", None) is False
    assert weight_cache_of("megatron_te", False) is False
    assert weight_cache_of("megatron_te", None, zero=3) is False  # no workspace under FSDP2
    assert fp8_param_gather_of("megatron_te", None, fp8=True, zero=1) is True
    assert fp8_param_gather_of("megatron_te", None, fp8=True, zero=0) is False
    assert fp8_param_gather_of("megatron_te", None, fp8=False, zero=1) is False
    assert fp8_param_gather_of("torchtitan", None, fp8=True, zero=3) is False
    with pytest.raises(ConfigError, match="needs training.dtype: fp8"):
        fp8_param_gather_of(None, True, fp8=False, zero=1)
    with pytest.raises(ConfigError, match="sharded optimizer") as info:
        fp8_param_gather_of("megatron_te", True, fp8=True, zero=0)
    assert info.value.key_path == "training.fp8_param_gather"
    with pytest.raises(ConfigError, match="training.fp8_recipe|must be one of"):
        FP8Casts(recipe="int8")


def test_compute_model_casts_cost_less_cached_and_experts_run_in_fp8() -> None:
    device = get_device("h100")
    spec = get_preset("llama2-7b")
    torchao = ComputeModel(device, "fp8").layer_times(spec, micro_batch=1)
    every = ComputeModel(device, "fp8", fp8_casts=FP8Casts()).layer_times(spec, micro_batch=1)
    cached = ComputeModel(
        device, "fp8", fp8_casts=FP8Casts(weight_cache=True, fused_norm=True)
    ).layer_times(spec, micro_batch=1)
    assert cached.forward_s < every.forward_s
    assert cached.backward_s == pytest.approx(every.backward_s)
    assert torchao.fp8_weights == (0.0, 0.0, 0)
    dense, expert, linears = cached.fp8_weights
    h, f = spec.hidden, spec.ffn_hidden
    assert linears == 4 and expert == 0
    assert dense == h * 3 * h + h * h + h * 2 * f + f * h  # QKV, out, gated up, down
    moe = get_preset("qwen3-30b-a3b", num_layers=2, seq_len=1024)
    te = ComputeModel(device, "fp8", fp8_casts=FP8Casts(weight_cache=True))
    eff = {
        c.name: c.matmul_efficiency
        for c in te.layer_times(moe, micro_batch=1, layer=1, ep=8).ops
        if c.phase == "forward"
    }
    ao = {
        c.name: c.matmul_efficiency
        for c in ComputeModel(device, "fp8").layer_times(moe, micro_batch=1, layer=1, ep=8).ops
        if c.phase == "forward"
    }
    assert te.layer_times(moe, micro_batch=1, layer=1, ep=8).fp8_weights[1] > 0
    assert eff["expert_up"] != ao["expert_up"]  # the TE path runs the experts in FP8


def test_fp8_ceilings_apply_the_clock_and_the_power_derate_once() -> None:
    """MAMF_fp8 x the sustained clock fraction, x (P / P_ref)^(1/3) below the MAMF's power:
    the same factors as bf16, so the FP8 / bf16 ceiling ratio is the MAMF ratio."""
    h100 = ComputeModel(get_device("h100"), "fp8")
    assert h100.matmul_peak_flops == pytest.approx(1402.6e12 * 0.735)
    derated = ComputeModel(get_device("h100_96gb"), "fp8")
    assert derated.matmul_peak_flops == pytest.approx(1402.6e12 * 0.735 * (500 / 700) ** (1 / 3))
    bf16 = ComputeModel(get_device("h100_96gb"), "bf16")
    assert derated.matmul_peak_flops / bf16.matmul_peak_flops == pytest.approx(1402.6 / 794.5)
