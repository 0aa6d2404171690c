"""Links, NICs and fabrics of a topology: the link table and the dataclasses a file is read into.

Derivations, measurements and sources: docs/derivations.md, ``collsim.cluster.topology``.
"""

from __future__ import annotations

import bisect
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any, overload

import numpy as np

from collsim.cluster.transports import NCCL_RELEASES, TRANSPORTS
from collsim.core.vocab import FabricKind, Interconnect, LinkKind

__all__ = [
    "Link",
    "LinkTable",
    "CollectiveSettings",
    "FabricDefaults",
    "FABRIC_DEFAULTS",
]


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
