"""From a plan and its reliability section to the few numbers the goodput models need.

Checkpoint size (what a checkpoint must hold to resume training): the 16-bit (or fp32)
parameters and the optimizer state, without the gradients, written once however many data-
parallel replicas hold them (torch.distributed.checkpoint de-duplicates replicated tensors
and spreads the writes over the ranks). Per rank the closed forms of
:mod:`collsim.workload.memory` give the bytes: :func:`parameters_per_rank` for the TP x PP
split, :func:`model_state_bytes` (ZeRO table, Rajbhandari et al. 2020) for the bytes per
parameter. Summed over one replica (every stage, every TP rank) that is the unique state;
sharded over all ranks it is what each GPU writes. Small tensors each TP rank holds whole
(norms, biases, a learned position table) are counted once per TP rank, as Megatron-LM's
per-rank checkpoint files hold them, and so is the last stage's copy of a tied embedding.

Storage time (writers contending for shared storage): ``n`` writers of ``S`` bytes in all take
``S / min(B_aggregate, n x b_writer)`` - the file system's aggregate bandwidth is shared, and
one writer cannot exceed its own link. A sharded checkpoint has ``n`` = world size writers; an
unsharded one a single writer (rank 0 after gathering), loaded back the same way.

Restart cost ``R`` = re-scheduling + process start + checkpoint load + warm-up steps x step
time; with the detection time ``D`` a recovery takes ``D + R``.
"""

from __future__ import annotations

from dataclasses import dataclass

from collsim.core.errors import ConfigError
from collsim.parallel.config import ParallelConfig, TrainingConfig
from collsim.study.goodput.config import ReliabilityConfig
from collsim.workload.memory import model_state_bytes, parameters_per_rank
from collsim.workload.model import TransformerSpec

__all__ = ["CheckpointState", "JobCosts", "checkpoint_state", "job_costs", "storage_time_s"]

GB = 1e9
"""GB/s in config are 10**9 bytes/s (STYLE.md section 3)."""


@dataclass(frozen=True, slots=True, kw_only=True)
class CheckpointState:
    """What one checkpoint holds."""

    total_bytes: float
    """Unique model state: parameters + optimizer state of one replica (all stages, TP ranks)."""
    max_rank_bytes: float
    """The largest share one GPU writes when the state is sharded over every rank."""
    num_ranks: int


def checkpoint_state(
    spec: TransformerSpec, training: TrainingConfig, parallel: ParallelConfig
) -> CheckpointState:
    """Checkpoint bytes of a plan (see the module docstring)."""
    mixed = training.dtype.value != "fp32"
    total = 0.0
    largest = 0.0
    for stage in range(parallel.pp):
        params = parameters_per_rank(spec, tp=parallel.tp, pp=parallel.pp, stage=stage)
        state = model_state_bytes(
            params, zero=0, dp=1, optimizer=training.optimizer.value, mixed_precision=mixed
        )
        per_tp_rank = state.parameters + state.optimizer
        total += parallel.tp * per_tp_rank
        largest = max(largest, per_tp_rank / parallel.dp)
    return CheckpointState(total_bytes=total, max_rank_bytes=largest, num_ranks=parallel.world_size)


def storage_time_s(
    size_bytes: float, writers: int, aggregate_gbps: float, per_writer_gbps: float | None
) -> float:
    """``size / min(aggregate, writers x per_writer)``: writers share the storage bandwidth."""
    bandwidth = aggregate_gbps * GB
    if per_writer_gbps is not None:
        bandwidth = min(bandwidth, writers * per_writer_gbps * GB)
    return size_bytes / bandwidth


