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

The data that fills the check buffers is ``value(rank, i) = rank + 1 + (i mod 5)`` in float32:
small integers, so that every sum is exact and a wrong element is an error, not rounding.
"""

from __future__ import annotations

import ctypes
import datetime as _dt
import functools
import os
import platform
import socket
import statistics
import sys
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from typing import Any, cast

from collsim.core.errors import ConfigError
from collsim.core.units import parse_size
from collsim.validate.data.dataset import COLUMNS, csv_preamble, csv_row, read_measurements
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
]

#: The ops the bench knows, in nccl-tests naming.
OPS = ("all_reduce", "all_gather", "reduce_scatter", "broadcast", "all_to_all", "send_recv")

#: busbw / algbw as a function of the world size n (nccl-tests doc/PERFORMANCE.md).
BUS_FACTOR: dict[str, Callable[[int], float]] = {
    "all_reduce": lambda n: 2.0 * (n - 1) / n,
    "all_gather": lambda n: (n - 1) / n,
    "reduce_scatter": lambda n: (n - 1) / n,
    "all_to_all": lambda n: (n - 1) / n,
    "broadcast": lambda n: 1.0,
    "send_recv": lambda n: 1.0,
}

_SPLIT_OPS = frozenset({"all_gather", "reduce_scatter", "all_to_all"})
_ELEMENT_BYTES = 4  # float32


def bus_factor(op: str, world_size: int) -> float:
    """nccl-tests' busbw factor of ``op`` for ``world_size`` ranks."""
    return BUS_FACTOR[op](world_size)


def element_count(op: str, size_bytes: int, world_size: int) -> int:
    """float32 elements of the op's nccl-tests buffer, rounded down to a multiple of n if split."""
    count = size_bytes // _ELEMENT_BYTES
    if op in _SPLIT_OPS:
        count -= count % world_size
    return count


def sizes_between(min_bytes: int | str, max_bytes: int | str, factor: int) -> list[int]:
    """Sizes ``b, b*f, b*f^2, ... <= e`` as nccl-tests' ``-b -e -f``.

    Raises:
        ValueError: a size does not parse, min > max, or factor < 2.
    """
    lo, hi = parse_size(min_bytes), parse_size(max_bytes)
    if factor < 2:
        raise ValueError(f"factor must be >= 2, got {factor}")
    if lo < 1 or lo > hi:
        raise ValueError(f"need 1 <= min <= max, got min {lo} and max {hi}")
    sizes = []
    size = lo
    while size <= hi:
        sizes.append(size)
        size *= factor
    return sizes


@dataclass(frozen=True, slots=True, kw_only=True)
class BenchConfig:
    """What to measure."""

    ops: tuple[str, ...] = OPS
    sizes_bytes: tuple[int, ...] = (1 << 10, 1 << 20)
    iters: int = 20
    """Timed iterations per size."""
    warmup: int = 5
    """Untimed iterations per size (per round), after the check and before timing."""
    rounds: int = 1
    """Sweep all ops and sizes this many times, timing iters/rounds iterations of each point
    per sweep: a burst of load from other processes then hits a few samples of many points
    instead of all samples of a few (the median is taken over all samples of a point)."""
    root: int = 0
    """Root of broadcast."""
    barrier_each: bool = True
    """A barrier before every timed iteration, only the op timed (default); False: one
    barrier, then back-to-back iterations, each timed from the end of the one before."""
    probe_backend: bool = True
    """Record which backend kernels each op runs (torch profiler event names), once per op."""
    output: str | None = None
    """A ``.csv`` file rank 0 writes as it goes: metadata lines first, then each point as soon
    as it is measured (appended and flushed), so a bench that is killed keeps every finished
    point. The parent rewrites it with the whole metadata at the end (:func:`run_bench`)."""
    skip: tuple[tuple[str, int], ...] = ()
    """(op, requested size) pairs already in ``output``: not measured again (``--resume``)."""
    progress: bool = False
    """Rank 0 draws a progress line (points done, ETA) on stderr if that is a terminal."""

    def __post_init__(self) -> None:
        unknown = [op for op in self.ops if op not in OPS]
        if unknown:
            raise ValueError(f"unknown op(s) {', '.join(unknown)}; choose from {', '.join(OPS)}")
        if self.iters < 1 or self.warmup < 0 or not 1 <= self.rounds <= self.iters:
            raise ValueError(
                f"need iters >= 1, warmup >= 0 and 1 <= rounds <= iters, got "
                f"{self.iters}, {self.warmup}, {self.rounds}"
            )


