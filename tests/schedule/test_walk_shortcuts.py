"""The walk's two shortcuts say what the step-by-step interpretation says, float for float: a
ZeRO-3 op whose units are gathered and ready and that releases none runs as one block
(:func:`collsim.play.walk_zero3.settled_op`, taken for most ops of the plans that keep their
units), its events on its segments' boundaries as the loop's clock reaches them; an op's many
bucket reductions, every op's of a stage, run as one batch (:meth:`Walker.run_block_batch`,
the stream's queue as arrays), the dp stream, tallies and ZeRO-2 buffers as the call-by-call
loop leaves them, whether the stream is idle, busy or falls idle between buckets; chunks with
alike buckets share one tuple of reductions, made once. Equal by
their bits: events that coincide must stay coincident for the memory peaks (frees sort
before allocations at one instant)."""

from __future__ import annotations

import dataclasses
import random
from types import SimpleNamespace
from typing import Any

import numpy as np
import pytest

import collsim.play.walk as walk_module
import collsim.play.walk_pipe as walk_pipe
import collsim.play.walk_zero3 as zero3
import collsim.play.walker as walker_module
import collsim.step.stage as stage_module
from collsim.cluster.topology import load_topology
from collsim.core.errors import SimulationError
from collsim.parallel.buckets import Bucket
from collsim.parallel.config import DDPConfig, FSDPConfig, ParallelConfig, TrainingConfig
from collsim.parallel.params import ParamTensor
from collsim.play.walk import Estimator, estimate_step
from collsim.play.walk_tables import op_table, pipeline_links, pipeline_wiring, queue_ends
from collsim.play.walker import Walker
from collsim.step.build import build_schedule
from collsim.step.memory import MemoryEvent, MemoryLedger, MemoryPattern
from collsim.step.ops import ChunkModel
from collsim.step.pricing import ClosedPricer
from collsim.step.result import MEMORY_KEYS, StepResult
from collsim.step.shapes import ShapeCache
from collsim.step.stats import CallKey, CallStats, dp_link, dp_links
from collsim.workload import get_preset
from tests.schedule.helpers import float_bits, zero3_plan


def _facts(r: StepResult) -> object:
    return float_bits(
        {
            "step": r.step_time_s,
            "breakdown": dict(r.breakdown_s.items()),
            "peak": r.memory_peak_bytes_by_rank,
            "by_category": r.memory_bytes,
            "activations": r.activation_peak_bytes_by_rank,
            "reserved": r.memory_reserved_bytes,
            "timeline": dict(r.memory_timeline),
            "stages": r.stage_end_s,
            "calls": [
                (c.axis, c.op, c.size_bytes, c.count, c.time_s, c.busbw_bps) for c in r.collectives
            ],
        }
    )


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
    training, parallel = zero3_plan(pp, raf, sync, prefetch)
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
    assert _facts(blocks) == _facts(loop)
    # and each loop adding its own terms, none joining the settled sums (seg_sums)
    monkeypatch.setattr(zero3, "seg_sums", lambda *args: None)
    assert _facts(estimate_step(topology, spec, training, parallel)) == _facts(loop)


def test_settled_ops_keep_coincident_events_coincident(monkeypatch: pytest.MonkeyPatch) -> None:
    """A plan where, with a block's events at ``start + offset`` (a rounding away from the
    loop's clock), a gather and a gradient buffer's free stopped coinciding and rank 0's peak
    moved by 4 MiB: the boundaries are the clock's own floats, so the peak and the timeline
    stay the loop's."""
    topology = load_topology("dgx_h100", nodes=4)
    spec = get_preset("llama2-7b", num_layers=16, seq_len=1024)
    training = TrainingConfig(global_batch=64, micro_batch=1, recompute="none")
    fsdp = FSDPConfig(prefetch=1, reshard_after_forward=False, grad_sync="microbatch")
    parallel = ParallelConfig(
        tp=2,
        pp=4,
        dp=4,
        schedule="interleaved",
        virtual_stages=2,
        zero=3,
        sequence_parallel=True,
        fsdp=fsdp,
    )
    looped: list[int] = []
    run_segments = zero3.run_segments
    monkeypatch.setattr(
        walker_module, "run_segments", lambda *args: (looped.append(1), run_segments(*args))
    )
    blocks = estimate_step(topology, spec, training, parallel)
    assert 0 < len(looped) < len(build_schedule(topology, spec, training, parallel).pipeline[0]) * 4
    monkeypatch.setattr(walker_module, "settled_op", lambda *args: None)
    loop = estimate_step(topology, spec, training, parallel)
    assert _facts(blocks) == _facts(loop)


