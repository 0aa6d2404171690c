"""``collsim validate kernels``: a measured device profile against a device's compute model.

Derivations, measurements and sources: docs/derivations.md, ``collsim.validate.check.kernels``.
"""

from __future__ import annotations

import csv
import math
import statistics
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from collsim.core.errors import ConfigError
from collsim.core.vocab import OpKind
from collsim.validate.measure.compute import ComputeGrid, attention_shape
from collsim.workload.compute import ComputeModel, optimizer_bytes_per_param
from collsim.workload.model import TransformerSpec
from collsim.workload.ops import Gemm, Op, activation_element_bytes, elementwise_op

__all__ = [
    "KernelRow",
    "KindSummary",
    "compare_kernels",
    "summarize",
    "format_rows",
    "format_summary",
    "write_csv",
    "ATTENTION_OPS",
    "attention_model_s",
]

ATTENTION_OPS = {
    "fused": ("flash_attention",),
    "eager": ("attn_scores", "softmax", "attn_values"),
}
"""The ops of :mod:`collsim.workload.ops` that make up the attention kernel SDPA times."""

CSV_COLUMNS = (
    "kind",
    "entry",
    "unit",
    "measured_rate",
    "model_rate",
    "measured_s",
    "model_s",
    "ratio",
)


@dataclass(frozen=True, slots=True, kw_only=True)
class KernelRow:
    """One measured kernel against the model: times in seconds, rates in ``unit``."""

    kind: str
    """``gemm bf16``, ``attention flash2 fwd``, ``memory``, ``gelu fwd`` / ``swiglu bwd``
    (activations), ``optimizer`` or ``host``."""
    entry: str
    """The shape or size, e.g. ``m=64 n=400 k=2500``."""
    unit: str
    """Unit of the rates: ``TFLOP/s``, ``GB/s``, ``Gelem/s`` (activations) or ``us`` (host:
    the time itself)."""
    work: float
    """FLOPs (GEMM, attention), bytes (memory, optimizer) or elements (activations) as the
    profile counts them; 0 for the host cost."""
    measured_s: float
    model_s: float

    @property
    def ratio(self) -> float:
        """Measured over modelled time (> 1: slower than modelled)."""
        return self.measured_s / self.model_s

    def rate(self, time_s: float) -> float:
        if self.unit == "TFLOP/s":
            return self.work / time_s / 1e12
        if self.unit in ("GB/s", "Gelem/s"):
            return self.work / time_s / 1e9
        return time_s * 1e6

    @property
    def measured_rate(self) -> float:
        return self.rate(self.measured_s)

    @property
    def model_rate(self) -> float:
        return self.rate(self.model_s)


@dataclass(frozen=True, slots=True, kw_only=True)
class KindSummary:
    """Ratios of one kernel kind: median and the worst (furthest from 1 in log)."""

    kind: str
    count: int
    median_ratio: float
    worst_ratio: float
    worst_entry: str


def _notes(profile: Any) -> dict[str, Any]:
    return dict(getattr(profile.measured, "extra", {}) or {})


def _attention_layout(notes: dict[str, Any]) -> tuple[int | None, int | None, str]:
    """(tokens, hidden, dtype) the profile timed attention with (its notes; a profile without
    them was timed on one sequence of 4 heads in fp32, as ``validate compute`` does on a CPU):
    :func:`collsim.validate.measure.compute.attention_shape` turns them into (batch, heads)."""
    on_cpu = str(notes.get("device", "cpu")) == "cpu"
    tokens = notes.get("attention_tokens")
    hidden = notes.get("attention_hidden")
    dtype = str(notes.get("attention_dtype", "fp32" if on_cpu else "bf16"))
    return (
        None if tokens is None else int(tokens),
        None if hidden is None else int(hidden),
        dtype,
    )


def _gemm_rows(
    profile: Any, models: Callable[..., Any], skipped: dict[str, int]
) -> list[KernelRow]:
    rows = []
    for m, n, k, dtype, tflops in profile.measured.gemm:
        gemm = Gemm(m, n, k)
        try:
            model_s = models(dtype).gemm_time_s(gemm, dtype)[0]
        except ConfigError as exc:  # a dtype the device has no figures for
            _skip(skipped, f"gemm {dtype}: {exc}")
            continue
        rows.append(
            KernelRow(
                kind=f"gemm {dtype}",
                entry=f"m={m} n={n} k={k}",
                unit="TFLOP/s",
                work=gemm.flops,
                measured_s=gemm.flops / (tflops * 1e12),
                model_s=model_s,
            )
        )
    return rows