@dataclass(frozen=True, slots=True, kw_only=True)
class BenchPoint:
    """One measured (op, size): times are of the slowest rank, over ``iters`` iterations."""

    op: str
    size_bytes: int
    count: int
    type: str
    redop: str
    root: int
    time_us: float
    """Median over iterations of the slowest rank's time."""
    min_us: float
    p90_us: float
    algbw_gbps: float
    busbw_gbps: float
    wrong: int
    """Elements that differed from the expected value in the check run, summed over ranks."""
    world_size: int
    iters: int


@dataclass
class BenchResult:
    """Measured points plus the metadata needed to compare them later."""

    points: list[BenchPoint]
    metadata: dict[str, Any] = field(default_factory=dict)

    def rows(self) -> list[dict[str, Any]]:
        """The points as plain dicts (one per row of the CSV)."""
        return [asdict(p) for p in self.points]


# ---------------------------------------------------------------------------------- rank side


def _values(torch: Any, rank: int, start: int, count: int, device: str) -> Any:
    idx = torch.arange(start, start + count, device=device, dtype=torch.int64)
    return (idx % 5 + (rank + 1)).to(torch.float32)


def _single(dist: Any, name: str, legacy: str) -> Callable[..., Any]:
    """The flat-tensor form of all_gather / reduce_scatter under the name this torch prefers.

    torch 2.13 offers ``all_gather_single`` and ``reduce_scatter_single`` and keeps the older
    ``all_gather_into_tensor`` and ``reduce_scatter_tensor`` as deprecated wrappers around them
    (a FutureWarning, then the ``*_single`` call); a torch without ``*_single`` has only the
    older names. ``all_to_all_single`` has had that name all along and needs no lookup.
    """
    fn: Callable[..., Any] = getattr(dist, name, None) or getattr(dist, legacy)
    return fn


#: Elements per block when the check data are made and compared: 256 Ki float32 (1 MiB), so
#: that the check of a large size needs a few blocks of scratch memory (int64 indices and
#: float32 values, a few MiB per rank), not several copies of it.
_CHECK_BLOCK = 1 << 18


class _Buffers:
    """The send and receive buffers of a rank for one op, sized for its largest point and
    reused by each of its sizes, as nccl-tests holds them (``sendbuff`` and ``recvbuff``,
    nccl-tests common.cu): the bench's memory does not grow with the number of sizes. An op
    that works in place (all_reduce, broadcast) has no receive buffer."""

    def __init__(
        self, torch: Any, max_count: int, device: str, recv_count: int | None = None
    ) -> None:
        self.send = torch.empty(max_count, dtype=torch.float32, device=device)
        count = max_count if recv_count is None else recv_count
        self.recv = torch.empty(count, dtype=torch.float32, device=device)

    @classmethod
    def for_op(cls, torch: Any, op: str, max_count: int, n: int, device: str) -> _Buffers:
        """Buffers for ``op`` up to ``max_count`` elements: the input and the output sizes of
        nccl-tests (all_gather sends a 1/n chunk, reduce_scatter receives one)."""
        chunk = max_count // n if op in _SPLIT_OPS else max_count
        match op:
            case "all_reduce" | "broadcast":
                return cls(torch, max_count, device, recv_count=0)
            case "all_gather":
                return cls(torch, chunk, device, recv_count=max_count)
            case "reduce_scatter":
                return cls(torch, max_count, device, recv_count=chunk)
        return cls(torch, max_count, device)


