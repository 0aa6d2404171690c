"""Compute slowdown while a collective runs on the same GPU (communication-computation
interference), as a factor on the compute time of the overlapped window.

A running NCCL collective holds SMs (one CTA per channel; "NCCL CTAs won't share an SM with
compute kernels", NVIDIA/nccl#689) and moves HBM traffic (each byte on the bus is read from a
send buffer, written into a receive buffer and, for reductions, read again; NVIDIA/nccl#1433:
NCCL with few SMs still "compete[s] for memory bandwidth"). Compute that runs beside it::

    f_sm    = nccl_sms / sm_count                              # SMs lost to NCCL
    f_hbm   = min(0.9, hbm_bytes_per_bus_byte x busbw / (0.9 x HBM bandwidth))
    factor  = (1 - m) / (1 - f_sm) + m / (1 - f_hbm)

``m`` is the memory-bound share of the overlapped compute time (``LayerTimes.memory_bound_s``
over the block time): compute-bound kernels lose SMs (Calculon's ``flop_time / (1 -
processor_usage)``, calculon/llm/layers.py l.551), memory-bound ones lose bandwidth.
Defaults and checks against compute.md 4: 16 SMs on an 8-NIC DGX (NVIDIA/nccl#689); 2 SMs
on PCIe with one NIC; ``hbm_bytes_per_bus_byte`` 3 for reductions (read local, write received,
read to reduce), 2 for all-gather / all-to-all / send-recv. An H100 NVLink ring at 360 GB/s
busbw with m = 0.1 gives 1.18 and an A100 one at 230 GB/s 1.22, beside the published average
slowdown of 18.9 % (max 40 %) of Lee et al. 2025 (arXiv 2507.03114) on A100/H100.

The engine applies the factor to the compute that runs while a collective is in flight on that
rank (:func:`slowed_compute_s`); the closed form does the same over the known overlap windows.
"""

from __future__ import annotations

from typing import Any

from collsim.core.errors import ConfigError

__all__ = ["overlap_slowdown", "slowed_compute_s", "HBM_BYTES_PER_BUS_BYTE", "PCIE_NCCL_SMS"]

HBM_BYTES_PER_BUS_BYTE = {"reduce": 3.0, "copy": 2.0}
"""HBM bytes a rank moves per byte of collective bus traffic (see the module docstring)."""
PCIE_NCCL_SMS = 2
"""SMs NCCL uses on a PCIe node with one NIC (NVIDIA/nccl#689, sjeaugey)."""


def overlap_slowdown(
    device: Any,
    *,
    busbw_bps: float,
    memory_bound_share: float = 0.0,
    nccl_sms: int | None = None,
    reduction: bool = True,
) -> float:
    """Factor (>= 1) on compute time while a collective with bus bandwidth ``busbw_bps`` runs
    on the same rank (formula in the module docstring).

    Args:
        device: a ``collsim.cluster.hardware.Device`` (``sm_count``, ``nccl_sms``,
            ``memory_bandwidth_bps``).
        busbw_bps: the collective's bus bandwidth (nccl-tests busbw, bytes/s) on that rank.
        memory_bound_share: share of the overlapped compute time in memory-bound kernels.
        nccl_sms: SMs the collective holds (default: the device's ``nccl_sms``).
        reduction: all-reduce / reduce-scatter (3 HBM bytes per bus byte) or a copy (2).
    """
    if not 0.0 <= memory_bound_share <= 1.0:
        raise ConfigError(
            f"must be in [0, 1], got {memory_bound_share}", key_path="memory_bound_share"
        )
    if busbw_bps < 0:
        raise ConfigError(f"must be >= 0, got {busbw_bps}", key_path="busbw_bps")
    if busbw_bps == 0:
        return 1.0
    sms = int(getattr(device, "sm_count", None) or 108)
    held = getattr(device, "nccl_sms", 16) if nccl_sms is None else nccl_sms
    f_sm = min(0.9, max(0.0, held / sms))
    per_bus = HBM_BYTES_PER_BUS_BYTE["reduce" if reduction else "copy"]
    hbm = float(device.memory_bandwidth_bps) * 0.9
    f_hbm = min(0.9, per_bus * busbw_bps / hbm)
    m = memory_bound_share
    return (1.0 - m) / (1.0 - f_sm) + m / (1.0 - f_hbm)


def slowed_compute_s(compute_s: float, overlap_s: float, factor: float) -> float:
    """Wall time of ``compute_s`` of compute that shares the GPU with a collective lasting
    ``overlap_s`` from the compute's start: it runs at 1/factor speed while the collective
    runs, at full speed after it::

        compute_s x factor                            if compute_s x factor <= overlap_s
        overlap_s + (compute_s - overlap_s / factor)  otherwise
    """
    if factor < 1.0:
        raise ConfigError(f"must be >= 1, got {factor}", key_path="factor")
    if compute_s * factor <= overlap_s:
        return compute_s * factor
    return overlap_s + (compute_s - overlap_s / factor)
