"""The collectives and the DDP gradient copies of a measured step, timed alone in the step's own
loop, and the topology they calibrate ("in situ": under the scheduler and the load the step
itself runs under).

Derivations, measurements and sources: docs/derivations.md, ``collsim.validate.measure.insitu``.
"""

from __future__ import annotations

import os
import statistics
import time
from typing import Any

from collsim.cluster.topology import load_topology, parse_topology
from collsim.core.errors import ConfigError
from collsim.core.yamlio import parse_yaml_text
from collsim.step.pricing import ClosedPricer
from collsim.validate.data.dataset import Measurements
from collsim.validate.fit.calibrate import calibrate, topology_yaml

__all__ = [
    "PROBE_PREFIX",
    "COPIES_KEY",
    "ddp_probe",
    "fsdp_probe",
    "time_ddp_copies",
    "probe_points",
    "insitu_topology",
]

#: Column prefix of a probe's per-iteration times (``comm:ddp_b1:all_reduce``).
PROBE_PREFIX = "comm:"

#: Column of the DDP gradient copies' per-iteration time.
COPIES_KEY = "ddp_copies"


def _bucket_numels(ddp: Any, bucket_mb: int, grads: list[Any]) -> list[int]:
    """Elements of each bucket torch's reducer all-reduces (private accessor of torch 2.13,
    see :func:`collsim.validate.measure.step.ddp_bucket_count`); without it, the model's gradient
    elements cut into ``bucket_mb`` MiB pieces (what the reducer's size cap makes)."""
    reducer = getattr(ddp, "reducer", None)
    get_buckets = getattr(reducer, "_get_zeros_like_grad_buckets", None)
    if get_buckets is not None:
        return [int(b.buffer().numel()) for b in get_buckets()]
    total = sum(int(g.numel()) for g in grads)
    cap = bucket_mb * 2**20 // 4
    return [min(cap, total - i) for i in range(0, total, cap)]


def ddp_probe(torch: Any, dist: Any, ddp: Any, bucket_mb: int) -> Any:
    """A function that all-reduces one zero buffer per bucket of ``ddp`` (all issued, then
    waited for) and returns ``{"all_reduce": (seconds, [bytes of each call])}``. The bucket
    sizes are read again at each call (the reducer rebuilds its buckets after the first
    backward); the buffers are allocated outside the timed part."""
    buffers: list[Any] = []

    def run() -> dict[str, tuple[float, list[int]]]:
        numels = _bucket_numels(ddp, bucket_mb, [p for p in ddp.parameters()])
        if [b.numel() for b in buffers] != numels:
            buffers[:] = [torch.zeros(n) for n in numels]
        start = time.perf_counter()
        works = [dist.all_reduce(b, async_op=True) for b in buffers]
        for w in works:
            w.wait()
        elapsed = time.perf_counter() - start
        return {"all_reduce": (elapsed, [int(b.numel()) * 4 for b in buffers])}

    return run