def test_a_stepped_pattern_is_placed_as_a_clock_runs_its_steps() -> None:
    """:meth:`MemoryPattern.times` (numpy, many starts) and ``times_at`` (one start) give the
    boundaries a Python clock reaches adding the steps one by one from each start."""
    rng = random.Random(3)
    steps = tuple(rng.uniform(1e-6, 1e-2) for _ in range(7))
    at = [0, 1, 1, 3, 7, 7]
    events = [(0.0, float(i + 1), "act", i) for i in range(len(at))]
    pattern = MemoryPattern("activations", events, steps, at)
    starts = [rng.uniform(0.0, 50.0) for _ in range(20)]
    rows = pattern.times(starts).tolist()
    for start, row in zip(starts, rows, strict=True):
        clock, bounds = start, [start]
        for step in steps:
            clock += step
            bounds.append(clock)
        expected = [bounds[i] for i in at]
        assert [x.hex() for x in row] == [x.hex() for x in expected]
        assert [x.hex() for x in pattern.times_at(start)] == [x.hex() for x in expected]


@pytest.mark.parametrize("long_steps", [3, 400])  # one grid for all; pattern by pattern
def test_placed_patterns_fall_on_their_boundaries_however_their_steps_differ(
    long_steps: int,
) -> None:
    """The placed patterns' columns (stepped ones in one padded grid, or pattern by pattern
    when one pattern's steps far outnumber the others') hold each placement's events at
    ``times_at`` of its start (offsets for a pattern without steps), grouped by pattern in
    order of first use, placements in recording order; the same again when the patterns'
    columns are kept from the first call."""
    from collsim.step.memory import _pattern_arrays

    rng = random.Random(5)
    kinds = []
    for q, n in enumerate((2, 5, long_steps, 0)):
        events = [(rng.uniform(0, 1e-3), float(i + 1 + 10 * q), "act", i) for i in range(4)]
        if n:
            steps = tuple(rng.uniform(1e-6, 1e-2) for _ in range(n))
            at = sorted(rng.randint(0, n) for _ in events)
            kinds.append(MemoryPattern("activations", events, steps, at))
        else:
            kinds.append(MemoryPattern("buffers", events))
    which = [0, 1, 0, 3, 2, 1, 1, 0, 3, 3, 1]  # (kinds first used in order)
    starts = [rng.uniform(0.0, 50.0) for _ in which]
    times, deltas, cats = [], [], []
    for q in range(len(kinds)):
        for start, w in zip(starts, which, strict=True):
            if w == q:
                times += kinds[q].times_at(start)
                deltas += [ev[1] for ev in kinds[q].events]
                cats += [MEMORY_KEYS.index(kinds[q].category)] * len(kinds[q].events)
    for _ in range(2):
        got = _pattern_arrays(np.array(starts), np.array(which, dtype=np.intp), kinds)
        assert [x.hex() for x in got[0].tolist()] == [x.hex() for x in times]
        assert got[1].tolist() == deltas
        assert got[2].tolist() == cats


@pytest.mark.parametrize(
    ("steps", "at"), [((1.0,), None), (None, [0]), ((1.0,), [0, 1]), ((1.0,), [2])]
)
def test_a_stepped_pattern_needs_a_boundary_per_event(
    steps: tuple[float, ...] | None, at: list[int] | None
) -> None:
    with pytest.raises(SimulationError, match="stepped pattern"):
        MemoryPattern("activations", [(0.0, 1.0, "act", 0)], steps, at)


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


