"""Measure collectives with torch.distributed, the way nccl-tests does, and check every result.

For each op and size: allocate the buffers, run the op once on known data and count the wrong
elements (``#wrong``, summed over ranks), run the warm-ups, then time ``iters`` iterations,
each right after a barrier so that no rank times its wait for a late peer (optionally spread
over ``rounds`` sweeps; ``barrier_each=False`` times back-to-back iterations instead, which
can make a send_recv bimodal: docs/derivations.md, measurements). The time of an
iteration is that of the slowest rank (an all-reduce MAX of the per-rank times), and the
reported time of a size is the median over iterations.

Sizes follow nccl-tests (doc/PERFORMANCE.md): the whole buffer for all_reduce and broadcast, the
gathered output for all_gather, the input for reduce_scatter, the per-rank send buffer for
all_to_all, the message for send_recv. The element count is rounded down to a multiple of the
world size where the op splits the buffer. algbw = size / time; busbw = algbw x factor with
factor 2(n-1)/n for all_reduce, (n-1)/n for all_gather, reduce_scatter and all_to_all, and 1
for broadcast and send_recv (send_recv: each rank sends to rank+1 and receives from rank-1).
On gloo, all_gather and reduce_scatter are timed in place, the layout of nccl-tests' in-place
columns (:data:`~collsim.validate.measure.bench_ops.GLOO_IN_PLACE` says why: gloo does the same
work either way); the measurement's ``in_place`` metadata names the ops timed so.

The data that fills the check buffers is ``value(rank, i) = rank + 1 + (i mod 5)`` in float32:
small integers, so that every sum is exact and a wrong element is an error, not rounding.
"""

from __future__ import annotations

import datetime as _dt
import gc
import os
import platform
import socket
import statistics
import sys
import time
from collections.abc import Callable
from dataclasses import asdict
from typing import Any

from collsim.core.errors import ConfigError
from collsim.validate.data.dataset import COLUMNS, csv_preamble, csv_row, read_measurements
from collsim.validate.measure.bench_memory import (
    PARENT_BYTES,
    RANK_BASE_BYTES,
    RANK_BASE_BYTES_SOURCE,
    _fix_mmap_threshold,
    _return_free_memory,
    available_memory_bytes,
    bench_memory_bytes,
    check_bench_memory,
)
from collsim.validate.measure.bench_ops import (
    _ELEMENT_BYTES,
    BUS_FACTOR,
    OPS,
    BenchConfig,
    BenchPoint,
    BenchResult,
    _Buffers,
    _OpCase,
    bus_factor,
    element_count,
    in_place_ops,
    sizes_between,
)
from collsim.validate.measure.launch import current_scheduling, in_torchrun, run_distributed

__all__ = [
    "OPS",
    "BUS_FACTOR",
    "BenchConfig",
    "BenchPoint",
    "BenchResult",
    "bus_factor",
    "element_count",
    "sizes_between",
    "bench_rank",
    "run_bench",
    "resume_state",
    "steal_share",
    "RANK_BASE_BYTES",
    "RANK_BASE_BYTES_SOURCE",
    "PARENT_BYTES",
    "bench_memory_bytes",
    "available_memory_bytes",
    "check_bench_memory",
]


