"""Two fidelities of one schedule: the engine pricing every call in closed form (``fused``,
nothing on the DES) and the closed-form walk of the same schedule give the same peak memory
exactly and the same step time (within 1 %; in practice to rounding) for every shipped
scenario and for generated plans."""

from __future__ import annotations

import warnings
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from collsim.cluster.topology import load_topology
from collsim.core.errors import CollsimWarning
from collsim.parallel.config import DDPConfig, FSDPConfig, ParallelConfig, TrainingConfig
from collsim.play.engine import simulate_step
from collsim.play.walk import estimate_step
from collsim.study.scenario import load_scenario
from collsim.workload import get_preset

REPO = Path(__file__).resolve().parents[2]
SCENARIOS = sorted((REPO / "scenarios").rglob("*.yaml"))


def _agree(topology, spec, training, parallel) -> None:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", CollsimWarning)
        des = simulate_step(topology, spec, training, parallel, fidelity="fused")
        closed = estimate_step(topology, spec, training, parallel)
    assert closed.step_time_s == pytest.approx(des.step_time_s, rel=0.01)
    assert closed.memory_peak_bytes == des.memory_peak_bytes
    assert closed.memory_bytes == des.memory_bytes
    for key, value in des.breakdown_s.items():
        assert closed.breakdown_s[key] == pytest.approx(value, rel=1e-6, abs=1e-12), key
    assert closed.fidelity == "closed"


@pytest.mark.parametrize("path", SCENARIOS, ids=[p.stem for p in SCENARIOS])
def test_every_shipped_scenario(path: Path) -> None:
    from collsim.core.errors import CollsimError, ConfigError

    try:
        sc = load_scenario(path)
        topology = sc.cluster.load()
    except ConfigError:
        return  # a scenario whose cluster is not there yet: nothing to play (tested elsewhere)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", CollsimWarning)
            simulate_step(topology, sc.model, sc.training, sc.parallel, fidelity="fused")
    except CollsimError as exc:  # a plan the engine refuses, the closed form refuses too
        with pytest.raises(type(exc)), warnings.catch_warnings():
            warnings.simplefilter("ignore", CollsimWarning)
            estimate_step(topology, sc.model, sc.training, sc.parallel)
        return
    _agree(topology, sc.model, sc.training, sc.parallel)


PLANS = st.fixed_dictionaries(
    {
        "nodes": st.sampled_from([1, 2, 4]),
        "tp": st.sampled_from([1, 2, 4, 8]),
        "pp": st.sampled_from([1, 2, 4]),
        "mb": st.sampled_from([1, 2]),
        "m": st.sampled_from([1, 2, 4, 8]),
        "schedule": st.sampled_from(["gpipe", "1f1b", "interleaved"]),
        "zero": st.sampled_from([0, 1, 2, 3]),
        "sp": st.booleans(),
        "recompute": st.sampled_from(["none", "selective", "full"]),
        "overlap": st.booleans(),
        "bucket_mb": st.sampled_from([1.0, 25.0]),
        "prefetch": st.sampled_from([0, 1, 2]),
        "reshard": st.booleans(),
    }
)


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(PLANS)
def test_generated_plans(knobs: dict) -> None:
    spec = get_preset("gpt3-350m")  # 24 layers, 16 heads
    gpus = 8 * knobs["nodes"]
    tp, pp = knobs["tp"], knobs["pp"]
    if gpus % (tp * pp):
        return
    dp = gpus // (tp * pp)
    zero = knobs["zero"] if pp == 1 else min(knobs["zero"], 1)
    schedule = knobs["schedule"] if pp > 1 else "1f1b"
    v = 2 if schedule == "interleaved" else 1
    m = knobs["m"] * (pp if schedule == "interleaved" else 1)
    training = TrainingConfig(
        global_batch=m * knobs["mb"] * dp, micro_batch=knobs["mb"], recompute=knobs["recompute"]
    )
    parallel = ParallelConfig(
        tp=tp,
        pp=pp,
        dp=dp,
        schedule=schedule,
        virtual_stages=v,
        zero=zero,
        sequence_parallel=knobs["sp"] and tp > 1,
        ddp=DDPConfig(bucket_mb=knobs["bucket_mb"], overlap=knobs["overlap"]),
        fsdp=FSDPConfig(prefetch=knobs["prefetch"], reshard_after_forward=knobs["reshard"]),
    )
    _agree(load_topology("dgx_h100", nodes=knobs["nodes"]), spec, training, parallel)


