"""A device profile learned from traced steps, in the schema ``collsim validate compute`` writes
(:func:`collsim.validate.measure.compute.write_profile`; read by
:func:`collsim.cluster.hardware.get_device`): the GEMM rate of every shape the trace ran
(``aten::mm`` / ``addmm`` / ``bmm`` / ``baddbmm`` with their recorded ``Input Dims``), the
attention rate of the SDPA ops (forward and backward, by head dim and sequence length), the
bandwidth of the memory-bound element-wise ops by size, the GELU rate, the optimizer's bytes per
second (``Optimizer.step#<name>.step``), the host cost per launch (on a CPU trace the step
thread's time no priced op holds, per priced op: :func:`host_per_launch`; the tiny op's time
kept as ``notes.op_floor_us``; on a GPU trace the kernel launch call) and, from a second trace
of the same step with the ranks pinned to fewer cores, the time-sharing slowdown
(:func:`time_sharing`). On a CPU-only trace an op's time is its host duration; on a GPU trace
the summed duration of the kernels its launches ran (``External id`` -> launch ->
``correlation`` -> kernel). Each point is its work over its time summed over its occurrences in
the traced steps of every rank (not the median: an op the OS preempted costs the step that time
too, and a step's prediction needs its mean). The rates are the ones the ranks got while they
ran together, so the profile's ``concurrent_slowdown`` is 1 (no further slowdown for
neighbours). What the trace did not run comes from the ``base`` device: its measured rows where
it is a profile (GEMM shapes farther than a factor of 2 in some dimension from every traced
shape; whole sections the trace lacks), else the catalogue model;
:meth:`LearnedProfile.describe` says which."""

from __future__ import annotations

import math
import statistics
from collections import defaultdict
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from collsim.cluster.hardware import get_device
from collsim.core.errors import ConfigError
from collsim.validate.data.kineto import GPU_CATS, STEP_PREFIX, Event, Trace
from collsim.validate.measure.compute import write_profile
from collsim.validate.measure.traces.breakdown import dtype_bytes
from collsim.validate.measure.traces.classify import classify
from collsim.workload.compute import optimizer_bytes_per_param
from collsim.workload.ops import head_ops, layer_ops

__all__ = [
    "LearnedProfile",
    "profile_from_traces",
    "write_trace_profile",
    "covered_gemm",
    "gemm_shapes",
]

GEMM_OPS = {"aten::mm": (0, 1), "aten::addmm": (1, 2), "aten::bmm": (0, 1), "aten::baddbmm": (1, 2)}
"""GEMM ops and the positions of their two matrix operands in ``Input Dims``."""

ATTENTION_OPS = {
    "aten::_scaled_dot_product_flash_attention_for_cpu": "flash2",
    "aten::_scaled_dot_product_flash_attention": "flash2",
    "aten::_flash_attention_forward": "flash2",
    "aten::_scaled_dot_product_cudnn_attention": "cudnn",
    "aten::_scaled_dot_product_efficient_attention": "eager",
    "aten::_efficient_attention_forward": "eager",
}
"""SDPA forward ops and the attention-table kernel they are filed under (memory-efficient
attention under ``eager``: collsim's kernel families have no entry of its own)."""

DTYPES = {"float": "fp32", "c10::bfloat16": "bf16", "c10::half": "fp16", "bfloat16": "bf16"}

TINY_ELEMENTS = 4096
"""An element-wise op on at most this many elements times the host cost of one op: 4096 fp32
elements (48 KiB moved by an add) take about 3 us at the slowest cold bandwidth of
``validate/data/third_host/cpu_profile.yaml`` (6.3 GB/s at 64 KiB), the order of its measured
host cost per op (3.3 us); the traced ones of ``validate step`` are 256-1024 elements."""

SAME_SHAPE_FACTOR = 2.0
"""A base GEMM row is dropped when a traced shape is within this factor in every dimension
(chosen: closer than the neighbours of ``validate compute``'s grid, x2.5 apart,
:data:`collsim.validate.measure.compute.GEMM_DIMS`)."""


