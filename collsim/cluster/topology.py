"""Physical topology: ranks, nodes, NVSwitch / PCIe switch, NICs and the fabric, from YAML.

Derivations, measurements and sources: docs/derivations.md, ``collsim.cluster.topology``.
"""

from __future__ import annotations

import bisect
import copy
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field, replace
from functools import lru_cache
from pathlib import Path
from typing import Any, overload

import numpy as np

from collsim.cluster.hardware import DEVICE, Device, device_from_reader, get_device, list_devices
from collsim.cluster.transports import (
    EFA_PLATFORMS,
    NCCL_RELEASES,
    TRANSPORTS,
    TUNERS,
    transport_for,
)
from collsim.core.errors import ConfigError, InfeasibleError
from collsim.core.schema import (
    Either,
    Section,
    Spec,
    Value,
    check,
    choice_value,
    flag_value,
    fraction_value,
    non_negative_value,
    positive_value,
    raise_errors,
    text_value,
    values_of,
)
from collsim.core.units import US, gbit_to_bps, gbps_to_bps
from collsim.core.vocab import Algorithm, CollectiveOp, FabricKind, Interconnect, LinkKind, Protocol
from collsim.core.yamlio import ConfigReader, YamlDoc, load_yaml, non_negative, one_of, positive

__all__ = [
    "TOPOLOGY",
    "Link",
    "LinkKind",
    "CPU_VENDORS",
    "LIBRARIES",
    "Interconnect",
    "FabricKind",
    "FabricDefaults",
    "FABRIC_DEFAULTS",
    "CollectiveSettings",
    "Topology",
    "load_topology",
    "read_topology_file",
    "parse_topology",
    "topology_dirs",
    "resolve_topology_path",
]

CPU_VENDORS = ("intel", "amd")
"""``host.cpu_vendor`` values."""
LIBRARIES = ("nccl", "gloo")
"""``collectives.library`` values."""

_KIND_CODES = tuple(LinkKind)
TOPOLOGY_MAX_RANKS = 4 * 262_144
"""The most ranks (and NIC ports) a topology file may build, whatever ``--max-gpus`` says: 4 x
the default limit (:class:`collsim.study.limits.Limits`), checked before a link is built."""
_OP_NAMES = tuple(op.value for op in CollectiveOp)
_ALGORITHM_NAMES = tuple(a.value for a in Algorithm)


_INTRA_KIND = {
    Interconnect.NVSWITCH: LinkKind.NVLINK,
    Interconnect.PCIE_SWITCH: LinkKind.PCIE,
    Interconnect.LOOPBACK: LinkKind.LOOPBACK,
}


@dataclass(frozen=True, slots=True)
class Link:
    """One direction of one physical link."""

    index: int
    name: str
    bandwidth_bps: float
    """Line rate per direction, bytes/s."""
    latency_s: float
    tier: int
    """0 inside a node, 1 NIC to leaf, 2 leaf to spine."""
    kind: LinkKind = LinkKind.NVLINK
    efficiency: float = 1.0
    """Achievable share of the line rate (protocol overhead), in (0, 1]."""

    @property
    def capacity_bps(self) -> float:
        """Achievable bytes/s: line rate x efficiency."""
        return self.bandwidth_bps * self.efficiency


class LinkTable(Sequence[Link]):
    """The links of a topology held as blocks of alike links; a :class:`Link` is made only
    when asked for.

    A 65,536-GPU cluster has about 270,000 links; building them one object at a time cost
    more than simulating the step on it. Blocks of alike links (every GPU's NVLink port, every
    NIC, every leaf uplink) are added at once with a rule that names link i of the block; the
    per-link columns are numpy arrays built from the blocks (:meth:`columns`).
    """

    def __init__(self) -> None:
        self._starts: list[int] = []
        self._counts: list[int] = []
        self._namers: list[Callable[[int], str]] = []
        self._rows: list[tuple[Any, float, int, LinkKind, float]] = []
        """Per block: bandwidth (one value, or one per link), latency, tier, kind, efficiency."""
        self._size = 0

    def add_block(
        self,
        count: int,
        name_of: Callable[[int], str],
        bandwidth_bps: float | Sequence[float],
        latency_s: float,
        tier: int,
        kind: LinkKind,
        efficiency: float,
    ) -> range:
        """``count`` alike links, link i named ``name_of(i)`` (``bandwidth_bps``: one rate for
        all, or one per link); their indices."""
        if not isinstance(bandwidth_bps, (int, float)) and len(bandwidth_bps) != count:
            raise ValueError(f"{len(bandwidth_bps)} bandwidths for {count} links")
        start = self._size
        self._starts.append(start)
        self._counts.append(count)
        self._namers.append(name_of)
        self._rows.append((bandwidth_bps, latency_s, tier, kind, efficiency))
        self._size += count
        return range(start, start + count)

    def columns(self, kind_codes: dict[LinkKind, int]) -> dict[str, np.ndarray]:
        """Every link's achievable ``capacity_bps`` (rate x efficiency), ``latency_s`` and
        ``kind_code`` (``kind_codes`` of its kind, int8), by index: filled block by block (a
        few large blocks; a 65,536-GPU cluster has 268,704 links, and each full-length column
        made and dropped costs its memory's first touch)."""
        starts, counts, rows = self._starts, self._counts, self._rows
        capacity = np.empty(self._size, dtype=float)
        latency = np.empty(self._size, dtype=float)
        kind = np.empty(self._size, dtype=np.int8)
        for start, count, row in zip(starts, counts, rows, strict=True):
            rate, latency_s, _, link_kind, efficiency = row
            end = start + count
            if isinstance(rate, (int, float)):
                capacity[start:end] = rate * efficiency
            else:
                capacity[start:end] = np.asarray(rate, dtype=float) * efficiency
            latency[start:end] = latency_s
            kind[start:end] = kind_codes[link_kind]
        return {"capacity_bps": capacity, "latency_s": latency, "kind_code": kind}

    def name(self, index: int) -> str:
        block = bisect.bisect_right(self._starts, index) - 1
        return self._namers[block](index - self._starts[block])

    def __len__(self) -> int:
        return self._size

    @overload
    def __getitem__(self, index: int) -> Link: ...

    @overload
    def __getitem__(self, index: slice) -> list[Link]: ...

    def __getitem__(self, index: int | slice) -> Link | list[Link]:
        if isinstance(index, slice):
            return [self[i] for i in range(*index.indices(len(self)))]
        if index < 0:
            index += len(self)
        if not 0 <= index < len(self):
            raise IndexError(f"link {index} out of range")
        block = bisect.bisect_right(self._starts, index) - 1
        bandwidth, latency, tier, kind, efficiency = self._rows[block]
        offset = index - self._starts[block]
        if not isinstance(bandwidth, (int, float)):
            bandwidth = bandwidth[offset]
        return Link(
            index,
            self._namers[block](offset),
            float(bandwidth),
            latency,
            tier,
            kind,
            efficiency,
        )

    def __iter__(self) -> Iterator[Link]:
        return (self[i] for i in range(len(self)))


