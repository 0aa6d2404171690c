"""Closed forms of goodput: the checkpoint interval (Young, Daly) and the exact renewal ratio.

Derivations, measurements and sources: docs/derivations.md, ``collsim.study.goodput.closed_form``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from collsim.core.errors import ConfigError
from collsim.study.goodput.costs import JobCosts

__all__ = [
    "RenewalBreakdown",
    "young_interval_s",
    "daly_interval_s",
    "optimal_interval_s",
    "effective_training_time_ratio",
    "renewal_breakdown",
]


def young_interval_s(stall_s: float, mtbf_s: float) -> float:
    """Young (1974) first order optimum: ``sqrt(2 s M)``."""
    return math.sqrt(2.0 * stall_s * mtbf_s)


def daly_interval_s(stall_s: float, mtbf_s: float) -> float:
    """Daly (2006) higher order optimum; ``M`` when the stall reaches ``2 M``."""
    if stall_s >= 2.0 * mtbf_s:
        return mtbf_s
    x = stall_s / (2.0 * mtbf_s)
    return math.sqrt(2.0 * stall_s * mtbf_s) * (1.0 + math.sqrt(x) / 3.0 + x / 9.0) - stall_s


def optimal_interval_s(costs: JobCosts) -> float:
    """The ``tau`` that maximises :func:`effective_training_time_ratio` (exact, bisection).

    Clamped below at the background write time (an asynchronous write must end before the
    next snapshot) and at one step.
    """
    lam, s = costs.failure_rate_per_s, costs.stall_s
    floor_s = max(costs.background_s, costs.step_time_s)
    if lam <= 0:
        return math.inf
    a = lam * s
    if a <= 0:
        return floor_s
    lo, hi = a, 1.0 + a  # f(lo) = e^a - 1 > 0 > f(hi) = -1, f decreasing on (a, inf)
    for _ in range(200):
        mid = 0.5 * (lo + hi)
        if 1.0 - mid + a > math.exp(-mid):  # e^u (1 - u + a) > 1, without overflow
            lo = mid
        else:
            hi = mid
        if hi - lo <= 1e-15 * max(1.0, hi):
            break
    tau = 0.5 * (lo + hi) / lam - s
    return max(tau, floor_s)


def effective_training_time_ratio(costs: JobCosts, interval_s: float) -> float:
    """``lam tau e^(-lam (W + D + R)) / (e^(lam (tau + s)) - 1)`` (docs/derivations.md)."""
    return renewal_breakdown(costs, interval_s).useful


@dataclass(frozen=True, slots=True, kw_only=True)
class RenewalBreakdown:
    """Long-run shares of elapsed time (they sum to 1) and the failure counts per second."""

    interval_s: float
    useful: float
    """Training that is kept: the effective training time ratio."""
    checkpointing: float
    """Stalled for checkpoint writes or snapshots."""
    lost: float
    """Training done and rolled back."""
    recovering: float
    """Detecting, restarting, loading, warming up (and recoveries cut short by failures)."""
    failures_per_s: float
    """All interruptions (= lam)."""
    recovery_failures_per_s: float
    """Interruptions that struck during a recovery."""


def renewal_breakdown(costs: JobCosts, interval_s: float) -> RenewalBreakdown:
    """The long-run split of time of the model in docs/derivations.md.

    Raises:
        ConfigError: a non-positive interval.
    """
    tau = interval_s
    if not tau > 0:
        raise ConfigError(f"must be > 0, got {tau}", key_path="reliability.checkpoint.interval_s")
    lam, s, w = costs.failure_rate_per_s, costs.stall_s, costs.background_s
    period = tau + s
    if lam <= 0:
        return RenewalBreakdown(
            interval_s=tau,
            useful=tau / period,
            checkpointing=s / period,
            lost=0.0,
            recovering=0.0,
            failures_per_s=0.0,
            recovery_failures_per_s=0.0,
        )
    # Shares of a piece of mean length e^(lam Rt) / lam, written so that nothing overflows
    # when lam Rt or lam P is large (the job then barely trains).
    rt = costs.recovery_s
    survive = math.exp(-lam * rt)  # E[X] / E[X + Y]
    useful = lam * tau * math.exp(-lam * (w + rt) - _log_expm1(lam * period))
    stalled = math.exp(-lam * tau) * (-math.expm1(-lam * s)) / (-math.expm1(-lam * period))
    checkpointing = stalled * survive
    recovering = -math.expm1(-lam * rt)
    return RenewalBreakdown(
        interval_s=tau,
        useful=useful,
        checkpointing=checkpointing,
        lost=max(0.0, survive - checkpointing - useful),
        recovering=recovering,
        failures_per_s=lam,
        recovery_failures_per_s=lam * recovering,
    )


def _log_expm1(x: float) -> float:
    """``log(e^x - 1)`` for x > 0, without overflow."""
    return math.log(math.expm1(x)) if x < 30.0 else x + math.log1p(-math.exp(-x))
