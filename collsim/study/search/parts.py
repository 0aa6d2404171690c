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

from collsim.parallel.pipeline import Phase, get_schedule
from collsim.step.build import bytes_per, layer_kind_of, plan_blocks
from collsim.step.layer_passes import layer_segments
from collsim.step.ops import Segment
from collsim.step.pricing import ClosedPricer, SegmentPrices
from collsim.step.shapes import ShapeCache

if TYPE_CHECKING:  # pragma: no cover
    from collsim.parallel.plan import Plan
    from collsim.step.ops import BlockTimes

__all__ = ["LayerPart", "PlanParts", "ProgramParts", "held_counts"]


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

    def cheapest(self) -> LayerPart:
        """A layer no cheaper in any field than every layer of every stage (field-wise
        minimum)."""
        parts = [p for st in self.stages for p in st.values()]
        return LayerPart(
            min(p.forward_s for p in parts),
            min(p.backward_s for p in parts),
            min(p.wgrad_s for p in parts),
            min(p.stored_bytes for p in parts),
            min(p.compute_s for p in parts),
        )

    def wgrad_range(self) -> tuple[float, float]:
        parts = [p.wgrad_s for st in self.stages for p in st.values()]
        return min(parts), max(parts)


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


_COUNTS: dict[tuple[str, int, int, int, int], tuple[tuple[int, ...], ...]] = {}


def held_counts(
    schedule: str, *, pp: int, m: int, v: int, stage: int
) -> tuple[tuple[int, ...], ...]:
    """Per chunk of ``stage``, how many micro-batches' activations it holds at the end of each
    forward op of the schedule's order (distinct vectors, none below another): a forward
    keeps its activations at its end; the op that frees them (the backward, or the
    weight-gradient op of a split backward) releases them at its end. The stage's activations
    at that instant are the vector times each chunk's activations, so the largest is a floor
    of its peak."""
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
    kept = [
        a
        for a in seen
        if not any(b != a and all(x >= y for x, y in zip(b, a, strict=True)) for b in seen)
    ]
    hit = _COUNTS[key] = tuple(sorted(kept))
    return hit
