"""The cyclic collector is paused over a step and given back as the caller had it."""

from __future__ import annotations

import gc

from collsim.core.runtime import collector_paused


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
