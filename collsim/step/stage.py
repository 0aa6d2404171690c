"""What one pipeline stage runs: per model chunk, the forward and backward segments.

:func:`build_stage` puts a stage's chunks together: the segments of the embedding, its layers
and the head (:mod:`collsim.step.layer_passes`), the chunk's parameter tensors, DDP buckets and
FSDP units, and, for a schedule that splits backward, the input- and weight-gradient segments.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable
from dataclasses import fields
from functools import partial
from operator import attrgetter
from typing import TYPE_CHECKING, Any

from collsim.parallel.buckets import (
    CutBuckets,
    PackedTensors,
    bucket_cuts,
    grad_ready_fraction,
    packed_tensors,
)
from collsim.parallel.fsdp import FSDPUnit, build_units
from collsim.parallel.params import ParamTensor, chunk_tensors
from collsim.parallel.plan import Plan
from collsim.step.comm_overlap import tp_overlap_for
from collsim.step.fp8_amax import ChunkAmax, attach_chunk_amax
from collsim.step.layer_passes import head_segments, sized_layer_segments
from collsim.step.ops import BlockTimes, ChunkModel, Segment, StageModel, Step

if TYPE_CHECKING:
    from collsim.parallel.layer_comms import LayerComm
    from collsim.step.shapes import ShapeCache

__all__ = [
    "LayerKinds",
    "LayerSegments",
    "build_stage",
    "rebucket_stage",
]


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
    amax: ChunkAmax | None = None,
    kinds: LayerKinds | None = None,
) -> StageModel:
    """The chunks of ``stage`` with their segments, tensors, DDP buckets and FSDP units.

    ``layer_of`` gives the block times of a layer index (its kind; default ``layer`` for
    all), ``comms_of`` its EP / CP collectives (default none); a ``cache`` shares the
    tensors, buckets and units of a chunk shape with other plans (:func:`_chunk_params`);
    ``amax`` the once-per-chunk steps of delayed FP8 scaling (:mod:`collsim.step.fp8_amax`);
    ``kinds`` the segments of each layer kind made so far (:func:`_layer_segments`), shared
    by the stages of one plan."""
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
    kinds = {} if kinds is None else kinds
    make = partial(sized_layer_segments, plan, size=size, full=full, overlap=overlap, tp_how=tp_how)
    entries: list[ChunkEntry] = []  # with a cache: each chunk's, for the stage's variants
    pp = plan.pp if plan.head_stage != 0 else 1  # a tied head's copy: not on the embedding's
    params = partial(
        _chunk_params, plan, pp=pp, grad_bytes=grad_bytes, cache=cache, entries=entries
    )
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
            f_seg, b_seg, f_alt, b_alt = _layer_segments(kinds, make, index, blk, comms)
            fwd.append(f_seg)
            bwd.append(b_seg)
            if f_alt is not None and b_alt is not None:
                alt[id(f_seg)], alt[id(b_seg)] = f_alt, b_alt
        if last:
            f_seg, b_seg = head_segments(plan, head, size)
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
        tensors, buckets, units, bucket_shape = params(layers, first=first, last=last)
        chunk = ChunkModel(
            index=c,
            layers=layers,
            tensors=tensors,
            forward=fwd,
            backward=head_seg + layer_bwd + emb_seg,
        )
        attach_chunk_amax(fwd, bwd, amax, alt)
        if alt:
            chunk.paired_forward = [alt.get(id(seg), seg) for seg in chunk.forward]
            chunk.paired_backward = [alt.get(id(seg), seg) for seg in chunk.backward]
        if split:
            _split_chunk(
                chunk, {"embedding": embedding, "head": head}, layer_of or (lambda _: layer)
            )
        chunk.buckets = buckets
        chunk.bucket_shape = bucket_shape
        chunk.units = units
        chunks.append(chunk)
    if cache is not None and chunks:  # what rebucket_stage reads for the stage's variants
        segments = chunks[0].forward
        cache.get("stage chunks", _stage_layout(plan, stage, segments), lambda: (segments, entries))
    return StageModel(stage=stage, chunks=chunks)


def rebucket_stage(
    plan: Plan, model: StageModel, *, grad_bytes: int, cache: ShapeCache | None = None
) -> StageModel:
    """``model`` (a stage built by :func:`build_stage` for a plan that differs from ``plan``
    only in its DDP knobs) with each chunk's DDP buckets made for ``plan``'s: the chunks are
    new, their segments, tensors and units the same objects (nothing changes them). With a
    ``cache``, what each chunk's buckets are cut from is looked up once for the stage's
    variants (by the identity of its first chunk's segments, which they share)."""
    pipeline, v = plan.pipeline_schedule, plan.virtual_stages
    pp = plan.pp if plan.head_stage != 0 else 1

    def ends(chunk: ChunkModel) -> tuple[bool, bool]:  # whether it is the model's first, last
        part = pipeline.part_of(model.stage, chunk.index, plan.pp, v)
        return part == 0, part == plan.pp * v - 1

    chunks = []
    if cache is None:
        for chunk in model.chunks:
            first, last = ends(chunk)
            _, buckets, _, bucket_shape = _chunk_params(
                plan, chunk.layers, first=first, last=last, pp=pp, grad_bytes=grad_bytes, cache=None
            )
            chunks.append(_rebucketed(chunk, buckets, bucket_shape))
        return StageModel(stage=model.stage, chunks=chunks, split_of=model.split_of)
    shapes: ShapeCache = cache

    def entries() -> list[ChunkEntry]:
        out = []
        for chunk in model.chunks:
            first, last = ends(chunk)
            out.append(
                _chunk_entry(plan, chunk.layers, first=first, last=last, pp=pp, cache=shapes)
            )
        return out

    segments = model.chunks[0].forward if model.chunks else None
    layout = _stage_layout(plan, model.stage, segments)
    held, known = cache.get("stage chunks", layout, lambda: (segments, entries()))
    if held is not segments:  # pragma: no cover - a reused address
        known = entries()
    for chunk, (shape, tensors, _, grads) in zip(model.chunks, known, strict=True):
        buckets, bucket_shape = _chunk_buckets(plan, shape, tensors, grads, grad_bytes, cache)
        chunks.append(_rebucketed(chunk, buckets, bucket_shape))
    return StageModel(stage=model.stage, chunks=chunks, split_of=model.split_of)


def _stage_layout(plan: Plan, stage: int, segments: list[Segment] | None) -> tuple[Any, ...]:
    """The key of a stage's chunk entries in a cache (the ``stage chunks`` table: what
    :func:`rebucket_stage` cuts each chunk's buckets from), by the identity of its first
    chunk's forward segments (the entry holds them) and what places its layers."""
    return (
        id(segments),
        stage,
        id(plan.spec),
        plan.tp,
        plan.pp,
        plan.virtual_stages,
        plan.ep,
        plan.etp,
    )


def _rebucketed(chunk: ChunkModel, buckets: CutBuckets, bucket_shape: Any) -> ChunkModel:
    """A copy of ``chunk`` with other buckets (and their shape)."""
    copy = ChunkModel(*_CHUNK_FIELDS(chunk))  # (dataclasses.replace, without its checks)
    copy.buckets = buckets
    copy.bucket_shape = bucket_shape
    return copy


_CHUNK_FIELDS = attrgetter(*[f.name for f in fields(ChunkModel)])
"""A chunk's fields in order (read from the dataclass: a new field is copied too)."""


LayerSegments = tuple[Segment, Segment, Segment | None, Segment | None]
"""A layer's forward and backward segments and their paired forms
(:func:`collsim.step.layer_passes.sized_layer_segments`)."""

LayerKinds = dict[tuple[int, tuple["LayerComm", ...]], tuple[BlockTimes, LayerSegments]]
"""The segments made for each layer kind of a plan, by (id of its block times, its EP / CP
collectives), with the block times kept (:func:`_layer_segments`)."""


def _layer_segments(
    kinds: LayerKinds,
    make: Callable[[int, BlockTimes, list[LayerComm]], LayerSegments],
    index: int,
    blk: BlockTimes,
    comms: list[LayerComm],
) -> LayerSegments:
    """The segments of layer ``index`` (block times ``blk``, EP / CP collectives ``comms``)
    from those ``kinds`` holds for its kind, made by ``make(index, blk, comms)`` for the
    first layer of the kind. Layers of a kind differ only in their key (a layer's segments
    depend on its block times and collectives, not its index), so each gets new segments
    (updated one by one later: framework work, FP8 amax steps) over the same steps (frozen,
    in lists never changed in place); those made for the kind stay private."""
    kind = (id(blk), tuple(comms))
    known = kinds.get(kind)
    if known is None or known[0] is not blk:  # (the block kept: its id stays its own)
        known = kinds[kind] = (blk, make(index, blk, comms))
    made = known[1]
    return (
        _keyed(made[0], index),
        _keyed(made[1], index),
        None if made[2] is None else _keyed(made[2], index),
        None if made[3] is None else _keyed(made[3], index),
    )


def _keyed(seg: Segment, index: int) -> Segment:
    """``seg`` for layer ``index``: its fields but the key, its step list shared."""
    return Segment(index, *_ALL_BUT_KEY(seg))


_ALL_BUT_KEY = attrgetter(*[f.name for f in fields(Segment)][1:])
"""A segment's fields after its key, in order (read from the dataclass: a new field is
copied too)."""


def _chunk_params(
    plan: Plan,
    layers: range,
    *,
    first: bool,
    last: bool,
    pp: int,
    grad_bytes: int,
    cache: ShapeCache | None,
    entries: list[ChunkEntry] | None = None,
) -> tuple[list[ParamTensor], CutBuckets, list[FSDPUnit], BucketShape | None]:
    """A chunk's tensors, DDP buckets, FSDP units (made once per chunk shape in a ``cache``;
    the lists are shared then, and nothing changes them) and, with a ``cache``, its buckets'
    shape (:data:`BucketShape`); with a ``cache``, its :func:`_chunk_entry` appended to
    ``entries``."""
    if cache is None:
        tensors = chunk_tensors(
            plan.spec, layers, tp=plan.tp, first=first, last=last, pp=pp, ep=plan.ep, etp=plan.etp
        )
        buckets, _ = _buckets(plan, tensors, grad_bytes)
        return tensors, buckets, build_units(tensors), None
    entry = _chunk_entry(plan, layers, first=first, last=last, pp=pp, cache=cache)
    if entries is not None:
        entries.append(entry)
    shape, tensors, units, grads = entry
    buckets, bucket_shape = _chunk_buckets(plan, shape, tensors, grads, grad_bytes, cache)
    return tensors, buckets, units, bucket_shape


ChunkEntry = tuple[tuple[Any, ...], list[ParamTensor], list[FSDPUnit], "ChunkGrads"]
"""A chunk shape's key in a cache, its tensors, FSDP units and gradients
(:func:`_chunk_entry`)."""


def _chunk_entry(
    plan: Plan, layers: range, *, first: bool, last: bool, pp: int, cache: ShapeCache
) -> ChunkEntry:
    """A chunk shape's key, tensors, FSDP units and what every bucket size packs of its
    gradients (:func:`_grads_of`), made once per chunk shape in ``cache``: keyed by the spec's
    identity (hashing a spec costs more than the lookup saves); the entry holds the spec, so
    a key is never reused by another spec while it lives."""
    spec = plan.spec

    def tensors_of() -> list[ParamTensor]:
        return chunk_tensors(
            spec, layers, tp=plan.tp, first=first, last=last, pp=pp, ep=plan.ep, etp=plan.etp
        )

    shape = (id(spec), layers.start, layers.stop, plan.tp, first, last, pp, plan.ep, plan.etp)
    held, tensors, units, grads = cache.get(
        "chunk",
        shape,
        lambda: (spec, t := tensors_of(), build_units(t), _grads_of(t, layers.start, cache)),
    )
    if held is not spec:  # pragma: no cover - another spec at a reused address
        tensors = tensors_of()
        units = build_units(tensors)
        grads = _grads_of(tensors, layers.start, cache)
    return shape, tensors, units, grads


def _chunk_buckets(
    plan: Plan,
    shape: tuple[Any, ...],
    tensors: list[ParamTensor],
    grads: ChunkGrads,
    grad_bytes: int,
    cache: ShapeCache,
) -> tuple[CutBuckets, BucketShape | None]:
    """The buckets of the chunk shape ``shape`` (:func:`_chunk_entry`) for ``plan``'s bucket
    knobs, and their shape, made once per both in ``cache`` (every bucket size's pieces are
    kept with the chunk shape)."""
    spec = plan.spec
    ddp = plan.parallel.ddp
    key = (shape, ddp.bucket_mb, ddp.first_bucket_mb, grad_bytes)
    made = cache.table("buckets")  # (read as ShapeCache.get does, without a closure per call)
    hit = made.get(key)
    if hit is None:
        hit = made[key] = (spec, _buckets(plan, tensors, grad_bytes, grads, cache))
    if hit[0] is not spec:  # pragma: no cover - as above
        return _buckets(plan, tensors, grad_bytes, grads, cache)
    out: tuple[CutBuckets, BucketShape | None] = hit[1]
    return out


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
            buffer_bytes=seg.buffer_bytes,
        ),
        Segment(seg.key, [Step(wgrad)], stored_bytes=held),
    )


