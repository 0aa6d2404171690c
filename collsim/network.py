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
    flow_of_entry: np.ndarray, link_of_entry: np.ndarray, num_flows: int, capacity_bps: np.ndarray
) -> np.ndarray:
    """Max-min fair rates by progressive filling.

    Every unfrozen flow's rate rises at the same pace; when a link saturates, the flows through
    it freeze. Repeats until every flow is frozen.

    Args:
        flow_of_entry: flow index of each (flow, link) incidence entry.
        link_of_entry: link index of each entry (same length).
        num_flows: number of flows; every flow must have at least one entry.
        capacity_bps: capacity of every link of the network.

    Returns:
        rate of each flow, bytes/s.
    """
    rates = np.zeros(num_flows)
    cap_left = capacity_bps.astype(float).copy()
    num_links = len(capacity_bps)
    live = np.ones(len(flow_of_entry), dtype=bool)
    frozen = np.zeros(num_flows, dtype=bool)
    level = 0.0
    while live.any():
        counts = np.bincount(link_of_entry[live], minlength=num_links)
        used = counts > 0
        share = np.full(num_links, np.inf)
        share[used] = cap_left[used] / counts[used]
        increment = float(share.min())
        level += increment
        cap_left[used] -= increment * counts[used]
        saturated = used & (share <= increment * (1 + 1e-12))
        hit = np.unique(flow_of_entry[live & saturated[link_of_entry]])
        rates[hit] = level
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
        self.capacity_bps = np.array([link.capacity_bps for link in topology.links], dtype=float)
        self._latency_s = np.array([link.latency_s for link in topology.links], dtype=float)
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
    ) -> simpy.Event:
        """Send over an explicit list of link indices (e.g. a GPU's port into a switch).

        ``src`` / ``dst`` name the ranks whose counters the bytes go to (None: a switch).
        """
        if size_bytes < 0:
            raise ConfigError(f"size_bytes must be >= 0, got {size_bytes}")
        if not 0 < efficiency <= 1:
            raise ConfigError(f"efficiency must be in (0, 1], got {efficiency}")
        path = tuple(path)
        if latency_s is None:
            latency_s = float(self._latency_s[list(path)].sum()) if path else 0.0
        done = self.env.event()
        flow = _Flow(
            path=path,
            wire_bytes=size_bytes / efficiency,
            remaining=size_bytes / efficiency,
            latency_s=latency_s,
            done=done,
            src=src,
            dst=dst,
            size_bytes=size_bytes,
        )
        if not path or size_bytes == 0:
            self._deliver(flow)
            return done
        self._advance()
        self._flows.append(flow)
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
        rates = max_min_rates(flow_of_entry, link_of_entry, len(flows), self.capacity_bps)
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
        for flow in finished:
            self._deliver(flow)
        self._recompute()

    def _deliver(self, flow: _Flow) -> None:
        if flow.path:  # a rank sending to itself is no network traffic
            if flow.src is not None:
                self.bytes_sent[flow.src] += flow.size_bytes
            if flow.dst is not None:
                self.bytes_received[flow.dst] += flow.size_bytes
        for link in flow.path:
            self.link_bytes[link] += flow.size_bytes
        if flow.latency_s > 0:
            delay = self.env.timeout(flow.latency_s, value=flow.done)
            delay.callbacks.append(_fire_delivery)
        else:
            flow.done.succeed()


def _fire_delivery(delay: simpy.Event) -> None:
    """Callback of a propagation delay: fire the delivery event it carries as its value."""
    cast(simpy.Event, delay.value).succeed()