@dataclass(frozen=True, slots=True, kw_only=True)
class CollectiveSettings:
    """The ``collectives`` section: library conventions, fixed overhead, algorithm overrides."""

    library: str = "nccl"
    """``nccl`` (LL / LL128 / Simple protocols and NCCL's latencies) or ``gloo`` (one protocol,
    latencies from the links only)."""
    overhead_s: float = 0.0
    """Fixed per-collective software cost (launch, framework), seconds."""
    algorithms: dict[str, str] = field(default_factory=dict, hash=False)
    """Per-op algorithm used when ``auto`` is asked (e.g. from calibration)."""
    op_overhead_s: dict[str, float] = field(default_factory=dict, hash=False)
    """Per-op fixed cost replacing ``overhead_s`` for that op (``collectives.ops.<op>.overhead_us``,
    written by ``collsim validate calibrate``)."""
    op_efficiency: dict[str, float] = field(default_factory=dict, hash=False)
    """Per-op share of the link capacity the library achieves for that op, in (0, 1]
    (``collectives.ops.<op>.efficiency``): gloo reduces on the CPU, copies through the kernel,
    and runs reduce_scatter as a whole all_reduce, so each op has its own effective rate."""
    op_knee: dict[str, tuple[float, float]] = field(default_factory=dict, hash=False)
    """Per-op second regime ``(knee_bytes, knee_efficiency)``
    (``collectives.ops.<op>.knee_bytes`` and ``.knee_efficiency``, written by ``collsim validate
    calibrate`` when one line does not follow the measurement): the bytes of a collective above
    knee_bytes move at knee_efficiency instead of the op's efficiency (gloo's broadcast slows
    down once its buffers leave the cache). knee_efficiency <= the op's efficiency."""
    nccl_version: str = NCCL_RELEASES[-1]
    """The NCCL release the topology assumes (``collectives.nccl_version``), one of
    :data:`collsim.cluster.transports.NCCL_RELEASES`."""


@dataclass(frozen=True, slots=True, kw_only=True)
class _IntraSpec:
    interconnect: Interconnect
    bandwidth_bps: float
    efficiency: float
    latency_s: float
    nvls: bool


@dataclass(frozen=True, slots=True, kw_only=True)
class _NicSpec:
    count: int
    bandwidth_bps: float
    efficiency: float
    latency_s: float


@dataclass(frozen=True, slots=True, kw_only=True)
class FabricDefaults:
    """What a fabric kind sets unless the topology file says otherwise."""

    nic_efficiency: float
    """Achievable share of a NIC's line rate for NCCL traffic (``nics.efficiency``)."""
    net_latency_us: float
    """Latency the transport adds to every LL / LL128 network step, us: NCCL's
    ``graph->latencyInter`` (the network plugin's, src/graph/tuning.cc adds it to the NET hop
    latency); 0 where NCCL's own NET row was measured (InfiniBand verbs)."""
    net_simple_latency_us: float
    """The same for a Simple network step, us (tuning.cc adds ``latencyInter`` twice for Simple,
    "the flush extra latency"; a transport that stages Simple data differently, as TCPXO's
    receive-side unpack does, has its own figure)."""
    ll128: bool
    """Whether NCCL runs LL128 across this fabric."""
    source: str


FABRIC_DEFAULTS: dict[FabricKind, FabricDefaults] = {
    kind: FabricDefaults(
        nic_efficiency=t.nic_efficiency,
        net_latency_us=t.net_latency_us,
        net_simple_latency_us=t.net_simple_latency_us,
        ll128=t.ll128,
        source=t.source,
    )
    for kind, t in TRANSPORTS.items()
}
"""Per-kind defaults, each with its source."""


@dataclass(frozen=True, slots=True, kw_only=True)
class _FabricSpec:
    rails: bool
    oversubscription: float
    nodes_per_leaf: int
    latency_s: float
    kind: FabricKind = FabricKind.FAT_TREE
    net_latency_s: float = 0.0
    """Per LL / LL128 network step latency the transport adds (see :class:`FabricDefaults`)."""
    net_simple_latency_s: float = 0.0
    """Per Simple network step latency the transport adds."""
    ll128: bool = True
    collnet: bool = False
    """In-network reduction (SHARP) reachable through NCCL's CollNet (``fabric.sharp``)."""
    ll: bool = True
    """Whether NCCL runs LL across this fabric (``fabric.ll``)."""
    platform: str | None = None
    """The EFA instance family (``fabric.platform``,
    :data:`collsim.cluster.transports.EFA_PLATFORMS`)."""
    tuner: str = "nccl"
    """Whose choice ``auto`` follows: ``nccl`` or ``aws-ofi-nccl`` (``fabric.tuner``)."""


