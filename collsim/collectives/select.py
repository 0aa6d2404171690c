"""Entry points: closed-form :func:`cost` and DES :func:`simulate`, with ``auto`` selection.

``auto`` with ``library: nccl`` takes the (algorithm, protocol) NCCL's own tuner picks
(:mod:`collsim.collectives.tuner`, NCCL 2.30.7 src/graph/tuning.cc and src/enqueue.cc) for the
ops NCCL tunes (all_reduce, reduce_scatter, all_gather, broadcast, reduce); the time is
collsim's for that choice, and the result names it. Where the tuner has no say (gloo, a forced
protocol, all_to_all and send_recv, which NCCL runs point to point) ``auto`` evaluates the
closed-form time of every (algorithm, protocol) available and takes the cheapest. A topology
may pin the algorithm per op (``collectives.algorithms``), as a calibrated topology does.

Schedules and their timings are cached per (group, op, algorithm) on the topology, and the
tuner's pick per size per (group, op), so a cost evaluation is a dictionary lookup and a few
multiply-adds.
"""

from __future__ import annotations

from collections.abc import Callable, Generator, Sequence
from math import inf
from types import ModuleType
from typing import Any

import simpy

import collsim.collectives.collnet as collnet
import collsim.collectives.direct as direct
import collsim.collectives.halving_doubling as halving_doubling
import collsim.collectives.hierarchical as hierarchical
import collsim.collectives.nvls as nvls
import collsim.collectives.nvls_tree as nvls_tree
import collsim.collectives.pat as pat
import collsim.collectives.ring as ring
import collsim.collectives.tree as tree
import collsim.collectives.tuner as tuner
from collsim.cluster.network import FlowNetwork
from collsim.collectives.memo import PerTopology
from collsim.collectives.phases import CollectivePhases, ProtocolCap, Timing, run_phases
from collsim.collectives.types import CollectiveCost, Group, busbw_factor
from collsim.core.errors import ConfigError
from collsim.core.vocab import Algorithm, CollectiveOp, Protocol, parse_enum

__all__ = ["ALGORITHM_MODULES", "phases_for", "choose", "cost", "simulate", "supported"]

_PHASES: PerTopology[tuple[Group, str, str], CollectivePhases] = PerTopology()
"""The phases of one (group, op, algorithm) (:func:`phases_for`)."""
_CANDIDATES: PerTopology[tuple[Group, str], list[tuple[CollectivePhases, Timing]]] = PerTopology()
"""The (phases, timing) options ``auto`` chooses among per (group, op)."""
COSTS: PerTopology[tuple[Group, str, str, str | None], CostEntry] = PerTopology()
"""The closed form's per-call table per (group, op, algorithm, protocol) (:func:`cost`)."""
SHARED_COSTS: PerTopology[tuple[Any, str, str, str | None], CostEntry] = PerTopology()
"""The same tables per (:meth:`~collsim.cluster.topology.Topology.symmetry_key` of the group, op,
algorithm, protocol): groups that a shift by whole nodes maps onto each other share one."""

ALGORITHM_MODULES: dict[Algorithm, ModuleType] = {
    Algorithm.RING: ring,
    Algorithm.TREE: tree,
    Algorithm.HALVING_DOUBLING: halving_doubling,
    Algorithm.DIRECT: direct,
    Algorithm.HIERARCHICAL: hierarchical,
    Algorithm.NVLS: nvls,
    Algorithm.NVLS_TREE: nvls_tree,
    Algorithm.COLLNET_DIRECT: collnet,
    Algorithm.COLLNET_CHAIN: collnet,
    Algorithm.PAT: pat,
}

_NCCL_AUTO = (
    Algorithm.RING,
    Algorithm.TREE,
    Algorithm.NVLS,
    Algorithm.NVLS_TREE,
    Algorithm.COLLNET_DIRECT,
    Algorithm.COLLNET_CHAIN,
    Algorithm.PAT,
)
_TUNED_OPS = frozenset(
    {
        CollectiveOp.ALL_REDUCE,
        CollectiveOp.REDUCE_SCATTER,
        CollectiveOp.ALL_GATHER,
        CollectiveOp.BROADCAST,
        CollectiveOp.REDUCE,
    }
)
"""Ops NCCL's tuner chooses an (algorithm, protocol) for (tuning.cc); the others are
point-to-point in NCCL."""
_GLOO_AUTO = (
    Algorithm.RING,
    Algorithm.TREE,
    Algorithm.HALVING_DOUBLING,
    Algorithm.HIERARCHICAL,
    Algorithm.DIRECT,
)
_DIRECT_ONLY = frozenset({CollectiveOp.ALL_TO_ALL, CollectiveOp.SEND_RECV})


