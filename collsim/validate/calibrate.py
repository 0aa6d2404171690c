"""Fit a topology to measured collectives: link latency and bandwidth, and per op the algorithm,
a fixed overhead and an efficiency, so that collsim's own cost formula reproduces the times.

Derivations, measurements and sources: docs/derivations.md, ``collsim.validate.calibrate``.
"""

from __future__ import annotations

import itertools
import json
import math
import statistics
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import yaml

from collsim.cluster.topology import load_topology, parse_topology, resolve_topology_path
from collsim.collectives import Group, cost, phases_for, supported
from collsim.core.errors import ConfigError
from collsim.core.vocab import Algorithm, CollectiveOp
from collsim.core.yamlio import load_yaml
from collsim.validate.dataset import Measurements

__all__ = [
    "OpFit",
    "Calibration",
    "fit_line",
    "fit_hinge",
    "fit_two_regime",
    "select_rows",
    "calibrate",
    "topology_yaml",
    "write_topology",
    "SUBSETS",
    "KNEE_ALPHA",
    "best_knee",
    "KNEE_GRID_PER_OCTAVE",
    "knee_candidates",
    "f_critical",
]

#: ``all`` sizes, or every other power of two: ``even`` (2^10, 2^12, ...) or ``odd``.
SUBSETS = ("all", "even", "odd")

#: A knee is kept only if the F-test of hinge against line rejects the line at this level.
KNEE_ALPHA = 0.05

#: Knee positions tried per factor of two in size (a geometric grid).
KNEE_GRID_PER_OCTAVE = 16

_PROBE_LATENCY_S = 1e-6
_PROBE_BANDWIDTH_BPS = 1e9


@dataclass(frozen=True, slots=True, kw_only=True)
class OpFit:
    """The fit of one op."""

    op: str
    algorithm: str
    intercept_s: float
    """a of time = a + b x size."""
    seconds_per_byte: float
    """b of time = a + b x size."""
    overhead_s: float
    efficiency: float
    latency_steps: float
    """k_lat: link latencies paid per collective under the algorithm."""
    bytes_factor: float
    """k_bw: bytes on the busiest link per byte of size under the algorithm."""
    num_points: int
    fit_median_abs_error: float
    """Median |relative residual| of the fitted model (line, or line with its knee) on the
    points it was fitted to."""
    kernels: tuple[str, ...] = ()
    line_median_abs_error: float = 0.0
    """The same for the plain line (what the knee had to halve)."""
    knee_bytes: float | None = None
    """K of the second regime, or None (one line)."""
    extra_seconds_per_byte: float = 0.0
    """c: added to b for every byte above the knee."""
    knee_efficiency: float | None = None
    """The op's efficiency for the bytes above the knee (<= ``efficiency``)."""


@dataclass
class Calibration:
    """A fitted topology: link latency and bandwidth, and per-op fits."""

    world_size: int
    ranks_per_node: int
    link_latency_s: float
    link_bandwidth_bps: float
    ops: dict[str, OpFit]
    base: str
    subset: str
    source: str
    metadata: dict[str, Any] = field(default_factory=dict)
    notes: list[str] = field(default_factory=list)


def _log2_parity(size_bytes: int) -> int | None:
    """0 for even powers of two, 1 for odd, None for sizes that are not near a power of two."""
    if size_bytes <= 0:
        return None
    exp = math.log2(size_bytes)
    nearest = round(exp)
    # Split ops round the count down to a multiple of n: still within 1% of the power of two.
    if abs(size_bytes - 2**nearest) > 0.01 * 2**nearest:
        return None
    return nearest % 2


def select_rows(
    rows: list[dict[str, Any]],
    subset: str = "all",
    *,
    min_bytes: int = 0,
    max_bytes: int | None = None,
    ops: tuple[str, ...] | None = None,
) -> list[dict[str, Any]]:
    """Rows whose size is in ``subset`` and [min_bytes, max_bytes], for ``ops`` (all if None).

    Raises:
        ConfigError: unknown subset.
    """
    if subset not in SUBSETS:
        raise ConfigError(
            f"must be one of {', '.join(SUBSETS)}; got {subset!r}", key_path="--subset"
        )
    out = []
    for row in rows:
        size = int(row["size_bytes"])
        if size < min_bytes or (max_bytes is not None and size > max_bytes):
            continue
        if ops is not None and row["op"] not in ops:
            continue
        if subset != "all":
            parity = _log2_parity(size)
            if parity is None or parity != (0 if subset == "even" else 1):
                continue
        out.append(row)
    return out


def _fit_arrays(
    sizes_bytes: list[float], times_s: list[float], minimum: int, what: str
) -> tuple[Any, Any]:
    """Sizes and times as float arrays, checked: at least ``minimum`` points, times > 0."""

    if len(sizes_bytes) < minimum:
        raise ConfigError(f"need at least {minimum} sizes to fit {what}, got {len(sizes_bytes)}")
    s = np.asarray(sizes_bytes, dtype=float)
    t = np.asarray(times_s, dtype=float)
    if not np.isfinite(t).all() or (t <= 0).any():
        raise ConfigError("measured times must be finite numbers > 0")
    return s, t


def _huber_weights(resid: Any) -> Any | None:
    """IRLS weights (square roots of Huber's) for relative residuals; None when they are all 0.

    k = 1.345 robust sigmas, sigma = 1.4826 x median |residual| (Holland & Welsch 1977).
    """

    sigma = 1.4826 * float(np.median(np.abs(resid)))
    if sigma <= 0:
        return None
    k = 1.345 * sigma
    return np.sqrt(np.minimum(1.0, k / np.maximum(np.abs(resid), 1e-300)))


