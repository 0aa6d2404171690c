"""Tidy frames: one row per fact, unit-suffixed columns, values carried over exactly."""

from __future__ import annotations

import math

import pytest

from collsim.core.errors import ConfigError
from collsim.report.frames import (
    RESULT_COLUMNS,
    collectives_frame,
    event_phase,
    memory_timeline_frame,
    result_record,
    results_frame,
    trace_frame,
)
from collsim.step.result import TraceEvent


def test_result_record_flattens_every_field(result_factory) -> None:
    result = result_factory(step_time_s=0.5, num_gpus=64)
    row = result_record(result)
    assert tuple(row) == RESULT_COLUMNS
    assert row["step_time_s"] == 0.5 and row["num_gpus"] == 64
    assert row["compute_s"] == pytest.approx(0.35) and row["bubble_s"] == pytest.approx(0.05)
    assert row["mem_optimizer_bytes"] == result.memory_bytes["optimizer"]
    # 4 dp all-reduces of 25 MiB; 96 tp all-reduces of 16 MiB
    assert row["comm_bytes_dp"] == 4 * 25 * 2**20
    assert row["comm_bytes_tp"] == 96 * 2**24 and row["comm_bytes_pp"] == 0
    # the allocator's reserved bytes where it was replayed, NaN where it was not
    assert math.isnan(row["memory_reserved_bytes"])
    result.memory_reserved_bytes = 21.5 * 2**30
    assert result_record(result)["memory_reserved_bytes"] == 21.5 * 2**30


def test_results_frame_keeps_infeasible_rows(result_factory) -> None:
    frame = results_frame(
        [
            ({"plan": "a", "num_gpus": 8}, result_factory()),
            ({"plan": "b", "num_gpus": 16, "extra": 1}, None),
        ],
        reasons=[None, "gpus: 16 GPUs do not split"],
    )
    assert list(frame.columns[:5]) == ["plan", "num_gpus", "extra", "feasible", "reason"]
    assert list(frame["feasible"]) == [True, False]
    assert frame.loc[1, "reason"] == "gpus: 16 GPUs do not split"
    assert math.isnan(frame.loc[1, "step_time_s"]) and frame.loc[1, "num_gpus"] == 16
    with pytest.raises(ValueError, match="reasons has 1 entries for 2 rows"):
        results_frame([({}, None), ({}, None)], reasons=[None])


def test_collectives_trace_and_timeline_frames(pipeline, result_factory) -> None:
    result = result_factory(
        events=pipeline("1f1b", stages=2, microbatches=2),
        memory_timeline={3: [(0.0, 1e9), (0.5, 2e9)]},
    )
    coll = collectives_frame(result)
    assert list(coll["axis"]) == ["dp", "tp"]
    assert list(coll["total_bytes"]) == [4 * 25 * 2**20, 96 * 2**24]
    trace = trace_frame(result)
    assert len(trace) == len(result.trace_events)
    assert (trace["duration_s"] == trace["end_s"] - trace["start_s"]).all()
    assert set(trace.loc[trace["stream"] == "compute", "phase"]) == {"forward", "backward"}
    assert set(trace.loc[trace["stream"] == "pp", "phase"]) == {"comm"}
    timeline = memory_timeline_frame(result, 3)
    assert timeline.values.tolist() == [[3, 0.0, 1e9], [3, 0.5, 2e9]]
    with pytest.raises(ConfigError, match="rank 0 has no memory timeline"):
        memory_timeline_frame(result, 0)


@pytest.mark.parametrize(
    "stream, name, args, want",
    [
        ("compute", "F mb0 c0", {}, "forward"),  # the engine's names
        ("compute", "B mb3 c1", {}, "backward"),
        ("compute", "fwd mb3 L12", {}, "forward"),
        ("compute", "recompute mb1", {}, "recompute"),
        ("compute", "optimizer", {}, "optimizer"),
        ("compute", "embedding", {}, "other"),
        ("dp", "all_reduce bucket 4", {}, "comm"),
        ("compute", "F mb0", {"phase": "backward"}, "backward"),  # args win
    ],
    ids=["F", "B", "fwd", "recompute", "optimizer", "other", "comm", "args"],
)
def test_event_phase(stream: str, name: str, args: dict, want: str) -> None:
    assert event_phase(stream, name, args) == want
    TraceEvent(rank=0, stream=stream, name=name, start_s=0.0, end_s=1.0, args=args)