def _probe_kernels(
    torch: Any, dist: Any, ctx: Any, ops: tuple[str, ...], root: int
) -> dict[str, list[str]]:
    """Names of the backend events (``gloo:...``/``nccl:...``) each op emits under the profiler.

    This is how the bench sees what the backend really runs, e.g. that gloo in torch 2.13
    implements reduce_scatter as an all_reduce (its profile shows ``gloo:all_reduce``). One
    profiler session covers every op (a small buffer each); events are attributed to the op
    whose ``collsim:<op>`` range encloses them.
    """
    # torch is optional (the validate extra): imported where ranks run
    from torch.profiler import ProfilerActivity, profile, record_function

    n = ctx.world_size
    cases = {
        op: _OpCase(torch, dist, op, element_count(op, 4096, n), ctx.rank, n, ctx.device, root)
        for op in ops
    }
    # The profiler prints start/stop lines on stderr; keep them off the user's terminal.
    saved = os.dup(2)
    try:
        with open(os.devnull, "w") as null:
            os.dup2(null.fileno(), 2)
            with profile(activities=[ProfilerActivity.CPU]) as prof:
                for op, case in cases.items():
                    dist.barrier()
                    with record_function(f"collsim:{op}"):
                        case()
                        ctx.sync()
    finally:
        os.dup2(saved, 2)
        os.close(saved)
    events = list(prof.events())
    ranges = [
        (e.name.split(":", 1)[1], e.time_range.start, e.time_range.end)
        for e in events
        if e.name.startswith("collsim:")
    ]
    found: dict[str, set[str]] = {op: set() for op in ops}
    for e in events:
        if not e.name.startswith(f"{ctx.backend}:"):
            continue
        for op, start, end in ranges:
            if start <= e.time_range.start <= end:
                found[op].add(e.name)
    return {op: sorted(names) for op, names in found.items()}


def _time_iterations(
    torch: Any, dist: Any, ctx: Any, fn: Callable[[], None], iters: int, barrier_each: bool = True
) -> list[float]:
    """Per-iteration time in seconds of the slowest rank.

    With ``barrier_each`` (default) a barrier precedes every iteration and only the op is
    timed; otherwise one barrier, then back-to-back iterations, each timed from the end of the
    one before (a blocking collective is itself a synchronisation point).
    """
    times = torch.zeros(iters, dtype=torch.float64, device=ctx.device)
    dist.barrier()
    last = time.perf_counter()
    for i in range(iters):
        if barrier_each:
            dist.barrier()
            last = time.perf_counter()
        fn()
        ctx.sync()
        now = time.perf_counter()
        times[i] = now - last
        last = now
    dist.all_reduce(times, op=dist.ReduceOp.MAX)
    return [float(t) for t in times.cpu()]


def _summary(times_s: list[float]) -> tuple[float, float, float]:
    ordered = sorted(times_s)
    p90 = ordered[min(len(ordered) - 1, int(round(0.9 * (len(ordered) - 1))))]
    return statistics.median(ordered), ordered[0], p90


def _point(op: str, count: int, times_s: list[float], wrong: int, n: int, root: int) -> BenchPoint:
    """The reported figures of one (op, size) from its per-iteration times."""
    median_s, min_s, p90_s = _summary(times_s)
    real_bytes = count * _ELEMENT_BYTES
    algbw = real_bytes / median_s / 1e9 if median_s > 0 else 0.0
    return BenchPoint(
        op=op,
        size_bytes=real_bytes,
        count=count,
        type="float",
        redop="sum" if op in ("all_reduce", "reduce_scatter") else "none",
        root=root if op == "broadcast" else -1,
        time_us=median_s * 1e6,
        min_us=min_s * 1e6,
        p90_us=p90_s * 1e6,
        algbw_gbps=algbw,
        busbw_gbps=algbw * bus_factor(op, n),
        wrong=wrong,
        world_size=n,
        iters=len(times_s),
    )


def _csv_cell(value: Any) -> Any:
    """A value as :func:`collsim.validate.data.dataset.write_measurements` writes it."""
    return f"{value:.9g}" if isinstance(value, float) else value


