"""What one pipeline stage runs: per model chunk, the forward and backward segments.

Derivations, measurements and sources: docs/derivations.md, ``collsim.step.ops``.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING

from collsim.core.vocab import ParallelAxis
from collsim.parallel.buckets import Bucket, build_buckets
from collsim.parallel.fsdp import FSDPUnit, build_units
from collsim.parallel.params import ParamTensor, chunk_tensors
from collsim.parallel.plan import Plan
from collsim.parallel.tp_overlap import USERBUFFERS, margin_factor, tp_overlap_of

if TYPE_CHECKING:
    from collsim.parallel.layer_comms import LayerComm
    from collsim.step.shapes import ShapeCache

__all__ = [
    "Step",
    "Segment",
    "ChunkModel",
    "StageModel",
    "build_stage",
    "BlockTimes",
    "loss_bytes",
    "layer_segments",
]


@dataclass(frozen=True, slots=True)
class Step:
    """One compute step (``op`` empty) or one blocking collective (``op`` set) on the group of
    ``axis`` (tp, ep, etp or cp)."""

    seconds: float = 0.0
    op: str = ""
    size_bytes: float = 0.0
    overlap_s: float = 0.0
    """Compute that runs alongside this collective (``op`` set): the compute stream is busy for
    max(collective, overlap_s) and the collective is exposed only beyond ``overlap_s``."""
    axis: str = ParallelAxis.TP
    """The plan axis of the collective's group (``send_recv`` on cp: one ring step)."""
    beside: tuple[Step, ...] = ()
    """Collectives on other groups that run at the same time as this one (DeepEP's NVLink leg
    beside its network leg): the step lasts as long as the slowest of them."""
    sms: int | None = None
    """SMs the collective's kernels hold while compute runs beside it (None: the default of
    its axis; an overlapped TP chunk names its own, :mod:`collsim.parallel.tp_overlap`)."""

    def calls(self) -> tuple[Step, ...]:
        """This step's collective and those beside it (each a call on its own group)."""
        return (self, *self.beside) if self.beside else (self,)


@dataclass(slots=True)
class Segment:
    """One unit of work: ``"embedding"``, a layer index, or ``"head"``."""

    key: str | int
    steps: list[Step]
    grad_from: int = 0
    """Index of the first step that produces gradients (after the recomputed forward)."""
    stored_bytes: float = 0.0
    """Activations kept from this segment's forward until its backward, per micro-batch."""
    transient_bytes: float = 0.0
    """Activations rebuilt during this segment's backward (recompute), freed at its end."""
    framework_s: float = 0.0
    """Framework work on the compute stream in this segment (FSDP copy-in / copy-out of the
    gathered unit, gradient cast and copy-out of its reduced shard), accounted apart."""
    frees: bool = True
    """A backward segment frees its activations at its end (an input-gradient segment of a
    split backward keeps them for its weight-gradient segment, which frees them)."""

    @property
    def compute_s(self) -> float:
        return sum(s.overlap_s if s.op else s.seconds for s in self.steps)

    def activation_events(
        self, start_s: float, end_s: float, *, forward: bool
    ) -> list[tuple[float, float, str, str | int]]:
        """``(time_s, delta_bytes, kind, key)`` of this segment's activations when it runs
        from ``start_s`` to ``end_s``: forward keeps its stored activations at its end;
        backward rebuilds the transient ones at its start and frees both at its end."""
        if forward:
            return [(end_s, self.stored_bytes, "act", self.key)] if self.stored_bytes else []
        out: list[tuple[float, float, str, str | int]] = []
        if self.transient_bytes:
            out.append((start_s, self.transient_bytes, "recompute", self.key))
        if self.frees and self.transient_bytes + self.stored_bytes:
            out.append((end_s, -(self.transient_bytes + self.stored_bytes), "free", self.key))
        return out


