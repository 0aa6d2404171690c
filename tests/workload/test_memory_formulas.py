from __future__ import annotations

import pytest

from collsim.core.errors import ConfigError
from collsim.workload import (
    ComputeModel,
    activation_bytes_per_layer,
    get_preset,
    korthikanti_activation_bytes,
    model_state_bytes,
    parameters_per_rank,
)
from collsim.workload.memory import layers_per_stage

from .conftest import FakeDevice

PSI = 1_000_000_000


@pytest.mark.parametrize(
    ("zero", "n", "bytes_per_param"),
    [
        # ZeRO paper, mixed-precision Adam, K = 12
        (0, 8, 4 + 12),  # DDP: 16 Psi
        (1, 8, 4 + 12 / 8),  # optimizer states sharded
        (2, 8, 2 + (2 + 12) / 8),  # + gradients
        (3, 8, (4 + 12) / 8),  # + parameters (FSDP full shard)
        (3, 64, 16 / 64),  # N = 64: 0.25 bytes per parameter
        (1, 64, 4 + 12 / 64),
    ],
    ids=["ddp", "zero1", "zero2", "zero3", "zero3-64", "zero1-64"],
)
def test_zero_formulas_mixed_adam(zero: int, n: int, bytes_per_param: float) -> None:
    states = model_state_bytes(PSI, zero=zero, dp=n)
    assert states.total == pytest.approx(bytes_per_param * PSI, rel=1e-15)


@pytest.mark.parametrize(
    ("zero", "bytes_per_param"),
    [
        (0, 16),
        (1, 8 + 8 / 8),
        (2, 4 + 12 / 8),
        (3, 16 / 8),
    ],
    ids=["ddp", "zero1", "zero2", "zero3"],
)
def test_zero_formulas_fp32_adam(zero: int, bytes_per_param: float) -> None:
    states = model_state_bytes(PSI, zero=zero, dp=8, mixed_precision=False)
    assert states.total == pytest.approx(bytes_per_param * PSI, rel=1e-15)


def test_seed_7b_fp32_adam() -> None:
    # 7e9 params x (4 param + 4 grad + 8 Adam m, v) = 112 GB per GPU with DDP ...
    ddp = model_state_bytes(7e9, zero=0, dp=8, mixed_precision=False)
    assert ddp.total == 112e9
    assert (ddp.parameters, ddp.gradients, ddp.optimizer) == (28e9, 28e9, 56e9)
    # ... and 14 GB of model states per GPU fully sharded over 8
    assert model_state_bytes(7e9, zero=3, dp=8, mixed_precision=False).total == 14e9


def test_model_state_errors() -> None:
    with pytest.raises(ConfigError, match="0, 1, 2, 3"):
        model_state_bytes(PSI, zero=4)
    with pytest.raises(ConfigError, match="adam, sgd"):
        model_state_bytes(PSI, optimizer="adagrad")


CONFIGS = [
    ("megatron-22b", 4, 8),  # Korthikanti Table 4 setting
    ("gpt3-175b", 1, 8),
    ("megatron-530b", 1, 8),
    ("gpt3-125m", 2, 1),  # no tensor parallelism: sbh(34 + 5as/h)
    ("gpt3-1.3b", 3, 4),
]


@pytest.mark.parametrize("recompute", ["none", "selective", "full"])
@pytest.mark.parametrize("sp", [False, True], ids=["nosp", "sp"])
@pytest.mark.parametrize(("name", "b", "t"), CONFIGS, ids=[c[0] for c in CONFIGS])
def test_per_op_activation_sum_equals_korthikanti(
    name: str, b: int, t: int, sp: bool, recompute: str, a100: FakeDevice
) -> None:
    spec = get_preset(name)
    closed = korthikanti_activation_bytes(
        seq_len=spec.seq_len,
        micro_batch=b,
        hidden=spec.hidden,
        num_heads=spec.num_heads,
        tp=t,
        sequence_parallel=sp,
        recompute=recompute,
    )
    per_op = activation_bytes_per_layer(
        spec, micro_batch=b, tp=t, sequence_parallel=sp, recompute=recompute
    )
    assert per_op == pytest.approx(closed, rel=1e-12)
    layer = ComputeModel(a100, "bf16").layer_times(
        spec, micro_batch=b, tp=t, sequence_parallel=sp, recompute=recompute
    )
    assert layer.activation_bytes == pytest.approx(closed, rel=1e-12)


