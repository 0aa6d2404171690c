"""The renewal closed form against the Monte Carlo and an independent event-by-event simulation.

The closed form is exact under the Monte Carlo's assumptions (failures in any phase, recoveries
restarted by failures); the two must agree within 2 % on the expected effective training time
ratio over a grid of failure rates and intervals. Young's first order interval is shown beside
the exact optimum.
"""

from __future__ import annotations

import math
import random

import numpy as np
import pytest

from collsim.study.goodput.closed_form import (
    daly_interval_s,
    effective_training_time_ratio,
    optimal_interval_s,
    renewal_breakdown,
    young_interval_s,
)
from collsim.study.goodput.costs import JobCosts
from collsim.study.goodput.montecarlo import evaluate_intervals, sample_timelines

DAY_S = 86_400.0


def costs(
    mtbf_h: float,
    stall_s: float = 30.0,
    recovery_s: float = 900.0,
    background_s: float = 0.0,
    interval_s: float | None = None,
) -> JobCosts:
    return JobCosts(
        failure_rate_per_s=1.0 / (mtbf_h * 3600.0),
        write_s=background_s or stall_s,
        stall_s=stall_s,
        background_s=background_s,
        detection_s=recovery_s / 3.0,
        restart_s=2.0 * recovery_s / 3.0,
        load_s=0.0,
        step_time_s=1.0,
        tokens_per_step=1.0e6,
        num_nodes=1,
        interval_s=interval_s,
    )


def mc_ettr(c: JobCosts, intervals: list[float], days: float, runs: int, seed: int) -> np.ndarray:
    tl = sample_timelines(
        c,
        horizon_s=days * DAY_S,
        runs=runs,
        rng=np.random.default_rng(seed),
        lookahead_s=max(intervals) + c.stall_s + c.background_s,
    )
    return evaluate_intervals(tl, c, intervals).ettr


# -- closed form against the Monte Carlo ------------------------------------------------------


@pytest.mark.parametrize("mtbf_h", [0.5, 2.0, 8.0])
def test_closed_form_matches_monte_carlo_within_2_percent(mtbf_h: float) -> None:
    c = costs(mtbf_h)
    best = optimal_interval_s(c)
    grid = [best / 4, best, best * 4]
    ettr = mc_ettr(c, grid, days=60, runs=300, seed=11)
    for i, tau in enumerate(grid):
        exact = effective_training_time_ratio(c, tau)
        mean = float(ettr[:, i].mean())
        se = float(ettr[:, i].std(ddof=1)) / math.sqrt(ettr.shape[0])
        assert abs(mean - exact) / exact < 0.02, (mtbf_h, tau, mean, exact)
        # tighter: the windows are stationary, so the Monte Carlo mean is unbiased
        assert abs(mean - exact) < 4 * se, (mtbf_h, tau, mean, exact, se)


@pytest.mark.slow
@pytest.mark.parametrize("mtbf_h", [0.25, 1.0, 3.0, 12.0])
@pytest.mark.parametrize("stall_s", [5.0, 60.0])
@pytest.mark.parametrize("background_s", [0.0, 120.0])
def test_closed_form_matches_monte_carlo_big_grid(
    mtbf_h: float, stall_s: float, background_s: float
) -> None:
    c = costs(mtbf_h, stall_s=stall_s, recovery_s=1200.0, background_s=background_s)
    best = max(optimal_interval_s(c), background_s)
    grid = [t for t in np.geomspace(best / 6, best * 6, 7) if t >= background_s]
    ettr = mc_ettr(c, grid, days=60, runs=400, seed=5)
    for i, tau in enumerate(grid):
        exact = effective_training_time_ratio(c, tau)
        assert abs(float(ettr[:, i].mean()) - exact) / exact < 0.02


def test_asynchronous_checkpoint_matches_monte_carlo() -> None:
    c = costs(2.0, stall_s=2.0, background_s=300.0)
    grid = [300.0, 900.0]
    ettr = mc_ettr(c, grid, days=60, runs=300, seed=2)
    for i, tau in enumerate(grid):
        exact = effective_training_time_ratio(c, tau)
        assert abs(float(ettr[:, i].mean()) - exact) / exact < 0.02


# -- an independent simulation: event by event, random.Random, no numpy --------------------------


