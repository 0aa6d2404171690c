"""A traced step beside a scenario's simulated step, per op kind: the traced exclusive times
(:mod:`collsim.validate.measure.traces.breakdown`) against the simulated step's breakdown, whose
``compute`` is split over the kinds in the proportions of the compute model's own op times (one
micro-batch of every layer, the embedding and the head, forward and backward). Rows: the compute
kinds; ``optimizer``; ``copy + framework`` (the simulated ``framework`` and ``interference``);
exposed communication (traced: communication running with nothing else on the device; simulated:
every ``*_exposed``); ``idle / bubble`` (traced idle; simulated pipeline bubble). Largest
differences first. :func:`write_side_by_side` sets the traced step of the first rank and the
simulated step on neighbouring tracks of one Perfetto file."""

from __future__ import annotations

import gzip
import json
from collections import defaultdict
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from collsim.report.trace import to_chrome_trace
from collsim.study.job import run_job
from collsim.validate.data.kineto import GPU_CATS, Trace
from collsim.validate.measure.traces.breakdown import IDLE, Summary
from collsim.validate.measure.traces.classify import classify
from collsim.workload.compute import ComputeModel

__all__ = ["Comparison", "compare_steps", "format_comparison", "write_side_by_side", "op_kind"]

MODEL_KINDS = {
    "attn_norm": "norm",
    "mlp_norm": "norm",
    "final_norm": "norm",
    "q_norm": "norm",
    "kv_norm": "norm",
    "flash_attention": "attention",
    "attn_scores": "attention",
    "softmax": "attention",
    "attn_dropout": "attention",
    "attn_values": "attention",
    "embedding": "embedding",
    "loss": "loss",
}
"""The compute model's ops that are not GEMMs or element-wise ops, by kind."""

ROWS = (
    "gemm",
    "attention",
    "norm",
    "elementwise",
    "embedding",
    "loss",
    "optimizer",
    "copy + framework",
    "exposed communication",
    "idle / bubble",
)


def op_kind(name: str, matmul: bool) -> str:
    """The trace kind of one of the compute model's ops."""
    if name in MODEL_KINDS:
        return MODEL_KINDS[name]
    return "gemm" if matmul else "elementwise"


@dataclass
class Comparison:
    """Per row (kind): traced and simulated seconds per step."""

    traced_s: dict[str, float]
    simulated_s: dict[str, float]
    traced_step_s: float
    simulated_step_s: float
    per_step: list[tuple[str, str, float]] = field(default_factory=list)
    """(rank, step, traced seconds) of every traced step."""
    result: Any = None
    """The simulated StepResult (with its trace events)."""
    scenario: str = ""


def _traced_rows(summary: Summary) -> dict[str, float]:
    excl = summary.mean("exclusive_s")
    rows: dict[str, float] = defaultdict(float)
    for kind, value in excl.items():
        if kind in ("gemm", "attention", "norm", "elementwise", "embedding", "loss", "optimizer"):
            rows[kind] += value
        elif kind in ("convolution", "unclassified"):
            rows["elementwise" if kind == "unclassified" else "gemm"] += value
        elif kind in ("copy", "framework"):
            rows["copy + framework"] += value
        elif kind == "communication":
            rows["exposed communication"] += value
        elif kind == IDLE:
            rows["idle / bubble"] += value
    return dict(rows)


def _model_split(scenario: Any, topology: Any) -> dict[str, float]:
    """Shares of the compute kinds in the compute model's op times for one micro-batch."""

    training, parallel, spec = scenario.training, scenario.parallel, scenario.model
    model = ComputeModel(
        topology.device,
        training.dtype,
        attention_kernel=getattr(training, "attention_kernel", None),
        execution=getattr(training, "execution", "eager"),
    )
    tp = int(getattr(parallel, "tp", 1))
    sp = bool(getattr(parallel, "sequence_parallel", False))
    layers = model.layer_times(spec, micro_batch=training.micro_batch, tp=tp, sequence_parallel=sp)
    emb = model.embedding_times(spec, micro_batch=training.micro_batch, tp=tp, sequence_parallel=sp)
    head = model.head_times(spec, micro_batch=training.micro_batch, tp=tp, sequence_parallel=sp)
    split: dict[str, float] = defaultdict(float)
    for times, repeat in ((layers, spec.num_layers), (emb, 1), (head, 1)):
        for cost in times.ops:
            matmul = str(getattr(cost.kind, "value", cost.kind)) == "matmul"
            split[op_kind(cost.name, matmul)] += cost.time_s * repeat
    total = sum(split.values()) or 1.0
    return {k: v / total for k, v in split.items()}