def attention_model_s(
    models: Callable[..., Any],
    kernel: str,
    causal: bool,
    head_dim: int,
    seq: int,
    batch: int,
    heads: int,
    dtype: str,
) -> tuple[float, float]:
    """(forward, backward) seconds of the attention ops of a layer of this shape."""

    eager = kernel == "eager"
    model = models(dtype, attention_kernel=kernel, causal=causal, fused_kernels=not eager)
    spec = TransformerSpec(
        name="attention-probe",
        num_layers=1,
        hidden=heads * head_dim,
        num_heads=heads,
        ffn_hidden=4 * heads * head_dim,
        seq_len=seq,
        vocab=1000,
        dropout=False,
        flash_attention=not eager,
    )
    names = ATTENTION_OPS["eager" if eager else "fused"]
    costs = model.layer_times(spec, micro_batch=batch).ops
    fwd = sum(c.time_s for c in costs if c.name in names and c.phase == "forward")
    bwd = sum(c.time_s for c in costs if c.name in names and c.phase == "backward")
    return float(fwd), float(bwd)


def _skip(skipped: dict[str, int], what: str) -> None:
    skipped[what] = skipped.get(what, 0) + 1


def _attention_rows(
    profile: Any, models: Callable[..., Any], skipped: dict[str, int]
) -> list[KernelRow]:
    tokens, hidden, dtype = _attention_layout(_notes(profile))
    rows = []
    for kernel, causal, d, s, fwd_tflops, bwd_tflops in profile.measured.attention:
        batch, heads = attention_shape(s, d, tokens, hidden)
        # the profile's FLOP count: 4 b h s^2 d, halved when causal; backward 2.5 x forward
        fwd_flops = 4.0 * batch * heads * s * s * d * (0.5 if causal else 1.0)
        try:
            fwd_s, bwd_s = attention_model_s(models, kernel, causal, d, s, batch, heads, dtype)
        except ConfigError as exc:  # a kernel the device's generation does not run
            _skip(skipped, f"attention {kernel}: {exc}")
            continue
        entry = f"d={d} s={s}" + (" causal" if causal else "")
        for phase, flops, tflops, model_s in (
            ("fwd", fwd_flops, fwd_tflops, fwd_s),
            ("bwd", 2.5 * fwd_flops, bwd_tflops, bwd_s),
        ):
            rows.append(
                KernelRow(
                    kind=f"attention {kernel} {phase}",
                    entry=entry,
                    unit="TFLOP/s",
                    work=flops,
                    measured_s=flops / (tflops * 1e12),
                    model_s=model_s,
                )
            )
    return rows


def _memory_rows(
    profile: Any, models: Callable[..., Any], skipped: dict[str, int]
) -> list[KernelRow]:
    model = models("fp32")
    rows = []
    for size, gbps in profile.measured.bandwidth:
        elements = size / 12.0  # c = a + b over fp32 tensors: 3 x 4 bytes per element
        op = Op(
            name="attn_residual_add",
            kind=OpKind.ELEMENTWISE,
            flops=elements,
            size_bytes=size,
            backward_flops=2.0 * elements,
            backward_bytes=2.0 * size,
        )
        rows.append(
            KernelRow(
                kind="memory",
                entry=f"{size:.0f} B",
                unit="GB/s",
                work=size,
                measured_s=size / (gbps * 1e9),
                model_s=model.op_cost(op, "forward").time_s,
            )
        )
    return rows


def _activation_rows(
    profile: Any, models: Callable[..., Any], skipped: dict[str, int]
) -> list[KernelRow]:
    notes = _notes(profile)
    dtype = str(notes.get("activation_dtype", "fp32" if notes.get("device") == "cpu" else "bf16"))
    e = activation_element_bytes(dtype)
    rows = []
    for kind, elements, fwd, bwd in profile.measured.activation:
        if kind not in ("gelu", "swiglu"):
            _skip(skipped, f"activation {kind}")
            continue
        model = models(dtype, fused_kernels=False)
        model._gated = kind == "swiglu"  # the op list's style (ComputeModel._with_style)
        tensors = 3 if kind == "swiglu" else 2  # SwiGLU reads a and b, GELU x; each writes one
        op = elementwise_op("activation", kind, elements, tensors * e * elements)
        for phase, rate in (("forward", fwd), ("backward", bwd)):
            rows.append(
                KernelRow(
                    kind=f"{kind} {'fwd' if phase == 'forward' else 'bwd'}",
                    entry=f"{elements:.0f} elements",
                    unit="Gelem/s",
                    work=elements,
                    measured_s=elements / (rate * 1e9),
                    model_s=model.op_cost(op, phase).time_s,
                )
            )
    return rows


def _optimizer_rows(
    profile: Any, models: Callable[..., Any], skipped: dict[str, int]
) -> list[KernelRow]:
    bps = profile.measured.optimizer_bytes_per_s
    if not bps:
        return []
    notes = _notes(profile)
    params = int(notes.get("optimizer_params", ComputeGrid().optimizer_params))
    # the bytes the profile counted per parameter: a plain SGD step's 12 since it says so,
    # the 20 of SGD with momentum before (optimizer_bytes_per_param("sgd", "fp32"))
    per_param = float(
        notes.get("optimizer_bytes_per_param", optimizer_bytes_per_param("sgd", "fp32"))
    )
    size = params * per_param
    model = models("fp32")
    model_s = size / model.memory_bandwidth_at(size) + model.launch_s
    return [
        KernelRow(
            kind="optimizer",
            entry=f"sgd {params} params",
            unit="GB/s",
            work=size,
            measured_s=size / bps,
            model_s=model_s,
        )
    ]


