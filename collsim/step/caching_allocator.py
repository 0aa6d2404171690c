"""PyTorch's CUDA caching allocator of one device, rule by rule as
``c10/cuda/CUDACachingAllocator.cpp`` (pytorch/pytorch at 001074d, the torch 2.x allocator)
writes it: sizes rounded to 512 B, a small and a large pool per stream, best fit with
splitting, freed blocks merged with their free neighbours, segments cached until
``empty_cache`` or an out-of-memory retry, and ``expandable_segments:True``. The rules, their
sources and the worked examples are in docs/memory.md; :mod:`collsim.step.allocator` replays a
rank's step through it.
"""

from __future__ import annotations

from bisect import bisect_left, insort
from collections.abc import Iterable
from dataclasses import dataclass
from itertools import chain, compress, islice, repeat
from operator import itemgetter, ne
from typing import Any

from collsim.core.errors import SimulationError

__all__ = [
    "MIN_BLOCK_BYTES",
    "SMALL_SIZE_BYTES",
    "SMALL_BUFFER_BYTES",
    "LARGE_BUFFER_BYTES",
    "MIN_LARGE_ALLOC_BYTES",
    "ROUND_LARGE_BYTES",
    "AllocatorOOM",
    "AllocatorStats",
    "Block",
    "CachingAllocator",
    "allocation_size",
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
_UNKNOWN = -1
""":meth:`CachingAllocator.cached_fit`'s mark of a request not yet worked out (a fit is a
byte count, never negative)."""


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


MAX_REQUEST_SHAPES = 256
"""Rounded requests :meth:`CachingAllocator.cached_fit` keeps (a step asks a few shapes)."""


def _request_parts(sizes_bytes: tuple[int, ...]) -> tuple[tuple[int, bool, tuple[int, int]], ...]:
    """Each size of a request rounded (:func:`round_size`), whether it is a small-pool one,
    and the key a free list is searched from for it."""
    out = []
    for raw in sizes_bytes:
        size = round_size(int(raw))
        out.append((size, size <= SMALL_SIZE_BYTES, (size, -1)))
    return tuple(out)


def _capped_sizes(entries: list[tuple[int, int]] | None, cap: int, least: int) -> tuple[int, ...]:
    """The sizes of a sorted free list from its first block of at least ``least`` bytes on,
    each size's blocks after its first ``cap`` left out (block ``i`` is kept when it differs
    in size from block ``i - cap``)."""
    if not entries:
        return ()
    start = bisect_left(entries, (least, -1))
    sizes = list(map(itemgetter(0), islice(entries, start, None)))
    if len(sizes) <= cap:
        return tuple(sizes)
    return tuple(compress(sizes, chain(repeat(True, cap), map(ne, sizes[cap:], sizes))))


class AllocatorOOM(SimulationError):
    """A request the device cannot hold, even after the cached segments were released."""


class Block:
    """A block of a segment (``Block`` of the C++ file): address, size, pool, neighbours."""

    __slots__ = ("addr", "size", "allocated", "mapped", "prev", "next", "pool")

    def __init__(self, addr: int, size: int, pool: tuple[int, bool], mapped: bool = True):
        self.addr = addr
        self.size = size
        self.allocated = False
        self.mapped = mapped
        self.prev: Block | None = None
        self.next: Block | None = None
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


def _split(block: Block, size: int, *, mapped: bool) -> Block:
    """Cut ``block`` to ``size`` bytes; the rest becomes the next block of its segment."""
    rest = Block(block.addr + size, block.size - size, block.pool, mapped)
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
        self._free_at: dict[int, Block] = {}
        self._unmapped: dict[tuple[int, bool], list[int]] = {}
        """Expandable segments: per pool, the unmapped blocks' addresses, sorted."""
        self._unmapped_at: dict[int, Block] = {}
        self._fits: dict[tuple[Any, ...], int | None] = {}
        """:meth:`cached_fit`'s answers by request and cache state (with expandable segments:
        the free lists and unmapped ranges; without: the free lists' sizes, capped)."""
        self._parts: dict[tuple[int, ...], tuple[tuple[int, bool, tuple[int, int]], ...]] = {}
        """:meth:`_cached_fit`'s requests rounded (:func:`_request_parts`), by request."""
        self._pools: dict[tuple[int, ...], tuple[int, int]] = {}
        """A request's least part in the large pool and in the small one, by request."""
        self._next_addr = 0

    # ---- the public calls ---------------------------------------------------------------
    def malloc(self, size_bytes: int, stream: int = 0) -> Block:
        """A block for ``size_bytes`` on ``stream`` (``DeviceCachingAllocator::malloc``)."""
        size = round_size(int(size_bytes))
        small = size <= SMALL_SIZE_BYTES
        pool = (stream, small)
        lst = self._free.get(pool)
        block = self._get_free_block(lst, size) if lst else None
        if block is None:
            block = self._new_block(pool, size)
        rest = block.size - size
        if rest >= MIN_BLOCK_BYTES if (small or self.expandable) else rest > SMALL_SIZE_BYTES:
            # _split, then _insert_free of the rest (inline: a replay's most frequent path)
            after = block.next
            cut = Block(block.addr + size, rest, pool)
            cut.prev, cut.next = block, after
            if after is not None:
                after.prev = cut
            block.next = cut
            block.size = size
            if lst is None:  # the pool's first cached block (a new segment's rest)
                lst = self._free.setdefault(pool, [])
            insort(lst, (rest, cut.addr))
            self._free_at[cut.addr] = cut
        block.allocated = True
        st = self.stats
        st.allocated_bytes += block.size
        if st.allocated_bytes > st.peak_allocated_bytes:
            st.peak_allocated_bytes = st.allocated_bytes
        return block

    def free(self, block: Block) -> None:
        """Return ``block`` to its pool, merged with its free neighbours (``free_block``)."""
        if not block.allocated:
            raise SimulationError("a block freed twice")
        block.allocated = False
        self.stats.allocated_bytes -= block.size
        # try_merge_blocks with each neighbour, inline: an allocated block is mapped, so only
        # a free mapped neighbour merges, and it leaves the free list
        lst = self._free.get(block.pool)
        if lst is None:
            lst = self._free[block.pool] = []
        free_at = self._free_at
        before = block.prev
        if before is not None and not before.allocated and before.mapped:
            del lst[bisect_left(lst, (before.size, before.addr))]
            del free_at[before.addr]
            block.addr = before.addr
            block.size += before.size
            block.prev = before = before.prev
            if before is not None:
                before.next = block
        after = block.next
        if after is not None and not after.allocated and after.mapped:
            del lst[bisect_left(lst, (after.size, after.addr))]
            del free_at[after.addr]
            block.size += after.size
            block.next = after = after.next
            if after is not None:
                after.prev = block
        insort(lst, (block.size, block.addr))
        free_at[block.addr] = block

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

    def cached_fit(self, sizes_bytes: Iterable[int], stream: int = 0) -> int | None:
        """The bytes the blocks of ``sizes_bytes`` would hold if they were allocated now, one
        after another, or None when one of them needs a new segment or a mapped page; the
        allocator is left as it was.

        Used with :meth:`hold`: requests that are freed before anything else is allocated
        leave the cache as it was (a free block is a maximal run of free memory of one
        mapping in its segment, so the blocks are a function of the allocated ranges), so only
        their peak counts. The choice of each block and its split are :meth:`malloc`'s, on a
        copy of the free lists. The answer is kept per request and free lists (and unmapped
        ranges): a step repeats the same requests on the same cache many times. Without
        expandable segments the answer depends on the free blocks' sizes alone (equal sizes
        are interchangeable, and the blocks cut are the same sizes whatever their addresses),
        and only on each size's first ``n`` blocks for a request of ``n`` parts (it takes at
        most one block per part), and not on blocks smaller than its least part in their pool
        (never a best fit; the rests it cuts are its own): it is kept by the sizes so capped
        and so cut of the pools the request takes blocks from.
        """
        sizes = tuple(sizes_bytes)
        free = self._free
        if not self.expandable:
            # per pool the request takes blocks from, its least part (smaller blocks are
            # never its best fit, and the other pool's list is not read)
            large, small = self._pools_of(sizes)
            capped = (
                stream,
                sizes,
                _capped_sizes(free.get((stream, False)), len(sizes), large) if large else None,
                _capped_sizes(free.get((stream, True)), len(sizes), small) if small else None,
            )
            fit = self._fits.get(capped, _UNKNOWN)
            if fit == _UNKNOWN:
                fit = self._fits[capped] = self._cached_fit(sizes, stream)
            return fit
        key: tuple[Any, ...] = (
            stream,
            sizes,
            tuple(free.get((stream, False), ())),
            tuple(free.get((stream, True), ())),
        )
        at_addr = self._unmapped_at
        key += tuple(
            tuple((a, at_addr[a].size) for a in self._unmapped.get((stream, s), ()))
            for s in (False, True)
        )
        fit = self._fits.get(key, _UNKNOWN)  # one hash of the key (it holds the free lists)
        if fit != _UNKNOWN:
            return fit
        fit = self._cached_fit(sizes, stream)
        self._fits[key] = fit
        return fit

    def _request(
        self, sizes_bytes: tuple[int, ...]
    ) -> tuple[tuple[int, bool, tuple[int, int]], ...]:
        """A request's parts rounded (:func:`_request_parts`), kept by request."""
        parts = self._parts.get(sizes_bytes)
        if parts is None:
            if len(self._parts) >= MAX_REQUEST_SHAPES:
                self._parts.clear()
                self._pools.clear()
            parts = self._parts[sizes_bytes] = _request_parts(sizes_bytes)
        return parts

    def _pools_of(self, sizes_bytes: tuple[int, ...]) -> tuple[int, int]:
        """A request's least rounded part in the large pool and in the small one (0 where it
        takes no block from that pool)."""
        pools = self._pools.get(sizes_bytes)
        if pools is None:
            parts = self._request(sizes_bytes)
            large = [size for size, small, _ in parts if not small]
            small = [size for size, is_small, _ in parts if is_small]
            pools = self._pools[sizes_bytes] = (min(large, default=0), min(small, default=0))
        return pools

    def _cached_fit(self, sizes_bytes: tuple[int, ...], stream: int) -> int | None:
        """:meth:`cached_fit` worked out."""
        if self.expandable:
            return self._cached_fit_expandable(sizes_bytes, stream)
        parts = self._request(sizes_bytes)
        free = self._free
        large: list[tuple[int, int]] | None = None
        small: list[tuple[int, int]] | None = None
        total = 0
        for size, is_small, probe in parts:
            if is_small:
                if small is None:
                    small = list(free.get((stream, True), ()))
                lst = small
            else:
                if large is None:
                    large = list(free.get((stream, False), ()))
                lst = large
            i = bisect_left(lst, probe)
            if i == len(lst):
                return None
            block_size, addr = lst.pop(i)
            rest = block_size - size
            if rest >= MIN_BLOCK_BYTES if is_small else rest > SMALL_SIZE_BYTES:
                insort(lst, (rest, addr + size))
                total += size
            else:
                total += block_size
        return total

    def _cached_fit_expandable(self, sizes_bytes: tuple[int, ...], stream: int) -> int | None:
        """:meth:`cached_fit` worked out with expandable segments (a block that could grow
        is weighed at its grown size)."""
        lists: dict[tuple[int, bool], list[tuple[int, int]]] = {}
        grow: dict[int, int] = {}
        total = 0
        for raw in sizes_bytes:
            size = round_size(int(raw))
            small = size <= SMALL_SIZE_BYTES
            pool = (stream, small)
            lst = lists.get(pool)
            if lst is None:
                lst = lists[pool] = list(self._free.get(pool, ()))
            i = bisect_left(lst, (size, -1))
            if i == len(lst):
                return None
            i = self._expandable_pick(lst, i, grow)
            block_size, addr = lst.pop(i)
            rest = block_size - size
            if rest >= MIN_BLOCK_BYTES:
                insort(lst, (rest, addr + size))
                grow[addr + size] = self._growth(addr, grow)
                total += size
            else:
                total += block_size
        return total

    def hold(self, size_bytes: int) -> None:
        """Count ``size_bytes`` (a :meth:`cached_fit`) as allocated for the peak, then free."""
        st = self.stats
        if st.allocated_bytes + size_bytes > st.peak_allocated_bytes:
            st.peak_allocated_bytes = st.allocated_bytes + size_bytes

    def _growth(self, addr: int, grow: dict[int, int]) -> int:
        """The unmapped bytes after the free block at ``addr`` (:meth:`cached_fit`'s copy)."""
        hit = grow.get(addr)
        if hit is not None:
            return hit
        nxt = self._free_at[addr].next
        return nxt.size if nxt is not None and not nxt.mapped else 0

    def _expandable_pick(self, lst: list[tuple[int, int]], i: int, grow: dict[int, int]) -> int:
        """:meth:`_get_free_block`'s walk over a copy of a free list: from the best fit on,
        the next block while it could grow to less than the current one."""
        best = lst[i][0] + self._growth(lst[i][1], grow)
        j = i + 1
        while j < len(lst):
            size, addr = lst[j]
            grown = size + self._growth(addr, grow)
            if grown >= best:
                break
            i, best = j, grown
            j += 1
        return i

    def signature(self) -> tuple[Any, ...]:
        """A cheap summary of the cache (byte counts, next address, retries, the free lists'
        hashes): equal wherever :meth:`state` is, seldom equal elsewhere."""
        st = self.stats
        return (
            st.allocated_bytes,
            st.reserved_bytes,
            st.num_alloc_retries,
            self._next_addr,
            tuple(sorted((pool, hash(tuple(lst))) for pool, lst in self._free.items())),
            len(self._unmapped_at),
        )

    def state(self) -> tuple[Any, ...]:
        """What the cache's answers to later requests depend on, but for the allocated
        blocks: byte counts, next address, retries, each pool's free blocks (size, address)
        and unmapped ranges (address, size). With the same segments (none made or released
        between two states: same reserved bytes, next address and retries) the allocated
        blocks are the rest of each segment, told apart by address."""
        st = self.stats
        unmapped = tuple(
            (pool, tuple((a, self._unmapped_at[a].size) for a in addrs))
            for pool, addrs in sorted(self._unmapped.items())
        )
        return (
            st.allocated_bytes,
            st.reserved_bytes,
            st.num_alloc_retries,
            self._next_addr,
            tuple((pool, tuple(lst)) for pool, lst in sorted(self._free.items())),
            unmapped,
        )

    # ---- internals ----------------------------------------------------------------------
    def _new_block(self, pool: tuple[int, bool], size: int) -> Block:
        """A new segment or mapped pages for ``size`` bytes, after releasing the cache and
        retrying once if the device has no room (``malloc``'s slow path)."""
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
        return block

    def _page(self, pool: tuple[int, bool]) -> int:
        return SMALL_BUFFER_BYTES if pool[1] else LARGE_BUFFER_BYTES

    def _insert_free(self, block: Block) -> None:
        insort(self._free.setdefault(block.pool, []), (block.size, block.addr))
        self._free_at[block.addr] = block

    def _remove_free(self, block: Block) -> None:
        lst = self._free[block.pool]
        del lst[bisect_left(lst, (block.size, block.addr))]
        del self._free_at[block.addr]

    def _get_free_block(self, lst: list[tuple[int, int]], size: int) -> Block | None:
        """``get_free_block`` from a pool's free list ``lst``, taken off it: the smallest
        cached block that holds ``size``; in an expandable segment, a block that could grow is
        weighed at its grown size (the next larger blocks taken while they would grow to less
        than the one before)."""
        i = bisect_left(lst, (size, -1))
        n = len(lst)
        if i == n:
            return None
        free_at = self._free_at
        if not self.expandable:
            return free_at.pop(lst.pop(i)[1])
        block = free_at[lst[i][1]]
        after = block.next
        best = block.size + (after.size if after is not None and not after.mapped else 0)
        j = i + 1
        while j < n:
            other = free_at[lst[j][1]]
            after = other.next
            grown = other.size + (after.size if after is not None and not after.mapped else 0)
            if grown >= best:
                break
            block, best, i = other, grown, j
            j += 1
        del lst[i]  # _remove_free: the block's entry is at i
        del free_at[block.addr]
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

    def _alloc_block(self, pool: tuple[int, bool], size: int) -> Block | None:
        """``alloc_block``: a new segment (``cudaMalloc``), or more pages of the pool's
        expandable segment; None when the device has no room."""
        if self.expandable:
            return self._grow(pool, size)
        seg = allocation_size(size)
        if not self._reserve(seg):
            return None
        block = Block(self._next_addr, seg, pool)
        self._next_addr += seg
        return block

    def _merge(self, dst: Block, src: Block | None) -> None:
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
    def _insert_unmapped(self, block: Block) -> None:
        insort(self._unmapped.setdefault(block.pool, []), block.addr)
        self._unmapped_at[block.addr] = block

    def _remove_unmapped(self, block: Block) -> None:
        lst = self._unmapped[block.pool]
        del lst[bisect_left(lst, block.addr)]
        del self._unmapped_at[block.addr]

    def _grow(self, pool: tuple[int, bool], size: int) -> Block | None:
        """``try_allocate_expandable_block``: from the lowest unmapped range with room (with
        the free block before it), map pages until the block holds ``size``."""
        if pool not in self._unmapped:
            # one segment per stream and pool: its whole virtual range, unmapped
            span = 1 << 50
            whole = Block(self._next_addr, span, pool, mapped=False)
            self._next_addr += span
            self._unmapped[pool] = []
            self._insert_unmapped(whole)
        candidate: Block | None = None
        for addr in self._unmapped[pool]:
            c = self._unmapped_at[addr]
            before = c.prev
            if before is not None and not before.allocated:
                c = before
            room = 0
            walk: Block | None = c
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

    def _map(self, block: Block, size: int) -> Block | None:
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

    def _unmap(self, block: Block) -> None:
        """``unmap_block``: give back the whole pages inside a free block."""
        page = self._page(block.pool)
        begin = -(-block.addr // page) * page
        end = ((block.addr + block.size) // page) * page
        if end <= begin:
            return
        self._remove_free(block)
        if begin > block.addr:
            before = Block(block.addr, begin - block.addr, block.pool)
            before.prev, before.next = block.prev, block
            if block.prev is not None:
                block.prev.next = before
            block.prev = before
            self._insert_free(before)
        if end < block.addr + block.size:
            after = Block(end, block.addr + block.size - end, block.pool)
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