@dataclass
class LearnedProfile:
    """The ``measured`` tables learned from a trace, and where each section came from."""

    measured: dict[str, Any]
    device: str
    base: str
    sources: dict[str, str] = field(default_factory=dict)
    """Section -> ``trace (N points)`` or ``base`` / ``catalogue model``."""
    traced_gemm: int = 0
    """The first rows of ``measured["gemm"]`` that the trace gave (the rest: the base's)."""

    def describe(self) -> str:
        parts = [f"{k}: {v}" for k, v in self.sources.items()]
        return f"# profile from the trace (base {self.base}): " + "; ".join(parts)


def _dims(event: Event) -> list[Any]:
    dims = event.args.get("Input Dims")
    return dims if isinstance(dims, list) else []


def _numel(dims: Any) -> int:
    if not isinstance(dims, list) or not dims:
        return 0
    if all(isinstance(d, list) for d in dims):  # a TensorList
        return sum(_numel(d) for d in dims)
    n = 1
    for d in dims:
        n *= int(d)
    return n


def _dtype(event: Event) -> str:
    types = event.args.get("Input type") or []
    for t in types:
        key = str(t).lower()
        if key in DTYPES:
            return DTYPES[key]
    return "fp32"


def _op_times(trace: Trace) -> list[tuple[Event, float]]:
    """Every host op inside a step with its time: its duration on a CPU-only trace, the sum of
    its kernels' durations on a GPU trace (ops that launched none are left out)."""
    steps = trace.steps()
    ops = [
        e
        for e in trace.events
        if e.cat == "cpu_op"
        and not e.name.startswith(STEP_PREFIX)
        and any(s.ts_us <= e.ts_us < s.end_us for s in steps)
    ]
    if not trace.on_gpu:
        return [(e, e.dur_us * 1e-6) for e in ops]
    by_corr: dict[Any, float] = defaultdict(float)
    for k in trace.events:
        if k.cat in GPU_CATS and "correlation" in k.args:
            by_corr[k.args["correlation"]] += k.dur_us * 1e-6
    by_ext: dict[Any, float] = defaultdict(float)
    for r in trace.events:
        if r.cat in ("cuda_runtime", "cuda_driver") and "External id" in r.args:
            by_ext[r.args["External id"]] += by_corr.get(r.args.get("correlation"), 0.0)
    return [
        (e, by_ext[e.args["External id"]]) for e in ops if by_ext.get(e.args.get("External id"))
    ]


def gemm_shapes(traces: list[Trace]) -> list[tuple[int, int, int, str, int, float, float]]:
    """The traced GEMMs by shape: (m, n, k, dtype, calls, seconds, TFLOP/s), most time first
    (all traced steps of all ranks)."""
    calls: dict[tuple[int, int, int, str], int] = defaultdict(int)
    points: dict[tuple[int, int, int, str], list[float]] = defaultdict(lambda: [0.0, 0.0])
    for e, t in (pair for trace in traces for pair in _op_times(trace)):
        shape = _gemm_shape(e)
        if shape is None or t <= 0:
            continue
        calls[shape] += 1
        points[shape][0] += 2.0 * shape[0] * shape[1] * shape[2]
        points[shape][1] += t
    rows = [(*k, calls[k], v[1], v[0] / v[1] / 1e12) for k, v in points.items()]
    return sorted(rows, key=lambda r: -r[5])


def _gemm_shape(e: Event) -> tuple[int, int, int, str] | None:
    where = GEMM_OPS.get(e.name)
    dims = _dims(e)
    if where is None or len(dims) <= max(where):
        return None
    a, b = dims[where[0]], dims[where[1]]
    if not isinstance(a, list) or not isinstance(b, list) or len(a) < 2 or len(b) < 2:
        return None
    batch = _numel(a[:-2]) if len(a) > 2 else 1
    return int(a[-2]) * max(batch, 1), int(b[-1]), int(a[-1]), _dtype(e)


