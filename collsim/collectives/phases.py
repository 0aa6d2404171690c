"""An algorithm as a short list of phases, timed in closed form or run on a FlowNetwork.

Derivations, measurements and sources: docs/derivations.md, ``collsim.collectives.phases``.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Generator, Sequence
from dataclasses import dataclass

import numpy as np
import simpy

from collsim.cluster.network import FlowNetwork, PackedSends
from collsim.cluster.topology import CollectiveSettings, Topology
from collsim.collectives import protocols
from collsim.core.errors import ConfigError
from collsim.core.vocab import Algorithm, CollectiveOp, LinkKind, Protocol

__all__ = [
    "Transfer",
    "Phase",
    "LoadPhase",
    "PhaseLoad",
    "CollectivePhases",
    "Timing",
    "ProtocolCap",
    "make_transfer",
    "one_step_phase",
    "phase_load",
    "aggregate_transfers",
    "merge_identical",
    "equal_weights_per_link",
    "run_phases",
    "AGGREGATE_ABOVE",
]

AGGREGATE_ABOVE = 16384
"""A phase with more transfers than this runs in the DES with the transfers that share a path
(and ranks) merged into one flow carrying their summed bytes (see :func:`aggregate_transfers`)."""


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
    count: int = 1
    """Identical transfers (same path, ranks and weight) this one stands for in the DES."""


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


@dataclass(frozen=True, slots=True)
class PhaseLoad:
    """What the closed form needs of a phase: the weight (transfers, in units of
    ``size_factor`` bytes) on every used link and the longest intra / inter path latency."""

    link_index: np.ndarray
    """Distinct link indices carrying traffic."""
    link_weight: np.ndarray
    """Summed transfer weights on each of those links."""
    intra_latency_s: float
    inter_latency_s: float
    intra_kinds: frozenset[LinkKind]
    """Kinds of the links of intra-node transfers."""


class LoadPhase:
    """A phase given by its per-link loads, derived analytically (O(ranks)) instead of from an
    enumerated transfer list; the transfers are built only when the DES asks for them.

    Attributes:
        size_factor, intra_steps, inter_steps: as :class:`Phase`.
        load: the :class:`PhaseLoad` the closed form uses.
    """

    __slots__ = ("size_factor", "intra_steps", "inter_steps", "load", "_make", "_transfers")

    def __init__(
        self,
        *,
        load: PhaseLoad,
        size_factor: float,
        intra_steps: int,
        inter_steps: int,
        make_transfers: Callable[[], Sequence[Transfer]],
    ) -> None:
        self.load = load
        self.size_factor = size_factor
        self.intra_steps = intra_steps
        self.inter_steps = inter_steps
        self._make = make_transfers
        self._transfers: tuple[Transfer, ...] | None = None

    @property
    def transfers(self) -> tuple[Transfer, ...]:
        """The flows the DES runs (built on first use, then kept)."""
        if self._transfers is None:
            self._transfers = tuple(self._make())
        return self._transfers


AnyPhase = Phase | LoadPhase


def phase_load(phase: AnyPhase, topology: Topology) -> PhaseLoad:
    """The per-link load of ``phase`` (vectorised over its transfers for a :class:`Phase`)."""
    if isinstance(phase, LoadPhase):
        return phase.load
    transfers = phase.transfers
    count = len(transfers)
    lengths = np.fromiter((len(t.path) for t in transfers), dtype=np.int64, count=count)
    entries = np.fromiter(
        (link for t in transfers for link in t.path), dtype=np.int64, count=int(lengths.sum())
    )
    owner = np.repeat(np.arange(count), lengths)
    weights = np.fromiter((t.weight for t in transfers), dtype=float, count=count)
    load = np.bincount(entries, weights=weights[owner], minlength=len(topology.links))
    used = np.flatnonzero(load > 0)
    latency = np.bincount(owner, weights=topology.link_latency_s[entries], minlength=count)
    inter = np.fromiter((t.inter for t in transfers), dtype=bool, count=count)
    intra_entries = entries[~inter[owner]]
    kinds = topology.kinds_of(intra_entries)
    return PhaseLoad(
        used,
        load[used],
        float(latency[~inter].max()) if (~inter).any() else 0.0,
        float(latency[inter].max()) if inter.any() else 0.0,
        kinds,
    )


def merge_identical(transfers: Sequence[Transfer]) -> tuple[Transfer, ...]:
    """Transfers with the same (path, src, dst, weight) as one with a ``count``: exact for the
    DES, where the network gives such a flow its members' summed rate (weighted max-min,
    :func:`collsim.cluster.network.max_min_rates`). A ring's or tree's channels repeat the same
    rank-to-rank edges, so this runs them in a fraction of the flows."""
    counts: dict[tuple[tuple[int, ...], int | None, int | None, float, bool], int] = {}
    for t in transfers:
        key = (t.path, t.src, t.dst, t.weight, t.inter)
        counts[key] = counts.get(key, 0) + t.count
    if len(counts) == len(transfers):
        return tuple(transfers)
    return tuple(
        Transfer(path, src, dst, inter, weight, count)
        for (path, src, dst, weight, inter), count in counts.items()
    )


def aggregate_transfers(transfers: Sequence[Transfer]) -> tuple[Transfer, ...]:
    """Merge transfers with the same (path, src, dst) into one with the summed weight.

    Exact for the DES when the merged transfers would have run side by side on the same links
    (as a ring's channels do on a shared intra-node edge).
    """
    merged: dict[tuple[tuple[int, ...], int | None, int | None], Transfer] = {}
    for t in transfers:
        key = (t.path, t.src, t.dst)
        old = merged.get(key)
        merged[key] = (
            Transfer(t.path, t.src, t.dst, t.inter, t.weight * t.count)
            if old is None
            else Transfer(t.path, t.src, t.dst, t.inter, old.weight + t.weight * t.count)
        )
    return tuple(merged.values())


def equal_weights_per_link(transfers: Sequence[Transfer], num_links: int) -> bool:
    """True if every link's transfers carry the same weight (the :class:`Phase` invariant
    under which max-min sharing finishes at the closed form's load bound)."""
    if not transfers:
        return True
    lengths = np.fromiter((len(t.path) for t in transfers), dtype=np.int64, count=len(transfers))
    entries = np.fromiter(
        (link for t in transfers for link in t.path), dtype=np.int64, count=int(lengths.sum())
    )
    weights = np.repeat(
        np.fromiter((t.weight for t in transfers), dtype=float, count=len(transfers)), lengths
    )
    high = np.full(num_links, -np.inf)
    low = np.full(num_links, np.inf)
    np.maximum.at(high, entries, weights)
    np.minimum.at(low, entries, weights)
    used = np.isfinite(high)
    return bool((high[used] == low[used]).all())


#: Bytes per pipeline loop as a function of the collective's size (None: loops are hidden).
LoopBytes = Callable[[float], float]


def one_step_phase(
    topology: Topology, pairs: Sequence[tuple[int, int]], size_factor: float
) -> LoadPhase:
    """All ``pairs`` at once, one step: a network step if any pair crosses nodes."""
    src = np.fromiter((p[0] for p in pairs), dtype=np.int64, count=len(pairs))
    dst = np.fromiter((p[1] for p in pairs), dtype=np.int64, count=len(pairs))
    inter = bool((src // topology.gpus_per_node != dst // topology.gpus_per_node).any())
    return pairs_phase(topology, src, dst, size_factor, 0 if inter else 1, 1 if inter else 0)


def pairs_phase(
    topology: Topology,
    src: np.ndarray,
    dst: np.ndarray,
    size_factor: float,
    intra_steps: int,
    inter_steps: int,
) -> LoadPhase:
    """A phase of rank-to-rank transfers ``src[i] -> dst[i]`` (weight 1 each), its load worked
    out with array operations (:func:`pair_load`); the Transfer objects are built for the DES
    only."""
    src = np.asarray(src, dtype=np.int64)
    dst = np.asarray(dst, dtype=np.int64)

    def make() -> list[Transfer]:
        return [make_transfer(topology, s, d) for s, d in zip(src.tolist(), dst.tolist())]

    return LoadPhase(
        load=pair_load(topology, src, dst),
        size_factor=size_factor,
        intra_steps=intra_steps,
        inter_steps=inter_steps,
        make_transfers=make,
    )


def pair_load(topology: Topology, src: np.ndarray, dst: np.ndarray) -> PhaseLoad:
    """Per-link load of transfers ``src[i] -> dst[i]`` along :meth:`Topology.path`, vectorised:
    inside a node the sender's tx and the receiver's rx link; across nodes NIC k of the sender
    (k = local rank x NICs / GPUs per node), the leaf uplink and downlink when the leaf groups
    differ, and NIC k of the receiving node. (Phases that stay inside nodes, or that all cross
    them, skip the masks: most do.)"""
    topo = topology
    if not len(src):
        return PhaseLoad(np.zeros(0, dtype=np.int64), np.zeros(0), 0.0, 0.0, frozenset())
    gpn = topo.gpus_per_node
    latency = topo.link_latency_s
    src_node, dst_node = src // gpn, dst // gpn
    same = src_node == dst_node
    index: list[np.ndarray] = []
    intra_latency = inter_latency = 0.0
    kinds: frozenset[LinkKind] = frozenset()
    all_same = bool(same.all())
    any_same = all_same or bool(same.any())
    if any_same:
        s_in, d_in = (src, dst) if all_same else (src[same], dst[same])
        tx, rx = topo.gpu_tx_index[s_in], topo.gpu_rx_index[d_in]
        index += [tx, rx]
        intra_latency = float((latency[tx] + latency[rx]).max())
        kinds = topo.kinds_of(np.concatenate([tx, rx]))
    if not all_same:
        if topo.nics is None:
            raise ConfigError(f"topology {topo.name} has no NICs")
        if any_same:
            cross = ~same
            s, sn, dn = src[cross], src_node[cross], dst_node[cross]
        else:
            s, sn, dn = src, src_node, dst_node
        nic = (s % gpn) * topo.nics.count // gpn
        tx, rx = topo.nic_tx_index[sn, nic], topo.nic_rx_index[dn, nic]
        index += [tx, rx]
        hops = latency[tx] + latency[rx]
        per_leaf = topo.fabric.nodes_per_leaf
        src_leaf, dst_leaf = sn // per_leaf, dn // per_leaf
        diff = src_leaf != dst_leaf
        if diff.any():
            rail = nic[diff] if topo.fabric.rails else np.zeros(int(diff.sum()), dtype=np.int64)
            up = topo.leaf_up_index[rail, src_leaf[diff]]
            down = topo.leaf_down_index[rail, dst_leaf[diff]]
            index += [up, down]
            hops[diff] += latency[up] + latency[down]
        inter_latency = float(hops.max())
    if not index:
        return PhaseLoad(np.zeros(0, dtype=np.int64), np.zeros(0), 0.0, 0.0, kinds)
    used, counts = _link_counts(np.concatenate(index))
    return PhaseLoad(used, counts, intra_latency, inter_latency, kinds)


_SMALL_PHASE = 32
"""Link entries up to which a phase's links are counted in Python: a dict beats
``numpy.unique``, whose cost hardly depends on the size, up to some 30 entries (timings in
docs/derivations.md, measurements)."""


def _link_counts(entries: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """The links used (ascending) and how many transfers each carries, as floats: the used
    links only (a phase touches a few thousand of a large cluster's links)."""
    if len(entries) <= _SMALL_PHASE:
        tally: dict[int, int] = {}
        for link in entries.tolist():
            tally[link] = tally.get(link, 0) + 1
        keys = sorted(tally)
        return (
            np.array(keys, dtype=np.int64),
            np.array([tally[k] for k in keys], dtype=float),
        )
    used, counts = np.unique(entries, return_counts=True)
    return used, counts.astype(float)


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