class _PointSink:
    """Rank 0's side of incremental writing and of the progress line.

    The file gets its metadata lines and the CSV header when the ranks start (unless it is
    resumed: then rows are appended to what is there), and each point as one ``write`` of one
    line on a file opened for appending, flushed at once: a SIGKILL leaves whole rows only.
    The backend kernels are probed after the sweep, so a partial file does not list them; the
    finished file does (the parent rewrites it whole).
    """

    def __init__(self, config: BenchConfig, ctx: Any, total: int):
        self.columns = list(COLUMNS)
        self.total, self.finished = total, 0
        self.started = time.monotonic()
        self.tty = config.progress and sys.stderr.isatty()
        self.fd: int | None = None
        if config.output is not None:
            path = config.output
            fresh = not config.skip or not os.path.exists(path)
            flags = os.O_WRONLY | os.O_CREAT | (os.O_TRUNC if fresh else os.O_APPEND)
            self.fd = os.open(path, flags, 0o644)
            if fresh:
                meta = {
                    "tool": "collsim validate bench",
                    "status": "partial: the run has not finished (validate bench --resume)",
                    "backend": ctx.backend,
                    "world_size": ctx.world_size,
                    "ranks_per_node": ctx.local_world_size,
                    "launcher": ctx.launcher,
                    "host": socket.gethostname(),
                    "date": _dt.datetime.now(_dt.UTC).isoformat(timespec="seconds"),
                    "iters": config.iters,
                    "warmup": config.warmup,
                    "rounds": config.rounds,
                    "timing": _timing(config),
                    "dtype": "float32",
                    "in_place": list(in_place_ops(ctx.backend, config.ops)),
                }

                self._write(csv_preamble(meta))
            self.meta = {"world_size": ctx.world_size, "dtype": "float32", "backend": ctx.backend}

    def _write(self, text: str) -> None:
        if self.fd is not None:
            os.write(self.fd, text.encode())
            os.fsync(self.fd)

    def done(self, point: BenchPoint | None) -> None:
        """One (round, op, size) finished; ``point`` is set when that point is final."""
        self.finished += 1
        if point is not None and self.fd is not None:
            self._write(csv_row(asdict(point), self.meta))
        if self.tty:
            elapsed = time.monotonic() - self.started
            left = elapsed / self.finished * (self.total - self.finished)
            what = f"{point.op} {point.size_bytes} B" if point is not None else ""
            sys.stderr.write(
                f"\rbench: {self.finished}/{self.total} done, {elapsed:.0f} s, "
                f"ETA {left:.0f} s  {what}\x1b[K"
            )
            sys.stderr.flush()

    def close(self) -> None:
        if self.tty:
            sys.stderr.write("\n")
            sys.stderr.flush()
        if self.fd is not None:
            os.close(self.fd)
            self.fd = None


def _timing(config: BenchConfig) -> str:
    return "median over iterations of the slowest rank; " + (
        "barrier before each iteration"
        if config.barrier_each
        else "one barrier, then back-to-back iterations"
    )


def _wrong_elements(dist: Any, ctx: Any, case: Any, wrong_total: Any) -> int:
    """Run ``case`` once on its check data; the wrong elements summed over the ranks."""
    case.fill_check()
    dist.barrier()
    case()
    ctx.sync()
    wrong_total.fill_(case.count_wrong())
    dist.all_reduce(wrong_total)
    return int(wrong_total.item())


