from __future__ import annotations

import math

import pytest

from collsim.core.errors import ConfigError
from collsim.workload import ComputeModel, get_preset, shape_efficiency
from collsim.workload.ops import SELECTIVE_OPS, Gemm, OpKind, layer_ops

from .conftest import FakeDevice

SPEC = get_preset("megatron-22b")


def test_shape_efficiency_formula() -> None:
    # 8192^3 on 108 SMs: 64 x 64 = 4096 tiles in 38 waves (4104 slots); k 8192 / (8192 + 128)
    expected = 4096 / 4104 * 8192 / 8320
    assert shape_efficiency(Gemm(8192, 8192, 8192), 108) == pytest.approx(expected, rel=1e-12)


def test_wave_quantization_halves_one_tile_over() -> None:
    full_wave = Gemm(128 * 108, 128, 4096)  # exactly 108 tiles: one full wave
    one_over = Gemm(128 * 109, 128, 4096)  # 109 tiles: a second, almost empty wave
    ratio = shape_efficiency(one_over, 108) / shape_efficiency(full_wave, 108)
    assert ratio == pytest.approx(109 / 216, rel=1e-12)


def test_thin_gemm_runs_below_mamf() -> None:
    assert shape_efficiency(Gemm(2048, 2048, 64), 108) < 0.35  # k = head_dim 64
    assert shape_efficiency(Gemm(100, 4096, 4096), 108) < 0.8  # m = 100 pads to 128


def test_elementwise_op_is_bytes_over_bandwidth_plus_launch(a100: FakeDevice) -> None:
    model = ComputeModel(a100, "bf16", launch_s=5e-6, memory_efficiency=0.8)
    times = model.layer_times(SPEC, micro_batch=4, tp=8)
    cost = next(c for c in times.ops if c.name == "softmax" and c.phase == "forward")
    # fused scale+mask+softmax: read and write b (a/t) s^2 16-bit elements
    size = 2 * 2 * 4 * 8 * 2048 * 2048
    assert cost.size_bytes == size
    assert cost.time_s == pytest.approx(size / (2.039e12 * 0.8) + 5e-6, rel=1e-12)
    assert cost.bound == "memory"


def test_large_gemm_runs_near_mamf(a100: FakeDevice) -> None:
    model = ComputeModel(a100, "bf16", launch_s=0.0)
    time_s, bound, achieved = model.gemm_time_s(Gemm(8192, 8192, 8192))
    assert bound == "compute"
    assert achieved == pytest.approx(a100.matmul_efficiency * 4096 / 4104 * 8192 / 8320)
    assert time_s == pytest.approx(2 * 8192**3 / (312e12 * achieved))


def test_backward_is_twice_the_matmul_flops(a100: FakeDevice) -> None:
    for op in layer_ops(SPEC, micro_batch=2, tp=4):
        if op.kind is OpKind.MATMUL:
            assert op.backward_flops == 2 * op.flops
            assert sum(g.flops for g in op.backward_gemms) == 2 * op.flops
        else:
            assert op.backward_bytes == 2 * op.size_bytes


def test_per_rank_matmul_flops_split_by_tp() -> None:
    def total(tp: int) -> float:
        return sum(
            o.flops for o in layer_ops(SPEC, micro_batch=1, tp=tp) if o.kind is OpKind.MATMUL
        )

    assert total(8) * 8 == pytest.approx(total(1), rel=1e-12)


@pytest.mark.parametrize("sp", [False, True], ids=["tp", "tp+sp"])
def test_recompute_modes(a100: FakeDevice, sp: bool) -> None:
    model = ComputeModel(a100, "bf16")
    none = model.layer_times(SPEC, micro_batch=4, tp=8, sequence_parallel=sp)
    sel = model.layer_times(SPEC, micro_batch=4, tp=8, sequence_parallel=sp, recompute="selective")
    full = model.layer_times(SPEC, micro_batch=4, tp=8, sequence_parallel=sp, recompute="full")
    assert none.recompute_s == 0
    assert full.recompute_s == pytest.approx(full.forward_s, rel=1e-12)
    core = sum(c.time_s for c in none.ops if c.phase == "forward" and c.name in SELECTIVE_OPS)
    assert sel.recompute_s == pytest.approx(core, rel=1e-12)
    assert 0 < sel.recompute_s < 0.25 * none.forward_s
    assert none.forward_s == sel.forward_s == full.forward_s
    assert none.backward_s == sel.backward_s == full.backward_s
    assert full.activation_bytes < sel.activation_bytes < none.activation_bytes


