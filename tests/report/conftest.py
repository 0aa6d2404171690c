"""Synthetic StepResults for report tests: built by hand, no engine needed."""

from __future__ import annotations

from collections.abc import Callable

import pytest

from collsim.step.result import CollectiveStat, StepResult, TraceEvent


def pipeline_events(
    schedule: str,
    *,
    stages: int,
    microbatches: int,
    fwd_s: float = 1e-3,
    bwd_s: float = 2e-3,
    p2p_s: float = 1e-4,
) -> list[TraceEvent]:
    """Compute and pp-stream events of a GPipe or 1F1B pipeline, list-scheduled by dependency:
    forward k on stage s waits for forward k on s-1 (+ p2p), backward k on s waits for
    backward k on s+1 (+ p2p) and forward k on s. One rank per stage (rank = stage)."""
    order: list[list[tuple[str, int]]] = []
    for s in range(stages):
        if schedule == "gpipe":
            ops = [("F", k) for k in range(microbatches)] + [("B", k) for k in range(microbatches)]
        else:  # 1f1b: warm-up forwards, then alternate, then drain backwards
            warm = min(stages - s - 1, microbatches)
            ops = [("F", k) for k in range(warm)]
            f, b = warm, 0
            while b < microbatches:
                if f < microbatches:
                    ops.append(("F", f))
                    f += 1
                ops.append(("B", b))
                b += 1
        order.append(ops)
    done: dict[tuple[str, int, int], float] = {}
    free = [0.0] * stages
    pos = [0] * stages
    events: list[TraceEvent] = []
    while any(pos[s] < len(order[s]) for s in range(stages)):
        progressed = False
        for s in range(stages):
            if pos[s] >= len(order[s]):
                continue
            phase, k = order[s][pos[s]]
            if phase == "F":
                dep = done.get(("F", s - 1, k), None) if s > 0 else 0.0
                dep = None if dep is None else dep + (p2p_s if s > 0 else 0.0)
            else:
                up = done.get(("B", s + 1, k)) if s < stages - 1 else 0.0
                mine = done.get(("F", s, k))
                dep = (
                    None
                    if up is None or mine is None
                    else max(up + (p2p_s if s < stages - 1 else 0.0), mine)
                )
            if dep is None:
                continue
            start = max(free[s], dep)
            end = start + (fwd_s if phase == "F" else bwd_s)
            name = f"{'fwd' if phase == 'F' else 'bwd'} mb{k}"
            events.append(
                TraceEvent(
                    rank=s,
                    stream="compute",
                    name=name,
                    start_s=start,
                    end_s=end,
                    args={"stage": s, "microbatch": k},
                )
            )
            if (phase == "F" and s < stages - 1) or (phase == "B" and s > 0):
                events.append(
                    TraceEvent(
                        rank=s,
                        stream="pp",
                        name=f"send mb{k}",
                        start_s=end,
                        end_s=end + p2p_s,
                        args={"bytes": 1 << 20, "algorithm": "direct"},
                    )
                )
            done[(phase, s, k)] = end
            free[s] = end
            pos[s] += 1
            progressed = True
        assert progressed, "synthetic pipeline deadlocked"
    return events


def make_result(
    *,
    events: list[TraceEvent] | None = None,
    step_time_s: float | None = None,
    num_gpus: int = 8,
    memory_timeline: dict[int, list[tuple[float, float]]] | None = None,
    zero: int = 0,
    tokens_per_s: float = 1e5,
    capacity_bytes: float = 80e9,
) -> StepResult:
    events = events or []
    end = max((e.end_s for e in events), default=0.01)
    step = step_time_s if step_time_s is not None else end
    params = 16e9 / (num_gpus if zero == 3 else 1)
    memory = {
        "parameters": 2e9 / (num_gpus if zero == 3 else 1),
        "gradients": 2e9 / (num_gpus if zero >= 2 else 1),
        "optimizer": 12e9 / (num_gpus if zero >= 1 else 1),
        "activations": 5e9,
        "buffers": 0.5e9,
    }
    peak = sum(memory.values())
    del params
    return StepResult(
        step_time_s=step,
        tokens_per_s=tokens_per_s,
        model_tflops_per_gpu=150.0,
        hardware_tflops_per_gpu=190.0,
        mfu=0.48,
        hfu=0.61,
        breakdown_s={
            "compute": 0.7 * step,
            "tp_exposed": 0.05 * step,
            "pp_exposed": 0.02 * step,
            "dp_exposed": 0.08 * step,
            "ep_exposed": 0.0,
            "cp_exposed": 0.0,
            "bubble": 0.1 * step,
            "framework": 0.0,
            "interference": 0.0,
            "optimizer": 0.05 * step,
        },
        memory_peak_bytes=peak,
        memory_bytes=memory,
        memory_capacity_bytes=capacity_bytes,
        fits=peak <= capacity_bytes,
        num_gpus=num_gpus,
        collectives=[
            CollectiveStat(
                axis="dp",
                op="all_reduce",
                group_size=num_gpus,
                algorithm="ring",
                count=4,
                size_bytes=25 * 2**20,
                time_s=0.004,
                busbw_bps=180e9,
            ),
            CollectiveStat(
                axis="tp",
                op="all_reduce",
                group_size=8,
                algorithm="nvls",
                count=96,
                size_bytes=2**24,
                time_s=0.01,
                busbw_bps=300e9,
            ),
        ],
        memory_timeline=memory_timeline
        if memory_timeline is not None
        else {0: [(0.0, 20e9), (0.2 * step, 24e9), (0.5 * step, 26e9), (0.8 * step, 21e9)]},
        trace_events=events,
    )


@pytest.fixture
def pipeline() -> Callable[..., list[TraceEvent]]:
    return pipeline_events


@pytest.fixture
def result_factory() -> Callable[..., StepResult]:
    return make_result