def _gemm_rows(timed: list[tuple[Event, float]]) -> list[list[Any]]:
    points: dict[tuple[int, int, int, str], list[float]] = defaultdict(lambda: [0.0, 0.0])
    for e, t in timed:
        shape = _gemm_shape(e)
        if shape is None or t <= 0:
            continue
        points[shape][0] += 2.0 * shape[0] * shape[1] * shape[2]
        points[shape][1] += t
    return [[m, n, k, d, round(f / t / 1e12, 6)] for (m, n, k, d), (f, t) in sorted(points.items())]


def _attention_rows(trace_ops: list[tuple[Event, float]]) -> list[list[Any]]:
    fwd: dict[tuple[str, bool, int, int], list[float]] = defaultdict(lambda: [0.0, 0.0])
    bwd: dict[tuple[str, bool, int, int], list[float]] = defaultdict(lambda: [0.0, 0.0])
    for e, t in trace_ops:
        name = e.name.removesuffix("_backward")
        kernel = ATTENTION_OPS.get(name)
        dims = _dims(e)
        if kernel is None or t <= 0 or not dims or len(dims[0]) != 4:
            continue
        b, h, s, d = (int(x) for x in dims[0])
        concrete = e.args.get("Concrete Inputs") or []
        causal = "True" in [str(c) for c in concrete]
        # FLOPs as collsim.validate.measure.compute counts them: 4 b h s^2 d, half of it when
        # causal;
        # backward 2.5 x forward
        flops = 4.0 * b * h * s * s * d / (2 if causal else 1)
        key = (kernel, causal, d, s)
        acc = bwd[key] if e.name.endswith("_backward") else fwd[key]
        acc[0] += 2.5 * flops if e.name.endswith("_backward") else flops
        acc[1] += t
    rows = []
    for key in sorted(fwd):
        f = fwd[key][0] / fwd[key][1]
        b_rate = bwd[key][0] / bwd[key][1] if key in bwd else f
        rows.append([*key, round(f / 1e12, 6), round(b_rate / 1e12, 6)])
    return rows


MEMORY_BOUND = {"aten::add": 3, "aten::add_": 3, "aten::mul": 3, "aten::mul_": 3, "aten::copy_": 2}
"""Memory-bound ops that give the bandwidth table, and the tensors each moves (two read, one
written; a copy one of each)."""


def _bandwidth_rows(timed: list[tuple[Event, float]]) -> list[list[float]]:
    bins: dict[int, list[tuple[float, float]]] = defaultdict(list)  # (bytes, seconds)
    for e, t in timed:
        tensors = MEMORY_BOUND.get(e.name)
        dims = _dims(e)
        if tensors is None or t <= 0 or not dims:
            continue
        width = dtype_bytes((e.args.get("Input type") or ["float"])[0]) or 4
        size = tensors * _numel(dims[0]) * width
        if size < 64 * 1024:  # the smallest size validate compute times (65,532 bytes)
            continue
        bins[round(math.log2(size))].append((size, t))
    return [
        [
            float(statistics.median(s for s, _ in v)),
            round(sum(s for s, _ in v) / sum(t for _, t in v) / 1e9, 4),
        ]
        for _, v in sorted(bins.items())
    ]


def _activation_rows(timed: list[tuple[Event, float]]) -> list[list[Any]]:
    fwd: dict[int, float] = defaultdict(float)  # elements -> seconds summed
    bwd: dict[int, float] = defaultdict(float)
    calls: dict[tuple[int, bool], int] = defaultdict(int)
    for e, t in timed:
        if e.name not in ("aten::gelu", "aten::gelu_backward") or t <= 0 or not _dims(e):
            continue
        elems = _numel(_dims(e)[0])
        back = e.name.endswith("_backward")
        (bwd if back else fwd)[elems] += t
        calls[(elems, back)] += 1
    rows = []
    for n in sorted(fwd):
        f = n * calls[(n, False)] / fwd[n] / 1e9
        b = n * calls[(n, True)] / bwd[n] / 1e9 if n in bwd else f
        rows.append(["gelu", float(n), round(f, 6), round(b, 6)])
    return rows