ChunkGrads = tuple[tuple[bool | None, PackedTensors, Any, int], ...]
"""What every bucket size packs of a chunk's gradients (:func:`_grads_of`)."""

BucketShape = tuple[tuple[bool | None, int, int], ...]
"""What a chunk's buckets are made of, as numbers (:func:`_buckets`): per kind of bucket,
the kind, the cuts' number and the packed tensors' number. Chunks with equal shapes have
buckets alike in everything but their tensors' names and their layers' numbers (the same
elements, bytes, ready fractions and ready segments counted from the chunk's first layer);
the walk shares their reductions (:meth:`collsim.play.walker.Walker.op_plans`)."""

_SHAPE_NUMBERS = itertools.count()
"""The numbers of :data:`BucketShape` (unique in the process, so never equal for two
shapes of two caches)."""


def _grads_of(
    tensors: list[ParamTensor], first_layer: int = 0, cache: ShapeCache | None = None
) -> ChunkGrads:
    """What every bucket size packs of a chunk's gradients: per kind of bucket (the dense and
    the expert gradients bucket apart, or all as one), the kind, the tensors it packs
    (:func:`~collsim.parallel.buckets.packed_tensors`), their form (the packed elements
    with their types: equal ints and floats cut alike, but make buckets of their own type;
    with a ``cache``, a number for it, equal for equal forms, that keys the cuts without
    hashing the elements) and, with a ``cache``, a number for their ready fractions and
    segments (a layer's counted from ``first_layer``, the chunk's first), equal for alike
    chunks (-1 without)."""
    kinds: tuple[bool | None, ...] = (False, True) if any(t.expert for t in tensors) else (None,)
    ready = grad_ready_fraction(tensors)
    out = []
    for kind in kinds:
        packed = packed_tensors(tensors, expert=kind, ready=ready)
        number = -1
        form: Any = (packed.numels, tuple(map(type, packed.numels)))
        if cache is not None:
            segments = tuple([s - first_layer if type(s) is int else s for s in packed.segments])
            alike = (packed.ready, segments)
            number = cache.get("packed shapes", alike, partial(next, _SHAPE_NUMBERS))
            form = cache.get("packed forms", form, partial(next, _SHAPE_NUMBERS))
        out.append((kind, packed, form, number))
    return tuple(out)


