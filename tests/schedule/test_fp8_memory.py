"""FP8 memory as Transformer Engine and Megatron-Core hold it, by hand: FP8 parameters
(``--fp8-param-gather``, the ``megatron_te`` stack's FP8 default) replace the bf16 GEMM
weights, and the FP8 linears keep their inputs for the weight gradient in 1 byte."""

from __future__ import annotations

import warnings

import pytest

from collsim.cluster.topology import load_topology
from collsim.core.errors import CollsimWarning
from collsim.core.vocab import Dtype, RecomputeMode
from collsim.parallel.config import ParallelConfig, TrainingConfig
from collsim.parallel.plan import build_plan
from collsim.parallel.sharding import fp8_weight_bytes
from collsim.parallel.states import fp8_parameters, rank_model_states
from collsim.play.engine import simulate_step
from collsim.workload import get_preset
from collsim.workload.memory import activation_bytes_per_layer, fp8_saved_input_savings
from collsim.workload.ops import layer_ops

TOPO = load_topology("dgx_h100", nodes=2)
SPEC = get_preset("llama2-7b", num_layers=4, seq_len=2048)


def _plan(training: TrainingConfig, parallel: ParallelConfig):  # type: ignore[no-untyped-def]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", CollsimWarning)
        return build_plan(TOPO, SPEC, training, parallel, for_simulation=False)


@pytest.mark.parametrize(
    ("stack", "dtype", "zero", "expected"),
    [
        ("megatron_te", "fp8", 1, True),
        ("megatron_te", "fp8", 0, False),  # Megatron needs the distributed optimizer
        ("megatron_te", "bf16", 1, False),
        (None, "fp8", 1, False),
        ("megatron_te", "fp8", 3, False),  # zero 3: fsdp.fp8_all_gather instead
    ],
)
def test_fp8_parameters_follow_the_stack(
    stack: str | None, dtype: str, zero: int, expected: bool
) -> None:
    plan = _plan(
        TrainingConfig(global_batch=16, dtype=Dtype(dtype), stack=stack),
        ParallelConfig(dp=16, zero=zero),
    )
    assert fp8_parameters(plan) is expected


def test_fp8_parameters_replace_the_bf16_gemm_weights() -> None:
    plan = _plan(
        TrainingConfig(global_batch=16, dtype=Dtype.FP8, stack="megatron_te"),
        ParallelConfig(dp=16, zero=1),
    )
    r = rank_model_states(plan)
    gemm = r.dense_params - 2 * SPEC.vocab * SPEC.hidden  # the vocab matrices stay bf16
    # FP8 data + transpose (2 bytes) and 4 per-tensor scales per layer, less the bf16 weight
    assert r.fp8_copy_bytes == pytest.approx(
        fp8_weight_bytes(gemm, "tensorwise", num_tensors=16) - 2 * gemm
    )
    assert r.fp8_copy_bytes == pytest.approx(8.0 * 16)  # the scales only
    # bf16 weights + the copies: 2 bytes per parameter, as a bf16 plan
    assert r.states.parameters + r.fp8_copy_bytes == pytest.approx(2 * r.dense_params + 128)


def test_fp8_linear_inputs_kept_in_one_byte() -> None:
    b, s, h, tp = 1, SPEC.seq_len, SPEC.hidden, 2
    ops = layer_ops(SPEC, micro_batch=b, tp=tp, sequence_parallel=True, dtype="fp8")
    ffn = SPEC.ffn_hidden // tp
    heads = SPEC.num_heads // tp
    # 16-bit inputs of qkv (s b h / t with SP), out (s b heads d), up (s b h / t), down (s b f)
    inputs = 2 * (s * b * h / tp + s * b * heads * SPEC.head_dim + s * b * h / tp + s * b * ffn)
    assert fp8_saved_input_savings(ops, RecomputeMode.SELECTIVE, 2) == pytest.approx(inputs / 2)
    assert fp8_saved_input_savings(ops, RecomputeMode.FULL, 2) == 0.0
    bf16 = activation_bytes_per_layer(SPEC, micro_batch=b, tp=tp, sequence_parallel=True)
    fp8 = activation_bytes_per_layer(
        SPEC, micro_batch=b, tp=tp, sequence_parallel=True, dtype="fp8"
    )
    assert bf16 - fp8 == pytest.approx(inputs / 2)


def test_the_step_keeps_the_fp8_counts() -> None:
    par = ParallelConfig(dp=16, zero=1)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", CollsimWarning)
        bf16 = simulate_step(
            TOPO,
            SPEC,
            TrainingConfig(global_batch=16, stack="megatron_te", grad_reduce_dtype="bf16"),
            par,
            fidelity="fused",
        )
        fp8 = simulate_step(
            TOPO,
            SPEC,
            TrainingConfig(
                global_batch=16, stack="megatron_te", grad_reduce_dtype="bf16", dtype=Dtype.FP8
            ),
            par,
            fidelity="fused",
        )
    # one micro-batch in flight: the difference is one step's worth of layer savings
    ops = layer_ops(SPEC, micro_batch=1, dtype="fp8")
    saved = SPEC.num_layers * fp8_saved_input_savings(ops, RecomputeMode.NONE, 2)
    assert bf16.memory_bytes["activations"] - fp8.memory_bytes["activations"] == pytest.approx(
        saved
    )
    assert fp8.memory_bytes["parameters"] - bf16.memory_bytes["parameters"] == pytest.approx(
        8.0 * 16
    )
