"""A plan's step-program parts as the search's floors read them: each layer kind's forward and
backward segments priced once per plan shape, each stage's layers, and each schedule's
activation counts.

:func:`collsim.step.build.plan_blocks` and :func:`collsim.step.layer_passes.layer_segments` give the
parts :func:`collsim.step.build.build_schedule` puts in a plan's program (block times, EP and
CP collectives, FP8 casts, the slowest GPU's pace) without building the whole program; a
segment's floor is its compute plus its blocking collectives at their least exposed
(:class:`collsim.step.pricing.SegmentPrices` without the slowdown of the compute beside them),
what the closed-form walk spends on it less its interference and framework work. Plans of one
search that share tp, cp, pp, dp, ep, etp, micro-batch, recompute, sequence parallelism and the
MoE / CP / dtype knobs share these parts (the data-parallel knobs and the schedule do not
change a segment).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np

from collsim.parallel.pipeline import Phase, get_schedule
from collsim.step.build import bytes_per, layer_kind_of, plan_blocks
from collsim.step.layer_passes import layer_segments
from collsim.step.ops import Segment
from collsim.step.pricing import ClosedPricer, SegmentPrices
from collsim.step.shapes import ShapeCache

if TYPE_CHECKING:  # pragma: no cover
    from collsim.parallel.plan import Plan
    from collsim.step.ops import BlockTimes

__all__ = [
    "LayerPart",
    "Layout",
    "PlanParts",
    "ProgramParts",
    "chunk_kinds",
    "held_counts",
    "place",
]


@dataclass(frozen=True, slots=True)
class LayerPart:
    """One layer kind of one stage, one micro-batch: floors of the compute stream's seconds
    on its forward and its backward (recompute included), its weight-gradient part (what a
    split backward moves to its W op) and the activations it keeps."""

    forward_s: float
    backward_s: float
    wgrad_s: float
    stored_bytes: float
    compute_s: float = 0.0
    """Compute seconds alone of its forward and backward (what the data-parallel calls'
    interference slows)."""


@dataclass(frozen=True, slots=True)
class PlanParts:
    """The parts of one plan shape: per stage, each layer kind's :class:`LayerPart` priced on
    that stage's representative rank; the embedding and the head blocks."""

    kind_of: dict[int, int]
    """Layer index -> the representative layer of its kind."""
    stages: list[dict[int, LayerPart]]
    embedding: BlockTimes
    head: BlockTimes
    memory_bound_share: float = 1.0

    def layer(self, stage: int, index: int) -> LayerPart:
        return self.stages[stage][self.kind_of[index]]

    def wgrad_range(self) -> tuple[float, float]:
        parts = [p.wgrad_s for st in self.stages for p in st.values()]
        return min(parts), max(parts)


