"""Checkpoint size from the plan, writers contending for storage, restart and async stall."""

from __future__ import annotations

import dataclasses

import pytest

from collsim.core.errors import ConfigError
from collsim.parallel.config import ParallelConfig, TrainingConfig
from collsim.study.goodput.config import (
    CheckpointConfig,
    ComponentRate,
    ReliabilityConfig,
    RestartConfig,
    StorageConfig,
)
from collsim.study.goodput.costs import checkpoint_state, job_costs, storage_time_s
from collsim.workload import get_preset


def test_checkpoint_holds_one_replica_of_parameters_and_optimizer_state() -> None:
    spec = get_preset("gpt3-1.3b")
    train = TrainingConfig(global_batch=64, micro_batch=1)
    one = checkpoint_state(spec, train, ParallelConfig(tp=1, pp=1, dp=8))
    # bf16 weights (2 B) + fp32 master, m, v (12 B); no gradients
    assert one.total_bytes == pytest.approx(14 * spec.num_parameters(), rel=1e-9)
    split = checkpoint_state(spec, train, ParallelConfig(tp=2, pp=2, dp=2))
    # split otherwise: the same bytes plus the copy of the tied embedding that the last stage
    # keeps when pp > 1, plus the small tensors each TP rank holds whole (norms, biases, the
    # learned position table), counted once per TP rank as Megatron's per-rank files hold them
    tied_copy = 14 * spec.vocab * spec.hidden
    extra = split.total_bytes - one.total_bytes
    assert tied_copy < extra < 1.1 * tied_copy
    assert split.num_ranks == 8
    assert split.max_rank_bytes >= split.total_bytes / 8
    fp32 = checkpoint_state(spec, dataclasses.replace(train, dtype="fp32"), ParallelConfig(dp=8))
    assert fp32.total_bytes == pytest.approx(12 * spec.num_parameters(), rel=1e-9)


def test_writers_share_the_aggregate_bandwidth() -> None:
    size = 1e12
    # 1,000 writers at 5 GB/s could push 5 TB/s; the storage takes 2 TB/s
    assert storage_time_s(size, 1000, 2000.0, 5.0) == pytest.approx(0.5)
    # 100 writers at 5 GB/s: 500 GB/s, under the aggregate
    assert storage_time_s(size, 100, 2000.0, 5.0) == pytest.approx(2.0)
    # one writer
    assert storage_time_s(size, 1, 2000.0, 5.0) == pytest.approx(200.0)
    assert storage_time_s(size, 1, 2000.0, None) == pytest.approx(0.5)


def _reliability(**checkpoint: object) -> ReliabilityConfig:
    return ReliabilityConfig(
        components=(ComponentRate(name="gpu", per_1000_node_days=10.0),),
        storage=StorageConfig(
            write_bandwidth_gbps=100.0,
            read_bandwidth_gbps=50.0,
            per_rank_write_bandwidth_gbps=2.0,
        ),
        detection_s=60.0,
        restart=RestartConfig(reschedule_s=100.0, process_start_s=50.0, warmup_steps=3),
        checkpoint=CheckpointConfig(**checkpoint),  # type: ignore[arg-type]
    )


def test_job_costs_sync_async_and_restart() -> None:
    spec = get_preset("gpt3-1.3b")
    state = checkpoint_state(spec, TrainingConfig(global_batch=64), ParallelConfig(dp=64))
    kw = {"state": state, "num_nodes": 8, "step_time_s": 2.0, "tokens_per_step": 1e5}
    sync = job_costs(_reliability(), **kw)  # type: ignore[arg-type]
    size = state.total_bytes
    assert sync.write_s == pytest.approx(size / 100e9)  # 64 writers x 2 GB/s > 100 GB/s
    assert sync.stall_s == sync.write_s and sync.background_s == 0
    assert sync.load_s == pytest.approx(size / 50e9)
    assert sync.restart_s == pytest.approx(100 + 50 + size / 50e9 + 3 * 2.0)
    assert sync.recovery_s == pytest.approx(60 + sync.restart_s)
    assert sync.failure_rate_per_s == pytest.approx(8 * 10 / 1000 / 86400)
    one = job_costs(
        dataclasses.replace(_reliability(), checkpoint=CheckpointConfig(sharded=False)),
        **kw,  # type: ignore[arg-type]
    )
    assert one.write_s == pytest.approx(size / 2e9)  # one writer at 2 GB/s
    asy = job_costs(_reliability(asynchronous=True, snapshot_bandwidth_gbps=20.0), **kw)  # type: ignore[arg-type]
    assert asy.stall_s == pytest.approx(state.max_rank_bytes / 20e9)
    assert asy.background_s == pytest.approx(sync.write_s)
    with pytest.raises(ConfigError) as info:
        job_costs(_reliability(interval_s=0.5 * sync.write_s), **kw)  # type: ignore[arg-type]
    assert info.value.key_path == "reliability.checkpoint.interval_s"
    assert "must be >= one checkpoint write" in info.value.message