def test_korthikanti_22b_table_values() -> None:
    # sbh = 2048 * 4 * 6144; 5as/h = 5 * 64 * 2048 / 6144 = 106.67
    sbh = 2048 * 4 * 6144
    got = korthikanti_activation_bytes(seq_len=2048, micro_batch=4, hidden=6144, num_heads=64)
    assert got == pytest.approx(sbh * (34 + 5 * 64 * 2048 / 6144))


def test_llama_activation_counts_gqa_swiglu_and_flash() -> None:
    spec = get_preset("llama2-70b")  # 64 heads, 8 kv heads, ffn 28672, no dropout, flash
    s, b, h, f, t = spec.seq_len, 1, spec.hidden, spec.ffn_hidden, 8
    got = activation_bytes_per_layer(
        spec, micro_batch=b, tp=t, sequence_parallel=True, recompute="selective"
    )
    kv = 2 * s * b * (8 // t) * 128 * 2  # k and v of one kv head per rank
    expected = (
        s * b * h * 2 / t * 4  # two norm inputs, qkv and mlp inputs
        + s * b * h * 2 / t  # q
        + kv
        + s * b * h * 2 / t  # out_proj input
        + 2 * s * b * f * 2 / t  # SwiGLU keeps gate and up outputs
        + s * b * f * 2 / t  # mlp_down input
        + 4 * b * 64 // t * s
    )  # flash log-sum-exp, fp32 per row
    assert got == pytest.approx(expected, rel=1e-12)
    # flash attention keeps no s x s tensor, so selective recompute has nothing to drop
    assert got == activation_bytes_per_layer(spec, micro_batch=b, tp=t, sequence_parallel=True)


def test_layers_per_stage() -> None:
    assert layers_per_stage(96, 8) == [12] * 8
    assert layers_per_stage(105, 8) == [14] + [13] * 7
    with pytest.raises(ConfigError):
        layers_per_stage(4, 8)


def test_parameters_per_rank_add_up() -> None:
    spec = get_preset("llama2-7b")  # untied head
    assert parameters_per_rank(spec) == spec.num_parameters()
    stages = sum(parameters_per_rank(spec, pp=4, stage=i) for i in range(4))
    assert stages == spec.num_parameters()
    # TP 8: everything but the norms is split; norms (2 per layer + final) replicated
    replicated = (2 * spec.num_layers + 1) * spec.hidden
    split = sum(parameters_per_rank(spec, tp=8) for _ in range(8))
    assert split == pytest.approx(spec.num_parameters() + 7 * replicated, rel=1e-12)


def test_tied_head_is_copied_to_the_last_stage() -> None:
    spec = get_preset("gpt3-175b")
    stages = [parameters_per_rank(spec, tp=8, pp=8, stage=i) for i in range(8)]
    word = spec.vocab * spec.hidden / 8
    assert stages[-1] - stages[1] == pytest.approx(word + spec.norm_parameters())
    assert stages[0] - stages[1] == pytest.approx(word + spec.seq_len * spec.hidden)


def test_layer_parameters_per_rank() -> None:
    from collsim.workload.memory import layer_parameters_per_rank

    spec = get_preset("gpt3-175b")
    h = spec.hidden
    assert layer_parameters_per_rank(spec, 1) == spec.layer_parameters()
    # TP 8: 12h^2 weights and the column-parallel biases (3h + 4h) split; the row-parallel
    # biases (2h) and two LayerNorms (4h) replicated
    assert layer_parameters_per_rank(spec, 8) == pytest.approx(
        (12 * h * h + 7 * h) / 8 + 6 * h, rel=1e-15
    )