def supported(op: CollectiveOp) -> list[Algorithm]:
    """Algorithms that implement ``op`` (on some topology)."""
    return [alg for alg, module in ALGORITHM_MODULES.items() if op in module.SUPPORTED]


def phases_for(op: CollectiveOp, group: Group, algorithm: Algorithm) -> CollectivePhases:
    """The cached phases of (op, algorithm) on ``group``.

    Raises:
        ConfigError: the algorithm does not implement the op, or not on this group.
    """
    cache = _PHASES.of(group.topology)
    key = (group, op, algorithm)
    found = cache.get(key)
    if found is None:
        if algorithm is Algorithm.AUTO:
            raise ConfigError("auto names no one algorithm; use choose()")
        module = ALGORITHM_MODULES[algorithm]
        loop_bytes_for = getattr(module, "loop_bytes_for", None)
        latency_for = getattr(module, "latency_for", None)
        build = module.build
        phases = build(op, group, algorithm) if module is collnet else build(op, group)
        found = CollectivePhases(
            op,
            algorithm,
            group.topology,
            phases,
            None if loop_bytes_for is None else loop_bytes_for(op, group),
            latency_for=None if latency_for is None else latency_for(op, group, algorithm),
            cap_for=_protocol_cap(op, group, algorithm),
            loop_step_s=getattr(module, "LOOP_STEP_S", None),
        )
        cache[key] = found
    return found


def _protocol_cap(
    op: CollectiveOp, group: Group, algorithm: Algorithm
) -> Callable[[Protocol], ProtocolCap | None] | None:
    """NCCL's ceilings for (op, algorithm) on ``group``, in algorithm bandwidth (tuning.cc):
    LL / LL128 on rings and trees (``llMaxBws``, ``perChMaxRingLL128Bws``,
    ``perChMaxTreeLL128Bws``, LL's 0.5 and LL128's 0.92 of the graph's bandwidth), shared
    evenly by the graph's channels, with the channels a call runs on (enqueue.cc
    ``topoGetAlgoInfo``); and NVLS-tree's whole tuner bandwidth (``perChMaxNVLSTreeBws`` and
    ``nvlsEfficiency``), its kernel's measured ceiling. None where NCCL has no such limit
    (Simple rings and trees, and the algorithms that are not NCCL's)."""
    if (
        group.topology.collectives.library != "nccl"
        or op not in _TUNED_OPS
        or algorithm not in (Algorithm.RING, Algorithm.TREE, Algorithm.NVLS_TREE)
        or group.size < 2
    ):
        return None
    table = tuner.table_for(group)
    topo, num_nodes, n = group.topology, group.num_nodes, group.size
    gpus, nics = tuner.node_shape(topo, group.ranks)
    graph_channels = tuner.graphs_for(topo, num_nodes, gpus, nics)[algorithm].num_channels

    def cap(protocol: Protocol) -> ProtocolCap | None:
        if algorithm is Algorithm.NVLS_TREE:
            # perChMaxNVLSTreeBws: NCCL's measured per-channel ceiling of the NVLS-tree kernel
            bw = table.bandwidth_gbps.get((op, algorithm, protocol), 0.0) * 1e9
            if bw <= 0:
                return None
            return ProtocolCap(bw, bw / graph_channels, graph_channels, 0.0)
        if protocol is Protocol.SIMPLE:
            return None
        bw = table.bandwidth_gbps.get((op, algorithm, protocol), 0.0) * 1e9
        if bw <= 0:
            return None
        return ProtocolCap(
            bw,
            bw / graph_channels,
            tuner.runtime_channels(topo, num_nodes, gpus, nics),
            tuner.min_bytes_per_channel(algorithm, protocol, n),
        )

    return cap


