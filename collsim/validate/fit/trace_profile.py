"""A device profile learned from traced steps, in the schema ``collsim validate compute`` writes
(:func:`collsim.validate.measure.compute.write_profile`; read by
:func:`collsim.cluster.hardware.get_device`): the kernel rates of the traced ops
(:mod:`collsim.validate.fit.trace_rates`), the host cost per launch and, from a second trace of
the same step with the ranks pinned to fewer cores, the time-sharing slowdown
(:mod:`collsim.validate.fit.trace_host`; the tiny op's time kept as ``notes.op_floor_us``; on a
GPU trace the kernel launch call is the host cost). The rates are the ones the ranks got while
they ran together, so the profile's ``concurrent_slowdown`` is 1 (no further slowdown for
neighbours). What the trace did not run comes from the ``base`` device: its measured rows where
it is a profile (GEMM shapes farther than a factor of 2 in some dimension from every traced
shape; whole sections the trace lacks), else the catalogue model; :meth:`LearnedProfile.describe`
says which.
"""

from __future__ import annotations

import math
import statistics
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from collsim.cluster.hardware import get_device
from collsim.core.errors import ConfigError
from collsim.validate.check.kernels import attention_model_s
from collsim.validate.data.kineto import Trace
from collsim.validate.fit.trace_host import HostTime, host_per_launch, time_sharing
from collsim.validate.fit.trace_rates import (
    activation_rows,
    attention_rows,
    bandwidth_rows,
    gemm_rows,
    op_times,
    optimizer_bps,
    tiny_op_us,
)
from collsim.validate.measure.compute import (
    CUDA_ATTENTION_HIDDEN,
    CUDA_ATTENTION_TOKENS,
    attention_shape,
    write_profile,
)
from collsim.workload.compute import ComputeModel
from collsim.workload.ops import head_ops, layer_ops

__all__ = [
    "LearnedProfile",
    "profile_from_traces",
    "write_trace_profile",
    "covered_gemm",
    "gemm_coverage",
    "base_figures",
    "SAME_SHAPE_FACTOR",
    "MODEL_CURVE_SEQS",
    "attention_along_model",
]

MODEL_CURVE_SEQS = (128, 256, 512, 1024, 2048, 4096, 8192, 16384, 32768)
"""Sequence lengths a GPU trace's attention rows are carried to along the base device's model
(:func:`attention_along_model`)."""

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


def _model_rates(
    base: Any, kernel: str, causal: bool, head_dim: int, seq: int
) -> tuple[float, float]:
    """(forward, backward) FLOP/s of ``base``'s model for attention of this kernel and shape,
    in the layout ``validate compute`` times on a GPU (16k tokens of hidden 2048,
    :func:`~collsim.validate.measure.compute.attention_shape`), FLOPs counted as there."""

    batch, heads = attention_shape(seq, head_dim, CUDA_ATTENTION_TOKENS, CUDA_ATTENTION_HIDDEN)

    def models(dtype: str, **kwargs: Any) -> ComputeModel:
        return ComputeModel(base, dtype, **kwargs)

    fwd_s, bwd_s = attention_model_s(models, kernel, causal, head_dim, seq, batch, heads, "bf16")
    flops = 4.0 * batch * heads * seq * seq * head_dim * (0.5 if causal else 1.0)
    return flops / fwd_s, 2.5 * flops / bwd_s


def attention_along_model(rows: list[list[Any]], base: Any) -> tuple[list[list[Any]], int]:
    """A GPU trace's attention rows and, per (kernel, causal, head dim), rows at the other
    lengths of :data:`MODEL_CURVE_SEQS`: the traced rate of the nearest traced length (in log
    length) times the ratio of ``base``'s model rates at the two lengths, per phase. A trace
    holds the few sequence lengths its model ran (often one); an attention kernel's rate rises
    with the length over a range a table lookup would otherwise hold flat, so the model gives
    the curve's shape and the trace its level. Groups whose kernel ``base``'s model does not
    price keep their traced rows alone. Returns the rows and how many were added."""
    groups: dict[tuple[str, bool, int], dict[int, list[Any]]] = {}
    for row in rows:
        groups.setdefault((row[0], bool(row[1]), int(row[2])), {})[int(row[3])] = row
    added: list[list[Any]] = []
    for (kernel, causal, d), traced in groups.items():
        try:  # the model's rates at every length wanted and every traced one, once each
            model = {
                s: _model_rates(base, kernel, causal, d, s) for s in {*MODEL_CURVE_SEQS, *traced}
            }
        except ConfigError:  # a kernel the base device's generation does not run
            continue
        for s in MODEL_CURVE_SEQS:
            if s in traced:
                continue
            near = min(traced, key=lambda t: abs(math.log(t / s)))
            row = traced[near]
            fwd = row[4] * model[s][0] / model[near][0]
            bwd = row[5] * model[s][1] / model[near][1]
            added.append([kernel, causal, d, s, round(fwd, 6), round(bwd, 6)])
    return sorted(rows + added, key=lambda r: (r[0], r[1], r[2], r[3])), len(added)


def profile_from_traces(
    traces: list[Trace],
    *,
    base: str | None = None,
    pinned: list[Trace] | None = None,
    pinned_reference: list[Trace] | None = None,
) -> LearnedProfile:
    """Learn the ``measured`` tables from ``traces`` (one or several ranks of one job); with
    ``pinned`` also the time-sharing slowdown (:func:`time_sharing` against
    ``pinned_reference``, default ``traces``), in ``notes.time_sharing_slowdown`` where it
    applies (:attr:`collsim.validate.fit.trace_host.TimeSharing.applies`; else only
    ``notes.time_sharing_source``, saying why not)."""

    timed = [pair for t in traces for pair in op_times(t)]
    on_gpu = any(t.on_gpu for t in traces)
    base = base or ("h100" if on_gpu else "cpu")
    base_tables = getattr(get_device(base), "measured", None)
    learned: dict[str, Any] = {
        "gemm": gemm_rows(timed),
        "attention": attention_rows(timed),
        "bandwidth": bandwidth_rows(timed),
        "activation": activation_rows(timed),
    }
    opt = [r for t in traces if (r := optimizer_bps(t)) is not None]
    hosts = [h for t in traces if (h := tiny_op_us(t)) is not None]
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
    carried = traced = 0
    if on_gpu and learned["attention"]:
        traced = len(learned["attention"])
        learned["attention"], carried = attention_along_model(
            learned["attention"], get_device(base)
        )
    measured, sources = _merged_tables(learned, base_tables, base)
    if carried:
        sources["attention"] = (
            f"trace ({traced} points) and {carried} more along {base}'s model of the "
            "sequence length"
        )
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
        verdict = "" if shared.applies else "not applied, "
        sources["time sharing"] = f"{verdict}x{shared.slowdown:g}: {shared.source}"
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
            if shared is not None and shared.applies
            else {"time_sharing_source": f"not applied: {shared.source}"}
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