def _optimizer_bps(trace: Trace) -> float | None:
    """Bytes per second of the traced ``Optimizer.step#<Name>.step``: the parameters it
    updated (the first tensor of each op directly inside it) x collsim's bytes per parameter
    of that optimizer, over its duration (median over steps)."""

    rates = []
    for ann in (e for e in trace.events if e.name.startswith("Optimizer.step#")):
        name = ann.name.split("#", 1)[1].split(".", 1)[0].lower()
        name = "adam" if name.startswith("adam") else name
        inside = [
            e
            for e in trace.events
            if e.cat == "cpu_op" and e.tid == ann.tid and ann.ts_us <= e.ts_us < ann.end_us
        ]
        params = sum(_numel(_dims(e)[0]) for e in _outermost(inside) if _dims(e))
        if not params or ann.dur_us <= 0:
            continue
        try:
            per_param = optimizer_bytes_per_param(name, "fp32")
        except Exception:  # an optimizer collsim does not price
            continue
        rates.append(params * per_param / (ann.dur_us * 1e-6))
    return statistics.median(rates) if rates else None


def _outermost(ops: list[Event]) -> list[Event]:
    out: list[Event] = []
    end = -math.inf
    for e in sorted(ops, key=lambda e: (e.ts_us, -e.dur_us)):
        if e.ts_us >= end:
            out.append(e)
            end = e.end_us
    return out


def _host_us(trace: Trace) -> float | None:
    """Median time of a tiny element-wise op (host duration on a CPU trace), or of a kernel
    launch call on a GPU trace."""
    if trace.on_gpu:
        launches = [
            e.dur_us for e in trace.events if e.cat == "cuda_runtime" and "LaunchKernel" in e.name
        ]
        return statistics.median(launches) if launches else None
    tiny = [
        e.dur_us
        for e in trace.events
        if e.cat == "cpu_op"
        and classify(e.name, e.cat) == "elementwise"
        and _dims(e)
        and 0 < _numel(_dims(e)[0]) <= TINY_ELEMENTS
    ]
    return statistics.median(tiny) if tiny else None


HOST_KINDS = frozenset({"framework", "copy", "unclassified"})
"""Op kinds no table of the profile prices: their self time on the step's thread is host time
(views, transposes, autograd bookkeeping, allocations, layout copies)."""

PRICED_KINDS = frozenset(
    {"gemm", "attention", "convolution", "norm", "elementwise", "embedding", "loss"}
)
"""Op kinds the simulation prices one kernel at a time: each op of one of these kinds inside no
other, outside the optimizer and DDP's reducer, is one launch of :func:`host_per_launch`."""

PRICED_ELSEWHERE = ("Optimizer.", "reducer::")
"""Annotations whose insides the simulation prices as a whole: the optimizer step and
zero_grad (``optimizer_bytes_per_s``), and DDP's reducer (``torch::distributed::reducer::
mul_out``, ``torch.distributed.ddp.reducer::copy_bucket_to_grad``: the gradient copies priced
from their bytes, ``collsim.validate.check.step``)."""


@dataclass
class HostTime:
    """The host time of a CPU trace's steps that no priced op holds (:func:`host_per_launch`)."""

    host_s: float
    """Summed over the steps: self time of :data:`HOST_KINDS` ops and the step thread's gaps
    between ops, outside :data:`PRICED_ELSEWHERE` and not while a collective of the rank ran."""
    launches: int
    """Ops of :data:`PRICED_KINDS` inside no other such op, summed over the steps."""
    steps: int

    @property
    def per_launch_us(self) -> float:
        return self.host_s / max(self.launches, 1) * 1e6


def _overlap_us(lo: float, hi: float, spans: list[tuple[float, float]]) -> float:
    return sum(max(0.0, min(hi, b) - max(lo, a)) for a, b in spans)