def simulate_event_by_event(c: JobCosts, tau: float, horizon_s: float, rng: random.Random) -> float:
    """Useful fraction of one run, stepping through compute, stall and recovery phases.

    Written apart from the Monte Carlo: it draws the next failure after each event instead of a
    Poisson count, and walks phase by phase.
    """
    lam, s, w, rt = c.failure_rate_per_s, c.stall_s, c.background_s, c.recovery_s
    t, kept = 0.0, 0.0
    next_fail = rng.expovariate(lam)
    while t < horizon_s:
        # an up period: checkpoints complete at t + k (tau + s), are safe w later
        safe_work, k, start = 0.0, 0, t
        while True:
            end_compute = start + (k + 1) * (tau + s) - s
            end_stall = end_compute + s
            if min(next_fail, horizon_s) < end_stall:
                break
            k += 1
        stop = min(next_fail, horizon_s)
        for j in range(1, k + 1):
            if start + j * (tau + s) + w <= stop:
                safe_work = j * tau
        if stop >= horizon_s:
            done = k * tau + min(horizon_s - (start + k * (tau + s)), tau)
            return (kept + done) / horizon_s
        kept += safe_work
        t = next_fail
        next_fail = t + rng.expovariate(lam)
        # recovery: rt seconds without a failure
        while next_fail < t + rt:
            t = next_fail
            next_fail = t + rng.expovariate(lam)
        t += rt
        if t >= horizon_s:
            return kept / horizon_s
    return kept / horizon_s


@pytest.mark.parametrize(
    ("mtbf_h", "tau", "background_s"), [(1.0, 600.0, 0.0), (2.0, 900.0, 200.0)]
)
def test_closed_form_matches_an_independent_simulation(
    mtbf_h: float, tau: float, background_s: float
) -> None:
    c = costs(mtbf_h, background_s=background_s)
    rng = random.Random(7)
    values = [simulate_event_by_event(c, tau, 30 * DAY_S, rng) for _ in range(150)]
    mean = sum(values) / len(values)
    exact = effective_training_time_ratio(c, tau)
    assert abs(mean - exact) / exact < 0.01, (mean, exact)


# -- the closed form itself -----------------------------------------------------------------------


def test_breakdown_sums_to_one_and_matches_daly_complete_model() -> None:
    c = costs(3.0, stall_s=40.0, recovery_s=600.0)
    tau = 1500.0
    b = renewal_breakdown(c, tau)
    assert b.useful + b.checkpointing + b.lost + b.recovering == pytest.approx(1.0, abs=1e-12)
    # Daly (2006): T_w / T_s = M e^(R/M) (e^((tau + delta)/M) - 1) / tau, R = detection + restart
    m = c.mtbf_s
    daly = m * math.exp(c.recovery_s / m) * math.expm1((tau + c.stall_s) / m) / tau
    assert b.useful == pytest.approx(1.0 / daly, rel=1e-12)


def test_no_failures_leaves_only_the_checkpoint_stall() -> None:
    c = JobCosts(
        failure_rate_per_s=0.0,
        write_s=10.0,
        stall_s=10.0,
        background_s=0.0,
        detection_s=0.0,
        restart_s=0.0,
        load_s=0.0,
        step_time_s=1.0,
        tokens_per_step=1.0,
        num_nodes=1,
        interval_s=None,
    )
    assert effective_training_time_ratio(c, 990.0) == pytest.approx(0.99)


@pytest.mark.parametrize("mtbf_h", [0.2, 1.0, 10.0, 100.0])
def test_optimum_is_a_maximum_and_young_daly_approach_it(mtbf_h: float) -> None:
    c = costs(mtbf_h, stall_s=20.0)
    best = optimal_interval_s(c)
    f = effective_training_time_ratio(c, best)
    assert f > effective_training_time_ratio(c, best * 0.98)
    assert f > effective_training_time_ratio(c, best * 1.02)
    young = young_interval_s(c.stall_s, c.mtbf_s)
    daly = daly_interval_s(c.stall_s, c.mtbf_s)
    x = c.stall_s / c.mtbf_s
    # Young is first order: its error shrinks like sqrt(s / M); Daly's is much closer
    assert abs(young - best) / best < 2 * math.sqrt(x)
    assert abs(daly - best) <= abs(young - best)
    assert young == pytest.approx(math.sqrt(2 * c.stall_s * c.mtbf_s))


def test_daly_returns_mtbf_when_the_stall_exceeds_twice_it() -> None:
    assert daly_interval_s(500.0, 200.0) == 200.0


def test_no_overflow_when_the_job_barely_trains() -> None:
    # a failure a minute against a 14-hour recovery: e^(lam Rt) would overflow a float
    c = costs(1.0 / 60.0, stall_s=3000.0, recovery_s=50_000.0)
    b = renewal_breakdown(c, 1.0e5)
    assert b.useful == 0.0 and b.recovering == pytest.approx(1.0)
    assert math.isfinite(optimal_interval_s(c))
