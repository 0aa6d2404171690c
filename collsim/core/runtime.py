"""How collsim runs inside the interpreter: the cyclic garbage collector paused over a step,
and its full passes made rarer over a search and over a batch of evaluations.

A simulated step allocates tens of thousands of small objects (events, calls, memory records)
that all stay alive until the step's result is assembled. CPython's cyclic collector runs a
young-generation pass every 700 net allocations and, every hundred of those, a full pass over
every live object (the loaded topology, the modules, the previous results): during a step those
passes find nothing to free and cost a fifth to a third of the engine's time (3d_175b, the
engine benchmark's loop of ``benchmarks/bench_step_schedule.py``; the timings are in
docs/derivations.md, measurements). Reference counting still frees
everything acyclic as it goes; cycles made during the step are collected once the collector is
back on. Over many evaluations (a search, a sweep) the young passes between steps are cheap, but
every tenth middle pass becomes a full pass over the caches the evaluations share (tens of
milliseconds each): :func:`collector_relaxed` makes those rarer over a search (its bounds and
estimates, :func:`collsim.study.search.loop.search_plans`) and over each batch a worker runs,
and inside it each step's survivors are frozen once a young pass has collected the step's
cycles: the caches a search fills (tens of thousands of named tuples, which the collector
never untracks) are no longer scanned by every middle pass (3d_175b's search: a middle pass
every ten plans, 6-8 ms each).
"""

from __future__ import annotations

import gc
from collections.abc import Iterator
from contextlib import contextmanager

__all__ = ["FULL_PASS_SCALE", "collector_paused", "collector_relaxed"]

FULL_PASS_SCALE = 10
"""How many times rarer :func:`collector_relaxed` makes the collector's full passes (its third
threshold, 10 middle passes by default, times this; the searches it was measured on are in
docs/derivations.md, measurements). The young and middle passes are left as they were, and
full passes still come, so memory stays bounded."""

_relaxed = 0
"""How many :func:`collector_relaxed` blocks are open (only the outermost sets the threshold)."""

_freezing = False
"""Whether a paused block freezes what it leaves (inside a relaxed block whose caller had
frozen nothing)."""


@contextmanager
def collector_paused() -> Iterator[None]:
    """Pause the cyclic garbage collector inside the block; restore its state after (nested
    blocks and callers that keep it off are left as they were). Inside a relaxed block
    (:func:`collector_relaxed`), the outermost paused block ends with a young pass (the
    cycles it made are collected) and freezes what is left (``gc.freeze``), so that later
    passes do not scan again what each step added to the caches."""
    was_on = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was_on and _freezing:
            gc.collect(0)
            gc.freeze()
        if was_on:
            gc.enable()


@contextmanager
def collector_relaxed(scale: int = FULL_PASS_SCALE) -> Iterator[None]:
    """Full collections ``scale`` times rarer inside the block (:data:`FULL_PASS_SCALE`); the
    thresholds restored after (nested blocks leave them to the outermost). Where the caller
    had frozen nothing, the paused steps inside freeze what they leave
    (:func:`collector_paused`) and the outermost block unfreezes it all at its end (into the
    oldest generation, which the next full pass scans)."""
    global _relaxed, _freezing
    young, middle, full = gc.get_threshold()
    if _relaxed == 0:
        gc.set_threshold(young, middle, full * scale)
        _freezing = gc.get_freeze_count() == 0
    _relaxed += 1
    try:
        yield
    finally:
        _relaxed -= 1
        if _relaxed == 0:
            gc.set_threshold(young, middle, full)
            if _freezing:
                _freezing = False
                gc.unfreeze()