def _step_host_us(
    ops: list[Event], step: Event, comm: list[tuple[float, float]]
) -> tuple[float, int]:
    """(host microseconds, launches) of one step's ops on its thread, in time order."""
    host_us = 0.0
    launches = 0
    stack: list[tuple[Event, str, bool, list[float]]] = []  # op, kind, elsewhere, kids' time
    last_end = step.ts_us

    def pop() -> None:
        nonlocal host_us, launches
        op, kind, elsewhere, kids = stack.pop()
        span = max(0.0, min(op.end_us, step.end_us) - op.ts_us)
        if stack:
            stack[-1][3][0] += span
        if elsewhere:
            return
        if kind in HOST_KINDS:
            host_us += max(0.0, span - kids[0])
        elif kind in PRICED_KINDS and not any(k in PRICED_KINDS for _, k, _, _ in stack):
            launches += 1  # a priced op inside another (a GEMM's bias sum) is part of it

    for op in ops:
        while stack and stack[-1][0].end_us <= op.ts_us:
            pop()
        if not stack and op.ts_us > last_end:  # a gap between outermost ops
            host_us += (op.ts_us - last_end) - _overlap_us(last_end, op.ts_us, comm)
        elsewhere = any(p in op.name for p in PRICED_ELSEWHERE) or bool(stack and stack[-1][2])
        stack.append((op, classify(op.name, op.cat), elsewhere, [0.0]))
        if len(stack) == 1:
            last_end = max(last_end, op.end_us)
    while stack:
        pop()
    if step.end_us > last_end:
        host_us += (step.end_us - last_end) - _overlap_us(last_end, step.end_us, comm)
    return host_us, launches


def _comm_spans(trace: Trace) -> list[tuple[float, float]]:
    """The (start, end) microseconds of the trace's collectives, in order."""
    return sorted(
        (e.ts_us, e.end_us)
        for e in trace.events
        if e.name.startswith("gloo:") or e.name == "record_param_comms"
    )


def _step_ops(trace: Trace, step: Any) -> list[Event]:
    """The CPU ops and annotations on ``step``'s thread inside it (the step's own mark left out)."""
    return [
        e
        for e in trace.events
        if e.cat in ("cpu_op", "user_annotation")
        and e.tid == step.tid
        and e.pid == step.pid
        and step.ts_us <= e.ts_us < step.end_us
        and not e.name.startswith(STEP_PREFIX)
    ]


def host_per_launch(trace: Trace) -> HostTime:
    """The host cost per launch a CPU trace's steps show: on each step's thread, the self time
    of the ops of kinds no table prices (:data:`HOST_KINDS`) plus the gaps between the
    outermost ops (Python and the autograd engine between ops), leaving out what the simulation
    prices as a whole (:data:`PRICED_ELSEWHERE`) and the gaps while a collective of the rank ran
    (a wait, priced as exposed communication); over the ops the simulation prices one by one
    (:data:`PRICED_KINDS`, those inside no other priced op). On a CPU the host cost adds to each
    kernel's time (``collsim.workload.compute.ComputeModel``), so these seconds, spread over
    the launches, are what the simulated step lacks without them."""

    comm = _comm_spans(trace)
    host_us = 0.0
    launches = 0
    steps = trace.steps()
    for step in steps:
        ops = sorted(_step_ops(trace, step), key=lambda e: (e.ts_us, -e.dur_us))
        h, n = _step_host_us(ops, step, comm)
        host_us += h
        launches += n
    return HostTime(host_us * 1e-6, launches, len(steps))


def _busy_step_s(traces: list[Trace]) -> float:
    """Mean seconds per step of the steps' threads less their waits on a collective (the gaps
    between outermost ops while a collective of the rank ran), over every step of every rank."""
    total_us = 0.0
    count = 0
    for trace in traces:
        comm = _comm_spans(trace)
        for step in trace.steps():
            top = _outermost(_step_ops(trace, step))
            edges = [step.ts_us, *(x for e in top for x in (e.ts_us, e.end_us)), step.end_us]
            waits = sum(
                _overlap_us(edges[i], edges[i + 1], comm)
                for i in range(0, len(edges) - 1, 2)
                if edges[i + 1] > edges[i]
            )
            total_us += step.dur_us - waits
            count += 1
    return total_us / max(count, 1) * 1e-6


