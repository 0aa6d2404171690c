"""Units: sizes in bytes, times in seconds, rates in bytes or FLOP per second.

Decimal prefixes are decimal (GB = 1e9 bytes, GB/s = 1e9 bytes/s, Gb/s = 1e9 bits/s); binary
prefixes are binary (GiB = 2**30 bytes). Sizes typed on the command line follow nccl-tests:
``1K``/``1M``/``1G`` are KiB/MiB/GiB.

Everything inside collsim is SI (bytes, seconds, bytes/s); YAML keys carry their unit in the
name (``bandwidth_gbps``, ``latency_us``) and are converted once, in the loaders.
"""

from __future__ import annotations

import re

__all__ = [
    "KB",
    "MB",
    "GB",
    "TB",
    "KiB",
    "MiB",
    "GiB",
    "TiB",
    "US",
    "MS",
    "NS",
    "gbps_to_bps",
    "gbit_to_bps",
    "tflops_to_flops",
    "parse_size",
    "format_size",
]

KB = 1e3
MB = 1e6
GB = 1e9
TB = 1e12
KiB = 1 << 10
MiB = 1 << 20
GiB = 1 << 30
TiB = 1 << 40

NS = 1e-9
US = 1e-6
MS = 1e-3


def gbps_to_bps(bandwidth_gbps: float) -> float:
    """GB/s (1e9 bytes/s) to bytes/s."""
    return bandwidth_gbps * GB


def gbit_to_bps(rate_gbit: float) -> float:
    """Gb/s (1e9 bits/s, a NIC's port rate) to bytes/s."""
    return rate_gbit * GB / 8.0


def tflops_to_flops(tflops: float) -> float:
    """TFLOP/s to FLOP/s."""
    return tflops * 1e12


_SIZE_RE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([kKmMgGtT]?)(i?[bB])?\s*$")
_BINARY = {"": 1, "k": KiB, "m": MiB, "g": GiB, "t": TiB}


def parse_size(text: str | int) -> int:
    """Parse an nccl-tests style size: ``8``, ``1K``, ``16M``, ``8G`` (binary prefixes).

    ``1KB``, ``1KiB`` and ``1k`` all mean 1024 bytes, as in nccl-tests.

    Raises:
        ValueError: the text is not a size.
    """
    if isinstance(text, int):
        if text < 0:
            raise ValueError(f"size must be >= 0, got {text}")
        return text
    match = _SIZE_RE.match(str(text))
    if not match:
        raise ValueError(f"not a size: {text!r} (expected e.g. 8, 1K, 16M, 8G)")
    number, prefix, _ = match.groups()
    value = float(number) * _BINARY[prefix.lower()]
    return int(round(value))


def format_size(size_bytes: float) -> str:
    """Human-readable binary size: ``format_size(3 * 2**20) == '3 MiB'``."""
    value = float(size_bytes)
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(value) < 1024 or unit == "TiB":
            if unit == "B":
                return f"{value:.0f} B"  # rounded, like the larger units
            return f"{value:.4g} {unit}"
        value /= 1024
    raise AssertionError("unreachable")
