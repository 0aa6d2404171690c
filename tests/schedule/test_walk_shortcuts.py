"""The walk's two shortcuts say what the step-by-step interpretation says, to rounding: a ZeRO-3
op whose units are gathered and ready and that releases none runs as one block
(:func:`collsim.play.walk_zero3.settled_op`, taken for most ops of the plans that keep their
units); an op's many bucket reductions run as arrays (:meth:`Walker.reductions_as_arrays`),
the dp stream, tallies and ZeRO-2 buffers as the call-by-call loop leaves them, whether the
stream is idle, busy or falls idle between buckets."""

from __future__ import annotations

import math
import random
from typing import Any

import pytest

import collsim.play.walk_zero3 as zero3
import collsim.play.walker as walker_module
from collsim.cluster.topology import load_topology
from collsim.parallel.config import DDPConfig, FSDPConfig, ParallelConfig, TrainingConfig
from collsim.play.walk import estimate_step
from collsim.play.walker import Walker
from collsim.step.build import build_schedule
from collsim.step.pricing import ClosedPricer
from collsim.step.result import StepResult
from collsim.step.stats import CallKey
from collsim.workload import get_preset

REL = 1e-12
"""The shortcuts add seconds up before adding them to the clock; the loops add them one by
one (a few roundings apart)."""


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
    looped: list[int] = []
    run_segments = zero3.run_segments

    def counted(*args: Any) -> None:
        looped.append(1)
        run_segments(*args)

    monkeypatch.setattr(walker_module, "run_segments", counted)
    blocks = estimate_step(topology, spec, training, parallel)
    schedule = build_schedule(topology, spec, training, parallel)
    ops = sum(len(schedule.pipeline[s]) for s in range(parallel.pp))
    assert ops - len(looped) >= settled_share * ops  # the ops run as blocks
    monkeypatch.setattr(walker_module, "settled_op", lambda *args: None)
    looped.clear()
    loop = estimate_step(topology, spec, training, parallel)
    assert len(looped) == ops  # every op segment by segment
    assert _close(_facts(blocks), _facts(loop)), (_facts(blocks), _facts(loop))


def _walker() -> Walker:
    topology = load_topology("dgx_h100", nodes=1)
    spec = get_preset("llama2-7b", num_layers=2, seq_len=1024)
    training = TrainingConfig(global_batch=8, micro_batch=1)
    schedule = build_schedule(topology, spec, training, ParallelConfig(dp=8, zero=2))
    return Walker(schedule, ClosedPricer(topology))


def _reductions(seed: int, n: int) -> list[tuple[float, tuple[Any, ...], float]]:
    """``n`` reductions at rising offsets, one to three calls each (two tallies), some
    holding a buffer; the gaps leave the stream idle now and then."""
    rng = random.Random(seed)
    keys = [CallKey(0, "dp", op, 1e6, 8, "ring") for op in ("reduce_scatter", "all_reduce")]
    out, rel = [], 0.0
    for _ in range(n):
        rel += rng.choice([0.0, 1e-5, 4e-4, 2e-3])
        calls = tuple(
            (rng.uniform(1e-5, 1e-3), rng.uniform(1e9, 1e11), rng.choice(keys))
            for _ in range(rng.randint(1, 3))
        )
        out.append((rel, calls, rng.choice([0.0, 25.0 * 2**20])))
    return out


def _state(w: Walker) -> dict[str, Any]:
    prog = next(iter(w.programs.values()))
    return {
        "dp_free": prog.dp_free,
        "dp_last_end": prog.dp_last_end,
        "tallies": [(k, t.count, t.time_s, t.busbw_bps) for k, t in w.stats.items()],
    }


@pytest.mark.parametrize("seed", range(6))
@pytest.mark.parametrize("busy_s", [0.0, 5e-3, -1.0])
def test_reductions_as_arrays_match_the_loop(
    monkeypatch: pytest.MonkeyPatch, seed: int, busy_s: float
) -> None:
    reductions = _reductions(seed, 40)
    results = []
    for array_min in (walker_module.ARRAY_REDUCTIONS, 10**9):
        monkeypatch.setattr(walker_module, "ARRAY_REDUCTIONS", array_min)
        w = _walker()
        prog = next(iter(w.programs.values()))
        t0 = 2.0
        prog.dp_free = prog.dp_last_end = t0 + busy_s  # busy past t0, or idle since before
        held: list[Any] = []
        for start in (t0, t0 + 0.01, t0 + 0.011):  # three ops, the stream carried over
            held += w.run_reductions(prog, reductions, start)
        results.append((_state(w), [tuple(e) for e in held]))
    arrays, loop = results
    assert len(arrays[1]) == len(loop[1]) > 0
    assert _close(arrays, loop), (arrays[0], loop[0])


def test_a_zero2_plan_with_many_buckets_estimates_as_the_loop(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    topology = load_topology("dgx_h100", nodes=2)
    spec = get_preset("llama2-7b", num_layers=32, seq_len=2048)  # 65 buckets a backward
    training = TrainingConfig(global_batch=64, micro_batch=1, recompute="selective")
    parallel = ParallelConfig(tp=2, pp=2, dp=4, zero=2, ddp=DDPConfig(bucket_mb=1.0))
    ran: list[int] = []
    as_arrays = Walker.reductions_as_arrays

    def counted(self: Walker, *args: Any) -> Any:
        ran.append(1)
        return as_arrays(self, *args)

    monkeypatch.setattr(Walker, "reductions_as_arrays", counted)
    arrays = estimate_step(topology, spec, training, parallel)
    assert ran
    monkeypatch.setattr(walker_module, "ARRAY_REDUCTIONS", 10**9)
    loop = estimate_step(topology, spec, training, parallel)
    facts = [
        (
            r.step_time_s,
            dict(r.breakdown_s.items()),
            r.memory_peak_bytes_by_rank,
            r.memory_reserved_bytes,
            [(c.op, c.size_bytes, c.count, c.time_s) for c in r.collectives],
        )
        for r in (arrays, loop)
    ]
    assert _close(facts[0], facts[1])