@dataclass
class TimeSharing:
    """The slowdown beyond an even share of a core, learned from the same step traced with the
    ranks on their own cores and with more ranks per core (:func:`time_sharing`)."""

    slowdown: float
    source: str


def time_sharing(pinned: list[Trace], reference: list[Trace]) -> TimeSharing:
    """How much slower a rank's step runs when ranks time-share the cores than the even share
    says: the mean step of ``pinned`` (the ranks pinned to fewer cores, e.g. ``taskset -c 0``,
    more ranks per core) over that of ``reference`` (the same step with fewer ranks per core),
    divided by the ratio of their ranks per core; waits on collectives left out. Above 1 when
    switching between ranks costs (each finds the cache the other filled), below when the
    cores' own rate rises with fewer busy (clock boost, memory bandwidth). ConfigError (exit 2)
    when a trace does not record its cores (``collsim validate step --profile-dir`` does) or the
    pinned ranks do not share more."""

    def per_core(traces: list[Trace]) -> float:
        shares = {t.ranks_per_core for t in traces}
        if None in shares or len(shares) != 1:
            bad = next((t for t in traces if t.ranks_per_core is None), traces[0])
            raise ConfigError(
                "no 'collsim.cores' / 'collsim.local_ranks' metadata (or the ranks disagree): "
                "record the traces with `collsim validate step --profile-dir`",
                file=bad.path,
            )
        value = shares.pop()
        assert value is not None
        return value

    if not pinned or not reference:
        raise ConfigError("the time-sharing slowdown needs pinned and reference traces")
    ratio = per_core(pinned) / per_core(reference)
    if ratio <= 1.0:
        raise ConfigError(
            f"the pinned traces run {per_core(pinned):g} ranks per core, the reference "
            f"{per_core(reference):g}: pin the ranks to fewer cores (taskset -c 0)",
            file=pinned[0].path,
        )
    busy_p, busy_r = _busy_step_s(pinned), _busy_step_s(reference)
    slowdown = busy_p / busy_r / ratio

    def got(traces: list[Trace]) -> str:
        shares = [t.cpu_share for t in traces if t.cpu_share is not None]
        return f", threads got {statistics.mean(shares):.2f} of a core" if shares else ""

    names = ", ".join("/".join(Path(t.path).parts[-2:]) for t in pinned)
    refs = ", ".join("/".join(Path(t.path).parts[-2:]) for t in reference)
    source = (
        f"pinned {names} ({per_core(pinned):g} ranks per core, {busy_p * 1e3:.2f} ms per step"
        f"{got(pinned)}) over {refs} ({per_core(reference):g}, {busy_r * 1e3:.2f} ms"
        f"{got(reference)}), / {ratio:g}"
    )
    return TimeSharing(round(slowdown, 4), source)


def _near(row: list[Any], rows: list[list[Any]]) -> bool:
    lim = math.log(SAME_SHAPE_FACTOR)
    return any(all(abs(math.log(row[i]) - math.log(r[i])) <= lim for i in range(3)) for r in rows)


def covered_gemm(shape: tuple[int, int, int], rows: list[list[Any]]) -> bool:
    """Whether a GEMM shape (m, n, k) is within :data:`SAME_SHAPE_FACTOR` of a traced shape."""
    return _near(list(shape), rows)


