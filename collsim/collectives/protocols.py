"""Latency and bandwidth-efficiency tables per (algorithm, protocol), after NCCL's cost model.

Source: NCCL 2.30.7 src/graph/tuning.cc (``ncclTunerConstantsDefaults``), the same tables the
tuner uses (:mod:`collsim.collectives.tuner`). time = base latency + per-step hop latency x
steps + bytes / (bandwidth x efficiency).

- Base latency (us), LL / LL128 / Simple: Ring 6.6 / 14.0 / 8.4; Tree 6.8 / 14.0 / 8.4; PAT 8;
  CollNet, NVLS and NVLS-tree 0.
- Hop latency (us) per link class (NVLink, PCIe, network): ``hwLatencies`` (tuner._HW_US).
  Across nodes the fabric's ``net_latency_us`` (LL / LL128) or ``net_simple_latency_us``
  (Simple) is added to every network hop (the network plugin's ``latencyInter``, which
  tuning.cc adds once, and once more for Simple's flush); a ring's
  intra-node steps pay at least NCCL's network post overhead (``getNetOverhead``: 1 us on
  Intel, 2 on AMD, x3 for Simple) once the ring spans nodes.
- Bandwidth efficiency: LL 0.5 (half of every 8-byte word is a flag), LL128 0.92 (120 of 128
  bytes are data, NCCL's factor), Simple 1.0; Tree all_reduce a further 0.92 (NCCL's factors,
  tuning.cc). NVLS and NVLS-tree get no factor here: NCCL's ``nvlsEfficiency`` (0.85 Hopper,
  0.74 Blackwell) scales the *graph* bandwidth in the tuner, whereas collsim's links already run
  at NCCL's per-link NVLink figure (topology ``intra_node.efficiency``), and NVLS's slow ramp
  is its per-loop handshake (:mod:`collsim.collectives.nvls`). LL and LL128 are further capped
  at NCCL's own ceilings (``llMaxBws``, ``perChMaxRingLL128Bws``, ``perChMaxTreeLL128Bws``),
  applied by the schedule from the tuner's table.
- NVLS, NVLS-tree, CollNet and PAT run Simple only (tuning.cc skips the others).
- Halving-doubling, direct and hierarchical are not NCCL algorithms: they use Ring's table, as
  they move data with the same send/recv primitives.
- gloo (``library: gloo``): one protocol, no software latency beyond the topology's
  ``overhead_us`` and the links' own latencies.

A step's latency is max(protocol hop latency, physical path latency): NCCL's per-hop figures
are end-to-end measurements that already include the wire, so the links' latencies only show
when they are larger (a slow fabric, a calibrated loopback).
"""

from __future__ import annotations

from collsim.collectives import tuner
from collsim.vocab import Algorithm, LinkKind, Protocol

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