def compare_steps(summary: Summary, scenario: Any) -> Comparison:
    """Simulate ``scenario`` (a loaded :class:`collsim.study.scenario.Scenario`) and set it beside
    the traced steps of ``summary``."""

    sim = run_job(scenario, trace=True)
    breakdown = dict(sim.result.breakdown_s)
    shares = _model_split(scenario, sim.topology)
    compute = float(breakdown.get("compute", 0.0))
    simulated: dict[str, float] = {k: compute * v for k, v in shares.items()}
    simulated["optimizer"] = float(breakdown.get("optimizer", 0.0))
    simulated["copy + framework"] = float(breakdown.get("framework", 0.0)) + float(
        breakdown.get("interference", 0.0)
    )
    simulated["exposed communication"] = sum(
        float(v) for k, v in breakdown.items() if k.endswith("_exposed")
    )
    simulated["idle / bubble"] = float(breakdown.get("bubble", 0.0))
    return Comparison(
        _traced_rows(summary),
        simulated,
        summary.step_s,
        float(sim.result.step_time_s),
        [(b.rank, b.step, b.step_s) for b in summary.steps],
        sim.result,
        str(getattr(scenario, "name", "") or ""),
    )


def format_comparison(c: Comparison) -> str:
    lines = ["# traced against simulated, per step (ms)"]
    for rank, step, step_s in c.per_step:
        diff = (c.simulated_step_s - step_s) / step_s
        lines.append(
            f"  {rank:<10} {step:<18} traced {step_s * 1e3:10.3f}  simulated "
            f"{c.simulated_step_s * 1e3:10.3f}  {diff:+.1%}"
        )
    lines.append(
        "# per op kind, mean traced step against the simulated step, largest difference first"
    )
    lines.append(f"{'kind':<22} {'traced ms':>11} {'simulated ms':>13} {'diff ms':>10} {'diff':>8}")
    keys = [k for k in ROWS if k in c.traced_s or k in c.simulated_s]
    keys.sort(key=lambda k: -abs(c.simulated_s.get(k, 0.0) - c.traced_s.get(k, 0.0)))
    for k in keys:
        t, s = c.traced_s.get(k, 0.0), c.simulated_s.get(k, 0.0)
        rel = f"{(s - t) / t:+.1%}" if t > 0 else "n/a"
        lines.append(f"{k:<22} {t * 1e3:>11.3f} {s * 1e3:>13.3f} {(s - t) * 1e3:>+10.3f} {rel:>8}")
    diff = (c.simulated_step_s - c.traced_step_s) / c.traced_step_s
    lines.append(
        f"{'step':<22} {c.traced_step_s * 1e3:>11.3f} {c.simulated_step_s * 1e3:>13.3f} "
        f"{(c.simulated_step_s - c.traced_step_s) * 1e3:>+10.3f} {diff:>+8.1%}"
    )
    return "\n".join(lines)


TRACED_PID = 1_000_000
"""Process id of the traced rank's tracks in the side-by-side file (the simulated ranks keep
theirs, 0...)."""


def _traced_events(trace: Trace, step_index: int = 0) -> list[dict[str, Any]]:
    """The device events (GPU trace) or the host thread's ops (CPU trace) of one traced step,
    moved to start at 0, on one track per stream or thread, named by their kind."""

    step = trace.steps()[min(step_index, len(trace.steps()) - 1)]
    if trace.on_gpu:
        chosen = [
            e for e in trace.events if e.cat in GPU_CATS and step.ts_us <= e.ts_us < step.end_us
        ]
        t0 = min((e.ts_us for e in chosen), default=step.ts_us)
    else:
        chosen = [
            e
            for e in trace.events
            if e.cat in ("cpu_op", "user_annotation")
            and step.ts_us <= e.ts_us < step.end_us
            and e.tid == step.tid
        ]
        chosen.append(step)
        t0 = step.ts_us
    tids: dict[Any, int] = {}
    out: list[dict[str, Any]] = [
        {
            "ph": "M",
            "name": "process_name",
            "pid": TRACED_PID,
            "args": {"name": f"traced {trace.label}"},
        },
        {"ph": "M", "name": "process_sort_index", "pid": TRACED_PID, "args": {"sort_index": -1}},
    ]
    for e in chosen:
        track = e.args.get("stream", e.tid)
        tid = tids.setdefault(track, len(tids) + 1)
        out.append(
            {
                "ph": "X",
                "name": e.name[:120],
                "cat": classify(e.name, e.cat),
                "pid": TRACED_PID,
                "tid": tid,
                "ts": e.ts_us - t0,
                "dur": e.dur_us,
                "args": {"kind": classify(e.name, e.cat)},
            }
        )
    for track, tid in tids.items():
        label = f"stream {track}" if trace.on_gpu else f"thread {track}"
        out.append(
            {
                "ph": "M",
                "name": "thread_name",
                "pid": TRACED_PID,
                "tid": tid,
                "args": {"name": label},
            }
        )
    return out


def write_side_by_side(path: str | Path, traces: list[Trace], c: Comparison) -> Path:
    """One Perfetto (Chrome JSON) file: the simulated step's tracks and, beside them, the
    first traced step of the first rank, both starting at 0; gzip when the name ends in .gz."""

    doc = to_chrome_trace(c.result, name=c.scenario or None)
    doc["traceEvents"] = _traced_events(traces[0]) + list(doc["traceEvents"])
    out = Path(path)
    text = json.dumps(doc)
    if out.name.endswith(".gz"):
        with gzip.open(out, "wt") as f:
            f.write(text)
    else:
        out.write_text(text)
    return out