@dataclass(frozen=True, slots=True)
class Layout:
    """A plan shape's parts as its schedule places them: per stage, per chunk (the layers
    :meth:`collsim.parallel.plan.Plan.chunk_layers` gives it, each at its kind's
    :class:`LayerPart` on that stage) the sums of its layers' floors, and the model part each
    chunk is (part 0 holds the embedding, the last part the head)."""

    parts: PlanParts
    part_of: tuple[tuple[int, ...], ...]
    forward_s: tuple[tuple[float, ...], ...]
    backward_s: tuple[tuple[float, ...], ...]
    input_s: tuple[tuple[float, ...], ...]
    """A split backward's input-gradient op: each layer's backward less the largest
    weight-gradient part of any layer (what the W op can take at most)."""
    wgrad_s: tuple[tuple[float, ...], ...]
    stored_bytes: tuple[tuple[float, ...], ...]
    """Activations each chunk keeps per micro-batch, the embedding's and the head's
    included."""
    compute_s: tuple[float, ...]
    """Per stage, its layers' compute seconds alone (forward and backward)."""

    @property
    def last_part(self) -> int:
        return len(self.part_of) * len(self.part_of[0]) - 1

    def stage_work(self, stage: int) -> tuple[float, float]:
        """The compute stream's floor of one micro-batch on ``stage`` (forward, backward):
        its chunks' layers, and the embedding and the head where they are placed."""
        f, b = sum(self.forward_s[stage]), sum(self.backward_s[stage])
        emb, head = self.parts.embedding, self.parts.head
        for part in self.part_of[stage]:
            if part == 0:
                f, b = f + emb.forward_s, b + emb.backward_s
            if part == self.last_part:
                f, b = f + head.forward_s, b + head.backward_s
        return f, b

    def op_work(self) -> dict[tuple[int, Phase, int], float]:
        """Each (stage, phase, chunk) op's floor on the compute stream: its chunk's layers,
        and the embedding or the head where the chunk is the first or the last model part; a
        split backward as its input-gradient part (:attr:`input_s`, the head's backward less
        its weight-gradient part) and its weight-gradient part (each layer's least, the
        embedding's backward, the least of the head's), each a floor of what the program
        builds (``collsim.step.ops``' split backward)."""
        emb, head = self.parts.embedding, self.parts.head
        out: dict[tuple[int, Phase, int], float] = {}
        for s, row in enumerate(self.part_of):
            for k, part in enumerate(row):
                first, last = part == 0, part == self.last_part
                e_f, e_b = (emb.forward_s, emb.backward_s) if first else (0.0, 0.0)
                h_f, h_b = (head.forward_s, head.backward_s) if last else (0.0, 0.0)
                hw = head.wgrad_s if last else 0.0
                out[(s, Phase.FORWARD, k)] = self.forward_s[s][k] + e_f + h_f
                out[(s, Phase.BACKWARD, k)] = self.backward_s[s][k] + e_b + h_b
                out[(s, Phase.BACKWARD_INPUT, k)] = self.input_s[s][k] + max(0.0, h_b - hw)
                out[(s, Phase.BACKWARD_WEIGHT, k)] = self.wgrad_s[s][k] + e_b + min(hw, h_b)
        return out


_FIELDS = ("forward_s", "backward_s", "wgrad_s", "stored_bytes", "compute_s")


def chunk_kinds(plan: Plan) -> tuple[tuple[tuple[int, ...], ...], list[int], np.ndarray]:
    """Where ``plan``'s schedule puts its layers: per stage the model part of each chunk, the
    representative layers of the model's kinds, and how many layers of each kind each
    (stage, chunk) holds (an array stage x chunk x kind)."""
    v = plan.virtual_stages
    kinds = sorted(set(layer_kind_of(plan.spec).values()))
    kind_of = layer_kind_of(plan.spec)
    index = {rep: j for j, rep in enumerate(kinds)}
    counts = np.zeros((plan.pp, v, len(kinds)))
    part_of = []
    for s in range(plan.pp):
        part_of.append(tuple(plan.pipeline_schedule.part_of(s, k, plan.pp, v) for k in range(v)))
        for k in range(v):
            for i in plan.chunk_layers(s, k):
                counts[s, k, index[kind_of[i]]] += 1
    return tuple(part_of), kinds, counts


def place(
    parts: PlanParts, where: tuple[tuple[tuple[int, ...], ...], list[int], np.ndarray]
) -> Layout:
    """The :class:`Layout` of the chunks :func:`chunk_kinds` gives over ``parts``."""
    part_of, kinds, counts = where
    w_max = parts.wgrad_range()[1]
    emb, head = parts.embedding, parts.head
    last = len(part_of) * len(part_of[0]) - 1
    # per stage and kind: each field of the kind's part on that stage
    table = np.array(
        [[[getattr(st[rep], f) for f in _FIELDS] for rep in kinds] for st in parts.stages]
    )
    sums = np.einsum("skq,sqf->skf", counts, table)
    inputs = np.einsum("skq,sq->sk", counts, np.maximum(0.0, table[:, :, 1] - w_max))
    ends = np.array(
        [
            [
                (emb.stored_bytes if part == 0 else 0.0)
                + (head.stored_bytes if part == last else 0.0)
                for part in row
            ]
            for row in part_of
        ]
    )

    def rows(a: np.ndarray) -> tuple[tuple[float, ...], ...]:
        return tuple(map(tuple, a.tolist()))  # (Python floats, as float() of each)

    return Layout(
        parts=parts,
        part_of=part_of,
        forward_s=rows(sums[:, :, 0]),
        backward_s=rows(sums[:, :, 1]),
        input_s=rows(inputs),
        wgrad_s=rows(sums[:, :, 2]),
        stored_bytes=rows(sums[:, :, 3] + ends),
        compute_s=tuple(sums[:, :, 4].sum(axis=1).tolist()),
    )


