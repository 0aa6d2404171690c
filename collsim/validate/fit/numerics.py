"""The numerics of calibration: robust line and hinge fits of time against size (relative
residuals, Huber weights), the knee test, and a downhill simplex for the fabric fit.

Derivations, measurements and sources: docs/derivations.md, ``collsim.validate.fit.calibrate``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import numpy as np

from collsim.core.errors import ConfigError

__all__ = [
    "KNEE_ALPHA",
    "KNEE_GRID_PER_OCTAVE",
    "RegimeFit",
    "best_knee",
    "f_critical",
    "fit_hinge",
    "fit_line",
    "fit_two_regime",
    "knee_candidates",
    "nelder_mead",
]


#: A knee is kept only if the F-test of hinge against line rejects the line at this level.
KNEE_ALPHA = 0.05


#: Knee positions tried per factor of two in size (a geometric grid).
KNEE_GRID_PER_OCTAVE = 16


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