@dataclass(slots=True)
class ChunkModel:
    """One model chunk of a stage."""

    index: int
    layers: range
    tensors: list[ParamTensor]
    forward: list[Segment]
    backward: list[Segment]
    buckets: list[Bucket] = field(default_factory=list)
    units: list[FSDPUnit] = field(default_factory=list)
    paired_forward: list[Segment] | None = None
    """With ``parallel.ep_overlap``: the forward segments of a paired (steady-state) op, the
    EP all-to-alls beside compute (docs/derivations.md); the other segments are shared."""
    paired_backward: list[Segment] | None = None
    input_grad: list[Segment] | None = None
    """With a schedule that splits backward: the input-gradient segments (the backward with
    the weight-gradient GEMMs taken out; they keep the activations)."""
    weight_grad: list[Segment] | None = None
    """With a schedule that splits backward: the weight-gradient segments (the weight-gradient
    GEMMs; they free the activations and make the gradients ready)."""

    @property
    def numel(self) -> float:
        return sum(t.numel for t in self.tensors)

    def segments(self, phase: str, paired: bool = False) -> list[Segment]:
        """The segments of one op of this chunk in ``phase`` (a
        :class:`~collsim.core.vocab.PipelinePhase`; ``paired``: a steady-state op under EP
        overlap)."""
        forward = phase == "F"
        if paired:
            alt = self.paired_forward if forward else self.paired_backward
            if alt is not None and (forward or phase == "B"):
                return alt
        if forward:
            return self.forward
        if phase == "B":
            return self.backward
        split = self.input_grad if phase == "I" else self.weight_grad
        if split is None:
            raise ValueError(f"chunk {self.index} has no split backward (phase {phase})")
        return split

    @property
    def has_root(self) -> bool:
        """Holds both the embedding and the head (FSDP's root unit: pp = 1)."""
        segs = {t.segment for t in self.tensors}
        return "embedding" in segs and "head" in segs


@dataclass(slots=True)
class StageModel:
    stage: int
    chunks: list[ChunkModel]

    @property
    def numel(self) -> float:
        return sum(c.numel for c in self.chunks)