def _candidates(op: CollectiveOp, group: Group) -> list[tuple[CollectivePhases, Timing]]:
    cache = _CANDIDATES.of(group.topology)
    key = (group, op)
    found = cache.get(key)
    if found is None:
        settings = group.topology.collectives
        pinned = settings.algorithms.get(op.value)
        if pinned is not None and pinned != Algorithm.AUTO.value:
            algorithms: Sequence[Algorithm] = (Algorithm(pinned),)
        elif op in _DIRECT_ONLY:
            algorithms = (Algorithm.DIRECT,)
        else:
            algorithms = _GLOO_AUTO if settings.library == "gloo" else _NCCL_AUTO
        found = []
        for algorithm in algorithms:
            if op not in ALGORITHM_MODULES[algorithm].SUPPORTED:
                continue
            try:
                phases = phases_for(op, group, algorithm)
            except ConfigError:
                continue  # not applicable to this group (e.g. NVLS across nodes)
            found += [(phases, timing) for timing in phases.timings]
        if not found:
            raise ConfigError(
                f"no algorithm implements {op.value} on this group "
                f"({group.size} ranks on {group.num_nodes} nodes)"
            )
        cache[key] = found
    return found


def choose(
    op: CollectiveOp | str,
    size_bytes: float,
    group: Group,
    algorithm: Algorithm | str = Algorithm.AUTO,
    protocol: Protocol | str | None = None,
) -> tuple[CollectivePhases, Timing]:
    """The (phases, timing) that :func:`cost` and :func:`simulate` use.

    With ``algorithm=auto`` the cheapest (algorithm, protocol) in closed form; with a named
    algorithm, its cheapest protocol (or ``protocol`` if given).
    """
    options = _options(op, group, algorithm, protocol)
    picked = _tuner_pick(op, size_bytes, group, algorithm, protocol, options)
    if picked is not None:
        return picked
    best = options[0]
    best_s = best[1].time_s(size_bytes)
    for option in options[1:]:
        t = option[1].time_s(size_bytes)
        if t < best_s:
            best, best_s = option, t
    return best


def _uses_tuner(
    op: CollectiveOp, group: Group, algorithm: Algorithm | str, protocol: Protocol | str | None
) -> bool:
    """Whether ``auto`` follows NCCL's tuner here: library nccl, an op NCCL tunes, no pinned
    algorithm or forced protocol, more than one rank."""
    settings = group.topology.collectives
    pinned = settings.algorithms.get(str(op))
    return (
        settings.library == "nccl"
        and parse_enum(Algorithm, algorithm, "algorithm") is Algorithm.AUTO
        and protocol is None
        and op in _TUNED_OPS
        and (pinned is None or pinned == Algorithm.AUTO.value)
        and group.size > 1
    )


def _tuner_pick(
    op: CollectiveOp | str,
    size_bytes: float,
    group: Group,
    algorithm: Algorithm | str,
    protocol: Protocol | str | None,
    options: Sequence[tuple[CollectivePhases, Timing]],
) -> tuple[CollectivePhases, Timing] | None:
    """The option NCCL's tuner picks (:func:`collsim.collectives.tuner.pick`), or None when
    the tuner does not decide here or picks something this group has no phases for."""
    parsed = parse_enum(CollectiveOp, op, "op")
    if not _uses_tuner(parsed, group, algorithm, protocol):
        return None
    choice = tuner.pick(parsed, size_bytes, group)
    if choice is None:
        return None
    for option in options:
        if option[0].algorithm is choice[0] and option[1].protocol is choice[1]:
            return option
    return None


def _result(
    op: CollectiveOp,
    phases: CollectivePhases,
    timing: Timing,
    size_bytes: float,
    time_s: float,
    n: int,
) -> CollectiveCost:
    algbw = size_bytes / time_s if time_s > 0 else 0.0
    return CollectiveCost(
        op,
        phases.algorithm,
        timing.protocol,
        int(size_bytes),
        time_s,
        algbw,
        algbw * busbw_factor(op, n),
        n,
    )


