"""The Monte Carlo: seeded, reproducible; its best interval; spares; correlated failures."""

from __future__ import annotations

import numpy as np
import pytest

from collsim.study.goodput.config import (
    ComponentRate,
    ReliabilityConfig,
    SparesConfig,
    StorageConfig,
)
from collsim.study.goodput.costs import JobCosts
from collsim.study.goodput.estimate import estimate_goodput
from collsim.study.goodput.montecarlo import evaluate_intervals, sample_timelines, sampled_run

DAY_S = 86_400.0


def costs(mtbf_h: float, stall_s: float = 30.0, recovery_s: float = 900.0) -> JobCosts:
    return JobCosts(
        failure_rate_per_s=1.0 / (mtbf_h * 3600.0),
        write_s=stall_s,
        stall_s=stall_s,
        background_s=0.0,
        detection_s=300.0,
        restart_s=recovery_s - 300.0,
        load_s=0.0,
        step_time_s=2.0,
        tokens_per_step=4.0e6,
        num_nodes=100,
        interval_s=None,
    )


def reliability(
    *components: ComponentRate, spares: SparesConfig | None = None
) -> ReliabilityConfig:
    return ReliabilityConfig(
        components=components or (ComponentRate(name="gpu", per_1000_node_days=5.0),),
        storage=StorageConfig(write_bandwidth_gbps=100.0, read_bandwidth_gbps=100.0),
        spares=spares or SparesConfig(),
    )


def test_same_seed_same_result_other_seed_other_result() -> None:
    c, rel = costs(2.0), reliability()
    a = estimate_goodput(c, rel, days=10, runs=200, seed=3, resamples=50)
    b = estimate_goodput(c, rel, days=10, runs=200, seed=3, resamples=50)
    other = estimate_goodput(c, rel, days=10, runs=200, seed=4, resamples=50)
    assert a.to_dict() == b.to_dict()
    assert a.monte_carlo is not None and other.monte_carlo is not None
    assert (
        a.monte_carlo.effective_training_time_ratio
        != other.monte_carlo.effective_training_time_ratio
    )
    t1 = sample_timelines(c, horizon_s=5 * DAY_S, runs=20, rng=np.random.default_rng(9))
    t2 = sample_timelines(c, horizon_s=5 * DAY_S, runs=20, rng=np.random.default_rng(9))
    np.testing.assert_array_equal(t1.failure_times_s, t2.failure_times_s)
    np.testing.assert_array_equal(t1.up_start_s, t2.up_start_s)


def test_time_accounts_add_up_to_the_horizon() -> None:
    c = costs(1.0)
    tl = sample_timelines(
        c, horizon_s=20 * DAY_S, runs=50, rng=np.random.default_rng(1), lookahead_s=2000.0
    )
    m = evaluate_intervals(tl, c, [300.0, 1200.0])
    total = m.useful_s + m.checkpointing_s + m.lost_s + m.recovering_s
    np.testing.assert_allclose(total, 20 * DAY_S, rtol=1e-12)
    assert np.all(m.lost_s >= -1e-9) and np.all(m.checkpointing_s >= 0)


def test_spread_is_reported_and_brackets_the_mean() -> None:
    r = estimate_goodput(costs(2.0), reliability(), days=30, runs=300, seed=0, resamples=50)
    mc = r.monte_carlo
    assert mc is not None
    for s in (mc.interruptions, mc.effective_training_time_ratio, mc.goodput_tokens_per_day):
        assert s.p5 < s.mean < s.p95
    # interruptions are Poisson: mean lam H, spread about sqrt(lam H)
    lam_h = 30 * 24 / 2.0
    assert mc.interruptions.mean == pytest.approx(lam_h, rel=0.02)
    assert r.closed_form.interruptions == pytest.approx(lam_h)


@pytest.mark.parametrize(("mtbf_h", "stall_s"), [(2.0, 30.0), (0.5, 60.0), (6.0, 120.0)])
def test_best_interval_from_monte_carlo_matches_closed_form(mtbf_h: float, stall_s: float) -> None:
    r = estimate_goodput(costs(mtbf_h, stall_s), reliability(), days=20, runs=500, seed=1)
    b = r.best_interval
    assert b is not None
    # the bootstrap 95 % interval is narrower than +/- 20 % and holds the exact optimum
    assert b.ci95_low_s > 0.8 * b.monte_carlo_s and b.ci95_high_s < 1.2 * b.monte_carlo_s
    assert b.ci95_low_s <= b.closed_form_s <= b.ci95_high_s, (
        b.ci95_low_s,
        b.closed_form_s,
        b.ci95_high_s,
    )
    assert b.ci95_low_s <= b.monte_carlo_s <= b.ci95_high_s