def fit_line(
    sizes_bytes: list[float], times_s: list[float], *, iterations: int = 20
) -> tuple[float, float, float]:
    """Robust fit of time = a + b x size minimising relative residuals; a >= 0, b > 0.

    Iteratively reweighted least squares with Huber weights (k = 1.345 robust sigmas, sigma
    from the median absolute residual), as in Huber 1964 / Holland & Welsch 1977.

    Returns:
        ``(a, b, median |relative residual|)``.

    Raises:
        ConfigError: fewer than two points, or a non-positive time.
    """

    s, t = _fit_arrays(sizes_bytes, times_s, 2, "a line")
    weights = np.ones_like(t)

    def solve(w: Any) -> tuple[float, float]:
        rows = np.stack([w / t, w * s / t], axis=1)
        (a, b), *_ = np.linalg.lstsq(rows, w, rcond=None)
        if a < 0:  # through the origin
            a = 0.0
            b = float(np.sum(w * w * s / t) / np.sum((w * s / t) ** 2))
        if b <= 0:  # flat: all latency
            b = 1e-18
            a = float(np.sum(w * w / t) / np.sum((w / t) ** 2))
        return float(a), float(b)

    a, b = solve(weights)
    for _ in range(iterations):
        resid = (a + b * s - t) / t
        weights = _huber_weights(resid)
        if weights is None:
            break
        a_new, b_new = solve(weights)
        if abs(a_new - a) <= 1e-12 * max(a, 1e-12) and abs(b_new - b) <= 1e-9 * b:
            a, b = a_new, b_new
            break
        a, b = a_new, b_new
    resid = np.abs((a + b * s - t) / t)
    return a, b, float(np.median(resid))


def _solve_nonnegative(rows: Any, target: Any) -> Any:
    """Least squares ``rows @ x ~ target`` with x >= 0 and x[1] > 0 (3 unknowns: a, b, c).

    Small enough to enumerate the active sets: every subset of {a, c} held at zero.
    """

    best: tuple[float, Any] | None = None
    for free in ((0, 1, 2), (1, 2), (0, 1), (1,)):
        cols = list(free)
        sol, *_ = np.linalg.lstsq(rows[:, cols], target, rcond=None)
        x = np.zeros(3)
        x[cols] = sol
        if (x < 0).any() or x[1] <= 0:
            continue
        loss = float(np.sum((rows @ x - target) ** 2))
        if best is None or loss < best[0]:
            best = (loss, x)
    if best is None:  # no admissible slope: all latency, as fit_line does
        x = np.zeros(3)
        x[1] = 1e-18
        x[0] = float(np.sum(rows[:, 0] * target) / np.sum(rows[:, 0] ** 2))
        return x
    return best[1]


def fit_hinge(
    sizes_bytes: list[float], times_s: list[float], knee_bytes: float, *, iterations: int = 20
) -> tuple[float, float, float, float]:
    """Robust fit of time = a + b x size + c x max(0, size - knee); a, c >= 0, b > 0.

    Relative residuals with Huber weights, as :func:`fit_line` (IRLS, Holland & Welsch 1977);
    for a fixed knee the model is linear in (a, b, c) (Hudson 1966, segmented regression).

    Returns:
        ``(a, b, c, median |relative residual|)``.

    Raises:
        ConfigError: fewer than three points, or a non-positive time.
    """

    s, t = _fit_arrays(sizes_bytes, times_s, 3, "a knee")
    h = np.maximum(0.0, s - knee_bytes)
    base = np.stack([1.0 / t, s / t, h / t], axis=1)
    weights = np.ones_like(t)
    x = _solve_nonnegative(base, weights)
    for _ in range(iterations):
        resid = base @ x - 1.0
        weights = _huber_weights(resid)
        if weights is None:
            break
        x_new = _solve_nonnegative(base * weights[:, None], weights)
        done = bool(np.allclose(x_new, x, rtol=1e-9, atol=0.0))
        x = x_new
        if done:
            break
    err = float(np.median(np.abs(base @ x - 1.0)))
    return float(x[0]), float(x[1]), float(x[2]), err


@dataclass(frozen=True, slots=True)
class RegimeFit:
    """The line of an op and, if it earned its place, a knee (see docs/derivations.md)."""

    intercept_s: float
    seconds_per_byte: float
    line_median_abs_error: float
    median_abs_error: float
    knee_bytes: float | None = None
    extra_seconds_per_byte: float = 0.0

    def time_s(self, size_bytes: float) -> float:
        """The fitted time of one size: a + b x size (+ c x max(0, size - knee))."""
        extra = (
            0.0
            if self.knee_bytes is None
            else self.extra_seconds_per_byte * max(0.0, size_bytes - self.knee_bytes)
        )
        return self.intercept_s + self.seconds_per_byte * size_bytes + extra


def knee_candidates(
    sizes_bytes: list[float], per_octave: int = KNEE_GRID_PER_OCTAVE
) -> list[float]:
    """Knee positions to try: a geometric grid of ``per_octave`` points per factor of two from
    the third-smallest distinct size up to (not including) the second-largest, so that every
    candidate leaves at least 3 sizes at or below it and 2 above. Empty below 5 sizes."""
    ordered = sorted(set(float(v) for v in sizes_bytes))
    if len(ordered) < 5:
        return []
    lo, hi = ordered[2], ordered[-2]
    steps = max(1, int(round(per_octave * math.log2(hi / lo))))
    return [lo * (hi / lo) ** (i / steps) for i in range(steps)]


def f_critical(d2: int, alpha: float) -> float:
    """Upper ``alpha`` quantile of the F distribution with (2, d2) degrees of freedom.

    Closed form: the CDF of F(2, d2) is 1 - (1 + 2x/d2)^(-d2/2) (e.g. Johnson, Kotz &
    Balakrishnan, Continuous Univariate Distributions vol. 2, ch. 27), so
    x = (d2/2) (alpha^(-2/d2) - 1).
    """
    if d2 < 1 or not 0 < alpha <= 1:
        raise ValueError(f"need d2 >= 1 and 0 < alpha <= 1, got {d2}, {alpha}")
    return d2 / 2.0 * (float(alpha ** (-2.0 / d2)) - 1.0)


def best_knee(
    sizes_bytes: list[float], times_s: list[float], *, line_median_abs_error: float = float("nan")
) -> tuple[float, RegimeFit] | None:
    """The hinge with the least sum of squared relative residuals over the knees of
    :func:`knee_candidates`, with that sum; None when no knee gets an extra slope > 0."""

    s = np.asarray(sizes_bytes, dtype=float)
    t = np.asarray(times_s, dtype=float)
    best: tuple[float, RegimeFit] | None = None
    for knee in knee_candidates(sizes_bytes):
        ha, hb, hc, herr = fit_hinge(sizes_bytes, times_s, knee)
        if hc <= 0:
            continue
        resid = (ha + hb * s + hc * np.maximum(0.0, s - knee) - t) / t
        loss = float(np.sum(resid * resid))
        if best is None or loss < best[0]:
            best = (loss, RegimeFit(ha, hb, line_median_abs_error, herr, knee, hc))
    return best


