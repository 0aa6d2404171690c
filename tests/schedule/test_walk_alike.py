"""A search's FSDP prefetch variants that walk alike replay the walk of the last one walked in
full (:mod:`collsim.play.walk_alike`): only their segment loops run, and the result is, to the
bit, the one the whole walk gives (every memory event in its place, the account, the ends, the
call tallies); a variant that walks otherwise is walked in full; a dp stream or a unit's ready
time that differs only before the loop's end acts alike."""

from __future__ import annotations

from typing import Any

import pytest

import collsim.play.walker as walker_module
from collsim.cluster.topology import load_topology
from collsim.play.walk import Estimator
from collsim.play.walk_alike import LoopRecord, _alike
from collsim.play.walk_tables import RankState
from collsim.play.walker import Walker
from collsim.step.memory import MemoryLedger
from collsim.step.pricing import ClosedPricer
from collsim.workload import get_preset
from tests.schedule.helpers import float_bits, zero3_plan


def _walked(w: Walker) -> object:
    """What a walk leaves for the result: per rank its events (patterns expanded), account
    and end; the call tallies in order."""
    ranks = {
        rank: (prog.ledger.events, dict(prog.breakdown_s), prog.end_s)
        for rank, prog in w.programs.items()
    }
    calls = [(k, t.count, t.time_s, t.busbw_bps) for k, t in w.stat_items()]
    return float_bits({"ranks": ranks, "calls": calls})


@pytest.mark.parametrize(("raf", "pp"), [(False, 2), (False, 1), (True, 2)])
def test_prefetch_variants_replay_the_walk_as_it_walks(
    monkeypatch: pytest.MonkeyPatch, raf: bool, pp: int
) -> None:
    topology = load_topology("dgx_h100", nodes=2)
    spec = get_preset("llama2-7b", num_layers=8, seq_len=2048)
    est = Estimator(topology, spec)
    replays: list[bool] = []
    replay = walker_module.replay_walk

    def counted(*args: Any) -> bool:
        replays.append(replay(*args))
        return replays[-1]

    monkeypatch.setattr(walker_module, "replay_walk", counted)
    for prefetch in (0, 1, 2, 4):
        schedule = est.schedule(*zero3_plan(pp, raf, "step", prefetch))
        searched = Walker(schedule, est.pricer, est.shapes)
        searched.run()
        whole = Walker(schedule, ClosedPricer(topology))  # no search: always in full
        whole.run()
        assert _walked(searched) == _walked(whole)
    assert len(replays) == 3  # each variant after the first tried
    if not raf:  # depths 1, 2 and 4 keep every unit ready in time: 2 and 4 replay 1
        assert replays == [False, True, True]


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


def _record(exit_dp: tuple[float, float], units: dict[Any, float]) -> LoopRecord:
    return LoopRecord(0, 0, 0, (0.0, 0.0, 0.0), {}, 0, (10.0, *exit_dp), units, 0, None, 0)


def _rank(dp_free: float, dp_last: float, units: dict[Any, float]) -> RankState:
    prog = RankState(0, None, MemoryLedger(0))  # type: ignore[arg-type]
    prog.now, prog.dp_free, prog.dp_last_end, prog.gathered = 10.0, dp_free, dp_last, units
    return prog


def test_a_stream_or_unit_that_differs_only_before_the_loop_end_acts_alike() -> None:
    rec = _record((9.0, 8.0), {(0, 1): 7.0})
    assert _alike(_rank(9.0, 8.0, {(0, 1): 7.0}), rec)
    assert _alike(_rank(5.0, 10.0, {(0, 1): 3.0}), rec)  # all at or before the clock
    assert not _alike(_rank(10.5, 8.0, {(0, 1): 7.0}), rec)  # the stream busy past it
    assert not _alike(_rank(9.0, 11.0, {(0, 1): 7.0}), rec)
    assert not _alike(_rank(9.0, 8.0, {(0, 1): 12.0}), rec)  # a unit ready after it
    assert not _alike(_rank(9.0, 8.0, {(0, 2): 7.0}), rec)  # another unit gathered
    late = _record((12.0, 12.0), {(0, 1): 7.0})
    assert not _alike(_rank(9.0, 12.0, {(0, 1): 7.0}), late)  # the record's stream past it