@dataclass(frozen=True, slots=True)
class BlockTimes:
    """Seconds of one block for one micro-batch, and the activations it keeps."""

    forward_s: float
    backward_s: float
    recompute_s: float = 0.0
    stored_bytes: float = 0.0
    transient_bytes: float = 0.0
    column_dgrad_s: tuple[float, ...] = ()
    """Input-gradient (dgrad) seconds of the block's column-parallel linears in backward
    order (layer: MLP up, then QKV; head: the LM head): what hides the SP all-gather."""
    attention_s: tuple[float, float] = (0.0, 0.0)
    """Core attention seconds (forward, backward): what hides the CP ring steps."""
    experts_s: tuple[float, float] = (0.0, 0.0)
    """Routed-expert GEMM seconds (forward, backward): between dispatch and combine."""
    wgrad_s: float = 0.0
    """Weight-gradient seconds inside ``backward_s`` (the dB GEMMs of the block's linears:
    :attr:`collsim.workload.compute.LayerTimes.wgrad_s`)."""
    fp8_weights: tuple[float, float, int] = (0.0, 0.0, 0)
    """FP8 weight elements (non-expert, expert) and FP8 linears of the block, with Transformer
    Engine's casts (:attr:`collsim.workload.compute.LayerTimes.fp8_weights`)."""
    linears_s: tuple[tuple[str, float, float, float], ...] = ()
    """(name, forward, dgrad, wgrad seconds) per TP linear (``qkv_proj``, ``out_proj``,
    ``mlp_up``, ``mlp_down``) of the block: what overlapped tensor parallelism chunks
    (:mod:`collsim.parallel.tp_overlap`)."""


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
    """Transformer Engine current scaling under sequence parallelism: the amax of a
    column-parallel input (forward) and of a row-parallel output gradient (backward) is
    all-reduced over the TP group before the cast (one fp32 scalar; module/linear.py l.352
    and l.810-825 at d0067d0)."""


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
    even attention / MLP halves of :func:`_split` only place the compute, the pass keeps its
    total). Returns the seconds taken."""
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


def _overlap_ep(steps: list[Step], *, forward: bool) -> list[Step]:
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
        if isinstance(x, Step) and x.axis in _PAIRED_AXES and x.op == "all_to_all"
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


_PAIRED_AXES = ("ep", "ep_node")
"""Axes of the all-to-alls the EP overlap hides: the whole exchange, or DeepEP's network leg
(its NVLink leg on ``ep_local`` beside it, ``Step.beside``, is hidden with it)."""


def _first_ep(items: list[Step | list[Step]]) -> int:
    """Index of the first EP all-to-all of a pass (its dispatch in forward, its combine in
    backward)."""
    return next(
        i
        for i, x in enumerate(items)
        if isinstance(x, Step) and x.axis in _PAIRED_AXES and x.op == "all_to_all"
    )


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
    for i, st in enumerate(steps):
        if i == attn_i and (cp or cp_extra[phase]):
            out += _cp_steps(
                st.seconds, cp, block.attention_s[phase], cp_extra[phase], forward=forward
            )
        elif i == mlp_i and ep:
            out += _ep_steps(st.seconds, ep, block.experts_s[phase], forward=forward)
        else:
            out.append(st)
    return [st for st in out if st.op or st.seconds > 0]


def _cp_imbalance(plan: Plan, block: BlockTimes) -> tuple[float, float]:
    """Extra core-attention seconds (forward, backward) of the busiest CP rank without causal
    load balancing: (2 cp - 1) / cp times the mean, minus the mean (docs/derivations.md)."""
    cp = plan.cp
    if cp < 2 or plan.parallel.cp_load_balance:
        return (0.0, 0.0)
    f = (cp - 1) / cp
    return (block.attention_s[0] * f, block.attention_s[1] * f)


def loss_bytes(plan: Plan) -> float:
    """One vocab-parallel cross-entropy all-reduce: ``micro_batch x seq / cp`` fp32 values
    (Megatron-LM ``_VocabParallelCrossEntropy``: max, predicted logit, sum of exponentials)."""
    return float(plan.training.micro_batch * plan.spec.seq_len // plan.cp * 4)


def build_stage(
    plan: Plan,
    stage: int,
    *,
    layer: BlockTimes,
    embedding: BlockTimes,
    head: BlockTimes,
    grad_bytes: int,
    act_element_bytes: int,
    layer_of: Callable[[int], BlockTimes] | None = None,
    comms_of: Callable[[int], list[LayerComm]] | None = None,
    cache: ShapeCache | None = None,
) -> StageModel:
    """The chunks of ``stage`` with their segments, tensors, DDP buckets and FSDP units.

    ``layer_of`` gives the block times of a layer index (its kind; default ``layer`` for
    all), ``comms_of`` its EP / CP collectives (default none); a ``cache`` shares the
    tensors, buckets and units of a chunk shape with other plans (:func:`_chunk_params`)."""
    spec = plan.spec
    tp, sp = plan.tp, plan.parallel.sequence_parallel
    # a CP rank holds s / cp tokens: its TP messages are b (s / cp) h
    size = float(
        plan.training.micro_batch * spec.seq_len // plan.cp * spec.hidden * act_element_bytes
    )
    comm = tp > 1
    full = str(plan.training.recompute) == "full"
    chunks: list[ChunkModel] = []
    v = plan.virtual_stages
    overlap = bool(plan.parallel.ep_overlap)
    pipeline = plan.pipeline_schedule
    split = pipeline.splits_backward
    tp_how = tp_overlap_for(plan)
    for c in range(v):
        alt: dict[int, Segment] = {}  # a segment -> its paired form (EP overlap)
        layers = plan.chunk_layers(stage, c)
        part = pipeline.part_of(stage, c, plan.pp, v)
        first = part == 0
        last = part == plan.pp * v - 1
        fwd: list[Segment] = []
        bwd: list[Segment] = []
        if first:
            steps = [Step(embedding.forward_s)]
            if comm:
                steps.append(Step(op="reduce_scatter" if sp else "all_reduce", size_bytes=size))
            fwd.append(Segment("embedding", steps, stored_bytes=embedding.stored_bytes))
        for index in layers:
            blk = layer if layer_of is None else layer_of(index)
            comms = comms_of(index) if comms_of is not None else []
            f_seg, b_seg, f_alt, b_alt = _layer_segments(
                plan, index, blk, comms, size, full=full, overlap=overlap, tp_how=tp_how
            )
            fwd.append(f_seg)
            bwd.append(b_seg)
            if f_alt is not None and b_alt is not None:
                alt[id(f_seg)], alt[id(b_seg)] = f_alt, b_alt
        if last:
            f_seg, b_seg = _head_segments(plan, head, size)
            fwd.append(f_seg)
            bwd.insert(0, b_seg)
        if first:
            bwd.append(
                Segment(
                    "embedding", [Step(embedding.backward_s)], stored_bytes=embedding.stored_bytes
                )
            )
        # layers run high to low in backward
        layer_bwd = sorted((s for s in bwd if isinstance(s.key, int)), key=lambda s: -int(s.key))
        head_seg = [s for s in bwd if s.key == "head"]
        emb_seg = [s for s in bwd if s.key == "embedding"]
        # a tied head needs its own copy only on another stage than the embedding
        pp = plan.pp if plan.head_stage != 0 else 1
        tensors, buckets, units = _chunk_params(
            plan, layers, first=first, last=last, pp=pp, grad_bytes=grad_bytes, cache=cache
        )
        chunk = ChunkModel(
            index=c,
            layers=layers,
            tensors=tensors,
            forward=fwd,
            backward=head_seg + layer_bwd + emb_seg,
        )
        if alt:
            chunk.paired_forward = [alt.get(id(seg), seg) for seg in chunk.forward]
            chunk.paired_backward = [alt.get(id(seg), seg) for seg in chunk.backward]
        if split:
            _split_chunk(
                chunk, {"embedding": embedding, "head": head}, layer_of or (lambda _: layer)
            )
        chunk.buckets = buckets
        chunk.units = units
        chunks.append(chunk)
    return StageModel(stage=stage, chunks=chunks)


def _chunk_params(
    plan: Plan,
    layers: range,
    *,
    first: bool,
    last: bool,
    pp: int,
    grad_bytes: int,
    cache: ShapeCache | None,
) -> tuple[list[ParamTensor], list[Bucket], list[FSDPUnit]]:
    """A chunk's tensors, DDP buckets and FSDP units (made once per chunk shape in a
    ``cache``; the lists are shared then, and nothing changes them)."""
    spec = plan.spec

    def tensors_of() -> list[ParamTensor]:
        return chunk_tensors(
            spec, layers, tp=plan.tp, first=first, last=last, pp=pp, ep=plan.ep, etp=plan.etp
        )

    if cache is None:
        tensors = tensors_of()
        return tensors, _buckets(plan, tensors, grad_bytes), build_units(tensors)
    # keyed by the spec's identity (hashing a spec costs more than the lookup saves); the
    # entry holds the spec, so a key is never reused by another spec while it lives
    shape = (id(spec), layers.start, layers.stop, plan.tp, first, last, pp, plan.ep, plan.etp)
    held, tensors, units = cache.get(
        "chunk", shape, lambda: (spec, t := tensors_of(), build_units(t))
    )
    if held is not spec:  # pragma: no cover - another spec at a reused address
        tensors = tensors_of()
        units = build_units(tensors)
    ddp = plan.parallel.ddp
    key = (shape, ddp.bucket_mb, ddp.first_bucket_mb, grad_bytes)
    held_b, buckets = cache.get("buckets", key, lambda: (spec, _buckets(plan, tensors, grad_bytes)))
    if held_b is not spec:  # pragma: no cover - as above
        buckets = _buckets(plan, tensors, grad_bytes)
    return tensors, buckets, units


def _layer_segments(
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
    layer, their paired forms too (:func:`_overlap_ep`; else None)."""
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
    forward = Segment(index, fsteps_l, stored_bytes=blk.stored_bytes)
    backward = Segment(
        index,
        pre + bsteps_l,
        grad_from=len(pre),
        stored_bytes=blk.stored_bytes,
        transient_bytes=blk.transient_bytes,
    )
    if not (overlap and any(c.axis in _PAIRED_AXES and c.op == "all_to_all" for c in f_comms)):
        return forward, backward, None, None
    paired_forward = Segment(index, _overlap_ep(p_fwd, forward=True), stored_bytes=blk.stored_bytes)
    paired_backward = Segment(
        index,
        pre + _overlap_ep(p_bwd, forward=False),
        grad_from=len(pre),
        stored_bytes=blk.stored_bytes,
        transient_bytes=blk.transient_bytes,
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
    return _layer_segments(
        plan,
        index,
        blk,
        comms,
        size,
        full=str(plan.training.recompute) == "full",
        overlap=bool(plan.parallel.ep_overlap),
        tp_how=tp_overlap_for(plan),
    )


def tp_overlap_for(plan: Plan) -> TPOverlap | None:
    """How ``plan``'s layers run their sequence-parallel collectives (None: as blocking
    calls in 16-bit, the default): the ``parallel.tp_overlap`` mode and Transformer Engine's
    FP8 gathers (``megatron_te`` with ``dtype: fp8``)."""
    mode = tp_overlap_of(plan.parallel.tp_overlap_mode, plan.training.stack)
    fp8 = plan.training.stack == "megatron_te" and str(plan.training.dtype) == "fp8"
    if mode == "none" and not fp8:
        return None
    return TPOverlap(
        mode=mode,
        tp=plan.tp,
        margin=margin_factor(plan.topology.device, USERBUFFERS["fprop_rs"].sms),
        fp8_gather=fp8,
        amax_reduce=fp8 and str(plan.training.fp8_recipe or "tensorwise") == "tensorwise",
    )


def _head_segments(plan: Plan, head: BlockTimes, size: float) -> tuple[Segment, Segment]:
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


def _split_chunk(
    chunk: ChunkModel, blocks: dict[str, BlockTimes], layer_of: Callable[[int], BlockTimes]
) -> None:
    """Set ``chunk``'s input- and weight-gradient segments (:func:`_split_backward`)."""
    pairs = [
        _split_backward(seg, blocks.get(str(seg.key)) or layer_of(int(seg.key)))
        for seg in chunk.backward
    ]
    chunk.input_grad = [i for i, _ in pairs]
    chunk.weight_grad = [w for _, w in pairs]


def _split_backward(seg: Segment, block: BlockTimes) -> tuple[Segment, Segment]:
    """A backward segment as its input-gradient and weight-gradient segments (Qi et al. 2024,
    section 2): the weight-gradient GEMMs (``block.wgrad_s``, the whole backward of the
    embedding, a lookup with no input gradient) leave the segment's compute steps in
    proportion and form the weight-gradient segment; collectives, recompute and the compute
    beside an overlapped collective stay with the input gradient. The input-gradient segment
    rebuilds the recomputed activations and keeps everything; the weight-gradient segment
    frees it (and its gradients are what data parallelism waits for)."""
    grad = seg.steps[seg.grad_from :]
    plain = sum(st.seconds for st in grad if not st.op)
    wgrad = plain if seg.key == "embedding" else min(block.wgrad_s, plain)
    keep = 1.0 - wgrad / plain if plain > 0 else 1.0
    steps = seg.steps[: seg.grad_from] + [
        st if st.op else Step(st.seconds * keep, axis=st.axis) for st in grad
    ]
    held = seg.stored_bytes + seg.transient_bytes
    return (
        Segment(
            seg.key,
            [st for st in steps if st.op or st.seconds > 0],
            grad_from=seg.grad_from,
            stored_bytes=seg.stored_bytes,
            transient_bytes=seg.transient_bytes,
            frees=False,
        ),
        Segment(seg.key, [Step(wgrad)], stored_bytes=held),
    )


def _buckets(plan: Plan, tensors: list[ParamTensor], grad_bytes: int) -> list[Bucket]:
    """A chunk's DDP buckets: the dense and the expert gradients bucket apart."""
    ddp = plan.parallel.ddp
    kinds: tuple[bool | None, ...] = (False, True) if any(t.expert for t in tensors) else (None,)
    return [
        b
        for kind in kinds
        for b in build_buckets(
            tensors,
            bucket_mb=ddp.bucket_mb,
            first_bucket_mb=ddp.first_bucket_mb,
            grad_bytes=grad_bytes,
            expert=kind,
        )
    ]
