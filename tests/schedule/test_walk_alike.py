"""A search's FSDP prefetch variants that walk alike replay the walk of the last one walked in
full (:mod:`collsim.play.walk_alike`): only their segment loops run, and the result is, to the
bit, the one the whole walk gives (every memory event in its place, the account, the ends, the
call tallies); a variant that walks otherwise is walked in full; a dp stream or a unit's ready
time that differs only before the loop's end acts alike."""

from __future__ import annotations

import dataclasses
from typing import Any

import pytest

import collsim.play.walk_alike as walk_alike
import collsim.play.walker as walker_module
from collsim.cluster.topology import load_topology
from collsim.play.walk import Estimator
from collsim.play.walk_alike import _alike
from collsim.play.walker import Walker
from collsim.step.pricing import ClosedPricer
from collsim.workload import get_preset
from tests.schedule.helpers import float_bits, zero3_plan


def _walked(w: Walker) -> object:
    """What a walk leaves for the result: per rank its memory peak, activations' peak and
    timeline, its events (patterns expanded), account and end; the call tallies in order."""
    ranks = {
        rank: (
            prog.ledger.peak(),  # (a replay declares its sorted columns: read them first)
            prog.ledger.category_peak("activations"),
            prog.ledger.timeline(),
            prog.ledger.events,
            dict(prog.breakdown_s),
            prog.end_s,
        )
        for rank, prog in w.programs.items()
    }
    calls = [(k, t.count, t.time_s, t.busbw_bps) for k, t in w.stat_items()]
    return float_bits({"ranks": ranks, "calls": calls})


@pytest.mark.parametrize(
    ("raf", "pp", "depths"),
    [
        (False, 2, (0, 1, 2, 4)),
        (False, 1, (0, 1, 2, 4)),
        (True, 2, (0, 1, 2, 4)),
        (False, 2, (4, 2, 1, 0)),  # shallower than the record: every loop run
        (True, 2, (4, 2, 1, 0)),
    ],
)
def test_prefetch_variants_replay_the_walk_as_it_walks(
    monkeypatch: pytest.MonkeyPatch, raf: bool, pp: int, depths: tuple[int, ...]
) -> None:
    topology = load_topology("dgx_h100", nodes=2)
    spec = get_preset("llama2-7b", num_layers=8, seq_len=2048)
    est = Estimator(topology, spec)
    monkeypatch.setattr(walker_module, "RECORDED_LOOPS_SHARE", 1.0)  # every walk recorded
    replays: list[bool] = []
    replay = walker_module.replay_walk

    def counted(*args: Any) -> bool:
        replays.append(replay(*args))
        return replays[-1]

    monkeypatch.setattr(walker_module, "replay_walk", counted)
    for prefetch in depths:
        schedule = est.schedule(*zero3_plan(pp, raf, "step", prefetch))
        searched = Walker(schedule, est.pricer, est.shapes)
        searched.run()
        whole = Walker(schedule, ClosedPricer(topology))  # no search: always in full
        whole.run()
        assert _walked(searched) == _walked(whole)
    # each variant after the first recorded walk tried (a walk without prefetch is not recorded)
    assert len(replays) == len(depths) - 1 - (depths[0] == 0)
    if not raf and depths[0] == 0:  # 1, 2 and 4 keep every unit ready in time: 2, 4 replay 1
        assert replays == [True, True]


def test_a_walk_of_loops_throughout_is_not_recorded() -> None:
    """A walk is recorded while its segment loops are at most ``RECORDED_LOOPS_SHARE`` of its
    ops: units kept all step (loops: each chunk's first forward and last backward, 8 of 64
    ops) are; units resharded after every forward (every op a loop) are not; nor is a walk
    without prefetch, whose loops no deeper variant walks alike."""
    topology = load_topology("dgx_h100", nodes=2)
    spec = get_preset("llama2-7b", num_layers=8, seq_len=2048)
    est = Estimator(topology, spec)
    for raf, prefetch, recorded in ((False, 1, True), (True, 1, False), (False, 0, False)):
        w = Walker(est.schedule(*zero3_plan(2, raf, "step", prefetch)), est.pricer, est.shapes)
        w.run()
        assert (w.loops is not None) is recorded
        assert w.loop_limit == 64 * walker_module.RECORDED_LOOPS_SHARE