def bench_rank(ctx: Any, config: BenchConfig) -> dict[str, Any]:
    """The per-rank body of the bench (every rank returns the same, already reduced, data).

    Args:
        ctx: the :class:`~collsim.validate.measure.launch.RankContext` of this rank.
        config: what to measure.

    Returns:
        ``{"points": [BenchPoint...], "kernels": {op: [event names]}, "overhead": {...},
        "host": ..., "torch_version": ..., ...}``.
    """
    # torch is optional (the validate extra): imported where ranks run
    import torch
    import torch.distributed as dist

    n, rank = ctx.world_size, ctx.rank
    points: list[BenchPoint] = []
    kernels: dict[str, list[str]] = {}
    wrong: dict[tuple[str, int], int] = {}
    samples: dict[tuple[str, int], list[float]] = {}
    wrong_total = torch.zeros(1, dtype=torch.int64, device=ctx.device)
    per_round = -(-config.iters // config.rounds)
    _fix_mmap_threshold()
    in_place = in_place_ops(ctx.backend, config.ops)
    skip = set(config.skip)
    todo_keys = [
        (op, size) for op in config.ops for size in config.sizes_bytes if (op, size) not in skip
    ]
    sink = _PointSink(config, ctx, len(todo_keys) * config.rounds) if rank == 0 else None
    largest = {
        op: max(element_count(op, size, n) for o, size in todo_keys if o == op)
        for op, _ in todo_keys
    }
    buffers: _Buffers | None = None
    held_for = ""
    for round_index in range(config.rounds):
        for key in todo_keys:
            op, size_bytes = key
            count = element_count(op, size_bytes, n)
            if op != held_for:  # one op's buffers at a time: the last op's go first
                buffers = None
                gc.collect()  # anything of the last op caught in a reference cycle
                _return_free_memory()
                buffers = _Buffers.for_op(torch, op, largest[op], n, ctx.device, op in in_place)
                held_for = op
            case = _OpCase(
                torch, dist, op, count, rank, n, ctx.device, config.root, buffers, op in in_place
            )
            if round_index == 0:
                wrong[key] = _wrong_elements(dist, ctx, case, wrong_total)
            case.fill_timing()
            for _ in range(config.warmup):
                case()
            ctx.sync()
            todo = min(per_round, config.iters - len(samples.get(key, [])))
            samples.setdefault(key, []).extend(
                _time_iterations(torch, dist, ctx, case, todo, config.barrier_each)
            )
            del case
            _return_free_memory()
            point = None
            if round_index == config.rounds - 1:
                point = _point(op, count, samples[key], wrong[key], n, config.root)
                points.append(point)
            if sink is not None:
                sink.done(point)
    if sink is not None:
        sink.close()
    buffers = None  # the last op's buffers go before the profiler and the overhead loop
    gc.collect()
    _return_free_memory()
    if config.probe_backend:
        # after the sweep: the profiler's own memory (about 70 MiB per rank, torch 2.13) stays
        # with the process once started, and must not add to the largest buffers' peak
        kernels = _probe_kernels(torch, dist, ctx, config.ops, config.root)
    overhead = _overhead(torch, dist, ctx, config.iters)
    return {
        "points": points,
        "kernels": kernels,
        "overhead": overhead,
        "host": socket.gethostname(),
        "torch_version": torch.__version__,
        "local_world_size": ctx.local_world_size,
        "num_threads": torch.get_num_threads(),
        "scheduling": current_scheduling(),
        "launcher": ctx.launcher,
    }


def _overhead(torch: Any, dist: Any, ctx: Any, iters: int) -> dict[str, float]:
    """The bench's own cost: its timing loop around nothing, and around a 4-byte all_reduce."""
    noop = _time_iterations(torch, dist, ctx, lambda: None, max(iters, 10), barrier_each=True)
    one = torch.zeros(1, dtype=torch.float32, device=ctx.device)
    tiny = _time_iterations(torch, dist, ctx, lambda: dist.all_reduce(one), max(iters, 10))
    return {
        "noop_us": statistics.median(noop) * 1e6,
        "all_reduce_4B_us": statistics.median(tiny) * 1e6,
    }


# -------------------------------------------------------------------------------- parent side


def _load_average() -> list[float] | None:
    """The host's 1-, 5- and 15-minute load averages (None where the OS has none): how busy
    the machine was, beside the figures measured on it."""
    try:
        return [round(v, 2) for v in os.getloadavg()]
    except OSError:
        return None


def _cpu_jiffies() -> tuple[int, int] | None:
    """(steal, total) CPU time of the host from /proc/stat (Linux), or None elsewhere."""
    try:
        with open("/proc/stat") as stat:
            fields = stat.readline().split()
    except OSError:
        return None
    if not fields or fields[0] != "cpu" or len(fields) < 9:
        return None
    values = [int(v) for v in fields[1:]]
    return values[7], sum(values[:8])  # guest time is already inside user time


def steal_share(start: tuple[int, int] | None, end: tuple[int, int] | None) -> float | None:
    """Share of the CPU time between two :func:`_cpu_jiffies` readings that the hypervisor gave
    to other guests (``steal`` in /proc/stat): how much a virtual machine's neighbours took."""
    if start is None or end is None or end[1] <= start[1]:
        return None
    return round((end[0] - start[0]) / (end[1] - start[1]), 4)


def resume_state(
    path: str, config: BenchConfig, *, backend: str, world_size: int | None
) -> tuple[tuple[tuple[str, int], ...], list[dict[str, Any]]]:
    """What a partial bench file already holds: the (op, size) pairs to skip, and its rows.

    A missing file, or one without rows yet, resumes from nothing. The file must have been
    measured the same way (backend, world size, iters, warmup, rounds, timing).

    Raises:
        ConfigError: the file was measured differently, or is not a bench CSV.
    """

    if not os.path.exists(path):
        return (), []
    try:
        meas = read_measurements(path)
    except ConfigError as exc:
        if "no measured rows" in str(exc):
            return (), []
        raise
    meta = meas.metadata
    wanted: dict[str, Any] = {
        "backend": backend,
        "iters": config.iters,
        "warmup": config.warmup,
        "rounds": config.rounds,
        "timing": _timing(config),
    }
    if world_size is not None:
        wanted["world_size"] = world_size
    for key, value in wanted.items():
        if key in meta and meta[key] != value:
            raise ConfigError(
                f"cannot resume: it was measured with {key} {meta[key]!r}, this run asks "
                f"for {value!r} (use the same options, or another -o)",
                file=path,
            )
    n = meas.world_size
    done = {(str(r["op"]), int(r["size_bytes"])) for r in meas.rows}
    skip = tuple(
        (op, size)
        for op in config.ops
        for size in config.sizes_bytes
        if (op, element_count(op, size, n) * _ELEMENT_BYTES) in done
    )
    return skip, list(meas.rows)


def run_bench(
    config: BenchConfig,
    *,
    world_size: int | None,
    backend: str = "gloo",
    timeout_s: float = 600.0,
    realtime: bool = False,
) -> tuple[BenchResult, bool]:
    """Run the bench on local spawned ranks, or on this torchrun job.

    Args:
        config: what to measure.
        world_size: ranks to spawn (ignored under torchrun).
        backend: ``"gloo"`` or ``"nccl"``.
        timeout_s: deadline of the whole run (spawn) and the process-group timeout.
        realtime: run the ranks under SCHED_RR (see :mod:`collsim.validate.measure.launch`).

    Returns:
        ``(result, is_reporter)``: the measurement with its metadata, and whether this process
        should print and write files (false on torchrun ranks other than 0).

    Raises:
        RankFailure: a rank failed or the run timed out (the message names the rank).
    """
    if world_size is not None and not in_torchrun():
        check_bench_memory(config, world_size, backend)
    started = _dt.datetime.now(_dt.UTC)
    load_start = _load_average()
    jiffies_start = _cpu_jiffies()
    out, is_reporter = run_distributed(
        bench_rank,
        world_size,
        args=(config,),
        backend=backend,
        timeout_s=timeout_s,
        realtime=realtime,
    )
    n = out["points"][0].world_size if out["points"] else (world_size or 0)
    metadata: dict[str, Any] = {
        "tool": "collsim validate bench",
        "backend": backend,
        "world_size": n,
        "ranks_per_node": out["local_world_size"],
        "num_nodes": max(1, n // max(1, out["local_world_size"])),
        "launcher": out["launcher"],
        "torch_version": out["torch_version"],
        "host": out["host"],
        "platform": platform.platform(),
        "cpu_count": os.cpu_count(),
        "threads_per_rank": out["num_threads"],
        "scheduling": out["scheduling"],
        "date": started.isoformat(timespec="seconds"),
        "iters": config.iters,
        "warmup": config.warmup,
        "rounds": config.rounds,
        "timing": _timing(config),
        "dtype": "float32",
        "in_place": list(in_place_ops(backend, config.ops)),
        "kernels": out["kernels"],
        "overhead_noop_us": round(out["overhead"]["noop_us"], 3),
        "overhead_all_reduce_4B_us": round(out["overhead"]["all_reduce_4B_us"], 3),
        "duration_s": round((_dt.datetime.now(_dt.UTC) - started).total_seconds(), 1),
        "load_average_start": load_start,
        "load_average_end": _load_average(),
        "cpu_steal_share": steal_share(jiffies_start, _cpu_jiffies()),
    }
    return BenchResult(points=list(out["points"]), metadata=metadata), is_reporter
