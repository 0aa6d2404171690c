"""Groups of ranks and collective costs (the ops, algorithms and protocols are in
:mod:`collsim.core.vocab`)."""

from __future__ import annotations

from dataclasses import dataclass, field
from functools import cached_property

from collsim.cluster.topology import Topology
from collsim.core.errors import ConfigError
from collsim.core.vocab import Algorithm, CollectiveOp, Protocol

__all__ = [
    "Group",
    "CollectiveCost",
    "busbw_factor",
]


_new = object.__new__
_setattr = object.__setattr__


def busbw_factor(op: CollectiveOp, num_ranks: int) -> float:
    """nccl-tests busbw / algbw (doc/PERFORMANCE.md): 2(n-1)/n all_reduce, (n-1)/n gathers."""
    n = num_ranks
    if n < 2:
        return 0.0
    match op:
        case CollectiveOp.ALL_REDUCE:
            return 2.0 * (n - 1) / n
        case CollectiveOp.REDUCE_SCATTER | CollectiveOp.ALL_GATHER | CollectiveOp.ALL_TO_ALL:
            return (n - 1) / n
        case CollectiveOp.BROADCAST | CollectiveOp.REDUCE | CollectiveOp.SEND_RECV:
            return 1.0
        case _:
            raise ConfigError(f"unknown op {op!r}")


@dataclass(frozen=True, eq=False)
class Group:
    """Ranks of a topology taking part in one collective, in the order given.

    Groups compare and hash by (topology identity, ranks), so they key per-group caches.
    """

    topology: Topology
    ranks: tuple[int, ...]
    _key: tuple[int, tuple[int, ...]] = field(init=False, repr=False, compare=False)
    _hash: int = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        ranks = tuple(map(int, self.ranks))
        object.__setattr__(self, "ranks", ranks)
        if not ranks:
            raise ConfigError("a group needs at least one rank")
        if len(set(ranks)) != len(ranks):
            raise ConfigError(f"group ranks repeat: {ranks}")
        n = self.topology.num_ranks
        if min(ranks) < 0 or max(ranks) >= n:
            rank = next(r for r in ranks if not 0 <= r < n)
            raise ConfigError(f"rank {rank} not in topology {self.topology.name} (0..{n - 1})")
        key = (id(self.topology), ranks)
        object.__setattr__(self, "_key", key)
        object.__setattr__(self, "_hash", hash(key))

    @classmethod
    def all(cls, topology: Topology) -> Group:
        """Every rank of the topology."""
        return cls(topology, tuple(range(topology.num_ranks)))

    @property
    def size(self) -> int:
        """Number of ranks."""
        return len(self.ranks)

    def __hash__(self) -> int:
        return self._hash

    def __eq__(self, other: object) -> bool:
        return isinstance(other, Group) and (other is self or other._key == self._key)

    def by_node(self) -> list[tuple[int, list[int]]]:
        """(node, ranks of the group on it in group order), nodes in first-seen order."""
        nodes: dict[int, list[int]] = {}
        for rank in self.ranks:
            nodes.setdefault(self.topology.node_of(rank), []).append(rank)
        return list(nodes.items())

    @cached_property
    def num_nodes(self) -> int:
        """Distinct nodes the group spans (computed once)."""
        return len({r // self.topology.gpus_per_node for r in self.ranks})


@dataclass(frozen=True)
class CollectiveCost:
    """Time of one collective and nccl-tests bandwidths (algbw = size / time).

    Not slotted, so that :meth:`fast` can fill ``__dict__`` directly: the closed form builds
    one of these per evaluation and the frozen ``__init__`` would cost more than the model.
    """

    op: CollectiveOp
    algorithm: Algorithm
    protocol: Protocol
    size_bytes: int
    time_s: float
    algbw_bps: float
    busbw_bps: float
    num_ranks: int = 0

    @property
    def label(self) -> str:
        """``ring/simple`` style name of the choice."""
        return f"{self.algorithm.value}/{self.protocol.value}"

    @classmethod
    def fast(
        cls,
        op: CollectiveOp,
        algorithm: Algorithm,
        protocol: Protocol,
        size_bytes: int,
        time_s: float,
        algbw_bps: float,
        busbw_bps: float,
        num_ranks: int,
    ) -> CollectiveCost:
        """Same as the constructor, without the frozen ``__init__``'s per-field setattr."""
        obj = _new(cls)
        _setattr(
            obj,
            "__dict__",
            {
                "op": op,
                "algorithm": algorithm,
                "protocol": protocol,
                "size_bytes": size_bytes,
                "time_s": time_s,
                "algbw_bps": algbw_bps,
                "busbw_bps": busbw_bps,
                "num_ranks": num_ranks,
            },
        )
        return obj
