"""The memory of a local bench: its estimate before the ranks start (refused when it does not
fit this machine's available memory), and how each rank hands the memory it freed back to
the system between points (glibc's mmap threshold and ``malloc_trim``)."""

from __future__ import annotations

import ctypes
import functools
from collections.abc import Callable
from typing import cast

from collsim.core.errors import ConfigError
from collsim.validate.measure.bench_ops import (
    _CHECK_BLOCK,
    _ELEMENT_BYTES,
    BenchConfig,
    element_count,
)

__all__ = [
    "RANK_BASE_BYTES",
    "RANK_BASE_BYTES_SOURCE",
    "PARENT_BYTES",
    "bench_memory_bytes",
    "available_memory_bytes",
    "check_bench_memory",
]


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


#: Memory of one spawned gloo rank before its buffers: the interpreter, torch and a process
#: group (proportional set size, PSS, per added rank of ``validate bench -b 1K -e 1K``: see
#: :data:`RANK_BASE_BYTES_SOURCE`).
RANK_BASE_BYTES = 240 * 2**20
RANK_BASE_BYTES_SOURCE = (
    "benchmarks/peak_rss.py -- collsim validate bench -b 1K -e 1K -n 1 -w 0 --ops all_reduce, "
    "torch 2.13.0+cpu: peak PSS of the process tree 0.41 / 0.62 / 1.04 GiB with 1 / 2 / 4 ranks"
)
#: Buffers of the op's size a gloo rank holds at its peak, with the backend's own copies, per
#: op (all_gather and reduce_scatter in place: :data:`~.bench_ops.GLOO_IN_PLACE`). Measured
#: (torch 2.13.0+cpu) as the PSS of each rank sampled every 0.1 s above its base of 152-157 MiB
#: during the sweep (the profiler's share of :data:`RANK_BASE_BYTES` comes after the sweep), in
#: 256 MiB buffers, 4 ranks: ``validate bench --world-size 4 --ops all_gather,reduce_scatter,
#: all_to_all,send_recv,all_reduce -b 256M -e 256M -n 2 -w 1``: all_gather 2.00, reduce_scatter
#: 2.01, all_to_all 2.04, send_recv 2.03 (in place: out of place all_gather held 2.24 and
#: reduce_scatter 2.27, gloo's flat output and input clone); ``validate bench --world-size 4
#: -b 1K -e 256M -n 2 -w 1``: all_reduce 1.06, broadcast 1.06. Rounded up to the quarter.
_OP_BUFFERS: dict[str, float] = {
    "all_reduce": 1.25,
    "broadcast": 1.25,
    "all_gather": 2.25,
    "reduce_scatter": 2.25,
    "all_to_all": 2.25,
    "send_recv": 2.25,
}
#: Memory of the launching process, which never imports torch (the same run: 15 MiB PSS and 7
#: MiB for multiprocessing's resource tracker, rounded up).
PARENT_BYTES = 32 * 2**20


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
