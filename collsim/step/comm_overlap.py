"""Collectives hidden under a layer's own compute: overlapped tensor parallelism and EP overlap.

Rewrites one layer pass so that its sequence-parallel collectives run under the GEMMs of its TP
linears (userbuffers or AsyncTP, with Transformer Engine's FP8 gathers) and, under
``parallel.ep_overlap``, its EP all-to-alls beside its compute (the paired form).
Derivations and sources: docs/tp_overlap.md and docs/derivations.md,
``collsim.step.comm_overlap``.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from collsim.core.vocab import ParallelAxis
from collsim.parallel.amax import tp_amax_reduce
from collsim.parallel.plan import Plan
from collsim.parallel.tp_overlap import USERBUFFERS, margin_factor, tp_overlap_of
from collsim.step.ops import Step

__all__ = [
    "TPOverlap",
    "overlap_tp",
    "tp_overlap_for",
    "PAIRED_AXES",
    "overlap_ep",
]


@dataclass(frozen=True, slots=True)
class TPOverlap:
    """How a layer's sequence-parallel collectives run (:func:`overlap_tp`)."""

    mode: str
    """``none``, ``userbuffers`` or ``async_tp`` (:mod:`collsim.parallel.tp_overlap`)."""
    tp: int
    margin: float = 1.0
    """Factor on a GEMM run beside a 16-SM userbuffers kernel with TE's SM margin."""
    fp8_gather: bool = False
    """Transformer Engine FP8: the inputs of the FP8 linears are quantized before the
    all-gather, which then moves 1 byte per element (module/linear.py at d0067d0)."""
    amax_reduce: bool = False
    """Current scaling under sequence parallelism: the amax of a column-parallel input
    (forward) and of a row-parallel output gradient (backward) is all-reduced over the TP
    group before the cast (one fp32 scalar; Transformer Engine module/linear.py l.352 and
    l.810-825 at d0067d0; torchao's float8 TP styles likewise:
    :func:`collsim.parallel.amax.tp_amax_reduce`)."""


_FWD_ROLES = {"all_gather": ("qkv_proj", "mlp_up"), "reduce_scatter": ("out_proj", "mlp_down")}


_BWD_ROLES = {
    "all_gather": ("mlp_down", "out_proj"),
    "regather": ("mlp_up", "qkv_proj"),
    "reduce_scatter": ("mlp_up", "qkv_proj"),
}


_FP8_GATHERED = frozenset(("qkv_proj", "mlp_up"))


def _ring(size: float, gemm_s: float, n: int, sms: int, *, gather: bool) -> list[Step]:
    """A point-to-point ring of ``n - 1`` steps of ``size / n`` bytes beside ``n`` GEMM
    pieces: the local piece last for a gather (its chunks arrive first), first for a
    scatter (docs/tp_overlap.md)."""
    piece = gemm_s / n
    sends = [Step(op="send_recv", size_bytes=size / n, overlap_s=piece, sms=sms)] * (n - 1)
    return [*sends, Step(piece)] if gather else [Step(piece), *sends]


def _pipelined(size: float, gemm_s: float, chunks: int) -> list[Step]:
    """TE's pipelined GEMM + reduce-scatter: the first piece alone, each reduce-scatter of a
    piece beside the next piece, the last one exposed (``gemm_s`` already on fewer SMs)."""
    piece = gemm_s / chunks
    calls = [Step(op="reduce_scatter", size_bytes=size / chunks, overlap_s=piece, sms=0)]
    return [Step(piece), *calls * (chunks - 1), Step(op="reduce_scatter", size_bytes=size / chunks)]


