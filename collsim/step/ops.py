"""The typed ops of the step program: steps, segments, model chunks, stages and block times.

A stage's chunks hold forward and backward segments, each a list of compute steps and blocking
collectives; what the layers, the embedding and the head put in them is built by
:mod:`collsim.step.layer_passes` and :mod:`collsim.step.stage`, and both interpreters read them.
"""

from __future__ import annotations

from collections.abc import Hashable, Sequence
from dataclasses import dataclass, field

from collsim.core.vocab import ParallelAxis
from collsim.parallel.buckets import Bucket
from collsim.parallel.fsdp import FSDPUnit
from collsim.parallel.params import ParamTensor
from collsim.step.shapes import same_objects

__all__ = [
    "BUFFER_FREE_KIND",
    "BUFFER_KIND",
    "Step",
    "Segment",
    "ChunkModel",
    "StageModel",
    "BlockTimes",
]

BUFFER_KIND = "cp_buffer"
"""The label kind of a segment's buffers (:attr:`Segment.buffer_bytes`) when allocated."""
BUFFER_FREE_KIND = "cp_buffer_free"
"""The label kind of their free (the replay pairs it with the newest live block of its size:
collsim.step.allocator)."""


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
    buffer_bytes: float = 0.0
    """Bytes held from this segment's start to its end and no longer (the KV exchange and
    fp32 merge or gradient buffers of torch's context parallelism:
    :func:`collsim.workload.torch_cp.buffer_bytes`)."""

    @property
    def compute_s(self) -> float:
        return sum(s.overlap_s if s.op else s.seconds for s in self.steps)

    def activation_events(
        self, start_s: float, end_s: float, *, forward: bool
    ) -> list[tuple[float, float, str, str | int]]:
        """``(time_s, delta_bytes, kind, key)`` of this segment's activations when it runs
        from ``start_s`` to ``end_s``: forward keeps its stored activations at its end;
        backward rebuilds the transient ones at its start and frees both at its end; its
        buffers (:attr:`buffer_bytes`) live from its start to its end."""
        out: list[tuple[float, float, str, str | int]] = []
        if self.buffer_bytes:
            out.append((start_s, self.buffer_bytes, BUFFER_KIND, self.key))
            out.append((end_s, -self.buffer_bytes, BUFFER_FREE_KIND, self.key))
        if forward:
            if self.stored_bytes:
                out.append((end_s, self.stored_bytes, "act", self.key))
            return out
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
    buckets: Sequence[Bucket] = field(default_factory=list)
    units: list[FSDPUnit] = field(default_factory=list)
    bucket_shape: Hashable | None = None
    """What ``buckets`` are made of, as numbers (:data:`collsim.step.stage.BucketShape`):
    chunks with equal shapes have buckets alike but for names and layer numbers (None: not
    known)."""
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
    numel_of: tuple[list[ParamTensor], float] | None = field(
        default=None, repr=False, compare=False
    )
    """:attr:`numel` with the tensor list it was summed over (summed again for another)."""

    @property
    def numel(self) -> float:
        """Elements of the chunk's parameters (summed once per tensor list: the lists are
        shared by plans of one chunk shape and never changed in place)."""
        known = self.numel_of
        if known is not None and known[0] is self.tensors:
            return known[1]
        total = sum(t.numel for t in self.tensors)
        self.numel_of = (self.tensors, total)
        return total

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
    split_of: tuple[list[list[ParamTensor]], float, float] | None = field(
        default=None, repr=False, compare=False
    )
    """:meth:`split_numel` with the chunks' tensor lists it was summed over."""

    @property
    def numel(self) -> float:
        return sum(c.numel for c in self.chunks)

    def split_numel(self) -> tuple[float, float]:
        """Elements of the stage's parameters (not routed experts, routed experts), added
        tensor by tensor in chunk order; summed once per set of tensor lists (shared by the
        plans of one chunk shape, never changed in place)."""
        lists = [c.tensors for c in self.chunks]
        known = self.split_of
        if known is not None and same_objects(known[0], lists):
            return known[1], known[2]
        dense = expert = 0.0
        for tensors in lists:
            for t in tensors:
                if t.expert:
                    expert += t.numel
                else:
                    dense += t.numel
        self.split_of = (lists, dense, expert)
        return dense, expert


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
    cp_chunks_s: tuple[tuple[float, ...], tuple[float, ...]] = ((), ())
    """Under torch's context parallelism, the seconds of each CP step (an SDPA call and its
    merge) in forward and backward (:mod:`collsim.step.torch_cp`); empty otherwise."""
    fp8_linears: int = 0
    """FP8 linears of the block (what a delayed-scaling amax buffer holds per layer)."""
    cp_buffer_bytes: tuple[float, float] = (0.0, 0.0)
    """Under torch's context parallelism, the bytes its attention holds beyond the kept
    activations in forward and backward (:func:`collsim.workload.torch_cp.buffer_bytes`)."""
