"""Break each traced step down by op kind: what ran, for how long, and where the step's time
went. Two views per step: the *busy* time of each kind (kernels summed, overlapping ones each
counted), and the *exclusive* time, which splits the step's wall-clock span so that the kinds
and the idle time add up to the step exactly. On a GPU trace each instant of the step goes to
the highest kind of :data:`PRIORITY` running on the device (compute, then copies, then
communication: communication counts only where nothing else hides it, i.e. it is exposed), or
to ``idle``; the step's span runs from its first kernel to the next step's first kernel (the
last step: to its last kernel's end), the kernels assigned to a step by the host time of their
launch (``correlation``). On a CPU-only trace the step is the ``ProfilerStep#N`` annotation on
the host thread and each instant goes to the innermost op running on that thread (self time;
ops inside ``Optimizer.step`` count as optimizer), or to ``idle`` (Python between ops, or
waiting). The method follows HolisticTraceAnalysis' temporal and kernel breakdowns
(``hta/analyzers/breakdown_analysis.py``), applied to collsim's op kinds."""

from __future__ import annotations

import bisect
import statistics
from collections import Counter, defaultdict
from dataclasses import dataclass, field
from typing import Any

from collsim.validate.data.kineto import GPU_CATS, STEP_PREFIX, Event, Trace
from collsim.validate.measure.traces.classify import KINDS, classify

__all__ = [
    "Comm",
    "StepBreakdown",
    "breakdown",
    "summarise",
    "PRIORITY",
    "DTYPE_BYTES",
]

PRIORITY = (
    "convolution",
    "gemm",
    "attention",
    "norm",
    "elementwise",
    "optimizer",
    "embedding",
    "loss",
    "unclassified",
    "framework",
    "copy",
    "communication",
)
"""Which kind an instant of a GPU step goes to when several run at once (first wins)."""

IDLE = "idle"

DTYPE_BYTES = {
    "float": 4,
    "float32": 4,
    "double": 8,
    "float64": 8,
    "half": 2,
    "float16": 2,
    "c10::half": 2,
    "bfloat16": 2,
    "c10::bfloat16": 2,
    "bf16": 2,
    "int": 4,
    "int32": 4,
    "long": 8,
    "long int": 8,
    "int64": 8,
    "unsigned char": 1,
    "uint8": 1,
    "byte": 1,
    "char": 1,
    "signed char": 1,
    "int8": 1,
    "bool": 1,
    "c10::float8_e4m3fn": 1,
    "float8_e4m3fn": 1,
    "float8_e5m2": 1,
}
"""Bytes per element of the dtype names Kineto writes (``Input type``; NCCL kernels' ``dtype``,
as c10's ScalarType names: ``Float``, ``BFloat16``...)."""


@dataclass(frozen=True, slots=True)
class Comm:
    """One collective of a step, with what the trace says of it."""

    collective: str
    size_bytes: int | None
    time_s: float
    group_size: int | None = None


@dataclass
class StepBreakdown:
    """One step of one rank."""

    rank: str
    step: str
    step_s: float
    """The step's span (see the module docstring)."""
    host_step_s: float
    """The ``ProfilerStep#N`` annotation's duration on the host."""
    exclusive_s: dict[str, float] = field(default_factory=dict)
    """Kinds and ``idle``: they add up to ``step_s``."""
    busy_s: dict[str, float] = field(default_factory=dict)
    count: dict[str, int] = field(default_factory=dict)
    comms: list[Comm] = field(default_factory=list)
    unclassified: dict[str, float] = field(default_factory=dict)
    """Seconds per name that no rule classified."""
    on_gpu: bool = False


def dtype_bytes(name: Any) -> int | None:
    """Bytes per element of a dtype name as Kineto writes it, None when unknown."""
    key = str(name).strip().lower().removeprefix("c10::")
    return DTYPE_BYTES.get(key) or DTYPE_BYTES.get(f"c10::{key}")