def fit_two_regime(
    sizes_bytes: list[float], times_s: list[float], *, alpha: float = KNEE_ALPHA
) -> RegimeFit:
    """The line, or the line with one knee when an F-test rejects the line at ``alpha``.

    Knees are tried on the grid of :func:`knee_candidates`; the one whose hinge has the smallest
    sum of squared relative residuals is tested against the line (see docs/derivations.md).

    Raises:
        ConfigError: fewer than two points, or a non-positive time.
    """

    a, b, err = fit_line(sizes_bytes, times_s)
    line = RegimeFit(a, b, err, err)
    s = np.asarray(sizes_bytes, dtype=float)
    t = np.asarray(times_s, dtype=float)
    rss_line = float(np.sum(((a + b * s - t) / t) ** 2))
    best = best_knee(sizes_bytes, times_s, line_median_abs_error=err)
    if best is None:
        return line
    rss_hinge, hinge = best
    gained = rss_line - rss_hinge
    if gained <= 1e-12 * max(rss_line, 1e-300) or gained <= 1e-24:
        return line  # no real improvement (an exact line, or round-off)
    d2 = len(s) - 4
    if rss_hinge <= 0.0:
        return hinge
    f_stat = (gained / 2.0) / (rss_hinge / d2)
    return hinge if f_stat > f_critical(d2, alpha) else line


def _probe_topology(base: str, ranks_per_node: int, num_nodes: int) -> Any:
    """The base topology with probe link figures, zero overhead and no per-op settings."""

    doc = load_yaml(resolve_topology_path(base))
    data = _probe_data(dict(doc.data))
    doc.data = data
    return parse_topology(doc, nodes=num_nodes, gpus_per_node=ranks_per_node)


def _probe_data(data: dict[str, Any]) -> dict[str, Any]:
    intra = dict(data["intra_node"])
    intra.update(
        bandwidth_gbps=_PROBE_BANDWIDTH_BPS / 1e9, latency_us=_PROBE_LATENCY_S * 1e6, efficiency=1.0
    )
    data["intra_node"] = intra
    coll = dict(data.get("collectives") or {})
    coll["overhead_us"] = 0.0
    coll.pop("ops", None)
    coll.pop("algorithms", None)
    data["collectives"] = coll
    return data


def _coefficients(topology: Any, op: str) -> dict[str, tuple[float, float]]:
    """(k_lat, k_bw) per algorithm that can run ``op`` on the whole topology (gloo: no NVLS)."""

    group = Group.all(topology)
    out: dict[str, tuple[float, float]] = {}
    for algorithm in supported(CollectiveOp(op)):
        if algorithm is Algorithm.NVLS:
            continue
        try:
            timing = phases_for(CollectiveOp(op), group, algorithm).timings[0]
        except ConfigError:
            continue  # not on this group
        out[algorithm.value] = (
            timing.latency_s / _PROBE_LATENCY_S,
            timing.seconds_per_byte * _PROBE_BANDWIDTH_BPS,
        )
    return out


#: What gloo runs when nothing else is known (gloo/allreduce.cc ring, allgather.cc ring,
#: alltoall.cc pairwise): ring for reductions and gathers, direct for all_to_all and send_recv.
PREFERRED = ("ring", "direct", "tree", "halving_doubling", "hierarchical")


def _preferred(op: str, options: dict[str, float]) -> str:
    for name in PREFERRED:
        if name in options:
            return name
    return next(iter(options))


def _world_size_of(meas: Measurements, rows: list[dict[str, Any]]) -> int:
    """The one world size of the selected rows; none of them may have wrong results."""
    sizes = {int(r["world_size"]) for r in rows}
    if len(sizes) != 1:
        raise ConfigError(
            f"need one world size per calibration, got {sorted(sizes)}", file=meas.path
        )
    bad = [r for r in rows if int(r.get("wrong", 0) or 0) > 0]
    if bad:
        raise ConfigError(
            f"{len(bad)} measured point(s) have wrong results "
            f"(e.g. {bad[0]['op']} {bad[0]['size_bytes']} B)",
            file=meas.path,
        )
    return sizes.pop()


def _chosen_algorithms(
    implied: dict[str, dict[str, float]], algorithms: dict[str, str] | None, n: int
) -> dict[str, str]:
    """Per op the pinned algorithm (checked against those that run it), else the preferred."""
    chosen: dict[str, str] = {}
    for op, options in implied.items():
        pinned = (algorithms or {}).get(op)
        if pinned is not None and pinned not in options:
            raise ConfigError(
                f"{pinned} cannot run {op} on {n} ranks; choose from {', '.join(options)}",
                key_path=f"--algorithm {op}",
            )
        chosen[op] = pinned or _preferred(op, options)
    return chosen


def _op_fit(
    op: str,
    alg: str,
    regime: RegimeFit,
    count: int,
    *,
    k_lat: float,
    k_bw: float,
    latency_s: float,
    efficiency: float,
    kernels: tuple[str, ...],
) -> OpFit:
    """One op's fit: its line (and knee) and what the shared link figures leave to it."""
    a, b, err = regime.intercept_s, regime.seconds_per_byte, regime.median_abs_error
    return OpFit(
        op=op,
        algorithm=alg,
        intercept_s=a,
        seconds_per_byte=b,
        overhead_s=max(0.0, a - k_lat * latency_s),
        efficiency=efficiency,
        latency_steps=k_lat,
        bytes_factor=k_bw,
        num_points=count,
        fit_median_abs_error=err,
        kernels=kernels,
        line_median_abs_error=regime.line_median_abs_error,
        knee_bytes=regime.knee_bytes,
        extra_seconds_per_byte=regime.extra_seconds_per_byte,
        knee_efficiency=(
            None
            if regime.knee_bytes is None
            else efficiency * b / (b + regime.extra_seconds_per_byte)
        ),
    )


