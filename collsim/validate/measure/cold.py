"""Cold operands for the kernel timings of ``collsim validate compute``: flat random pools past
the last-level cache (CPU) or L2 (GPU), cut into blocks that consecutive timed calls take in
turn, so that a kernel is timed on operands and results that are not cache-resident, as in
training (hot and cold rates: docs/derivations.md, measurements).
"""

from __future__ import annotations

from typing import Any

COLD_BYTES = 64 * 2**20
"""Operand bytes cycled through per GEMM shape, above a CPU's last-level cache and a GPU's L2:
in training a GEMM's operands (a weight used once per micro-batch, an activation written by
other kernels in between) are not cache-resident as a benchmark that reuses one pair is (hot
and cold rates in docs/derivations.md, measurements)."""


_POOLS: dict[tuple[str, str, str], Any] = {}


def _pool(torch: Any, dev: Any, dtype: Any, role: str = "in") -> Any:
    """One flat random buffer of :data:`COLD_BYTES` per device, dtype and role (``in``: GEMM
    operands, ``out``: GEMM results); operands and results are views into it, so that no
    shape pays for filling its own buffers."""
    key = (str(dev), str(dtype), role)
    if key not in _POOLS:
        elems = COLD_BYTES // (torch.finfo(dtype).bits // 8)
        _POOLS[key] = torch.randn(elems, device=dev, dtype=dtype)
    return _POOLS[key]


_CURSOR = [0]


def _next_slot(count: int) -> int:
    """The next slot of ``count``, from one cursor every cold timing shares: consecutive
    calls, across layouts, shapes and sections, take consecutive slots, so that none finds
    what the call before it touched until a pool wraps."""
    _CURSOR[0] += 1
    return _CURSOR[0] % count


def _slot(pool: Any, slot: int, elems: int, count: int) -> list[Any]:
    """The ``count`` consecutive views of ``elems`` each that make up block ``slot`` of a
    flat pool (a kernel's operands and result)."""
    base = slot * count * elems
    return [pool[base + j * elems : base + (j + 1) * elems] for j in range(count)]


MAX_COLD_BYTES = 3 * 2**30 // 2
"""Largest pool a size gets of its own (1.5 GiB): room for the 4 blocks of the largest default
memory-bound size (256 MiB moved: 1 GiB); a size past it is left out of the table."""


def _cold_blocks(torch: Any, dev: Any, dtype: Any, block_elems: int) -> tuple[Any, int] | None:
    """A pool of at least 4 blocks of ``block_elems`` (at most 64): the shared
    :data:`COLD_BYTES` pool where it holds 4, else one of its own of 4 blocks (filled once,
    outside any timing); None when 4 blocks exceed :data:`MAX_COLD_BYTES`."""
    pool = _pool(torch, dev, dtype, "out")
    if pool.numel() < 4 * block_elems:
        itemsize = torch.finfo(dtype).bits // 8
        if 4 * block_elems * itemsize > MAX_COLD_BYTES:
            return None
        pool = torch.empty(4 * block_elems, device=dev, dtype=dtype).uniform_(-1.0, 1.0)
    return pool, min(64, pool.numel() // block_elems)
