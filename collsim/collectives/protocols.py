"""Latency and bandwidth-efficiency tables per (algorithm, protocol), after NCCL's cost model.

Source: NCCL src/graph/tuning.cc (NCCL 2.30), as listed in /work/shared/reference/README.md.
time = base latency + per-step hop latency x steps + bytes / (bandwidth x efficiency).

- Base latency (us), LL / LL128 / Simple: Ring 6.6 / 14.0 / 8.4; Tree 6.8 / 14.0 / 8.4.
- Hop latency (us) per link class (NVLink, PCIe, network): see ``_HOP_US``.
- Bandwidth efficiency: LL 0.5 (half of every 8-byte word is a flag), LL128 0.92 (120 of 128
  bytes are data, NCCL's factor), Simple 1.0; Tree all_reduce a further 0.92; NVLS 0.85 on
  Hopper (all NCCL's own factors, tuning.cc).
- NVLS runs Simple only; its hop latency on NVLink is 25 us with base 0 (tuning.cc hwLat).
- Halving-doubling, direct and hierarchical are not NCCL algorithms: they use Ring's table, as
  they move data with the same send/recv primitives.
- gloo (``library: gloo``): one protocol, no software latency beyond the topology's
  ``overhead_us`` and the links' own latencies.

A step's latency is max(protocol hop latency, physical path latency): NCCL's per-hop figures
are end-to-end measurements that already include the wire, so the links' latencies only show
when they are larger (a slow fabric, a calibrated loopback).
"""

from __future__ import annotations

from collsim.collectives.types import Algorithm, Protocol
from collsim.topology import LinkKind

__all__ = ["protocols_for", "base_latency_s", "hop_latency_s", "bandwidth_efficiency"]

_LL, _LL128, _SIMPLE = Protocol.LL, Protocol.LL128, Protocol.SIMPLE

_BASE_US = {
    Algorithm.RING: {_LL: 6.6, _LL128: 14.0, _SIMPLE: 8.4},
    Algorithm.TREE: {_LL: 6.8, _LL128: 14.0, _SIMPLE: 8.4},
    Algorithm.NVLS: {_SIMPLE: 0.0},
}

_HOP_US = {
    Algorithm.RING: {
        LinkKind.NVLINK: {_LL: 0.6, _LL128: 1.9, _SIMPLE: 3.4},
        LinkKind.PCIE: {_LL: 1.0, _LL128: 2.5, _SIMPLE: 5.7},
        LinkKind.NETWORK: {_LL: 2.7, _LL128: 4.0, _SIMPLE: 14.0},
    },
    Algorithm.TREE: {
        LinkKind.NVLINK: {_LL: 0.6, _LL128: 1.25, _SIMPLE: 4.0},
        LinkKind.PCIE: {_LL: 1.0, _LL128: 1.9, _SIMPLE: 4.0},
        LinkKind.NETWORK: {_LL: 5.0, _LL128: 8.5, _SIMPLE: 14.0},
    },
    Algorithm.NVLS: {
        LinkKind.NVLINK: {_SIMPLE: 25.0},
        LinkKind.PCIE: {_SIMPLE: 25.0},
        LinkKind.NETWORK: {_SIMPLE: 25.0},
    },
}

_PROTOCOL_EFFICIENCY = {_LL: 0.5, _LL128: 0.92, _SIMPLE: 1.0}
_ALGORITHM_EFFICIENCY = {Algorithm.TREE: 0.92, Algorithm.NVLS: 0.85}


def _table(algorithm: Algorithm) -> Algorithm:
    return algorithm if algorithm in _BASE_US else Algorithm.RING


def protocols_for(algorithm: Algorithm, library: str) -> tuple[Protocol, ...]:
    """Protocols an algorithm can run with under ``library`` (``nccl`` or ``gloo``)."""
    if library == "gloo" or algorithm is Algorithm.NVLS:
        return (_SIMPLE,)
    return (_LL, _LL128, _SIMPLE)


def base_latency_s(algorithm: Algorithm, protocol: Protocol, library: str) -> float:
    """Fixed latency of one collective call, seconds."""
    if library == "gloo":
        return 0.0
    return _BASE_US[_table(algorithm)][protocol] * 1e-6


def hop_latency_s(algorithm: Algorithm, protocol: Protocol, kind: LinkKind, library: str) -> float:
    """Software latency of one step over a link of class ``kind``, seconds."""
    if library == "gloo" or kind is LinkKind.LOOPBACK:
        return 0.0
    return _HOP_US[_table(algorithm)][kind][protocol] * 1e-6


def bandwidth_efficiency(algorithm: Algorithm, protocol: Protocol, library: str) -> float:
    """Payload share of the link bandwidth the (algorithm, protocol) achieves."""
    if library == "gloo":
        return 1.0
    return _PROTOCOL_EFFICIENCY[protocol] * _ALGORITHM_EFFICIENCY.get(algorithm, 1.0)
