"""A simulated step leaves almost no cyclic garbage (``Engine.release``): its objects are freed
by reference counting, not by a collection over all of them."""

from __future__ import annotations

import gc

from collsim.parallel.config import ParallelConfig, TrainingConfig
from collsim.play.engine import simulate_step

from .conftest import topology

STEP_MODULES = ("simpy", "collsim")
"""Where the step's own objects come from: its events, processes, ledgers and blocks."""


def _unreachable_of_the_step(topo, spec, training, parallel) -> int:
    """The unreachable objects of the step's own types after one step, the collector off
    during it. Objects of other packages are not counted: a thread or event loop an earlier
    test left (a Dask cluster's) may drop its last reference while the step runs."""
    gc.collect()
    was_on = gc.isenabled()
    gc.disable()
    gc.set_debug(gc.DEBUG_SAVEALL)  # the unreachable objects kept in gc.garbage, to be read
    try:
        result = simulate_step(topo, spec, training, parallel)
        assert result.step_time_s > 0
        del result
        gc.collect()
        own = sum(type(o).__module__.split(".")[0] in STEP_MODULES for o in gc.garbage)
    finally:
        gc.set_debug(0)
        gc.garbage.clear()
        if was_on:
            gc.enable()
    return own


def test_a_step_leaves_only_simpys_own_cycles(small_spec) -> None:
    topo = topology("dgx_a100", 2)
    training = TrainingConfig(global_batch=32, micro_batch=1)
    parallel = ParallelConfig(tp=2, pp=4, dp=2)
    simulate_step(topo, small_spec, training, parallel)  # warm the topology's caches
    own = _unreachable_of_the_step(topo, small_spec, training, parallel)
    # the environment with its bound helpers, the processes and their condition: a few dozen
    # objects whatever the step's length (without the release: every op, mail and event)
    assert own < 40
