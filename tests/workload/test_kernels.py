"""Kernel tables, FP8 casts, framework costs and interference (figures from
reference/compute.md, copied into the modules with their sources)."""

from __future__ import annotations

import pytest

from collsim.cluster.hardware import get_device
from collsim.core.errors import ConfigError
from collsim.workload import ComputeModel, get_preset
from collsim.workload.framework import framework_costs
from collsim.workload.interference import overlap_slowdown, slowed_compute_s
from collsim.workload.kernels import attention_rate_flops, hbm_efficiency
from collsim.workload.ops import Gemm


def test_attention_tables_reproduce_the_published_points() -> None:
    # compute.md 2b: FA3 causal hdim 128 forward at 2k = 521, cuDNN 484; 2c: FA3 bwd 128 2k = 501
    assert attention_rate_flops(
        "hopper", "flash3", "fwd", causal=True, head_dim=128, seq_len=2048
    ) == pytest.approx(521e12)
    assert attention_rate_flops(
        "hopper", "cudnn", "fwd", causal=True, head_dim=128, seq_len=2048
    ) == pytest.approx(484e12)
    assert attention_rate_flops(
        "hopper", "flash3", "bwd", causal=False, head_dim=128, seq_len=2048
    ) == pytest.approx(501e12)


def test_a100_fwd_bwd_split_keeps_the_published_combined_rate() -> None:
    # compute.md 2a: FA2 causal hdim 128 fwd+bwd at 2k on A100 = 155 TFLOP/s (bwd = 2.5 fwd FLOPs)
    f = attention_rate_flops("ampere", "flash2", "fwd", causal=True, head_dim=128, seq_len=2048)
    b = attention_rate_flops("ampere", "flash2", "bwd", causal=True, head_dim=128, seq_len=2048)
    assert f is not None and b is not None
    assert 3.5 / (1 / f + 2.5 / b) == pytest.approx(155e12, rel=1e-9)


def test_log_interpolation_between_columns() -> None:
    # between 2k (298) and 4k (319): at 2896 (the log midpoint) the geometric mean
    r = attention_rate_flops("hopper", "flash2", "fwd", causal=True, head_dim=128, seq_len=2896)
    assert r == pytest.approx((298 * 319) ** 0.5 * 1e12, rel=2e-3)


def test_flash3_on_ampere_is_a_config_error() -> None:
    with pytest.raises(ConfigError, match="Hopper only"):
        attention_rate_flops("ampere", "flash3", "fwd", causal=True, head_dim=128, seq_len=2048)


def test_hbm_efficiency_follows_calculon_steps() -> None:
    assert hbm_efficiency(500e6) == 0.9
    assert hbm_efficiency(1e7) == pytest.approx(0.75)
    assert hbm_efficiency(1e6) == pytest.approx(0.6)
    assert hbm_efficiency(1e3) == 0.3
    assert hbm_efficiency(3e6) > hbm_efficiency(2e6)


def test_h100_fa2_is_about_half_as_fast_as_the_old_mamf_share() -> None:
    # compute.md 2e: the old 0.84 / 0.72 x MAMF model made H100 attention 2x FA2
    spec = get_preset("llama2-7b")
    old = ComputeModel(get_device("h100"), "bf16", attention_kernel="flash2")
    t = old.layer_times(spec, micro_batch=1)
    fwd = next(c for c in t.ops if c.name == "flash_attention" and c.phase == "forward")
    mamf = 794.5e12 * 0.84
    assert fwd.flops / fwd.time_s < 0.5 * mamf


def test_eager_attention_keeps_the_scores() -> None:
    spec = get_preset("gpt3-1.3b")
    device = get_device("a100")
    fused = ComputeModel(device, attention_kernel="flash2").layer_times(spec, micro_batch=4)
    eager = ComputeModel(device, attention_kernel="eager").layer_times(spec, micro_batch=4)
    assert fused.attention_kernel == "flash2" and eager.attention_kernel == "eager"
    assert eager.activation_bytes > 2 * fused.activation_bytes


def test_fp8_speedups_match_torchao_microbenchmarks() -> None:
    # compute.md 1c: float8 linear fwd+bwd vs bf16 on H100: 0.80x at 1024,2048,1024 and 1.39x at
    # 4096,8192,16384 (M,K,N), LayerNorm and sigmoid around it in both
    h100 = get_device("h100")

    def step(dtype: str, m: int, k: int, n: int) -> float:
        model = ComputeModel(h100, dtype)
        from collsim.workload.ops import _matmul

        op = _matmul("mlp_up", Gemm(m, n, k), 2, {})
        lin = model.op_cost(op, "forward").time_s + model.op_cost(op, "backward").time_s
        ln_sig = model.memory_time_s(2 * 2 * m * k) + model.memory_time_s(2 * 2 * m * n)
        return lin + 3 * ln_sig

    small = step("bf16", 1024, 2048, 1024) / step("fp8", 1024, 2048, 1024)
    large = step("bf16", 4096, 8192, 16384) / step("fp8", 4096, 8192, 16384)
    assert small < 1.0 < large
    assert large == pytest.approx(1.39, rel=0.15)