def fsdp_probe(torch: Any, dist: Any, unit_numels: list[int]) -> Any:
    """A function that runs the FSDP sketch's collectives for units of ``unit_numels``
    elements (padded to the world size, as
    :class:`~collsim.validate.measure.sketch.FlatShard` pads):
    each unit's all-gather in order, then each unit's reduce-scatter in reverse order, one at a
    time; returns per op the list of ``(seconds, nccl-tests bytes)`` of each call (the full
    buffer's bytes for both, as nccl-tests sizes them)."""
    n = dist.get_world_size()
    padded = [-(-u // n) * n for u in unit_numels]
    fulls = [torch.zeros(p) for p in padded]
    shards = [torch.zeros(p // n) for p in padded]
    gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
    scatter = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor

    def run() -> dict[str, list[tuple[float, int]]]:
        out: dict[str, list[tuple[float, int]]] = {"all_gather": [], "reduce_scatter": []}
        for full, shard in zip(fulls, shards):
            t0 = time.perf_counter()
            gather(full, shard)
            out["all_gather"].append((time.perf_counter() - t0, int(full.numel()) * 4))
        for full, shard in zip(reversed(fulls), reversed(shards)):
            t0 = time.perf_counter()
            scatter(shard, full)
            out["reduce_scatter"].append((time.perf_counter() - t0, int(full.numel()) * 4))
        return out

    return run


def time_ddp_copies(torch: Any, params: list[Any], world_size: int) -> Any:
    """A function that runs the reducer's two gradient passes over ``params``' gradients
    (copy into a flat bucket scaled by 1 / world_size, then copy back) and returns seconds."""
    total = sum(int(p.numel()) for p in params)
    bucket = torch.zeros(total)
    views = []
    offset = 0
    for p in params:
        views.append(bucket[offset : offset + p.numel()].view_as(p))
        offset += p.numel()
    scale = 1.0 / world_size

    def run() -> float:
        grads = [p.grad if p.grad is not None else torch.zeros_like(p) for p in params]
        start = time.perf_counter()
        for view, grad in zip(views, grads):
            torch.mul(grad, scale, out=view)
        for view, grad in zip(views, grads):
            grad.copy_(view)
        return time.perf_counter() - start

    return run


#: Columns of the overlap probe: a fixed compute alone, collectives alone, both at once.
OVERLAP_KEYS = ("overlap:compute", "overlap:comm", "overlap:both")

OVERLAP_GEMM = (512, 12)
"""The overlap probe's compute: 12 fp32 GEMMs of 512 x 512 x 512 (3.2 GFLOP in all; a generic
shape, not the validated model's), longer than the collectives beside it so that they can
hide in it."""


def overlap_probe(torch: Any, dist: Any, numel: int, piece_numel: int = 2**18) -> Any:
    """A function that times, on this rank: the compute of :data:`OVERLAP_GEMM` alone; the
    all-reduce of ``numel`` fp32 elements in pieces of ``piece_numel`` (1 MiB: DDP's bucket
    at 1 MB) issued at once, alone; and both at once (the pieces issued, then the compute,
    then the wait), each after a barrier. Returns the three seconds."""
    dim, count = OVERLAP_GEMM
    a, b = torch.randn(dim, dim), torch.randn(dim, dim)
    pieces = [torch.zeros(min(piece_numel, numel - i)) for i in range(0, numel, piece_numel)]

    def compute() -> None:
        for _ in range(count):
            torch.mm(a, b)

    def comm() -> list[Any]:
        return [dist.all_reduce(p, async_op=True) for p in pieces]

    def run() -> tuple[float, float, float]:
        dist.barrier()
        t0 = time.perf_counter()
        compute()
        alone = time.perf_counter() - t0
        dist.barrier()
        t0 = time.perf_counter()
        for w in comm():
            w.wait()
        comm_s = time.perf_counter() - t0
        dist.barrier()
        t0 = time.perf_counter()
        works = comm()
        compute()
        for w in works:
            w.wait()
        both = time.perf_counter() - t0
        return alone, comm_s, both

    return run


def measured_overlap_cost(report: dict[str, Any]) -> float | None:
    """f - 1 measured by :func:`overlap_probe` (medians, slowest rank): what the collectives
    added to the compute they ran beside, over their time alone, (both - compute) / comm,
    at least 0; None without the probe. PS on one core gives 1, a free core 0."""
    probe = report.get("overlap_probe")
    if not probe or probe.get("comm_s", 0.0) <= 0:
        return None
    return max(0.0, (float(probe["both_s"]) - float(probe["compute_s"])) / float(probe["comm_s"]))


def probe_points(report: dict[str, Any]) -> list[dict[str, Any]]:
    """The in-situ points of a report as collective-table rows (``op``, ``size_bytes``,
    ``time_us``, ...): per DDP mode one all_reduce point at the mean bucket size (the group's
    median time over its calls), per FSDP call kind one point per distinct size (the median
    over iterations of the slowest rank). Empty if the report has no probes."""
    rows: list[dict[str, Any]] = []
    n = int(report["world_size"])
    for mode, probe in (report.get("comm_probe") or {}).items():
        for op, entry in probe.items():
            sizes = [int(s) for s in entry["sizes_bytes"]]
            if not sizes:
                continue
            if mode.startswith("ddp"):
                rows.append(
                    _row(op, statistics.fmean(sizes), entry["median_s"] / len(sizes), n, mode)
                )
                continue
            by_size: dict[int, list[float]] = {}
            for size, t in zip(sizes, entry["call_median_s"]):
                by_size.setdefault(size, []).append(float(t))
            for size, ts in sorted(by_size.items()):
                rows.append(_row(op, size, statistics.median(ts), n, mode))
    return rows


def _row(op: str, size: float, time_s: float, world_size: int, mode: str) -> dict[str, Any]:
    return {
        "op": op,
        "size_bytes": int(round(size)),
        "time_us": time_s * 1e6,
        "world_size": world_size,
        "wrong": 0,
        "mode": mode,
    }


def _second_point(row: dict[str, Any], base: str, nodes: int, gpus_per_node: int) -> dict[str, Any]:
    """An op timed at one size only (one DDP mode): a line needs two points, so the second is
    the base topology's time at twice the size, scaled by timed / base at the timed size (the
    base's shape of the line, through the timed point)."""

    pricer = ClosedPricer(load_topology(base, nodes=nodes, gpus_per_node=gpus_per_node))
    ranks = tuple(range(int(row["world_size"])))
    size = int(row["size_bytes"])
    scale = row["time_us"] * 1e-6 / pricer.cost(row["op"], size, ranks).time_s
    time_s = scale * pricer.cost(row["op"], 2 * size, ranks).time_s
    return _row(row["op"], 2 * size, time_s, int(row["world_size"]), "base line")


def insitu_topology(
    report: dict[str, Any], base: str, *, nodes: int, gpus_per_node: int
) -> tuple[Any, str, str]:
    """The topology ``base`` fitted to the report's in-situ points.

    An op timed at one size only (one DDP mode alone) gets a second point from the base
    topology's line through the timed one (:func:`_second_point`).

    Returns:
        ``(topology, yaml_text, "")``, or ``(None, "", why not)`` when the report has no probes
        or the fit fails.
    """

    rows = probe_points(report)
    if not rows:
        return None, "", "no collectives timed in the step's loop (an older report)"
    for op in sorted({r["op"] for r in rows}):
        mine = [r for r in rows if r["op"] == op]
        if len({r["size_bytes"] for r in mine}) < 2:
            rows.append(_second_point(mine[0], base, nodes, gpus_per_node))
    meas = Measurements(
        rows=rows,
        metadata={
            "backend": report.get("backend"),
            "world_size": int(report["world_size"]),
            "ranks_per_node": gpus_per_node,
            "torch_version": report.get("torch_version"),
            "host": "the step's own loop",
            "date": report.get("config", {}).get("date", ""),
        },
        path="the collectives timed in the step's loop",
    )
    try:
        cal = calibrate(meas, base=base, knees=False)
    except ConfigError as err:
        return None, "", f"in-situ calibration failed: {err}"
    text = topology_yaml(cal, "insitu")
    topo = parse_topology(parse_yaml_text(text), nodes=nodes, gpus_per_node=gpus_per_node)
    return topo, text, ""


def probe_summary(report: dict[str, Any], topology: Any) -> list[str]:
    """One line per probed mode: its collectives' measured time in the step's loop beside
    what ``topology`` prices them at, and the DDP copies."""

    pricer = ClosedPricer(topology)
    ranks = tuple(range(int(report["world_size"])))
    out = []
    for mode, probe in (report.get("comm_probe") or {}).items():
        parts = []
        for op, entry in probe.items():
            sizes = [int(s) for s in entry["sizes_bytes"]]
            priced = sum(pricer.cost(op, s, ranks).time_s for s in sizes)
            parts.append(
                f"{op} {len(sizes)} x {statistics.fmean(sizes) / 1e6:.2f} MB "
                f"{entry['median_s'] * 1e3:.1f} ms (topology {priced * 1e3:.1f})"
            )
        out.append(f"{mode}: " + ", ".join(parts))
    if "ddp_copies_s" in report:
        out.append(f"DDP gradient copies {report['ddp_copies_s'] * 1e3:.1f} ms")
    return out


COMM_THREADS_PER_RANK = 1
"""Runnable gloo threads of a rank while its collective runs: the process group's worker and
the TCP transport loop hand each message to one another (torch ProcessGroupGloo, gloo
``transport/tcp``), so about one of them runs at a time."""


def sharing_factor(report: dict[str, Any]) -> float:
    """1 + the measured overlap cost (:func:`measured_overlap_cost`) when the report has it;
    else from the share of a core the local step got. How much slower a rank's compute and
    its collective run while they overlap than each
    alone, when the CPU the ranks get is shared evenly by their runnable threads (Linux's fair
    scheduler)::

        s      = the share of a core the local step's compute thread got (CPU time / wall)
        G      = CPU (in cores) the ranks' threads can have:
                   C                         if s >= 0.95 (uncontended: every core)
                   s R T                     with sched_autogroup on (the fair share is per
                                             session: more threads do not get it more CPU)
                   C R T / (R T + E),        else, E = C / s - max(R T, C) other runnable
                   with E other threads      threads (the share is per thread)
        f      = min(1, G_alone / (R T)) / min(1, G_both / (R (T + K)))

    C cores, R ranks on the host, T compute threads and K comm threads per rank (G_both: G
    with R K more threads of the ranks). f = 2 for 2 ranks of 1 thread on 2 cores, quiet or
    (with autogroup) loaded: a collective beside the compute costs its whole time; with free
    cores f = 1.
    """

    measured = measured_overlap_cost(report)
    if measured is not None:
        return 1.0 + measured
    cores = int(report.get("cpu_count") or os.cpu_count() or 1)
    ranks = int(report.get("local_world_size", report["world_size"]))
    threads = int(report.get("threads_per_rank", 1))
    share = float(report.get("local_cpu_share", 1.0) or 1.0)
    share = min(1.0, max(share, 1e-3))
    alone_threads = ranks * threads
    both_threads = alone_threads + ranks * COMM_THREADS_PER_RANK

    def cpu_for(n: int) -> float:
        if share >= UNCONTENDED_SHARE:
            return float(cores)
        if report.get("sched_autogroup"):
            return share * alone_threads
        others = max(0.0, cores / share - max(alone_threads, cores))
        return cores * n / (n + others)

    alone = min(1.0, cpu_for(alone_threads) / alone_threads)
    both = min(1.0, cpu_for(both_threads) / both_threads)
    return alone / both


UNCONTENDED_SHARE = 0.95
"""A local step whose thread got at least this share of a core ran uncontended. ASSUMPTION:
on an idle core a single-threaded step's CPU time is within a few % of its wall time (page
faults, interrupts); not measured on an idle host."""


def peer_idle_boost(report: dict[str, Any]) -> float:
    """How much faster a rank's compute runs while the other ranks of its host wait for it
    (a straggler's, once its peers have reached the gradient all-reduce) than in a step where
    every rank computes (the local step, share ``s`` of a core)::

        uncontended (s >= UNCONTENDED_SHARE)   1 (each rank had its core already)
        sched_autogroup on                     min(1 / s, R)   the session's CPU, s R T
                                               cores, now for one rank's T threads
        per thread                             min(1, C / (E + T)) / s, E as in
                                               :func:`sharing_factor`
    """

    share = float(report.get("local_cpu_share", 1.0) or 1.0)
    if share >= UNCONTENDED_SHARE:
        return 1.0
    share = max(share, 1e-3)
    cores = int(report.get("cpu_count") or os.cpu_count() or 1)
    ranks = int(report.get("local_world_size", report["world_size"]))
    threads = int(report.get("threads_per_rank", 1))
    if report.get("sched_autogroup"):
        return max(1.0, min(1.0 / share, float(ranks)))
    others = max(0.0, cores / share - max(ranks * threads, cores))
    return max(1.0, min(1.0, cores / (others + threads)) / share)


def straggler_span_s(local_s: float, extra_s: float, boost: float) -> float:
    """The slowed rank's compute span in a straggler step: ``extra_s`` of its extra work (on
    the wall clock), then a local step's compute, at the local step's speed while its peers
    still compute (until ``local_s``), ``boost`` x faster after (:func:`peer_idle_boost`)::

        local_s + extra_s / boost        if local_s > extra_s
        extra_s + local_s / boost        otherwise
    """
    if local_s > extra_s:
        return local_s + extra_s / boost
    return extra_s + local_s / boost
