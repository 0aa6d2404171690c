"""Goodput of a job over a run: the closed form and the Monte Carlo side by side.

:func:`estimate_goodput` takes the job's costs (:func:`collsim.study.goodput.costs.job_costs`) and
returns a :class:`GoodputResult`: interruptions over the run, effective training time ratio,
goodput in tokens per day, work lost to rollbacks, time checkpointing and recovering, each as
the closed form's expectation and the Monte Carlo's mean with its 5th and 95th percentiles; and
the best checkpoint interval, exact from the closed form (with Young's and Daly's estimates)
and from the Monte Carlo with a bootstrap 95 % interval.

The Monte Carlo's best interval: every interval of a log-spaced grid (1/8 to 8 times the
closed-form optimum) is evaluated on the same sampled failures; the mean ETTR curve's highest
grid point, refined by a parabola in log(interval) over a factor 2 around it, centres a fine
grid (a factor 1.3 either side) on which a least-squares cubic in log(interval) is fitted; the
cubic's maximum is the estimate. Resampling the runs with replacement (Efron's bootstrap, B
resamples, on the same fine grid) and repeating the fit gives its 2.5th and 97.5th
percentiles.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field, replace
from typing import Any

import numpy as np
from numpy.typing import NDArray

from collsim.study.goodput.closed_form import (
    daly_interval_s,
    optimal_interval_s,
    renewal_breakdown,
    young_interval_s,
)
from collsim.study.goodput.config import SECONDS_PER_DAY, ReliabilityConfig
from collsim.study.goodput.costs import JobCosts
from collsim.study.goodput.montecarlo import (
    SampledRun,
    Timelines,
    evaluate_intervals,
    sample_timelines,
    sampled_run,
)

__all__ = [
    "Spread",
    "ClosedFormGoodput",
    "MonteCarloGoodput",
    "BestInterval",
    "GoodputResult",
    "closed_form_goodput",
    "estimate_goodput",
    "best_interval_from_runs",
    "interval_grid_s",
]

FloatArray = NDArray[np.float64]

#: Bootstrap resamples for the best interval's 95 % interval.
BOOTSTRAP_RESAMPLES = 400

#: Grid of intervals the Monte Carlo scans, as multiples of the closed-form optimum.
GRID_SPAN = 8.0
GRID_POINTS = 25
#: The fine grid around the coarse maximum where the cubic is fitted.
FINE_SPAN = 1.3
FINE_POINTS = 13


@dataclass(frozen=True, slots=True, kw_only=True)
class Spread:
    """A Monte Carlo quantity: mean and 5th / 95th percentiles over the runs."""

    mean: float
    p5: float
    p95: float

    @classmethod
    def of(cls, values: FloatArray) -> Spread:
        """The spread of ``values``; negatives within 1e-6 of zero (what is left of a sum
        of seconds minus its parts) read as 0."""
        v = np.asarray(values, dtype=np.float64)
        v = np.where((v < 0) & (v > -1e-6), 0.0, v)
        return cls(
            mean=float(v.mean()), p5=float(np.percentile(v, 5)), p95=float(np.percentile(v, 95))
        )


@dataclass(frozen=True, slots=True, kw_only=True)
class ClosedFormGoodput:
    """Expectations over the run from :mod:`collsim.study.goodput.closed_form`."""

    interval_s: float
    interruptions: float
    interruptions_in_recovery: float
    effective_training_time_ratio: float
    goodput_tokens_per_day: float
    lost_s: float
    checkpointing_s: float
    recovering_s: float
    interruptions_by_component: dict[str, float] = field(default_factory=dict)
    """Expected failures of each component over the run (its share of lam H)."""


@dataclass(frozen=True, slots=True, kw_only=True)
class MonteCarloGoodput:
    """The Monte Carlo at the chosen interval: each quantity's spread over the runs."""

    runs: int
    seed: int | None
    interval_s: float
    interruptions: Spread
    interruptions_in_recovery: Spread
    effective_training_time_ratio: Spread
    goodput_tokens_per_day: Spread
    lost_s: Spread
    checkpointing_s: Spread
    recovering_s: Spread
    spare_wait_s: Spread
    spare_shortages: Spread
    interruptions_by_component: dict[str, float] = field(default_factory=dict)
    """Mean failures per run of each component."""