@pytest.mark.xfail(
    strict=True,
    reason="known gap: the model gives 0.54x for the small FP8 linear where torchao measured "
    "0.80x (compute.md 1c); the large point is within 15 %",
)
def test_fp8_small_gemm_speedup_matches_torchao() -> None:
    """The small point held to the large point's bound (15 %): it fails today (0.54 / 0.80),
    and a fix of the model turns this strict expected failure into a failure to remove."""
    h100 = get_device("h100")
    from collsim.workload.ops import _matmul

    def step(dtype: str, m: int, k: int, n: int) -> float:
        model = ComputeModel(h100, dtype)
        op = _matmul("mlp_up", Gemm(m, n, k), 2, {})
        lin = model.op_cost(op, "forward").time_s + model.op_cost(op, "backward").time_s
        ln_sig = model.memory_time_s(2 * 2 * m * k) + model.memory_time_s(2 * 2 * m * n)
        return lin + 3 * ln_sig

    small = step("bf16", 1024, 2048, 1024) / step("fp8", 1024, 2048, 1024)
    assert small == pytest.approx(0.80, rel=0.15)


def test_overlap_slowdown_matches_the_published_average() -> None:
    # compute.md 4: average 18.9 %, max 40 % (A100/H100); NCCL 16 SMs on a DGX
    h100, a100 = get_device("h100"), get_device("a100")
    f_h = overlap_slowdown(h100, busbw_bps=360e9, memory_bound_share=0.1)
    f_a = overlap_slowdown(a100, busbw_bps=230e9, memory_bound_share=0.1)
    assert 1.12 < f_h < 1.25 and 1.12 < f_a < 1.25
    assert overlap_slowdown(h100, busbw_bps=360e9) == pytest.approx(1 / (1 - 16 / 132))
    assert overlap_slowdown(h100, busbw_bps=0.0) == 1.0
    assert overlap_slowdown(h100, busbw_bps=360e9, memory_bound_share=1.0) < 1.40 + 0.5


def test_slowed_compute_by_hand() -> None:
    # 10 ms of compute beside a 4 ms collective at factor 1.25: 4 ms at 0.8 speed (3.2 ms of
    # work), then 6.8 ms at full speed
    assert slowed_compute_s(10e-3, 4e-3, 1.25) == pytest.approx(10.8e-3)
    assert slowed_compute_s(2e-3, 4e-3, 1.25) == pytest.approx(2.5e-3)


def test_framework_costs_fp32_reduction_and_fsdp_terms() -> None:
    model = ComputeModel(get_device("h100"), "bf16")
    spec = get_preset("llama2-7b")
    unit = 202e6
    fp32 = framework_costs(
        model,
        unit_params=unit,
        local_params=6.7e9 / 8,
        dp=8,
        zero=3,
        grad_reduce_dtype="fp32",
        spec=spec,
    )
    bf16 = framework_costs(
        model,
        unit_params=unit,
        local_params=6.7e9 / 8,
        dp=8,
        zero=3,
        grad_reduce_dtype="bf16",
        fsdp_version=2,
    )
    assert fp32.grad_reduce_bytes_per_element == 4.0 and bf16.grad_reduce_bytes_per_element == 2.0
    assert fp32.fsdp_grad_cast_s > 0 and bf16.fsdp_grad_cast_s == 0
    assert fp32.fsdp_copy_bytes == pytest.approx(unit / 8 * 6)  # fp32 shard -> bf16: read 4 write 2
    assert bf16.fsdp_copy_bytes == pytest.approx(unit / 8 * 6 + unit * 4)  # + FSDP2 copy-out
    assert fp32.grad_clip_s > 0 and fp32.optimizer_s > 0 and fp32.loss_s > 0
    ddp = framework_costs(model, unit_params=unit, local_params=6.7e9, dp=8, zero=0)
    assert ddp.fsdp_copy_in_s == 0 and ddp.fsdp_grad_cast_s == 0
    foreach = model.optimizer_time_s(1e9, "adam", "foreach")
    assert foreach > 2.5 * model.optimizer_time_s(1e9, "adam", "fused")


def test_slowest_gpu_factor() -> None:
    from collsim.workload.kernels import slowest_gpu_factor

    assert slowest_gpu_factor(1) == 1.0
    # 8 GPUs over a 5 % band: the slowest at 1/9 of it, 0.05 x (1/2 - 1/9) = 1.94 % below typical
    assert slowest_gpu_factor(8) == pytest.approx(1 / (1 - 0.05 * (0.5 - 1 / 9)))
    assert slowest_gpu_factor(8) < slowest_gpu_factor(512) < 1 / (1 - 0.025)
    with pytest.raises(ConfigError):
        slowest_gpu_factor(0)
