"""An algorithm as a short list of phases, timed in closed form or run on a FlowNetwork.

A chunked, pipelined collective is, at flow level, a few phases; in each phase a set of
transfers runs concurrently (all links of a pipelined ring busy at once, each carrying its
total bytes) and the phase pays a latency of ``steps x hop latency``. Every transfer of a phase
carries the same number of bytes (``size_factor x size_bytes``), which makes the uncontended
phase time exact in closed form (:func:`collsim.network.load_bound_time_s`).

Closed form (per protocol p), with M the collective's size in bytes::

    time = overhead + base(p) + sum_phases [steps_intra x max(hop_intra(p), L_intra)
                                            + steps_inter x max(hop_net(p), L_inter)
                                            + size_factor x M x max_l(load_l / cap_l) / eff(p)]

where L_* are the longest physical path latencies of the schedule's intra- and inter-node
transfers. The DES runs the same phases on a :class:`~collsim.network.FlowNetwork`, where other
traffic shares the links.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable, Generator, Sequence

import numpy as np
import simpy

from collsim.collectives import protocols
from collsim.collectives.types import Algorithm, CollectiveOp, Protocol
from collsim.errors import ConfigError
from collsim.network import FlowNetwork, load_bound_time_s
from collsim.topology import LinkKind, Topology

__all__ = ["Transfer", "Phase", "Schedule", "Timing", "make_transfer", "one_step_phase",
           "run_phases"]


@dataclass(frozen=True, slots=True)
class Transfer:
    """One flow of a phase: a path of links, and the ranks whose counters it feeds."""

    path: tuple[int, ...]
    src: int | None
    dst: int | None
    inter: bool
    """True if the path crosses the network (charged the network hop latency)."""
    weight: float = 1.0
    """Bytes of this transfer relative to the phase's ``size_factor`` (1 for almost all)."""


def make_transfer(topology: Topology, src: int, dst: int) -> Transfer:
    """A rank-to-rank transfer along the topology's path."""
    path = topology.path(src, dst)
    return Transfer(path, src, dst, topology.node_of(src) != topology.node_of(dst))


@dataclass(frozen=True, slots=True)
class Phase:
    """Concurrent transfers plus a latency of intra and inter steps.

    Transfers that share a link must carry the same bytes (equal ``weight``): then the closed
    form max_l(bytes on l / cap_l) is exact under max-min sharing.
    """

    transfers: tuple[Transfer, ...]
    size_factor: float
    """Bytes of each transfer per byte of the collective's size."""
    intra_steps: int
    inter_steps: int


#: Bytes per pipeline loop as a function of the collective's size (None: loops are hidden).
LoopBytes = Callable[[float], float]


def one_step_phase(topology: Topology, pairs: Sequence[tuple[int, int]],
                   size_factor: float) -> Phase:
    """All ``pairs`` at once, one step: a network step if any pair crosses nodes."""
    transfers = tuple(make_transfer(topology, src, dst) for src, dst in pairs)
    inter = any(t.inter for t in transfers)
    return Phase(transfers, size_factor, 0 if inter else 1, 1 if inter else 0)