def test_a_replayed_variant_has_its_own_gather_events(monkeypatch: pytest.MonkeyPatch) -> None:
    """Depth 2 issues its gathers earlier than depth 1: the replay's events are its own (the
    recorded walk's would differ from the whole walk's)."""
    topology = load_topology("dgx_h100", nodes=2)
    spec = get_preset("llama2-7b", num_layers=8, seq_len=2048)
    est = Estimator(topology, spec)
    first = Walker(est.schedule(*zero3_plan(2, False, "step", 1)), est.pricer, est.shapes)
    first.run()
    schedule = est.schedule(*zero3_plan(2, False, "step", 2))
    replayed = Walker(schedule, est.pricer, est.shapes)
    replayed.run()
    assert replayed.loops is None  # replayed, not walked
    gathers = [
        [e for e in w.programs[r].ledger.events if str(e.label).startswith("gathered")]
        for w in (first, replayed)
        for r in sorted(w.programs)
    ]
    assert gathers[0] != gathers[2] or gathers[1] != gathers[3]


def _alike_after(
    dp_free: float, dp_last: float, units: dict[Any, float], held: tuple[float, float]
) -> bool:
    """:func:`_alike` of a rank's state against a record whose loop ended at 10.0."""
    return _alike((dp_free, dp_last, units), (10.0, *held), {(0, 1): 7.0})


def test_a_stream_or_unit_that_differs_only_before_the_clock_acts_alike() -> None:
    assert _alike_after(9.0, 8.0, {(0, 1): 7.0}, (9.0, 8.0))
    assert _alike_after(5.0, 10.0, {(0, 1): 3.0}, (9.0, 8.0))  # all at or before the clock
    assert not _alike_after(10.5, 8.0, {(0, 1): 7.0}, (9.0, 8.0))  # the stream busy past it
    assert not _alike_after(9.0, 11.0, {(0, 1): 7.0}, (9.0, 8.0))
    assert not _alike_after(9.0, 8.0, {(0, 1): 12.0}, (9.0, 8.0))  # a unit ready after it
    assert not _alike_after(9.0, 8.0, {(0, 2): 7.0}, (9.0, 8.0))  # another unit gathered
    assert not _alike_after(9.0, 12.0, {(0, 1): 7.0}, (12.0, 12.0))  # the record's past it


