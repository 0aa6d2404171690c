"""What the schedule tests share."""

from __future__ import annotations

from collsim.parallel.config import DDPConfig, FSDPConfig, ParallelConfig, TrainingConfig


def float_bits(x: object) -> object:
    """``x`` (floats in dicts, lists and tuples) with every float as its bits (``float.hex``:
    -0.0 is not 0.0), for results compared bit for bit."""
    if isinstance(x, float):
        return x.hex()
    if isinstance(x, dict):
        return {k: float_bits(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [float_bits(v) for v in x]
    return x


def plan16(
    pp: int,
    schedule: str,
    zero: int,
    microbatches: int,
    ddp: DDPConfig | None = None,
    fsdp: FSDPConfig | None = None,
) -> tuple[TrainingConfig, ParallelConfig]:
    """A plan on 16 GPUs: tp 2, ``pp`` stages (2 virtual stages when interleaved), dp the
    rest, ``microbatches`` of one sample a stage, selective recompute."""
    tp = 2
    dp = 16 // (tp * pp)
    training = TrainingConfig(global_batch=microbatches * dp, micro_batch=1, recompute="selective")
    parallel = ParallelConfig(
        tp=tp,
        pp=pp,
        dp=dp,
        schedule=schedule,
        virtual_stages=2 if schedule == "interleaved" else 1,
        zero=zero,
        ddp=ddp or DDPConfig(),
        fsdp=fsdp or FSDPConfig(),
    )
    return training, parallel


def zero3_plan(
    pp: int, raf: bool, sync: str, prefetch: int
) -> tuple[TrainingConfig, ParallelConfig]:
    """A ZeRO-3 :func:`plan16` (interleaved under pipelines, 4 micro-batches a stage): ``raf``
    reshards after forward, ``sync`` its gradient sync."""
    fsdp = FSDPConfig(prefetch=prefetch, reshard_after_forward=raf, grad_sync=sync)
    return plan16(pp, "interleaved" if pp > 1 else "1f1b", 3, 4 * pp, fsdp=fsdp)
