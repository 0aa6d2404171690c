"""Seeded Monte Carlo of a training job's timeline: failures, detection, restart, rollback.

It samples the model of :mod:`collsim.goodput.closed_form` event by event, plus what the closed
form leaves out: which component failed, correlated events that take many nodes at once, and a
finite pool of spare nodes (a failed node comes back after its repair time; a restart that
needs more spares than the pool holds waits for repairs).

The sampling is split in two so that every checkpoint interval sees the same failures (common
random numbers, which makes the best interval far less noisy):

1. :func:`sample_timelines` draws, per run, the failure times (a Poisson process of rate lam
   over the horizon: a Poisson count, then sorted uniform times), the failed component, the
   spare waits, and from them when the job was up. Whether a failure strikes while the job
   trains or while it recovers does not depend on the interval, because a recovery always
   takes ``D + R`` (plus any wait for spares) from the failure that started it.
2. :func:`evaluate_intervals` cuts each up period into ``tau`` of training and ``s`` of stall;
   a checkpoint is safe ``W`` after its stall; a failure keeps only the safe checkpoints. The
   up period cut by the horizon keeps all its training (the job saves when it ends).

Randomness comes only from the ``numpy.random.Generator`` passed in.
"""

from __future__ import annotations

import heapq
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
from numpy.typing import NDArray

from collsim.errors import ConfigError
from collsim.goodput.config import ComponentRate, SparesConfig
from collsim.goodput.costs import JobCosts

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


@dataclass(frozen=True, slots=True, kw_only=True)
class Timelines:
    """When each run was up; independent of the checkpoint interval."""

    horizon_s: float
    failure_times_s: FloatArray
    """(runs, max failures): sorted failure times, +inf past a run's last failure."""
    component: IntArray
    """(runs, max failures): index of the failed component (-1 past the last failure)."""
    up_s: FloatArray
    """(runs, max failures): length of the up period the failure ended (0 if it struck a
    recovery)."""
    final_up_s: FloatArray
    """(runs,): the up period the horizon cut (0 when the run ends while recovering)."""
    interruptions: IntArray
    """(runs,): failures that struck the job (training or recovering)."""
    recovery_failures: IntArray
    """(runs,): failures that struck during a recovery."""
    spare_wait_s: FloatArray
    """(runs,): time recoveries waited for spare nodes."""
    spare_shortages: IntArray
    """(runs,): recoveries that had to wait for a spare."""

    @property
    def runs(self) -> int:
        return int(self.up_s.shape[0])


