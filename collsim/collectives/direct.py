"""Direct algorithms: every rank sends to every peer at once (one step).

all_to_all: rank i sends its block j (M/n) to rank j (NCCL's grouped send/recv).
reduce_scatter / all_gather: the same all-pairs pattern with M/n blocks; all_reduce is both.
broadcast / reduce: the root sends M to / receives M from every other rank.
send_recv: with two ranks, one point-to-point message ranks[0] -> ranks[1] (a pipeline stage
sending to the next); with more, nccl-tests sendrecv: rank i sends M to rank i+1 (mod n). On an
idle network both take the time of one message (every rank's links carry one).
"""

from __future__ import annotations

from collsim.collectives.schedule import Phase, one_step_phase
from collsim.collectives.types import Algorithm, CollectiveOp, Group

__all__ = ["ALGORITHM", "SUPPORTED", "build"]

ALGORITHM = Algorithm.DIRECT
SUPPORTED = frozenset(CollectiveOp)


def build(op: CollectiveOp, group: Group) -> list[Phase]:
    """Phases of direct ``op`` on ``group``."""
    ranks, topo = group.ranks, group.topology
    n = len(ranks)
    if n < 2:
        return []
    all_pairs = [(s, d) for s in ranks for d in ranks if s != d]
    root = ranks[0]
    match op:
        case CollectiveOp.ALL_TO_ALL | CollectiveOp.REDUCE_SCATTER | CollectiveOp.ALL_GATHER:
            return [one_step_phase(topo, all_pairs, 1.0 / n)]
        case CollectiveOp.ALL_REDUCE:          # reduce-scatter, then all-gather
            return [one_step_phase(topo, all_pairs, 1.0 / n)] * 2
        case CollectiveOp.BROADCAST:
            return [one_step_phase(topo, [(root, d) for d in ranks[1:]], 1.0)]
        case CollectiveOp.REDUCE:
            return [one_step_phase(topo, [(s, root) for s in ranks[1:]], 1.0)]
        case CollectiveOp.SEND_RECV:
            pairs = [(ranks[i], ranks[(i + 1) % n]) for i in range(n if n > 2 else 1)]
            return [one_step_phase(topo, pairs, 1.0)]
        case _:
            raise AssertionError(op)
