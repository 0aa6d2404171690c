"""A ZeRO-3 op whose units are gathered and ready and that releases none runs as one block
(:func:`collsim.play.walk_zero3.settled_op`): the walk says what the segment-by-segment loop
says, to rounding, and takes the block for most ops of the plans that keep their units."""

from __future__ import annotations

import math
from typing import Any

import pytest

import collsim.play.walk_zero3 as zero3
from collsim.cluster.topology import load_topology
from collsim.parallel.config import FSDPConfig, ParallelConfig, TrainingConfig
from collsim.play.walk import estimate_step
from collsim.step.build import build_schedule
from collsim.step.result import StepResult
from collsim.workload import get_preset

REL = 1e-12
"""The block adds its segments' seconds up before adding them to the clock; the loop adds
them one by one (a few roundings apart)."""


def _facts(r: StepResult) -> dict[str, Any]:
    return {
        "step": r.step_time_s,
        "breakdown": dict(r.breakdown_s.items()),
        "peak": r.memory_peak_bytes_by_rank,
        "activations": r.activation_peak_bytes_by_rank,
        "reserved": r.memory_reserved_bytes,
        "stages": r.stage_end_s,
        "calls": [(c.axis, c.op, c.size_bytes, c.count, c.time_s) for c in r.collectives],
    }


def _close(a: object, b: object) -> bool:
    if isinstance(a, float) and isinstance(b, float):
        return math.isclose(a, b, rel_tol=REL, abs_tol=1e-15)
    if isinstance(a, dict) and isinstance(b, dict):
        return a.keys() == b.keys() and all(_close(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)) and isinstance(b, (list, tuple)):
        return len(a) == len(b) and all(_close(x, y) for x, y in zip(a, b, strict=True))
    return a == b


def _plan(pp: int, raf: bool, sync: str, prefetch: int) -> tuple[TrainingConfig, ParallelConfig]:
    tp = 2
    dp = 16 // (tp * pp)
    schedule, v = ("interleaved", 2) if pp > 1 else ("1f1b", 1)
    training = TrainingConfig(global_batch=4 * pp * dp, micro_batch=1, recompute="selective")
    parallel = ParallelConfig(
        tp=tp,
        pp=pp,
        dp=dp,
        schedule=schedule,
        virtual_stages=v,
        zero=3,
        fsdp=FSDPConfig(prefetch=prefetch, reshard_after_forward=raf, grad_sync=sync),
    )
    return training, parallel


@pytest.mark.parametrize(
    ("pp", "raf", "sync", "prefetch", "settled_share"),
    [
        (2, False, "step", 1, 0.8),  # units kept all step: all but the first and last
        (1, False, "step", 0, 0.7),
        (2, True, "step", 2, 0.1),  # regathered by every forward: some backward ops
        (2, False, "microbatch", 1, 0.1),  # released by every backward: some forward ops
    ],
)
def test_settled_ops_walk_as_the_segment_loop(
    monkeypatch: pytest.MonkeyPatch,
    pp: int,
    raf: bool,
    sync: str,
    prefetch: int,
    settled_share: float,
) -> None:
    topology = load_topology("dgx_h100", nodes=2)
    spec = get_preset("llama2-7b", num_layers=8, seq_len=2048)
    training, parallel = _plan(pp, raf, sync, prefetch)
    ran: list[bool] = []
    run_settled = zero3._run_settled

    def counted(*args: Any) -> bool:
        ran.append(run_settled(*args))
        return ran[-1]

    monkeypatch.setattr(zero3, "_run_settled", counted)
    blocks = estimate_step(topology, spec, training, parallel)
    taken = sum(ran)
    monkeypatch.setattr(zero3, "settled_op", lambda *args: None)
    loop = estimate_step(topology, spec, training, parallel)
    assert _close(_facts(blocks), _facts(loop)), (_facts(blocks), _facts(loop))
    schedule = build_schedule(topology, spec, training, parallel)
    ops = sum(len(schedule.pipeline[s]) for s in range(parallel.pp))
    assert taken >= settled_share * ops