def test_goodput_against_interval_has_an_interior_optimum() -> None:
    r = estimate_goodput(costs(2.0), reliability(), days=30, runs=300, seed=2, resamples=50)
    b = r.best_interval
    assert b is not None
    for curve in (np.asarray(b.monte_carlo_ettr), np.asarray(b.closed_form_ettr)):
        i = int(np.argmax(curve))
        assert 0 < i < curve.size - 1
        assert curve[0] < curve[i] - 0.01 and curve[-1] < curve[i] - 0.01
        # rises to the peak and falls after it (closed form strictly; MC within its noise)
        assert np.all(np.diff(curve[: i + 1]) > -1e-3) and np.all(np.diff(curve[i:]) < 1e-3)


def test_running_out_of_spares_costs_goodput_and_warns() -> None:
    c = costs(1.0)
    gpu = ComponentRate(name="gpu", per_1000_node_days=240.0)  # 100 nodes: 24 per day
    plenty = estimate_goodput(c, reliability(gpu), days=20, runs=200, seed=5, resamples=50)
    short = estimate_goodput(
        c,
        reliability(gpu, spares=SparesConfig(nodes=1, repair_hours=24.0)),
        days=20,
        runs=200,
        seed=5,
        resamples=50,
    )
    assert plenty.monte_carlo is not None and short.monte_carlo is not None
    assert short.monte_carlo.spare_wait_s.mean > 0
    assert plenty.monte_carlo.spare_wait_s.mean == 0
    drop = (
        plenty.monte_carlo.effective_training_time_ratio.mean
        - short.monte_carlo.effective_training_time_ratio.mean
    )
    assert drop > 0.05
    # the closed form does not see the pool
    assert short.closed_form == plenty.closed_form
    assert any("in repair" in w for w in short.warnings)


def test_a_correlated_event_larger_than_the_pool_waits_for_repairs() -> None:
    c = costs(100.0)
    switch = ComponentRate(name="switch", per_1000_node_days=10.0, nodes_affected=32)
    rel = reliability(switch, spares=SparesConfig(nodes=8, repair_hours=10.0))
    tl = sample_timelines(
        c,
        horizon_s=30 * DAY_S,
        runs=100,
        rng=np.random.default_rng(0),
        components=rel.components,
        spares=rel.spares,
    )
    # every switch event needs 32 nodes from a pool of 8: each waits the full repair
    events = tl.interruptions.sum()
    assert events > 0
    assert tl.spare_wait_s.sum() == pytest.approx(events * 10 * 3600.0)
    r = estimate_goodput(c, rel, days=30, runs=20, seed=0, resamples=20)
    assert any("switch event takes 32 nodes" in w for w in r.warnings)


def test_sampled_run_keeps_what_the_metrics_say() -> None:
    c = costs(1.5)
    tl = sample_timelines(
        c, horizon_s=10 * DAY_S, runs=3, rng=np.random.default_rng(4), lookahead_s=800.0
    )
    m = evaluate_intervals(tl, c, [700.0])
    for run in range(3):
        s = sampled_run(tl, c, 700.0, run=run)
        assert s.progress_useful_s[-1] == pytest.approx(m.useful_s[run, 0])
        assert np.all(np.diff(s.progress_time_s) >= 0)
        up = sum(b - a for a, b in s.up_periods_s)
        assert up == pytest.approx(10 * DAY_S - m.recovering_s[run, 0])


@pytest.mark.slow
def test_bootstrap_interval_covers_the_exact_optimum_about_95_percent_of_the_time() -> None:
    # 12 seeds: with a true 95 % coverage, 10 or more hits has probability 0.98
    c, rel = costs(2.0, 30.0), reliability()
    hits = 0
    for seed in range(12):
        b = estimate_goodput(c, rel, days=20, runs=500, seed=100 + seed).best_interval
        assert b is not None
        hits += b.ci95_low_s <= b.closed_form_s <= b.ci95_high_s
    assert hits >= 10


def test_failures_by_component_follow_their_rates() -> None:
    c = costs(1.0)
    rel = reliability(
        ComponentRate(name="gpu", per_1000_node_days=6.0),
        ComponentRate(name="software", per_1000_node_days=2.0),
    )
    r = estimate_goodput(c, rel, days=30, runs=300, seed=8, resamples=20)
    assert r.monte_carlo is not None
    cf, mc = r.closed_form.interruptions_by_component, r.monte_carlo.interruptions_by_component
    assert cf["gpu"] == pytest.approx(3 * cf["software"])
    assert cf["gpu"] + cf["software"] == pytest.approx(r.closed_form.interruptions)
    for name in ("gpu", "software"):
        assert mc[name] == pytest.approx(cf[name], rel=0.03)
