"""The segments of one layer, the embedding and the LM head: compute split around collectives.

A layer's forward and backward passes as steps: its compute halves with the tensor-parallel
collectives Megatron-LM places around them, its EP and CP collectives inserted, the recomputed
forward before the backward, and the overlapped forms of :mod:`collsim.step.comm_overlap`.
Derivations and sources: docs/derivations.md, ``collsim.step.layer_passes``.
"""

from __future__ import annotations

from dataclasses import replace
from typing import TYPE_CHECKING

from collsim.core.vocab import ParallelAxis
from collsim.parallel.plan import Plan
from collsim.step.comm_overlap import (
    PAIRED_AXES,
    TPOverlap,
    overlap_ep,
    overlap_tp,
    tp_overlap_for,
)
from collsim.step.ops import BlockTimes, Segment, Step
from collsim.step.torch_cp import take_excess, torch_cp_steps

if TYPE_CHECKING:
    from collsim.parallel.layer_comms import LayerComm

__all__ = [
    "loss_bytes",
    "sized_layer_segments",
    "layer_segments",
    "head_segments",
]


def _split(
    seconds: float, tp_comm: bool, size: float, *, sp: bool, dgrad_s: tuple[float, ...] = ()
) -> list[Step]:
    """Two halves of compute (attention, MLP), each followed by its TP all-reduce, or with SP
    preceded by an all-gather and followed by a reduce-scatter.

    ``dgrad_s`` (backward with SP only): per half, the dgrad seconds of its column-parallel
    linear, which hide the re-gather of that linear's input (Korthikanti 2022, sec. 4.2.2).
    """
    if not tp_comm:
        return [Step(seconds)]
    half = seconds / 2
    if sp and dgrad_s:
        out: list[Step] = []
        for d in dgrad_s:
            d = min(max(d, 0.0), half)
            out += [
                Step(op="all_gather", size_bytes=size),
                Step(half - d),
                Step(op="all_gather", size_bytes=size, overlap_s=d),
                Step(op="reduce_scatter", size_bytes=size),
            ]
        return out
    if sp:
        return [
            Step(op="all_gather", size_bytes=size),
            Step(half),
            Step(op="reduce_scatter", size_bytes=size),
        ] * 2
    return [Step(half), Step(op="all_reduce", size_bytes=size)] * 2


def _halves(steps: list[Step], seconds: float) -> tuple[list[Step], list[int]]:
    """The steps of a layer pass and the indices of its two compute halves (the single
    compute step of a pass without TP collectives is split in two)."""
    idx = [i for i, st in enumerate(steps) if not st.op]
    if len(idx) >= 2:
        return steps, idx[:2]
    return [Step(seconds / 2), Step(seconds / 2)], [0, 1]


def _cp_steps(
    seconds: float, comms: list[LayerComm], attn_s: float, extra_s: float, *, forward: bool
) -> list[Step]:
    """The attention half with its CP collectives (docs/derivations.md)."""
    total = seconds + extra_s
    attn = min(attn_s + extra_s, total)
    out: list[Step] = []
    for c in comms:
        if c.op == "send_recv":
            block = attn / (c.calls + 1)
            ring = [
                Step(op="send_recv", size_bytes=c.size_bytes, overlap_s=block, axis=c.axis)
            ] * c.calls + [Step(block)]
            rest = Step(total - attn)
            return [rest, *ring] if forward else [*ring, rest]
        out.append(Step(op=c.op, size_bytes=c.size_bytes, axis=c.axis))
    return [*out, Step(total)] if forward else [Step(total), *out]


def _ep_steps(
    seconds: float, comms: list[LayerComm], experts_s: float, *, forward: bool
) -> list[Step]:
    """The MLP half of an MoE layer with its EP / etp collectives (docs/derivations.md)."""
    x = min(experts_s, seconds)
    nvl = {c.name.removesuffix("_nvl"): c for c in comms if c.name.endswith("_nvl")}
    lead = [c for c in comms if not c.name.endswith("_nvl")]
    coll = [
        Step(
            op=c.op,
            size_bytes=c.size_bytes,
            axis=c.axis,
            beside=(
                (Step(op=nvl[c.name].op, size_bytes=nvl[c.name].size_bytes, axis=nvl[c.name].axis),)
                if c.name in nvl
                else ()
            ),
        )
        for c in lead
    ]
    k = len(
        [
            c
            for c in lead
            if c.name
            in (("ep_dispatch", "etp_gather") if forward else ("ep_combine", "etp_scatter"))
        ]
    )
    body = [*coll[:k], Step(x), *coll[k:]]
    return [Step(seconds - x), *body] if forward else [*body, Step(seconds - x)]