def _numel(dims: Any) -> int | None:
    if not isinstance(dims, list) or not dims:
        return None
    n = 1
    for d in dims:
        if not isinstance(d, int | float):
            return None
        n *= int(d)
    return n


def _comm_of(event: Event, dur_s: float) -> Comm | None:
    """A collective's name, size and group from an NCCL kernel's or ``record_param_comms``'
    args (``Collective name``, ``In msg nelems``, ``dtype``, ``Group size``), or from gloo's
    ``gloo:<op>`` annotation (``Input Dims`` and ``Input type`` of its tensor)."""
    args = event.args
    if "Collective name" in args:
        nelems = args.get("In msg nelems")
        width = dtype_bytes(args.get("dtype", ""))
        out = args.get("Out msg nelems")
        if isinstance(out, int | float) and isinstance(nelems, int | float):
            nelems = max(nelems, out)  # an all-gather's size is its output's (nccl-tests)
        size = int(nelems) * width if isinstance(nelems, int | float) and width else None
        group = args.get("Group size")
        return Comm(
            str(args["Collective name"]),
            size,
            dur_s,
            int(group) if isinstance(group, int | float) else None,
        )
    if event.name.startswith("gloo:"):
        dims = args.get("Input Dims") or []
        types = args.get("Input type") or []
        size = None
        if dims and types:
            numel, width = _numel(dims[0]), dtype_bytes(types[0])
            size = numel * width if numel is not None and width else None
        return Comm(event.name.removeprefix("gloo:"), size, dur_s)
    if event.cat == "kernel":
        return Comm(_nccl_name(event.name), None, dur_s)
    return None


def _nccl_name(name: str) -> str:
    """``ncclDevKernel_AllReduce_Sum_f32_RING_LL`` -> ``AllReduce``."""
    for prefix in ("ncclDevKernel_", "ncclKernel_", "rcclKernel_"):
        if name.startswith(prefix):
            return name.removeprefix(prefix).split("_")[0].split("(")[0]
    return name.split("(")[0]


def _kind(event: Event) -> str:
    return classify(event.name, event.cat)


def breakdown(trace: Trace) -> list[StepBreakdown]:
    """Every ``ProfilerStep#N`` of ``trace``, broken down (a GPU or a CPU-only trace)."""
    return _gpu_steps(trace) if trace.on_gpu else _cpu_steps(trace)


def _sweep(intervals: list[tuple[float, float, str]], lo: float, hi: float) -> dict[str, float]:
    """Exclusive seconds per kind over [lo, hi] (microsecond intervals), the highest kind of
    :data:`PRIORITY` winning where several overlap; what nothing covers is ``idle``."""
    rank = {k: i for i, k in enumerate(PRIORITY)}
    points: list[tuple[float, int, str]] = []
    for start, end, kind in intervals:
        s, e = max(start, lo), min(end, hi)
        if e > s:
            points.append((s, 1, kind))
            points.append((e, -1, kind))
    points.sort(key=lambda p: (p[0], p[1]))
    active: Counter[str] = Counter()
    out: dict[str, float] = defaultdict(float)
    at = lo
    for t, delta, kind in points:
        if t > at:
            live = [k for k, n in active.items() if n > 0]
            top = min(live, key=lambda k: rank.get(k, len(rank))) if live else IDLE
            out[top] += (t - at) * 1e-6
            at = t
        active[kind] += delta
    if hi > at:
        out[IDLE] += (hi - at) * 1e-6
    return dict(out)