def sample_timelines(
    costs: JobCosts,
    *,
    horizon_s: float,
    runs: int,
    rng: np.random.Generator,
    components: Sequence[ComponentRate] = (),
    spares: SparesConfig | None = None,
) -> Timelines:
    """Draw ``runs`` timelines of ``horizon_s`` seconds (module docstring, step 1).

    Args:
        costs: failure rate and recovery time of the job.
        horizon_s: length of each run.
        runs: number of independent runs.
        rng: the only source of randomness.
        components: the failure sources (their rates give each event's component); empty
            means one anonymous source that needs no spares.
        spares: the spare pool; None or ``nodes=None`` never runs out.

    Raises:
        ConfigError: ``runs`` < 1 or a non-positive horizon.
    """
    if runs < 1:
        raise ConfigError(f"must be >= 1, got {runs}", key_path="runs")
    if not horizon_s > 0:
        raise ConfigError(f"must be > 0, got {horizon_s}", key_path="days")
    lam = costs.failure_rate_per_s
    counts = rng.poisson(lam * horizon_s, size=runs) if lam > 0 else np.zeros(runs, np.int64)
    width = int(counts.max()) if runs else 0
    times = rng.uniform(0.0, horizon_s, size=(runs, width))
    column = np.arange(width)[None, :]
    present = column < counts[:, None]
    times = np.sort(np.where(present, times, np.inf), axis=1)

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

    rt = costs.recovery_s
    rec_end = np.zeros(runs)
    up = np.zeros((runs, width))
    rec_fail = np.zeros(runs, dtype=np.int64)
    for j in range(width):
        t = times[:, j]
        valid = t < horizon_s
        is_up = valid & (t >= rec_end)
        up[:, j] = np.where(is_up, t - rec_end, 0.0)
        rec_fail += valid & ~is_up
        rec_end = np.where(valid, t + waits[:, j] + rt, rec_end)
    final = np.clip(horizon_s - rec_end, 0.0, None)
    return Timelines(
        horizon_s=horizon_s,
        failure_times_s=times,
        component=comp,
        up_s=up,
        final_up_s=final,
        interruptions=counts.astype(np.int64),
        recovery_failures=rec_fail,
        spare_wait_s=waits.sum(axis=1),
        spare_shortages=(waits > 0).sum(axis=1).astype(np.int64),
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


def _split_period(
    length: FloatArray, tau: float, stall: float
) -> tuple[FloatArray, FloatArray, FloatArray]:
    """Whole periods, training time and stall time inside ``length`` seconds of up time."""
    period = tau + stall
    whole = np.floor(length / period)
    rest = length - whole * period
    trained = whole * tau + np.minimum(rest, tau)
    stalled = whole * stall + np.clip(rest - tau, 0.0, stall)
    return whole, trained, stalled


def evaluate_intervals(
    timelines: Timelines, costs: JobCosts, intervals_s: Sequence[float] | FloatArray
) -> IntervalMetrics:
    """Useful, checkpointing, lost and recovering time of every run at every interval."""
    grid = np.asarray(intervals_s, dtype=np.float64)
    if grid.ndim != 1 or not np.all(grid > 0):
        raise ConfigError("intervals must be > 0", key_path="reliability.checkpoint.interval_s")
    s, w = costs.stall_s, costs.background_s
    x, f = timelines.up_s, timelines.final_up_s
    up_total = x.sum(axis=1) + f
    shape = (timelines.runs, grid.size)
    useful, ckpt, lost = np.zeros(shape), np.zeros(shape), np.zeros(shape)
    for i, tau in enumerate(grid):
        period = tau + s
        safe = np.floor(np.clip(x - w, 0.0, None) / period)
        kept = tau * safe.sum(axis=1)
        _, trained, stalled = _split_period(x, float(tau), s)
        _, f_trained, f_stalled = _split_period(f, float(tau), s)
        useful[:, i] = kept + f_trained
        ckpt[:, i] = stalled.sum(axis=1) + f_stalled
        lost[:, i] = trained.sum(axis=1) - kept
    recovering = np.repeat((timelines.horizon_s - up_total)[:, None], grid.size, axis=1)
    return IntervalMetrics(
        intervals_s=grid,
        useful_s=useful,
        checkpointing_s=ckpt,
        lost_s=lost,
        recovering_s=recovering,
        horizon_s=timelines.horizon_s,
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
    """The up periods, failures and kept training of run ``run`` (module docstring, step 2)."""
    tau, s, w = interval_s, costs.stall_s, costs.background_s
    period = tau + s
    times = timelines.failure_times_s[run]
    times = times[np.isfinite(times)]
    lengths = timelines.up_s[run, : times.size]
    periods: list[tuple[float, float]] = []
    pt: list[float] = [0.0]
    pu: list[float] = [0.0]
    kept = 0.0
    for t, length in zip(times, lengths, strict=True):
        if length <= 0:
            continue
        start = float(t - length)
        periods.append((start, float(t)))
        n = int(np.floor(max(length - w, 0.0) / period))
        commits = start + w + period * np.arange(1, n + 1)
        pt.extend(commits.tolist())
        pu.extend((kept + tau * np.arange(1, n + 1)).tolist())
        kept += tau * n
        pt.append(float(t))
        pu.append(kept)
    final = float(timelines.final_up_s[run])
    if final > 0:
        start = timelines.horizon_s - final
        periods.append((start, timelines.horizon_s))
        n = int(np.floor(final / period))
        pt.extend((start + period * np.arange(1, n + 1)).tolist())
        pu.extend((kept + tau * np.arange(1, n + 1)).tolist())
        kept += tau * n + min(final - n * period, tau)
        pt.append(timelines.horizon_s)
        pu.append(kept)
    else:
        pt.append(timelines.horizon_s)
        pu.append(kept)
    return SampledRun(
        horizon_s=timelines.horizon_s,
        interval_s=interval_s,
        up_periods_s=tuple(periods),
        failure_times_s=tuple(float(t) for t in times),
        progress_time_s=np.asarray(pt),
        progress_useful_s=np.asarray(pu),
    )