def _buckets(
    plan: Plan,
    tensors: list[ParamTensor],
    grad_bytes: int,
    grads: ChunkGrads | None = None,
    cache: ShapeCache | None = None,
) -> tuple[CutBuckets, BucketShape | None]:
    """A chunk's DDP buckets (``grads``: its :func:`_grads_of`, worked out here when not
    given; made when first read, :class:`~collsim.parallel.buckets.CutBuckets`) and, with a
    ``cache``, their shape (:data:`BucketShape`); a ``cache`` keeps the cuts by the packed
    tensors' form and the bucket knobs, so the chunks of one form (a model's repeated
    layers) are cut once."""
    grads = _grads_of(tensors) if grads is None else grads
    ddp = plan.parallel.ddp
    mb, first_mb = ddp.bucket_mb, ddp.first_bucket_mb
    pieces: list[tuple[PackedTensors, Any, bool | None]] = []
    shape: list[tuple[bool | None, int, int]] = []
    known = None if cache is None else cache.table("bucket cuts")
    alike = cache is not None
    for kind, packed, form, packed_number in grads:
        if known is None:
            cuts = bucket_cuts(
                packed.numels, bucket_mb=mb, first_bucket_mb=first_mb, grad_bytes=grad_bytes
            )
        else:
            key = (form, mb, first_mb, grad_bytes)
            hit = known.get(key)
            if hit is None:
                cut = bucket_cuts(
                    packed.numels, bucket_mb=mb, first_bucket_mb=first_mb, grad_bytes=grad_bytes
                )
                hit = known[key] = (cut, next(_SHAPE_NUMBERS))
            cuts, cuts_number = hit
            shape.append((kind, cuts_number, packed_number))
            alike = alike and packed_number >= 0
        pieces.append((packed, cuts, kind))
    return CutBuckets(pieces), (tuple(shape) if alike else None)
