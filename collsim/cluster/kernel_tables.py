"""The kernel tables a device profile measured (``measured:`` in a device file): GEMM rates by
shape, attention rates, memory bandwidth by size, the optimizer step, launch and host costs and
the MLP activation, as ``collsim validate compute`` writes them; with the log-log interpolation
they and the published attention tables of :mod:`collsim.workload.kernels` are read with.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from collsim.core.errors import ConfigError
from collsim.core.schema import Anything, ListOf, Section, Value, read_described

if TYPE_CHECKING:
    from collsim.core.yamlio import ConfigReader

__all__ = ["MEASURED", "MeasuredTables", "interp_log_extrapolated"]


def interp_log_extrapolated(
    xs: Sequence[float], ys: Sequence[float | None], x: float
) -> float | None:
    """``y`` at ``x`` from the columns ``xs`` (``None``: a hidden value, skipped), linear in
    (log x, log y) between them and extrapolated beyond them from the two nearest, clamped to
    within 2x of the nearest figure (the published attention tables,
    :mod:`collsim.workload.kernels`); None: no value."""
    pts = [(math.log(a), math.log(b)) for a, b in zip(xs, ys, strict=True) if b]
    if not pts:
        return None
    if len(pts) == 1:
        return math.exp(pts[0][1])
    lx = math.log(x)
    if lx <= pts[0][0]:
        (x0, y0), (x1, y1) = pts[0], pts[1]
        nearest = y0
    elif lx >= pts[-1][0]:
        (x0, y0), (x1, y1) = pts[-2], pts[-1]
        nearest = y1
    else:
        for (x0, y0), (x1, y1) in zip(pts, pts[1:], strict=False):  # noqa: B007 (used after the break)
            if x0 <= lx <= x1:
                break
        nearest = None
    y = y0 + (y1 - y0) * (lx - x0) / (x1 - x0)
    if nearest is not None:
        y = min(max(y, nearest - math.log(2.0)), nearest + math.log(2.0))
    return math.exp(y)


def _log_interp(points: Sequence[tuple[float, float]], x: float) -> float:
    """``y`` at ``x`` from sorted ``(x, y)`` points, linear in (log x, log y) between them,
    the end values outside (a measured table is not extrapolated, unlike the published
    attention tables, :func:`interp_log_extrapolated`)."""
    if x <= points[0][0]:
        return points[0][1]
    if x >= points[-1][0]:
        return points[-1][1]
    for (x0, y0), (x1, y1) in zip(points, points[1:], strict=False):
        if x0 <= x <= x1:
            t = (math.log(x) - math.log(x0)) / (math.log(x1) - math.log(x0)) if x1 > x0 else 0.0
            return math.exp(math.log(y0) + t * (math.log(y1) - math.log(y0)))
    return points[-1][1]


MEASURED = Section(
    nullable=False,
    description="Kernel tables of a measured profile (collsim validate compute).",
    fields={
        "gemm": ListOf(items=None, description="[m, n, k, dtype, flops_per_s] rows."),
        "attention": ListOf(items=None, description="Attention kernel rows."),
        "bandwidth": ListOf(items=None, description="[bytes, bytes_per_s] rows."),
        "optimizer_bytes_per_s": Value(kind="number", description="Optimizer rate."),
        "launch_us": Value(kind="number", description="Kernel launch cost, us."),
        "host_us": Value(kind="number", description="Host cost per op, us."),
        "gemm_reach": Value(
            kind="number",
            exclusive_minimum=1,
            description="GEMM rows price shapes within this factor in every dimension; "
            "farther ones get the device's own figures (absent: the nearest rows).",
        ),
        "activation": ListOf(
            items=None, description="[kind, elements, fwd_gelem_s, bwd_gelem_s] rows."
        ),
        "notes": Anything(description="Free notes."),
        "concurrent_slowdown": Value(
            kind="number",
            minimum=1,
            default=1.0,
            description="Slowdown of compute kernels beside other busy cores.",
        ),
        "concurrent_memory_slowdown": Value(
            kind="number",
            minimum=1,
            description="Slowdown of memory-bound kernels beside other busy cores "
            "(absent: concurrent_slowdown).",
        ),
    },
)
"""The keys of a device file's ``measured:`` mapping (:data:`collsim.cluster.hardware.DEVICE`
holds it), read by :meth:`MeasuredTables.from_reader`."""


@dataclass(frozen=True, slots=True)
class MeasuredTables:
    """Kernel tables of a device profile (``measured:`` in a device file), written by
    ``collsim validate compute`` and read by the compute model in place of the catalogue
    figures where they cover an op:

    - ``gemm``: rows ``[m, n, k, dtype, tflops]`` timed on the device; a GEMM's rate is the
      rate of the nearest measured shape in log (m, n, k) space of that dtype (no shape of the
      model being predicted needs to be in the grid); with ``gemm_reach`` (a profile learned
      from a trace, whose rows are only the shapes it ran) a shape farther than that factor in
      some dimension from every row gets no measured rate: the device's own figures price it;
    - ``attention``: rows ``[kernel, causal, head_dim, seq, fwd_tflops, bwd_tflops]``, read
      like the published tables (log-log interpolation in seq, log in head dim);
    - ``bandwidth``: rows ``[size_bytes, gbps]`` of memory-bound kernels; a kernel's
      bandwidth is interpolated in log size;
    - ``optimizer_bytes_per_s``: the measured optimizer step's bytes / time (fused Adam/SGD);
    - ``launch_us``, ``host_us``: the per-kernel floor and the per-op host cost measured;
    - ``activation``: rows ``[kind, elements, fwd_gelem_per_s, bwd_gelem_per_s]`` of the MLP
      activation (``gelu``: exact erf GELU; ``swiglu``: SiLU(a) x b), timed as the eager
      kernels run it; a rate is interpolated in log elements. Exact GELU is not memory-bound
      on a CPU (its erf costs tens of instructions per element; docs/derivations.md,
      measurements).
    """

    gemm: tuple[tuple[int, int, int, str, float], ...] = ()
    attention: tuple[tuple[str, bool, int, int, float, float], ...] = ()
    bandwidth: tuple[tuple[float, float], ...] = ()
    optimizer_bytes_per_s: float | None = None
    launch_us: float | None = None
    host_us: float | None = None
    extra: dict[str, Any] = field(default_factory=dict)
    activation: tuple[tuple[str, float, float, float], ...] = ()

    @classmethod
    def from_reader(cls, reader: ConfigReader) -> MeasuredTables:
        """The tables of a ``measured:`` mapping, its keys read as :data:`MEASURED` describes
        them; the rules between keys (a row's shape, the memory slowdown's default) are here.
        A described key that is not a table goes to :attr:`extra` under its own name."""
        values = read_described(reader, MEASURED)
        gemm_rows = values.pop("gemm", ())
        att_rows = values.pop("attention", ())
        bw_rows = values.pop("bandwidth", ())
        opt = values.pop("optimizer_bytes_per_s", None)
        launch = values.pop("launch_us", None)
        host = values.pop("host_us", None)
        act_rows = values.pop("activation", ())
        extra = dict(reader.get("notes", dict, default={}))
        extra.update(values)
        # a profile from before the split measured one mix of both kinds: it serves for both
        extra["concurrent_memory_slowdown"] = values.get(
            "concurrent_memory_slowdown", values["concurrent_slowdown"]
        )
        reader.finish()
        try:
            gemm = tuple(
                (int(r[0]), int(r[1]), int(r[2]), str(r[3]), float(r[4])) for r in gemm_rows
            )
            att = tuple(
                (str(r[0]), bool(r[1]), int(r[2]), int(r[3]), float(r[4]), float(r[5]))
                for r in att_rows
            )
            bw = tuple(sorted((float(r[0]), float(r[1])) for r in bw_rows))
            act = tuple(
                sorted((str(r[0]), float(r[1]), float(r[2]), float(r[3])) for r in act_rows)
            )
        except (TypeError, ValueError, IndexError) as exc:
            raise reader.error(f"malformed table row ({exc})") from None
        for row in act:
            if row[1] <= 0 or row[2] <= 0 or row[3] <= 0:
                raise reader.error(f"activation row {list(row)}: elements and rates must be > 0")
        return cls(gemm, att, bw, opt, launch, host, dict(extra), act)

    def shared(self, factor: float, memory_factor: float | None = None) -> MeasuredTables:
        """The tables of a rank that gets 1/``factor`` of the cores the profile was timed on:
        the compute rates (GEMMs, attention, the activation) divided by ``factor``, the host
        cost multiplied by it, and the memory-bound rates (bandwidth, optimizer) divided by
        ``memory_factor`` (default ``factor``)."""
        mem = factor if memory_factor is None else memory_factor
        for key, value in (("cpu_share", factor), ("cpu_share_memory", mem)):
            if value <= 0:
                raise ConfigError(f"must be > 0, got {value}", key_path=key)
        return MeasuredTables(
            gemm=tuple((m, n, k, d, r / factor) for m, n, k, d, r in self.gemm),
            attention=tuple(
                (a, c, d, s, f / factor, b / factor) for a, c, d, s, f, b in self.attention
            ),
            bandwidth=tuple((x, y / mem) for x, y in self.bandwidth),
            optimizer_bytes_per_s=None
            if self.optimizer_bytes_per_s is None
            else self.optimizer_bytes_per_s / mem,
            launch_us=None if self.launch_us is None else self.launch_us * factor,
            host_us=None if self.host_us is None else self.host_us * factor,
            extra=dict(self.extra, cpu_share=factor, cpu_share_memory=mem),
            activation=tuple((k, e, f / factor, b / factor) for k, e, f, b in self.activation),
        )

    def activation_time_s(self, kind: str, elements: float, phase: str) -> float | None:
        """Seconds of the ``kind`` activation (``gelu`` / ``swiglu``) over ``elements`` in
        ``phase`` (``forward`` / ``backward``) at the measured rate, interpolated in log
        elements (the end rates outside the measured range); None: not measured."""
        rows = [(e, f if phase == "forward" else b) for k, e, f, b in self.activation if k == kind]
        if not rows or elements <= 0:
            return None
        rate = _log_interp(rows, elements)
        return elements / (rate * 1e9)

    def gemm_rate(self, m: int, n: int, k: int, dtype: str) -> float | None:
        """FLOP/s of the nearest measured GEMM shape (log distance) of ``dtype``; None when
        there is none, or none within ``gemm_reach`` (when the profile sets it)."""
        rows = [r for r in self.gemm if r[3] == dtype] or [r for r in self.gemm]
        if not rows:
            return None
        lm, ln, lk = math.log(m), math.log(n), math.log(k)
        reach = self.extra.get("gemm_reach")
        if reach is not None:
            lim = math.log(float(reach))
            if not any(
                max(abs(math.log(r[0]) - lm), abs(math.log(r[1]) - ln), abs(math.log(r[2]) - lk))
                <= lim
                for r in rows
            ):
                return None  # no row near: the device's own figures price it

        def dist(r: tuple[int, int, int, str, float]) -> float:
            return (
                (math.log(r[0]) - lm) ** 2 + (math.log(r[1]) - ln) ** 2 + (math.log(r[2]) - lk) ** 2
            )

        best = sorted(rows, key=dist)[:4]
        # inverse-distance weighting of the nearest four, in log rate
        weights = [1.0 / (dist(r) + 1e-6) for r in best]
        lr = sum(w * math.log(r[4]) for w, r in zip(weights, best, strict=True)) / sum(weights)
        return math.exp(lr) * 1e12

    def bandwidth_bps(self, size_bytes: float) -> float | None:
        """Bytes/s of a memory-bound kernel moving ``size_bytes`` (log-size interpolation)."""
        if not self.bandwidth:
            return None
        return _log_interp(self.bandwidth, size_bytes) * 1e9

    def attention_rate(
        self, kernel: str, phase: str, *, causal: bool, head_dim: int, seq_len: int
    ) -> float | None:
        """FLOP/s of ``kernel`` in ``phase`` from the measured rows (None: not measured)."""
        rows = [r for r in self.attention if r[0] == kernel and r[1] == causal]
        if not rows:
            rows = [r for r in self.attention if r[0] == kernel]
        if not rows:
            return None
        dims = sorted({r[2] for r in rows})
        d = min(dims, key=lambda x: abs(math.log(x) - math.log(head_dim)))
        sel = sorted((r[3], r[4] if phase == "fwd" else r[5]) for r in rows if r[2] == d)
        rate = interp_log_extrapolated([s for s, _ in sel], [v for _, v in sel], seq_len)
        return None if rate is None else rate * 1e12
