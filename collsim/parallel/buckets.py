"""DDP gradient buckets, built the way torch's reducer builds them.

torch ``DistributedDataParallel`` (``torch/nn/parallel/distributed.py`` and the C++ reducer,
``_compute_bucket_assignment_by_size``) walks the parameters in *reverse* registration order,
since backward produces gradients roughly in that order, and packs them into buckets of
``bucket_cap_mb`` MiB; the first bucket is small (``dist._DEFAULT_FIRST_BUCKET_BYTES`` = 1 MiB)
so that the first all-reduce starts early. A bucket closes once its size reaches its limit
(a tensor is never split, so a bucket may exceed the limit). A bucket's all-reduce is launched
when the last of its gradients is produced (its "ready" point in backward).

Ready points are placed inside a backward segment (the LM head, one transformer layer, the
embedding): a layer's backward produces its gradients in reverse registration order, each after
a share of the segment's gradient time proportional to the elements produced so far (GEMM work
scales with the weight size).
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping, Sequence
from typing import Any, NamedTuple, overload

from collsim.core.units import MiB
from collsim.parallel.params import ParamTensor

__all__ = [
    "Bucket",
    "CutBuckets",
    "PackedTensors",
    "backward_segments",
    "bucket_cuts",
    "build_buckets",
    "cut_buckets",
    "grad_ready_fraction",
    "packed_tensors",
]


class Bucket(NamedTuple):
    """One gradient bucket (a named tuple, as :class:`~collsim.parallel.params.ParamTensor`:
    every new chunk shape of a search makes its buckets, a frozen dataclass costs about three
    times as much to make).

    Attributes:
        index: 0 for the first bucket launched (holding the last parameters).
        tensors: names of its tensors, in the order they were added.
        numel: elements in the bucket (fractional only with a vocab-parallel V / t split).
        size_bytes: gradient bytes (numel x gradient element size).
        ready_segment: backward segment whose gradient completes the bucket.
        ready_fraction: how far into that segment's gradient production it completes (0..1].
    """

    index: int  # type: ignore[assignment]  # the field shadows tuple.index, unused here
    tensors: tuple[str, ...]
    numel: float
    size_bytes: float
    ready_segment: str | int
    ready_fraction: float
    expert: bool = False
    """Holds routed-expert gradients (reduced over the expert data-parallel group)."""


def backward_segments(tensors: Sequence[ParamTensor]) -> list[str | int]:
    """Backward segments in execution order: head, layers high to low, embedding."""
    seen: dict[str | int, None] = {}
    for t in reversed(tensors):
        seen.setdefault(t.segment, None)
    return list(seen)


def grad_ready_fraction(tensors: Sequence[ParamTensor]) -> dict[str, float]:
    """Fraction of its segment's gradient time after which each tensor's gradient exists."""
    totals: dict[str | int, float] = {}
    for t in tensors:
        totals[t.segment] = totals.get(t.segment, 0) + t.numel
    done: dict[str | int, float] = {}
    out: dict[str, float] = {}
    for t in reversed(tensors):
        done[t.segment] = done.get(t.segment, 0) + t.numel
        total = totals[t.segment]
        out[t.name] = done[t.segment] / total if total else 1.0
    return out


def bucket_cuts(
    numels: Sequence[float], *, bucket_mb: float, first_bucket_mb: float = 1.0, grad_bytes: int = 2
) -> tuple[tuple[int, float, float], ...]:
    """Where torch's reducer closes each bucket over gradients in launch order (``numels``:
    the elements of the tensors :func:`build_buckets` packs, reversed registration order):
    per bucket, (the index after its last tensor, its elements, its gradient bytes). The
    first bucket's limit is ``first_bucket_mb``, every other's ``bucket_mb`` (MiB); a bucket
    closes once it reaches its limit, or at the last tensor. Tensors of the same sizes in the
    same order are cut the same way (a search's chunks of one form share their cuts)."""
    limit = first_bucket_mb * MiB  # the first bucket's, then every other's
    cuts: list[tuple[int, float, float]] = []
    numel: float = 0  # added up one tensor after another, as sum() would
    size = 0.0
    last = len(numels) - 1
    for i, x in enumerate(numels):
        numel += x
        size += x * grad_bytes
        if size >= limit or i == last:  # full, or the last tensor
            cuts.append((i + 1, numel, size))
            numel, size = 0, 0.0
            limit = bucket_mb * MiB
    return tuple(cuts)


class PackedTensors(NamedTuple):
    """The tensors one kind of bucket packs, in launch order (reversed registration order),
    as columns (:func:`packed_tensors`)."""

    numels: tuple[float, ...]
    names: tuple[str, ...]
    segments: tuple[str | int, ...]
    """The backward segment that makes each gradient."""
    ready: tuple[float, ...]
    """How far into its segment's gradient production each gradient exists
    (:func:`grad_ready_fraction`)."""


def packed_tensors(
    tensors: Sequence[ParamTensor],
    *,
    expert: bool | None = None,
    ready: Mapping[str, float] | None = None,
) -> PackedTensors:
    """The tensors of one rank's chunk (registration order) that buckets of one kind pack
    (``expert``: as :func:`build_buckets`; ``ready``: ``grad_ready_fraction(tensors)``,
    where the caller has it already)."""
    frac = grad_ready_fraction(tensors) if ready is None else ready
    picked = [t for t in reversed(tensors) if expert is None or t.expert == expert]
    return PackedTensors(
        numels=tuple([t.numel for t in picked]),
        names=tuple([t.name for t in picked]),
        segments=tuple([t.segment for t in picked]),
        ready=tuple([frac[t.name] for t in picked]),
    )


def cut_buckets(
    packed: PackedTensors, cuts: Sequence[tuple[int, float, float]], *, expert: bool | None
) -> list[Bucket]:
    """The buckets ``cuts`` (:func:`bucket_cuts` of ``packed.numels``) make of ``packed``,
    in launch order; each is ready when its last tensor's gradient exists."""
    new = tuple.__new__  # the named tuple made without its keyword layer
    kind = bool(expert)
    names, segments, ready = packed.names, packed.segments, packed.ready
    buckets: list[Bucket] = []
    start = 0
    for i, (stop, numel, size) in enumerate(cuts):
        last = stop - 1
        bucket = (i, names[start:stop], numel, size, segments[last], ready[last], kind)
        buckets.append(new(Bucket, bucket))
        start = stop
    return buckets


class CutBuckets(Sequence[Bucket]):
    """A chunk's buckets as the pieces they are cut from (per kind: the packed tensors, the
    cuts, the kind), made into :class:`Bucket` tuples on the first read of one (their count
    is read without): a search's plans that differ only in bucket sizes cut every chunk
    anew, and most of them are never read one by one (alike chunks share what is made of
    them, :meth:`collsim.play.walker.Walker.op_plans`). Equal to a list of the same buckets."""

    __slots__ = ("_pieces", "_made", "_count")

    def __init__(
        self, pieces: Sequence[tuple[PackedTensors, Sequence[tuple[int, float, float]], Any]]
    ) -> None:
        self._pieces = tuple(pieces)
        self._made: list[Bucket] | None = None
        self._count = sum(len(cuts) for _, cuts, _ in self._pieces)

    def _buckets(self) -> list[Bucket]:
        made = self._made
        if made is None:
            made = []
            for packed, cuts, kind in self._pieces:
                made += cut_buckets(packed, cuts, expert=kind)
            self._made = made
        return made

    def __len__(self) -> int:
        return self._count

    def __iter__(self) -> Iterator[Bucket]:
        return iter(self._buckets())

    @overload
    def __getitem__(self, index: int) -> Bucket: ...

    @overload
    def __getitem__(self, index: slice) -> list[Bucket]: ...

    def __getitem__(self, index: int | slice) -> Bucket | list[Bucket]:
        return self._buckets()[index]

    def __eq__(self, other: object) -> bool:
        if isinstance(other, CutBuckets):
            return self._buckets() == other._buckets()
        if isinstance(other, list):
            return self._buckets() == other
        return NotImplemented

    __hash__ = None  # type: ignore[assignment]

    def __repr__(self) -> str:
        return f"CutBuckets({self._buckets()!r})"


def build_buckets(
    tensors: Sequence[ParamTensor],
    *,
    bucket_mb: float,
    first_bucket_mb: float = 1.0,
    grad_bytes: int = 2,
    expert: bool | None = None,
    ready: Mapping[str, float] | None = None,
) -> list[Bucket]:
    """Pack the gradients of ``tensors`` (registration order) into DDP buckets
    (:func:`packed_tensors`, :func:`bucket_cuts`, :func:`cut_buckets`).

    Args:
        tensors: parameter tensors of one rank (one model chunk), in registration order.
        bucket_mb: torch's ``bucket_cap_mb`` (MiB).
        first_bucket_mb: the first bucket's limit (MiB), torch's 1 MiB default.
        grad_bytes: bytes per gradient element (2 for bf16/fp16, 4 for fp32).
        expert: pack only the routed-expert (True) or only the other (False) tensors, as
            Megatron-Core keeps separate gradient buffers for each; ready points are still
            those of the whole segment. None packs all.
        ready: ``grad_ready_fraction(tensors)``, where the caller has it already.

    Returns:
        Buckets in launch order.

    Example:
        >>> from collsim.parallel.params import ParamTensor
        >>> ts = [ParamTensor(f"w{i}", 2**19, i) for i in range(4)]   # 1 MiB each in bf16
        >>> [b.tensors for b in build_buckets(ts, bucket_mb=2)]
        [('w3',), ('w2', 'w1'), ('w0',)]
    """
    packed = packed_tensors(tensors, expert=expert, ready=ready)
    cuts = bucket_cuts(
        packed.numels, bucket_mb=bucket_mb, first_bucket_mb=first_bucket_mb, grad_bytes=grad_bytes
    )
    return cut_buckets(packed, cuts, expert=expert)