def test_sequence_parallel_splits_the_norms(a100: FakeDevice) -> None:
    # a constant bandwidth share and no host floor, so that bytes / 8 is time / 8
    model = ComputeModel(
        a100, "bf16", launch_s=0.0, memory_efficiency=0.85, execution="cuda_graphs"
    )
    plain = model.layer_times(SPEC, micro_batch=4, tp=8)
    split = model.layer_times(SPEC, micro_batch=4, tp=8, sequence_parallel=True)

    def norm(times: object) -> float:
        return next(
            c.time_s
            for c in times.ops  # type: ignore[attr-defined]
            if c.name == "attn_norm" and c.phase == "forward"
        )

    assert norm(split) == pytest.approx(norm(plain) / 8, rel=1e-12)
    assert split.forward_s < plain.forward_s


def test_overrides_replace_modelled_times(a100: FakeDevice) -> None:
    base = ComputeModel(a100, "bf16").layer_times(SPEC, micro_batch=4, tp=8, recompute="full")
    model = ComputeModel(a100, "bf16", overrides={"qkv_proj": 1e-3, "mlp_up.backward": 2e-3})
    times = model.layer_times(SPEC, micro_batch=4, tp=8, recompute="full")
    by_key = {(c.name, c.phase): c for c in times.ops}
    old = {(c.name, c.phase): c for c in base.ops}
    assert by_key["qkv_proj", "forward"].time_s == 1e-3
    assert by_key["qkv_proj", "forward"].bound == "override"
    assert by_key["qkv_proj", "recompute"].time_s == 1e-3
    assert by_key["mlp_up", "backward"].time_s == 2e-3
    assert times.forward_s == pytest.approx(
        base.forward_s - old["qkv_proj", "forward"].time_s + 1e-3, rel=1e-12
    )
    assert times.backward_s == pytest.approx(
        base.backward_s - old["mlp_up", "backward"].time_s + 2e-3, rel=1e-12
    )


def test_op_names_cover_every_op() -> None:
    from collsim.workload.ops import OP_NAMES, embedding_ops, head_ops

    seen = set()
    for spec in (SPEC, get_preset("llama3-8b"), get_preset("deepseek-v3")):
        for build in (layer_ops, embedding_ops, head_ops):
            seen |= {op.name for op in build(spec, micro_batch=1, tp=8)}
    torch_cp = layer_ops(
        get_preset("llama3-8b"), micro_batch=1, tp=8, cp=2, cp_algorithm="torch_allgather"
    )
    seen |= {op.name for op in torch_cp}
    # GPT (unfused, dropout), Llama (flash, rotary), DeepSeek-V3 (MLA, routed + shared experts),
    # Llama under torch's context parallelism (an SDPA call per KV chunk, merges)
    assert seen == set(OP_NAMES)


def test_gated_mlp_is_three_matrices() -> None:
    spec = get_preset("llama3-8b")
    ops = {o.name: o for o in layer_ops(spec, micro_batch=1, tp=1)}
    tokens, h, f = spec.seq_len, spec.hidden, spec.ffn_hidden
    assert ops["mlp_up"].flops == 2 * tokens * h * 2 * f  # gate and up, one fused GEMM
    assert ops["mlp_down"].flops == 2 * tokens * f * h
    # GQA: q has 32 heads of 128, k and v 8 each
    assert ops["qkv_proj"].flops == 2 * tokens * h * (32 + 16) * 128
    assert "attn_dropout" not in ops and "rotary" in ops


