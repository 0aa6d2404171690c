"""The kernel rates of traced steps, per op kind: the GEMM rate of every shape the trace ran
(``aten::mm`` / ``addmm`` / ``bmm`` / ``baddbmm`` with their recorded ``Input Dims``), the
attention rate of the SDPA ops (forward and backward, by head dim and sequence length), the
bandwidth of the memory-bound element-wise ops by size, the GELU rate, the optimizer's bytes per
second (``Optimizer.step#<name>.step``) and a tiny op's host time, as rows of the device schema
that :mod:`collsim.validate.fit.trace_profile` assembles. On a CPU-only trace an op's time is
its host duration; on a GPU trace the summed duration of the kernels its launches ran (``External
id`` -> launch -> ``correlation`` -> kernel). Each point is its work over its time summed over its
occurrences in the traced steps of every rank (not the median: an op the OS preempted costs the
step that time too, and a step's prediction needs its mean).
"""

from __future__ import annotations

import math
import statistics
from collections import defaultdict
from typing import Any

from collsim.validate.data.kineto import GPU_CATS, STEP_PREFIX, Event, Trace
from collsim.validate.measure.traces.breakdown import dtype_bytes
from collsim.validate.measure.traces.classify import classify
from collsim.workload.compute import optimizer_bytes_per_param

__all__ = [
    "GEMM_OPS",
    "ATTENTION_OPS",
    "MEMORY_BOUND",
    "TINY_ELEMENTS",
    "op_times",
    "gemm_shapes",
    "gemm_op_rates",
    "gemm_rows",
    "attention_rows",
    "bandwidth_rows",
    "activation_rows",
    "optimizer_bps",
    "outermost",
    "tiny_op_us",
]

GEMM_OPS = {"aten::mm": (0, 1), "aten::addmm": (1, 2), "aten::bmm": (0, 1), "aten::baddbmm": (1, 2)}
"""GEMM ops and the positions of their two matrix operands in ``Input Dims``."""

ATTENTION_OPS: dict[str, tuple[str, bool, int, int]] = {
    # name less "_backward": (kernel, inputs laid out (b, s, h, d), position of is_causal in the
    # forward's Concrete Inputs, in the backward's)
    "aten::_scaled_dot_product_flash_attention_for_cpu": ("flash2", False, 4, 7),
    "aten::_scaled_dot_product_flash_attention": ("flash2", False, 4, 11),
    "aten::_flash_attention_forward": ("flash2", True, 8, -1),
    "aten::_flash_attention": ("flash2", True, -1, 11),
    "aten::_scaled_dot_product_cudnn_attention": ("cudnn", False, 6, 14),
    "aten::_cudnn_attention_forward": ("cudnn", False, 10, -1),
    "aten::_cudnn_attention": ("cudnn", False, -1, 14),
    "aten::_scaled_dot_product_efficient_attention": ("eager", False, 6, 11),
    "aten::_efficient_attention_forward": ("eager", True, 9, -1),
    "aten::_efficient_attention": ("eager", True, -1, 14),
}
"""SDPA ops by name less ``_backward``: the attention-table kernel they are filed under
(memory-efficient attention under ``eager``: collsim's kernel families have no entry of its
own), whether their inputs are (batch, seq, heads, head dim) (the kernels' own ops, which
SDPA calls on transposed views) rather than (batch, heads, seq, head dim), and where
``is_causal`` stands among the arguments of the forward and of the backward
(``native_functions.yaml`` of PyTorch 2.5-2.11; the memory-efficient kernel's own ops take an
integer ``custom_mask_type`` there, causal when non-zero). On a GPU the kernels belong to the
innermost op, which launched them (``aten::_<kernel>_attention_forward`` / ``_backward`` under
each SDPA op in PyTorch 2.11's traces, validate/data/h200/); on a CPU the SDPA op's own
duration counts."""


def _causal(concrete: list[Any], at: int) -> bool:
    """Whether the argument at ``at`` of a trace's ``Concrete Inputs`` says causal (``True``,
    or a non-zero mask type); the first ``True`` where the position is unknown or absent."""
    values = [str(c) for c in concrete]
    if 0 <= at < len(values) and values[at] not in ("", "None"):
        return values[at] not in ("False", "0")
    return "True" in values


DTYPES = {"float": "fp32", "c10::bfloat16": "bf16", "c10::half": "fp16", "bfloat16": "bf16"}