def _loop_ends(ready: list[float], seconds: list[float], free_s: float) -> list[float]:
    out = []
    for r, t in zip(ready, seconds, strict=True):
        free_s = (r if r >= free_s else free_s) + t
        out.append(free_s)
    return out


@pytest.mark.parametrize("seed", range(12))
def test_the_queue_as_arrays_ends_each_call_as_the_loop(seed: int) -> None:
    """``queue_ends`` against the call-by-call loop: idle and busy stretches, runs of every
    length (one call up to all of them waiting), ready times that tie with an end, and ends of
    mixed magnitudes where any other grouping of the sums rounds differently."""
    rng = random.Random(seed)
    n = rng.choice([1, 2, 17, 300])
    ready, t = [], rng.uniform(0, 5)
    for _ in range(n):
        t += rng.choice([0.0, 1e-7, 1e-4, rng.uniform(0, 3e-3)])
        ready.append(t)
    seconds = [rng.uniform(1e-6, 2e-3) * 10 ** rng.randint(-3, 0) for _ in range(n)]
    free = rng.choice([0.0, ready[0], ready[0] + 0.05])
    loop = _loop_ends(ready, seconds, free)
    if n > 2:  # a call ready exactly when the one before ends
        ready[2] = loop[1]
        loop = _loop_ends(ready, seconds, free)
    ends = queue_ends(np.array(ready), np.array(seconds), free)
    assert [x.hex() for x in ends.tolist()] == [x.hex() for x in loop]


def test_a_queue_where_every_call_waits_is_one_run() -> None:
    ready = np.zeros(500)
    seconds = np.full(500, 0.1)
    ends = queue_ends(ready, seconds, 1.0)
    assert [x.hex() for x in ends.tolist()] == [
        x.hex() for x in _loop_ends([0.0] * 500, [0.1] * 500, 1.0)
    ]
    assert ends[-1] != 1.0 + 500 * 0.1  # (the sum one after another rounds otherwise)


@pytest.mark.parametrize("seed", range(6))
@pytest.mark.parametrize("busy_s", [0.0, 5e-3, -1.0])
@pytest.mark.parametrize("earlier", [False, True])
def test_a_batch_of_reductions_matches_the_op_by_op_loop(
    seed: int, busy_s: float, earlier: bool
) -> None:
    """Several ops' reductions run as one batch (``Walker.run_block_batch``) leave the dp
    stream, the tallies (their order, counts, seconds, busbw) and the ZeRO-2 buffers as the
    op-by-op calls of ``Walker.run_reductions`` do, whether the stream is idle, busy or
    falls idle between buckets, and whether the tallies start empty or hold the seconds of
    an earlier op's calls; the ops' reductions differ (two tables of calls)."""
    first, second = _reductions(seed, 40), _reductions(seed + 100, 7)
    ops = [(2.0, first), (2.01, second), (2.011, first), (2.5, second)]
    results = []
    for batched in (True, False):
        w = _walker()
        prog = next(iter(w.programs.values()))
        held: list[Any] = []
        if earlier:  # the same calls, op by op, before: the tallies hold seconds
            held += w.run_reductions(prog, first, 0.5)
            assert all(t.time_s > 0 for t in w.stats.tallies.values())
        prog.dp_free = prog.dp_last_end = 2.0 + busy_s  # busy past t0, or idle since before
        if batched:
            for _, reductions in ops:
                w.open_tallies(reductions)
            starts = np.array([start for start, _ in ops])
            which = np.array([0, 1, 0, 1])  # (ops 0 and 2 run first, 1 and 3 second)
            per_op, times, deltas = w.run_block_batch(prog, starts, which, [first, second])
            assert sum(per_op) == len(times) == len(deltas)
            held += [
                MemoryEvent(t, "buffers", d, "zero2 bucket")
                for t, d in zip(times.tolist(), deltas.tolist(), strict=True)
            ]
        else:
            for start, reductions in ops:
                held += w.run_reductions(prog, reductions, start)
        results.append((_state(w), [tuple(e) for e in held]))
    batch, loop = results
    assert len(batch[1]) == len(loop[1]) > 0
    assert float_bits(batch) == float_bits(loop), (batch[0], loop[0])