def overlap_tp(
    steps: list[Step],
    linears: tuple[tuple[str, float, float, float], ...],
    how: TPOverlap,
    *,
    forward: bool,
) -> list[Step]:
    """One pass of a layer with its sequence-parallel collectives overlapped with the GEMMs
    of its TP linears (docs/tp_overlap.md): every blocking all-gather before a column-parallel
    GEMM (forward) or a row-parallel dgrad (backward) becomes a ring under it; every
    reduce-scatter after a row-parallel GEMM a pipelined (userbuffers) or ring (AsyncTP)
    scatter; in backward the re-gather and the dgrad reduce-scatter of a column-parallel
    linear run beside its dgrad and wgrad (userbuffers' bulk overlap) or the gathered input is
    kept and the reduce-scatter rings under the dgrad (AsyncTP). A collective whose linear is
    not in ``linears`` (an MoE layer's MLP half) stays as it is."""
    times = {name: (f, d, w) for name, f, d, w in linears}
    out = list(steps)
    seen: dict[str, int] = {}
    i = 0
    while i < len(out):
        st = out[i]
        if not (st.op in ("all_gather", "reduce_scatter") and st.axis == ParallelAxis.TP):
            i += 1
            continue
        role = "regather" if (not forward and st.overlap_s > 0) else st.op
        k = seen.get(role, 0)
        seen[role] = k + 1
        names = (_FWD_ROLES if forward else _BWD_ROLES)[role]
        name = names[k] if k < len(names) else ""
        if name not in times:
            i += 1
            continue
        f, d, w = times[name]
        size = st.size_bytes
        if how.fp8_gather and name in _FP8_GATHERED and role in ("all_gather", "regather"):
            size /= 2
        new, i = _overlap_one(out, i, role, replace(st, size_bytes=size), (f, d, w), how, forward)
        if how.amax_reduce and role == "all_gather":  # the amax before the cast and gather
            new = [Step(op="all_reduce", size_bytes=4.0), *new]
        out[i : i + 1] = new
        i += len(new)
    return [st for st in out if st.op or st.seconds > 0]


def _overlap_one(
    out: list[Step],
    i: int,
    role: str,
    st: Step,
    fdw: tuple[float, float, float],
    how: TPOverlap,
    forward: bool,
) -> tuple[list[Step], int]:
    """The steps that replace ``out[i]`` (and the index they go at), taking the GEMM seconds
    they hide from the plain compute next to it."""
    f, d, w = fdw
    n, ub = how.tp, how.mode == "userbuffers"
    if how.mode == "none":
        return [st], i
    if role == "all_gather":  # a ring under the GEMM that follows
        g = _take(out, i + 1, f if forward else d)
        if g <= 0:
            return [st], i
        return _ring(st.size_bytes, g, n, 1 if ub else 0, gather=True), i
    if role == "reduce_scatter" and forward:  # the GEMM before it, in pieces
        g = _take(out, i - 1, f)
        if g <= 0:
            return [st], i
        if ub:
            return _pipelined(st.size_bytes, g * how.margin, 4), i
        return _ring(st.size_bytes, g, n, 0, gather=False), i
    if role == "regather":  # beside the column-parallel dgrad
        if ub:
            return [replace(st, overlap_s=st.overlap_s * how.margin, sms=0)], i
        return [Step(st.overlap_s)], i  # AsyncTP keeps the gathered input
    # backward reduce-scatter of the column-parallel dgrad output
    j = max((k for k in range(i) if not out[k].op and out[k].seconds > 0), default=-1)
    if ub:
        g = _take(out, j, w)
        if g <= 0:
            return [st], i
        return [replace(st, overlap_s=g * how.margin, sms=0)], i
    # AsyncTP: the dgrad (the plain step the re-gather became) in pieces, ring-scattered
    g = _take(out, i - 1, d)
    if g <= 0:
        return [st], i
    return _ring(st.size_bytes, g, n, 0, gather=False), i


def _take(out: list[Step], j: int, want_s: float) -> float:
    """Take ``want_s`` of GEMM seconds out of the plain compute step ``out[j]`` (none when it
    is not plain compute); what it lacks comes from the pass's largest other plain step (the
    even attention / MLP halves of :func:`collsim.step.layer_passes._split` only place the
    compute, the pass keeps its total). Returns the seconds taken."""
    have = _plain(out, j)
    if have <= 0 or want_s <= 0:
        return 0.0
    got = min(want_s, have)
    out[j] = Step(have - got)
    short = want_s - got
    others = [k for k in range(len(out)) if k != j and not out[k].op and out[k].seconds > 0]
    if short > 0 and others:
        k = max(others, key=lambda x: out[x].seconds)
        extra = min(short, out[k].seconds)
        out[k] = Step(out[k].seconds - extra)
        got += extra
    return got


