"""Flow-level network on SimPy: transfers follow paths and share links max-min fairly.

A transfer occupies every link of its path for its serialization; concurrent transfers share
each link's capacity max-min fairly (progressive filling, as flow-level simulators such as
SimGrid do), and rates are recomputed only when a transfer starts or ends. All transfers that
start at the same simulated instant are batched into one recomputation. The path latency is
paid once, after the last byte is serialized (propagation after release, so chunks pipeline).

Closed form for the uncontended case: a set of equal-size transfers that start together all
finish by ``size x max over links (flows on link / capacity)``; the flows through the most
loaded link finish exactly then (:func:`load_bound_time_s`).

Example::

    env = simpy.Environment()
    net = FlowNetwork(env, load_topology("dgx_h100"))
    done = net.transfer(0, 1, 1e9)       # fires when the last byte arrives
    env.run(done)
"""

from __future__ import annotations

import itertools
from collections import defaultdict
from collections.abc import Sequence
from dataclasses import dataclass
from typing import cast

import numpy as np
import simpy

from collsim.cluster.topology import Topology
from collsim.core.errors import ConfigError, SimulationError

__all__ = ["FlowNetwork", "PackedSends", "max_min_rates", "load_bound_time_s"]

#: A flow whose remaining wire bytes fall below this share of its size counts as finished
#: (float round-off when several flows end at the same instant).
_FINISH_RTOL = 1e-9


def max_min_rates(
    flow_of_entry: np.ndarray,
    link_of_entry: np.ndarray,
    num_flows: int,
    capacity_bps: np.ndarray,
    multiplicity: np.ndarray | None = None,
) -> np.ndarray:
    """Max-min fair rates by progressive filling.

    Every unfrozen flow's rate rises at the same pace; when a link saturates, the flows through
    it freeze. Repeats until every flow is frozen.

    A flow of ``multiplicity`` k stands for k identical flows (same path, same bytes): it
    counts k times on each of its links and gets k times the member rate, which is exactly what
    the k flows would get one by one (they are never told apart by max-min sharing).

    Args:
        flow_of_entry: flow index of each (flow, link) incidence entry.
        link_of_entry: link index of each entry (same length).
        num_flows: number of flows; every flow must have at least one entry.
        capacity_bps: capacity of every link of the network.
        multiplicity: identical flows each flow stands for (default 1 each).

    Returns:
        rate of each flow (all its members together), bytes/s.
    """
    rates = np.zeros(num_flows)
    cap_left = capacity_bps.astype(float).copy()
    num_links = len(capacity_bps)
    live = np.ones(len(flow_of_entry), dtype=bool)
    frozen = np.zeros(num_flows, dtype=bool)
    entry_weight = None if multiplicity is None else multiplicity[flow_of_entry]
    level = 0.0
    while live.any():
        if entry_weight is None:
            counts = np.bincount(link_of_entry[live], minlength=num_links).astype(float)
        else:
            counts = np.bincount(
                link_of_entry[live], weights=entry_weight[live], minlength=num_links
            )
        used = counts > 0
        share = np.full(num_links, np.inf)
        share[used] = cap_left[used] / counts[used]
        increment = float(share.min())
        level += increment
        cap_left[used] -= increment * counts[used]
        saturated = used & (share <= increment * (1 + 1e-12))
        hit = flow_of_entry[live & saturated[link_of_entry]]  # repeats assign the same value
        rates[hit] = level if multiplicity is None else level * multiplicity[hit]
        frozen[hit] = True
        live &= ~frozen[flow_of_entry]
    return rates


def load_bound_time_s(
    paths: Sequence[Sequence[int]], capacity_bps: np.ndarray, weights: Sequence[float] | None = None
) -> float:
    """Seconds per byte for flows started together: max over links of (bytes on l) / cap_l.

    ``weights`` are the flows' sizes (default 1 each). Exact under max-min sharing when flows
    that share a link have equal sizes: the most loaded link's flows get cap_l / load_l and
    keep it until they all finish together; every other flow is at least as fast.
    """
    entries = [link for path in paths for link in path]
    if not entries:
        return 0.0
    entry_weights = (
        None if weights is None else [w for path, w in zip(paths, weights) for _ in path]
    )
    counts = np.bincount(
        np.asarray(entries, dtype=np.int64), weights=entry_weights, minlength=len(capacity_bps)
    )
    used = counts > 0
    return float((counts[used] / capacity_bps[used]).max())


