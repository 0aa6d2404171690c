"""Streams (rendezvous, FIFO, ready times), contention detection, CPU offload."""

from __future__ import annotations

import pytest
import simpy

from collsim.core.errors import SimulationError
from collsim.parallel.config import FSDPConfig, ParallelConfig, TrainingConfig
from collsim.play.engine import simulate_step
from collsim.play.engine.comm import axis_contends
from collsim.play.engine.streams import GroupStream

from .conftest import topology


def test_group_stream_rendezvous_and_fifo() -> None:
    env = simpy.Environment()
    log: list[tuple[str, float, float]] = []
    stream = GroupStream(
        env,
        (0, 1),
        "dp",
        on_done=lambda members, rec: log.append((rec.name, rec.start_s, rec.end_s)),
    )

    def member(rank: int, arrive: float) -> object:
        yield env.timeout(arrive)
        first = stream.submit(rank, "a", 2.0)  # ready now
        second = stream.submit(rank, "b", 1.0, ready_s=env.now + 5.0)
        yield first & second

    env.process(member(0, 1.0))
    env.process(member(1, 3.0))
    env.run()
    # "a" starts when the last member arrives (3); "b" when ready (max 3 + 5 = 8)
    assert log == [("a", 3.0, 5.0), ("b", 8.0, 9.0)]


def test_group_stream_process_work_runs_in_order() -> None:
    env = simpy.Environment()
    stream = GroupStream(env, (7,), "pp")
    ends = []

    def job(d: float):
        return lambda: env.timeout(d)

    for d in (3.0, 1.0):
        stream.submit(7, f"t{d}", job(d)).callbacks.append(lambda ev: ends.append(env.now))
    env.run()
    assert ends == [3.0, 4.0]


def test_contention_detection_from_topology() -> None:
    rail = topology("dgx_a100", 2)
    shared = topology("pcie_8gpu", 2)
    # the data-parallel groups of two tp ranks, each spanning the two nodes
    groups = [(0, 8), (1, 9)]
    assert not axis_contends(rail, groups)  # one NIC per GPU: rails
    assert axis_contends(shared, groups)  # one NIC per node, shared
    assert not axis_contends(shared, [(0, 8)])  # alone on the NIC


def test_fsdp_offload_moves_states_to_host(small_spec) -> None:
    topo = topology("dgx_a100", 2)
    tr = TrainingConfig(global_batch=16, micro_batch=1)
    gpu = simulate_step(topo, small_spec, tr, ParallelConfig(dp=16, zero=3))
    host = simulate_step(
        topo, small_spec, tr, ParallelConfig(dp=16, zero=3, fsdp=FSDPConfig(offload=True))
    )
    assert host.memory_peak_bytes < gpu.memory_peak_bytes
    assert host.memory_bytes["optimizer"] == 0 and host.memory_bytes["gradients"] == 0
    # PCIe copies before gathers and after reduce-scatters, and the CPU optimizer cost time
    assert host.step_time_s > gpu.step_time_s
    assert host.breakdown_s["optimizer"] > gpu.breakdown_s["optimizer"]


def test_group_stream_process_work_waits_for_a_closed_form_call_before_it() -> None:
    """FIFO holds when a stream turns from closed-form durations to process work: the process
    starts only once the closed-form call issued before it has ended."""
    env = simpy.Environment()
    log: list[tuple[str, float, float]] = []
    stream = GroupStream(
        env, (0,), "dp", on_done=lambda members, rec: log.append((rec.name, rec.start_s, rec.end_s))
    )
    stream.submit(0, "closed", 2.0)
    stream.submit(0, "process", lambda: env.timeout(1.0))
    env.run()
    assert log == [("closed", 0.0, 2.0), ("process", 2.0, 3.0)]


def test_reserve_from_keeps_the_stream_fifo_with_submitted_calls() -> None:
    """A reserved call starts when it is ready and the stream is free, as a submitted one:
    reserved and submitted calls share one queue."""
    env = simpy.Environment()
    log: list[tuple[str, float, float]] = []
    stream = GroupStream(
        env, (0,), "dp", on_done=lambda members, rec: log.append((rec.name, rec.start_s, rec.end_s))
    )
    assert stream.reserve_from(1.0, 2.0) == (1.0, 3.0)  # ready later than free: waits to 1
    assert stream.reserve_from(0.0, 0.5) == (3.0, 3.5)  # ready at once: waits for the stream
    stream.submit(0, "after", 1.0, ready_s=0.0)
    assert log == [("after", 3.5, 4.5)]
    two = GroupStream(env, (0, 1), "dp")
    with pytest.raises(SimulationError, match="one-member"):
        two.reserve_from(0.0, 1.0)


@pytest.mark.parametrize(
    "parallel",
    [
        ParallelConfig(tp=2, pp=2, dp=4, zero=1),  # buckets + gathers
        ParallelConfig(dp=16, zero=0),  # DDP all-reduce buckets
    ],
    ids=["zero1-3d", "ddp"],
)
def test_reserved_data_parallel_calls_equal_issued_ones(small_spec, parallel) -> None:
    """Gradient buckets and the parameter all-gathers are reserved on the dp stream unless a
    trace needs their records: the step, its breakdown and every collective's statistics are
    the same either way."""
    topo = topology("dgx_a100", 2)
    tr = TrainingConfig(global_batch=16, micro_batch=1)
    reserved = simulate_step(topo, small_spec, tr, parallel)
    issued = simulate_step(topo, small_spec, tr, parallel, trace=True)
    assert reserved.step_time_s == issued.step_time_s
    assert reserved.breakdown_s == issued.breakdown_s
    # the same calls, counts and sizes; times to rounding (an untraced pipeline send's time
    # is a tally's sum, a traced one's the sum of its records)
    assert [(c.axis, c.op, c.size_bytes, c.count, c.algorithm) for c in reserved.collectives] == [
        (c.axis, c.op, c.size_bytes, c.count, c.algorithm) for c in issued.collectives
    ]
    for a, b in zip(reserved.collectives, issued.collectives, strict=True):
        assert a.time_s == pytest.approx(b.time_s, rel=1e-12)
    assert any(c.axis == "dp" for c in reserved.collectives)
