"""PyTorch's CUDA caching allocator replayed over one rank's allocations and frees: the memory
it reserves (segments it holds from the device) beside what is allocated, as
``torch.cuda.max_memory_reserved`` reports it. The rules are those of
``c10/cuda/CUDACachingAllocator.cpp`` (pytorch/pytorch at 001074d, the torch 2.x allocator):
sizes rounded to 512 B, a small pool (<= 1 MiB, 2 MiB segments) and a large pool (20 MiB
segments below 10 MiB, else the size rounded to 2 MiB), best fit with splitting, freed blocks
merged with their free neighbours, pools per stream, segments kept until ``empty_cache`` or an
out-of-memory retry, and ``expandable_segments:True`` (one growing segment per stream and pool,
mapped in 2 MiB pages for the small pool and 20 MiB pages for the large one). The derivation,
the sources and what the step program cannot tell the allocator are in docs/memory.md.
"""

from __future__ import annotations

from bisect import bisect_left, insort
from collections import deque
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

from collsim.cluster.hardware import CUDA_CONTEXT_BYTES, NCCL_BUFFER_BYTES
from collsim.core.errors import SimulationError

__all__ = [
    "MIN_BLOCK_BYTES",
    "SMALL_SIZE_BYTES",
    "SMALL_BUFFER_BYTES",
    "LARGE_BUFFER_BYTES",
    "MIN_LARGE_ALLOC_BYTES",
    "NEAR_LIMIT_SHARE",
    "ROUND_LARGE_BYTES",
    "EXPANDABLE_SEGMENTS_BY_STACK",
    "AllocatorOOM",
    "AllocatorStats",
    "CachingAllocator",
    "ReservedMemory",
    "allocation_size",
    "activation_tensors",
    "allocator_limit_bytes",
    "expandable_segments_of",
    "replay_ledger",
    "replay_ranks",
    "reserved_memory",
    "round_size",
]

MIB = 1 << 20

MIN_BLOCK_BYTES = 512
"""``kMinBlockSize``: every size is rounded up to a multiple of 512 B
(c10/cuda/CUDACachingAllocator.cpp at 001074d)."""
SMALL_SIZE_BYTES = 1 * MIB
"""``kSmallSize``: the largest request of the small pool (same file)."""
SMALL_BUFFER_BYTES = 2 * MIB
"""``kSmallBuffer``: small requests are packed into 2 MiB segments; also the page of an
expandable small-pool segment (same file)."""
LARGE_BUFFER_BYTES = 20 * MIB
"""``kLargeBuffer``: requests of 1-10 MiB get a 20 MiB segment; also the page of an expandable
large-pool segment (same file, Note [Expandable Segments])."""
MIN_LARGE_ALLOC_BYTES = 10 * MIB
"""``kMinLargeAlloc``: from 10 MiB a request gets a segment of its own size (same file)."""
ROUND_LARGE_BYTES = 2 * MIB
"""``kRoundLarge``: such a segment is rounded up to 2 MiB (same file)."""

EXPANDABLE_SEGMENTS_BY_STACK: dict[str | None, bool] = {
    # Megatron-Bridge's H100 performance recipes set PYTORCH_CUDA_ALLOC_CONF=
    # expandable_segments:True (src/megatron/bridge/perf_recipes/{llama,qwen,deepseek,gpt_oss}/
    # h100/*.py at 067f987); Megatron-LM's MoE README tells MoE runs to export it
    # (megatron/core/transformer/moe/README.md at d98e8a6)
    "megatron_te": True,
    # NeMo Automodel's benchmark recipes set it in their env (examples/llm_benchmark/
    # {deepseek/deepseek_v3_torch,gpt_oss/gptoss_120b_te_deepep,qwen/qwen3_moe_30b_te_fp8}.yaml
    # at 36044ad)
    "nemo_automodel": True,
    # torchtitan's run_train.sh launches torchrun with PYTORCH_ALLOC_CONF=
    # "expandable_segments:True" (run_train.sh at b5bcd76)
    "torchtitan": True,
    # the others launch torch with its default (expandable_segments:False): no stack source
    # found that sets it
    "llm_foundry": False,
    "fsdp": False,
    "deepspeed": False,
    None: False,
}
"""The allocator setting each stack launches torch with (``training.expandable_segments``
overrides it)."""