def test_embedding_and_head_times(a100: FakeDevice) -> None:
    model = ComputeModel(a100, "bf16")
    head = model.head_times(SPEC, micro_batch=4, tp=8)
    emb = model.embedding_times(SPEC, micro_batch=4, tp=8)
    lm = next(c for c in head.ops if c.name == "lm_head" and c.phase == "forward")
    assert lm.flops == 2 * 4 * 2048 * 6144 * (51200 // 8)
    assert head.forward_s > lm.time_s > 0
    assert emb.forward_s > 0 and emb.backward_s > 0 and emb.recompute_s == 0


def test_optimizer_time_is_adam_bytes_over_bandwidth(a100: FakeDevice) -> None:
    model = ComputeModel(a100, "bf16", launch_s=0.0, memory_efficiency=0.85)
    # mixed-precision Adam moves 30 bytes per parameter (see optimizer_bytes_per_param)
    assert model.optimizer_time_s(7e9) == pytest.approx(7e9 * 30 / (2.039e12 * 0.85))
    fp32 = ComputeModel(a100, "fp32", launch_s=0.0, memory_efficiency=0.85)
    assert fp32.optimizer_time_s(7e9, "adam") == pytest.approx(7e9 * 28 / (2.039e12 * 0.85))
    assert model.optimizer_time_s(0) == 0.0


@pytest.mark.parametrize(
    ("call", "match"),
    [
        (lambda d: ComputeModel(d, "int4"), "bf16, fp16, fp32, fp8"),
        (
            lambda d: ComputeModel(d).layer_times(SPEC, micro_batch=1, recompute="half"),
            "none, selective, full",
        ),
        (lambda d: ComputeModel(d).layer_times(SPEC, micro_batch=1, tp=5), "divisible by tp"),
        (lambda d: ComputeModel(d).optimizer_time_s(1e9, "lion"), "adam, sgd"),
        (lambda d: ComputeModel(d, overrides={"softmax": -1.0}), ">= 0 seconds"),
        (
            lambda d: ComputeModel(d, overrides={"qkv": 1.0}),
            "unknown op 'qkv'; valid ops: attn_norm",
        ),
    ],
    ids=["dtype", "recompute", "tp", "optimizer", "override", "override-name"],
)
def test_bad_input_raises_config_error(a100: FakeDevice, call, match: str) -> None:  # type: ignore[no-untyped-def]
    with pytest.raises(ConfigError, match=match):
        call(a100)


def test_fp8_halves_gemm_time_of_large_matmuls() -> None:
    device = FakeDevice(
        peak_flops={"bf16": 989e12, "fp8": 1979e12, "fp32": 67e12},
        name="H100 SXM",
        matmul_efficiency=0.8,
    )
    bf16 = ComputeModel(device, "bf16", launch_s=0.0).gemm_time_s(Gemm(8192, 8192, 8192))[0]
    fp8 = ComputeModel(device, "fp8", launch_s=0.0).gemm_time_s(Gemm(8192, 8192, 8192))[0]
    assert fp8 == pytest.approx(bf16 * 989 / 1979, rel=1e-9)
    assert math.isfinite(fp8)


def test_flash_attention_time(a100: FakeDevice) -> None:
    from collsim.workload.op_costs import FLASH_BACKWARD_EFFICIENCY, FLASH_FORWARD_EFFICIENCY

    spec = get_preset("llama2-7b")  # 32 heads of 128, seq 4096
    model = ComputeModel(a100, "bf16", launch_s=0.0)
    times = model.layer_times(spec, micro_batch=1, tp=1, recompute="selective")
    fwd = next(c for c in times.ops if c.name == "flash_attention" and c.phase == "forward")
    bwd = next(c for c in times.ops if c.name == "flash_attention" and c.phase == "backward")
    flops = 4 * 32 * 4096**2 * 128 / 2  # causal half of QK^T and AV
    ctas = 32 * 4096 // 128  # 1024 CTAs in 10 waves of 108
    wave = 1024 / 1080
    mamf = 312e12 * a100.matmul_efficiency
    assert fwd.flops == flops and bwd.flops == 2.5 * flops
    assert fwd.time_s == pytest.approx(flops / (mamf * FLASH_FORWARD_EFFICIENCY * wave))
    assert bwd.time_s == pytest.approx(2.5 * flops / (mamf * FLASH_BACKWARD_EFFICIENCY * wave))
    assert ctas == 1024
    assert times.recompute_s == 0  # nothing to recompute selectively with flash


@pytest.mark.parametrize("key", ["a100", "h100", "h200", "b200", "cpu"])
def test_catalogue_devices(key: str) -> None:
    from collsim.cluster.hardware import get_device

    device = get_device(key)
    model = ComputeModel(device, "bf16")
    times = model.layer_times(get_preset("gpt3-1.3b"), micro_batch=1, tp=1)
    assert times.forward_s > 0 and times.backward_s > times.forward_s
    # no op beats the device's best-shape matmul rate
    assert max(c.matmul_efficiency for c in times.ops) <= device.matmul_efficiency


def test_accepts_the_config_enums(a100: FakeDevice) -> None:
    from collsim.parallel.config import Dtype, Recompute

    by_enum = ComputeModel(a100, Dtype.BF16).layer_times(
        SPEC, micro_batch=1, tp=8, recompute=Recompute.FULL
    )
    by_str = ComputeModel(a100, "bf16").layer_times(SPEC, micro_batch=1, tp=8, recompute="full")
    assert by_enum == by_str
