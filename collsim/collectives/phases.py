"""An algorithm as a short list of phases, timed in closed form or run on a FlowNetwork; the
parts of a phase (transfers, link loads) are in :mod:`collsim.collectives.transfers`.
Derivations, measurements and sources: docs/derivations.md, ``collsim.collectives.phases``.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Generator, Sequence
from dataclasses import dataclass

import simpy

import collsim.collectives.protocols as protocols
from collsim.cluster.network import FlowNetwork, PackedSends
from collsim.cluster.topology import CollectiveSettings, Topology
from collsim.collectives.transfers import (
    AGGREGATE_ABOVE,
    AnyPhase,
    LoadPhase,
    LoopBytes,
    PhaseLoad,
    Transfer,
    aggregate_transfers,
    equal_weights_per_link,
    merge_identical,
    phase_load,
)
from collsim.core.errors import ConfigError
from collsim.core.vocab import Algorithm, CollectiveOp, LinkKind, Protocol

__all__ = ["CollectivePhases", "ProtocolCap", "Timing", "run_phases"]


@dataclass(frozen=True, slots=True)
class Timing:
    """The closed form of one (collective's phases, protocol).

    time_s = latency_s + size x seconds_per_byte [+ loops(size) x loop_step_s], where the loop
    term exists only for algorithms whose loops end in a handshake that is not overlapped
    (NVLS, see :mod:`collsim.collectives.nvls`).
    """

    protocol: Protocol
    latency_s: float
    seconds_per_byte: float
    efficiency: float
    intra_hop_s: float
    inter_hop_s: float
    loop_step_s: float = 0.0
    loop_bytes: LoopBytes | None = None
    knee_bytes: float | None = None
    """Bytes above which each byte costs ``knee_s_per_byte`` more (a calibrated knee,
    ``collectives.ops.<op>.knee_bytes``); None: one regime."""
    knee_s_per_byte: float = 0.0
    channel_s: Callable[[float], float] | None = None
    """Extra time when a call runs on fewer channels than the line assumes (NCCL cuts the
    channel count for small sizes, src/enqueue.cc ``topoGetAlgoInfo``); None: never."""

    def knee_s(self, size_bytes: float) -> float:
        """The extra time of the bytes above the knee (0 without a knee or below it)."""
        if self.knee_bytes is None or size_bytes <= self.knee_bytes:
            return 0.0
        return (size_bytes - self.knee_bytes) * self.knee_s_per_byte

    def extra_s(self, size_bytes: float) -> float:
        """The size-dependent terms beyond the line: loop handshakes, the knee and the
        channels a small call leaves idle."""
        extra = self.loop_overhead_s(size_bytes) + self.knee_s(size_bytes)
        if self.channel_s is not None:
            extra += self.channel_s(size_bytes)
        return extra

    @property
    def has_extra(self) -> bool:
        """Whether :meth:`extra_s` can be non-zero (the fast paths skip it otherwise)."""
        return (
            self.loop_bytes is not None or self.knee_bytes is not None or self.channel_s is not None
        )

    def loop_overhead_s(self, size_bytes: float) -> float:
        """Handshake time of the loops a collective of ``size_bytes`` is cut into."""
        if self.loop_bytes is None or size_bytes <= 0:
            return 0.0
        return math.ceil(size_bytes / self.loop_bytes(size_bytes)) * self.loop_step_s

    def time_s(self, size_bytes: float) -> float:
        """Closed-form time for ``size_bytes``."""
        if not self.has_extra:
            return self.latency_s + size_bytes * self.seconds_per_byte
        return self.latency_s + size_bytes * self.seconds_per_byte + self.extra_s(size_bytes)


@dataclass(frozen=True, slots=True)
class ProtocolCap:
    """NCCL's ceiling on a protocol's algorithm bandwidth (src/graph/tuning.cc) and how it
    scales with the channels a call of a given size runs on (src/enqueue.cc)."""

    total_bps: float
    """Ceiling with every channel busy, bytes/s of algorithm bandwidth."""
    per_channel_bps: float
    """One channel's share of it (the ceiling over the graph's channels)."""
    full_channels: int
    """Channels of a large call (``comm->nChannels``)."""
    min_bytes_per_channel: float
    """Bytes below which NCCL drops a channel (threads x thread threshold, enqueue.cc
    ``topoGetAlgoInfo``); 0: the channel count does not depend on the size."""


def _channel_term(cap: ProtocolCap, s_per_byte: float) -> Callable[[float], float]:
    """Extra seconds of a call on fewer channels, less what the line already charges.

    NCCL runs floor(bytes / min_bytes_per_channel) channels (at least 1, at most all), so
    each carries between one and two times ``min_bytes_per_channel``; collsim takes the
    power-of-two value, exactly that minimum (bytes / channels = min_bytes_per_channel), which
    keeps the time non-decreasing in size: a call below the full channel count costs
    min(bytes, min_bytes_per_channel) / per-channel rate."""
    per_channel = cap.per_channel_bps
    floor_bytes = cap.min_bytes_per_channel
    full = cap.full_channels

    def extra_s(size_bytes: float) -> float:
        if size_bytes <= 0 or floor_bytes <= 0:
            return 0.0
        channels = min(float(full), max(1.0, size_bytes / floor_bytes))
        slow = size_bytes / (channels * per_channel) - size_bytes * s_per_byte
        return slow if slow > 0 else 0.0

    return extra_s


class CollectivePhases:
    """Phases of one (op, algorithm) on one group, with its closed-form timings per protocol."""

    def __init__(
        self,
        op: CollectiveOp,
        algorithm: Algorithm,
        topology: Topology,
        phases: Sequence[AnyPhase],
        loop_bytes: LoopBytes | None = None,
        *,
        latency_for: Callable[[Protocol], float] | None = None,
        cap_for: Callable[[Protocol], ProtocolCap | None] | None = None,
        loop_step_s: float | None = None,
    ) -> None:
        """``latency_for(protocol)`` replaces the step-count latency (seconds, base and hops
        included) where an algorithm's latency is not steps x hops (PAT, CollNet);
        ``cap_for(protocol)`` is a ceiling on the algorithm bandwidth in bytes/s (NCCL's
        LL / LL128 limits, :func:`collsim.collectives.tuner.TunerTable`), folded into the
        timing's efficiency so that the DES runs at the same rate; ``loop_step_s`` is the
        handshake that ends each loop of ``loop_bytes`` (default: one NVLink step at NCCL's
        Simple step latency)."""
        self.op = op
        self.loop_bytes = loop_bytes
        self._latency_for = latency_for
        self._cap_for = cap_for
        self.loop_step_override_s = loop_step_s
        self.algorithm = algorithm
        self.topology = topology
        # Phases repeat (all_reduce = the same phase twice): summarise each object once.
        seen: dict[int, PhaseLoad] = {}
        for p in phases:
            if id(p) not in seen:
                seen[id(p)] = phase_load(p, topology)
        self.phases = tuple(
            p
            for p in phases
            if (len(seen[id(p)].link_index) if isinstance(p, LoadPhase) else p.transfers)
        )
        loads = [seen[id(p)] for p in self.phases]
        capacity = topology.link_capacity_bps
        self.phase_s_per_byte = [
            p.size_factor * float((load.link_weight / capacity[load.link_index]).max())
            if len(load.link_index)
            else 0.0
            for p, load in zip(self.phases, loads)
        ]
        self.intra_path_latency_s = max((load.intra_latency_s for load in loads), default=0.0)
        self.inter_path_latency_s = max((load.inter_latency_s for load in loads), default=0.0)
        kinds = {kind for load in loads for kind in load.intra_kinds}
        self._des: dict[int, tuple[Transfer, ...]] = {}
        self._sends: dict[int, PackedSends] = {}
        self.intra_kind = (
            LinkKind.LOOPBACK
            if LinkKind.LOOPBACK in kinds
            else LinkKind.PCIE
            if LinkKind.PCIE in kinds
            else LinkKind.NVLINK
        )
        self._library = topology.collectives.library
        self.protocols: tuple[Protocol, ...] = tuple(
            protocols.protocols_for(algorithm, self._library)
        )
        """The protocols this algorithm runs with here, in NCCL's order."""
        self._timings: dict[Protocol, Timing] = {}

    @property
    def timings(self) -> tuple[Timing, ...]:
        """The closed form of every protocol (:attr:`protocols`, in order)."""
        return tuple(self.timing(p) for p in self.protocols)

    def _timing(self, protocol: Protocol, library: str) -> Timing:
        alg = self.algorithm
        topo = self.topology
        spans_nodes = any(p.inter_steps for p in self.phases) or self.inter_path_latency_s > 0
        intra_hop = max(
            protocols.hop_latency_s(alg, protocol, self.intra_kind, library),
            self.intra_path_latency_s,
        )
        if alg is Algorithm.RING and spans_nodes and library == "nccl":
            # "inter-node rings still have to launch nsteps * net overhead" (tuning.cc)
            intra_hop = max(
                intra_hop, protocols.net_overhead_s(protocol, topo.host_cpu_vendor == "amd")
            )
        inter_hop = max(
            protocols.hop_latency_s(
                alg,
                protocol,
                LinkKind.NETWORK,
                library,
                topo.fabric.net_latency_s,
                topo.fabric.net_simple_latency_s,
            ),
            self.inter_path_latency_s,
        )
        settings = topo.collectives
        eff = protocols.bandwidth_efficiency(alg, protocol, library) * settings.op_efficiency.get(
            self.op.value, 1.0
        )
        link_s_per_byte = sum(self.phase_s_per_byte)
        cap = self._cap_for(protocol) if self._cap_for is not None else None
        channel_s: Callable[[float], float] | None = None
        if cap is not None and link_s_per_byte > 0:
            if 1.0 / cap.total_bps > link_s_per_byte / eff:
                eff = link_s_per_byte * cap.total_bps  # the protocol's ceiling binds
            channel_s = _channel_term(cap, link_s_per_byte / eff)
        latency = settings.op_overhead_s.get(self.op.value, settings.overhead_s)
        if self.phases and self._latency_for is not None:
            latency += self._latency_for(protocol)
            intra_hop = inter_hop = 0.0  # the hook's latency already holds the steps
        else:
            if self.phases:
                latency += protocols.base_latency_s(alg, protocol, library)
            latency += sum(
                p.intra_steps * intra_hop + p.inter_steps * inter_hop for p in self.phases
            )
        loop_step = 0.0
        if self.loop_bytes is not None and self.phases:
            # one NVLink step handshake per loop at NCCL's Simple step latency (tuning.cc),
            # unless the algorithm gives its own (NVLS: fitted, see collectives.nvls)
            loop_step = max(
                protocols.hop_latency_s(Algorithm.RING, Protocol.SIMPLE, self.intra_kind, library),
                self.intra_path_latency_s,
            )
            if self.loop_step_override_s is not None:
                loop_step = max(self.loop_step_override_s, self.intra_path_latency_s)
        return Timing(
            protocol=protocol,
            latency_s=latency,
            seconds_per_byte=link_s_per_byte / eff,
            efficiency=eff,
            intra_hop_s=intra_hop,
            inter_hop_s=inter_hop,
            loop_step_s=loop_step,
            loop_bytes=self.loop_bytes if loop_step > 0 else None,
            channel_s=channel_s,
            **self._knee(eff, settings),
        )

    def des_sends(self, phase: AnyPhase) -> PackedSends:
        """:meth:`des_transfers` packed for :meth:`FlowNetwork.send_all`, bytes per byte of
        the phase's size (cached: every message size sends the same flows)."""
        found = self._sends.get(id(phase))
        if found is None:
            found = PackedSends.of(
                [(t.path, t.weight, t.src, t.dst, t.count) for t in self.des_transfers(phase)]
            )
            self._sends[id(phase)] = found
        return found

    def des_transfers(self, phase: AnyPhase) -> tuple[Transfer, ...]:
        """The flows the DES runs for ``phase``: its transfers, merged by
        :func:`aggregate_transfers` when there are more than :data:`AGGREGATE_ABOVE`."""
        found = self._des.get(id(phase))
        if found is None:
            found = merge_identical(phase.transfers)
            if len(found) > AGGREGATE_ABOVE:
                merged = aggregate_transfers(found)
                if equal_weights_per_link(merged, len(self.topology.links)):
                    found = merged
            self._des[id(phase)] = found
        return found

    def _knee(self, eff: float, settings: CollectiveSettings) -> dict[str, float]:
        """Timing fields of the op's calibrated knee (``collectives.ops.<op>.knee_bytes`` and
        ``.knee_efficiency``): above ``knee_bytes`` the bytes move at ``knee_efficiency``
        instead of the op's efficiency, so each costs sum(phase s/B) / eff x (op efficiency /
        knee_efficiency - 1) more. The DES adds that after the phases, as it adds loop
        handshakes: a per-byte cost of the library (memory, caches), not of the links."""
        knee = settings.op_knee.get(self.op.value)
        if knee is None or not self.phases:
            return {}
        knee_bytes, knee_eff = knee
        ratio = settings.op_efficiency.get(self.op.value, 1.0) / knee_eff  # >= 1
        per_byte = sum(self.phase_s_per_byte) / eff
        return {"knee_bytes": knee_bytes, "knee_s_per_byte": per_byte * (ratio - 1.0)}

    def timing(self, protocol: Protocol) -> Timing:
        """The timing of ``protocol``, worked out when first asked for (NCCL's tuner picks one
        protocol per size: the others of an algorithm are often never needed); ConfigError if
        the algorithm cannot use it here."""
        found = self._timings.get(protocol)
        if found is None:
            if protocol not in self.protocols:
                raise ConfigError(
                    f"{self.algorithm.value} has no protocol {protocol.value} here; "
                    f"choose from {', '.join(p.value for p in self.protocols)}"
                )
            found = self._timings[protocol] = self._timing(protocol, self._library)
        return found


def run_phases(
    env: simpy.Environment,
    net: FlowNetwork,
    collective: CollectivePhases,
    timing: Timing,
    size_bytes: float,
) -> Generator[simpy.Event, object, float]:
    """SimPy process body: the collective's phases one after another on ``net``.

    Returns the elapsed simulated time in seconds.
    """
    start = env.now
    fixed = timing.latency_s - sum(
        p.intra_steps * timing.intra_hop_s + p.inter_steps * timing.inter_hop_s
        for p in collective.phases
    )
    if fixed > 0:
        yield env.timeout(fixed)
    for phase in collective.phases:
        yield net.send_all(
            collective.des_sends(phase),
            efficiency=timing.efficiency,
            scale=phase.size_factor * size_bytes,
        )
        latency = phase.intra_steps * timing.intra_hop_s + phase.inter_steps * timing.inter_hop_s
        if latency > 0:
            yield env.timeout(latency)
    loops = timing.extra_s(size_bytes)  # loop handshakes and a calibrated knee
    if loops > 0:
        yield env.timeout(loops)
    return env.now - start
