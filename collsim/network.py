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

from collections import defaultdict
from collections.abc import Sequence
from dataclasses import dataclass
from typing import cast

import numpy as np
import simpy

from collsim.errors import ConfigError, SimulationError
from collsim.topology import Topology

__all__ = ["FlowNetwork", "max_min_rates", "load_bound_time_s"]

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
        hit = np.unique(flow_of_entry[live & saturated[link_of_entry]])
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


@dataclass(slots=True, eq=False)
class _Flow:
    path: tuple[int, ...]
    wire_bytes: float  # bytes on the wire: payload / efficiency
    remaining: float
    latency_s: float
    done: simpy.Event
    src: int | None
    dst: int | None
    size_bytes: float
    rate: float = 0.0
    count: float = 1.0
    """Identical transfers this flow stands for (bytes and rate are their sum)."""
    batch: _Batch | None = None
    """The batch whose single event this flow's delivery counts towards (None: ``done``)."""


@dataclass(slots=True, eq=False)
class _Batch:
    """Flows started together that share one completion event (:meth:`FlowNetwork.send_all`)."""

    pending: int
    done: simpy.Event


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
        self._flows: list[_Flow] = []
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
        flow = _Flow(
            path=path,
            wire_bytes=count * size_bytes / efficiency,
            remaining=count * size_bytes / efficiency,
            latency_s=latency_s,
            done=done,
            src=src,
            dst=dst,
            size_bytes=count * size_bytes,
            count=float(count),
        )
        if not path or size_bytes == 0:
            self._deliver(flow)
            return done
        self._advance()
        self._flows.append(flow)
        self._request_update()
        return done

    def send_all(
        self,
        transfers: Sequence[tuple[tuple[int, ...], float, int | None, int | None, int]],
        *,
        efficiency: float = 1.0,
        scale: float = 1.0,
    ) -> simpy.Event:
        """Start many transfers at once, delivered without propagation latency; one event
        fires when the last of them is delivered.

        Each transfer is ``(path, size_bytes, src, dst, count)`` as for :meth:`transfer_path`
        with ``latency_s=0``, its size multiplied by ``scale``. Same sharing as one call per
        transfer, without one SimPy event each (a collective phase of tens of thousands of
        flows).
        """
        if not 0 < efficiency <= 1:
            raise ConfigError(f"efficiency must be in (0, 1], got {efficiency}")
        if scale < 0:
            raise ConfigError(f"scale must be >= 0, got {scale}")
        done = self.env.event()
        batch = _Batch(len(transfers), done)
        self._advance()
        wire_scale = scale / efficiency
        started: list[_Flow] = []
        append = started.append
        for path, size_bytes, src, dst, count in transfers:
            if size_bytes < 0 or count < 1:
                raise ConfigError(
                    f"size_bytes must be >= 0 and count >= 1, got {size_bytes} and {count}"
                )
            wire = count * size_bytes * wire_scale
            append(
                _Flow(
                    path if type(path) is tuple else tuple(path),
                    wire,
                    wire,
                    0.0,
                    done,
                    src,
                    dst,
                    count * size_bytes * scale,
                    0.0,
                    float(count),
                    batch,
                )
            )
        if batch.pending == 0:
            done.succeed()
            return done
        empty = [f for f in started if not f.path or f.size_bytes == 0]
        self._flows.extend(f for f in started if f.path and f.size_bytes != 0)
        if empty:
            self._deliver_all(empty)
        if batch.pending > 0:
            self._request_update()
        return done

    @property
    def active_flows(self) -> int:
        """Transfers currently serializing."""
        return len(self._flows)

    # -- internals ----------------------------------------------------------------------
    def _advance(self) -> None:
        """Drain every active flow at its current rate up to now."""
        now = self.env.now
        elapsed = now - self._last_s
        if elapsed > 0:
            for flow in self._flows:
                flow.remaining -= flow.rate * elapsed
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
        flows = self._flows
        if not flows:
            return
        self.num_recomputes += 1
        lengths = np.fromiter((len(f.path) for f in flows), dtype=np.int64, count=len(flows))
        link_of_entry = np.fromiter(
            (link for f in flows for link in f.path), dtype=np.int64, count=int(lengths.sum())
        )
        flow_of_entry = np.repeat(np.arange(len(flows)), lengths)
        counts = np.fromiter((f.count for f in flows), dtype=float, count=len(flows))
        rates = max_min_rates(
            flow_of_entry,
            link_of_entry,
            len(flows),
            self.capacity_bps,
            None if bool((counts == 1.0).all()) else counts,
        )
        remaining = np.fromiter((f.remaining for f in flows), dtype=float, count=len(flows))
        for flow, rate in zip(flows, rates.tolist()):
            flow.rate = rate
        if np.any(rates <= 0):
            raise SimulationError("a flow got a zero rate")
        times = np.maximum(remaining, 0.0) / rates
        next_s = float(times.min())
        # The flows that end at the next event: decided now, so that clock round-off at a
        # large simulated time cannot leave a completion event without its flow.
        ending = [flows[i] for i in np.flatnonzero(times <= next_s * (1 + 1e-9) + 1e-15)]
        token = self._token
        event = self.env.timeout(next_s)
        event.callbacks.append(lambda _e: self._on_finish(token, ending))

    def _on_finish(self, token: int, ending: list[_Flow]) -> None:
        if token != self._token:
            return  # rates changed since this completion was scheduled
        self._advance()
        done = {id(f) for f in ending}
        still: list[_Flow] = []
        finished: list[_Flow] = []
        for flow in self._flows:
            if id(flow) in done or flow.remaining <= _FINISH_RTOL * flow.wire_bytes:
                finished.append(flow)
            else:
                still.append(flow)
        if not finished:
            raise SimulationError("completion event with no finished flow")
        self._flows = still
        self._deliver_all(finished)
        self._recompute()

    def _deliver(self, flow: _Flow) -> None:
        self._deliver_all([flow])

    def _deliver_all(self, flows: Sequence[_Flow]) -> None:
        """Count the flows' bytes (links in one vectorised update) and fire their events."""
        sent, received = self.bytes_sent, self.bytes_received
        with_path = [f for f in flows if f.path]
        for flow in with_path:  # a rank sending to itself is no network traffic
            if flow.src is not None:
                sent[flow.src] += flow.size_bytes
            if flow.dst is not None:
                received[flow.dst] += flow.size_bytes
        if len(with_path) == 1:
            flow = with_path[0]
            self.link_bytes[list(flow.path)] += flow.size_bytes
        elif with_path:
            lengths = np.fromiter(
                (len(f.path) for f in with_path), dtype=np.int64, count=len(with_path)
            )
            entries = np.fromiter(
                (link for f in with_path for link in f.path),
                dtype=np.int64,
                count=int(lengths.sum()),
            )
            sizes = np.fromiter((f.size_bytes for f in with_path), dtype=float, count=len(lengths))
            np.add.at(self.link_bytes, entries, np.repeat(sizes, lengths))
        for flow in flows:
            batch = flow.batch
            if batch is not None:  # latency 0 by construction (send_all)
                batch.pending -= 1
                if batch.pending == 0:
                    batch.done.succeed()
            elif flow.latency_s > 0:
                delay = self.env.timeout(flow.latency_s, value=flow.done)
                delay.callbacks.append(_fire_delivery)
            else:
                flow.done.succeed()


def _fire_delivery(delay: simpy.Event) -> None:
    """Callback of a propagation delay: fire the delivery event it carries as its value."""
    cast(simpy.Event, delay.value).succeed()