@dataclass(frozen=True, slots=True, eq=False)
class PackedSends:
    """Transfers for :meth:`FlowNetwork.send_all` as columns, packed once and sent many times
    (a collective's phase at every message size).

    ``links`` holds every transfer's path one after another, ``lengths`` how many links each
    has; ``sizes`` are bytes (multiplied by ``send_all``'s ``scale``), ``src`` / ``dst`` the
    ranks (-1: none), ``counts`` the identical transfers each stands for.
    """

    links: np.ndarray
    lengths: np.ndarray
    sizes: np.ndarray
    src: np.ndarray
    dst: np.ndarray
    counts: np.ndarray

    @classmethod
    def of(
        cls, transfers: Sequence[tuple[Sequence[int], float, int | None, int | None, int]]
    ) -> PackedSends:
        """Pack ``(path, size_bytes, src, dst, count)`` tuples (checked: sizes >= 0, counts
        >= 1)."""
        if not transfers:
            empty = np.zeros(0, dtype=np.int64)
            return cls(empty, empty, np.zeros(0), empty, empty, np.zeros(0))
        paths, sizes_in, srcs, dsts, counts_in = zip(*transfers)
        sizes = np.asarray(sizes_in, dtype=float)
        counts = np.asarray(counts_in, dtype=float)
        bad = (sizes < 0) | (counts < 1)
        if bad.any():
            i = int(np.flatnonzero(bad)[0])
            raise ConfigError(
                f"size_bytes must be >= 0 and count >= 1, got {sizes_in[i]} and {counts_in[i]}"
            )
        lengths = np.fromiter(map(len, paths), dtype=np.int64, count=len(paths))
        links = np.fromiter(
            itertools.chain.from_iterable(paths), dtype=np.int64, count=int(lengths.sum())
        )
        src = np.fromiter((-1 if x is None else x for x in srcs), dtype=np.int64)
        dst = np.fromiter((-1 if x is None else x for x in dsts), dtype=np.int64)
        return cls(links, lengths, sizes, src, dst, counts)

    def __len__(self) -> int:
        return len(self.lengths)


@dataclass(slots=True, eq=False)
class _Single:
    """What a lone transfer (:meth:`FlowNetwork.transfer_path`) fires on delivery."""

    done: simpy.Event
    latency_s: float


@dataclass(slots=True, eq=False)
class _Batch:
    """Flows started together that share one completion event (:meth:`FlowNetwork.send_all`)."""

    pending: int
    done: simpy.Event


class _Pending:
    """Flows added since the last rate computation, as columns (appended, then packed)."""

    def __init__(self) -> None:
        self.links: list[int] = []
        self.lengths: list[int] = []
        self.wire: list[float] = []
        self.size: list[float] = []
        self.count: list[float] = []
        self.src: list[int] = []
        self.dst: list[int] = []
        self.owner: list[int] = []
        self.chunks: list[tuple[np.ndarray, ...]] = []
        """Packed batches: (links, lengths, wire, size, count, src, dst, owner) columns."""
        self.chunk_flows = 0

    def __len__(self) -> int:
        return len(self.lengths) + self.chunk_flows


