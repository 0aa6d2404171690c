"""The allocator replay's skip over the repeats of a pipeline's steady state
(collsim.step.replay_period): the same answer as replaying every event, on shipped scenarios,
and a skip that does happen where the steady state is long."""

from __future__ import annotations

import warnings
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest

import collsim.step.assemble as assemble_module
import collsim.step.replay_period as replay_period
from collsim.core.errors import CollsimWarning
from collsim.play.engine import simulate_step
from collsim.play.walk import estimate_step
from collsim.step import allocator
from collsim.step.memory import MemoryEvent, MemoryLedger, MemoryPattern
from collsim.step.replay_events import ReplayEvents, recording_digest, replay_events
from collsim.step.shapes import ShapeCache
from collsim.study.scenario import load_scenario

REPO = Path(__file__).resolve().parents[1]
SCENARIOS = REPO / "scenarios"
FAST = [
    "3d_175b.yaml",
    "ddp_gpt3_1.3b.yaml",
    "pipeline_13b_1f1b.yaml",
    "pipeline_13b_gpipe.yaml",
    "pipeline_13b_interleaved.yaml",
    "pipeline_13b_zb_h1.yaml",
    "pipeline_13b_dualpipev.yaml",
    "published/moe_qwen3_30b_a3b_h100_16_fp8.yaml",
    "published/moe_gpt_oss_120b_h100_64.yaml",
    "published/llmf_a100_30b_s2048_8g.yaml",
    "published/cp_llama3_405b_h100_16384_8k.yaml",
]
"""Shipped scenarios whose replays run in a few seconds together (1F1B, GPipe, interleaved,
ZB-H1, DualPipeV, MoE, FSDP, context parallel)."""
EVERY = sorted(
    str(p.relative_to(SCENARIOS))
    for p in [*SCENARIOS.glob("*.yaml"), *(SCENARIOS / "published").glob("*.yaml")]
)


def _ledgers(path: Path, engine: bool) -> tuple[dict[int, Any], dict[str, Any]]:
    """Every walked rank's memory ledger of the scenario's step, and the replay's inputs."""
    seen: dict[str, Any] = {}
    real = assemble_module.reserved_memory

    def keep(ledgers: Any, **kwargs: Any) -> Any:
        seen["ledgers"], seen["schedule"] = dict(ledgers), kwargs["schedule"]
        return real(ledgers, **kwargs)

    sc = load_scenario(path)
    assemble_module.reserved_memory = keep
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", CollsimWarning)
            play = simulate_step if engine else estimate_step
            play(sc.cluster.load(), sc.model, sc.training, sc.parallel)
    finally:
        assemble_module.reserved_memory = real
    schedule = seen["schedule"]
    tr, device = schedule.plan.training, schedule.plan.topology.device
    inputs = {
        "expandable_segments": allocator.expandable_segments_of(tr.stack, tr.expandable_segments),
        "tensors": allocator.activation_tensors(schedule),
        "workspaces": allocator.cublas_workspaces(device),
        "logits": allocator.logits_bytes(schedule),
        "limit_bytes": allocator.allocator_limit_bytes(device),
    }
    return seen["ledgers"], inputs


def _same_with_and_without(name: str, engine: bool = False) -> int:
    """Replay every rank with and without the skip, with and without the device's limit;
    assert the answers equal; return how many replays skipped."""
    ledgers, inputs = _ledgers(SCENARIOS / name, engine)
    skips = 0
    pairing = allocator._Pairing
    real = pairing.relabel

    def counted(pairs: Any, by: int) -> None:
        nonlocal skips
        skips += 1
        real(pairs, by)

    pairing.relabel = counted  # type: ignore[method-assign]
    try:
        for limit in (inputs["limit_bytes"], None):
            for rank, ledger in ledgers.items():
                events = ledger.sorted_events()
                kwargs = {**inputs, "limit_bytes": limit}
                full = allocator.replay_ledger(rank, events, **kwargs, skip_repeats=False)
                fast = allocator.replay_ledger(rank, events, **kwargs)
                assert fast == full, (name, rank, limit)
    finally:
        pairing.relabel = real  # type: ignore[method-assign]
    return skips


@pytest.mark.parametrize("name", FAST)
def test_skip_gives_the_replay_of_every_event(name: str) -> None:
    _same_with_and_without(name)


def test_skip_happens_on_a_long_steady_state() -> None:
    # 96 micro-batches per replica: every walked rank's replay skips, in both interpreters
    assert _same_with_and_without("3d_175b.yaml") == 16
    assert _same_with_and_without("3d_175b.yaml", engine=True) == 16
    assert _same_with_and_without("published/moe_qwen3_30b_a3b_h100_16_fp8.yaml") == 2


def test_find_period_by_hand() -> None:
    # a period of three events (a layer's activations, a message in and out), each micro-batch
    # one on from the one before, after a warm-up of two unrelated events
    events = [MemoryEvent(0.0, "buffers", 8.0, "x"), MemoryEvent(0.0, "buffers", -8.0, "x")]
    for mb in range(10):
        events += [
            MemoryEvent(0.0, "activations", 64.0, ("act", 0, mb, 0)),
            MemoryEvent(0.0, "buffers", 4.0, "pp recv"),
            MemoryEvent(0.0, "activations", -64.0, ("free", 0, mb, 0)),
        ]
    assert replay_period.find_period(events) == replay_period.Period(events=3, shift=1)
    full = allocator.replay_ledger(0, events, expandable_segments=False, skip_repeats=False)
    assert allocator.replay_ledger(0, events, expandable_segments=False) == full
    assert replay_period.find_period(events[:8]) is None  # too short: no window of four periods


