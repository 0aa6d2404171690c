"""The schedule's model states (what both fidelities allocate at time 0) equal the closed form
of :func:`collsim.parallel.states.rank_model_states` for MoE, CP, HSDP and FP8 plans."""

from __future__ import annotations

import warnings

import pytest

from collsim.cluster.topology import load_topology
from collsim.core.errors import CollsimWarning
from collsim.parallel.config import FSDPConfig, ParallelConfig, TrainingConfig
from collsim.parallel.states import rank_model_states
from collsim.play.walk import estimate_step
from collsim.step.build import build_schedule
from collsim.workload import get_preset

PLANS = [
    ("qwen3-30b-a3b", "bf16", dict(pp=2, dp=8, ep=8, zero=1)),
    ("qwen3-30b-a3b", "bf16", dict(pp=2, dp=8, ep=4, zero=3)),
    ("qwen3-30b-a3b", "bf16", dict(pp=1, dp=16, ep=8, zero=3, fsdp={"shard_group_size": 4})),
    ("deepseek-v3", "bf16", dict(pp=2, dp=8, ep=8, zero=2)),
    ("llama2-7b", "fp8", dict(tp=2, pp=2, dp=2, cp=2, zero=1, sequence_parallel=True)),
    ("qwen3-30b-a3b", "fp8", dict(tp=2, dp=8, ep=4, zero=0, sequence_parallel=True)),
]


@pytest.mark.parametrize(("preset", "dtype", "par"), PLANS)
def test_state_bytes_equal_rank_model_states(preset: str, dtype: str, par: dict) -> None:
    topo = load_topology("dgx_h100", nodes=2)
    spec = get_preset(preset, num_layers=4, seq_len=1024)
    if "fsdp" in par:
        par = {**par, "fsdp": FSDPConfig(**par["fsdp"])}
    training = TrainingConfig(global_batch=32, micro_batch=1, dtype=dtype)
    parallel = ParallelConfig(**par)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", CollsimWarning)
        schedule = build_schedule(topo, spec, training, parallel)
        result = estimate_step(topo, spec, training, parallel)
    plan = schedule.plan
    for s, stage in schedule.stages.items():
        st = schedule.dp.state_bytes(stage)
        ref = rank_model_states(plan, s)
        assert st.parameters + st.gradients + st.optimizer == pytest.approx(
            ref.states.total + ref.fp8_copy_bytes, rel=1e-12
        )
    assert result.memory_bytes["optimizer"] > 0