def test_a_loop_that_gathers_nothing_runs_only_where_it_may_act_otherwise(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Replaying depth 2's walk: a deeper variant runs only the loops that gathered; a
    shallower one runs them all; a recorded entry the variant's state does not act as (a unit
    more gathered) has its loop run."""
    topology = load_topology("dgx_h100", nodes=2)
    spec = get_preset("llama2-7b", num_layers=8, seq_len=2048)
    est = Estimator(topology, spec)
    monkeypatch.setattr(walker_module, "RECORDED_LOOPS_SHARE", 1.0)
    first = Walker(est.schedule(*zero3_plan(2, False, "step", 2)), est.pricer, est.shapes)
    first.run()
    held = first.shared.alike
    assert held is not None
    ran: list[int] = []
    run_segments = walk_alike.run_segments

    def counted(*args: Any) -> Any:
        ran.append(1)
        return run_segments(*args)

    monkeypatch.setattr(walk_alike, "run_segments", counted)

    def replayed(prefetch: int, record: walk_alike.AlikeWalk) -> int:
        ran.clear()
        plan = zero3_plan(2, False, "step", prefetch)
        assert walk_alike.replay_walk(Walker(est.schedule(*plan), est.pricer, est.shapes), record)
        return len(ran)

    gathering = sum(1 for rec in held.loops if rec.issued)
    assert 0 < gathering < len(held.loops)
    assert replayed(4, held) == gathering
    assert replayed(1, held) == len(held.loops)
    seen: set[int] = set()
    for k, rec in enumerate(held.loops):  # a loop that gathered nothing, not its rank's first
        if rec.rank in seen and not rec.issued:
            break
        seen.add(rec.rank)
    more = rec._replace(gathered_in={**rec.gathered_in, (99, "unit"): 0.0})
    tampered = dataclasses.replace(held, loops=[*held.loops[:k], more, *held.loops[k + 1 :]])
    assert replayed(4, tampered) == gathering + 1


@pytest.mark.parametrize("raf", [False, True])
def test_a_variant_walked_in_full_adds_the_runs_its_program_counted(
    monkeypatch: pytest.MonkeyPatch, raf: bool
) -> None:
    """A search's ZeRO-3 walk counts its TP runs and keeps what it added
    (``SharedWalk.zero3_tp``); a prefetch variant of the program, walked in full, runs the
    same ops in the same order and adds those without counting: the same tallies, to the
    bit, as the whole walk of the variant outside a search (tp 2: TP calls in every layer)."""
    topology = load_topology("dgx_h100", nodes=2)
    spec = get_preset("llama2-7b", num_layers=8, seq_len=2048)
    est = Estimator(topology, spec)
    monkeypatch.setattr(walker_module, "replay_walk", lambda *args: False)  # walked in full
    counted = []
    for prefetch in (0, 1, 2):
        schedule = est.schedule(*zero3_plan(2, raf, "step", prefetch))
        searched = Walker(schedule, est.pricer, est.shapes)
        searched.run()
        counted.append(searched.count_runs)
        whole = Walker(schedule, ClosedPricer(topology))
        whole.run()
        assert whole.count_runs
        assert _walked(searched) == _walked(whole)
        assert any(key.axis == "tp" for key, _ in searched.stat_items())
    assert counted == [True, False, False]


def test_pipeline_receive_buffers_are_one_block_a_rank() -> None:
    """A ZeRO-3 walk records each rank's pipeline receive buffers as one block of columns
    after its other events (:meth:`Walker.record_messages`), no event made: every buffer
    received is freed, none is in the event list, and a ledger with the same events recorded
    one by one in time order has the same peaks and timeline, to the bit."""
    from collsim.step.memory import MemoryLedger

    topology = load_topology("dgx_h100", nodes=2)
    spec = get_preset("llama2-7b", num_layers=8, seq_len=2048)
    est = Estimator(topology, spec)
    schedule = est.schedule(*zero3_plan(2, False, "step", 1))
    w = Walker(schedule, est.pricer, est.shapes)
    w.run()
    size = float(schedule.p2p_bytes)
    assert size > 0
    for rank, prog in w.programs.items():
        ledger = prog.ledger
        peaks = (ledger.peak(), ledger.category_peak("activations"), ledger.timeline())
        listed, _, blocks = ledger.copy_rows() or ([], [], [])
        assert [b.labels for b in blocks] == [("pp recv",)]
        assert not [e for e in listed if e.label == "pp recv"]
        (block,) = blocks
        assert block.at == len(listed)
        assert sorted(block.deltas.tolist()) == [-size] * (len(block.deltas) // 2) + [size] * (
            len(block.deltas) // 2
        )
        one_by_one = MemoryLedger(rank)
        for e in sorted(ledger.events, key=lambda e: (e.time_s, -e.delta_bytes)):
            if e.delta_bytes > 0:
                one_by_one.alloc(e.time_s, e.category, e.delta_bytes, e.label)
            else:
                one_by_one.free(e.time_s, e.category, -e.delta_bytes, e.label)
        again = (one_by_one.peak(), one_by_one.category_peak("activations"), one_by_one.timeline())
        assert float_bits(peaks) == float_bits(again)


def test_plans_walk_alike_when_they_differ_only_in_prefetch() -> None:
    """``alike_key``: equal for plans that differ only in the FSDP prefetch depth, unequal
    for any other knob (a DDP bucket, resharding after forward, the training config)."""
    from collsim.play.walk_alike import alike_key

    topology = load_topology("dgx_h100", nodes=2)
    spec = get_preset("llama2-7b", num_layers=8, seq_len=2048)
    est = Estimator(topology, spec)

    def key(training: Any, parallel: Any) -> object:
        return alike_key(est.schedule(training, parallel).plan)

    training, parallel = zero3_plan(2, False, "step", 1)
    deeper = dataclasses.replace(parallel, fsdp=dataclasses.replace(parallel.fsdp, prefetch=4))
    assert key(training, parallel) == key(training, deeper)
    assert hash(key(training, parallel)) == hash(key(training, deeper))
    others = [
        (
            training,
            dataclasses.replace(parallel, ddp=dataclasses.replace(parallel.ddp, bucket_mb=7)),
        ),
        zero3_plan(2, True, "step", 1),
        (dataclasses.replace(training, global_batch=2 * training.global_batch), parallel),
    ]
    for other in others:
        assert key(*other) != key(training, parallel)