@dataclass(frozen=True, slots=True, kw_only=True)
class BestInterval:
    """The checkpoint interval that maximises goodput."""

    closed_form_s: float
    """Exact optimum of the renewal ratio."""
    young_s: float
    daly_s: float
    monte_carlo_s: float
    ci95_low_s: float
    ci95_high_s: float
    grid_s: tuple[float, ...]
    closed_form_ettr: tuple[float, ...]
    """Closed-form ETTR at each grid interval."""
    monte_carlo_ettr: tuple[float, ...]
    """Monte Carlo mean ETTR at each grid interval."""


@dataclass(frozen=True, slots=True, kw_only=True)
class GoodputResult:
    """Everything ``collsim goodput`` reports."""

    days: float
    interval_s: float
    interval_source: str
    """``scenario`` (the file's interval_s) or ``auto`` (the closed-form optimum)."""
    costs: JobCosts
    closed_form: ClosedFormGoodput
    monte_carlo: MonteCarloGoodput | None
    best_interval: BestInterval | None
    timeline: SampledRun | None = field(default=None, repr=False)
    warnings: tuple[str, ...] = ()

    def to_dict(self) -> dict[str, Any]:
        """Flat JSON-ready summary; the headline keys are the closed form's expectations."""
        cf = self.closed_form
        costs = self.costs
        out: dict[str, Any] = {
            "days": self.days,
            "checkpoint_interval_s": self.interval_s,
            "checkpoint_interval_source": self.interval_source,
            "interruptions": cf.interruptions,
            "effective_training_time_ratio": cf.effective_training_time_ratio,
            "goodput_tokens_per_day": cf.goodput_tokens_per_day,
            "lost_s": cf.lost_s,
            "checkpointing_s": cf.checkpointing_s,
            "recovering_s": cf.recovering_s,
            "job": {
                "mtbf_s": costs.mtbf_s,
                "failure_rate_per_day": costs.failure_rate_per_s * SECONDS_PER_DAY,
                "num_nodes": costs.num_nodes,
                "step_time_s": costs.step_time_s,
                "tokens_per_step": costs.tokens_per_step,
                "checkpoint_write_s": costs.write_s,
                "checkpoint_stall_s": costs.stall_s,
                "checkpoint_load_s": costs.load_s,
                "detection_s": costs.detection_s,
                "restart_s": costs.restart_s,
                "checkpoint_bytes": costs.state.total_bytes if costs.state else None,
                "checkpoint_bytes_per_gpu": costs.state.max_rank_bytes if costs.state else None,
            },
            "closed_form": asdict(cf),
            "warnings": list(self.warnings),
        }
        if self.monte_carlo is not None:
            out["monte_carlo"] = asdict(self.monte_carlo)
        if self.best_interval is not None:
            out["best_interval"] = asdict(self.best_interval)
        return out


def interval_grid_s(
    center_s: float, *, span: float = GRID_SPAN, points: int = GRID_POINTS
) -> FloatArray:
    """Log-spaced intervals from ``center / span`` to ``center x span``."""
    return np.geomspace(center_s / span, center_s * span, points)


def closed_form_goodput(costs: JobCosts, interval_s: float, horizon_s: float) -> ClosedFormGoodput:
    """The closed form's expectations over a run of ``horizon_s`` seconds."""
    b = renewal_breakdown(costs, interval_s)
    return ClosedFormGoodput(
        interval_s=interval_s,
        interruptions=b.failures_per_s * horizon_s,
        interruptions_in_recovery=b.recovery_failures_per_s * horizon_s,
        effective_training_time_ratio=b.useful,
        goodput_tokens_per_day=b.useful * costs.tokens_per_s * SECONDS_PER_DAY,
        lost_s=b.lost * horizon_s,
        checkpointing_s=b.checkpointing * horizon_s,
        recovering_s=b.recovering * horizon_s,
    )


