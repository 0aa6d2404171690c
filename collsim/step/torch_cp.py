"""The attention half of a layer under torch's context parallelism as the step program runs
it: each SDPA call (with its merge or gradient accumulation) a compute step, and the KV
exchange beside the call it overlaps, in the order of pytorch's
``_templated_ring_attention`` / ``_templated_ring_attention_backward``
(``torch/distributed/tensor/experimental/_context_parallel/_attention.py`` at 09b101c;
docs/derivations.md, "torch context parallelism").
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from collsim.core.vocab import ParallelAxis
from collsim.step.ops import Step

if TYPE_CHECKING:
    from collsim.parallel.layer_comms import LayerComm
    from collsim.workload.op_costs import OpCost

__all__ = ["CHUNK_OPS", "chunk_times", "torch_cp_steps"]

CHUNK_OPS = frozenset(("flash_attention", "cp_attention", "cp_lse_merge"))
"""The ops of one torch CP step: an SDPA call and the merge (or accumulation) after it."""


def chunk_times(ops: tuple[OpCost, ...], phase: str, scale: float = 1.0) -> tuple[float, ...]:
    """Seconds of each CP step of one layer in ``phase``: its SDPA call plus the merge after
    it (backward: its accumulation), in the loop's order (the same in both phases), times
    ``scale`` (an overridden block's ratio)."""
    out: list[float] = []
    for cost in ops:
        if cost.phase != phase or cost.name not in CHUNK_OPS:
            continue
        if cost.name == "cp_lse_merge" and out:
            out[-1] += cost.time_s * scale
        else:
            out.append(cost.time_s * scale)
    return tuple(out)


def torch_cp_steps(
    seconds: float, comms: list[LayerComm], chunks_s: tuple[float, ...], *, forward: bool
) -> list[Step]:
    """The attention half of one pass (``seconds`` in all, of which ``chunks_s`` are the CP
    steps) with the KV exchange of ``comms`` beside the SDPA calls.

    Forward: ``allgather`` issues the all-gather before step 0 and waits for it before step
    1; ``alltoall`` sends the held KV block to the next rank before each step but the last
    and waits for it at the next. Backward: the same exchange of K and V, and at each step
    the fp32 dK, dV sent on, waited for at the next step, the last one after the loop
    (exposed). Two sends of one step share the CP group's stream, so they are one send of
    both sizes."""
    cp = len(chunks_s)
    rest = Step(max(seconds - sum(chunks_s), 0.0))
    kv = next(c for c in comms if c.name in ("cp_kv_all_gather", "cp_kv_rotate"))
    axis = ParallelAxis.CP
    gather = kv.op == "all_gather"
    kv_send = [
        kv.size_bytes if (gather and i == 0) or (not gather and i < cp - 1) else 0.0
        for i in range(cp)
    ]
    if forward:
        out = [
            Step(op=kv.op, size_bytes=kv_send[i], overlap_s=chunks_s[i], axis=axis)
            if kv_send[i]
            else Step(chunks_s[i])
            for i in range(cp)
        ]
        return [rest, *out]
    dkv = next(c for c in comms if c.name == "cp_dkv_rotate")
    steps: list[Step] = []
    for i in range(cp):
        sizes = [kv_send[i]] if kv_send[i] else []
        if i > 0:
            sizes.append(dkv.size_bytes)
        if gather and i == 0:
            steps.append(
                Step(op="all_gather", size_bytes=kv_send[0], overlap_s=chunks_s[0], axis=axis)
            )
        elif sizes:
            steps.append(
                Step(op="send_recv", size_bytes=sum(sizes), overlap_s=chunks_s[i], axis=axis)
            )
        else:
            steps.append(Step(chunks_s[i]))
    steps.append(Step(op="send_recv", size_bytes=dkv.size_bytes, axis=axis))
    return [*steps, rest]


def take_excess(out: list[Step], excess_s: float, keep: set[int]) -> None:
    """Take ``excess_s`` seconds out of the largest plain compute steps of a pass (not those
    whose id is in ``keep``), in place: the CP steps of a torch layer can outlast the even
    attention half the pass was split into, and the pass keeps its total."""
    while excess_s > 0:
        plain = [
            k for k, st in enumerate(out) if not st.op and st.seconds > 0 and id(st) not in keep
        ]
        if not plain:
            return
        k = max(plain, key=lambda j: out[j].seconds)
        got = min(excess_s, out[k].seconds)
        out[k] = Step(out[k].seconds - got)
        excess_s -= got
