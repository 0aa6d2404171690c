"""In-switch reduction (NVLS, NVLink SHARP) inside one NVSwitch node.

NCCL's NVLS all_reduce (src/device/all_reduce.h, NVLS) is a reduce-scatter with
multimem.ld_reduce (the switch reads every GPU's piece of a shard, the issuing GPU's own
included, and returns the sum) followed by an all-gather with multimem.st (the GPU writes its
reduced shard once, the switch multicasts it). Per GPU port, pipelined:

- all_reduce: out M (pieces read by the switch) + M/n (reduced shard written) = (1 + 1/n) M;
  in M/n (reduced shard) + M (multicast shards) = (1 + 1/n) M.
- reduce_scatter: out M, in M/n.  all_gather: out M/n, in M.

The bandwidth efficiency is NCCL's NVLS factor, 0.85 on Hopper (tuning.cc); the latency is
NCCL's NVLS NVLink hop, 25 us, paid once.
"""

from __future__ import annotations

from collsim.collectives.schedule import Phase, Transfer
from collsim.collectives.types import Algorithm, CollectiveOp, Group
from collsim.errors import ConfigError

__all__ = ["ALGORITHM", "SUPPORTED", "build"]

ALGORITHM = Algorithm.NVLS
SUPPORTED = frozenset({CollectiveOp.ALL_REDUCE, CollectiveOp.REDUCE_SCATTER,
                       CollectiveOp.ALL_GATHER})


def build(op: CollectiveOp, group: Group) -> list[Phase]:
    """Phases of NVLS ``op`` on ``group`` (one phase of port transfers)."""
    topo = group.topology
    if op not in SUPPORTED:
        raise ConfigError(f"nvls does not implement {op.value}")
    if not topo.nvls:
        raise ConfigError(f"topology {topo.name} has no in-switch reduction (intra_node.nvls)")
    if group.num_nodes != 1:
        raise ConfigError("nvls runs inside one node; this group spans "
                          f"{group.num_nodes} nodes (use hierarchical or ring)")
    n = group.size
    if n < 2:
        return []
    out_w, in_w = {CollectiveOp.ALL_REDUCE: (1.0 + 1.0 / n, 1.0 + 1.0 / n),
                   CollectiveOp.REDUCE_SCATTER: (1.0, 1.0 / n),
                   CollectiveOp.ALL_GATHER: (1.0 / n, 1.0)}[op]
    transfers = [Transfer((topo.gpu_tx[r],), r, None, False, out_w) for r in group.ranks]
    transfers += [Transfer((topo.gpu_rx[r],), None, r, False, in_w) for r in group.ranks]
    return [Phase(tuple(transfers), 1.0, 1, 0)]