def _gpu_steps(trace: Trace) -> list[StepBreakdown]:
    steps = trace.steps()
    launches = {
        e.args["correlation"]: e.ts_us
        for e in trace.events
        if e.cat in ("cuda_runtime", "cuda_driver") and "correlation" in e.args
    }
    device = sorted((e for e in trace.events if e.cat in GPU_CATS), key=lambda e: e.ts_us)
    owned: list[list[Event]] = [[] for _ in steps]
    step_starts = [s.ts_us for s in steps]
    for k in device:
        host_ts = launches.get(k.args.get("correlation"), k.ts_us)
        i = bisect.bisect_right(step_starts, host_ts) - 1
        if i >= 0 and host_ts <= steps[i].end_us:
            owned[i].append(k)
    host_comms = [e for e in trace.events if e.name == "record_param_comms" and e.args]
    dev_starts = [k.ts_us for k in device]
    longest = max((k.dur_us for k in device), default=0.0)
    out: list[StepBreakdown] = []
    for i, (step, kernels) in enumerate(zip(steps, owned)):
        if not kernels:
            continue
        lo = kernels[0].ts_us
        nxt = next((o[0].ts_us for o in owned[i + 1 :] if o), None)
        hi = nxt if nxt is not None else max(k.end_us for k in kernels)
        near = device[
            bisect.bisect_left(dev_starts, lo - longest) : bisect.bisect_left(dev_starts, hi)
        ]
        intervals = [(k.ts_us, k.end_us, _kind(k)) for k in near if k.end_us > lo]
        b = StepBreakdown(trace.label, step.name, (hi - lo) * 1e-6, step.dur_us * 1e-6, on_gpu=True)
        b.exclusive_s = _sweep(intervals, lo, hi)
        _busy(b, kernels)
        b.comms = [
            c
            for k in kernels
            if _kind(k) == "communication"
            for c in [_comm_of(k, k.dur_us * 1e-6)]
            if c
        ]
        if b.comms and all(c.size_bytes is None for c in b.comms):
            # older traces: the sizes are on the host's record_param_comms, in launch order
            sized = [e for e in host_comms if step.ts_us <= e.ts_us <= step.end_us]
            if len(sized) == len(b.comms):
                b.comms = [
                    Comm(c.collective, s.size_bytes, c.time_s, s.group_size)
                    for c, s in zip(b.comms, (_comm_of(e, 0.0) for e in sized))
                    if s is not None
                ]
        out.append(b)
    return out


def _busy(b: StepBreakdown, events: list[Event]) -> None:
    busy: dict[str, float] = defaultdict(float)
    count: Counter[str] = Counter()
    unknown: dict[str, float] = defaultdict(float)
    for e in events:
        kind = _kind(e)
        busy[kind] += e.dur_us * 1e-6
        count[kind] += 1
        if kind == "unclassified":
            unknown[e.name] += e.dur_us * 1e-6
    b.busy_s, b.count, b.unclassified = dict(busy), dict(count), dict(unknown)


def _within(events: list[Event], starts: list[float], lo: float, hi: float) -> list[Event]:
    """The events (sorted by start, ``starts`` their starts) that start in [lo, hi)."""
    return events[bisect.bisect_left(starts, lo) : bisect.bisect_left(starts, hi)]


def _cpu_steps(trace: Trace) -> list[StepBreakdown]:
    steps = trace.steps()
    out: list[StepBreakdown] = []
    threads: dict[tuple[Any, Any], list[Event]] = defaultdict(list)
    for e in trace.events:
        if e.cat in ("cpu_op", "user_annotation") and not e.name.startswith(STEP_PREFIX):
            threads[(e.pid, e.tid)].append(e)
    for evs in threads.values():
        evs.sort(key=lambda e: (e.ts_us, -e.dur_us))
    starts = {k: [e.ts_us for e in v] for k, v in threads.items()}
    comm_events = sorted(
        (e for e in trace.events if e.name.startswith("gloo:") or e.name == "record_param_comms"),
        key=lambda e: e.ts_us,
    )
    comm_starts = [e.ts_us for e in comm_events]
    for step in steps:
        key = (step.pid, step.tid)
        ops = _within(threads.get(key, []), starts.get(key, []), step.ts_us, step.end_us)
        b = StepBreakdown(trace.label, step.name, step.dur_us * 1e-6, step.dur_us * 1e-6)
        _self_times(ops, step, b)
        others = _within(comm_events, comm_starts, step.ts_us, step.end_us)
        b.comms = [c for e in others for c in [_comm_of(e, e.dur_us * 1e-6)] if c]
        out.append(b)
    return out