class _OpCase:
    """Buffers, the op call and the expected result of one op at one size on one rank."""

    def __init__(
        self,
        torch: Any,
        dist: Any,
        op: str,
        count: int,
        rank: int,
        n: int,
        device: str,
        root: int,
        buffers: _Buffers | None = None,
    ) -> None:
        self.torch, self.dist, self.op = torch, dist, op
        self.count, self.rank, self.n, self.device, self.root = count, rank, n, device, root
        chunk = count // n if op in _SPLIT_OPS else count
        self.chunk = chunk
        if buffers is None:
            buffers = _Buffers(torch, count, device)
        send, recv = buffers.send, buffers.recv
        match op:
            case "all_reduce" | "broadcast":
                self.inp = send[:count]
                self.out = self.inp
            case "all_gather":
                self.inp, self.out = send[:chunk], recv[:count]
            case "reduce_scatter":
                self.inp, self.out = send[:count], recv[:chunk]
            case "all_to_all" | "send_recv":
                self.inp, self.out = send[:count], recv[:count]
            case _:
                raise ValueError(f"unknown op {op}")
        self._call = self._make_call()

    def _make_call(self) -> Callable[[], None]:
        dist, inp, out = self.dist, self.inp, self.out
        match self.op:
            case "all_reduce":
                return lambda: dist.all_reduce(inp)
            case "broadcast":
                return lambda: dist.broadcast(inp, src=self.root)
            case "all_gather":
                fn = _single(dist, "all_gather_single", "all_gather_into_tensor")
                return lambda: fn(out, inp)
            case "reduce_scatter":
                fn = _single(dist, "reduce_scatter_single", "reduce_scatter_tensor")
                return lambda: fn(out, inp)
            case "all_to_all":
                return lambda: dist.all_to_all_single(out, inp)
            case _:  # send_recv: a ring shift, as nccl-tests sendrecv_perf
                dst, src = (self.rank + 1) % self.n, (self.rank - 1) % self.n

                def shift() -> None:
                    if self.n == 1:
                        out.copy_(inp)
                        return
                    works = [dist.isend(inp, dst), dist.irecv(out, src)]
                    for work in works:
                        work.wait()

                return shift

    def __call__(self) -> None:
        self._call()

    def fill_check(self) -> None:
        """Put the known data into the input buffer (block by block)."""
        torch, r = self.torch, self.rank
        first = r * self.chunk if self.op == "all_gather" else 0
        length = self.inp.numel()
        for a in range(0, length, _CHECK_BLOCK):
            b = min(length, a + _CHECK_BLOCK)
            self.inp[a:b].copy_(_values(torch, r, first + a, b - a, self.device))

    def fill_timing(self) -> None:
        """Zeros: sums stay finite however many iterations run."""
        self.inp.zero_()

    def _expected(self, a: int, b: int) -> Any:
        """The expected output elements ``a`` to ``b`` (``[a, b)``)."""
        torch, n, dev, chunk = self.torch, self.n, self.device, self.chunk
        match self.op:
            case "all_reduce":
                return sum(_values(torch, q, a, b - a, dev) for q in range(n))
            case "broadcast":
                return _values(torch, self.root, a, b - a, dev)
            case "reduce_scatter":
                start = self.rank * chunk + a
                return sum(_values(torch, q, start, b - a, dev) for q in range(n))
            case "all_gather" | "all_to_all":
                # element i came from rank q = i // chunk: its element i (all_gather) or its
                # element rank x chunk + i % chunk (all_to_all)
                idx = torch.arange(a, b, device=dev, dtype=torch.int64)
                source = idx // chunk
                at = idx if self.op == "all_gather" else self.rank * chunk + idx % chunk
                return (at % 5 + source + 1).to(torch.float32)
            case _:
                return _values(torch, (self.rank - 1) % n, a, b - a, dev)

    def count_wrong(self) -> int:
        """Elements of the output that differ from the expected values (block by block)."""
        length = self.out.numel()
        if self.count == 0 or length == 0:
            return 0
        wrong = 0
        for a in range(0, length, _CHECK_BLOCK):
            b = min(length, a + _CHECK_BLOCK)
            wrong += int((self.out[a:b] != self._expected(a, b)).sum().item())
        return wrong