def calibrate(
    meas: Measurements,
    *,
    base: str = "localhost",
    subset: str = "all",
    min_bytes: int = 0,
    max_bytes: int | None = None,
    algorithms: dict[str, str] | None = None,
    knees: bool = True,
    knee_alpha: float = KNEE_ALPHA,
) -> Calibration:
    """Fit the topology ``base`` to the measurements (see docs/derivations.md).

    Args:
        meas: measured points with metadata (one world size).
        base: topology file or name whose shape (interconnect, device) is kept.
        subset: sizes to fit on: ``all``, ``even`` or ``odd`` powers of two.
        min_bytes: ignore smaller sizes.
        max_bytes: ignore larger sizes.
        algorithms: pin the algorithm of some ops (``{"broadcast": "tree"}``).
        knees: allow an op a knee (second regime) when it earns it; False: one line per op.
        knee_alpha: significance level of the F-test a knee must pass.

    Raises:
        ConfigError: mixed world sizes, an op with fewer than two sizes, or wrong results in
            the data (a measurement with #wrong > 0 is not a measurement).
    """
    rows = select_rows(meas.rows, subset, min_bytes=min_bytes, max_bytes=max_bytes)
    n = _world_size_of(meas, rows)
    ranks_per_node = int(meas.metadata.get("ranks_per_node", n))
    num_nodes = max(1, n // ranks_per_node)
    probe = _probe_topology(base, ranks_per_node, num_nodes)
    kernels = meas.metadata.get("kernels") or {}
    regimes: dict[str, RegimeFit] = {}
    coeffs: dict[str, dict[str, tuple[float, float]]] = {}
    counts: dict[str, int] = {}
    for op in [o for o in meas.ops() if any(r["op"] == o for r in rows)]:
        pts = [r for r in rows if r["op"] == op]
        sizes_b = [float(r["size_bytes"]) for r in pts]
        times = [float(r["time_us"]) * 1e-6 for r in pts]
        if knees:
            fit = fit_two_regime(sizes_b, times, alpha=knee_alpha)
        else:
            a, b, err = fit_line(sizes_b, times)
            fit = RegimeFit(a, b, err, err)
        regimes[op] = fit
        counts[op] = len(pts)
        coeffs[op] = _coefficients(probe, op)
    if not regimes:
        raise ConfigError("no measured points in the selected sizes", file=meas.path)
    implied = {
        op: {alg: kb / regimes[op].seconds_per_byte for alg, (_, kb) in algs.items()}
        for op, algs in coeffs.items()
    }
    chosen = _chosen_algorithms(implied, algorithms, n)
    bandwidth = max(implied[op][chosen[op]] for op in chosen)
    with_steps = [
        regimes[op].intercept_s / coeffs[op][chosen[op]][0]
        for op in chosen
        if coeffs[op][chosen[op]][0] > 0
    ]
    latency = min(with_steps) if with_steps else 0.0
    fits: dict[str, OpFit] = {}
    for op, alg in chosen.items():
        k_lat, k_bw = coeffs[op][alg]
        fits[op] = _op_fit(
            op,
            alg,
            regimes[op],
            counts[op],
            k_lat=k_lat,
            k_bw=k_bw,
            latency_s=latency,
            efficiency=min(1.0, implied[op][alg] / bandwidth),
            kernels=tuple(kernels.get(op, ())),
        )
    notes = _notes(fits, kernels)
    return Calibration(
        world_size=n,
        ranks_per_node=ranks_per_node,
        link_latency_s=latency,
        link_bandwidth_bps=bandwidth,
        ops=fits,
        base=base,
        subset=subset,
        source=meas.path,
        metadata=dict(meas.metadata),
        notes=notes,
    )


def _notes(fits: dict[str, OpFit], kernels: dict[str, list[str]]) -> list[str]:
    notes = []
    for op, names in kernels.items():
        ran = sorted({name.split(":", 1)[-1] for name in names})
        if (
            op in ("reduce_scatter", "all_gather", "broadcast", "all_reduce", "all_to_all")
            and ran
            and op not in ran
        ):
            notes.append(
                f"{op}: the backend ran {', '.join(names)} (the profiler shows no "
                f"{op} kernel), so its fitted efficiency covers that extra traffic"
            )
    if "reduce_scatter" in fits and "all_reduce" in fits:
        rs, ar = fits["reduce_scatter"], fits["all_reduce"]
        notes.append(
            f"reduce_scatter takes {rs.seconds_per_byte / ar.seconds_per_byte:.2f} x "
            f"all_reduce's time per byte of the same input"
        )
    return notes


def _yaml_float(value: float) -> str:
    """``value`` to 6 significant digits as YAML reads a float back: ``5e+08`` is a string to
    YAML 1.1 (PyYAML), ``5.0e+08`` a number."""
    text = f"{value:.6g}"
    if "e" in text and "." not in text:
        text = text.replace("e", ".0e")
    return text


def topology_yaml(cal: Calibration, name: str) -> str:
    """The calibrated topology as YAML text (the base file's shape, fitted figures)."""

    base = load_yaml(resolve_topology_path(cal.base)).data
    intra = dict(base["intra_node"])
    md = cal.metadata
    lines = [
        f"# Calibrated by `collsim validate calibrate` from {cal.source}",
        f"# measured: backend {md.get('backend')}, world size {cal.world_size}, "
        f"{cal.ranks_per_node} ranks per node, torch {md.get('torch_version')}, "
        f"host {md.get('host')}, {md.get('date')}",
        f"# fitted on sizes: {cal.subset}; per op: time = overhead + steps x latency "
        f"+ size x bytes_factor / (bandwidth x efficiency)",
    ]
    if any(fit.knee_bytes is not None for fit in cal.ops.values()):
        lines.append("# with a knee: the bytes above knee_bytes at knee_efficiency instead")
    lines += [f"# note: {note}" for note in cal.notes]
    lines += [
        f"name: {name}",
        f"description: {json.dumps(str(base.get('description', '')) + ' (calibrated)')}",
        f"device: {base['device']}",
        f"nodes: {max(1, cal.world_size // cal.ranks_per_node)}",
        f"gpus_per_node: {cal.ranks_per_node}",
        "intra_node:",
        f"  interconnect: {intra['interconnect']}",
        f"  bandwidth_gbps: {_yaml_float(cal.link_bandwidth_bps / 1e9)}",
        "  efficiency: 1.0",
        f"  latency_us: {_yaml_float(cal.link_latency_s * 1e6)}",
        f"  nvls: {str(bool(intra.get('nvls', False))).lower()}",
    ]
    if "host" in base:
        lines += ["host:", f"  bandwidth_gbps: {base['host'].get('bandwidth_gbps', 32.0)}"]
    overheads = [f.overhead_s for f in cal.ops.values()]
    library = (base.get("collectives") or {}).get("library", "gloo")
    lines += [
        "collectives:",
        f"  library: {library}",
        f"  overhead_us: {_yaml_float(min(overheads) * 1e6)}",
        "  algorithms:",
    ]
    lines += [f"    {op}: {fit.algorithm}" for op, fit in cal.ops.items()]
    lines.append("  ops:")
    for op, fit in cal.ops.items():
        kern = f"  # ran {', '.join(fit.kernels)}" if fit.kernels else ""
        knee = ""
        if fit.knee_bytes is not None and fit.knee_efficiency is not None:
            knee_eff = _yaml_float(fit.knee_efficiency)
            knee = f", knee_bytes: {fit.knee_bytes:.0f}, knee_efficiency: {knee_eff}"
        lines.append(
            f"    {op}: {{overhead_us: {_yaml_float(fit.overhead_s * 1e6)}, "
            f"efficiency: {_yaml_float(fit.efficiency)}{knee}}}{kern}"
        )
    return "\n".join(lines) + "\n"


def write_topology(cal: Calibration, path: str | Path, name: str | None = None) -> Path:
    """Write the calibrated topology and check that it loads back."""

    out = Path(path)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(topology_yaml(cal, name or out.stem))
    load_topology(out)
    return out


# ----------------------------------------------------------- multi-node (NCCL) calibration

#: Figures a fabric calibration fits, by stage: one-node data fit the NVLink (or PCIe) link
#: and the library's fixed cost; multi-node data fit the NICs. Each is a (section, key) of the
#: topology file.
INTRA_PARAMETERS = (
    ("intra_node", "efficiency"),
    ("intra_node", "latency_us"),
    ("collectives", "overhead_us"),
)
NETWORK_PARAMETERS = (("nics", "efficiency"), ("nics", "latency_us"))
#: The transport's own terms (collsim.cluster.transports), fitted on multi-node data where the
#: base's
#: transport has them (a plugin latency or a completion cost: EFA, TCPXO); InfiniBand's and
#: RoCE's are NCCL's own NET row, which the fit leaves to the links.
TRANSPORT_PARAMETERS = (("fabric", "net_latency_us"), ("fabric", "completion_us"))

#: Significance of the F-test that lets fitted transport terms replace the base's.
TRANSPORT_ALPHA = 0.05

#: Start grids of the transport stage, us (search grids, not figures of a machine).
FABRIC_START_NET_LATENCIES_US = (3.0, 30.0, 100.0)
FABRIC_START_COMPLETIONS_US = (1.0, 10.0, 100.0)

#: A term is decided by the data when moving it by ``DECIDED_STEP`` (relative: an efficiency
#: down, a latency or cost up, by ``DECIDED_FLOOR_US`` at least) moves some point's simulated
#: time by at least ``DECIDED_SHIFT``; a term that moves none is kept at the base's figure and
#: reported so.
DECIDED_STEP = 0.10
DECIDED_FLOOR_US = 1.0
DECIDED_SHIFT = 0.005

#: Relative residual at which the loss turns from quadratic to linear (pseudo-Huber on the
#: log ratio): a few points far off (a congested size) do not drag the rest.
FABRIC_HUBER_DELTA = 0.05

#: Evaluations of the simplex search per stage (each evaluates every point once).
FABRIC_MAX_EVALUATIONS = 240

#: Restarts of the simplex from its best point (a simplex that has collapsed along a kink of
#: the loss, where a latency floor switches, stops early; a new one moves on).
FABRIC_RESTARTS = 6

#: Efficiencies and latencies each staged search also starts from, every combination with
#: the base's figures added (search grids, not figures of a machine); the
#: ``FABRIC_STARTS_KEPT`` starts with the lowest loss are searched from.
FABRIC_START_EFFICIENCIES = (0.3, 0.4, 0.5, 0.6, 0.7, 0.8, 0.9)
FABRIC_START_LATENCIES_US = (1.0, 3.0, 10.0)
FABRIC_STARTS_KEPT = 4

#: Device names in nccl-tests' rank lines -> the shipped topology of that machine.
_DEVICE_BASES = (
    ("H200", "dgx_h200"),
    ("H100", "dgx_h100"),
    ("B200", "dgx_b200"),
    ("A100", "dgx_a100"),
)


def base_for_device(device: str) -> str | None:
    """The shipped topology for a GPU named as nccl-tests prints it (``NVIDIA H100 80GB
    HBM3`` -> ``dgx_h100``), or None."""
    for needle, base in _DEVICE_BASES:
        if needle in device.upper():
            return base
    return None


@dataclass
class FileFit:
    """How the fitted topology reproduces one input file."""

    path: str
    nodes: int
    ranks: int
    points: int
    median_abs_error_before: float
    median_abs_error: float
    max_abs_error: float
    by_choice: dict[str, tuple[int, float]]
    """Per (algorithm/protocol) the simulator chose: points and median |error| after the fit."""


@dataclass
class FabricCalibration:
    """A fitted multi-node topology: the base file with fitted link figures."""

    base: str
    values: dict[str, float]
    """``section.key`` -> fitted value."""
    fitted: list[str]
    """The keys fitted (a stage without data leaves its keys at the base's values)."""
    decided: list[str]
    """The fitted keys the data decided; the others are the base's figures (see notes)."""
    data: dict[str, Any]
    """The topology document (the base's, with the fitted values)."""
    files: list[FileFit]
    nodes: int
    gpus_per_node: int
    notes: list[str] = field(default_factory=list)


def _fabric_data(base_data: dict[str, Any], values: dict[str, float]) -> dict[str, Any]:
    data = {k: (dict(v) if isinstance(v, dict) else v) for k, v in base_data.items()}
    for dotted, value in values.items():
        section, key = dotted.split(".")
        data.setdefault(section, {})[key] = value
    if "fabric.completion_us" in values:  # the Simple step is 2 x latency + completion then
        data["fabric"].pop("net_simple_latency_us", None)
    return data


def _encode(key: str, value: float) -> float:
    """Search coordinate of a figure: the logit of an efficiency, a latency in us as it is
    (decoded as its absolute value, so that the search space has no edge and no flat part)."""
    if key.endswith("efficiency"):
        v = min(max(value, 1e-4), 1 - 1e-6)
        return math.log(v / (1 - v))
    return value


def _decode(key: str, x: float) -> float:
    if key.endswith("efficiency"):
        return 1.0 / (1.0 + math.exp(-max(min(x, 50.0), -50.0)))
    return abs(x)


def _steps(keys: list[str], x0: list[float]) -> list[float]:
    """First simplex steps: 0.5 in logit, or half a latency (at least 0.5 us)."""
    return [0.5 if k.endswith("efficiency") else max(0.5, 0.5 * abs(x)) for k, x in zip(keys, x0)]


def nelder_mead(
    fun: Any, x0: list[float], *, steps: list[float] | None = None, max_evaluations: int = 240
) -> tuple[list[float], float]:
    """Minimise ``fun`` from ``x0`` by the downhill simplex (Nelder & Mead 1965, with the
    standard coefficients: reflection 1, expansion 2, contraction 0.5, shrink 0.5).

    Returns:
        The best point and its value.
    """

    n = len(x0)
    simplex = [np.asarray(x0, dtype=float)]
    for i in range(n):
        p = np.asarray(x0, dtype=float).copy()
        p[i] += 0.5 if steps is None else steps[i]
        simplex.append(p)
    values = [float(fun(p)) for p in simplex]
    evaluations = n + 1
    while evaluations < max_evaluations:
        order = np.argsort(values)
        simplex = [simplex[i] for i in order]
        values = [values[i] for i in order]
        if abs(values[-1] - values[0]) <= 1e-10 * (abs(values[0]) + 1e-12):
            break
        centroid = np.mean(simplex[:-1], axis=0)
        reflected = centroid + (centroid - simplex[-1])
        f_r = float(fun(reflected))
        evaluations += 1
        if f_r < values[0]:
            expanded = centroid + 2.0 * (centroid - simplex[-1])
            f_e = float(fun(expanded))
            evaluations += 1
            simplex[-1], values[-1] = (expanded, f_e) if f_e < f_r else (reflected, f_r)
        elif f_r < values[-2]:
            simplex[-1], values[-1] = reflected, f_r
        else:
            inside = f_r >= values[-1]
            target = simplex[-1] if inside else reflected
            contracted = centroid + 0.5 * (target - centroid)
            f_c = float(fun(contracted))
            evaluations += 1
            if f_c < min(f_r, values[-1]):
                simplex[-1], values[-1] = contracted, f_c
            else:
                for i in range(1, n + 1):
                    simplex[i] = simplex[0] + 0.5 * (simplex[i] - simplex[0])
                    values[i] = float(fun(simplex[i]))
                evaluations += n
    best = int(np.argmin(values))
    return [float(v) for v in simplex[best]], values[best]


def _points(meas: Measurements) -> list[tuple[str, int, float]]:
    out = []
    for row in meas.rows:
        if int(row.get("wrong", 0) or 0) > 0:
            raise ConfigError(
                f"{row['op']} {row['size_bytes']} B has #wrong {row['wrong']}: wrong results "
                "are not a measurement",
                file=meas.path,
            )
        out.append((str(row["op"]), int(row["size_bytes"]), float(row["time_us"]) * 1e-6))
    return out


def _simulate_files(
    base_doc: Any, values: dict[str, float], files: list[Measurements]
) -> list[list[tuple[float, str]]]:
    """Simulated (time, algorithm/protocol) of every point of every file."""

    data = _fabric_data(base_doc.data, values)
    doc = type(base_doc)(data=data, file=base_doc.file, lines=base_doc.lines)
    groups: dict[tuple[int, int], Any] = {}
    out = []
    for meas in files:
        shape = (meas.num_nodes, meas.ranks_per_node)
        if shape not in groups:
            groups[shape] = Group.all(parse_topology(doc, nodes=shape[0], gpus_per_node=shape[1]))
        group = groups[shape]
        sims = []
        for op, size, _ in _points(meas):
            result = cost(op, size, group)
            sims.append((result.time_s, result.label))
        out.append(sims)
    return out


def _loss(base_doc: Any, values: dict[str, float], files: list[Measurements]) -> float:
    total = 0.0
    for meas, sims in zip(files, _simulate_files(base_doc, values, files)):
        for (_, _, measured), (simulated, _) in zip(_points(meas), sims):
            r = math.log(simulated / measured) / FABRIC_HUBER_DELTA
            total += math.sqrt(1.0 + r * r) - 1.0
    return total


def _file_fits(
    base_doc: Any,
    before: dict[str, float],
    after: dict[str, float],
    files: list[Measurements],
) -> list[FileFit]:
    out = []
    sims_before = _simulate_files(base_doc, before, files)
    sims_after = _simulate_files(base_doc, after, files)
    for meas, sb, sa in zip(files, sims_before, sims_after):
        pts = _points(meas)
        err_b = [abs(s - t) / t for (_, _, t), (s, _) in zip(pts, sb)]
        err_a = [abs(s - t) / t for (_, _, t), (s, _) in zip(pts, sa)]
        by: dict[str, list[float]] = {}
        for e, (_, label) in zip(err_a, sa):
            by.setdefault(label, []).append(e)
        out.append(
            FileFit(
                path=meas.path,
                nodes=meas.num_nodes,
                ranks=meas.world_size,
                points=len(pts),
                median_abs_error_before=statistics.median(err_b),
                median_abs_error=statistics.median(err_a),
                max_abs_error=max(err_a),
                by_choice={k: (len(v), statistics.median(v)) for k, v in by.items()},
            )
        )
    return out


def _fabric_base(files: list[Measurements], base: str | None) -> tuple[str, Any]:
    """The base topology's name (``base``, else the shipped file of the GPU the logs name)
    and its document, which must be an NCCL one."""

    if base is None:
        devices = {str(m.metadata.get("device", "")) for m in files}
        guesses = {base_for_device(d) for d in devices}
        if len(guesses) != 1 or None in guesses:
            raise ConfigError(
                f"cannot tell the machine from the device names {sorted(devices)}; name the "
                "base topology (a file or a shipped name such as dgx_h100)",
                key_path="--base",
            )
        base = str(guesses.pop())
    base_doc = load_yaml(resolve_topology_path(base))
    library = (base_doc.data.get("collectives") or {}).get("library", "nccl")
    if library != "nccl":
        raise ConfigError(
            f"the base topology {base} is a {library} topology; a multi-node fit needs an NCCL one",
            key_path="--base",
        )
    return base, base_doc


def _stage_starts(keys: list[str], values: dict[str, float], multistart: bool) -> list[list[float]]:
    """Search coordinates to start a stage from: the current figures and, with
    ``multistart``, every combination of the start grids (and the current figure) per key."""
    starts = [[_encode(k, values[k]) for k in keys]]
    if multistart:  # the auto choice of algorithm switches with the figures: local minima
        grids = [_start_grid(key) + (values[key],) for key in keys]
        starts += [
            [_encode(k, v) for k, v in zip(keys, combo)] for combo in itertools.product(*grids)
        ]
    return starts


def _start_grid(key: str) -> tuple[float, ...]:
    if key.endswith("efficiency"):
        return FABRIC_START_EFFICIENCIES
    if key == "fabric.net_latency_us":
        return FABRIC_START_NET_LATENCIES_US
    if key == "fabric.completion_us":
        return FABRIC_START_COMPLETIONS_US
    return FABRIC_START_LATENCIES_US


def _transport_start(base_doc: Any) -> dict[str, float] | None:
    """The base's transport terms (``fabric.net_latency_us``, ``fabric.completion_us``) as its
    file and its kind's defaults set them, or None where the transport adds none (NCCL's own
    NET row: InfiniBand, RoCE, no kind)."""

    fabric = parse_topology(base_doc, nodes=2).fabric
    net_us = fabric.net_latency_s * 1e6
    simple_us = fabric.net_simple_latency_s * 1e6
    if net_us == 0 and simple_us == 0:
        return None
    return {"fabric.net_latency_us": net_us, "fabric.completion_us": simple_us - 2 * net_us}


def _log_ssr(
    base_doc: Any, values: dict[str, float], data: list[Measurements]
) -> tuple[float, int]:
    """Sum of squared log(simulated / measured) over the points of ``data``, and their count."""
    total, count = 0.0, 0
    for meas, sims in zip(data, _simulate_files(base_doc, values, data)):
        for (_, _, measured), (simulated, _) in zip(_points(meas), sims):
            total += math.log(simulated / measured) ** 2
            count += 1
    return total, count


def _transport_gains(
    base_doc: Any,
    held: dict[str, float],
    fitted: dict[str, float],
    data: list[Measurements],
    keys: int,
) -> bool:
    """Whether fitting the two transport terms improves on the base's significantly: the
    F-test of the nested fits (2 more parameters, ``keys`` in all) at TRANSPORT_ALPHA, on the
    squared log residuals (as :func:`fit_two_regime` tests a knee)."""
    ssr0, n = _log_ssr(base_doc, held, data)
    ssr1, _ = _log_ssr(base_doc, fitted, data)
    gained = ssr0 - ssr1
    if gained <= 1e-12 * max(ssr0, 1e-300):
        return False
    d2 = n - keys
    if ssr1 <= 0.0 or d2 < 1:
        return d2 >= 1 or gained > 0
    return (gained / 2.0) / (ssr1 / d2) > f_critical(d2, TRANSPORT_ALPHA)


def _decided(
    base_doc: Any, values: dict[str, float], keys: list[str], data: list[Measurements]
) -> list[str]:
    """The ``keys`` the points of ``data`` decide: moving one by DECIDED_STEP (see there) moves
    some point's simulated time by DECIDED_SHIFT or more."""
    at = [t for sims in _simulate_files(base_doc, values, data) for t, _ in sims]
    out = []
    for key in keys:
        value = values[key]
        trial = dict(values)
        if key.endswith("efficiency"):
            trial[key] = value * (1 - DECIDED_STEP)
        else:  # a latency or cost: up, by at least DECIDED_FLOOR_US (it may sit at 0)
            trial[key] = value + max(DECIDED_STEP * value, DECIDED_FLOOR_US)
        shifted = [t for sims in _simulate_files(base_doc, trial, data) for t, _ in sims]
        if max(abs(b / a - 1) for a, b in zip(at, shifted)) >= DECIDED_SHIFT:
            out.append(key)
    return out


def _fit_stage(
    base_doc: Any,
    values: dict[str, float],
    fitted: list[str],
    keys: list[str],
    data: list[Measurements],
    multistart: bool,
) -> None:
    """Fit ``keys`` on ``data`` with the other figures held: the best starts, each refined by
    the simplex and restarted where it stopped; ``values`` gets the best, ``fitted`` the keys."""

    def fun(x: Any) -> float:
        trial = dict(values)
        trial.update({k: _decode(k, float(v)) for k, v in zip(keys, x)})
        return _loss(base_doc, trial, data)

    ranked = sorted(_stage_starts(keys, values, multistart), key=fun)[:FABRIC_STARTS_KEPT]
    found = []
    for start in ranked:
        best, f_best = nelder_mead(
            fun, start, steps=_steps(keys, start), max_evaluations=FABRIC_MAX_EVALUATIONS
        )
        for _ in range(FABRIC_RESTARTS):  # a fresh simplex where the last one stopped
            again, f_again = nelder_mead(
                fun, best, steps=_steps(keys, best), max_evaluations=FABRIC_MAX_EVALUATIONS
            )
            if f_again >= f_best - 1e-9 * max(f_best, 1e-12):
                break
            best, f_best = again, f_again
        found.append((f_best, best))
    best = min(found, key=lambda pair: pair[0])[1]
    values.update({k: _decode(k, v) for k, v in zip(keys, best)})
    for k in keys:
        if k not in fitted:
            fitted.append(k)


def _written(
    values: dict[str, float],
    fitted: list[str],
    decided: list[str],
    transport: dict[str, float] | None,
) -> dict[str, float]:
    """The figures the calibrated file sets: the decided ones, and both transport terms when
    one is (the Simple step is 2 x latency + completion)."""
    written = {k for k in fitted if k in decided}
    if transport is not None and written & set(transport):
        written |= set(transport)
    return {k: values[k] for k in sorted(written)}


def _fit_transport(
    base_doc: Any,
    values: dict[str, float],
    fitted: list[str],
    keys: list[str],
    many: list[Measurements],
    notes: list[str],
) -> list[str]:
    """Fit the transport's ``keys`` with the rails' efficiency on the multi-node files; keep
    them only when the F-test prefers them to the base's. Returns the keys kept fitted."""
    held = dict(values)
    _fit_stage(base_doc, values, fitted, keys + ["nics.efficiency"], many, True)
    network = len(NETWORK_PARAMETERS) + len(keys)
    if _transport_gains(base_doc, held, values, many, network):
        return keys
    values.update(held)  # the base's transport terms do as well
    notes.append(
        f"the fitted transport terms do not beat the base's (F-test at {TRANSPORT_ALPHA:.0%}): "
        + ", ".join(f"{k} = {held[k]:.6g}" for k in keys)
        + " kept"
    )
    for key in keys:
        fitted.remove(key)
    return []


def calibrate_fabric(files: list[Measurements], *, base: str | None = None) -> FabricCalibration:
    """Fit a multi-node NCCL topology to nccl-tests measurements of one and more nodes.

    The base topology (``base``, else the shipped file of the GPU the logs name) keeps its
    shape and NCCL's own per-protocol tables (:mod:`collsim.collectives.protocols`); what is
    fitted are the figures of the topology file, by minimising the pseudo-Huber loss of
    log(simulated / measured) over every point with a downhill simplex, each figure searched
    in an unbounded transform (logit of an efficiency, log of a latency):

    1. on the one-node files: ``intra_node.efficiency`` (NVLink), ``intra_node.latency_us``
       and ``collectives.overhead_us``;
    2. on the multi-node files, with those held: ``nics.efficiency`` and ``nics.latency_us``
       (the network latency per hop, NIC to NIC);
    3. all of them together on every file, from where 1 and 2 ended.

    A stage without files keeps the base's figures and says so in the notes. NCCL's
    per-protocol latencies (tuning.cc) are not keys of a topology file, so the fit is per
    link, and each point's error is reported per (algorithm, protocol) the simulator chose.

    Raises:
        ConfigError: no files, a #wrong > 0, no base topology for the device, or a file whose
            op the base cannot run.
    """
    if not files:
        raise ConfigError("no measurement files")
    for meas in files:
        for row in meas.rows:
            t = float(row["time_us"])
            if not (math.isfinite(t) and t > 0):
                raise ConfigError(f"measured times must be finite and > 0, got {t}", file=meas.path)
    base, base_doc = _fabric_base(files, base)
    one = [m for m in files if m.num_nodes == 1]
    many = [m for m in files if m.num_nodes > 1]
    if many and "nics" not in base_doc.data:
        raise ConfigError(f"the base topology {base} has no nics section", key_path="--base")
    start: dict[str, float] = {}
    for section, key in INTRA_PARAMETERS + NETWORK_PARAMETERS:
        sec = base_doc.data.get(section) or {}
        start[f"{section}.{key}"] = float(sec.get(key, 1.0 if key == "efficiency" else 0.0))
    values = dict(start)
    notes = []
    fitted: list[str] = []
    intra_keys = [f"{s}.{k}" for s, k in INTRA_PARAMETERS]
    net_keys = [f"{s}.{k}" for s, k in NETWORK_PARAMETERS]
    if one:
        _fit_stage(base_doc, values, fitted, intra_keys, one, True)
    else:
        notes.append("no one-node file: NVLink figures and the fixed cost kept from the base")
    transport = _transport_start(base_doc) if many else None
    if transport is not None:
        start.update(transport)
        values.update(transport)
    if many:
        _fit_stage(base_doc, values, fitted, net_keys, many, True)
        if transport is not None:
            net_keys += _fit_transport(base_doc, values, fitted, list(transport), many, notes)
    else:
        notes.append("no multi-node file: NIC figures kept from the base")
    decided = _decided(base_doc, values, intra_keys, one) if one else []
    decided += _decided(base_doc, values, net_keys, many) if many else []
    kept = [k for k in fitted if k not in decided]
    for key in kept:  # nothing in the data moves it: the base's figure stays
        values[key] = start[key]
    if one and many:
        joint = [k for k in intra_keys + net_keys if k in decided]
        _fit_stage(base_doc, values, fitted, joint, files, False)
    if kept:
        notes.append(
            f"kept from the base (no point moves by {DECIDED_SHIFT:.1%} when the figure moves "
            f"by {DECIDED_STEP:.0%}, a latency by {DECIDED_FLOOR_US:g} us at least): "
            + ", ".join(f"{k} = {start[k]:.6g}" for k in kept)
        )
    if many and transport is None:
        notes.append(
            "the base's transport adds no latency of its own (NCCL's NET row, tuning.cc): "
            "fabric.net_latency_us and fabric.completion_us not fitted"
        )
    notes.append(
        "NCCL's per-protocol base and per-hop latencies (src/graph/tuning.cc) are the "
        "simulator's tables, not topology keys: the fit sets the link and transport figures"
    )
    data = _fabric_data(base_doc.data, _written(values, fitted, decided, transport))
    nodes = max(m.num_nodes for m in files)
    per_node = {m.ranks_per_node for m in files}
    if len(per_node) != 1:
        raise ConfigError(
            f"the files have {sorted(per_node)} ranks per node; calibrate one node shape at a time"
        )
    gpus = per_node.pop()
    data["nodes"] = nodes
    data["gpus_per_node"] = gpus
    return FabricCalibration(
        base=base,
        values={k: values[k] for k in fitted},
        fitted=fitted,
        decided=decided,
        data=data,
        files=_file_fits(base_doc, start, values, files),
        nodes=nodes,
        gpus_per_node=gpus,
        notes=notes,
    )


def fabric_yaml(cal: FabricCalibration, name: str) -> str:
    """The calibrated topology as YAML text, with the fit in its header comments."""

    lines = [
        f"# Calibrated by `collsim validate calibrate` from {', '.join(f.path for f in cal.files)}",
        f"# base topology {cal.base}; fitted (pseudo-Huber on log(simulated/measured), "
        f"downhill simplex): " + ", ".join(f"{k} = {v:.6g}" for k, v in cal.values.items()),
    ]
    for f in cal.files:
        lines.append(
            f"# {f.path}: {f.ranks} ranks on {f.nodes} node(s), {f.points} points, median "
            f"|error| {f.median_abs_error_before:.1%} with the base -> {f.median_abs_error:.1%} "
            f"(max {f.max_abs_error:.1%})"
        )
    lines += [f"# note: {note}" for note in cal.notes]
    data = dict(cal.data)
    data["name"] = name
    data["description"] = f"{data.get('description', '')} (calibrated)".strip()
    rounded = {}
    for section, value in data.items():
        if isinstance(value, dict):
            value = {
                k: (float(f"{v:.6g}") if isinstance(v, float) else v) for k, v in value.items()
            }
        rounded[section] = value
    return "\n".join(lines) + "\n" + yaml.safe_dump(rounded, sort_keys=False)


def write_fabric_topology(
    cal: FabricCalibration, path: str | Path, name: str | None = None
) -> Path:
    """Write the calibrated multi-node topology and check that it loads back."""

    out = Path(path)
    out.parent.mkdir(parents=True, exist_ok=True)  # as write_topology does
    out.write_text(fabric_yaml(cal, name or out.stem))
    load_topology(out)
    return out