def _self_times(ops: list[Event], step: Event, b: StepBreakdown) -> None:
    """Exclusive seconds per kind of one host thread's nested ops inside ``step`` into ``b``:
    each op's time less its children's, an op inside ``Optimizer.step`` / ``Optimizer.zero_grad``
    counted as optimizer; the rest of the step is ``idle``. Busy time and count per kind: the
    ops whose parent is of another kind (``aten::linear`` and the ``aten::addmm`` inside it are
    one GEMM)."""
    out: dict[str, float] = defaultdict(float)
    busy: dict[str, float] = defaultdict(float)
    count: Counter[str] = Counter()
    unknown: dict[str, float] = defaultdict(float)
    stack: list[tuple[Event, str, list[float]]] = []  # (op, kind, [children's time])
    end_of_step = step.end_us
    covered = [0.0]

    def pop() -> None:
        op, kind, kids = stack.pop()
        span = max(0.0, min(op.end_us, end_of_step) - op.ts_us)
        out[kind] += max(0.0, span - kids[0]) * 1e-6
        if stack:
            stack[-1][2][0] += span
        else:
            covered[0] += span
        if not stack or stack[-1][1] != kind:
            busy[kind] += span * 1e-6
            count[kind] += 1
            if kind == "unclassified":
                unknown[op.name] += span * 1e-6

    for op in ops:
        while stack and stack[-1][0].end_us <= op.ts_us:
            pop()
        kind = _kind(op)
        if any(o.name.startswith("Optimizer.") for o, _, _ in stack):
            kind = "optimizer"
        stack.append((op, kind, [0.0]))
    while stack:
        pop()
    out[IDLE] += max(0.0, step.dur_us - covered[0]) * 1e-6
    b.exclusive_s, b.busy_s, b.count = dict(out), dict(busy), dict(count)
    b.unclassified = dict(unknown)


@dataclass
class Summary:
    """All steps of all ranks, per kind: the mean per step."""

    steps: list[StepBreakdown]

    @property
    def step_s(self) -> float:
        return statistics.fmean(b.step_s for b in self.steps)

    def mean(self, attr: str) -> dict[str, float]:
        total: dict[str, float] = defaultdict(float)
        for b in self.steps:
            for k, v in getattr(b, attr).items():
                total[k] += v
        return {k: v / len(self.steps) for k, v in total.items()}

    def kinds(self) -> list[str]:
        seen = set(self.mean("exclusive_s")) | set(self.mean("busy_s"))
        return [k for k in (*KINDS, IDLE) if k in seen]

    def comm_table(self) -> list[tuple[str, int | None, int | None, int, float]]:
        """(collective, size_bytes, group size, calls per step, seconds per step), largest
        time first."""
        calls: Counter[tuple[str, int | None, int | None]] = Counter()
        time_s: dict[tuple[str, int | None, int | None], float] = defaultdict(float)
        for b in self.steps:
            for c in b.comms:
                key = (c.collective, c.size_bytes, c.group_size)
                calls[key] += 1
                time_s[key] += c.time_s
        n = len(self.steps)
        rows = [(k[0], k[1], k[2], round(calls[k] / n), time_s[k] / n) for k in calls]
        return sorted(rows, key=lambda r: -r[4])

    def unclassified(self) -> list[tuple[str, float]]:
        total: dict[str, float] = defaultdict(float)
        for b in self.steps:
            for k, v in b.unclassified.items():
                total[k] += v / len(self.steps)
        return sorted(total.items(), key=lambda kv: -kv[1])


def summarise(steps: list[StepBreakdown]) -> Summary:
    if not steps:
        raise ValueError("no step with any activity")
    return Summary(steps)


def step_number(name: str) -> int | None:
    """``ProfilerStep#12`` -> 12."""
    tail = name.removeprefix(STEP_PREFIX)
    return int(tail) if tail.isdigit() else None
