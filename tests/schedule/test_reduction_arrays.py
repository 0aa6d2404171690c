"""An op's many bucket reductions run as arrays (:meth:`Walker.reductions_as_arrays`): the dp
stream, the tallies and the ZeRO-2 buffers come out as the call-by-call loop leaves them, to
rounding, whether the stream is idle, busy or falls idle between buckets."""

from __future__ import annotations

import math
import random
from typing import Any

import pytest

import collsim.play.walker as walker_module
from collsim.cluster.topology import load_topology
from collsim.parallel.config import DDPConfig, ParallelConfig, TrainingConfig
from collsim.play.walk import estimate_step
from collsim.play.walker import Walker
from collsim.step.build import build_schedule
from collsim.step.pricing import ClosedPricer
from collsim.step.stats import CallKey
from collsim.workload import get_preset

REL = 1e-12


def _close(a: object, b: object) -> bool:
    if isinstance(a, float) and isinstance(b, float):
        return math.isclose(a, b, rel_tol=REL, abs_tol=1e-15)
    if isinstance(a, dict) and isinstance(b, dict):
        return a.keys() == b.keys() and all(_close(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)) and isinstance(b, (list, tuple)):
        return len(a) == len(b) and all(_close(x, y) for x, y in zip(a, b, strict=True))
    return a == b


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
    spec = get_preset("llama2-7b", num_layers=8, seq_len=2048)
    training = TrainingConfig(global_batch=64, micro_batch=1, recompute="selective")
    parallel = ParallelConfig(tp=2, pp=2, dp=4, zero=2, ddp=DDPConfig(bucket_mb=5.0))
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