@functools.cache
def _malloc_trim() -> Callable[[int], int] | None:
    """glibc's ``malloc_trim`` (None where the C library has none: macOS, musl)."""
    try:
        fn = ctypes.CDLL(None).malloc_trim
    except (AttributeError, OSError):
        return None
    fn.argtypes, fn.restype = [ctypes.c_size_t], ctypes.c_int
    return cast(Callable[[int], int], fn)


#: glibc ``mallopt`` parameter number of the mmap threshold (``M_MMAP_THRESHOLD`` in malloc.h).
_M_MMAP_THRESHOLD = -3
#: Blocks from this size up are mapped on their own and unmapped when freed (glibc's default
#: starting threshold, 128 KiB; ``DEFAULT_MMAP_THRESHOLD_MIN`` in glibc's malloc/malloc.c).
_MMAP_THRESHOLD_BYTES = 128 * 1024


def _fix_mmap_threshold() -> None:
    """Keep glibc's mmap threshold where it starts (:data:`_MMAP_THRESHOLD_BYTES`) for the rest
    of this rank. By default the threshold rises to the size of each mapped block that is freed,
    up to 32 MiB (``DEFAULT_MMAP_THRESHOLD_MAX``), so that after a point of a few MiB the
    backend's per-call temporaries of the next sizes land in the heaps of the threads that made
    them; a fixed threshold (setting it turns the dynamic rise off: mallopt(3)) maps every
    block of a size that matters and returns it to the system when it is freed."""
    try:
        mallopt = ctypes.CDLL(None).mallopt
    except (AttributeError, OSError):  # not glibc (macOS, musl): nothing to fix
        return
    mallopt.argtypes, mallopt.restype = [ctypes.c_int, ctypes.c_int], ctypes.c_int
    mallopt(_M_MMAP_THRESHOLD, _MMAP_THRESHOLD_BYTES)


def _return_free_memory() -> None:
    """Hand the heap memory freed since the last point back to the OS (glibc ``malloc_trim``,
    between points, never inside a timed loop). The backend's per-call temporaries below
    glibc's mmap threshold (gloo's flat output of an all_gather, the copy of a reduce_scatter's
    input; the threshold rises with the blocks freed, up to 32 MiB on 64-bit Linux:
    ``DEFAULT_MMAP_THRESHOLD_MAX`` in glibc's malloc/malloc.c) are freed into the heaps of the
    threads that made them, where they would otherwise stay over the sizes and ops of a sweep
    and add to the peak of the largest."""
    trim = _malloc_trim()
    if trim is not None:
        trim(0)


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
                _return_free_memory()
                buffers = _Buffers.for_op(torch, op, largest[op], n, ctx.device)
                held_for = op
            case = _OpCase(torch, dist, op, count, rank, n, ctx.device, config.root, buffers)
            if round_index == 0:
                case.fill_check()
                dist.barrier()
                case()
                ctx.sync()
                wrong_total.fill_(case.count_wrong())
                dist.all_reduce(wrong_total)
                wrong[key] = int(wrong_total.item())
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


