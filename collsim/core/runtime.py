"""How collsim runs inside the interpreter: the cyclic garbage collector paused over a step.

A simulated step allocates tens of thousands of small objects (events, calls, memory records)
that all stay alive until the step's result is assembled. CPython's cyclic collector runs a
young-generation pass every 700 net allocations and, every hundred of those, a full pass over
every live object (the loaded topology, the modules, the previous results): during a step those
passes find nothing to free and cost a fifth to a third of the engine's time (3d_175b, the
engine benchmark's loop of ``benchmarks/bench_step_schedule.py``; the timings are in
docs/derivations.md, measurements). Reference counting still frees
everything acyclic as it goes; cycles made during the step are collected once the collector is
back on.
"""

from __future__ import annotations

import gc
from collections.abc import Iterator
from contextlib import contextmanager

__all__ = ["collector_paused"]


@contextmanager
def collector_paused() -> Iterator[None]:
    """Pause the cyclic garbage collector inside the block; restore its state after (nested
    blocks and callers that keep it off are left as they were)."""
    was_on = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was_on:
            gc.enable()