def _merged_tables(
    learned: dict[str, Any], base_tables: Any, base: str
) -> tuple[dict[str, Any], dict[str, str]]:
    """Each learned section, or the base device's rows where the trace had none; the GEMM
    rows add the base rows of shapes the trace did not see. Returns the tables and a source
    line per section."""
    sources: dict[str, str] = {}
    measured: dict[str, Any] = {"concurrent_slowdown": 1.0, "concurrent_memory_slowdown": 1.0}
    for section, rows in learned.items():
        base_rows = [list(r) for r in getattr(base_tables, section, ())] if base_tables else []
        if section == "gemm" and rows:
            kept = [r for r in base_rows if not _near(r, rows)]
            measured[section] = rows + kept
            sources[section] = (
                f"trace ({len(rows)} shapes)"
                + (f" + base ({len(kept)} shapes the trace did not see)" if kept else "")
                + f"; a shape beyond {SAME_SHAPE_FACTOR:g}x of every row: {base}'s own figures"
            )
        elif rows:
            measured[section] = rows
            sources[section] = f"trace ({len(rows)} points)"
        elif base_rows:
            measured[section] = base_rows
            sources[section] = "base (not in the trace)"
        else:
            measured[section] = []
            sources[section] = "catalogue model (not in the trace)"
    return measured, sources


def profile_from_traces(
    traces: list[Trace],
    *,
    base: str | None = None,
    pinned: list[Trace] | None = None,
    pinned_reference: list[Trace] | None = None,
) -> LearnedProfile:
    """Learn the ``measured`` tables from ``traces`` (one or several ranks of one job); with
    ``pinned`` also the time-sharing slowdown (:func:`time_sharing` against
    ``pinned_reference``, default ``traces``), in ``notes.time_sharing_slowdown``."""

    timed = [pair for t in traces for pair in _op_times(t)]
    on_gpu = any(t.on_gpu for t in traces)
    base = base or ("h100" if on_gpu else "cpu")
    base_tables = getattr(get_device(base), "measured", None)
    learned: dict[str, Any] = {
        "gemm": _gemm_rows(timed),
        "attention": _attention_rows(timed),
        "bandwidth": _bandwidth_rows(timed),
        "activation": _activation_rows(timed),
    }
    opt = [r for t in traces if (r := _optimizer_bps(t)) is not None]
    hosts = [h for t in traces if (h := _host_us(t)) is not None]
    floors: list[float] = []
    host_time = None
    if not on_gpu:  # the host cost adds to each kernel on a CPU: its measured share per launch
        found = [host_per_launch(t) for t in traces]
        host_time = HostTime(
            sum(h.host_s for h in found),
            sum(h.launches for h in found),
            sum(h.steps for h in found),
        )
        if host_time.launches:
            floors, hosts = hosts, [host_time.per_launch_us]
    measured, sources = _merged_tables(learned, base_tables, base)
    base_opt = getattr(base_tables, "optimizer_bytes_per_s", None) if base_tables else None
    measured["optimizer_bytes_per_s"] = round(statistics.median(opt), 1) if opt else base_opt
    sources["optimizer"] = "trace" if opt else ("base" if base_opt else "catalogue model")
    base_host = getattr(base_tables, "host_us", None) if base_tables else None
    measured["host_us"] = round(statistics.median(hosts), 3) if hosts else base_host
    sources["host"] = "trace" if hosts else ("base" if base_host else "catalogue model")
    if host_time is not None and host_time.launches:
        per_step = host_time.steps or 1
        sources["host"] = (
            f"trace ({host_time.host_s / per_step * 1e3:.2f} ms per step outside the priced ops"
            f" over {host_time.launches / per_step:.0f} launches)"
        )
    measured["launch_us"] = 0.0
    shared = None
    if pinned:
        shared = time_sharing(pinned, pinned_reference or traces)
        sources["time sharing"] = f"x{shared.slowdown:g}: {shared.source}"
    # the rows are the shapes the trace ran: a shape far from all of them is priced by the
    # base device's own figures (write_trace_profile), not by the nearest traced shape
    measured["gemm_reach"] = SAME_SHAPE_FACTOR
    measured["notes"] = {
        "source": "trace",
        "traces": [Path(t.path).name for t in traces],
        "threads": 1,
        "device": "cuda" if on_gpu else "cpu",
        "base": base,
        "activation_dtype": "fp32" if not on_gpu else "bf16",
        # a tiny op's own time: the floor of a kernel issued without Python between
        # (DDP's gradient copies, collsim.validate.check.step); host_us is per launch
        **({"op_floor_us": round(statistics.median(floors), 3)} if floors else {}),
        # applied where the predicted ranks exceed the cores (collsim.validate.check.step)
        **(
            {"time_sharing_slowdown": shared.slowdown, "time_sharing_source": shared.source}
            if shared is not None
            else {}
        ),
        **({"attention_dtype": "fp32"} if not on_gpu else {"attention_dtype": "bf16"}),
    }
    return LearnedProfile(
        measured, "cuda" if on_gpu else "cpu", base, sources, len(learned["gemm"])
    )


