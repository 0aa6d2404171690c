"""PAT (parallel aggregated trees) all_gather and reduce_scatter, NCCL 2.23+.

Scope in the release followed (NCCL 2.30.7, src/graph/tuning.cc ``ncclPatEnable``): PAT runs
only with one GPU per node (``nNodes == nRanks``), sm60+, and without network device offload;
Simple protocol only; reduce_scatter not with PreMulSum / SumPostDiv (src/enqueue.cc). So it is
the at-scale algorithm for gathers across nodes with one rank each (the data-parallel groups of
a TP x DP plan), and this module refuses other groups.

Flow level: log2 steps at doubling distances (rank i sends to i + 2^k for all_gather, to
i - 2^k for reduce_scatter in reverse order), step k carrying min(2^k, n - 2^k)/n x M, so a
rank moves (n-1)/n x M in all, as a ring does, in ceil(log2 n) steps instead of n - 1.
Latency (tuning.cc): base 8 us + log2(nodes) x network latency / 3.5 + 2.8 us x ranks ("still
a linear part"). Bandwidth: NCCL's model applies 0.75 to PAT's bus bandwidth (tuning.cc);
collsim's links give the rate.
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np

import collsim.collectives.tuner as tuner
from collsim.collectives.transfers import LoadPhase, pairs_phase
from collsim.collectives.types import Group
from collsim.core.errors import ConfigError
from collsim.core.vocab import Algorithm, CollectiveOp, Protocol

__all__ = ["ALGORITHM", "SUPPORTED", "build", "latency_for"]

ALGORITHM = Algorithm.PAT
SUPPORTED = frozenset({CollectiveOp.ALL_GATHER, CollectiveOp.REDUCE_SCATTER})


def build(op: CollectiveOp, group: Group) -> list[LoadPhase]:
    """One phase per distance 2^k."""
    if op not in SUPPORTED:
        raise ConfigError(f"pat implements all_gather and reduce_scatter, not {op.value}")
    n = group.size
    if group.num_nodes != n:
        raise ConfigError(
            "pat runs with one rank per node in NCCL 2.30.7 (ncclPatEnable); this group has "
            f"{n} ranks on {group.num_nodes} nodes"
        )
    if n < 2:
        return []
    ranks = np.asarray(group.ranks, dtype=np.int64)
    index = np.arange(n)
    phases = []
    distance = 1
    while distance < n:
        share = min(distance, n - distance) / n
        sign = 1 if op is CollectiveOp.ALL_GATHER else -1
        dst = ranks[(index + sign * distance) % n]
        phases.append(pairs_phase(group.topology, ranks, dst, share, 0, 1))
        distance *= 2
    if op is CollectiveOp.REDUCE_SCATTER:
        phases.reverse()
    return phases


def latency_for(
    op: CollectiveOp, group: Group, algorithm: Algorithm = ALGORITHM
) -> Callable[[Protocol], float]:
    """NCCL's PAT latency for the group (tuner table, seconds)."""
    table = tuner.table_for(group)

    def latency_s(protocol: Protocol) -> float:
        key = (op, Algorithm.PAT, protocol)
        if key in table.latency_us:
            return table.latency_us[key] * 1e-6
        return 0.0

    return latency_s
