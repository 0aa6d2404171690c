"""How much ranks that share a host slow one another: the concurrency probe that
``collsim validate compute`` runs (one process per core, a compute and a memory-bound kernel mix,
on cold operands) and :func:`cpu_share`, the factor ``validate step`` divides a profile's rates
by when its ranks share the cores.
"""

from __future__ import annotations

import multiprocessing as mp
import queue
import statistics
import time
from typing import Any

from collsim.validate.measure.cold import COLD_BYTES, _slot

__all__ = ["PROBE_KINDS", "concurrency_slowdown", "cpu_share"]


PROBE_KINDS = ("compute", "memory")
"""The concurrency probe's two kernel mixes: ``compute``, fp32 GEMMs of 400 x 400 x 400; and
``memory``, a streaming add of 4 MiB vectors; each on cold operands into cold results."""


def _probe_worker(kind: str, iters: int, start: Any, out: Any) -> None:
    """One of :data:`PROBE_KINDS` on cold operands into cold results, as the rest of the
    profile times its kernels (views cycling through pools past the core's own cache), timed
    (runs in its own process).

    Ranks on separate cores share the last-level cache and the memory bandwidth, so what they
    cost one another depends on the traffic that reaches those, and differs between GEMMs
    (operands reused from the core's cache) and streaming kernels (docs/derivations.md,
    measurements)."""
    # torch is optional (the validate extra): imported where ranks run
    import torch

    torch.set_num_threads(1)
    side, elems = 400, 1 << 20
    mats = torch.randn(16 * 2**20 // 4)  # 16 MiB of 400 x 400 fp32 triples
    vecs = torch.randn(COLD_BYTES // 4)  # 64 MiB of 4 MiB vector triples
    n_mats, n_vecs = mats.numel() // (3 * side * side), vecs.numel() // (3 * elems)

    def once(i: int) -> None:
        if kind == "compute":
            a, b, c = (v.view(side, side) for v in _slot(mats, i % n_mats, side * side, 3))
            torch.mm(a, b, out=c)
        else:
            x, y, z = _slot(vecs, i % n_vecs, elems, 3)
            torch.add(x, y, out=z)

    once(0)
    start.wait()
    t0 = time.perf_counter()
    for i in range(iters):
        once(i)
    out.put(time.perf_counter() - t0)


def concurrency_slowdown(
    processes: int, kind: str = "compute", iters: int = 400, timeout_s: float = 120.0
) -> float:
    """How much slower one process of ``processes`` running the ``kind`` mix
    (:data:`PROBE_KINDS`) at once is than one running alone (shared last-level cache, memory
    bandwidth and, on a VM, whatever the vCPUs share underneath): median concurrent time over
    the solo time. Measured, not assumed; ``validate step`` divides a profile's compute rates
    by the ``compute`` one and its memory-bound rates by the ``memory`` one for ranks that run
    at the same time on separate cores."""

    if kind not in PROBE_KINDS:
        raise ValueError(f"kind must be one of {', '.join(PROBE_KINDS)}, got {kind!r}")
    ctx = mp.get_context("spawn")

    def run(n: int) -> list[float]:
        start, out = ctx.Event(), ctx.Queue()
        procs = [
            ctx.Process(target=_probe_worker, args=(kind, iters, start, out)) for _ in range(n)
        ]
        for p in procs:
            p.start()
        time.sleep(2.0)  # let every process import torch before the start signal
        start.set()
        times: list[float] = []
        deadline = time.monotonic() + timeout_s
        try:
            while len(times) < n:
                if time.monotonic() > deadline:
                    raise TimeoutError(f"concurrency probe: no result within {timeout_s} s")
                if any(p.exitcode not in (None, 0) for p in procs):
                    raise RuntimeError("concurrency probe: a worker process failed")
                try:
                    times.append(out.get(timeout=1.0))
                except queue.Empty:
                    continue
        finally:
            for p in procs:
                p.join(timeout=5.0)
                if p.is_alive():
                    p.terminate()
        return times

    solo = statistics.median(run(1) + run(1))
    together = statistics.median(run(processes))
    return max(1.0, together / solo)


def cpu_share(
    ranks_per_node: int,
    threads_per_rank: int,
    cores: int,
    profile_threads: int,
    concurrent_slowdown: float = 1.0,
) -> float:
    """How much slower each rank computes than the profile measured: the ranks' threads over
    the cores when they exceed them (the OS time-slices the cores evenly), else 1; relative to
    the threads the profile was timed with (its rates are per ``profile_threads`` threads);
    and, when more than one thread is busy, x the profile's measured ``concurrent_slowdown``
    (threads on separate cores share the last-level cache and the memory bandwidth)::

        share = max(1, ranks_per_node x threads_per_rank / cores)
                x profile_threads / threads_per_rank   (only when the rank has fewer threads)
    """
    busy = ranks_per_node * threads_per_rank
    share = max(1.0, busy / max(1, cores))
    if threads_per_rank < profile_threads:
        share *= profile_threads / threads_per_rank
    if busy > 1:
        # threads on separate cores still share the cache and memory: the measured slowdown
        # of ``cores`` concurrent processes (a profile's ``concurrent_slowdown``)
        share *= concurrent_slowdown
    return share