def base_figures(base: str) -> dict[str, Any]:
    """The device-file figures of ``base`` (a catalogue key or a device file) that price a GEMM
    no profile row reaches (:data:`SAME_SHAPE_FACTOR`): its peak and best-shape (MAMF) rates,
    its SM (core) count and its clocks, in the units of the device schema."""
    device = get_device(base)
    figures: dict[str, Any] = {
        "peak_tflops": {k: v / 1e12 for k, v in device.peak_flops.items()},
        "mamf_tflops": {k: v / 1e12 for k, v in device.mamf_flops.items()},
    }
    if device.sm_count is not None:
        figures["sm_count"] = device.sm_count
    clocks = {
        k: v
        for k, v in (
            ("boost_mhz", device.boost_clock_mhz),
            ("sustained_mhz", device.sustained_clock_mhz),
        )
        if v is not None
    }
    if clocks:
        figures["clocks"] = clocks
    return figures


def write_trace_profile(path: str | Path, learned: LearnedProfile) -> Path:
    """Write ``learned`` as a device file
    (:func:`collsim.validate.measure.compute.write_profile`)."""

    tables = dict(learned.measured)
    if not tables["gemm"]:
        raise ConfigError(
            "the traces hold no GEMM with recorded shapes (profile with record_shapes=True)",
            key_path="--profile-out",
        )
    figures = base_figures(learned.base)
    if learned.device == "cpu":
        # the traced rates are one thread's: no wave quantization over the base's cores (with
        # the catalogue CPU's 32, a fused attention of 8 heads x 1 block would run at 8/32)
        figures["sm_count"] = int(tables["notes"].get("threads", 1))
    out = write_profile(path, tables, device=learned.device, figures=figures)
    text = out.read_text().replace(
        "written by `collsim validate compute`",
        "learned from a trace by `collsim validate trace --profile-out`",
        1,
    )
    out.write_text(text)
    return out


def gemm_coverage(
    rows: list[list[Any]], scenario: Any
) -> tuple[list[tuple[int, int, int]], list[tuple[int, int, int]]]:
    """The GEMM shapes (m, n, k) of ``scenario``'s layers, embedding and head, forward and
    backward: those within :data:`SAME_SHAPE_FACTOR` of a traced shape, and those not (a
    profile prices them from its base's measured rows within that factor where it has them,
    else from its base device's own figures: ``gemm_reach``)."""

    training, parallel, spec = scenario.training, scenario.parallel, scenario.model
    tp = int(getattr(parallel, "tp", 1))
    sp = bool(getattr(parallel, "sequence_parallel", False))
    kw = {"micro_batch": training.micro_batch, "tp": tp, "sequence_parallel": sp}
    ops = [
        *layer_ops(spec, dtype=training.dtype, **kw),
        *head_ops(spec, dtype=training.dtype, **kw),
    ]
    shapes = sorted(
        {(g.m * g.batch, g.n, g.k) for op in ops for g in (*op.gemms, *op.backward_gemms)}
    )
    traced = [r for r in rows if r]
    seen = [s for s in shapes if covered_gemm(s, traced)]
    return seen, [s for s in shapes if s not in seen]
