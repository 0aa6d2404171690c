from __future__ import annotations

import pytest

from collsim.workload import (
    ComputeModel,
    get_preset,
    hardware_flops_per_step,
    hfu,
    mfu,
    model_flops_per_step,
    model_tflops_per_gpu,
    narayanan_hardware_flops,
    narayanan_model_flops,
)
from collsim.workload.ops import OpKind

from .conftest import FakeDevice

# Assumptions under which the per-op sum equals Narayanan's closed forms (stated in flops.py):
# only matmul FLOPs; ffn = 4h; multi-head attention; the full s x s score matrix; backward =
# 2 x forward; the LM head is h -> V and is not recomputed; the embedding lookup is free.
GPT = [
    "gpt3-175b",
    "megatron-22b",
    "megatron-1.7b",
    "megatron-7.5b",
    "megatron-39.1b",
    "megatron-1t",
]


@pytest.mark.parametrize("name", GPT)
def test_per_op_sum_equals_narayanan(name: str) -> None:
    spec = get_preset(name)
    assert model_flops_per_step(spec, 512) == pytest.approx(
        narayanan_model_flops(spec, 512), rel=1e-12
    )
    assert hardware_flops_per_step(spec, 512, "full") == pytest.approx(
        narayanan_hardware_flops(spec, 512), rel=1e-12
    )


def test_compute_model_ops_sum_to_the_closed_form(a100: FakeDevice) -> None:
    # Sum the FLOPs of every matmul op the compute model times, over the 8 TP ranks, all
    # layers, forward + backward, plus the LM head: Narayanan's 72 B s l h^2 (...).
    spec = get_preset("gpt3-175b")
    model = ComputeModel(a100, "bf16")
    b, t = 2, 8
    layer = model.layer_times(spec, micro_batch=b, tp=t)
    head = model.head_times(spec, micro_batch=b, tp=1)
    matmul = sum(c.flops for c in layer.ops if c.kind is OpKind.MATMUL) * t * spec.num_layers
    matmul += sum(c.flops for c in head.ops if c.kind is OpKind.MATMUL)
    assert matmul == pytest.approx(narayanan_model_flops(spec, b), rel=1e-12)
    full = model.layer_times(spec, micro_batch=b, tp=t, recompute="full")
    again = (
        sum(c.flops for c in full.ops if c.kind is OpKind.MATMUL and c.phase == "recompute")
        * t
        * spec.num_layers
    )
    assert matmul + again == pytest.approx(narayanan_hardware_flops(spec, b), rel=1e-12)


def test_selective_recompute_adds_the_attention_matmuls() -> None:
    spec = get_preset("megatron-22b")
    b, s, h, l = 8, spec.seq_len, spec.hidden, spec.num_layers
    extra = hardware_flops_per_step(spec, b, "selective") - model_flops_per_step(spec, b)
    assert extra == pytest.approx(4 * b * s * s * h * l, rel=1e-12)  # QK^T and AV forward


def test_llama_flops_about_6_n_tokens() -> None:
    # For s << 6h the step is ~ 6 x params x tokens (Kaplan 2020) plus attention.
    spec = get_preset("llama2-7b")
    tokens = 1024 * spec.seq_len
    ratio = model_flops_per_step(spec, 1024) / (6 * spec.num_parameters() * tokens)
    assert 1.0 < ratio < 1.0 + spec.seq_len / (6 * spec.hidden) + 0.01


def test_mfu_and_hfu() -> None:
    spec = get_preset("megatron-22b")
    flops = model_flops_per_step(spec, 64)
    step = flops / (8 * 156e12)  # 8 GPUs each doing 156 TFLOP/s of model work
    assert model_tflops_per_gpu(spec, 64, step, 8) == pytest.approx(156.0)
    assert mfu(spec, 64, step, 8, 312e12) == pytest.approx(0.5)
    ratio = narayanan_hardware_flops(spec, 64) / narayanan_model_flops(spec, 64)
    assert hfu(spec, 64, step, 8, 312e12, recompute="full") == pytest.approx(0.5 * ratio)
