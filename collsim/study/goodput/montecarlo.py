"""Seeded Monte Carlo of a training job's timeline: failures, detection, restart, rollback.

Derivations, measurements and sources: docs/derivations.md, ``collsim.study.goodput.montecarlo``.
"""

from __future__ import annotations

import heapq
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
from numpy.typing import NDArray

from collsim.core.errors import ConfigError
from collsim.study.goodput.config import ComponentRate, SparesConfig
from collsim.study.goodput.costs import JobCosts

__all__ = [
    "Timelines",
    "IntervalMetrics",
    "SampledRun",
    "sample_timelines",
    "evaluate_intervals",
    "sampled_run",
]

FloatArray = NDArray[np.float64]
IntArray = NDArray[np.int64]

#: Most failure events drawn in one call (a few hundred MB of arrays).
MAX_EVENTS = 2e7


@dataclass(frozen=True, slots=True, kw_only=True)
class Timelines:
    """When each run was up; independent of the checkpoint interval."""

    horizon_s: float
    lookahead_s: float
    """Failures are drawn up to ``horizon_s + lookahead_s`` to settle the window's last work."""
    failure_times_s: FloatArray
    """(runs, max failures): sorted failure times in [0, H + look-ahead), +inf past the last."""
    component: IntArray
    """(runs, max failures): index of the failed component (-1 past the last failure)."""
    up_start_s: FloatArray
    """(runs, max failures + 1): start of each up period (it may precede 0); column j is the
    period that failure j ended, the last column the one the look-ahead cuts; 0-length where
    there is none."""
    up_end_s: FloatArray
    """(runs, max failures + 1): end of each up period."""
    interruptions: IntArray
    """(runs,): failures inside the window (training or recovering)."""
    recovery_failures: IntArray
    """(runs,): failures inside the window that struck during a recovery."""
    spare_wait_s: FloatArray
    """(runs,): time the window's recoveries waited for spare nodes."""
    spare_shortages: IntArray
    """(runs,): recoveries in the window that had to wait for a spare."""

    @property
    def runs(self) -> int:
        return int(self.up_start_s.shape[0])


