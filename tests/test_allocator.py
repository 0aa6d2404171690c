"""The caching allocator (collsim.step.caching_allocator) and its replay
(collsim.step.allocator) against outcomes worked out by hand from the rules of
c10/cuda/CUDACachingAllocator.cpp (pytorch/pytorch at 001074d), and its reserved memory on
shipped scenarios."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from collsim.cluster.hardware import get_device
from collsim.step.allocator import cublas_workspaces, expandable_segments_of, replay_ledger
from collsim.step.caching_allocator import (
    MAX_REQUEST_SHAPES,
    AllocatorOOM,
    Block,
    CachingAllocator,
    allocation_size,
    round_size,
)
from collsim.step.memory import MemoryEvent
from collsim.study.job import run_job
from collsim.workload import get_preset
from collsim.workload.compute import ComputeModel

MIB = 1 << 20
SCENARIOS = Path(__file__).resolve().parents[1] / "scenarios"


def test_rounding_and_segment_sizes() -> None:
    assert round_size(100) == 512
    assert round_size(1000) == 1024
    assert allocation_size(round_size(100 * 1024)) == 2 * MIB  # small pool
    assert allocation_size(6 * MIB) == 20 * MIB  # 1-10 MiB: a 20 MiB segment
    assert allocation_size(10 * MIB + 1) == 12 * MIB  # from 10 MiB: rounded to 2 MiB


def test_three_6mib_share_one_20mib_segment() -> None:
    a = CachingAllocator()
    for _ in range(3):
        a.malloc(6 * MIB)
    assert a.stats.reserved_bytes == 20 * MIB
    assert a.stats.allocated_bytes == 18 * MIB


def test_9_then_11_mib_reuse_the_split_remainder() -> None:
    # 9 MiB takes a 20 MiB segment and splits it (11 MiB left > 1 MiB); 11 MiB fits the rest
    a = CachingAllocator()
    a.malloc(9 * MIB)
    a.malloc(11 * MIB)
    assert (a.stats.reserved_bytes, a.stats.allocated_bytes) == (20 * MIB, 20 * MIB)


def test_11_then_9_mib_take_two_segments() -> None:
    # 11 MiB gets a 12 MiB segment of its own; the 1 MiB left is not split off (must be
    # > 1 MiB), so the block stays 12 MiB; 9 MiB then needs a 20 MiB segment
    a = CachingAllocator()
    a.malloc(11 * MIB)
    a.malloc(9 * MIB)
    assert a.stats.reserved_bytes == 32 * MIB
    assert a.stats.allocated_bytes == 12 * MIB + 9 * MIB


def test_free_split_merge_and_empty_cache() -> None:
    a = CachingAllocator()
    x = a.malloc(12 * MIB)
    a.free(x)
    y = a.malloc(4 * MIB)  # best fit: the cached 12 MiB block, split 4 + 8
    z = a.malloc(8 * MIB)  # the 8 MiB remainder
    assert a.stats.reserved_bytes == 12 * MIB
    a.free(y)
    a.free(z)  # merged back into one 12 MiB block: a whole free segment
    a.empty_cache()
    assert a.stats.reserved_bytes == 0
    assert a.stats.peak_reserved_bytes == 12 * MIB


def test_small_pool_packs_into_2mib() -> None:
    a = CachingAllocator()
    for _ in range(10):
        a.malloc(100_000)  # 100,352 B rounded
    assert a.stats.reserved_bytes == 2 * MIB
    assert a.stats.allocated_bytes == 10 * 100_352


def test_streams_have_their_own_pools() -> None:
    a = CachingAllocator()
    a.free(a.malloc(4 * MIB, stream=0))
    a.malloc(4 * MIB, stream=1)  # the cached block is stream 0's
    assert a.stats.reserved_bytes == 40 * MIB


def test_a_slightly_larger_request_fragments_segments_not_expandable_ones() -> None:
    # batch N then N + 1 (Note [Expandable Segments]): 30 MiB freed, then 32 MiB
    plain = CachingAllocator()
    plain.free(plain.malloc(30 * MIB))
    plain.malloc(32 * MIB)
    assert plain.stats.reserved_bytes == 62 * MIB
    grown = CachingAllocator(expandable_segments=True)
    grown.free(grown.malloc(30 * MIB))  # maps 2 pages of 20 MiB
    grown.malloc(32 * MIB)  # fits the 40 MiB already mapped
    assert grown.stats.reserved_bytes == 40 * MIB


def test_expandable_segment_grows_by_pages_from_its_free_tail() -> None:
    a = CachingAllocator(expandable_segments=True)
    a.malloc(30 * MIB)  # 40 MiB mapped, 10 MiB free at the end
    a.malloc(30 * MIB)  # the 10 MiB tail + one more 20 MiB page
    assert a.stats.reserved_bytes == 60 * MIB
    assert a.stats.allocated_bytes == 60 * MIB


def test_out_of_memory_releases_the_cache_and_retries() -> None:
    a = CachingAllocator(limit_bytes=40 * MIB)
    a.free(a.malloc(30 * MIB))
    a.malloc(32 * MIB)  # 30 + 32 > 40: the cached 30 MiB segment goes, then it fits
    assert a.stats.num_alloc_retries == 1
    assert a.stats.reserved_bytes == 32 * MIB
    with pytest.raises(AllocatorOOM):
        a.malloc(12 * MIB)  # nothing cached to release
    assert a.stats.num_ooms == 1


def test_replay_pairs_labelled_activation_frees() -> None:
    ev = [
        MemoryEvent(0.0, "activations", 6 * MIB, ("act", 0, 0, 0)),
        MemoryEvent(1.0, "activations", 6 * MIB, ("act", 1, 0, 0)),
        MemoryEvent(2.0, "activations", 2 * MIB, ("recompute", 1, 0, 0)),
        MemoryEvent(3.0, "activations", -8 * MIB, ("free", 1, 0, 0)),
        MemoryEvent(4.0, "activations", 6 * MIB, ("act", 1, 1, 0)),
    ]
    out = replay_ledger(0, ev, expandable_segments=False)
    assert out.unmatched_bytes == 0
    # all four live at once (6 + 6 + 2 in one 20 MiB segment), then the freed blocks reused
    assert out.peak_reserved_bytes == 20 * MIB
    assert out.peak_allocated_bytes == 14 * MIB


def test_stack_defaults_and_override() -> None:
    assert expandable_segments_of("torchtitan") is True
    assert expandable_segments_of("deepspeed") is False
    assert expandable_segments_of(None) is False
    assert expandable_segments_of("torchtitan", False) is False


def test_shipped_scenario_reserves_at_least_what_it_allocates() -> None:
    path = SCENARIOS / "fsdp_llama2_7b.yaml"
    closed = run_job(path, fidelity="closed").result
    engine = run_job(path).result
    for result in (closed, engine):
        assert result.memory_reserved_bytes is not None
        assert result.allocator is not None
        assert result.allocator["unmatched_bytes"] == 0
        assert result.memory_reserved_bytes >= result.memory_peak_bytes
    assert closed.memory_reserved_bytes == engine.memory_reserved_bytes
    assert closed.to_dict()["memory_reserved_bytes"] == closed.memory_reserved_bytes


def test_scenario_key_overrides_the_stack() -> None:
    path = SCENARIOS / "published" / "moe_gpt_oss_120b_h100_64.yaml"
    default = run_job(path, fidelity="closed").result
    plain = run_job(path, ["training.expandable_segments=false"], fidelity="closed").result
    assert default.allocator is not None and plain.allocator is not None
    assert default.allocator["expandable_segments"] is True  # nemo_automodel
    assert plain.allocator["expandable_segments"] is False
    assert plain.memory_peak_bytes == default.memory_peak_bytes


@pytest.mark.parametrize("recompute", ["none", "selective", "full"])
def test_a_layers_tensors_add_up_to_its_activation_bytes(recompute: str) -> None:
    model = ComputeModel(get_device("h100"), "bf16")
    times = model.layer_times(
        get_preset("llama2-7b"), micro_batch=1, tp=2, sequence_parallel=True, recompute=recompute
    )
    assert sum(times.kept_tensor_bytes) == pytest.approx(times.activation_bytes, rel=1e-12)
    assert sum(times.rebuilt_tensor_bytes) == pytest.approx(times.transient_bytes, abs=1e-6)
    assert len(times.kept_tensor_bytes) >= (1 if recompute == "full" else 5)


@pytest.mark.slow
@pytest.mark.parametrize(
    "name", ["pipeline_13b_interleaved", "published/hsdp_qwen3_30b_a3b_h100_64_fsdp"]
)
def test_closed_form_and_engine_reserve_the_same(name: str) -> None:
    path = SCENARIOS / f"{name}.yaml"
    closed = run_job(path, fidelity="closed").result
    engine = run_job(path).result
    assert closed.memory_peak_bytes == engine.memory_peak_bytes
    assert closed.memory_reserved_bytes == engine.memory_reserved_bytes
    assert closed.memory_reserved_bytes is not None
    assert closed.memory_reserved_bytes >= closed.memory_peak_bytes


# requests around the pool and segment thresholds: 512 B, 1 MiB, 10 MiB (sizes in KiB)
PARTS = 16
"""Tensors in the largest group the cached-fit tests ask for (a layer's activations are 14 on
GPT-3 175B)."""
_SIZES_KIB = st.sampled_from([1, 300, 1024, 1025, 2048, 6144, 9216, 10240, 11264, 30720, 49152])


@settings(max_examples=150, deadline=None)
@given(
    expandable=st.booleans(),
    live=st.lists(st.tuples(_SIZES_KIB, st.booleans()), min_size=1, max_size=25),
    group=st.lists(_SIZES_KIB, min_size=1, max_size=6),
)
def test_a_group_freed_at_once_leaves_the_cache_as_it_was(
    expandable: bool, live: list[tuple[int, bool]], group: list[int]
) -> None:
    # what the replay's shortcut rests on: tensors allocated from cached blocks and freed
    # before anything else is allocated change nothing but the allocated peak
    a = CachingAllocator(expandable_segments=expandable)
    blocks = [(a.malloc(kib * 1024), keep) for kib, keep in live]
    for block, keep in blocks:
        if not keep:
            a.free(block)
    free_before = {pool: list(entries) for pool, entries in a._free.items()}
    reserved, allocated = a.stats.reserved_bytes, a.stats.allocated_bytes
    fit = a.cached_fit([kib * 1024 for kib in group])
    made = [a.malloc(kib * 1024) for kib in group]
    if fit is None:
        assert a.stats.reserved_bytes > reserved
        return
    assert a.stats.reserved_bytes == reserved
    assert a.stats.allocated_bytes - allocated == fit
    for block in reversed(made):
        a.free(block)
    assert {pool: entries for pool, entries in a._free.items() if entries} == {
        pool: entries for pool, entries in free_before.items() if entries
    }


def test_replay_holds_rebuilt_activations_freed_next() -> None:
    # the rebuilt tensors of layer 1 (two blocks) come from the cached 20 MiB segment and are
    # freed by the next event: the peak counts them, the cache does not change
    ev = [
        MemoryEvent(0.0, "activations", 6 * MIB, ("act", 0, 0, 0)),
        MemoryEvent(1.0, "activations", 6 * MIB, ("act", 1, 0, 0)),
        MemoryEvent(1.5, "activations", -6 * MIB, ("free", 0, 0, 0)),
        MemoryEvent(2.0, "activations", 8 * MIB, ("recompute", 1, 0, 0)),
        MemoryEvent(3.0, "activations", -14 * MIB, ("free", 1, 0, 0)),
    ]
    out = replay_ledger(0, ev, expandable_segments=False, tensors={8 * MIB: (2 * MIB, 6 * MIB)})
    assert out.unmatched_bytes == 0
    assert out.peak_reserved_bytes == 20 * MIB
    assert out.peak_allocated_bytes == 14 * MIB  # 6 live + 2 + 6 held


def test_cublas_workspaces_by_device() -> None:
    # parseChosenWorkspaceSize (CublasHandlePool.cpp): 32 MiB on compute capability 9.0,
    # else :4096:2:16:8; one per handle, two handles (forward and autograd threads)
    assert cublas_workspaces(get_device("h100")) == (32 * MIB, 32 * MIB)
    assert cublas_workspaces(get_device("a100")) == (8 * MIB + 128 * 1024,) * 2


def test_replay_with_workspaces_and_the_heads_logits() -> None:
    ev = [
        MemoryEvent(0.0, "activations", 12 * MIB, ("act", "head", 0, 0)),
        MemoryEvent(1.0, "activations", -12 * MIB, ("free", "head", 0, 0)),
    ]
    plain = replay_ledger(0, ev, expandable_segments=False, workspaces=(32 * MIB, 32 * MIB))
    # two 32 MiB segments, then the 12 MiB head in a 12 MiB segment of its own
    assert plain.peak_reserved_bytes == 76 * MIB
    full = replay_ledger(
        0, ev, expandable_segments=False, workspaces=(32 * MIB, 32 * MIB), logits=4 * MIB
    )
    # the 4 MiB logits take a 20 MiB segment (split 4 + 16), the head the 16 MiB rest; in
    # backward the logits' gradient takes the freed 4 MiB block: no new segment
    assert full.peak_reserved_bytes == 84 * MIB
    assert full.peak_allocated_bytes == 80 * MIB
    assert full.unmatched_bytes == 0


def test_a_scenarios_logits_and_workspaces_by_hand() -> None:
    # GPT-3 1.3B, micro-batch 2 x 2,048 tokens, vocabulary 50,257 on one rank, bf16; DGX H100
    result = run_job(SCENARIOS / "ddp_gpt3_1.3b.yaml", fidelity="closed").result
    assert result.allocator is not None
    assert result.allocator["logits_bytes"] == 2 * 2048 * 50257 * 2
    assert result.allocator["cublas_workspace_bytes"] == 64 * MIB


@settings(max_examples=60, deadline=None)
@given(
    expandable=st.booleans(),
    kept=st.lists(_SIZES_KIB, min_size=2, max_size=6),
    rebuilt=st.lists(_SIZES_KIB, min_size=1, max_size=5),
    microbatches=st.integers(min_value=1, max_value=3),
    limit_mib=st.sampled_from([None, 120, 400]),
)
def test_holding_rebuilt_tensors_replays_to_the_same_bytes(
    expandable: bool,
    kept: list[int],
    rebuilt: list[int],
    microbatches: int,
    limit_mib: int | None,
) -> None:
    # layers of a recomputed step: kept inputs in forward, then per layer in reverse its
    # rebuilt tensors and their free with the kept input; replayed with and without holding
    import collsim.step.allocator as allocator

    rebuilt_bytes = sum(kib * 1024 for kib in rebuilt)
    ev: list[MemoryEvent] = []
    t = 0.0
    for mb in range(microbatches):
        for layer, kib in enumerate(kept):
            ev.append(MemoryEvent(t, "activations", kib * 1024.0, ("act", layer, mb, 0)))
            t += 1
        for layer in reversed(range(len(kept))):
            label = (layer, mb, 0)
            ev.append(MemoryEvent(t, "activations", float(rebuilt_bytes), ("recompute", *label)))
            t += 1
            freed = -float(rebuilt_bytes + kept[layer] * 1024)
            ev.append(MemoryEvent(t, "activations", freed, ("free", *label)))
    tensors = {rebuilt_bytes: tuple(kib * 1024 for kib in rebuilt)}
    limit = None if limit_mib is None else limit_mib * MIB

    def replay() -> object:
        return replay_ledger(
            0, ev, expandable_segments=expandable, limit_bytes=limit, tensors=tensors
        )

    held = replay()
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(allocator, "_freed_next", lambda ev, nxt: False)
        assert replay() == held


@settings(max_examples=60, deadline=None)
@given(
    steps=st.lists(
        st.tuples(st.sampled_from(["malloc", "free", "fit"]), _SIZES_KIB, st.integers(0, 99)),
        min_size=1,
        max_size=80,
    ),
)
def test_cached_fit_answers_from_its_cache_as_worked_out_afresh(
    steps: list[tuple[str, int, int]],
) -> None:
    # one allocator through many states, repeated requests answered from the cache: each
    # answer is the one worked out on the free lists of the moment, and each free list is
    # sorted and its blocks found by their addresses
    a = CachingAllocator(expandable_segments=False)
    live: list[Block] = []
    for action, kib, pick in steps:
        if action == "malloc":
            live.append(a.malloc(kib * 1024))
        elif action == "free" and live:
            a.free(live.pop(pick % len(live)))
        else:  # a request of two parts and one of PARTS + 1
            for sizes in ((kib * 1024, 2048 * 1024), (kib * 1024,) * (PARTS + 1)):
                for _ in range(2):  # the second from the cache
                    assert a.cached_fit(sizes) == a._cached_fit(sizes, 0)
        for pool, entries in a._free.items():
            assert entries == sorted(entries)
            assert all(
                a._free_at[addr].size == size and a._free_at[addr].pool == pool
                for size, addr in entries
            )


@settings(max_examples=60, deadline=None)
@given(
    held=st.lists(st.sampled_from([2, 6, 20, 48]), min_size=20, max_size=60),
    freed=st.lists(st.integers(0, 59), max_size=60),
    parts=st.lists(st.sampled_from([1, 2, 6, 20, 24, 48]), min_size=1, max_size=PARTS),
)
def test_cached_fit_by_capped_sizes_is_the_fit_worked_out(
    held: list[int], freed: list[int], parts: list[int]
) -> None:
    # many free blocks of a few sizes (more of one size than the cap counts): each answer,
    # from the cache kept by the free lists' sizes so capped, is the one worked out afresh
    # on the lists of the moment, as the blocks are freed one by one
    a = CachingAllocator(expandable_segments=False)
    live = [a.malloc(mib * MIB) for mib in held]
    requests = [tuple(mib * MIB for mib in parts)]
    requests += [(mib * MIB,) * k for mib in (2, 6, 20, 48) for k in (1, 2, 3, PARTS)]
    for pick in freed:
        if live:
            a.free(live.pop(pick % len(live)))
        for sizes in requests:
            assert a.cached_fit(sizes) == a._cached_fit(sizes, 0)


def test_free_blocks_past_the_cap_share_a_cached_fit() -> None:
    # 20 and then 21 free 12 MiB segments (from 10 MiB a request gets a segment of its own):
    # the same blocks answer a request of PARTS parts, so the second state is
    # answered from the first one's entry
    a = CachingAllocator(expandable_segments=False)
    blocks = [a.malloc(12 * MIB) for _ in range(21)]
    for block in blocks[:20]:
        a.free(block)
    sizes = (12 * MIB,) * PARTS
    assert a.cached_fit(sizes) == sum(sizes)
    entries = len(a._fits)
    a.free(blocks[20])
    assert len(a._free[(0, False)]) == 21
    assert a.cached_fit(sizes) == a._cached_fit(sizes, 0) == sum(sizes)
    assert len(a._fits) == entries


def test_cached_fit_keeps_a_bounded_number_of_rounded_requests() -> None:
    # many distinct request shapes: the rounded requests kept stay within their bound,
    # and each answer is still the one worked out afresh
    a = CachingAllocator(expandable_segments=False)
    a.free(a.malloc(64 * MIB))
    for kib in range(1, MAX_REQUEST_SHAPES + 50):
        sizes = (2 * MIB + kib * 1024, 2 * MIB)  # large-pool requests, 512 B multiples
        assert a.cached_fit(sizes) == sum(sizes)  # both cut from the cached 64 MiB block
        assert len(a._parts) <= MAX_REQUEST_SHAPES


def test_a_recording_equal_to_the_last_takes_its_digest(monkeypatch: pytest.MonkeyPatch) -> None:
    """``_digest_kept``: a rank's ledger that records the rows the last one of the same counts
    recorded (its patterns other objects of the same content, its blocks of events other
    arrays of the same values) takes that digest without hashing; one event moved by the
    least float step, in the list or in a block, is hashed, and digests apart."""
    from collsim.step import allocator
    from collsim.step.memory import MemoryLedger, MemoryPattern
    from collsim.step.replay_events import recording_digest
    from collsim.step.shapes import ShapeCache

    def ledger(late_s: float, block_s: float = 5.0) -> MemoryLedger:
        fwd = MemoryPattern("activations", [(0.0, 4.0, "act", 0), (1.0, -4.0, "act", 0)])
        out = MemoryLedger(3)
        out.alloc(0.0, "parameters", 8.0, "parameters")
        out.place(0.5, fwd, 0, 0)
        out.place(2.5, fwd, 1, 0)
        out.alloc(late_s, "buffers", 1.0, "pp recv")
        cats = np.full(2, 4, dtype=np.int8)  # (buffers)
        times, deltas = np.array([block_s, 6.0]), np.array([2.0, -2.0])
        out.add_block(times, deltas, cats, ("pp recv",), np.zeros(2, np.intp))
        return out

    hashed: list[MemoryLedger] = []

    def counted(x: MemoryLedger) -> bytes | None:
        hashed.append(x)
        return recording_digest(x)

    monkeypatch.setattr(allocator, "recording_digest", counted)
    memo = ShapeCache()
    first = allocator._digest_kept(3, ledger(4.0), memo)
    again = allocator._digest_kept(3, ledger(4.0), memo)
    assert first is not None and again == first and len(hashed) == 1
    moved = ledger(float(np.nextafter(4.0, 5.0)))
    other = allocator._digest_kept(3, moved, memo)
    assert len(hashed) == 2 and other == recording_digest(moved) and other != first
    late = ledger(4.0, float(np.nextafter(5.0, 6.0)))  # the same but for a block's event
    apart = allocator._digest_kept(3, late, memo)
    assert len(hashed) == 3 and apart == recording_digest(late) and apart not in (first, other)