def expandable_segments_of(stack: str | None, explicit: bool | None = None) -> bool:
    """``training.expandable_segments``: the explicit value, else the stack's
    (:data:`EXPANDABLE_SEGMENTS_BY_STACK`), else torch's default (False)."""
    if explicit is not None:
        return bool(explicit)
    return EXPANDABLE_SEGMENTS_BY_STACK.get(stack, False)


def round_size(size_bytes: int) -> int:
    """``round_size`` without ``roundup_power2_divisions`` (unset by default): at least 512 B,
    else up to a multiple of 512 B.

    >>> round_size(1), round_size(512), round_size(513)
    (512, 512, 1024)
    """
    if size_bytes < MIN_BLOCK_BYTES:
        return MIN_BLOCK_BYTES
    return MIN_BLOCK_BYTES * ((size_bytes + MIN_BLOCK_BYTES - 1) // MIN_BLOCK_BYTES)


def allocation_size(size_bytes: int) -> int:
    """``get_allocation_size``: the segment a rounded request gets from the device when no
    cached block fits.

    >>> [allocation_size(s * MIB) // MIB for s in (1, 6, 9, 11)]
    [2, 20, 20, 12]
    """
    if size_bytes <= SMALL_SIZE_BYTES:
        return SMALL_BUFFER_BYTES
    if size_bytes < MIN_LARGE_ALLOC_BYTES:
        return LARGE_BUFFER_BYTES
    return ROUND_LARGE_BYTES * ((size_bytes + ROUND_LARGE_BYTES - 1) // ROUND_LARGE_BYTES)


class AllocatorOOM(SimulationError):
    """A request the device cannot hold, even after the cached segments were released."""


class _Block:
    __slots__ = ("addr", "size", "allocated", "mapped", "prev", "next", "pool")

    def __init__(self, addr: int, size: int, pool: tuple[int, bool], mapped: bool = True):
        self.addr = addr
        self.size = size
        self.allocated = False
        self.mapped = mapped
        self.prev: _Block | None = None
        self.next: _Block | None = None
        self.pool = pool


@dataclass(slots=True)
class AllocatorStats:
    """What ``torch.cuda.memory_stats`` reports of a replay (bytes are block sizes)."""

    allocated_bytes: int = 0
    reserved_bytes: int = 0
    peak_allocated_bytes: int = 0
    peak_reserved_bytes: int = 0
    num_alloc_retries: int = 0
    num_ooms: int = 0


def _split(block: _Block, size: int, *, mapped: bool) -> _Block:
    """Cut ``block`` to ``size`` bytes; the rest becomes the next block of its segment."""
    rest = _Block(block.addr + size, block.size - size, block.pool, mapped)
    rest.prev, rest.next = block, block.next
    if block.next is not None:
        block.next.prev = rest
    block.next = rest
    block.size = size
    return rest


class CachingAllocator:
    """The caching allocator of one device.

    Args:
        expandable_segments: ``PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True``.
        limit_bytes: what the device can give the allocator (None: no limit). A request that
            would reserve beyond it releases the cached segments and retries, as
            ``DeviceCachingAllocator::malloc`` does; if that fails too it raises
            :class:`AllocatorOOM`.
    """

    def __init__(self, *, expandable_segments: bool = False, limit_bytes: int | None = None):
        self.expandable = expandable_segments
        self.limit_bytes = limit_bytes
        self.stats = AllocatorStats()
        self._free: dict[tuple[int, bool], list[tuple[int, int]]] = {}
        """Per (stream, small pool): the cached free blocks as sorted (size, address)."""
        self._free_at: dict[int, _Block] = {}
        self._unmapped: dict[tuple[int, bool], list[int]] = {}
        """Expandable segments: per pool, the unmapped blocks' addresses, sorted."""
        self._unmapped_at: dict[int, _Block] = {}
        self._next_addr = 0

    # ---- the public calls ---------------------------------------------------------------
    def malloc(self, size_bytes: int, stream: int = 0) -> _Block:
        """A block for ``size_bytes`` on ``stream`` (``DeviceCachingAllocator::malloc``)."""
        size = round_size(int(size_bytes))
        pool = (stream, size <= SMALL_SIZE_BYTES)
        block = self._get_free_block(pool, size)
        if block is None:
            block = self._alloc_block(pool, size)
            if block is None:
                self.stats.num_alloc_retries += 1
                self.empty_cache()
                block = self._alloc_block(pool, size)
            if block is None:
                self.stats.num_ooms += 1
                raise AllocatorOOM(
                    f"out of memory: {size / MIB:.1f} MiB requested with "
                    f"{self.stats.allocated_bytes / 2**30:.2f} GiB allocated and "
                    f"{self.stats.reserved_bytes / 2**30:.2f} GiB reserved of "
                    f"{(self.limit_bytes or 0) / 2**30:.2f} GiB"
                )
        if self._should_split(block, size):
            self._insert_free(_split(block, size, mapped=True))
        block.allocated = True
        st = self.stats
        st.allocated_bytes += block.size
        if st.allocated_bytes > st.peak_allocated_bytes:
            st.peak_allocated_bytes = st.allocated_bytes
        return block

    def free(self, block: _Block) -> None:
        """Return ``block`` to its pool, merged with its free neighbours (``free_block``)."""
        if not block.allocated:
            raise SimulationError("a block freed twice")
        block.allocated = False
        self.stats.allocated_bytes -= block.size
        self._merge(block, block.prev)
        self._merge(block, block.next)
        self._insert_free(block)

    def empty_cache(self) -> None:
        """``release_cached_blocks``: whole free segments go back to the device; in an
        expandable segment, the free pages inside free blocks are unmapped."""
        for pool in list(self._free):
            for _, addr in list(self._free[pool]):
                block = self._free_at.get(addr)
                if block is None:
                    continue
                if self.expandable:
                    self._unmap(block)
                elif block.prev is None and block.next is None:
                    self._remove_free(block)
                    self.stats.reserved_bytes -= block.size

    # ---- internals ----------------------------------------------------------------------
    def _page(self, pool: tuple[int, bool]) -> int:
        return SMALL_BUFFER_BYTES if pool[1] else LARGE_BUFFER_BYTES

    def _should_split(self, block: _Block, size: int) -> bool:
        """``should_split`` with ``max_split_size`` unset (its default)."""
        remaining = block.size - size
        if block.pool[1] or self.expandable:
            return remaining >= MIN_BLOCK_BYTES
        return remaining > SMALL_SIZE_BYTES

    def _insert_free(self, block: _Block) -> None:
        insort(self._free.setdefault(block.pool, []), (block.size, block.addr))
        self._free_at[block.addr] = block

    def _remove_free(self, block: _Block) -> None:
        lst = self._free[block.pool]
        i = bisect_left(lst, (block.size, block.addr))
        del lst[i]
        del self._free_at[block.addr]

    def _expandable_size(self, block: _Block) -> int:
        nxt = block.next
        return block.size + (nxt.size if nxt is not None and not nxt.mapped else 0)

    def _get_free_block(self, pool: tuple[int, bool], size: int) -> _Block | None:
        """``get_free_block``: the smallest cached block that holds ``size``; in an
        expandable segment, a block that could grow is weighed at its grown size."""
        lst = self._free.get(pool)
        if not lst:
            return None
        i = bisect_left(lst, (size, -1))
        if i == len(lst):
            return None
        block = self._free_at[lst[i][1]]
        if self.expandable:
            j = i + 1
            while j < len(lst) and self._expandable_size(
                nxt := self._free_at[lst[j][1]]
            ) < self._expandable_size(block):
                block = nxt
                j += 1
        self._remove_free(block)
        return block

    def _reserve(self, size: int) -> bool:
        limit = self.limit_bytes
        if limit is not None and self.stats.reserved_bytes + size > limit:
            return False
        st = self.stats
        st.reserved_bytes += size
        if st.reserved_bytes > st.peak_reserved_bytes:
            st.peak_reserved_bytes = st.reserved_bytes
        return True

    def _alloc_block(self, pool: tuple[int, bool], size: int) -> _Block | None:
        """``alloc_block``: a new segment (``cudaMalloc``), or more pages of the pool's
        expandable segment; None when the device has no room."""
        if self.expandable:
            return self._grow(pool, size)
        seg = allocation_size(size)
        if not self._reserve(seg):
            return None
        block = _Block(self._next_addr, seg, pool)
        self._next_addr += seg
        return block

    def _merge(self, dst: _Block, src: _Block | None) -> None:
        """``try_merge_blocks``: ``dst`` takes in a free neighbour of the same mapping."""
        if src is None or src.allocated or src.mapped != dst.mapped:
            return
        if src.mapped:
            self._remove_free(src)
        else:
            self._remove_unmapped(src)
        if dst.prev is src:
            dst.addr = src.addr
            dst.prev = src.prev
            if dst.prev is not None:
                dst.prev.next = dst
        else:
            dst.next = src.next
            if dst.next is not None:
                dst.next.prev = dst
        dst.size += src.size

    # ---- expandable segments ------------------------------------------------------------
    def _insert_unmapped(self, block: _Block) -> None:
        insort(self._unmapped.setdefault(block.pool, []), block.addr)
        self._unmapped_at[block.addr] = block

    def _remove_unmapped(self, block: _Block) -> None:
        lst = self._unmapped[block.pool]
        del lst[bisect_left(lst, block.addr)]
        del self._unmapped_at[block.addr]

    def _grow(self, pool: tuple[int, bool], size: int) -> _Block | None:
        """``try_allocate_expandable_block``: from the lowest unmapped range with room (with
        the free block before it), map pages until the block holds ``size``."""
        if pool not in self._unmapped:
            # one segment per stream and pool: its whole virtual range, unmapped
            span = 1 << 50
            whole = _Block(self._next_addr, span, pool, mapped=False)
            self._next_addr += span
            self._unmapped[pool] = []
            self._insert_unmapped(whole)
        candidate: _Block | None = None
        for addr in self._unmapped[pool]:
            c = self._unmapped_at[addr]
            before = c.prev
            if before is not None and not before.allocated:
                c = before
            room = 0
            walk: _Block | None = c
            while room < size and walk is not None and not walk.allocated:
                room += walk.size
                walk = walk.next
            if room >= size:
                candidate = c
                break
        if candidate is None:
            return None
        if not candidate.mapped:
            grown = self._map(candidate, min(candidate.size, size))
            if grown is None:
                return None
            candidate = grown
        while candidate.size < size:
            nxt = candidate.next
            if nxt is None or nxt.mapped:
                return None
            grown = self._map(nxt, min(size - candidate.size, nxt.size))
            if grown is None:
                return None
            candidate = grown
        self._remove_free(candidate)
        return candidate

    def _map(self, block: _Block, size: int) -> _Block | None:
        """``map_block``: back the first ``size`` bytes of an unmapped block with pages
        (whole pages), merge them with free neighbours and cache the result."""
        page = self._page(block.pool)
        mapped = min(block.size, page * ((size + page - 1) // page))
        if not self._reserve(mapped):
            return None
        self._remove_unmapped(block)
        if mapped < block.size:
            self._insert_unmapped(_split(block, mapped, mapped=False))
        block.mapped = True
        self._merge(block, block.prev)
        self._merge(block, block.next)
        self._insert_free(block)
        return block

    def _unmap(self, block: _Block) -> None:
        """``unmap_block``: give back the whole pages inside a free block."""
        page = self._page(block.pool)
        begin = -(-block.addr // page) * page
        end = ((block.addr + block.size) // page) * page
        if end <= begin:
            return
        self._remove_free(block)
        if begin > block.addr:
            before = _Block(block.addr, begin - block.addr, block.pool)
            before.prev, before.next = block.prev, block
            if block.prev is not None:
                block.prev.next = before
            block.prev = before
            self._insert_free(before)
        if end < block.addr + block.size:
            after = _Block(end, block.addr + block.size - end, block.pool)
            after.prev, after.next = block, block.next
            if block.next is not None:
                block.next.prev = after
            block.next = after
            self._insert_free(after)
        block.addr, block.size, block.mapped = begin, end - begin, False
        self.stats.reserved_bytes -= block.size
        self._merge(block, block.prev)
        self._merge(block, block.next)
        self._insert_unmapped(block)


@dataclass(frozen=True, slots=True)
class ReservedMemory:
    """The allocator's replay of one rank's step."""

    rank: int
    peak_reserved_bytes: float
    peak_allocated_bytes: float
    """Peak of the allocated block sizes (requests rounded to 512 B, unsplit remainders)."""
    num_alloc_retries: int
    """Requests that released the cached segments and retried (``num_alloc_retries``)."""
    oom: bool
    """A request failed after the retry: the step does not fit."""
    unmatched_bytes: float
    """Freed bytes the replay could not pair with a live allocation (0 on every shipped
    scenario; a check on the pairing rules)."""


def _family(label: Any) -> Any:
    """What a free is paired by: the label, with the FSDP reshard paired to its gather."""
    if isinstance(label, str):
        if label.startswith(("reshard", "gathered ")):
            return "gathered"
        return label
    return None


def replay_ledger(
    rank: int,
    events: Iterable[Any],
    *,
    expandable_segments: bool,
    limit_bytes: float | None = None,
    tensors: Mapping[int, tuple[int, ...]] | None = None,
) -> ReservedMemory:
    """Replay one rank's sorted memory events (:meth:`MemoryLedger.sorted_events`) through a
    :class:`CachingAllocator` on one stream.

    Each allocation event is one block, but an activation event whose bytes are a layer's
    kept or rebuilt activations (``tensors``: :func:`activation_tensors`) is its tensors, one
    block each, freed together (newest first). A free is paired with the live blocks it releases:
    a labelled activation free (``("free", key, micro-batch, chunk)``) with the ``act`` and
    ``recompute`` blocks of the same key; an FSDP reshard with the oldest gathered unit of
    its size; other frees with the oldest live block of their category, label and size;
    unlabelled ones (the closed form's activation frees under ZeRO-3) with the newest of their
    size, else the newest blocks of their category until the bytes are covered. A labelled
    free sorted before its allocation at the same instant cancels it. With ``limit_bytes``
    the replay stops at the first request that does not fit after the retry (``oom``).
    """
    alloc = CachingAllocator(
        expandable_segments=expandable_segments,
        limit_bytes=None if limit_bytes is None else int(limit_bytes),
    )
    split = tensors or {}
    pairs = _Pairing(alloc)
    oom = False
    for ev in events:
        category, delta, label = ev[1], ev[2], ev[3]
        size = int(round(abs(delta)))
        if delta < 0:
            pairs.free(category, label, size)
            continue
        if pairs.cancels(category, label, size):
            continue
        parts = split.get(size, (size,)) if category == "activations" else (size,)
        try:
            blocks = [alloc.malloc(part) for part in parts]
        except AllocatorOOM:
            oom = True
            break
        pairs.add(category, label, size, blocks)
    st = alloc.stats
    return ReservedMemory(
        rank=rank,
        peak_reserved_bytes=float(st.peak_reserved_bytes),
        peak_allocated_bytes=float(st.peak_allocated_bytes),
        num_alloc_retries=st.num_alloc_retries,
        oom=oom,
        unmatched_bytes=float(pairs.unmatched_bytes()),
    )


class _Pairing:
    """The live allocations of a replay and which of them a free releases (the rules of
    :func:`replay_ledger`). One handle per event: [its blocks, live, bytes] (a block object
    is reused once freed, a handle is not)."""

    def __init__(self, alloc: CachingAllocator) -> None:
        self.alloc = alloc
        self.by_key: dict[tuple[Any, ...], list[list[Any]]] = {}
        self.by_size: dict[tuple[str, Any, int], deque[list[Any]]] = {}
        self.stacks: dict[str, list[list[Any]]] = {}
        self.pending: dict[tuple[str, Any, int], int] = {}
        """Frees sorted before their allocation (both at one instant: frees sort first)."""
        self.unmatched = 0

    def add(self, category: str, label: Any, size: int, blocks: list[_Block]) -> None:
        handle = [blocks, True, size]
        if isinstance(label, tuple) and label and label[0] in ("act", "recompute"):
            self.by_key.setdefault((category, *label[1:]), []).append(handle)
        self.by_size.setdefault((category, _family(label), size), deque()).append(handle)
        self.stacks.setdefault(category, []).append(handle)

    def cancels(self, category: str, label: Any, size: int) -> bool:
        """An allocation whose free came first at the same instant: neither happens."""
        early = (category, _family(label), size)
        if self.pending.get(early):
            self.pending[early] -= 1
            return True
        return False

    def release(self, handle: list[Any]) -> int:
        handle[1] = False
        for block in reversed(handle[0]):
            self.alloc.free(block)
        return int(handle[2])

    def unmatched_bytes(self) -> int:
        return self.unmatched + sum(size * n for (_, _, size), n in self.pending.items())

    def free(self, category: str, label: Any, size: int) -> None:
        if isinstance(label, tuple) and label and label[0] == "free":
            handles = self.by_key.pop((category, *label[1:]), [])
            freed = sum(self.release(h) for h in handles if h[1])
            self.unmatched += max(0, size - freed)
            return
        family = _family(label)
        queue = self.by_size.get((category, family, size))
        if family:  # labelled: the oldest (gathered units, buckets, messages)
            while queue and not queue[0][1]:
                queue.popleft()
            if queue:
                self.release(queue.popleft())
            else:
                key = (category, family, size)
                self.pending[key] = self.pending.get(key, 0) + 1
            return
        # unlabelled activations: the newest of that size (backward runs the layers in
        # reverse), else the newest live block (the rebuilt part), then the newest of the
        # rest's size (the kept part)
        while queue and not queue[-1][1]:
            queue.pop()
        if queue:
            self.release(queue.pop())
            return
        left = size
        stack = self.stacks.get(category, [])
        while left > 0 and stack:
            handle = stack.pop()
            if not handle[1]:
                continue
            left -= self.release(handle)
            rest = self.by_size.get((category, family, left))
            while rest and not rest[-1][1]:
                rest.pop()
            if rest:
                self.release(rest.pop())
                left = 0
        self.unmatched += max(0, left)


def replay_ranks(
    ledgers: Mapping[int, Any],
    *,
    expandable_segments: bool,
    limit_bytes: float | None,
    tensors: Mapping[int, tuple[int, ...]] | None = None,
) -> dict[int, ReservedMemory]:
    """:func:`replay_ledger` of every rank's ledger (:class:`MemoryLedger`)."""
    return {
        rank: replay_ledger(
            rank,
            ledger.sorted_events(),
            expandable_segments=expandable_segments,
            limit_bytes=limit_bytes,
            tensors=tensors,
        )
        for rank, ledger in ledgers.items()
    }


def allocator_limit_bytes(device: Any) -> float:
    """What the caching allocator can reserve on ``device`` (a
    :class:`~collsim.cluster.hardware.Device`): the reported capacity less the memory outside
    the allocator, the device file's ``reserve_gib`` or else the CUDA context and NCCL buffers
    (:data:`~collsim.cluster.hardware.CUDA_CONTEXT_BYTES`,
    :data:`~collsim.cluster.hardware.NCCL_BUFFER_BYTES`). The fragmentation share of
    :attr:`~collsim.cluster.hardware.Device.memory_reserve_bytes` is left out: the replay
    finds the fragmentation itself."""
    outside = device.reserve_bytes
    if outside is None:
        outside = CUDA_CONTEXT_BYTES + NCCL_BUFFER_BYTES
    return max(0.0, float(device.reported_capacity_bytes) - float(outside))


NEAR_LIMIT_SHARE = 0.8
"""Besides the rank with the highest allocated peak, the replay runs the ranks whose allocated
peak is at least this share of what the allocator can hold: those whose fit could turn on
fragmentation. A choice of collsim (the replay's cost grows with the ranks it runs), not
a figure of PyTorch's."""


def reserved_memory(
    ledgers: Mapping[int, Any],
    *,
    expandable_segments: bool,
    limit_bytes: float | None,
    allocated_peaks: Mapping[int, float],
    schedule: Any = None,
) -> tuple[float, dict[str, Any]]:
    """The highest peak reserved over the replayed ranks of ``ledgers`` (rank ->
    :class:`MemoryLedger`): the rank with the highest of ``allocated_peaks`` and those within
    :data:`NEAR_LIMIT_SHARE` of ``limit_bytes``; and the facts of the replay
    (:attr:`collsim.step.result.StepResult.allocator`). With the step's ``schedule``, layer
    activations are allocated tensor by tensor."""
    tensors = activation_tensors(schedule) if schedule is not None else {}
    top_rank = max(allocated_peaks, key=lambda r: (allocated_peaks[r], -r))
    near = NEAR_LIMIT_SHARE * limit_bytes if limit_bytes is not None else float("inf")
    chosen = {
        r: ledger
        for r, ledger in ledgers.items()
        if r == top_rank or allocated_peaks.get(r, 0.0) >= near
    }
    runs = replay_ranks(
        chosen, expandable_segments=expandable_segments, limit_bytes=limit_bytes, tensors=tensors
    )
    top = max(runs.values(), key=lambda r: (r.oom, r.peak_reserved_bytes, -r.rank))
    return top.peak_reserved_bytes, {
        "expandable_segments": expandable_segments,
        "limit_bytes": limit_bytes,
        "rank": top.rank,
        "alloc_retries": top.num_alloc_retries,
        "oom": any(r.oom for r in runs.values()),
        "unmatched_bytes": max(r.unmatched_bytes for r in runs.values()),
        "reserved_bytes_by_rank": {r: run.peak_reserved_bytes for r, run in runs.items()},
        "activation_tensors": {size: len(parts) for size, parts in tensors.items()},
    }


def activation_tensors(schedule: Any) -> dict[int, tuple[int, ...]]:
    """Bytes of a layer kind's kept (and rebuilt) activations -> the bytes of each of their
    tensors, from the layer's op list (:attr:`collsim.workload.compute.LayerTimes.
    kept_tensor_bytes`) of the step program's compute model (``schedule``: a
    :class:`collsim.step.build.StepSchedule`). Where the step keeps fewer bytes than the op
    list (FP8 linears keep 1-byte inputs) the tensors are scaled to the step's bytes."""
    plan = schedule.plan
    spec, tr = plan.spec, plan.training
    # the layer kinds as the step program prices them (collsim.step.build._blocks)
    variant = spec.is_moe or spec.is_mla or spec.sliding_window is not None or plan.cp > 1
    blocks = schedule.layers if schedule.layers else {0: schedule.layer}
    out: dict[int, tuple[int, ...]] = {}
    for rep, block in blocks.items():
        kinds: dict[str, Any] = (
            {"layer": rep, "ep": plan.ep, "etp": plan.etp, "cp": plan.cp} if variant else {}
        )
        times = schedule.compute.layer_times(
            spec,
            micro_batch=tr.micro_batch,
            tp=plan.tp,
            sequence_parallel=plan.parallel.sequence_parallel,
            recompute=str(tr.recompute),
            **kinds,
        )
        for total, parts in (
            (block.stored_bytes, times.kept_tensor_bytes),
            (block.transient_bytes, times.rebuilt_tensor_bytes),
        ):
            size = int(round(total))
            if size > 0 and len(parts) > 1:
                out[size] = _scaled(parts, size)
    return out


def _scaled(parts: tuple[float, ...], total: int) -> tuple[int, ...]:
    """``parts`` scaled to add up to ``total`` bytes exactly (the last one takes the
    rounding), zero-byte tensors left out."""
    whole = float(sum(parts))
    if whole <= 0:
        return (total,)
    sizes = [int(p * total / whole) for p in parts]
    sizes[-1] += total - sum(sizes)
    return tuple(s for s in sizes if s > 0)