@pytest.mark.slow
@pytest.mark.parametrize("name", EVERY)
def test_skip_gives_the_replay_of_every_event_on_every_scenario(name: str) -> None:
    _same_with_and_without(name)


@pytest.mark.parametrize("engine", [True, False])
def test_a_kept_state_is_matched_at_its_first_return(engine: bool) -> None:
    # 3d_175b's first stage (the rank the engine replays): its steady state is seen from the
    # state kept at the start of its run of boundaries, at the signature's first return (no
    # state taken to wait a cycle more)
    ledgers, inputs = _ledgers(SCENARIOS / "3d_175b.yaml", engine=engine)
    seen: list[tuple[int, int, int]] = []
    real = replay_period.Steady._skip

    def skip(steady: Any, i: int, cycle: int, pairs: Any) -> int:
        end = real(steady, i, cycle, pairs)
        seen.append((steady.states, (i - steady.anchor) // steady.period - cycle, end - i))
        return end

    replay_period.Steady._skip = skip  # type: ignore[method-assign]
    try:
        allocator.replay_ledger(0, ledgers[0].sorted_events(), **inputs)
    finally:
        replay_period.Steady._skip = real  # type: ignore[method-assign]
    [(states, kept_at, skipped)] = seen
    assert states == 0 and kept_at < replay_period.KEPT_STATES and skipped > 0


@pytest.mark.parametrize("engine", [True, False])
@pytest.mark.parametrize("name", FAST[:4] + FAST[6:8])
def test_columns_are_the_sorted_events(name: str, engine: bool) -> None:
    # the columnar events the replay reads of both interpreters' ledgers (the engine places
    # patterns row by row, the walk as columns): every event, in sorted_events' order, the
    # same period found, the same replay
    ledgers, inputs = _ledgers(SCENARIOS / name, engine)
    columnar = 0
    for rank, ledger in ledgers.items():
        events, listed = replay_events(ledger), ledger.sorted_events()
        columnar += isinstance(events, ReplayEvents)
        assert list(events) == listed and events[3:9] == listed[3:9]
        assert replay_period.find_period(events) == replay_period.find_period(listed)
        got = allocator.replay_ledger(rank, events, **inputs)
        assert got == allocator.replay_ledger(rank, listed, **inputs)
    assert columnar > 0


def _placed_ledger(kind: str, label: object = "x") -> MemoryLedger:
    """A ledger of one single event and a pattern placed for six micro-batches."""
    ledger = MemoryLedger(0)
    ledger.alloc(0.0, "buffers", 8.0, label)
    pattern = MemoryPattern("activations", [(0.0, 64.0, kind, 3), (0.5, -64.0, "free", 3)])
    for mb in range(6):
        ledger.place(float(mb), pattern, mb, 0)
    return ledger


def test_columns_fall_back_to_the_sorted_list() -> None:
    # shifting kinds with a hashable single label: columns; a kind that does not shift or an
    # unhashable label: the list sorted_events gives
    ledger = _placed_ledger("act")
    assert isinstance(replay_events(ledger), ReplayEvents)
    assert list(replay_events(ledger)) == ledger.sorted_events()
    for other in (_placed_ledger("grad"), _placed_ledger("act", label=["unhashable"])):
        got = replay_events(other)
        assert type(got) is list and got == other.sorted_events()


def test_a_search_replays_the_same_events_once(monkeypatch: pytest.MonkeyPatch) -> None:
    # two walks of one plan record the same events: one digest, and a search's shape cache
    # answers the second replay (on another rank number too) with the first one's figures,
    # those of a replay without it, without sorting its events again; another plan's events
    # have another digest
    first, inputs = _ledgers(SCENARIOS / "3d_175b.yaml", False)
    again, _ = _ledgers(SCENARIOS / "3d_175b.yaml", False)
    other, other_inputs = _ledgers(SCENARIOS / "pipeline_13b_1f1b.yaml", False)
    rank, rank_other = min(first), min(other)
    events = replay_events(first[rank])
    assert isinstance(events, ReplayEvents)
    digest = recording_digest(first[rank])
    assert digest is not None and digest == recording_digest(again[rank])
    assert digest != recording_digest(other[rank_other])
    memo = ShapeCache()
    alone = allocator.replay_ledger(rank, events, **inputs)
    sorted_for: list[object] = []
    monkeypatch.setattr(
        allocator,
        "replay_events",
        lambda ledger: (sorted_for.append(ledger), replay_events(ledger))[1],
    )
    assert allocator._replay_kept(rank, first[rank], inputs, memo) == alone
    moved = allocator._replay_kept(rank + 1, again[rank], inputs, memo)
    assert memo.sizes() == {"allocator replays": 1}
    assert moved == replace(alone, rank=rank + 1)
    assert sorted_for == [first[rank]]  # (the second ledger's events never sorted)
    allocator._replay_kept(rank_other, other[rank_other], other_inputs, memo)
    assert memo.sizes() == {"allocator replays": 2}