@pytest.mark.slow
def test_a_16384_gpu_plan() -> None:
    spec = get_preset("gpt3-175b")
    training = TrainingConfig(global_batch=1536 * 16, micro_batch=1, recompute="full")
    parallel = ParallelConfig(tp=8, pp=8, dp=256, zero=1)
    _agree(load_topology("dgx_a100", nodes=2048), spec, training, parallel)


MODERN = st.fixed_dictionaries(
    {
        "model": st.sampled_from(["qwen3-30b-a3b", "deepseek-v3", "gpt-oss-120b", "llama2-7b"]),
        "tp": st.sampled_from([1, 2]),
        "cp": st.sampled_from([1, 2, 4]),
        "pp": st.sampled_from([1, 2]),
        "ep": st.sampled_from([1, 2, 4, 8]),
        "etp": st.sampled_from([1, 2]),
        "m": st.sampled_from([1, 2, 4]),
        "schedule": st.sampled_from(["1f1b", "interleaved"]),
        "zero": st.sampled_from([0, 1, 2, 3]),
        "shard": st.sampled_from([None, 2, 4]),
        "cp_algorithm": st.sampled_from(
            ["ring", "all_gather", "torch_allgather", "torch_alltoall"]
        ),
        "fp8": st.sampled_from([None, "delayed", "tensorwise"]),
        "balance": st.booleans(),
        "recompute": st.sampled_from(["none", "selective", "full"]),
        "overlap": st.booleans(),
        "reshard": st.booleans(),
        "fp32_reduce": st.booleans(),
        "ep_overlap": st.booleans(),
        "order": st.sampled_from(["tp-cp-ep-dp-pp", "tp-cp-ep-pp-dp"]),
    }
)


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(MODERN)
def test_generated_modern_plans(knobs: dict) -> None:
    """MoE (EP, etp, dense-first layers), MLA, sliding-window, CP (ring / all-gather / torch's
    two rotate methods, with or without causal balancing), FP8 (delayed and current scaling:
    their amax reductions) and HSDP plans: the two fidelities agree."""
    from collsim.core.errors import ConfigError

    extra = {"sliding_window_layers": (0, 2)} if knobs["model"] == "gpt-oss-120b" else {}
    spec = get_preset(knobs["model"], num_layers=4, seq_len=1024, **extra)
    gpus = 16
    tp, cp, pp = knobs["tp"], knobs["cp"], knobs["pp"]
    dp = gpus // (tp * cp * pp)
    moe = spec.is_moe
    ep, etp = (knobs["ep"], knobs["etp"]) if moe else (1, 1)
    schedule = knobs["schedule"] if pp > 1 else "1f1b"
    v = 2 if schedule == "interleaved" else 1
    m = knobs["m"] * (pp if schedule == "interleaved" else 1)
    shard = knobs["shard"] if knobs["shard"] and dp % knobs["shard"] == 0 else None
    zero = 3 if shard else knobs["zero"]
    fp8 = {"dtype": "fp8", "fp8_recipe": knobs["fp8"]} if knobs["fp8"] else {}
    training = TrainingConfig(
        global_batch=m * dp, micro_batch=1, recompute=knobs["recompute"], **fp8
    )
    try:
        parallel = ParallelConfig(
            tp=tp,
            cp=cp,
            pp=pp,
            dp=dp,
            ep=ep,
            etp=etp,
            schedule=schedule,
            virtual_stages=v,
            zero=zero,
            sequence_parallel=tp > 1,
            cp_algorithm=knobs["cp_algorithm"],
            cp_load_balance=knobs["balance"],
            ep_overlap=knobs["ep_overlap"],
            order=knobs["order"],
            ddp=DDPConfig(overlap=knobs["overlap"]),
            fsdp=FSDPConfig(
                reshard_after_forward=knobs["reshard"],
                shard_group_size=shard,
                reduce_dtype="fp32" if knobs["fp32_reduce"] else None,
            ),
        )
        topology = load_topology("dgx_h100", nodes=2)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", CollsimWarning)
            from collsim.parallel.plan import build_plan

            build_plan(topology, spec, training, parallel)
    except ConfigError:
        return  # a combination the plan checks refuse (ep x etp not dividing, ...)
    _agree(topology, spec, training, parallel)