@pytest.mark.parametrize("seed", range(4))
@pytest.mark.parametrize("busy_s", [0.0, 5e-3, -1.0])
@pytest.mark.parametrize("issued_s", [None, 1.5])
def test_a_list_of_calls_runs_as_the_call_by_call_recurrence(
    seed: int, busy_s: float, issued_s: float | None
) -> None:
    """``Walker.run_priced`` (the clock a running sum past the first call, the last call's
    event the latest) leaves the dp stream, what it returns and the tallies (order, counts,
    seconds, busbw) as the call-by-call recurrence (each call at ``max(ready, dp_free)``,
    each firing at ``fires(issued, end)``), whether the stream is busy past the calls' ready
    time or idle, the calls issued then or earlier; with a negative term it takes the
    recurrence."""
    calls = [c for _, cs, _ in _reductions(seed, 40) for c in cs]
    if seed == 3:  # a term that lets a later call find the stream idle again
        calls[5] = (-1e-2, calls[5][1], calls[5][2])
    results = []
    for each in (False, True):
        w = _walker()
        prog = next(iter(w.programs.values()))
        prog.dp_free = prog.dp_last_end = 2.0 + busy_s
        if each:
            fired = w._run_each(prog, calls, 2.0, 2.0 if issued_s is None else issued_s)
        else:
            fired = w.run_priced(prog, calls, 2.0, issued_s)
        results.append((fired, _state(w)))
    fast, each_ = results
    assert float_bits(fast) == float_bits(each_), (fast, each_)


@pytest.mark.parametrize("zero", [1, 3])
def test_a_pipeline_order_with_a_cycle_is_refused_not_walked_for_ever(zero: int) -> None:
    """The first stage's ops reversed: its first op waits for a gradient the last stage sends
    only after a forward the first stage has not run. The round-robin walk (ZeRO-3's
    ``advance``, the fused walk's ``trace_pipeline``) stops with the ranks that wait."""
    topology = load_topology("dgx_h100", nodes=1)
    spec = get_preset("llama2-7b", num_layers=4, seq_len=1024)
    training = TrainingConfig(global_batch=8, micro_batch=1)
    schedule = build_schedule(topology, spec, training, ParallelConfig(pp=2, dp=4, zero=zero))
    walk_module.walk(schedule)  # (the order as built walks)
    pipeline = dict(schedule.pipeline)
    pipeline[0] = tuple(reversed(pipeline[0]))
    with pytest.raises(SimulationError, match=r"ranks \[0, 4\] wait for inputs never sent"):
        walk_module.walk(dataclasses.replace(schedule, pipeline=pipeline))