def best_interval_from_runs(
    grid_s: FloatArray, ettr: FloatArray, rng: np.random.Generator, *, resamples: int
) -> tuple[float, float, float]:
    """(estimate, 2.5th, 97.5th percentile) of the best interval from per-run ETTRs on a grid.

    The estimate is the maximum of a least-squares cubic in log(interval) through the mean
    curve (a cubic, not a parabola: the curve is skewed in log(interval), and a parabola's
    vertex would sit below the maximum); the bootstrap repeats it on resampled runs.

    Args:
        grid_s: the intervals, increasing, around the maximum.
        ettr: (runs, intervals) ETTR of each run at each interval (same failures per row).
        rng: draws the bootstrap resamples.
        resamples: bootstrap resamples B.
    """
    runs = ettr.shape[0]
    estimate = _cubic_max(grid_s, ettr.mean(axis=0))
    weights = rng.multinomial(runs, np.full(runs, 1.0 / runs), size=resamples) / runs
    curves = weights @ ettr
    boots = np.array([_cubic_max(grid_s, curve) for curve in curves])
    low, high = np.percentile(boots, [2.5, 97.5])
    return estimate, float(low), float(high)


def _coarse_max(grid_s: FloatArray, curve: FloatArray) -> float:
    """Highest grid point refined by a parabola in log(interval) over a factor 2 around it."""
    i = int(np.argmax(curve))
    x = np.log(grid_s)
    near = np.abs(x - x[i]) <= math.log(2.0) + 1e-12
    if near.sum() < 3:
        return float(grid_s[i])
    a, b, _ = np.polyfit(x[near], curve[near], 2)
    if a >= 0:
        return float(grid_s[i])
    return math.exp(float(np.clip(-b / (2.0 * a), x[near].min(), x[near].max())))


def _cubic_max(grid_s: FloatArray, curve: FloatArray) -> float:
    """The maximum over the grid's span of a least-squares cubic in log(interval)."""
    x = np.log(grid_s)
    coeffs = np.polyfit(x, curve, 3)
    roots = np.roots(np.polyder(coeffs))
    candidates = [float(r.real) for r in roots if abs(r.imag) < 1e-12 and x[0] <= r.real <= x[-1]]
    candidates += [float(x[0]), float(x[-1])]
    best = max(candidates, key=lambda c: float(np.polyval(coeffs, c)))
    return math.exp(best)


def _spare_warnings(costs: JobCosts, reliability: ReliabilityConfig) -> tuple[str, ...]:
    """Where the spare pool is too small: Little's law, and events larger than the pool."""
    spares = reliability.spares
    if spares.nodes is None:
        return ()
    out: list[str] = []
    per_node_s = sum(
        c.rate_per_node_s * c.replace_fraction * c.nodes_affected for c in reliability.components
    )
    in_repair = costs.num_nodes * per_node_s * spares.repair_hours * 3600.0
    if in_repair > spares.nodes:
        out.append(
            f"on average {in_repair:.1f} nodes are in repair but the pool holds "
            f"{spares.nodes} spares: restarts will wait for repairs (the closed form ignores this)"
        )
    for c in reliability.components:
        if c.replace_fraction > 0 and c.per_1000_node_days > 0 and c.nodes_affected > spares.nodes:
            out.append(
                f"a {c.name} event takes {c.nodes_affected} nodes, more than the {spares.nodes} "
                f"spares: its restart waits {spares.repair_hours:g} h for repairs (Monte Carlo "
                "only; the closed form ignores it)"
            )
    return tuple(out)


