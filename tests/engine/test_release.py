"""A simulated step leaves almost no cyclic garbage (``Engine.release``): its objects are freed
by reference counting, not by a collection over all of them."""

from __future__ import annotations

import gc

from collsim.parallel.config import ParallelConfig, TrainingConfig
from collsim.play.engine import simulate_step

from .conftest import topology


def test_a_step_leaves_only_simpys_own_cycles(small_spec) -> None:
    topo = topology("dgx_a100", 2)
    training = TrainingConfig(global_batch=32, micro_batch=1)
    parallel = ParallelConfig(tp=2, pp=4, dp=2)
    simulate_step(topo, small_spec, training, parallel)  # warm the topology's caches
    gc.collect()
    was_on = gc.isenabled()
    gc.disable()
    try:
        result = simulate_step(topo, small_spec, training, parallel)
        assert result.step_time_s > 0
        del result
        unreachable = gc.collect()
    finally:
        if was_on:
            gc.enable()
    # the environment with its bound helpers, the processes and their condition: a few dozen
    # objects whatever the step's length (without the release: every op, mail and event)
    assert unreachable < 100