class ProgramParts:
    """:class:`PlanParts` of the plans of one search, one per plan shape (:meth:`of`)."""

    def __init__(self) -> None:
        self.shapes = ShapeCache()
        self._pricers: dict[int, ClosedPricer] = {}
        self._parts: dict[tuple[Any, ...], PlanParts] = {}

    def of(self, plan: Plan, key: tuple[Any, ...]) -> PlanParts:
        """The parts of ``plan``, kept under ``key`` (the knobs they depend on)."""
        hit = self._parts.get(key)
        if hit is None:
            hit = self._parts[key] = self._make(plan)
        return hit

    def _make(self, plan: Plan) -> PlanParts:
        topology = plan.topology
        pricer = self._pricers.get(id(topology))
        if pricer is None:
            pricer = self._pricers[id(topology)] = ClosedPricer(topology)
        layers, emb, head, comms, share = plan_blocks(plan, self.shapes)
        kind_of = layer_kind_of(plan.spec)
        act = int(bytes_per(plan.training).activation)
        prices = SegmentPrices(plan, pricer)
        segs = {
            rep: layer_segments(plan, rep, layers[rep], comms.get(rep, []), act) for rep in layers
        }
        stages: list[dict[int, LayerPart]] = []
        for s in range(plan.pp):
            rank = plan.rank(dp=0, pp=s, tp=0)

            def stream(seg: Segment | None, r: int = rank) -> float:
                if seg is None:
                    return float("inf")
                return seg.compute_s + prices.seg_tp_s(r, seg)

            parts: dict[int, LayerPart] = {}
            for rep, (fwd, bwd, p_fwd, p_bwd) in segs.items():
                plain = sum(st.seconds for st in bwd.steps[bwd.grad_from :] if not st.op)
                parts[rep] = LayerPart(
                    min(stream(fwd), stream(p_fwd)),
                    min(stream(bwd), stream(p_bwd)),
                    min(layers[rep].wgrad_s, plain),
                    bwd.stored_bytes,
                    min(fwd.compute_s, p_fwd.compute_s if p_fwd is not None else fwd.compute_s)
                    + min(bwd.compute_s, p_bwd.compute_s if p_bwd is not None else bwd.compute_s),
                )
            stages.append(parts)
        return PlanParts(
            kind_of=dict(kind_of),
            stages=stages,
            embedding=emb,
            head=head,
            memory_bound_share=share,
        )


_COUNTS: dict[tuple[str, int, int, int, int], np.ndarray] = {}


def held_counts(schedule: str, *, pp: int, m: int, v: int, stage: int) -> np.ndarray:
    """Per chunk of ``stage``, how many micro-batches' activations it holds at the end of each
    forward op of the schedule's order (the distinct vectors, one row each): a forward keeps
    its activations at its end; the op that frees them (the backward, or the weight-gradient
    op of a split backward) releases them at its end. The stage's activations at that instant
    are the row times each chunk's activations, so the largest product is a floor of its
    peak. One chunk: the largest count alone."""
    key = (schedule, pp, m, v, stage)
    hit = _COUNTS.get(key)
    if hit is not None:
        return hit
    pipeline = get_schedule(schedule)
    frees = (Phase.BACKWARD, Phase.BACKWARD_WEIGHT)  # an input-gradient op keeps them
    counts = [0] * v
    seen: set[tuple[int, ...]] = set()
    for op in pipeline.order(num_stages=pp, num_microbatches=m, stage=stage, virtual_stages=v):
        if op.phase is Phase.FORWARD:
            counts[op.chunk] += 1
            seen.add(tuple(counts))
        elif op.phase in frees:
            counts[op.chunk] -= 1
    if v == 1:
        seen = {max(seen)} if seen else set()
    rows = sorted(seen) or [tuple([0] * v)]
    hit = _COUNTS[key] = np.array(rows, dtype=float).reshape(len(rows), v)
    return hit