def estimate_goodput(
    costs: JobCosts,
    reliability: ReliabilityConfig,
    *,
    days: float,
    runs: int = 1000,
    seed: int | None = 0,
    monte_carlo: bool = True,
    resamples: int = BOOTSTRAP_RESAMPLES,
) -> GoodputResult:
    """Closed form and (unless ``monte_carlo`` is False) Monte Carlo goodput over ``days``.

    The interval is the scenario's ``checkpoint.interval_s`` or, when ``auto``, the exact
    closed-form optimum. ``seed`` seeds the one ``numpy.random.Generator`` used.
    """
    horizon_s = days * SECONDS_PER_DAY
    best_s = optimal_interval_s(costs)
    if costs.interval_s is not None:
        interval_s, source = costs.interval_s, "scenario"
    else:
        interval_s, source = best_s, "auto"
    if not math.isfinite(interval_s):
        interval_s = horizon_s
    closed = closed_form_goodput(costs, interval_s, horizon_s)
    total_rate = sum(c.rate_per_node_s for c in reliability.components)
    if total_rate > 0:
        closed = replace(
            closed,
            interruptions_by_component={
                c.name: closed.interruptions * c.rate_per_node_s / total_rate
                for c in reliability.components
            },
        )
    warnings = _spare_warnings(costs, reliability)
    if not monte_carlo or costs.failure_rate_per_s <= 0:
        return GoodputResult(
            days=days,
            interval_s=interval_s,
            interval_source=source,
            costs=costs,
            closed_form=closed,
            monte_carlo=None,
            best_interval=None,
            warnings=warnings,
        )
    rng = np.random.default_rng(seed)
    floor_s = max(costs.background_s, costs.step_time_s)
    longest_s = max(interval_s, best_s, floor_s * GRID_SPAN) * GRID_SPAN * FINE_SPAN
    timelines = sample_timelines(
        costs,
        horizon_s=horizon_s,
        runs=runs,
        rng=rng,
        lookahead_s=longest_s + costs.stall_s + costs.background_s,
        components=reliability.components,
        spares=reliability.spares,
    )
    mc = _monte_carlo(timelines, costs, interval_s, runs=runs, seed=seed)
    names = [c.name for c in reliability.components]
    inside = timelines.failure_times_s < horizon_s
    mc = replace(
        mc,
        interruptions_by_component={
            name: float((inside & (timelines.component == i)).sum()) / runs
            for i, name in enumerate(names)
        },
    )
    best = _best_interval(timelines, costs, best_s, rng, resamples=resamples)
    return GoodputResult(
        days=days,
        interval_s=interval_s,
        interval_source=source,
        costs=costs,
        closed_form=closed,
        monte_carlo=mc,
        best_interval=best,
        timeline=sampled_run(timelines, costs, interval_s, run=0),
        warnings=warnings,
    )


def _monte_carlo(
    timelines: Timelines, costs: JobCosts, interval_s: float, *, runs: int, seed: int | None
) -> MonteCarloGoodput:
    m = evaluate_intervals(timelines, costs, [interval_s])
    ettr = m.ettr[:, 0]
    return MonteCarloGoodput(
        runs=runs,
        seed=seed,
        interval_s=interval_s,
        interruptions=Spread.of(timelines.interruptions.astype(np.float64)),
        interruptions_in_recovery=Spread.of(timelines.recovery_failures.astype(np.float64)),
        effective_training_time_ratio=Spread.of(ettr),
        goodput_tokens_per_day=Spread.of(ettr * costs.tokens_per_s * SECONDS_PER_DAY),
        lost_s=Spread.of(m.lost_s[:, 0]),
        checkpointing_s=Spread.of(m.checkpointing_s[:, 0]),
        recovering_s=Spread.of(m.recovering_s[:, 0]),
        spare_wait_s=Spread.of(timelines.spare_wait_s),
        spare_shortages=Spread.of(timelines.spare_shortages.astype(np.float64)),
    )


def _best_interval(
    timelines: Timelines,
    costs: JobCosts,
    best_s: float,
    rng: np.random.Generator,
    *,
    resamples: int,
) -> BestInterval:
    floor_s = max(costs.background_s, costs.step_time_s)
    grid = interval_grid_s(best_s)
    grid = grid[grid >= floor_s]
    if grid.size < 3:  # the optimum sits on the floor: scan upwards from it
        grid = interval_grid_s(floor_s * GRID_SPAN)
    ettr = evaluate_intervals(timelines, costs, grid).ettr
    coarse = _coarse_max(grid, ettr.mean(axis=0))
    fine = interval_grid_s(coarse, span=FINE_SPAN, points=FINE_POINTS)
    fine = fine[fine >= floor_s] if fine[0] < floor_s else fine
    if fine.size < 4:
        fine = np.geomspace(floor_s, floor_s * FINE_SPAN**2, FINE_POINTS)
    fine_ettr = evaluate_intervals(timelines, costs, fine).ettr
    estimate, low, high = best_interval_from_runs(fine, fine_ettr, rng, resamples=resamples)
    closed = tuple(renewal_breakdown(costs, float(t)).useful for t in grid)
    return BestInterval(
        closed_form_s=best_s,
        young_s=young_interval_s(costs.stall_s, costs.mtbf_s),
        daly_s=daly_interval_s(costs.stall_s, costs.mtbf_s),
        monte_carlo_s=estimate,
        ci95_low_s=low,
        ci95_high_s=high,
        grid_s=tuple(float(t) for t in grid),
        closed_form_ettr=closed,
        monte_carlo_ettr=tuple(float(v) for v in ettr.mean(axis=0)),
    )
