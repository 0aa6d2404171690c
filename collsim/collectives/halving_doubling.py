"""Recursive halving (reduce-scatter) and doubling (all-gather), Rabenseifner's all_reduce.

Thakur, Rabenseifner & Gropp 2005, "Optimization of collective communication operations in
MPICH". Reduce-scatter: in step k (k = 0..log2 n - 1) rank i exchanges M / 2^(k+1) with
i XOR 2^k; all-gather runs the steps in reverse. Distances double, so the biggest exchanges stay
between near ranks (inside a node) and the network carries the small ones. Bytes per rank:
(n-1)/n x M each way for each half, as a ring. Needs a power-of-two group.
"""

from __future__ import annotations

from collsim.collectives.transfers import LoadPhase, one_step_phase
from collsim.collectives.types import Group
from collsim.core.errors import ConfigError
from collsim.core.vocab import Algorithm, CollectiveOp

__all__ = ["ALGORITHM", "SUPPORTED", "build"]

ALGORITHM = Algorithm.HALVING_DOUBLING
SUPPORTED = frozenset(
    {CollectiveOp.ALL_REDUCE, CollectiveOp.REDUCE_SCATTER, CollectiveOp.ALL_GATHER}
)


def _exchange(group: Group, distance: int, factor: float) -> LoadPhase:
    ranks = group.ranks
    pairs = [(ranks[i], ranks[i ^ distance]) for i in range(len(ranks))]
    return one_step_phase(group.topology, pairs, factor)


def build(op: CollectiveOp, group: Group) -> list[LoadPhase]:
    """Phases of halving-doubling ``op`` on ``group`` (one per step)."""
    if op not in SUPPORTED:
        raise ConfigError(f"halving_doubling does not implement {op.value}")
    n = group.size
    if n & (n - 1):
        raise ConfigError(f"halving_doubling needs a power-of-two group, got {n} ranks")
    steps = n.bit_length() - 1
    halving = [_exchange(group, 1 << k, 1.0 / (2 << k)) for k in range(steps)]
    doubling = halving[::-1]
    match op:
        case CollectiveOp.ALL_REDUCE:
            return halving + doubling
        case CollectiveOp.REDUCE_SCATTER:
            return halving
        case _:
            return doubling