TINY_ELEMENTS = 4096
"""An element-wise op on at most this many elements times the host cost of one op: 4096 fp32
elements (48 KiB moved by an add) take about 3 us at the slowest cold bandwidth of
``validate/data/third_host/cpu_profile.yaml`` (6.3 GB/s at 64 KiB), the order of its measured
host cost per op (3.3 us); the traced ones of ``validate step`` are 256-1024 elements."""


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


def op_times(trace: Trace) -> list[tuple[Event, float]]:
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
    for e, t in (pair for trace in traces for pair in op_times(trace)):
        shape = _gemm_shape(e)
        if shape is None or t <= 0:
            continue
        calls[shape] += 1
        points[shape][0] += 2.0 * shape[0] * shape[1] * shape[2]
        points[shape][1] += t
    rows = [(*k, calls[k], v[1], v[0] / v[1] / 1e12) for k, v in points.items()]
    return sorted(rows, key=lambda r: -r[5])


def gemm_op_rates(traces: list[Trace]) -> list[float]:
    """The FLOP/s of each traced GEMM op on its own (every step of every rank): a GEMM of these
    sizes lasts well under a scheduler time slice, so most run unpreempted and their median is
    the rate a core gave the op, whatever share of the core the rank got."""
    rates = []
    for e, t in (pair for trace in traces for pair in op_times(trace)):
        shape = _gemm_shape(e)
        if shape is not None and t > 0:
            rates.append(2.0 * shape[0] * shape[1] * shape[2] / t)
    return rates


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


def gemm_rows(timed: list[tuple[Event, float]]) -> list[list[Any]]:
    points: dict[tuple[int, int, int, str], list[float]] = defaultdict(lambda: [0.0, 0.0])
    for e, t in timed:
        shape = _gemm_shape(e)
        if shape is None or t <= 0:
            continue
        points[shape][0] += 2.0 * shape[0] * shape[1] * shape[2]
        points[shape][1] += t
    return [[m, n, k, d, round(f / t / 1e12, 6)] for (m, n, k, d), (f, t) in sorted(points.items())]


def attention_rows(trace_ops: list[tuple[Event, float]]) -> list[list[Any]]:
    fwd: dict[tuple[str, bool, int, int], list[float]] = defaultdict(lambda: [0.0, 0.0])
    bwd: dict[tuple[str, bool, int, int], list[float]] = defaultdict(lambda: [0.0, 0.0])
    for e, t in trace_ops:
        backward = e.name.endswith("_backward")
        known = ATTENTION_OPS.get(e.name.removesuffix("_backward"))
        dims = _dims(e)
        if known is None or t <= 0 or not dims or len(dims[0]) != 4:
            continue
        kernel, bshd, causal_fwd, causal_bwd = known
        b, s, h, d = (int(x) for x in dims[0])
        if not bshd:
            h, s = s, h
        causal = _causal(
            e.args.get("Concrete Inputs") or [], causal_bwd if backward else causal_fwd
        )
        # FLOPs as collsim.validate.measure.compute counts them: 4 b h s^2 d, half of it when
        # causal;
        # backward 2.5 x forward
        flops = 4.0 * b * h * s * s * d / (2 if causal else 1)
        key = (kernel, causal, d, s)
        acc = bwd[key] if backward else fwd[key]
        acc[0] += 2.5 * flops if backward else flops
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


def bandwidth_rows(timed: list[tuple[Event, float]]) -> list[list[float]]:
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


def activation_rows(timed: list[tuple[Event, float]]) -> list[list[Any]]:
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


def optimizer_bps(trace: Trace) -> float | None:
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
        params = sum(_numel(_dims(e)[0]) for e in outermost(inside) if _dims(e))
        if not params or ann.dur_us <= 0:
            continue
        try:
            per_param = optimizer_bytes_per_param(name, "fp32")
        except Exception:  # an optimizer collsim does not price
            continue
        rates.append(params * per_param / (ann.dur_us * 1e-6))
    return statistics.median(rates) if rates else None


def outermost(ops: list[Event]) -> list[Event]:
    out: list[Event] = []
    end = -math.inf
    for e in sorted(ops, key=lambda e: (e.ts_us, -e.dur_us)):
        if e.ts_us >= end:
            out.append(e)
            end = e.end_us
    return out


def tiny_op_us(trace: Trace) -> float | None:
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