def cost(
    op: CollectiveOp | str,
    size_bytes: float,
    group: Group,
    algorithm: Algorithm | str = Algorithm.AUTO,
    protocol: Protocol | str | None = None,
) -> CollectiveCost:
    """Closed-form time of one collective on an otherwise idle network.

    Args:
        op: the collective.
        size_bytes: nccl-tests size (the whole buffer for all_reduce / broadcast / reduce, the
            gathered output for all_gather, the input for reduce_scatter, the per-rank buffer
            for all_to_all, the message for send_recv).
        group: the ranks taking part.
        algorithm: an algorithm, or ``auto`` for the cheapest.
        protocol: force a protocol (``ll``, ``ll128``, ``simple``).

    Raises:
        ConfigError: unknown op or algorithm, or one that cannot run on this group.
    """
    if size_bytes < 0:
        raise ConfigError(f"size_bytes must be >= 0, got {size_bytes}")
    # Hot path (sweeps and plan searches call this millions of times): one dictionary lookup
    # for the entry, then the tuner's remembered pick (or the candidates) and a multiply-add.
    cache = COSTS.of(group.topology)
    key = (group, op, algorithm, protocol)
    entry = cache.get(key)
    if entry is None:
        entry = cache[key] = _shared_entry(op, group, algorithm, protocol)
    parsed_op, factor, n, picks = entry.op, entry.factor, entry.num_ranks, entry.picks
    if picks is not None:
        picked = picks.get(size_bytes, _UNSEEN)
        if picked is _UNSEEN:
            if len(picks) >= _PICK_MEMO:
                picks.clear()
            picked = picks[size_bytes] = entry.tuner_pick(size_bytes, group)
        if picked is not None:
            latency_s, s_per_byte, loop, alg, proto = picked
            t = latency_s + size_bytes * s_per_byte
            if loop is not None:
                t += loop(size_bytes)
            algbw = size_bytes / t if t > 0 else 0.0
            return CollectiveCost.fast(
                parsed_op, alg, proto, int(size_bytes), t, algbw, algbw * factor, n
            )
    candidates = entry.all(group)
    best_s = inf
    best_alg, best_proto = candidates[0][3], candidates[0][4]  # never empty (_candidates)
    for latency_s, s_per_byte, loop, alg, proto in candidates:
        t = latency_s + size_bytes * s_per_byte
        if loop is not None:
            t += loop(size_bytes)
        if t < best_s:
            best_s, best_alg, best_proto = t, alg, proto
    algbw = size_bytes / best_s if best_s > 0 else 0.0
    return CollectiveCost.fast(
        parsed_op, best_alg, best_proto, int(size_bytes), best_s, algbw, algbw * factor, n
    )


_Candidate = tuple[float, float, Callable[[float], float] | None, Algorithm, Protocol]
"""One (algorithm, protocol) of a group in closed form: latency, seconds per byte, loop term
(or None), algorithm, protocol."""


_PICK_MEMO = 4096
"""Sizes remembered per (group, op) for the tuner's pick (sweeps repeat the same sizes)."""

_UNSEEN: Any = object()


def _shared_entry(
    op: CollectiveOp | str,
    group: Group,
    algorithm: Algorithm | str,
    protocol: Protocol | str | None,
) -> CostEntry:
    """The entry of ``group``, shared with every group its topology calls alike
    (:meth:`collsim.cluster.topology.Topology.symmetry_key`): the stages of a pipeline have the same
    data-parallel and tensor-parallel groups shifted by whole nodes, priced once."""
    topology = group.topology
    alike = topology.symmetry_key(group.ranks)
    if alike is None:
        return CostEntry(op, group, algorithm, protocol)
    shared = SHARED_COSTS.of(topology)
    key = (alike, str(op), str(algorithm), None if protocol is None else str(protocol))
    found = shared.get(key)
    if found is None:
        found = shared[key] = CostEntry(op, group, algorithm, protocol)
    return found


def _candidate(phases: CollectivePhases, t: Timing) -> _Candidate:
    return (
        t.latency_s,
        t.seconds_per_byte,
        t.extra_s if t.has_extra else None,
        phases.algorithm,
        t.protocol,
    )


