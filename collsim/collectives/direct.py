"""Direct algorithms: every rank sends to every peer at once (one step).

all_to_all: rank i sends its block j (M/n) to rank j (NCCL's grouped send/recv).
reduce_scatter / all_gather: the same all-pairs pattern with M/n blocks; all_reduce is both.
broadcast / reduce: the root sends M to / receives M from every other rank.
send_recv: with two ranks, one point-to-point message ranks[0] -> ranks[1] (a pipeline stage
sending to the next); with more, nccl-tests sendrecv: rank i sends M to rank i+1 (mod n). On an
idle network both take the time of one message (every rank's links carry one).
"""

from __future__ import annotations

from collsim.collectives.schedule import Phase, make_transfer
from collsim.collectives.types import Algorithm, CollectiveOp, Group

__all__ = ["ALGORITHM", "SUPPORTED", "build"]

ALGORITHM = Algorithm.DIRECT
SUPPORTED = frozenset(CollectiveOp)


def _phase(group: Group, pairs: list[tuple[int, int]], factor: float) -> Phase:
    transfers = tuple(make_transfer(group.topology, s, d) for s, d in pairs)
    inter = any(t.inter for t in transfers)
    return Phase(transfers, factor, 0 if inter else 1, 1 if inter else 0)


def build(op: CollectiveOp, group: Group) -> list[Phase]:
    """Phases of direct ``op`` on ``group``."""
    ranks = group.ranks
    n = len(ranks)
    if n < 2:
        return []
    all_pairs = [(s, d) for s in ranks for d in ranks if s != d]
    root = ranks[0]
    match op:
        case CollectiveOp.ALL_TO_ALL | CollectiveOp.REDUCE_SCATTER | CollectiveOp.ALL_GATHER:
            return [_phase(group, all_pairs, 1.0 / n)]
        case CollectiveOp.ALL_REDUCE:
            return [_phase(group, all_pairs, 1.0 / n), _phase(group, all_pairs, 1.0 / n)]
        case CollectiveOp.BROADCAST:
            return [_phase(group, [(root, d) for d in ranks[1:]], 1.0)]
        case CollectiveOp.REDUCE:
            return [_phase(group, [(s, root) for s in ranks[1:]], 1.0)]
        case CollectiveOp.SEND_RECV:
            pairs = [(ranks[i], ranks[(i + 1) % n]) for i in range(n if n > 2 else 1)]
            return [_phase(group, pairs, 1.0)]
        case _:
            raise AssertionError(op)