def _plain(out: list[Step], j: int) -> float:
    """Seconds of ``out[j]`` if it is plain compute (0 otherwise or out of range)."""
    if 0 <= j < len(out) and not out[j].op:
        return out[j].seconds
    return 0.0


def tp_overlap_for(plan: Plan) -> TPOverlap | None:
    """How ``plan``'s layers run their sequence-parallel collectives (None: as blocking
    calls in 16-bit, the default): the ``parallel.tp_overlap`` mode and Transformer Engine's
    FP8 gathers (``megatron_te`` with ``dtype: fp8``)."""
    mode = tp_overlap_of(plan.parallel.tp_overlap_mode, plan.training.stack)
    fp8 = plan.training.stack == "megatron_te" and str(plan.training.dtype) == "fp8"
    amax = tp_amax_reduce(plan)
    if mode == "none" and not fp8 and not amax:
        return None
    return TPOverlap(
        mode=mode,
        tp=plan.tp,
        margin=margin_factor(plan.topology.device, USERBUFFERS["fprop_rs"].sms),
        fp8_gather=fp8,
        amax_reduce=amax,
    )


PAIRED_AXES = ("ep", "ep_node")
"""Axes of the all-to-alls the EP overlap hides: the whole exchange, or DeepEP's network leg
(its NVLink leg on ``ep_local`` beside it, ``Step.beside``, is hidden with it)."""


def _first_ep(items: list[Step | list[Step]]) -> int:
    """Index of the first EP all-to-all of a pass (its dispatch in forward, its combine in
    backward)."""
    return next(
        i
        for i, x in enumerate(items)
        if isinstance(x, Step) and x.axis in PAIRED_AXES and x.op == "all_to_all"
    )


def overlap_ep(steps: list[Step], *, forward: bool) -> list[Step]:
    """One pass of an MoE layer with its EP all-to-alls beside its own compute (the paired
    form in docs/derivations.md): the combine beside the nearest compute run on its expert
    side (the expert GEMMs: before it in forward, after it in backward), the dispatch beside
    the largest remaining run on its other side (attention, router, permute). A run is a
    stretch of consecutive compute steps; each run hides at most one all-to-all."""
    out: list[Step | list[Step]] = []
    for st in steps:  # runs of plain compute become lists
        if not st.op and out and isinstance(out[-1], list):
            out[-1].append(st)
        elif not st.op:
            out.append([st])
        else:
            out.append(st)
    order = ("ep_combine", "ep_dispatch")
    kinds = {
        i: ("ep_combine" if (i > _first_ep(out)) == forward else "ep_dispatch")
        for i, x in enumerate(out)
        if isinstance(x, Step) and x.axis in PAIRED_AXES and x.op == "all_to_all"
    }
    used: set[int] = set()
    for name in order:
        for i, kind in kinds.items():
            if kind != name:
                continue
            side = range(i - 1, -1, -1) if forward else range(i + 1, len(out))
            runs = {j: out[j] for j in side if j not in used}
            runs_s = {j: sum(x.seconds for x in r) for j, r in runs.items() if isinstance(r, list)}
            if not runs_s:
                continue
            j = next(iter(runs_s)) if name == "ep_combine" else max(runs_s, key=runs_s.__getitem__)
            used.update((i, j))
            a2a = out[i]
            assert isinstance(a2a, Step)
            run = out[j]
            assert isinstance(run, list)
            out[j] = [replace(a2a, overlap_s=sum(x.seconds for x in run))]
            out[i] = []
    flat: list[Step] = []
    for x in out:
        flat.extend(x if isinstance(x, list) else [x])
    return flat