def sample_timelines(
    costs: JobCosts,
    *,
    horizon_s: float,
    runs: int,
    rng: np.random.Generator,
    lookahead_s: float = 0.0,
    components: Sequence[ComponentRate] = (),
    spares: SparesConfig | None = None,
) -> Timelines:
    """Draw ``runs`` stationary windows of ``horizon_s`` seconds (module docstring, step 1).

    Args:
        costs: failure rate and recovery time of the job.
        horizon_s: length of each window.
        runs: number of independent runs.
        rng: the only source of randomness.
        lookahead_s: failures are also drawn this long past the window, so that the window's
            last training is known to be kept or lost; it must cover the longest interval
            evaluated plus its stall and background write (:func:`evaluate_intervals` checks).
        components: the failure sources (their rates give each event's component); empty
            means one anonymous source that needs no spares.
        spares: the spare pool (full at the window's start); None or ``nodes=None`` never
            runs out.

    Raises:
        ConfigError: ``runs`` < 1 or a non-positive horizon.
    """
    if runs < 1:
        raise ConfigError(f"must be >= 1, got {runs}", key_path="runs")
    if not horizon_s > 0:
        raise ConfigError(f"must be > 0, got {horizon_s}", key_path="days")
    lam = costs.failure_rate_per_s
    span = horizon_s + max(lookahead_s, 0.0)
    rt = costs.recovery_s
    if lam * span * runs > MAX_EVENTS:
        raise ConfigError(
            f"{lam * span:.3g} failures per run x {runs} runs is more than the "
            f"{MAX_EVENTS:.0e} events the Monte Carlo draws at once; use fewer runs or days",
            key_path="runs",
        )
    if lam > 0:
        since_last = rng.exponential(1.0 / lam, size=runs)
        counts = rng.poisson(lam * span, size=runs)
        rec_end = rt - since_last
    else:
        counts = np.zeros(runs, dtype=np.int64)
        rec_end = np.zeros(runs)
    width = int(counts.max())
    times = rng.uniform(0.0, span, size=(runs, width))
    column = np.arange(width)[None, :]
    present = column < counts[:, None]
    times = np.sort(np.where(present, times, np.inf), axis=1)
    inside = times < horizon_s

    comp = np.full((runs, width), -1, dtype=np.int64)
    needs = np.zeros((runs, width), dtype=np.int64)
    rates = np.array([c.rate_per_node_s for c in components], dtype=np.float64)
    if components and rates.sum() > 0:
        drawn = rng.choice(len(components), size=(runs, width), p=rates / rates.sum())
        comp = np.where(present, drawn, -1)
        fraction = np.array([c.replace_fraction for c in components])
        affected = np.array([c.nodes_affected for c in components], dtype=np.int64)
        replaced = rng.random((runs, width)) < fraction[drawn]
        needs = np.where(present & replaced, affected[drawn], 0)

    waits = np.zeros((runs, width))
    if spares is not None and spares.nodes is not None:
        waits = _spare_waits(times, needs, counts, spares.nodes, spares.repair_hours * 3600.0)

    starts = np.zeros((runs, width + 1))
    ends = np.zeros((runs, width + 1))
    rec_fail = np.zeros(runs, dtype=np.int64)
    for j in range(width):
        t = times[:, j]
        valid = t < span
        is_up = valid & (t >= rec_end)
        starts[:, j] = np.where(is_up, rec_end, 0.0)
        ends[:, j] = np.where(is_up, t, 0.0)
        rec_fail += inside[:, j] & ~is_up
        rec_end = np.where(valid, t + waits[:, j] + rt, rec_end)
    open_end = rec_end < span
    starts[:, width] = np.where(open_end, rec_end, 0.0)
    ends[:, width] = np.where(open_end, span, 0.0)
    return Timelines(
        horizon_s=horizon_s,
        lookahead_s=span - horizon_s,
        failure_times_s=times,
        component=comp,
        up_start_s=starts,
        up_end_s=ends,
        interruptions=inside.sum(axis=1).astype(np.int64),
        recovery_failures=rec_fail,
        spare_wait_s=np.where(inside, waits, 0.0).sum(axis=1),
        spare_shortages=(inside & (waits > 0)).sum(axis=1).astype(np.int64),
    )


def _spare_waits(
    times: FloatArray, needs: IntArray, counts: IntArray, pool_size: int, repair_s: float
) -> FloatArray:
    """Wait for spares at each failure: the pool holds when each spare is next free.

    A failure that needs ``k`` nodes sends its ``k`` nodes to repair (back at ``t + repair``)
    and takes the ``k`` spares that are free first; the recovery waits for the last of them.
    """
    waits = np.zeros(times.shape)
    for r in range(times.shape[0]):
        pool = [0.0] * pool_size
        for j in range(int(counts[r])):
            k = int(needs[r, j])
            if k == 0:
                continue
            t = float(times[r, j])
            for _ in range(k):
                heapq.heappush(pool, t + repair_s)
            ready = max(heapq.heappop(pool) for _ in range(k))
            waits[r, j] = max(0.0, ready - t)
    return waits


@dataclass(frozen=True, slots=True, kw_only=True)
class IntervalMetrics:
    """Per run and per interval: arrays of shape (runs, intervals), seconds."""

    intervals_s: FloatArray
    useful_s: FloatArray
    checkpointing_s: FloatArray
    lost_s: FloatArray
    recovering_s: FloatArray
    horizon_s: float

    @property
    def ettr(self) -> FloatArray:
        """Effective training time ratio of each run at each interval."""
        return self.useful_s / self.horizon_s


def _phases(
    u: FloatArray, tau: float, stall: float, kept_max: FloatArray
) -> tuple[FloatArray, FloatArray, FloatArray]:
    """Training, stall and kept training in the first ``u`` seconds of an up period."""
    period = tau + stall
    whole = np.floor(u / period)
    rest = u - whole * period
    trained = whole * tau + np.minimum(rest, tau)
    stalled = whole * stall + np.clip(rest - tau, 0.0, stall)
    return trained, stalled, np.minimum(trained, kept_max)


