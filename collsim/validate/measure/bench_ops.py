"""What the bench measures and the buffers it measures with: the ops, their sizes and busbw
factors (nccl-tests' conventions, see :mod:`collsim.validate.measure.bench`), the bench's
configuration and results, and each rank's send and receive buffers with the op call and the
expected result of the check run."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from typing import Any

from collsim.core.units import parse_size

__all__ = [
    "OPS",
    "BUS_FACTOR",
    "BenchConfig",
    "BenchPoint",
    "BenchResult",
    "bus_factor",
    "element_count",
    "sizes_between",
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


#: The ops the bench times in place on gloo, as nccl-tests' in-place columns lay them out
#: (common.cu: all_gather sends from its own chunk of the receive buffer, reduce_scatter
#: receives into its own chunk of the send buffer). gloo does the same work either way: its
#: all_gather gathers into a flat temporary of the whole output and copies it out, and its
#: reduce_scatter all-reduces a clone of the whole input and copies its chunk out
#: (``ProcessGroupGloo::_allgather_base``, ``AsyncAllgatherWork`` and
#: ``reduce_scatter_tensor_coalesced`` in torch/csrc/distributed/c10d/ProcessGroupGloo.cpp), so
#: in place moves the same bytes through the same steps and saves a separate send (all_gather)
#: or receive (reduce_scatter) buffer beside those temporaries. Other backends time out of
#: place (nccl-tests' out-of-place columns).
GLOO_IN_PLACE = ("all_gather", "reduce_scatter")


def in_place_ops(backend: str, ops: tuple[str, ...] = OPS) -> tuple[str, ...]:
    """The ops of ``ops`` the bench times in place on ``backend`` (:data:`GLOO_IN_PLACE`)."""
    return tuple(op for op in ops if op in GLOO_IN_PLACE) if backend == "gloo" else ()


class _Buffers:
    """The send and receive buffers of a rank for one op, sized for its largest point and
    reused by each of its sizes, as nccl-tests holds them (``sendbuff`` and ``recvbuff``,
    nccl-tests common.cu): the bench's memory does not grow with the number of sizes. An op
    that works in place (all_reduce, broadcast, and all_gather and reduce_scatter timed in
    place) has one buffer: all_gather's is the receive buffer, the others' the send buffer."""

    def __init__(
        self, torch: Any, max_count: int, device: str, recv_count: int | None = None
    ) -> None:
        self.send = torch.empty(max_count, dtype=torch.float32, device=device)
        count = max_count if recv_count is None else recv_count
        self.recv = torch.empty(count, dtype=torch.float32, device=device)

    @classmethod
    def for_op(
        cls, torch: Any, op: str, max_count: int, n: int, device: str, in_place: bool = False
    ) -> _Buffers:
        """Buffers for ``op`` up to ``max_count`` elements: the input and the output sizes of
        nccl-tests (all_gather sends a 1/n chunk, reduce_scatter receives one); ``in_place``:
        the one buffer of the op's in-place form."""
        chunk = max_count // n if op in _SPLIT_OPS else max_count
        match op:
            case "all_reduce" | "broadcast":
                return cls(torch, max_count, device, recv_count=0)
            case "all_gather" if in_place:
                return cls(torch, 0, device, recv_count=max_count)
            case "reduce_scatter" if in_place:
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
        in_place: bool = False,
    ) -> None:
        self.torch, self.dist, self.op = torch, dist, op
        self.in_place = in_place and op in GLOO_IN_PLACE
        self.count, self.rank, self.n, self.device, self.root = count, rank, n, device, root
        chunk = count // n if op in _SPLIT_OPS else count
        self.chunk = chunk
        if buffers is None:
            buffers = _Buffers.for_op(torch, op, count, n, device, self.in_place)
        send, recv = buffers.send, buffers.recv
        mine = slice(rank * chunk, (rank + 1) * chunk)
        match op:
            case "all_reduce" | "broadcast":
                self.inp = send[:count]
                self.out = self.inp
            case "all_gather" if self.in_place:
                self.inp, self.out = recv[mine], recv[:count]
            case "reduce_scatter" if self.in_place:
                self.inp, self.out = send[:count], send[mine]
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
        # The call holds only locals, never ``self``: a closure over ``self`` is a reference
        # cycle (self -> call -> self) that outlives ``del case`` until the cyclic collector
        # runs, and with it the op's buffers, into the next op's peak.
        dist, inp, out, root, n = self.dist, self.inp, self.out, self.root, self.n
        match self.op:
            case "all_reduce":
                return lambda: dist.all_reduce(inp)
            case "broadcast":
                return lambda: dist.broadcast(inp, src=root)
            case "all_gather":
                fn = _single(dist, "all_gather_single", "all_gather_into_tensor")
                return lambda: fn(out, inp)
            case "reduce_scatter":
                fn = _single(dist, "reduce_scatter_single", "reduce_scatter_tensor")
                return lambda: fn(out, inp)
            case "all_to_all":
                return lambda: dist.all_to_all_single(out, inp)
            case _:  # send_recv: a ring shift, as nccl-tests sendrecv_perf
                dst, src = (self.rank + 1) % n, (self.rank - 1) % n

                def shift() -> None:
                    if n == 1:
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
