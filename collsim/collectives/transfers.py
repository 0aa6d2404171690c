"""The parts of a collective algorithm's phases: a transfer (a path of links and the ranks it
feeds), a phase of concurrent transfers or of one load per link, the link load of a phase
(how many transfers each link carries, and the latencies it pays), and the merging of
transfers that share a path for the DES. :mod:`collsim.collectives.phases` times a list of them.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np

from collsim.cluster.topology import Topology
from collsim.core.errors import ConfigError
from collsim.core.vocab import LinkKind

__all__ = [
    "AGGREGATE_ABOVE",
    "AnyPhase",
    "LoadPhase",
    "LoopBytes",
    "Phase",
    "PhaseLoad",
    "Transfer",
    "aggregate_transfers",
    "equal_weights_per_link",
    "make_transfer",
    "merge_identical",
    "one_step_phase",
    "pair_load",
    "pairs_phase",
    "phase_load",
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