class FlowNetwork:
    """Links of a topology shared by concurrent transfers (max-min fair).

    Attributes:
        bytes_sent: payload bytes delivered per source rank.
        bytes_received: payload bytes delivered per destination rank.
        link_bytes: payload bytes carried per link index.
        num_recomputes: how many times the rates were recomputed.
    """

    def __init__(self, env: simpy.Environment, topology: Topology) -> None:
        self.env = env
        self.topology = topology
        self.capacity_bps = np.array(topology.link_capacity_bps, dtype=float)
        self._latency_s = np.array(topology.link_latency_s, dtype=float)
        self.bytes_sent: dict[int, float] = defaultdict(float)
        self.bytes_received: dict[int, float] = defaultdict(float)
        self.link_bytes = np.zeros(len(topology.links))
        self.num_recomputes = 0
        # the active flows as columns: per flow, and per (flow, link) incidence entry
        self._id = np.zeros(0, dtype=np.int64)
        self._rem = np.zeros(0)  # wire bytes left
        self._wire = np.zeros(0)  # wire bytes in all (payload / efficiency)
        self._rate = np.zeros(0)
        self._count = np.zeros(0)  # identical transfers a flow stands for
        self._size = np.zeros(0)  # payload bytes
        self._src = np.zeros(0, dtype=np.int64)  # -1: no rank (a switch)
        self._dst = np.zeros(0, dtype=np.int64)
        self._owner = np.zeros(0, dtype=np.int64)  # index into _owners
        self._entry_flow = np.zeros(0, dtype=np.int64)
        self._entry_link = np.zeros(0, dtype=np.int64)
        self._owners: dict[int, _Single | _Batch] = {}
        self._next_owner = 0
        self._next_id = 0
        self._pending = _Pending()
        self._last_s = env.now
        self._update_pending = False
        self._token = 0

    # -- public -------------------------------------------------------------------------
    def transfer(
        self,
        src: int,
        dst: int,
        size_bytes: float,
        *,
        efficiency: float = 1.0,
        latency_s: float | None = None,
    ) -> simpy.Event:
        """Send ``size_bytes`` from rank ``src`` to rank ``dst`` along the topology's path.

        Args:
            src: sending rank.
            dst: receiving rank.
            size_bytes: payload bytes.
            efficiency: payload share of the bytes on the wire (a protocol's overhead), (0, 1].
            latency_s: latency paid after serialization; default: the path's latency.

        Returns:
            an event that fires when the last byte is delivered.
        """
        return self.transfer_path(
            self.topology.path(src, dst),
            size_bytes,
            src=src,
            dst=dst,
            efficiency=efficiency,
            latency_s=latency_s,
        )

    def transfer_path(
        self,
        path: Sequence[int],
        size_bytes: float,
        *,
        src: int | None = None,
        dst: int | None = None,
        efficiency: float = 1.0,
        latency_s: float | None = None,
        count: int = 1,
    ) -> simpy.Event:
        """Send over an explicit list of link indices (e.g. a GPU's port into a switch).

        ``src`` / ``dst`` name the ranks whose counters the bytes go to (None: a switch).
        ``count`` > 1 sends that many identical transfers of ``size_bytes`` each as one flow
        (same path and ranks; exact under max-min sharing, see :func:`max_min_rates`).
        """
        if size_bytes < 0:
            raise ConfigError(f"size_bytes must be >= 0, got {size_bytes}")
        if count < 1:
            raise ConfigError(f"count must be >= 1, got {count}")
        if not 0 < efficiency <= 1:
            raise ConfigError(f"efficiency must be in (0, 1], got {efficiency}")
        path = tuple(path)
        if latency_s is None:
            latency_s = float(self._latency_s[list(path)].sum()) if path else 0.0
        done = self.env.event()
        owner = self._own(_Single(done, latency_s))
        payload = count * size_bytes
        if not path or size_bytes == 0:
            if path:
                self._touch(src, dst)
            self._fire(owner, 1)
            return done
        self._advance()
        self._add(path, payload / efficiency, payload, float(count), src, dst, owner)
        self._request_update()
        return done

    def send_all(
        self,
        transfers: Sequence[tuple[tuple[int, ...], float, int | None, int | None, int]]
        | PackedSends,
        *,
        efficiency: float = 1.0,
        scale: float = 1.0,
    ) -> simpy.Event:
        """Start many transfers at once, delivered without propagation latency; one event
        fires when the last of them is delivered.

        Each transfer is ``(path, size_bytes, src, dst, count)`` as for :meth:`transfer_path`
        with ``latency_s=0``, its size multiplied by ``scale`` (or the same as
        :class:`PackedSends`, packed once for many calls). Same sharing as one call per
        transfer, without one SimPy event each (a collective phase of tens of thousands of
        flows).
        """
        if not 0 < efficiency <= 1:
            raise ConfigError(f"efficiency must be in (0, 1], got {efficiency}")
        if scale < 0:
            raise ConfigError(f"scale must be >= 0, got {scale}")
        packed = transfers if isinstance(transfers, PackedSends) else PackedSends.of(transfers)
        done = self.env.event()
        batch = _Batch(len(packed), done)
        if not len(packed):
            done.succeed()
            return done
        owner = self._own(batch)
        self._advance()
        lengths = packed.lengths
        payload = packed.counts * packed.sizes * scale
        moving = (lengths > 0) & (payload != 0)
        immediate = len(packed) - int(moving.sum())
        if immediate:
            for i in np.flatnonzero(~moving & (lengths > 0)).tolist():
                s_rank, d_rank = int(packed.src[i]), int(packed.dst[i])
                self._touch(s_rank, d_rank)
        if moving.any():
            links, counts, src, dst = packed.links, packed.counts, packed.src, packed.dst
            if immediate:
                links = links[np.repeat(moving, lengths)]
                lengths, payload = lengths[moving], payload[moving]
                counts, src, dst = counts[moving], src[moving], dst[moving]
            wire = payload / efficiency
            owners = np.full(len(lengths), owner, dtype=np.int64)
            pending = self._pending
            pending.chunks.append((links, lengths, wire, payload, counts, src, dst, owners))
            pending.chunk_flows += len(lengths)
        if immediate:
            self._fire(owner, immediate)
        if moving.any():
            self._request_update()
        return done

    @property
    def active_flows(self) -> int:
        """Transfers currently serializing."""
        return len(self._id) + len(self._pending)

    # -- internals ----------------------------------------------------------------------
    def _touch(self, src: int | None, dst: int | None) -> None:
        """A flow of no bytes over a path is delivered at once: its ranks are counted (0)."""
        if src is not None and src >= 0:
            self.bytes_sent[src] += 0.0
        if dst is not None and dst >= 0:
            self.bytes_received[dst] += 0.0

    def _own(self, owner: _Single | _Batch) -> int:
        key = self._next_owner
        self._next_owner += 1
        self._owners[key] = owner
        return key

    def _add(
        self,
        path: tuple[int, ...],
        wire: float,
        payload: float,
        count: float,
        src: int | None,
        dst: int | None,
        owner: int,
    ) -> None:
        p = self._pending
        p.links.extend(path)
        p.lengths.append(len(path))
        p.wire.append(wire)
        p.size.append(payload)
        p.count.append(count)
        p.src.append(-1 if src is None else src)
        p.dst.append(-1 if dst is None else dst)
        p.owner.append(owner)

    def _pack(self) -> None:
        """Move the pending flows into the columns (rate 0 until the next computation)."""
        p = self._pending
        if not len(p):
            return
        chunks = list(p.chunks)
        if p.lengths:
            chunks.append(
                (
                    np.asarray(p.links, dtype=np.int64),
                    np.asarray(p.lengths, dtype=np.int64),
                    np.asarray(p.wire, dtype=float),
                    np.asarray(p.size, dtype=float),
                    np.asarray(p.count, dtype=float),
                    np.asarray(p.src, dtype=np.int64),
                    np.asarray(p.dst, dtype=np.int64),
                    np.asarray(p.owner, dtype=np.int64),
                )
            )
        links, lengths, wire, size, count, src, dst, owner = (
            np.concatenate(column) for column in zip(*chunks)
        )
        n, base = len(lengths), len(self._id)
        self._entry_flow = np.concatenate(
            [self._entry_flow, np.repeat(np.arange(base, base + n, dtype=np.int64), lengths)]
        )
        self._entry_link = np.concatenate([self._entry_link, links])
        ids = np.arange(self._next_id, self._next_id + n, dtype=np.int64)
        self._next_id += n
        self._id = np.concatenate([self._id, ids])
        self._rem = np.concatenate([self._rem, wire])
        self._wire = np.concatenate([self._wire, wire])
        self._rate = np.concatenate([self._rate, np.zeros(n)])
        self._count = np.concatenate([self._count, count])
        self._size = np.concatenate([self._size, size])
        self._src = np.concatenate([self._src, src])
        self._dst = np.concatenate([self._dst, dst])
        self._owner = np.concatenate([self._owner, owner])
        self._pending = _Pending()

    def _advance(self) -> None:
        """Drain every active flow at its current rate up to now."""
        now = self.env.now
        elapsed = now - self._last_s
        if elapsed > 0 and len(self._rem):
            self._rem -= self._rate * elapsed
        self._last_s = now

    def _request_update(self) -> None:
        if self._update_pending:
            return
        self._update_pending = True
        event = self.env.timeout(0)
        event.callbacks.append(self._on_update)

    def _on_update(self, _event: simpy.Event) -> None:
        self._update_pending = False
        self._advance()
        self._recompute()

    def _recompute(self) -> None:
        self._token += 1
        self._pack()
        num = len(self._id)
        if not num:
            return
        self.num_recomputes += 1
        counts = self._count
        rates = max_min_rates(
            self._entry_flow,
            self._entry_link,
            num,
            self.capacity_bps,
            None if bool((counts == 1.0).all()) else counts,
        )
        self._rate = rates
        if np.any(rates <= 0):
            raise SimulationError("a flow got a zero rate")
        times = np.maximum(self._rem, 0.0) / rates
        next_s = float(times.min())
        # The flows that end at the next event: decided now, so that clock round-off at a
        # large simulated time cannot leave a completion event without its flow.
        ending = self._id[times <= next_s * (1 + 1e-9) + 1e-15]
        token = self._token
        event = self.env.timeout(next_s)
        event.callbacks.append(lambda _e: self._on_finish(token, ending))

    def _on_finish(self, token: int, ending: np.ndarray) -> None:
        if token != self._token:
            return  # rates changed since this completion was scheduled
        self._advance()
        finished = np.isin(self._id, ending) | (self._rem <= _FINISH_RTOL * self._wire)
        if not finished.any():
            raise SimulationError("completion event with no finished flow")
        self._deliver(finished)
        self._drop(finished)
        self._recompute()

    def _drop(self, finished: np.ndarray) -> None:
        """Remove the finished flows from the columns (entries renumbered)."""
        keep = ~finished
        entry_keep = keep[self._entry_flow]
        renumber = np.cumsum(keep) - 1
        self._entry_flow = renumber[self._entry_flow[entry_keep]]
        self._entry_link = self._entry_link[entry_keep]
        for name in ("_id", "_rem", "_wire", "_rate", "_count", "_size", "_src", "_dst"):
            setattr(self, name, getattr(self, name)[keep])
        self._owner = self._owner[keep]

    def _deliver(self, finished: np.ndarray) -> None:
        """Count the finished flows' bytes (ranks and links, vectorised) and fire their
        owners' events."""
        size = self._size[finished]
        for ranks, counter in ((self._src, self.bytes_sent), (self._dst, self.bytes_received)):
            mine = ranks[finished]
            named = mine >= 0
            if named.any():
                keys, where = np.unique(mine[named], return_inverse=True)
                sums = np.bincount(where, weights=size[named])
                for key, value in zip(keys.tolist(), sums.tolist()):
                    counter[key] += value
        entries = finished[self._entry_flow]
        np.add.at(self.link_bytes, self._entry_link[entries], self._size[self._entry_flow[entries]])
        owners, howmany = np.unique(self._owner[finished], return_counts=True)
        for owner, n in zip(owners.tolist(), howmany.tolist()):
            self._fire(owner, n)

    def _fire(self, key: int, delivered: int) -> None:
        """``delivered`` flows of owner ``key`` arrived: fire its event when all have."""
        owner = self._owners[key]
        if isinstance(owner, _Batch):  # latency 0 by construction (send_all)
            owner.pending -= delivered
            if owner.pending == 0:
                del self._owners[key]
                owner.done.succeed()
            return
        del self._owners[key]
        if owner.latency_s > 0:
            delay = self.env.timeout(owner.latency_s, value=owner.done)
            delay.callbacks.append(_fire_delivery)
        else:
            owner.done.succeed()


def _fire_delivery(delay: simpy.Event) -> None:
    """Callback of a propagation delay: fire the delivery event it carries as its value."""
    cast(simpy.Event, delay.value).succeed()