class Topology:
    """A cluster of ``num_nodes`` identical nodes: ranks, links and paths.

    Build one with :func:`load_topology`. Paths are cached. Ranks are numbered node-major:
    rank = node x gpus_per_node + local_rank.
    """

    def __init__(
        self,
        *,
        name: str,
        device: Device,
        num_nodes: int,
        gpus_per_node: int,
        intra: _IntraSpec,
        nics: _NicSpec | None,
        fabric: _FabricSpec,
        host_bandwidth_bps: float,
        collectives: CollectiveSettings,
        host_cpu_vendor: str = "intel",
        source: str = "",
    ) -> None:
        self.name = name
        self.device = device
        self.num_nodes = num_nodes
        self.gpus_per_node = gpus_per_node
        self.num_ranks = num_nodes * gpus_per_node
        self.intra = intra
        self.nics = nics
        self.fabric = fabric
        self.nvls = intra.nvls
        self.host_bandwidth_bps = host_bandwidth_bps
        self.host_cpu_vendor = host_cpu_vendor
        """``intel`` or ``amd``: NCCL's LL cap across nodes and its network post overhead
        depend on it (src/graph/tuning.cc llMaxBws, getNetOverhead)."""
        self.collectives = collectives
        self.source = source
        self.links: Sequence[Link] = LinkTable()
        self._path_cache: dict[tuple[int, int], tuple[int, ...]] = {}
        self.symmetric = True
        """Nodes alike, and leaves alike but for how many nodes each holds, as built from a
        file (:meth:`symmetry_key`); a copy with degraded links is not."""
        self._build()
        columns = self._table.columns({kind: i for i, kind in enumerate(_KIND_CODES)})
        self.link_capacity_bps = columns["capacity_bps"]
        """Achievable bytes/s of every link, by index."""
        self.link_latency_s = columns["latency_s"]
        """Latency of every link, by index."""
        self.link_kind_code = columns["kind_code"]
        """``_KIND_CODES`` index of every link's kind (see :meth:`kinds_of`)."""
        self._index_arrays()
        self._built = True

    def __setattr__(self, name: str, value: Any) -> None:
        # a built topology is shared (collective tables per topology, sweep points, workers):
        # it is not changed, only copied with changes (:meth:`replaced`); private caches fill
        if name[0] != "_" and self.__dict__.get("_built", False):
            raise AttributeError(
                f"a built Topology is not changed (setting {name!r}); use replaced(...)"
            )
        object.__setattr__(self, name, value)

    def replaced(self, **changes: Any) -> Topology:
        """A copy of this topology with ``changes`` to its attributes (this one is unchanged).

        The collectives' tables of the copy start empty (:mod:`collsim.collectives.memo`).

        Raises:
            AttributeError: a name that is not an attribute of a topology.
        """
        unknown = sorted(set(changes) - set(vars(self)))
        if unknown:
            raise AttributeError(f"a Topology has no attribute {', '.join(unknown)}")
        out = copy.copy(self)
        vars(out).update(changes)
        return out

    # -- graph ----------------------------------------------------------------------------
    @property
    def _table(self) -> LinkTable:
        table = self.links
        assert isinstance(table, LinkTable)
        return table

    def _build(self) -> None:
        intra = self.intra
        kind = _INTRA_KIND[intra.interconnect]
        table = self._table
        gpn = self.gpus_per_node
        tx = table.add_block(
            self.num_ranks,
            lambda r: f"n{r // gpn}.g{r % gpn}.tx",
            intra.bandwidth_bps,
            intra.latency_s,
            0,
            kind,
            intra.efficiency,
        )
        rx = table.add_block(
            self.num_ranks,
            lambda r: f"n{r // gpn}.g{r % gpn}.rx",
            intra.bandwidth_bps,
            intra.latency_s,
            0,
            kind,
            intra.efficiency,
        )
        self.gpu_tx: Sequence[int] = tx
        """Every GPU's transmit port to the node's switch, by rank (a range: one block)."""
        self.gpu_rx: Sequence[int] = rx
        """Every GPU's receive port, by rank."""
        self.gpu_tx_index = np.arange(tx.start, tx.stop, dtype=np.int64)
        self.gpu_rx_index = np.arange(rx.start, rx.stop, dtype=np.int64)
        self._nic_index = np.zeros((0, 2, 0), dtype=np.int64)
        self._nic_lists: tuple[list[list[int]], list[list[int]]] | None = None
        self.leaf_up: dict[tuple[int, int], int] = {}
        self.leaf_down: dict[tuple[int, int], int] = {}
        self._leaf_block: tuple[int, int, int] | None = None
        nics = self.nics
        if nics is None:
            return
        count = nics.count

        def nic_name(i: int) -> str:
            node, j = divmod(i, 2 * count)
            return f"n{node}.nic{j % count}.{'tx' if j < count else 'rx'}"

        # node by node: its NICs' tx links, then their rx links
        block = table.add_block(
            2 * count * self.num_nodes,
            nic_name,
            nics.bandwidth_bps,
            nics.latency_s,
            1,
            LinkKind.NETWORK,
            nics.efficiency,
        )
        per_node = np.arange(block.start, block.stop, dtype=np.int64).reshape(
            self.num_nodes, 2, count
        )
        self._nic_index = per_node
        self._build_leaves(table, nics)

    def _build_leaves(self, table: LinkTable, nics: _NicSpec) -> None:
        """Every leaf's uplink and downlink (one block), when the nodes span leaves."""
        fab = self.fabric
        num_groups = -(-self.num_nodes // fab.nodes_per_leaf)
        if num_groups <= 1:
            return  # every leaf holds all nodes: no uplink is ever used
        num_rails = nics.count if fab.rails else 1
        leaves = [(k, g) for k in range(num_rails) for g in range(num_groups)]
        # leaf by leaf: its uplink, then its downlink (one block); a leaf's rate from the
        # nodes it holds (the last may hold fewer)
        nodes_here = np.minimum(
            fab.nodes_per_leaf, self.num_nodes - np.arange(num_groups) * fab.nodes_per_leaf
        )
        ports = nodes_here * (1 if fab.rails else nics.count)
        up_bps = ports * nics.bandwidth_bps / fab.oversubscription
        rates = np.repeat(np.tile(up_bps, num_rails), 2)
        rails = fab.rails

        def leaf_name(i: int) -> str:
            rail, group = leaves[i // 2]
            label = f"rail{rail}.leaf{group}" if rails else f"leaf{group}"
            return f"{label}.{'down' if i % 2 else 'up'}"

        block = table.add_block(
            2 * len(leaves),
            leaf_name,
            rates.tolist(),
            fab.latency_s,
            2,
            LinkKind.NETWORK,
            nics.efficiency,
        )
        self.leaf_up = dict(zip(leaves, range(block.start, block.stop, 2), strict=True))
        self.leaf_down = dict(zip(leaves, range(block.start + 1, block.stop, 2), strict=True))
        # the same as arrays [rail, leaf group] (read by _index_arrays)
        self._leaf_block = (block.start, num_rails, num_groups)

    @property
    def nic_tx(self) -> list[list[int]]:
        """Per node, the link index of each NIC's transmit side (lists made when first read;
        :attr:`nic_tx_index` is the same as an array)."""
        return self._nic_link_lists()[0]

    @property
    def nic_rx(self) -> list[list[int]]:
        """Per node, the link index of each NIC's receive side (see :attr:`nic_tx`)."""
        return self._nic_link_lists()[1]

    def _nic_link_lists(self) -> tuple[list[list[int]], list[list[int]]]:
        if self._nic_lists is None:
            self._nic_lists = (
                self._nic_index[:, 0, :].tolist(),
                self._nic_index[:, 1, :].tolist(),
            )
        return self._nic_lists

    def kinds_of(self, links: Any) -> frozenset[LinkKind]:
        """The kinds of the links with indices ``links`` (an integer array), vectorised."""
        codes = np.bincount(self.link_kind_code[links], minlength=len(_KIND_CODES))
        return frozenset(_KIND_CODES[i] for i in np.flatnonzero(codes))

    def _index_arrays(self) -> None:
        """Link indices as arrays, for vectorised path construction (``path_links``)."""
        count = self.nics.count if self.nics is not None else 0
        shape = (len(self._nic_index), count)
        self.nic_tx_index = np.ascontiguousarray(self._nic_index[:, 0, :]).reshape(shape)
        self.nic_rx_index = np.ascontiguousarray(self._nic_index[:, 1, :]).reshape(shape)
        num_groups = -(-self.num_nodes // self.fabric.nodes_per_leaf)
        rails = count if self.fabric.rails else 1
        self.leaf_up_index = np.full((max(rails, 1), num_groups), -1, dtype=np.int64)
        self.leaf_down_index = np.full((max(rails, 1), num_groups), -1, dtype=np.int64)
        if self._leaf_block is not None:  # leaf by leaf, rail-major: up, down (None: no leaves)
            start, num_rails, groups = self._leaf_block
            ups = np.arange(start, start + 2 * num_rails * groups, 2, dtype=np.int64)
            self.leaf_up_index[:num_rails, :groups] = ups.reshape(num_rails, groups)
            self.leaf_down_index[:num_rails, :groups] = (ups + 1).reshape(num_rails, groups)

    # -- queries --------------------------------------------------------------------------
    def symmetry_key(self, ranks: tuple[int, ...]) -> tuple[Any, ...] | None:
        """Equal for two rank tuples when shifting the nodes of one by a whole number of nodes
        gives the other, and every link a transfer among them can use maps onto a link of the
        same class, capacity and latency; None when the topology is not :attr:`symmetric`.

        The key holds each rank's index in its node (its GPU links and its rail), its node
        relative to the first rank's node, its leaf relative to the first rank's leaf and how
        many nodes that leaf holds (a short last leaf has slower uplinks). A shift that keeps
        these keeps the paths of :meth:`path` link for link (GPU, NIC and leaf links are alike
        within their class but for the leaf's node count), so collective schedules on the two
        are the same but for the link names.
        """
        if not self.symmetric or not ranks:
            return None
        gpn = self.gpus_per_node
        per_leaf = self.fabric.nodes_per_leaf
        at = np.asarray(ranks, dtype=np.int64)
        nodes = at // gpn
        local = (at % gpn).tobytes()
        relative = (nodes - nodes[0]).tobytes()
        if self.num_nodes <= per_leaf or self.nics is None:
            return (local, relative)
        leaves = nodes // per_leaf
        full = self.num_nodes // per_leaf  # leaves before this index hold per_leaf nodes
        return (
            local,
            relative,
            (leaves - leaves[0]).tobytes(),
            (leaves < full).tobytes(),
        )

    def node_of(self, rank: int) -> int:
        """Node index of ``rank``."""
        return rank // self.gpus_per_node

    def local_rank(self, rank: int) -> int:
        """Index of ``rank`` inside its node."""
        return rank % self.gpus_per_node

    def nic_of(self, rank: int) -> int:
        """Index of the NIC nearest to ``rank`` (NICs spread evenly over the node's GPUs)."""
        if self.nics is None:
            raise InfeasibleError(f"topology {self.name} has no NICs", reason="topology")
        return self.local_rank(rank) * self.nics.count // self.gpus_per_node

    def _leaf(self, node: int, nic: int) -> tuple[int, int]:
        group = node // self.fabric.nodes_per_leaf
        return (nic, group) if self.fabric.rails else (0, group)

    def _check_rank(self, rank: int) -> None:
        if not 0 <= rank < self.num_ranks:
            raise ConfigError(
                f"rank {rank} out of range 0..{self.num_ranks - 1} "
                f"({self.num_nodes} nodes x {self.gpus_per_node})"
            )

    def path(self, src: int, dst: int) -> tuple[int, ...]:
        """Link indices from ``src`` to ``dst`` (empty for src == dst), cached.

        Inside a node: the sender's tx and the receiver's rx link to the switch. Across nodes:
        the sender's NIC k, the leaf uplink and downlink when the leaves differ, then NIC k of the
        receiving node (rail-aligned).
        """
        key = (src, dst)
        cached = self._path_cache.get(key)
        if cached is not None:
            return cached
        self._check_rank(src)
        self._check_rank(dst)
        if src == dst:
            result: tuple[int, ...] = ()
        elif self.node_of(src) == self.node_of(dst):
            result = (self.gpu_tx[src], self.gpu_rx[dst])
        else:
            result = self.net_path(self.node_of(src), self.node_of(dst), self.nic_of(src))
        self._path_cache[key] = result
        return result

    def net_path(self, src_node: int, dst_node: int, nic: int) -> tuple[int, ...]:
        """Links from NIC ``nic`` of ``src_node`` to NIC ``nic`` of ``dst_node``."""
        if self.nics is None:
            raise InfeasibleError(f"topology {self.name} has no NICs", reason="topology")
        src_leaf = self._leaf(src_node, nic)
        dst_leaf = self._leaf(dst_node, nic)
        links = [int(self.nic_tx_index[src_node, nic])]
        if src_leaf != dst_leaf:
            links += [self.leaf_up[src_leaf], self.leaf_down[dst_leaf]]
        links.append(int(self.nic_rx_index[dst_node, nic]))
        return tuple(links)

    def path_links(self, src: np.ndarray, dst: np.ndarray) -> np.ndarray:
        """The links of many transfers at once: row i holds the link indices of
        ``path(src[i], dst[i])`` (the same rule, vectorised), padded with -1 (4 columns)."""
        src = np.asarray(src, dtype=np.int64)
        dst = np.asarray(dst, dtype=np.int64)
        if src.size and (
            min(src.min(), dst.min()) < 0 or max(src.max(), dst.max()) >= self.num_ranks
        ):
            bad = int(src.max() if src.max() >= self.num_ranks or src.min() < 0 else dst.max())
            self._check_rank(bad)
        out = np.full((src.size, 4), -1, dtype=np.int64)
        gpn = self.gpus_per_node
        src_node, dst_node = src // gpn, dst // gpn
        intra = (src_node == dst_node) & (src != dst)
        out[intra, 0] = self.gpu_tx_index[src[intra]]
        out[intra, 1] = self.gpu_rx_index[dst[intra]]
        inter = src_node != dst_node
        if inter.any():
            if self.nics is None:
                raise InfeasibleError(f"topology {self.name} has no NICs", reason="topology")
            nic = (src[inter] % gpn) * self.nics.count // gpn
            sn, dn = src_node[inter], dst_node[inter]
            out[inter, 0] = self.nic_tx_index[sn, nic]
            rail = nic if self.fabric.rails else np.zeros_like(nic)
            sg, dg = sn // self.fabric.nodes_per_leaf, dn // self.fabric.nodes_per_leaf
            cross = sg != dg
            rows = np.flatnonzero(inter)
            up = np.full(rows.size, -1, dtype=np.int64)
            down = np.full(rows.size, -1, dtype=np.int64)
            up[cross] = self.leaf_up_index[rail[cross], sg[cross]]
            down[cross] = self.leaf_down_index[rail[cross], dg[cross]]
            rx = self.nic_rx_index[dn, nic]
            # (tx, up, down, rx) across leaves; (tx, rx) under one leaf
            out[rows, 1] = np.where(cross, up, rx)
            out[rows, 2] = np.where(cross, down, -1)
            out[rows, 3] = np.where(cross, rx, -1)
        return out

    def path_latency_s(self, path: tuple[int, ...]) -> float:
        """Sum of the link latencies of ``path``."""
        return sum(self.links[i].latency_s for i in path)

    def path_kind(self, path: tuple[int, ...]) -> LinkKind:
        """The slowest-class link kind on ``path`` (network > loopback > pcie > nvlink)."""
        order = (LinkKind.NETWORK, LinkKind.LOOPBACK, LinkKind.PCIE, LinkKind.NVLINK)
        kinds = {self.links[i].kind for i in path}
        for kind in order:
            if kind in kinds:
                return kind
        return LinkKind.NVLINK

    def describe(self) -> str:
        """One line: name, nodes x GPUs, device, interconnect, NICs."""
        oversub = self.fabric.oversubscription
        nic = (
            "no NICs"
            if self.nics is None
            else (
                f"{self.nics.count} x {self.nics.bandwidth_bps * 8 / 1e9:g} Gb/s NICs"
                f"{', rails' if self.fabric.rails else ''}"
                f"{f', {oversub:g}:1' if oversub != 1 else ''}"
            )
        )
        return (
            f"{self.name}: {self.num_nodes} x {self.gpus_per_node} {self.device.name}, "
            f"{self.intra.interconnect} {self.intra.bandwidth_bps / 1e9:g} GB/s, {nic}"
        )

    def __repr__(self) -> str:
        return f"Topology({self.describe()})"


# -- loading ------------------------------------------------------------------------------
PRESET_DIR = Path(__file__).resolve().parents[1] / "data" / "topologies"
"""The shipped topology presets, inside the package (found after any install). The repository's
top-level ``topologies/`` holds the same files for users to read and copy (a test keeps the two
identical)."""


def topology_dirs() -> list[Path]:
    """Folders searched for topology names: the package's presets, then the cwd's
    ``topologies/``."""
    return [PRESET_DIR, Path.cwd() / "topologies"]


def resolve_topology_path(spec: str | Path) -> Path:
    """A path to an existing file, or a name (``dgx_h100``) looked up in :func:`topology_dirs`.

    Raises:
        ConfigError: nothing found; the message lists the known names.
    """
    path = Path(spec)
    if path.is_file():
        return path
    if path.suffix == "" and len(path.parts) == 1:
        for folder in topology_dirs():
            candidate = folder / f"{path.name}.yaml"
            if candidate.is_file():
                return candidate
    known = sorted({p.stem for d in topology_dirs() if d.is_dir() for p in d.glob("*.yaml")})
    raise ConfigError(
        f"no topology file or name {str(spec)!r} (known names: {', '.join(known) or 'none'})"
    )


def load_topology(
    spec: str | Path,
    *,
    nodes: int | None = None,
    gpus_per_node: int | None = None,
    device: Device | None = None,
) -> Topology:
    """Load a topology from a YAML file or a name in ``topologies/``.

    Args:
        spec: path to a YAML file, or a name such as ``"dgx_h100"``.
        nodes: node count; defaults to the file's ``nodes`` (1 if absent).
        gpus_per_node: ranks per node override (used for ``localhost``: N CPU ranks).
        device: a device that replaces the file's (a scenario's ``cluster.device``).

    Raises:
        ConfigError: malformed file (``file:line: key.path: message``), or bad arguments.
    """
    return parse_topology(
        read_topology_file(spec), nodes=nodes, gpus_per_node=gpus_per_node, device=device
    )


def read_topology_file(spec: str | Path) -> YamlDoc:
    """The parsed topology file ``spec`` names (see :func:`load_topology`), read once per
    process while the file is unchanged: the limits check before the build and the build
    share it. The document is read, never changed.

    Raises:
        ConfigError: the file is missing or unreadable, or not YAML.
    """
    path = resolve_topology_path(spec)
    try:
        stat = Path(path).stat()
    except OSError:
        return load_yaml(path)  # reports the problem
    return _read_file(str(path), stat.st_mtime_ns, stat.st_size)


@lru_cache(maxsize=64)
def _read_file(path: str, mtime_ns: int, size_bytes: int) -> YamlDoc:
    return load_yaml(path)


def _read_device(root: ConfigReader, doc: YamlDoc) -> Device:
    """``device``: a catalogue key, a device file (``*.yaml``, relative to the topology file
    when it exists there) or an inline mapping in the device schema (collsim.cluster.hardware)."""
    if isinstance(root.data.get("device"), dict):
        return device_from_reader(root.section("device"), "inline", doc.file)
    key = root.get("device", str)
    if key.endswith((".yaml", ".yml")) and not Path(key).is_absolute() and doc.file:
        beside = Path(doc.file).parent / key
        key = str(beside) if beside.exists() else key
    try:
        return get_device(key)
    except ConfigError as exc:
        if exc.file is not None:
            raise
        raise root.error(exc.message, "device") from None


def parse_topology(
    doc: YamlDoc,
    *,
    nodes: int | None = None,
    gpus_per_node: int | None = None,
    device: Device | None = None,
) -> Topology:
    """Build a Topology from a parsed document (see docs/derivations.md for the schema);
    ``device`` replaces the file's (which is still checked).

    Every schema error of the file is reported at once (:func:`collsim.core.schema.check`), before
    the rules between keys are checked.
    """
    raise_errors(check(doc, TOPOLOGY))
    root = ConfigReader(doc.data, doc=doc)
    name = root.get("name", str)
    root.get("description", str, default="")
    file_device = _read_device(root, doc)
    device = file_device if device is None else device
    file_nodes = root.get("nodes", int, default=1, check=positive)
    file_gpus = root.get("gpus_per_node", int, check=positive)

    intra = _read_intra(root)
    nics, nics_has_efficiency = _read_nics(root)
    fabric, kind_defaults = _read_fabric(root)
    if nics is not None and not nics_has_efficiency and fabric.kind is not FabricKind.FAT_TREE:
        nics = replace(nics, efficiency=kind_defaults.nic_efficiency)
    sec = root.section("host", default_empty=True)
    host_bps = gbps_to_bps(sec.get("bandwidth_gbps", float, default=32.0, check=positive))
    cpu_vendor = sec.get("cpu_vendor", str, default="intel", check=one_of(*CPU_VENDORS))
    sec.finish()
    collectives = _read_collectives(root)
    root.finish()

    num_nodes = file_nodes if nodes is None else nodes
    if num_nodes < 1:
        raise ConfigError(f"nodes must be >= 1, got {num_nodes}")
    ranks_per_node = file_gpus if gpus_per_node is None else gpus_per_node
    if ranks_per_node < 1:
        raise ConfigError(f"gpus_per_node must be >= 1, got {ranks_per_node}")
    if num_nodes > 1 and nics is None:
        raise root.error(f"{num_nodes} nodes asked but the topology has no 'nics' section")
    _check_size(root, num_nodes, ranks_per_node, nics.count if nics is not None else 0)
    return Topology(
        name=name,
        device=device,
        num_nodes=num_nodes,
        gpus_per_node=ranks_per_node,
        intra=intra,
        nics=nics,
        fabric=fabric,
        host_bandwidth_bps=host_bps,
        host_cpu_vendor=cpu_vendor,
        collectives=collectives,
        source=doc.file,
    )


def _read_intra(root: ConfigReader) -> _IntraSpec:
    sec = root.section("intra_node")
    intra = _IntraSpec(
        interconnect=Interconnect(
            sec.get("interconnect", str, check=one_of(*[i.value for i in Interconnect]))
        ),
        bandwidth_bps=gbps_to_bps(sec.get("bandwidth_gbps", float, check=positive)),
        **_efficiency_and_latency(sec),
        nvls=sec.get("nvls", bool, default=False),
    )
    sec.finish()
    return intra


def _read_nics(root: ConfigReader) -> tuple[_NicSpec | None, bool]:
    """The ``nics`` section (None without one) and whether it sets its own efficiency."""
    if not root.has("nics"):
        return None, False
    sec = root.section("nics")
    has_efficiency = sec.has("efficiency")
    nics = _NicSpec(
        count=sec.get("count", int, check=positive),
        bandwidth_bps=gbit_to_bps(sec.get("rate_gbit", float, check=positive)),
        **_efficiency_and_latency(sec),
    )
    sec.finish()
    return nics, has_efficiency


def _read_fabric(root: ConfigReader) -> tuple[_FabricSpec, FabricDefaults]:
    """The ``fabric`` section, with its kind's defaults (which also set the NICs' efficiency)."""
    sec = root.section("fabric", default_empty=True)
    kind = FabricKind(
        sec.get("kind", str, default="fat_tree", check=one_of(*[k.value for k in FabricKind]))
    )
    platform: str | None = None
    if sec.has("platform"):
        platform = sec.get("platform", str, check=one_of(*EFA_PLATFORMS))
    transport = transport_for(kind, platform if kind is FabricKind.EFA else None)
    kind_defaults = replace(
        FABRIC_DEFAULTS[kind],
        net_latency_us=transport.net_latency_us,
        net_simple_latency_us=transport.net_simple_latency_us,
        ll128=transport.ll128,
        source=transport.source,
    )
    net_latency_us = sec.get(
        "net_latency_us", float, default=kind_defaults.net_latency_us, check=non_negative
    )
    if sec.has("completion_us") and sec.has("net_simple_latency_us"):
        raise sec.error("give completion_us or net_simple_latency_us, not both", "completion_us")
    simple_us = (
        2.0 * net_latency_us + sec.get("completion_us", float, check=non_negative)
        if sec.has("completion_us")
        else sec.get(
            "net_simple_latency_us",
            float,
            default=kind_defaults.net_simple_latency_us,
            check=non_negative,
        )
    )
    fabric = _FabricSpec(
        rails=sec.get("rails", bool, default=False),
        oversubscription=sec.get("oversubscription", float, default=1.0, check=_at_least_one),
        nodes_per_leaf=sec.get("nodes_per_leaf", int, default=1 << 30, check=positive),
        latency_s=sec.get("latency_us", float, default=0.0, check=non_negative) * US,
        kind=kind,
        net_latency_s=net_latency_us * US,
        net_simple_latency_s=simple_us * US,
        ll128=sec.get("ll128", bool, default=kind_defaults.ll128),
        collnet=sec.get("sharp", bool, default=False),
        ll=sec.get("ll", bool, default=Protocol.LL in transport.protocols),
        platform=platform,
        tuner=sec.get("tuner", str, default=transport.tuner, check=one_of(*TUNERS)),
    )
    sec.finish()
    if platform is not None and kind is not FabricKind.EFA:
        raise sec.error("platform is an EFA instance family; needs kind: efa", "platform")
    return fabric, kind_defaults


def _read_collectives(root: ConfigReader) -> CollectiveSettings:
    sec = root.section("collectives", default_empty=True)
    library = sec.get("library", str, default="nccl", check=one_of(*LIBRARIES))
    nccl_version = sec.get(
        "nccl_version", str, default=NCCL_RELEASES[-1], check=one_of(*NCCL_RELEASES)
    )
    overhead_s = sec.get("overhead_us", float, default=0.0, check=non_negative) * US
    algos = sec.section("algorithms", default_empty=True)
    overrides: dict[str, str] = {}
    for op in _op_keys(algos):
        overrides[str(op)] = algos.get(op, str, check=one_of(*_ALGORITHM_NAMES))
    op_overhead_s: dict[str, float] = {}
    op_efficiency: dict[str, float] = {}
    op_knee: dict[str, tuple[float, float]] = {}
    per_op = sec.section("ops", default_empty=True)
    for op in _op_keys(per_op):
        one = per_op.section(op)
        if one.has("overhead_us"):
            op_overhead_s[str(op)] = one.get("overhead_us", float, check=non_negative) * US
        if one.has("efficiency"):
            op_efficiency[str(op)] = one.get("efficiency", float, check=_fraction)
        if one.has("knee_bytes") or one.has("knee_efficiency"):
            op_knee[str(op)] = _knee(one, op_efficiency.get(str(op), 1.0))
        one.finish()
    sec.finish()
    return CollectiveSettings(
        library=library,
        overhead_s=overhead_s,
        algorithms=overrides,
        op_overhead_s=op_overhead_s,
        op_efficiency=op_efficiency,
        op_knee=op_knee,
        nccl_version=nccl_version,
    )


def _check_size(root: ConfigReader, num_nodes: int, ranks_per_node: int, nics: int) -> None:
    """Refuse, before any link is built, a cluster whose ranks or NIC ports pass
    :data:`TOPOLOGY_MAX_RANKS` (the graph holds links per rank and per NIC:
    ``gpus_per_node: 100000000`` was a MemoryError)."""
    limit = TOPOLOGY_MAX_RANKS
    for what, path, count in (
        ("GPUs", ("gpus_per_node",), num_nodes * ranks_per_node),
        ("NIC ports", ("nics", "count"), num_nodes * nics),
    ):
        if count > limit:
            raise ConfigError(
                f"{num_nodes:,} node(s) x {count // num_nodes:,} = {count:,} {what}, more than "
                f"the limit of {limit:,}; use fewer",
                key_path=".".join(path),
                file=root.file,
                line=root.doc.line_of(path) if root.doc is not None else None,
            )


def _efficiency_and_latency(sec: ConfigReader) -> dict[str, float]:
    """The ``efficiency`` and ``latency_us`` keys every link class has."""
    return {
        "efficiency": sec.get("efficiency", float, default=1.0, check=_fraction),
        "latency_s": sec.get("latency_us", float, default=0.0, check=non_negative) * US,
    }


def _op_keys(sec: ConfigReader) -> list[str]:
    """Keys of a per-op mapping, each checked to be a collective op."""
    keys = [str(op) for op, _ in list(sec.items())]
    for op in keys:
        if op not in _OP_NAMES:
            raise sec.error(f"unknown op (choose from {', '.join(_OP_NAMES)})", op)
    return keys


def _knee(one: ConfigReader, efficiency: float) -> tuple[float, float]:
    """``(knee_bytes, knee_efficiency)`` of one op: both keys, the second <= ``efficiency``."""
    for key in ("knee_bytes", "knee_efficiency"):
        if not one.has(key):
            raise one.error("knee_bytes and knee_efficiency go together; missing", key)
    knee_bytes = one.get("knee_bytes", (int, float), check=non_negative)
    knee_eff = one.get("knee_efficiency", float, check=_fraction)
    if knee_eff > efficiency:
        raise one.error(
            f"must be <= the op's efficiency ({efficiency}), got {knee_eff}", "knee_efficiency"
        )
    return float(knee_bytes), knee_eff


def _fraction(value: float) -> str | None:
    return None if 0 < value <= 1 else f"must be in (0, 1], got {value}"


def _at_least_one(value: float) -> str | None:
    return None if value >= 1 else f"must be >= 1 (1 = non-blocking), got {value}"


# -- topology (collsim.cluster.topology.parse_topology) --------------------------------------------


def _link(extra: dict[str, Spec]) -> dict[str, Spec]:
    return {
        **extra,
        "efficiency": fraction_value("Achievable / line rate."),
        "latency_us": non_negative_value("number", "Per-hop latency in microseconds."),
    }


_OPS = values_of(_OP_NAMES)
_OP_RULE = "unknown op (choose from {choices})"


def _op_value(spec: Value) -> Value:
    # per-op values are read when their key is present: null is refused there
    return replace(spec, nullable=False)


TOPOLOGY = Section(
    description="A collsim topology: one node type and the fabric (docs/topologies.md).",
    fields={
        "name": text_value("Topology name.", required=True),
        "description": text_value("Free text."),
        "device": Either(
            required=True,
            description="A device key, a device file (*.yaml) or a device mapping.",
            options=(text_value("A device key or file.", json_choices=list_devices), DEVICE),
            rule="must be a device key, a device file or a device mapping, got {value!r}",
        ),
        "nodes": positive_value("integer", "Default node count."),
        "gpus_per_node": positive_value("integer", "Ranks per node.", required=True),
        "intra_node": Section(
            required=True,
            description="What connects the GPUs of a node.",
            fields=_link(
                {
                    "interconnect": choice_value(
                        "NVSwitch, a PCIe switch, or the kernel's loopback.",
                        values_of(Interconnect),
                        required=True,
                    ),
                    "bandwidth_gbps": positive_value(
                        "number", "Per-direction bandwidth per GPU, GB/s.", required=True
                    ),
                    "nvls": flag_value("NVSwitch reduction (NVLS)."),
                }
            ),
        ),
        "nics": Section(
            nullable=False,
            description="Network interfaces of a node (needed for more than one node).",
            fields=_link(
                {
                    "count": positive_value("integer", "NICs per node.", required=True),
                    "rate_gbit": positive_value(
                        "number", "Line rate per NIC, Gb/s.", required=True
                    ),
                }
            ),
        ),
        "fabric": Section(
            description="The network between nodes.",
            fields={
                "kind": choice_value("Transport (sets defaults).", values_of(FabricKind)),
                "rails": flag_value("Rail-optimised."),
                "oversubscription": Value(
                    kind="number",
                    minimum=1,
                    rule="must be >= 1 (1 = non-blocking), got {value}",
                    description="Leaf uplink oversubscription.",
                ),
                "nodes_per_leaf": positive_value("integer", "Nodes per leaf switch."),
                "latency_us": non_negative_value("number", "Per leaf <-> spine direction, us."),
                "net_latency_us": non_negative_value("number", "Per LL/LL128 network step, us."),
                "net_simple_latency_us": non_negative_value(
                    "number", "Per Simple network step, us."
                ),
                "ll128": flag_value("NCCL runs LL128 across nodes."),
                "ll": flag_value("NCCL runs LL across nodes."),
                "completion_us": non_negative_value(
                    "number", "Per Simple network step beyond the flush, us."
                ),
                "platform": choice_value("EFA instance family.", values_of(EFA_PLATFORMS)),
                "tuner": choice_value("Whose choice auto follows.", values_of(TUNERS)),
                "sharp": flag_value("CollNet / SHARP in-network reduction."),
            },
        ),
        "host": Section(
            description="Host memory link and CPU.",
            fields={
                "bandwidth_gbps": positive_value("number", "Host <-> GPU bandwidth, GB/s."),
                "cpu_vendor": choice_value("Host CPU vendor.", values_of(CPU_VENDORS)),
            },
        ),
        "collectives": Section(
            description="Collective library settings.",
            fields={
                "library": choice_value("Library.", values_of(LIBRARIES)),
                "overhead_us": non_negative_value(
                    "number", "Launch overhead per call, microseconds."
                ),
                "nccl_version": choice_value("NCCL release assumed.", values_of(NCCL_RELEASES)),
                "algorithms": Section(
                    description="Algorithm per op.",
                    keys=_OPS,
                    key_rule=_OP_RULE,
                    values=choice_value("Algorithm.", values_of(_ALGORITHM_NAMES), nullable=False),
                ),
                "ops": Section(
                    description="Per-op calibration.",
                    keys=_OPS,
                    key_rule=_OP_RULE,
                    values=Section(
                        nullable=False,
                        fields={
                            "overhead_us": _op_value(
                                non_negative_value("number", "Overhead per call, us.")
                            ),
                            "efficiency": _op_value(
                                fraction_value("Achievable / modelled bandwidth.")
                            ),
                            "knee_bytes": _op_value(
                                non_negative_value("number", "Size above which the knee holds.")
                            ),
                            "knee_efficiency": _op_value(
                                fraction_value("Efficiency above the knee.")
                            ),
                        },
                    ),
                ),
            },
        ),
    },
)
