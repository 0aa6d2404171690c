"""Latency and bandwidth-efficiency tables per (algorithm, protocol), after NCCL's cost model.

Derivations, measurements and sources: docs/derivations.md, ``collsim.collectives.protocols``.
"""

from __future__ import annotations

import collsim.collectives.tuner as tuner
from collsim.core.vocab import Algorithm, LinkKind, Protocol

__all__ = [
    "protocols_for",
    "base_latency_s",
    "hop_latency_s",
    "bandwidth_efficiency",
    "SIMPLE_ONLY",
    "net_overhead_s",
]

_LL, _LL128, _SIMPLE = Protocol.LL, Protocol.LL128, Protocol.SIMPLE
_PROTOS = (_LL, _LL128, _SIMPLE)

SIMPLE_ONLY = frozenset(
    {
        Algorithm.NVLS,
        Algorithm.NVLS_TREE,
        Algorithm.COLLNET_DIRECT,
        Algorithm.COLLNET_CHAIN,
        Algorithm.PAT,
    }
)
"""Algorithms NCCL runs with the Simple protocol only (tuning.cc)."""

_HW_ROW = {
    LinkKind.NVLINK: tuner._NVLINK_HW,
    LinkKind.PCIE: tuner._PCI_HW,
    LinkKind.NETWORK: tuner._NET_HW,
}

_PROTOCOL_EFFICIENCY = {_LL: 0.5, _LL128: 0.92, _SIMPLE: 1.0}
_ALGORITHM_EFFICIENCY = {Algorithm.TREE: 0.92}


def _table(algorithm: Algorithm) -> Algorithm:
    return algorithm if algorithm in tuner._BASE_US else Algorithm.RING


def protocols_for(algorithm: Algorithm, library: str) -> tuple[Protocol, ...]:
    """Protocols an algorithm can run with under ``library`` (``nccl`` or ``gloo``)."""
    if library == "gloo" or algorithm in SIMPLE_ONLY:
        return (_SIMPLE,)
    return _PROTOS


def base_latency_s(algorithm: Algorithm, protocol: Protocol, library: str) -> float:
    """Fixed latency of one collective call, seconds."""
    if library == "gloo":
        return 0.0
    return tuner._BASE_US[_table(algorithm)][_PROTOS.index(protocol)] * 1e-6


def hop_latency_s(
    algorithm: Algorithm,
    protocol: Protocol,
    kind: LinkKind,
    library: str,
    net_latency_s: float = 0.0,
    net_simple_latency_s: float = 0.0,
) -> float:
    """Software latency of one step over a link of class ``kind``, seconds.

    ``net_latency_s`` / ``net_simple_latency_s`` are the fabric's per-step latencies for LL /
    LL128 and for Simple, added to network hops (the transport's ``latencyInter``, tuning.cc).
    """
    if library == "gloo" or kind is LinkKind.LOOPBACK:
        return 0.0
    hop = tuner._HW_US[_HW_ROW[kind]][_table(algorithm)][_PROTOS.index(protocol)] * 1e-6
    if kind is LinkKind.NETWORK:
        hop += net_simple_latency_s if protocol is _SIMPLE else net_latency_s
    return hop


def net_overhead_s(protocol: Protocol, amd_cpu: bool) -> float:
    """NCCL's network post overhead per ring step once a ring spans nodes (tuning.cc
    ``getNetOverhead``: 1 us on Intel x86, 2 us on AMD; x3 for Simple)."""
    overhead = 2.0e-6 if amd_cpu else 1.0e-6
    return overhead * 3 if protocol is _SIMPLE else overhead


def bandwidth_efficiency(algorithm: Algorithm, protocol: Protocol, library: str) -> float:
    """Payload share of the link bandwidth the (algorithm, protocol) achieves."""
    if library == "gloo":
        return 1.0
    return _PROTOCOL_EFFICIENCY[protocol] * _ALGORITHM_EFFICIENCY.get(algorithm, 1.0)