def _host_rows(
    profile: Any, models: Callable[..., Any], skipped: dict[str, int]
) -> list[KernelRow]:
    host_us = profile.measured.host_us
    if host_us is None:
        return []
    model_s = float(models("fp32").host_s)
    if model_s <= 0:  # CUDA graphs: no host cost to compare with
        return []
    return [
        KernelRow(
            kind="host",
            entry="per kernel",
            unit="us",
            work=0.0,
            measured_s=host_us * 1e-6,
            model_s=model_s,
        )
    ]


def compare_kernels(
    profile: Any, device: Any, *, execution: str = "eager"
) -> tuple[list[KernelRow], list[str]]:
    """Every measured entry of ``profile`` (a Device with ``measured`` tables) against
    ``device``'s compute model; returns the rows and one note per entry left out (a dtype
    or attention kernel the device's model has no figures for).

    Raises:
        ConfigError: the profile has no ``measured:`` section.
    """

    if getattr(profile, "measured", None) is None:
        raise ConfigError(
            "missing: not a device profile (write one with `collsim validate compute -o`)",
            file=getattr(profile, "source", "") or None,
            key_path="measured",
        )

    def models(dtype: str, **kwargs: Any) -> ComputeModel:
        return ComputeModel(device, dtype, execution=execution, **kwargs)

    rows: list[KernelRow] = []
    skipped: dict[str, int] = {}
    parts = (
        _gemm_rows,
        _attention_rows,
        _memory_rows,
        _activation_rows,
        _optimizer_rows,
        _host_rows,
    )
    for part in parts:
        rows += part(profile, models, skipped)
    return rows, [f"{n} x {what}" for what, n in skipped.items()]


def _log_dev(ratio: float) -> float:
    return abs(math.log(ratio))


def summarize(rows: Sequence[KernelRow]) -> list[KindSummary]:
    """Per kernel kind (in first-seen order): count, median ratio, worst ratio and entry."""
    kinds: dict[str, list[KernelRow]] = {}
    for row in rows:
        kinds.setdefault(row.kind, []).append(row)
    out = []
    for kind, group in kinds.items():
        worst = max(group, key=lambda r: _log_dev(r.ratio))
        out.append(
            KindSummary(
                kind=kind,
                count=len(group),
                median_ratio=statistics.median(r.ratio for r in group),
                worst_ratio=worst.ratio,
                worst_entry=worst.entry,
            )
        )
    return out


def _rate(value: float) -> str:
    return f"{value:.4g}"


def format_rows(rows: Sequence[KernelRow]) -> str:
    """One line per measured kernel: rates, times and the ratio."""
    lines = [
        f"{'kind':<22} {'entry':<22} {'unit':<8} {'measured':>10} {'model':>10} "
        f"{'measured_us':>12} {'model_us':>12} {'ratio':>7}"
    ]
    for r in rows:
        lines.append(
            f"{r.kind:<22} {r.entry:<22} {r.unit:<8} {_rate(r.measured_rate):>10} "
            f"{_rate(r.model_rate):>10} {r.measured_s * 1e6:>12.2f} {r.model_s * 1e6:>12.2f} "
            f"{r.ratio:>7.3f}"
        )
    return "\n".join(lines)


def format_summary(summary: Sequence[KindSummary]) -> str:
    """One line per kernel kind: median and worst measured / model time ratio."""
    lines = [f"{'kind':<22} {'n':>4} {'median':>7} {'worst':>7}  worst at"]
    for s in summary:
        lines.append(
            f"{s.kind:<22} {s.count:>4} {s.median_ratio:>7.3f} {s.worst_ratio:>7.3f}  "
            f"{s.worst_entry}"
        )
    return "\n".join(lines)


def write_csv(path: str | Path, rows: Sequence[KernelRow], header: Sequence[str] = ()) -> Path:
    """The rows as CSV (:data:`CSV_COLUMNS`), after ``# `` comment lines of ``header``."""
    out = Path(path)
    with out.open("w", newline="") as fh:
        for line in header:
            fh.write(f"# {line}\n")
        writer = csv.writer(fh)
        writer.writerow(CSV_COLUMNS)
        for r in rows:
            writer.writerow(
                [
                    r.kind,
                    r.entry,
                    r.unit,
                    f"{r.measured_rate:.6g}",
                    f"{r.model_rate:.6g}",
                    f"{r.measured_s:.6e}",
                    f"{r.model_s:.6e}",
                    f"{r.ratio:.6f}",
                ]
            )
    return out