def _with_comms(
    steps: list[Step],
    seconds: float,
    comms: list[LayerComm],
    block: BlockTimes,
    *,
    forward: bool,
    cp_extra: tuple[float, float],
) -> list[Step]:
    """Insert a layer's EP and CP collectives into one pass (forward or backward)."""
    cp = [c for c in comms if c.axis == ParallelAxis.CP]
    ep = [c for c in comms if c.axis != ParallelAxis.CP]
    if not cp and not ep:
        return steps
    steps, (first, second) = _halves(steps, seconds)
    attn_i, mlp_i = (first, second) if forward else (second, first)
    phase = 0 if forward else 1
    out: list[Step] = []
    excess, keep = 0.0, set()
    for i, st in enumerate(steps):
        if i == attn_i and cp and block.cp_chunks_s[phase]:
            chunks = block.cp_chunks_s[phase]
            torch_steps = torch_cp_steps(st.seconds, cp, chunks, forward=forward)
            keep = {id(x) for x in torch_steps}
            excess = max(sum(chunks) - st.seconds, 0.0)
            out += torch_steps
        elif i == attn_i and (cp or cp_extra[phase]):
            out += _cp_steps(
                st.seconds, cp, block.attention_s[phase], cp_extra[phase], forward=forward
            )
        elif i == mlp_i and ep:
            out += _ep_steps(st.seconds, ep, block.experts_s[phase], forward=forward)
        else:
            out.append(st)
    take_excess(out, excess, keep)
    return [st for st in out if st.op or st.seconds > 0]


def _cp_imbalance(plan: Plan, block: BlockTimes) -> tuple[float, float]:
    """Extra core-attention seconds (forward, backward) of the busiest CP rank without causal
    load balancing: (2 cp - 1) / cp times the mean, minus the mean (docs/derivations.md)."""
    cp = plan.cp
    if cp < 2 or plan.parallel.cp_load_balance or block.cp_chunks_s[0]:
        return (0.0, 0.0)  # torch's CP prices the busiest rank's calls (cp_chunks_s) itself
    f = (cp - 1) / cp
    return (block.attention_s[0] * f, block.attention_s[1] * f)


