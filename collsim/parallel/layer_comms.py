"""Where the expert-parallel and context-parallel collectives sit in a layer.

For wiring into the step schedule: per layer, the collectives each micro-batch issues on one
rank, with the op they follow in the layer's op list (:func:`collsim.workload.ops.layer_ops`),
their size in the nccl-tests convention (``collsim.collectives.cost``: the per-rank buffer for
all_to_all, the gathered output for all_gather, the input for reduce_scatter, the message for
send_recv), the plan axis of their group and whether compute can hide them. The byte counts
are those of :mod:`collsim.parallel.moe` and :mod:`collsim.parallel.context` (tested against
each other).

MoE layer: forward ``ep_dispatch`` after ``moe_permute`` (with DeepEP / HybridEP across nodes,
the network leg on ``ep_node`` and beside it ``ep_dispatch_nvl`` on ``ep_local``), [``etp_gather``
(all_gather over etp)], experts, [``etp_scatter`` (reduce_scatter over etp)], ``ep_combine``
before ``moe_unpermute``; backward the same collectives in reverse order (the gradient of a
combine is a dispatch). The dispatcher decides ops and bytes (:func:`_moe_forward`). These
sit on the critical path of the layer unless the stack overlaps them with another
micro-batch's compute (``parallel.ep_overlap``), so ``overlappable`` is False here.

Attention with CP: ``all_gather`` gathers K and V before the attention (not overlapped; Llama
3) and reduce-scatters dK, dV after its backward; ``ring`` sends cp - 1 KV blocks, each step
overlapped with the attention of the block already held (``overlappable``), and cp - 1 steps of
KV plus dKV in backward.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import TYPE_CHECKING

from collsim.core.vocab import ParallelAxis
from collsim.parallel.context import kv_block_bytes
from collsim.parallel.dispatch import dispatcher_of, ep_layout, expected_reach
from collsim.workload.ops import activation_element_bytes
from collsim.workload.torch_cp import CAST_BYTES, is_torch_cp

if TYPE_CHECKING:
    from collsim.parallel.plan import Plan

__all__ = ["LayerComm", "layer_comms"]

CP, EP, ETP = ParallelAxis.CP, ParallelAxis.EP, ParallelAxis.ETP
EP_NODE, EP_LOCAL = ParallelAxis.EP_NODE, ParallelAxis.EP_LOCAL
_MOE_AXES = (EP, ETP, EP_NODE, EP_LOCAL)


@dataclass(frozen=True, slots=True)
class LayerComm:
    """One collective of one layer and micro-batch on one rank.

    Attributes:
        name: ``ep_dispatch``, ``ep_combine``, ``ep_dispatch_nvl``, ``ep_combine_nvl``,
            ``etp_gather``, ``etp_scatter``,
            ``cp_kv_all_gather``, ``cp_dkv_reduce_scatter``, ``cp_ring_step``,
            ``cp_kv_rotate``, ``cp_dkv_rotate`` (torch's context parallelism).
        op: a ``collsim.collectives.CollectiveOp`` value.
        size_bytes: nccl-tests size of one call.
        axis: the plan axis of its group (``ep``, ``ep_node``, ``ep_local``, ``etp``, ``cp``).
        phase: ``forward`` or ``backward``.
        after: the op of the layer it follows (forward order; in backward it precedes that
            op's backward).
        calls: how many times it runs (ring steps), each of ``size_bytes``.
        overlappable: compute of the same layer can hide it.
    """

    name: str
    op: str
    size_bytes: float
    axis: str
    phase: str
    after: str
    calls: int = 1
    overlappable: bool = False


def layer_comms(plan: Plan, layer: int | None = None) -> list[LayerComm]:
    """The EP and CP collectives of ``layer`` (None: the most common layer kind) for one
    micro-batch on one rank of ``plan``, forward then backward."""
    e = activation_element_bytes(str(plan.training.dtype))
    fwd: list[LayerComm] = []
    bwd: list[LayerComm] = []
    if plan.parallel.cp > 1:
        fwd, bwd = _cp_comms(plan, e)
    if plan.spec.is_moe_layer(layer) and (plan.parallel.ep > 1 or plan.parallel.etp > 1):
        fwd += _moe_forward(plan, e)
        bwd += [
            LayerComm(
                c.name, c.op, c.size_bytes, c.axis, "backward", c.after, c.calls, c.overlappable
            )
            for c in reversed(fwd)
            if c.axis in _MOE_AXES
        ]
    return fwd + _backward_order(bwd)


def _cp_comms(plan: Plan, e: int) -> tuple[list[LayerComm], list[LayerComm]]:
    """The context-parallel exchange of keys and values (forward) and of their gradients
    (backward): one all-gather / reduce-scatter, or cp - 1 ring steps under attention."""
    spec, par, b = plan.spec, plan.parallel, plan.training.micro_batch
    block = kv_block_bytes(
        micro_batch=b,
        seq_len=spec.seq_len,
        cp=par.cp,
        kv_heads=spec.num_heads if spec.is_mla else spec.kv_heads,
        key_dim=spec.qk_head_dim,
        value_dim=spec.value_head_dim,
        element_bytes=e,
        tp=par.tp,
    )
    if is_torch_cp(str(par.cp_algorithm)):
        return _torch_cp_comms(plan, e)
    attn = "flash_attention" if spec.flash_attention else "attn_scores"
    before = "kv_up" if spec.is_mla else "qkv_proj"
    if spec.position_embedding == "rotary":
        before = "rotary"
    if str(par.cp_algorithm) == "all_gather":
        return (
            [LayerComm("cp_kv_all_gather", "all_gather", par.cp * block, CP, "forward", before)],
            [
                LayerComm(
                    "cp_dkv_reduce_scatter",
                    "reduce_scatter",
                    par.cp * block,
                    CP,
                    "backward",
                    before,
                )
            ],
        )
    steps = par.cp - 1
    return (
        [LayerComm("cp_ring_step", "send_recv", block, CP, "forward", attn, steps, True)],
        [LayerComm("cp_ring_step", "send_recv", 2 * block, CP, "backward", attn, steps, True)],
    )


def _torch_cp_comms(plan: Plan, e: int) -> tuple[list[LayerComm], list[LayerComm]]:
    """torch's context parallelism (:mod:`collsim.parallel.context`): K and V of every query
    head of the rank, exchanged once (``torch_allgather``: an all-gather beside the first SDPA
    call) or rotated (``torch_alltoall``: cp - 1 sends, each beside an SDPA call), in forward
    and again in backward; in backward the fp32 dK, dV accumulators go to the next rank at
    each of the cp steps. :mod:`collsim.step.torch_cp` places them beside the SDPA calls."""
    spec, par, b = plan.spec, plan.parallel, plan.training.micro_batch
    block = kv_block_bytes(
        micro_batch=b,
        seq_len=spec.seq_len,
        cp=par.cp,
        kv_heads=spec.num_heads,
        key_dim=spec.qk_head_dim,
        value_dim=spec.value_head_dim,
        element_bytes=e,
        tp=par.tp,
    )
    dkv = block * CAST_BYTES / e
    at = "flash_attention"
    steps = par.cp - 1
    if str(par.cp_algorithm) == "torch_allgather":
        kv = [
            LayerComm("cp_kv_all_gather", "all_gather", par.cp * block, CP, "forward", at, 1, True)
        ]
    else:
        kv = [LayerComm("cp_kv_rotate", "send_recv", block, CP, "forward", at, steps, True)]
    back = [replace(c, phase="backward") for c in kv]
    back.append(LayerComm("cp_dkv_rotate", "send_recv", dkv, CP, "backward", at, par.cp, True))
    return kv, back


def _moe_forward(plan: Plan, e: int) -> list[LayerComm]:
    """The forward expert-parallel dispatch and combine and the expert tensor-parallel gather
    and scatter around the experts (etp), as the plan's dispatcher runs them
    (:mod:`collsim.parallel.dispatch`; docs/dispatch.md)::

        alltoall:  all_to_all over ep of T k h e (k copies of every token)
        allgather: all_gather over ep of ep T h e (every token to every rank), the combine a
                   reduce_scatter of the same
        deepep / hybridep, one node: all_to_all over ep of T D_g h e (once per target GPU)
        deepep / hybridep, N > 1 nodes: all_to_all over ep_node of T D_n h e (once per target
                   node, to the same in-node index) and, beside it, all_to_all over ep_local
                   of T D_g h e (NVLink forwarding per target GPU; ``*_nvl``, run at the same
                   time as the network leg: ``collsim.step.ops.Step.beside``)

    T tokens on the rank, D_n and D_g the expected distinct nodes and GPUs a token reaches
    under the plan's routing model (:func:`~collsim.parallel.dispatch.expected_reach`)."""

    spec, par = plan.spec, plan.parallel
    tokens = (
        plan.training.micro_batch
        * (spec.seq_len // par.cp)
        / (par.tp if par.sequence_parallel else 1)
    )
    size = tokens * spec.moe_top_k * spec.hidden * e
    name = dispatcher_of(plan) if par.ep > 1 else "alltoall"
    dispatch: list[LayerComm] = []
    combine: list[LayerComm] = []
    if name == "allgather":
        gathered = par.ep * tokens * spec.hidden * e
        dispatch = [LayerComm("ep_dispatch", "all_gather", gathered, EP, "forward", "moe_permute")]
        combine = [
            LayerComm("ep_combine", "reduce_scatter", gathered, EP, "forward", "expert_down")
        ]
    elif name in ("deepep", "hybridep"):
        nodes, per_node = ep_layout(plan)
        reach = expected_reach(
            experts=spec.num_experts,
            top_k=spec.moe_top_k,
            gpus=par.ep,
            nodes=nodes,
            routing=par.routing,
            limit_nodes=par.routing_nodes or 0,
        )
        gpu_bytes = tokens * reach.gpus * spec.hidden * e
        if nodes == 1:
            dispatch = [
                LayerComm("ep_dispatch", "all_to_all", gpu_bytes, EP, "forward", "moe_permute")
            ]
            combine = [
                LayerComm("ep_combine", "all_to_all", gpu_bytes, EP, "forward", "expert_down")
            ]
        else:
            node_bytes = tokens * reach.nodes * spec.hidden * e
            dispatch = [
                LayerComm(
                    "ep_dispatch", "all_to_all", node_bytes, EP_NODE, "forward", "moe_permute"
                )
            ]
            combine = [
                LayerComm("ep_combine", "all_to_all", node_bytes, EP_NODE, "forward", "expert_down")
            ]
            if per_node > 1:
                dispatch.append(
                    LayerComm(
                        "ep_dispatch_nvl",
                        "all_to_all",
                        gpu_bytes,
                        EP_LOCAL,
                        "forward",
                        "moe_permute",
                    )
                )
                combine.insert(
                    0,
                    LayerComm(
                        "ep_combine_nvl",
                        "all_to_all",
                        gpu_bytes,
                        EP_LOCAL,
                        "forward",
                        "expert_down",
                    ),
                )
    elif par.ep > 1:
        dispatch = [LayerComm("ep_dispatch", "all_to_all", size, EP, "forward", "moe_permute")]
        combine = [LayerComm("ep_combine", "all_to_all", size, EP, "forward", "expert_down")]
    fwd: list[LayerComm] = list(dispatch)
    if par.etp > 1:
        gathered = size * par.etp
        fwd.append(LayerComm("etp_gather", "all_gather", gathered, ETP, "forward", "moe_permute"))
        fwd.append(
            LayerComm("etp_scatter", "reduce_scatter", gathered, ETP, "forward", "expert_down")
        )
    return fwd + combine


def _backward_order(bwd: list[LayerComm]) -> list[LayerComm]:
    """Backward runs the layer in reverse: MoE collectives (later in forward) come first."""
    moe = [c for c in bwd if c.axis in _MOE_AXES]
    rest = [c for c in bwd if c.axis not in _MOE_AXES]
    return moe + rest
