"""The topology as a graph: ranks, nodes, link indices, paths and symmetry keys.

Derivations, measurements and sources: docs/derivations.md, ``collsim.cluster.topology``.
"""

from __future__ import annotations

import copy
from collections.abc import Sequence
from typing import Any

import numpy as np

from collsim.cluster.hardware import Device
from collsim.cluster.topology.links import (
    CollectiveSettings,
    Link,
    LinkTable,
    _FabricSpec,
    _IntraSpec,
    _NicSpec,
)
from collsim.core.errors import ConfigError, InfeasibleError
from collsim.core.vocab import Interconnect, LinkKind

__all__ = ["Topology"]

_KIND_CODES = tuple(LinkKind)

_INTRA_KIND = {
    Interconnect.NVSWITCH: LinkKind.NVLINK,
    Interconnect.PCIE_SWITCH: LinkKind.PCIE,
    Interconnect.LOOPBACK: LinkKind.LOOPBACK,
}


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