@pytest.mark.parametrize(
    ("schedule_kind", "pp", "v"),
    [("1f1b", 4, 1), ("interleaved", 4, 2), ("zb_h1", 4, 1), ("dualpipev", 2, 2), ("gpipe", 2, 1)],
)
def test_every_numbered_message_read_is_sent_once_by_another_stage(
    schedule_kind: str, pp: int, v: int
) -> None:
    """``pipeline_wiring`` numbers the messages the ZeRO-3 walk reads and sends: every op that
    reads from another stage reads a number one op of another stage sends, for the same
    micro-batch; every number sent is read once; ops that read from their own stage read none."""
    topology = load_topology("dgx_h100", nodes=1)
    spec = get_preset("llama2-7b", num_layers=8, seq_len=1024)
    training = TrainingConfig(global_batch=8 * (8 // pp), micro_batch=1)
    parallel = ParallelConfig(pp=pp, dp=8 // pp, schedule=schedule_kind, virtual_stages=v, zero=3)
    schedule = build_schedule(topology, spec, training, parallel)
    stages = range(pp)
    links = [pipeline_links(schedule, s) for s in stages]
    tables = [
        op_table(schedule.pipeline[s], links[s], frozenset(), schedule.plan.num_microbatches)
        for s in stages
    ]
    wiring, count = pipeline_wiring(tables)
    sent: dict[int, tuple[int, int]] = {}
    read: dict[int, tuple[int, int]] = {}
    for s in stages:
        for op, (remote, _, dest), (number_in, number_out, to) in zip(
            schedule.pipeline[s], links[s], wiring[s], strict=True
        ):
            assert (number_in >= 0) == remote
            if number_in >= 0:
                assert number_in not in read
                read[number_in] = (s, op.microbatch)
            assert (number_out >= 0) == (dest is not None)
            if number_out >= 0:
                assert number_out not in sent and to == dest[0] != s
                sent[number_out] = (to, op.microbatch)
    assert read and read == sent  # (each read where it is sent to, for its micro-batch)
    assert max(read) < count


def test_a_zero2_plan_with_many_buckets_estimates_as_the_loop(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A ZeRO-2 plan with a pipeline estimates the same with every stage's reductions run as
    one batch as with the op-by-op loop (the tallies opened where the ops run; the buffers
    and the traced messages recorded as one block of columns, not as events)."""
    topology = load_topology("dgx_h100", nodes=2)
    spec = get_preset("llama2-7b", num_layers=32, seq_len=2048)  # 65 buckets a backward
    training = TrainingConfig(global_batch=64, micro_batch=1, recompute="selective")
    parallel = ParallelConfig(tp=2, pp=2, dp=4, zero=2, ddp=DDPConfig(bucket_mb=1.0))
    batches: list[int] = []
    batch = Walker.run_block_batch

    def counted(self: Walker, prog: Any, starts: Any, *args: Any) -> Any:
        batches.append(len(starts))
        return batch(self, prog, starts, *args)

    monkeypatch.setattr(Walker, "run_block_batch", counted)
    blocks: list[int] = []
    add_block = MemoryLedger.add_block

    def recorded(self: MemoryLedger, times: Any, *args: Any) -> None:
        blocks.append(len(times))
        add_block(self, times, *args)

    monkeypatch.setattr(MemoryLedger, "add_block", recorded)
    batched = estimate_step(topology, spec, training, parallel)
    assert batches and max(batches) > 1
    assert blocks and min(blocks) > 0
    monkeypatch.setattr(walk_pipe, "_batches", lambda *args: False)  # op by op, as events
    loop = estimate_step(topology, spec, training, parallel)
    assert _facts(batched) == _facts(loop)


def test_a_zero1_pipeline_of_alike_chunks_batches_their_shared_reductions(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """ZeRO-1 reduces in each chunk's last micro-batch only, one op per chunk: the chunks of a
    stage that are alike share one tuple of reductions, so with small buckets the stage's
    ops run them as one batch (grouped by that tuple, not by block), and estimate as the
    op-by-op loop."""
    topology = load_topology("dgx_h100", nodes=2)
    spec = get_preset("llama2-7b", num_layers=128, seq_len=2048)  # 16 chunks of 4 layers
    training = TrainingConfig(global_batch=64, micro_batch=1, recompute="selective")
    parallel = ParallelConfig(
        tp=2,
        pp=2,
        dp=4,
        zero=1,
        schedule="interleaved",
        virtual_stages=16,
        ddp=DDPConfig(bucket_mb=1.0),
    )
    groups: list[int] = []
    batch = Walker.run_block_batch

    def counted(self: Walker, prog: Any, starts: Any, which: Any, reductions_of: Any) -> Any:
        groups.append(len(reductions_of))
        assert len(set(which.tolist())) < len(starts)  # (ops of several chunks share one)
        return batch(self, prog, starts, which, reductions_of)

    monkeypatch.setattr(Walker, "run_block_batch", counted)
    batched = estimate_step(topology, spec, training, parallel)
    assert groups
    monkeypatch.setattr(walk_pipe, "_batches", lambda *args: False)
    loop = estimate_step(topology, spec, training, parallel)
    assert _facts(batched) == _facts(loop)


def test_settled_sums_are_added_term_by_term_in_the_order_the_blocks_ran() -> None:
    """``Walker.add_settled`` adds the blocks' terms with one accumulation: the floats of the
    segment loop's ``+=`` one term after another (terms of mixed magnitudes, where any other
    order or grouping rounds differently), keys a block does not touch left as they were; a
    run of blocks added again (its terms kept by the blocks' identities) from another account
    adds up as the first time."""
    from collsim.play.walk_tables import SETTLED_SUMS, RankState, SettledOp, SharedWalk

    rng = random.Random(3)
    blocks = []
    for n in (3, 7, 1, 12):
        sums = [[0.0] * n for _ in SETTLED_SUMS]
        for row in range(len(SETTLED_SUMS) - 2):  # dp_exposed, interference untouched
            sums[row] = [rng.uniform(0, 1) * 10 ** rng.randint(-9, 2) for _ in range(n)]
        blocks.append(SettledOp((), (1.0,) * n, np.array(sums), None, ()))
    blocks[0].sums[0] = [2.0**53, 1.0, 1.0]  # one after another each 1.0 rounds away
    prog = RankState(rank=0, coords=None, ledger=None)  # type: ignore[arg-type]
    prog.breakdown_s["compute"] = 0.1
    prog.breakdown_s["dp_exposed"] = 0.3
    expected = dict(prog.breakdown_s)
    for b in (*blocks, blocks[1], *blocks[:2]):  # a block runs again, then a run again
        for row, key in enumerate(SETTLED_SUMS):
            for term in b.sums[row].tolist():
                expected[key] += term
    walker = SimpleNamespace(shared=SharedWalk())  # (add_settled reads only its tables)
    prog.settled.extend(blocks[:2])
    Walker.add_settled(walker, prog)  # type: ignore[arg-type]
    assert prog.settled == []
    prog.settled.extend([*blocks[2:], blocks[1]])
    Walker.add_settled(walker, prog)  # type: ignore[arg-type]
    prog.settled.extend(blocks[:2])  # the first run's terms, kept
    Walker.add_settled(walker, prog)  # type: ignore[arg-type]
    assert len(walker.shared.settled_terms) == 2
    assert float_bits(prog.breakdown_s) == float_bits(expected)
    assert prog.breakdown_s["dp_exposed"] == 0.3
    grouped = 0.1 + sum(float(b.sums[0].sum()) for b in (*blocks, blocks[1], *blocks[:2]))
    assert grouped != expected["compute"]  # summed block by block, the two 1.0 count


@pytest.mark.parametrize("zero", [1, 2])
def test_alike_chunks_share_their_reductions_and_estimate_as_their_own(
    monkeypatch: pytest.MonkeyPatch, zero: int
) -> None:
    """Chunks whose buckets are alike but for names and layer numbers (a model's repeated
    layers) in ops of alike windows share one tuple of reductions (``OpBody.shape`` and the
    buckets' shape: ``ChunkModel.bucket_shape`` in a search's cache, ``Walker.bucket_shape``
    without one): the plan estimates as it does with each op's reductions made from its own
    buckets, and makes fewer of them."""
    topology = load_topology("dgx_h100", nodes=2)
    spec = get_preset("llama2-7b", num_layers=32, seq_len=2048)
    training = TrainingConfig(global_batch=64, micro_batch=1, recompute="selective")
    parallel = ParallelConfig(
        tp=2,
        pp=2,
        dp=4,
        zero=zero,
        schedule="interleaved",
        virtual_stages=8,  # 2 layers a chunk: 8 alike chunks a stage but the ends
        ddp=DDPConfig(bucket_mb=1.0),
    )
    made: list[int] = []
    reductions = Walker.reductions

    def counted(self: Walker, *args: Any) -> Any:
        made.append(1)
        return reductions(self, *args)

    monkeypatch.setattr(Walker, "reductions", counted)
    searched = Estimator(topology, spec).estimate(training, parallel)  # the cache's shapes
    searched_made = len(made)
    made.clear()
    shared = estimate_step(topology, spec, training, parallel)  # the walk's own shapes
    shared_made = len(made)
    made.clear()
    numbers = iter(range(10**9))

    def own(self: Walker, chunk: Any) -> int:  # every chunk a shape of its own
        return next(numbers)

    monkeypatch.setattr(Walker, "bucket_shape", own)
    alone = estimate_step(topology, spec, training, parallel)
    assert 0 < searched_made < len(made) / 2
    assert 0 < shared_made < len(made) / 2
    assert _facts(shared) == _facts(alone)
    # a search's estimate leaves out the timeline and the allocator's reserve
    facts, searched_facts = _facts(alone), _facts(searched)
    for key in ("timeline", "reserved"):
        del facts[key], searched_facts[key]  # type: ignore[attr-defined]
    assert searched_facts == facts


def test_a_bucket_shape_counts_ready_segments_from_the_chunks_first_layer() -> None:
    """Buckets alike but for names and layer numbers have one shape, in the walk
    (``Walker.bucket_shape``) and in a search's cache (the stage's ``ChunkModel.bucket_shape``);
    buckets ready at another layer of their chunk (counted from its first) have another."""
    w = _walker()

    def chunk(first: int, ready: list[int], names: str) -> ChunkModel:
        buckets = [
            Bucket(i, (f"{names}{i}",), 1000.0, 2000.0, seg, 0.5, False)
            for i, seg in enumerate(ready)
        ]
        c = ChunkModel(0, range(first, first + 2), [], [], [])
        c.buckets = buckets
        return c

    a = w.bucket_shape(chunk(4, [5, 4], "a"))
    assert w.bucket_shape(chunk(10, [11, 10], "b")) == a  # the same, two layers on
    assert w.bucket_shape(chunk(10, [10, 10], "c")) != a  # the first ready a layer early
    # a search's stages: the middle chunks of an interleaved stage alike, the embedding's not
    topology = load_topology("dgx_h100", nodes=2)
    spec = get_preset("llama2-7b", num_layers=32, seq_len=2048)
    training = TrainingConfig(global_batch=64, micro_batch=1)
    parallel = ParallelConfig(tp=2, pp=2, dp=4, schedule="interleaved", virtual_stages=8)
    stage = Estimator(topology, spec).schedule(training, parallel).stages[0]
    shapes = [c.bucket_shape for c in stage.chunks]
    assert None not in shapes
    assert shapes[0] != shapes[1] == shapes[2] == shapes[-1]  # chunk 0 holds the embedding
    # what the cache numbers: the tensors' ready fractions and segments, from the first layer
    cache = ShapeCache()

    def packed_number(first: int, segments: list[int]) -> int:
        tensors = [ParamTensor(f"t{i}", 1000.0, seg) for i, seg in enumerate(segments)]
        ((_, _, _, number),) = stage_module._grads_of(tensors, first, cache)
        return int(number)

    assert packed_number(4, [4, 4, 5, 5]) == packed_number(10, [10, 10, 11, 11])
    assert packed_number(4, [4, 4, 5, 5]) != packed_number(10, [10, 10, 12, 12])  # (alike ready)


def test_every_ranks_dp_link_in_one_pass_is_each_ones_own() -> None:
    """``dp_links`` gives each rank's data-parallel link seconds and busbw as ``dp_link``
    does rank by rank (the same floats: each rank's seconds added in tally order), and no
    entry for a rank without data-parallel calls."""
    rng = random.Random(3)
    stats = CallStats()
    axes = ["dp", "tp", "pp", "ep", "dp_cp"]
    for _ in range(300):
        key = CallKey(rng.randrange(6), rng.choice(axes), "all_reduce", 1e6, 8, "ring")
        stats.add(key, rng.random() * 1e-3, rng.random() * 1e11)
    stats.add(CallKey(9, "tp", "all_gather", 1e6, 8, "ring"), 1e-3, 1e11)
    links = dp_links(stats.items())
    assert 9 not in links and len(links) == 6
    for rank, link in links.items():
        assert float_bits(link) == float_bits(dp_link(stats.items(), rank))