@dataclass(frozen=True, slots=True)
class Timing:
    """The closed form of one (schedule, protocol).

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

    def loop_overhead_s(self, size_bytes: float) -> float:
        """Handshake time of the loops a collective of ``size_bytes`` is cut into."""
        if self.loop_bytes is None or size_bytes <= 0:
            return 0.0
        return math.ceil(size_bytes / self.loop_bytes(size_bytes)) * self.loop_step_s

    def time_s(self, size_bytes: float) -> float:
        """Closed-form time for ``size_bytes``."""
        if self.loop_bytes is None:
            return self.latency_s + size_bytes * self.seconds_per_byte
        return (self.latency_s + size_bytes * self.seconds_per_byte
                + self.loop_overhead_s(size_bytes))


class Schedule:
    """Phases of one (op, algorithm) on one group, with its closed-form timings per protocol."""

    def __init__(self, op: CollectiveOp, algorithm: Algorithm, topology: Topology,
                 phases: Sequence[Phase], loop_bytes: LoopBytes | None = None) -> None:
        self.op = op
        self.loop_bytes = loop_bytes
        self.algorithm = algorithm
        self.topology = topology
        self.phases = tuple(p for p in phases if p.transfers)
        capacity = np.array([link.capacity_bps for link in topology.links], dtype=float)
        self.phase_s_per_byte = [
            p.size_factor * load_bound_time_s([t.path for t in p.transfers], capacity,
                                              [t.weight for t in p.transfers])
            for p in self.phases]
        intra = [topology.path_latency_s(t.path) for p in self.phases for t in p.transfers
                 if not t.inter]
        inter = [topology.path_latency_s(t.path) for p in self.phases for t in p.transfers
                 if t.inter]
        self.intra_path_latency_s = max(intra, default=0.0)
        self.inter_path_latency_s = max(inter, default=0.0)
        kinds = {topology.path_kind(t.path) for p in self.phases for t in p.transfers
                 if not t.inter}
        self.intra_kind = (LinkKind.LOOPBACK if LinkKind.LOOPBACK in kinds else
                           LinkKind.PCIE if LinkKind.PCIE in kinds else LinkKind.NVLINK)
        library = topology.collectives.library
        self.timings: tuple[Timing, ...] = tuple(
            self._timing(p, library) for p in protocols.protocols_for(algorithm, library))

    def _timing(self, protocol: Protocol, library: str) -> Timing:
        alg = self.algorithm
        intra_hop = max(protocols.hop_latency_s(alg, protocol, self.intra_kind, library),
                        self.intra_path_latency_s)
        inter_hop = max(protocols.hop_latency_s(alg, protocol, LinkKind.NETWORK, library),
                        self.inter_path_latency_s)
        settings = self.topology.collectives
        eff = (protocols.bandwidth_efficiency(alg, protocol, library)
               * settings.op_efficiency.get(self.op.value, 1.0))
        latency = settings.op_overhead_s.get(self.op.value, settings.overhead_s)
        if self.phases:
            latency += protocols.base_latency_s(alg, protocol, library)
        latency += sum(p.intra_steps * intra_hop + p.inter_steps * inter_hop for p in self.phases)
        loop_step = 0.0
        if self.loop_bytes is not None and self.phases:
            # one NVLink step handshake per loop, at NCCL's Simple step latency (tuning.cc)
            loop_step = max(protocols.hop_latency_s(Algorithm.RING, Protocol.SIMPLE,
                                                    self.intra_kind, library),
                            self.intra_path_latency_s)
        return Timing(protocol=protocol, latency_s=latency,
                      seconds_per_byte=sum(self.phase_s_per_byte) / eff, efficiency=eff,
                      intra_hop_s=intra_hop, inter_hop_s=inter_hop, loop_step_s=loop_step,
                      loop_bytes=self.loop_bytes if loop_step > 0 else None)

    def timing(self, protocol: Protocol) -> Timing:
        """The timing of ``protocol``; ConfigError if the algorithm cannot use it here."""
        for timing in self.timings:
            if timing.protocol is protocol:
                return timing
        raise ConfigError(f"{self.algorithm.value} has no protocol {protocol.value} here; "
                          f"choose from {', '.join(t.protocol.value for t in self.timings)}")


def run_phases(env: simpy.Environment, net: FlowNetwork, schedule: Schedule, timing: Timing,
               size_bytes: float) -> Generator[simpy.Event, object, float]:
    """SimPy process body: the schedule's phases one after another on ``net``.

    Returns the elapsed simulated time in seconds.
    """
    start = env.now
    fixed = timing.latency_s - sum(p.intra_steps * timing.intra_hop_s
                                   + p.inter_steps * timing.inter_hop_s for p in schedule.phases)
    if fixed > 0:
        yield env.timeout(fixed)
    for phase in schedule.phases:
        per_transfer = phase.size_factor * size_bytes
        events = [net.transfer_path(t.path, per_transfer * t.weight, src=t.src, dst=t.dst,
                                    efficiency=timing.efficiency, latency_s=0.0)
                  for t in phase.transfers]
        yield simpy.AllOf(env, events)
        latency = phase.intra_steps * timing.intra_hop_s + phase.inter_steps * timing.inter_hop_s
        if latency > 0:
            yield env.timeout(latency)
    loops = timing.loop_overhead_s(size_bytes)
    if loops > 0:
        yield env.timeout(loops)
    return env.now - start
