"""The cyclic collector is paused over a step, its full passes made rarer over a batch of
evaluations, and given back as the caller had it."""

from __future__ import annotations

import gc

from collsim.core.jobs import Workers
from collsim.core.runtime import FULL_PASS_SCALE, collector_paused, collector_relaxed


def test_the_collector_is_paused_inside_and_restored_after() -> None:
    assert gc.isenabled()
    with collector_paused():
        assert not gc.isenabled()
        with collector_paused():  # nested: still off, and the outer block turns it back on
            assert not gc.isenabled()
        assert not gc.isenabled()
    assert gc.isenabled()


def test_a_caller_that_keeps_it_off_finds_it_off() -> None:
    gc.disable()
    try:
        with collector_paused():
            assert not gc.isenabled()
        assert not gc.isenabled()
    finally:
        gc.enable()


def test_an_error_inside_gives_it_back() -> None:
    try:
        with collector_paused():
            raise ValueError("inside")
    except ValueError:
        pass
    assert gc.isenabled()


def test_full_passes_are_rarer_inside_a_relaxed_block_only() -> None:
    before = gc.get_threshold()
    young, middle, full = before
    with collector_relaxed():
        assert gc.get_threshold() == (young, middle, full * FULL_PASS_SCALE)
        with collector_relaxed():  # nested: the outer block's setting, not scaled twice
            assert gc.get_threshold() == (young, middle, full * FULL_PASS_SCALE)
        assert gc.get_threshold() == (young, middle, full * FULL_PASS_SCALE)
    assert gc.get_threshold() == before
    try:
        with collector_relaxed():
            raise ValueError("inside")
    except ValueError:
        pass
    assert gc.get_threshold() == before


def _threshold(_context: object, _item: int) -> tuple[int, int, int]:
    return gc.get_threshold()


def _nothing() -> None:
    return None


def test_inline_evaluations_run_relaxed() -> None:
    young, middle, full = gc.get_threshold()
    relaxed = (young, middle, full * FULL_PASS_SCALE)
    with Workers(1, _nothing) as workers:
        assert workers.map(_threshold, [1, 2]) == [relaxed, relaxed]
        assert list(workers.imap(_threshold, [1])) == [relaxed]
        fed = iter([("a", [1, 2])])
        assert list(workers.stream(_threshold, lambda n: next(fed, None))) == [
            ("a", [relaxed, relaxed])
        ]
    assert gc.get_threshold() == (young, middle, full)


def test_pool_evaluations_run_relaxed() -> None:
    young, middle, full = gc.get_threshold()
    relaxed = (young, middle, full * FULL_PASS_SCALE)
    with Workers(2, _nothing, timeout_s=120) as workers:
        assert workers.map(_threshold, [1, 2]) == [relaxed, relaxed]
        fed = iter([("a", [1, 2, 3])])
        out = list(workers.stream(_threshold, lambda n: next(fed, None)))
    assert out == [("a", [relaxed] * 3)]


class _Node:
    def __init__(self) -> None:
        self.other: object = self  # a cycle: only the collector frees it


def test_a_relaxed_block_freezes_what_each_step_leaves_and_frees_its_cycles() -> None:
    """Inside a relaxed block a paused step ends with its cycles collected and its survivors
    frozen; the block's end unfreezes them; a caller's own frozen objects are left alone."""
    import weakref

    gc.unfreeze()  # (a command run in this process before may have frozen its objects)
    assert gc.get_freeze_count() == 0
    with collector_relaxed():
        with collector_paused():
            garbage = weakref.ref(_Node())  # unreachable once made: a cycle
            kept = [_Node() for _ in range(10)]
            with collector_paused():  # nested: the outer block freezes, once
                pass
            assert gc.get_freeze_count() == 0
        assert garbage() is None  # collected, not frozen
        assert gc.get_freeze_count() >= len(kept)
    assert gc.get_freeze_count() == 0
    gc.freeze()  # the caller's own regime
    try:
        frozen = gc.get_freeze_count()
        with collector_relaxed(), collector_paused():
            kept.append(_Node())
        assert gc.get_freeze_count() == frozen
    finally:
        gc.unfreeze()
