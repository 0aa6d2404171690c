"""What one pipeline stage runs: per model chunk, the forward and backward segments.

A segment is the work of one FSDP unit / one backward gradient segment: the input embedding,
one transformer layer, or the final norm + LM head + loss. It is a list of steps on the compute
stream: compute (seconds, from the workload's roofline) and blocking tensor-parallel
collectives. Megatron-LM places them (Shoeybi et al. 2019; Korthikanti et al. 2022, Fig. 5):

- layer forward: attention, all-reduce, MLP, all-reduce (with sequence parallelism each becomes
  an all-gather before the block and a reduce-scatter after it);
- layer backward: the same two collectives again (the conjugate f/g operators); a full
  recompute first re-runs the forward, collectives included; selective recompute re-runs only
  the core attention (no communication);
- embedding forward: vocab-parallel lookup, all-reduce (reduce-scatter with SP);
- LM head: input all-gather with SP in forward; input-gradient all-reduce (reduce-scatter with
  SP) in backward.
- sequence parallelism, backward of every column-parallel linear (QKV, MLP up, LM head): the
  layer saved only its sequence-sharded input, so backward all-gathers it again to compute the
  weight gradient (Korthikanti et al. 2022, section 4.2.2; Megatron-LM's
  ``LinearWithGradAccumulationAndAsyncCommunication.backward``). Megatron launches that
  all-gather asynchronously and computes the input gradient (the dgrad GEMM, half of the
  linear's backward FLOPs) meanwhile, so the step is ``Step(op="all_gather",
  overlap_s=dgrad)``: the compute stream is busy for max(all-gather, dgrad) and only the excess
  is exposed. The reduce-scatter of the input gradient, which Megatron overlaps with the wgrad
  GEMM, stays blocking here.
- vocab-parallel cross-entropy on the last stage (Megatron-LM's ``_VocabParallelCrossEntropy``):
  three all-reduces over the TP group of ``micro_batch x seq`` fp32 values in the loss forward
  (the logit maximum, the predicted logit, the sum of exponentials).

Tensor-parallel messages are ``micro_batch x seq x hidden`` activations in the compute dtype.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from collsim.parallel.buckets import Bucket, build_buckets
from collsim.parallel.fsdp import FSDPUnit, build_units
from collsim.parallel.params import ParamTensor, chunk_tensors
from collsim.parallel.plan import Plan

__all__ = ["Step", "Segment", "ChunkModel", "StageModel", "build_stage", "BlockTimes", "loss_bytes"]


@dataclass(frozen=True, slots=True)
class Step:
    """One compute step (``op`` empty) or one blocking TP collective (``op`` set)."""

    seconds: float = 0.0
    op: str = ""
    size_bytes: float = 0.0
    overlap_s: float = 0.0
    """Compute that runs alongside this collective (``op`` set): the compute stream is busy for
    max(collective, overlap_s) and the collective is exposed only beyond ``overlap_s``."""


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

    @property
    def compute_s(self) -> float:
        return sum(s.overlap_s if s.op else s.seconds for s in self.steps)


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

    @property
    def numel(self) -> float:
        return sum(t.numel for t in self.tensors)

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


def loss_bytes(plan: Plan) -> float:
    """One vocab-parallel cross-entropy all-reduce: ``micro_batch x seq`` fp32 values
    (Megatron-LM ``_VocabParallelCrossEntropy``: max, predicted logit, sum of exponentials)."""
    return float(plan.training.micro_batch * plan.spec.seq_len * 4)


def build_stage(
    plan: Plan,
    stage: int,
    *,
    layer: BlockTimes,
    embedding: BlockTimes,
    head: BlockTimes,
    grad_bytes: int,
    act_element_bytes: int,
) -> StageModel:
    """The chunks of ``stage`` with their segments, tensors, DDP buckets and FSDP units."""
    spec = plan.spec
    tp, sp = plan.tp, plan.parallel.sequence_parallel
    size = float(plan.training.micro_batch * spec.seq_len * spec.hidden * act_element_bytes)
    comm = tp > 1
    full = str(plan.training.recompute) == "full"
    chunks: list[ChunkModel] = []
    v = plan.virtual_stages
    for c in range(v):
        layers = plan.chunk_layers(stage, c)
        first = stage == 0 and c == 0
        last = stage == plan.pp - 1 and c == v - 1
        fwd: list[Segment] = []
        bwd: list[Segment] = []
        if first:
            steps = [Step(embedding.forward_s)]
            if comm:
                steps.append(Step(op="reduce_scatter" if sp else "all_reduce", size_bytes=size))
            fwd.append(Segment("embedding", steps, stored_bytes=embedding.stored_bytes))
        for index in layers:
            fwd.append(
                Segment(
                    index,
                    _split(layer.forward_s, comm, size, sp=sp),
                    stored_bytes=layer.stored_bytes,
                )
            )
            pre = (
                _split(layer.recompute_s, comm, size, sp=sp)
                if full
                else ([Step(layer.recompute_s)] if layer.recompute_s else [])
            )
            bsteps = _split(
                layer.backward_s,
                comm,
                size,
                sp=sp,
                dgrad_s=(layer.column_dgrad_s or (0.0, 0.0)) if sp else (),
            )
            bwd.append(
                Segment(
                    index,
                    pre + bsteps,
                    grad_from=len(pre),
                    stored_bytes=layer.stored_bytes,
                    transient_bytes=layer.transient_bytes,
                )
            )
        if last:
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
            fwd.append(Segment("head", fsteps, stored_bytes=head.stored_bytes))
            bwd.insert(0, Segment("head", bsteps, stored_bytes=head.stored_bytes))
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
        tensors = chunk_tensors(spec, layers, tp=tp, first=first, last=last, pp=plan.pp)
        chunk = ChunkModel(
            index=c,
            layers=layers,
            tensors=tensors,
            forward=fwd,
            backward=head_seg + layer_bwd + emb_seg,
        )
        ddp = plan.parallel.ddp
        chunk.buckets = build_buckets(
            tensors,
            bucket_mb=ddp.bucket_mb,
            first_bucket_mb=ddp.first_bucket_mb,
            grad_bytes=grad_bytes,
        )
        chunk.units = build_units(tensors)
        chunks.append(chunk)
    return StageModel(stage=stage, chunks=chunks)