def loss_bytes(plan: Plan) -> float:
    """One vocab-parallel cross-entropy all-reduce: ``micro_batch x seq / cp`` fp32 values
    (Megatron-LM ``_VocabParallelCrossEntropy``: max, predicted logit, sum of exponentials)."""
    return float(plan.training.micro_batch * plan.spec.seq_len // plan.cp * 4)


def sized_layer_segments(
    plan: Plan,
    index: int,
    blk: BlockTimes,
    comms: list[LayerComm],
    size: float,
    *,
    full: bool,
    overlap: bool = False,
    tp_how: TPOverlap | None = None,
) -> tuple[Segment, Segment, Segment | None, Segment | None]:
    """The forward and backward segments of layer ``index``: its compute split around the TP
    collectives of ``size`` bytes, its EP / CP ``comms`` inserted, and (``full`` recompute) the
    forward re-run with its collectives before the backward; with EP ``overlap`` on an MoE
    layer, their paired forms too (:func:`overlap_ep`; else None)."""
    comm, sp = plan.tp > 1, plan.parallel.sequence_parallel
    f_comms = [c for c in comms if c.phase == "forward"]
    b_comms = [c for c in comms if c.phase == "backward"]
    extra = _cp_imbalance(plan, blk)
    fsteps_l = _with_comms(
        _split(blk.forward_s, comm, size, sp=sp),
        blk.forward_s,
        f_comms,
        blk,
        forward=True,
        cp_extra=extra,
    )
    pre = (
        _with_comms(
            _split(blk.recompute_s, comm, size, sp=sp),
            blk.recompute_s,
            f_comms,
            blk,
            forward=True,
            cp_extra=extra,
        )
        if full
        else ([Step(blk.recompute_s)] if blk.recompute_s else [])
    )
    bsteps_l = _with_comms(
        _split(
            blk.backward_s,
            comm,
            size,
            sp=sp,
            dgrad_s=(blk.column_dgrad_s or (0.0, 0.0)) if sp else (),
        ),
        blk.backward_s,
        b_comms,
        blk,
        forward=False,
        cp_extra=extra,
    )
    # the paired (EP-overlap) forms keep blocking TP calls: their compute runs hide the EP
    # all-to-alls (docs/tp_overlap.md); FP8 gathers and amax reductions apply to both
    p_fwd, p_bwd = fsteps_l, bsteps_l
    if tp_how is not None and comm and sp:
        blocking = replace(tp_how, mode="none")
        p_fwd = overlap_tp(fsteps_l, blk.linears_s, blocking, forward=True)
        p_bwd = overlap_tp(bsteps_l, blk.linears_s, blocking, forward=False)
        fsteps_l = overlap_tp(fsteps_l, blk.linears_s, tp_how, forward=True)
        if full:
            pre = overlap_tp(pre, blk.linears_s, tp_how, forward=True)
        bsteps_l = overlap_tp(bsteps_l, blk.linears_s, tp_how, forward=False)
    # torch CP's buffers: the forward's, and in backward the larger of its own and those of
    # the recomputed attention forward (full or selective recompute re-runs the ring)
    f_buf, b_buf = blk.cp_buffer_bytes
    if str(plan.training.recompute) != "none":
        b_buf = max(b_buf, f_buf)
    forward = Segment(index, fsteps_l, stored_bytes=blk.stored_bytes, buffer_bytes=f_buf)
    backward = Segment(
        index,
        pre + bsteps_l,
        grad_from=len(pre),
        stored_bytes=blk.stored_bytes,
        transient_bytes=blk.transient_bytes,
        buffer_bytes=b_buf,
    )
    if not (overlap and any(c.axis in PAIRED_AXES and c.op == "all_to_all" for c in f_comms)):
        return forward, backward, None, None
    paired_forward = Segment(
        index, overlap_ep(p_fwd, forward=True), stored_bytes=blk.stored_bytes, buffer_bytes=f_buf
    )
    paired_backward = Segment(
        index,
        pre + overlap_ep(p_bwd, forward=False),
        grad_from=len(pre),
        stored_bytes=blk.stored_bytes,
        transient_bytes=blk.transient_bytes,
        buffer_bytes=b_buf,
    )
    return forward, backward, paired_forward, paired_backward


def layer_segments(
    plan: Plan, index: int, blk: BlockTimes, comms: list[LayerComm], act_element_bytes: int
) -> tuple[Segment, Segment, Segment | None, Segment | None]:
    """The forward and backward segments :func:`build_stage` gives layer ``index`` of
    ``plan`` (block times ``blk``, EP / CP collectives ``comms``), and their paired forms
    under EP overlap (else None); what a search's bounds price per layer kind."""
    spec = plan.spec
    size = float(
        plan.training.micro_batch * spec.seq_len // plan.cp * spec.hidden * act_element_bytes
    )
    return sized_layer_segments(
        plan,
        index,
        blk,
        comms,
        size,
        full=str(plan.training.recompute) == "full",
        overlap=bool(plan.parallel.ep_overlap),
        tp_how=tp_overlap_for(plan),
    )


def head_segments(plan: Plan, head: BlockTimes, size: float) -> tuple[Segment, Segment]:
    """The forward and backward segments of the LM head: with TP, the sequence gather (SP),
    the three loss all-reduces and the input gradient's reduction."""
    comm, sp = plan.tp > 1, plan.parallel.sequence_parallel
    fsteps = [Step(head.forward_s)]
    bsteps = [Step(head.backward_s)]
    if comm:
        if sp:
            fsteps.insert(0, Step(op="all_gather", size_bytes=size))
            d = min(sum(head.column_dgrad_s), head.backward_s)
            bsteps = [
                Step(head.backward_s - d),
                Step(op="all_gather", size_bytes=size, overlap_s=d),
            ]
        fsteps += [Step(op="all_reduce", size_bytes=loss_bytes(plan))] * 3
        bsteps.append(Step(op="reduce_scatter" if sp else "all_reduce", size_bytes=size))
    return (
        Segment("head", fsteps, stored_bytes=head.stored_bytes),
        Segment("head", bsteps, stored_bytes=head.stored_bytes),
    )