class CostEntry:
    """What :func:`cost` keeps per (group, op, algorithm, protocol).

    Where NCCL's tuner decides, only the phases it picks are built, when it first picks
    them (a step asks for a few sizes per group: most algorithms are never needed); every
    candidate is built only where the cheapest must be found.
    """

    __slots__ = ("op", "factor", "num_ranks", "picks", "_key", "_all", "_chosen")

    def __init__(
        self,
        op: CollectiveOp | str,
        group: Group,
        algorithm: Algorithm | str,
        protocol: Protocol | str | None,
    ) -> None:
        self.op = parse_enum(CollectiveOp, op, "op")
        self.factor = busbw_factor(self.op, group.size)
        self.num_ranks = group.size
        tuned = _uses_tuner(self.op, group, algorithm, protocol)
        self.picks: dict[float, _Candidate | None] | None = {} if tuned else None
        """The tuner's pick per size (None: it picks nothing this group has: the cheapest)."""
        self._key = (algorithm, protocol)
        self._all: list[_Candidate] | None = None
        self._chosen: dict[tuple[Algorithm, Protocol], _Candidate | None] = {}
        if not tuned:
            self.all(group)  # a bad algorithm or protocol fails here, as it always did

    def all(self, group: Group) -> list[_Candidate]:
        """Every (algorithm, protocol) this entry chooses among."""
        if self._all is None:
            algorithm, protocol = self._key
            self._all = [_candidate(s, t) for s, t in _options(self.op, group, algorithm, protocol)]
        return self._all

    def tuner_pick(self, size_bytes: float, group: Group) -> _Candidate | None:
        """The candidate NCCL's tuner picks for ``size_bytes`` (None when it picks nothing
        this group has phases for), built on first use."""
        choice = tuner.pick(self.op, size_bytes, group)
        if choice is None:
            return None
        if choice in self._chosen:
            return self._chosen[choice]
        found: _Candidate | None = None
        algorithm, protocol = choice
        if algorithm in _NCCL_AUTO and self.op in ALGORITHM_MODULES[algorithm].SUPPORTED:
            try:
                phases = phases_for(self.op, group, algorithm)
            except ConfigError:
                phases = None  # not applicable to this group (e.g. NVLS across nodes)
            if phases is not None and protocol in phases.protocols:
                found = _candidate(phases, phases.timing(protocol))
        self._chosen[choice] = found
        return found


def _options(
    op: CollectiveOp | str,
    group: Group,
    algorithm: Algorithm | str,
    protocol: Protocol | str | None,
) -> list[tuple[CollectivePhases, Timing]]:
    parsed_op = parse_enum(CollectiveOp, op, "op")
    parsed_alg = parse_enum(Algorithm, algorithm, "algorithm")
    if parsed_alg is Algorithm.AUTO:
        options = list(_candidates(parsed_op, group))
    else:
        phases = phases_for(parsed_op, group, parsed_alg)
        options = [(phases, t) for t in phases.timings]
    if protocol is not None:
        parsed_proto = parse_enum(Protocol, protocol, "protocol")
        options = [o for o in options if o[1].protocol is parsed_proto]
        if not options:
            raise ConfigError(
                f"protocol {parsed_proto.value} is not available for "
                f"{parsed_alg.value} {parsed_op.value} here"
            )
    return options


def simulate(
    env: simpy.Environment,
    net: FlowNetwork,
    op: CollectiveOp | str,
    size_bytes: float,
    group: Group,
    algorithm: Algorithm | str = Algorithm.AUTO,
    *,
    peers: Sequence[Group] = (),
    protocol: Protocol | str | None = None,
) -> simpy.Process:
    """Run one collective on ``net`` as a SimPy process.

    The (algorithm, protocol) is chosen as :func:`cost` chooses it. ``peers`` run the same
    collective at the same time (symmetry reduction: their traffic shares links with
    ``group``, but only ``group`` is followed). The process's value is the CollectiveCost
    measured in simulated time.
    """
    if size_bytes < 0:
        raise ConfigError(f"size_bytes must be >= 0, got {size_bytes}")
    phases, timing = choose(op, size_bytes, group, algorithm, protocol)
    for peer in peers:
        peer_phases = phases_for(phases.op, peer, phases.algorithm)
        env.process(
            run_phases(env, net, peer_phases, peer_phases.timing(timing.protocol), size_bytes)
        )
    return env.process(_follow(env, net, phases, timing, size_bytes, group.size))


def _follow(
    env: simpy.Environment,
    net: FlowNetwork,
    phases: CollectivePhases,
    timing: Timing,
    size_bytes: float,
    n: int,
) -> Generator[simpy.Event, object, CollectiveCost]:
    elapsed = yield from run_phases(env, net, phases, timing, size_bytes)
    return _result(phases.op, phases, timing, size_bytes, float(elapsed), n)