def evaluate_intervals(
    timelines: Timelines, costs: JobCosts, intervals_s: Sequence[float] | FloatArray
) -> IntervalMetrics:
    """Useful (kept), checkpointing, lost and recovering time of every run at every interval,
    counted inside the window [0, H].

    Raises:
        ConfigError: an interval <= 0.
        ValueError: an interval longer than the look-ahead the timelines were drawn with allows.
    """
    grid = np.asarray(intervals_s, dtype=np.float64)
    if grid.ndim != 1 or not np.all(grid > 0):
        raise ConfigError("intervals must be > 0", key_path="reliability.checkpoint.interval_s")
    s, w, h = costs.stall_s, costs.background_s, timelines.horizon_s
    if grid.size and float(grid.max()) + s + w > timelines.lookahead_s + 1e-9:
        raise ValueError(
            f"interval {float(grid.max()):g} s + stall + write needs a look-ahead of "
            f"{float(grid.max()) + s + w:g} s, the timelines have {timelines.lookahead_s:g} s"
        )
    start, end = timelines.up_start_s, timelines.up_end_s
    length = end - start
    u0 = np.clip(-start, 0.0, length)
    u1 = np.clip(h - start, 0.0, length)
    up_in_window = (u1 - u0).sum(axis=1)
    shape = (timelines.runs, grid.size)
    useful, ckpt, lost = np.zeros(shape), np.zeros(shape), np.zeros(shape)
    for i, tau in enumerate(grid):
        period = float(tau) + s
        safe = np.floor(np.clip(length - w, 0.0, None) / period) * tau
        t0, s0, k0 = _phases(u0, float(tau), s, safe)
        t1, s1, k1 = _phases(u1, float(tau), s, safe)
        kept = (k1 - k0).sum(axis=1)
        useful[:, i] = kept
        ckpt[:, i] = (s1 - s0).sum(axis=1)
        lost[:, i] = (t1 - t0).sum(axis=1) - kept
    recovering = np.repeat((h - up_in_window)[:, None], grid.size, axis=1)
    return IntervalMetrics(
        intervals_s=grid,
        useful_s=useful,
        checkpointing_s=ckpt,
        lost_s=lost,
        recovering_s=recovering,
        horizon_s=h,
    )


@dataclass(frozen=True, slots=True, kw_only=True)
class SampledRun:
    """One run's timeline at one interval, for drawing."""

    horizon_s: float
    interval_s: float
    up_periods_s: tuple[tuple[float, float], ...]
    """(start, end) of each period the job trained."""
    failure_times_s: tuple[float, ...]
    progress_time_s: FloatArray
    """Elapsed time at each point of the kept-training curve."""
    progress_useful_s: FloatArray
    """Training kept (safe in a checkpoint, or at the end) by that time."""


def sampled_run(
    timelines: Timelines, costs: JobCosts, interval_s: float, run: int = 0
) -> SampledRun:
    """The up periods, failures and kept training of run ``run`` inside its window.

    Each safe checkpoint adds the training of its compute phase that lies in the window, at the
    moment it is safe (a checkpoint safe after the window closes is drawn at its end).
    """
    tau, s, w, h = interval_s, costs.stall_s, costs.background_s, timelines.horizon_s
    period = tau + s
    starts, ends = timelines.up_start_s[run], timelines.up_end_s[run]
    periods: list[tuple[float, float]] = []
    pt: list[float] = [0.0]
    pu: list[float] = [0.0]
    kept = 0.0
    for a, b in zip(starts.tolist(), ends.tolist(), strict=True):
        if b <= a or b <= 0.0 or a >= h:
            continue
        periods.append((max(a, 0.0), min(b, h)))
        n = int(np.floor(max(b - a - w, 0.0) / period))
        for k in range(n):
            phase_start = a + k * period
            share = min(phase_start + tau, h) - max(phase_start, 0.0)
            if share <= 0.0:
                continue
            kept += share
            pt.append(min(max(phase_start + period + w, 0.0), h))
            pu.append(kept)
        if b < h:
            pt.append(b)
            pu.append(kept)
    pt.append(h)
    pu.append(kept)
    times = timelines.failure_times_s[run]
    return SampledRun(
        horizon_s=h,
        interval_s=interval_s,
        up_periods_s=tuple(periods),
        failure_times_s=tuple(float(t) for t in times[times < h]),
        progress_time_s=np.asarray(pt),
        progress_useful_s=np.asarray(pu),
    )