@dataclass(frozen=True, slots=True, kw_only=True)
class JobCosts:
    """The inputs of the closed form and the Monte Carlo, in seconds and events per second."""

    failure_rate_per_s: float
    """lambda: failures striking the job per second (all components, all its nodes)."""
    write_s: float
    """Time to write one checkpoint to storage."""
    stall_s: float
    """Training stopped per checkpoint (= write_s when synchronous; the snapshot when async)."""
    background_s: float
    """Time after the stall until the checkpoint is safe on storage (0 when synchronous)."""
    detection_s: float
    restart_s: float
    """Re-scheduling + process start + checkpoint load + warm-up."""
    load_s: float
    step_time_s: float
    tokens_per_step: float
    num_nodes: int
    interval_s: float | None
    """The scenario's interval (None: auto)."""
    state: CheckpointState | None = None

    def __post_init__(self) -> None:
        for key in (
            "failure_rate_per_s",
            "write_s",
            "stall_s",
            "background_s",
            "detection_s",
            "restart_s",
        ):
            if getattr(self, key) < 0:
                raise ConfigError(f"must be >= 0, got {getattr(self, key)}", key_path=key)
        if self.step_time_s <= 0:
            raise ConfigError(f"must be > 0, got {self.step_time_s}", key_path="step_time_s")

    @property
    def recovery_s(self) -> float:
        """Detection + restart: the time a failure keeps the job down when nothing else fails."""
        return self.detection_s + self.restart_s

    @property
    def mtbf_s(self) -> float:
        """Mean time between failures of the whole job."""
        return 1.0 / self.failure_rate_per_s if self.failure_rate_per_s > 0 else float("inf")

    @property
    def tokens_per_s(self) -> float:
        return self.tokens_per_step / self.step_time_s


def job_costs(
    reliability: ReliabilityConfig,
    *,
    state: CheckpointState,
    num_nodes: int,
    step_time_s: float,
    tokens_per_step: float,
) -> JobCosts:
    """Combine the section with the plan's checkpoint state and simulated step.

    Raises:
        ConfigError: ``reliability.checkpoint.interval_s`` is shorter than one checkpoint write.
    """
    ckpt, storage, restart = reliability.checkpoint, reliability.storage, reliability.restart
    writers = state.num_ranks if ckpt.sharded else 1
    write_s = storage_time_s(
        state.total_bytes,
        writers,
        storage.write_bandwidth_gbps,
        storage.per_rank_write_bandwidth_gbps,
    )
    load_s = storage_time_s(
        state.total_bytes,
        writers,
        storage.read_bandwidth_gbps,
        storage.per_rank_read_bandwidth_gbps,
    )
    if ckpt.asynchronous:
        if ckpt.snapshot_bandwidth_gbps is None:
            raise ConfigError(
                "missing required key (asynchronous checkpoints stall for the snapshot copy)",
                key_path="reliability.checkpoint.snapshot_bandwidth_gbps",
            )
        snapshot_bytes = state.max_rank_bytes if ckpt.sharded else state.total_bytes
        stall_s = snapshot_bytes / (ckpt.snapshot_bandwidth_gbps * GB)
        background_s = write_s
    else:
        stall_s, background_s = write_s, 0.0
    if ckpt.interval_s is not None and ckpt.interval_s < write_s:
        raise ConfigError(
            f"must be >= one checkpoint write ({write_s:.3g} s for "
            f"{state.total_bytes / 2**30:.4g} GiB), got {ckpt.interval_s:g}",
            key_path="reliability.checkpoint.interval_s",
        )
    restart_s = (
        restart.reschedule_s + restart.process_start_s + load_s + restart.warmup_steps * step_time_s
    )
    return JobCosts(
        failure_rate_per_s=reliability.failure_rate_per_s(num_nodes),
        write_s=write_s,
        stall_s=stall_s,
        background_s=background_s,
        detection_s=reliability.detection_s,
        restart_s=restart_s,
        load_s=load_s,
        step_time_s=step_time_s,
        tokens_per_step=tokens_per_step,
        num_nodes=num_nodes,
        interval_s=ckpt.interval_s,
        state=state,
    )