#: Memory of one spawned gloo rank before its buffers: the interpreter, torch and a process
#: group (proportional set size, PSS, per added rank of ``validate bench -b 1K -e 1K``: see
#: :data:`RANK_BASE_BYTES_SOURCE`).
RANK_BASE_BYTES = 240 * 2**20
RANK_BASE_BYTES_SOURCE = (
    "benchmarks/peak_rss.py -- collsim validate bench -b 1K -e 1K -n 1 -w 0 --ops all_reduce, "
    "torch 2.13.0+cpu: peak PSS of the process tree 0.41 / 0.62 / 1.04 GiB with 1 / 2 / 4 ranks"
)
#: Buffers of the op's size a gloo rank holds at its peak, with the backend's own copies, per
#: op. Measured with benchmarks/peak_rss.py (torch 2.13.0+cpu), peak PSS over a 1K run, per
#: rank, in 256 MiB buffers: one op at a time on 2 ranks (``validate bench --world-size 2 --ops
#: OP -b 256M -e 256M -n 1 -w 0``): all_reduce 1.15, broadcast 1.26, all_gather 2.83 (a 1/2
#: chunk, the output and gloo's flat copy of it), reduce_scatter 2.60, all_to_all 2.34,
#: send_recv 2.24; every op on 4 ranks (``validate bench --world-size 4 -b 1K -e 256M``): 3.55
#: at the peak of the whole run (4.59 GiB against 1.04 GiB at 1K). Rounded up to the half.
_OP_BUFFERS: dict[str, float] = {
    "all_reduce": 1.5,
    "broadcast": 1.5,
    "all_gather": 4.0,
    "reduce_scatter": 4.0,
    "all_to_all": 4.0,
    "send_recv": 4.0,
}
#: Memory of the launching process (the same runs: what is left at 0 ranks, rounded up).
PARENT_BYTES = 256 * 2**20


def bench_memory_bytes(config: BenchConfig, world_size: int, backend: str = "gloo") -> int:
    """The host memory a local bench of ``world_size`` ranks needs at its peak: the launching
    process, each rank's base and, on gloo (host tensors), the largest over the ops of its
    buffers (:meth:`_Buffers.for_op`) with the backend's own copies (:data:`_OP_BUFFERS`)
    and a few blocks of check data."""
    per_rank = RANK_BASE_BYTES
    if backend == "gloo" and config.sizes_bytes:
        n, top = world_size, max(config.sizes_bytes)
        held = max(_OP_BUFFERS[op] * element_count(op, top, n) for op in config.ops)
        per_rank += int((held + 8 * _CHECK_BLOCK) * _ELEMENT_BYTES)
    return PARENT_BYTES + world_size * per_rank


def available_memory_bytes() -> int | None:
    """``MemAvailable`` of ``/proc/meminfo`` (Linux): what can be allocated without swapping;
    None where the file is not there."""
    try:
        with open("/proc/meminfo") as handle:
            for line in handle:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        return None
    return None


def check_bench_memory(config: BenchConfig, world_size: int, backend: str = "gloo") -> None:
    """Refuse a local bench whose ranks would not fit in this machine's available memory.

    Raises:
        ConfigError: the estimate (:func:`bench_memory_bytes`) is above ``MemAvailable``
            (exit 2, naming ``--world-size`` and ``-e``).
    """

    need = bench_memory_bytes(config, world_size, backend)
    have = available_memory_bytes()
    if have is not None and need > have:
        raise ConfigError(
            f"{world_size} ranks need about {need / 2**30:.1f} GiB of memory "
            f"({RANK_BASE_BYTES / 2**20:.0f} MiB per rank and two buffers of the largest size "
            f"each), this machine has {have / 2**30:.1f} GiB available; use fewer ranks or a "
            "smaller -e",
            key_path="--world-size",
        )


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
        "kernels": out["kernels"],
        "overhead_noop_us": round(out["overhead"]["noop_us"], 3),
        "overhead_all_reduce_4B_us": round(out["overhead"]["all_reduce_4B_us"], 3),
        "duration_s": round((_dt.datetime.now(_dt.UTC) - started).total_seconds(), 1),
        "load_average_start": load_start,
        "load_average_end": _load_average(),
        "cpu_steal_share": steal_share(jiffies_start, _cpu_jiffies()),
    }
    return BenchResult(points=list(out["points"]), metadata=metadata), is_reporter
