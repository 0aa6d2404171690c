"""Floors of plans that differ in the MoE, CP, HSDP and dtype knobs: one :class:`Bounds` per
combination, each built on the scenario's sections with that combination's values.

:class:`Bounds` reads the expert tensor-parallel size, the EP overlap and the dtype from the
sections it is built on and keeps its tables per plan shape, so plans that differ only in those
knobs (:class:`collsim.study.search.space.Extra`, ``etp``) need their own. Plans of an HSDP
group smaller than dp reduce inside that group, which the data-parallel floor does not follow:
they get no data-parallel floor. Plans whose layers do not divide pp x v (a balanced split) keep
the cheap floor only: the pipeline walk of :meth:`Bounds.refined_s` prices each chunk as the
stage's mean chunk.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from collsim.parallel.states import rank_model_states
from collsim.study.search.bounds import Bounds
from collsim.workload.memory import layers_per_stage

if TYPE_CHECKING:  # pragma: no cover
    from collsim.cluster.topology import Topology
    from collsim.parallel.config import ParallelConfig, TrainingConfig
    from collsim.study.search.space import Candidate
    from collsim.workload.model import TransformerSpec

__all__ = ["VariantBounds"]


class VariantBounds(Bounds):
    """:class:`Bounds` that hands each plan to the bounds of its own knob combination (the
    scenario's sections with the plan's etp, dispatcher, EP overlap, CP algorithm, HSDP group
    and dtype); a plan of the scenario's own combination is bounded by this one."""

    def __init__(
        self,
        topology: Topology,
        spec: TransformerSpec,
        training: TrainingConfig,
        parallel: ParallelConfig | None = None,
    ) -> None:
        super().__init__(topology, spec, training, parallel)
        self._by: dict[tuple[Any, ...], Bounds] = {}
        self._left_out: dict[tuple[Any, ...], float] = {}
        self._held: dict[tuple[Any, ...], float] = {}

    def _of(self, c: Candidate) -> Bounds:
        key = (c.etp, c.dispatcher, c.ep_overlap, c.cp_algorithm, c.shard_group, c.dtype)
        hit = self._by.get(key)
        if hit is None:
            training, parallel = c.configs(self.training, self.base)
            hit = self._by[key] = Bounds(self.topology, self.spec, training, parallel)
        return hit

    def memory_bytes(self, c: Candidate) -> float:
        """:meth:`Bounds.memory_bytes` of the plan's combination; for an offloaded MoE plan
        at least its activations held at once (:func:`_held_activations`), and for FP8 or
        MoE plans that keep their gathered parameters the states :meth:`Bounds.memory_bytes`
        leaves out (:meth:`_left_out_bytes`)."""
        bounds = self._of(c)
        floor = bounds.memory_bytes(c)
        if self.spec.is_moe and c.offload:
            key: tuple[Any, ...] = (
                c.etp,
                c.dtype,
                c.tp,
                c.pp,
                c.dp,
                c.cp,
                c.ep,
                c.micro_batch,
                c.schedule,
            )
            key += (c.recompute, c.sequence_parallel)
            held = self._held.get(key)
            if held is None:
                held = self._held[key] = _held_activations(bounds, c)
            floor = max(floor, held)
        return floor + self._left_out_bytes(bounds, c)

    def _left_out_bytes(self, bounds: Bounds, c: Candidate) -> float:
        """What every stage holds besides the floor's states, at the least over the stages
        (:func:`collsim.parallel.states.rank_model_states`): the FP8 weight copies (ZeRO
        0-2, kept for the whole step; with offload left out) and, for a MoE plan, the
        parameters ZeRO-3 keeps gathered from forward to backward (held with the
        activations at the first backward; the dense floor counts them already)."""
        fp8 = str(bounds.training.dtype) == "fp8" and c.zero < 3 and not c.offload
        kept = self.spec.is_moe and c.zero == 3 and not c.reshard and c.dp > 1
        if not (fp8 or kept):
            return 0.0
        key: tuple[Any, ...] = (c.etp, c.dispatcher, c.ep_overlap, c.cp_algorithm)
        key += (
            c.shard_group,
            c.dtype,
            c.tp,
            c.pp,
            c.dp,
            c.cp,
            c.ep,
            c.zero,
            c.reshard,
            c.offload,
            c.virtual_stages,
        )
        hit = self._left_out.get(key)
        if hit is None:
            plan = bounds._plan_of(c)
            hit = 0.0
            if plan is not None:
                stages = [rank_model_states(plan, s) for s in range(plan.pp)]
                hit = min(
                    (st.fp8_copy_bytes if fp8 else 0.0) + (st.kept_gathered_bytes if kept else 0.0)
                    for st in stages
                )
            self._left_out[key] = hit
        return hit * (1 - 1e-9)

    def step_s(self, c: Candidate) -> float:
        bounds = self._of(c)
        if _hsdp(c):
            return _stream_s(bounds, c, None)
        return bounds.step_s(c)

    def refined_s(self, c: Candidate) -> float:
        if self.spec.num_layers % (c.pp * c.virtual_stages):
            return self.step_s(c)
        bounds = self._of(c)
        if _hsdp(c):
            return _stream_s(bounds, c, bounds._pipeline_ends(c))
        return bounds.refined_s(c)


def _held_activations(bounds: Bounds, c: Candidate) -> float:
    """A mixture-of-experts plan's activations held at once on its fullest stage, as
    :meth:`Bounds._moe_floor` counts them (``min(pp - s, m)`` micro-batches of the stage's
    layers, ``m`` with GPipe, each layer at the smallest activation of the model's layer
    kinds), without the model states: the floor of a plan whose states live in host memory
    (offload), which :meth:`Bounds.memory_bytes` leaves at 0."""
    model = bounds._model()
    spec = bounds.spec
    per_layer = min(
        model.layer_times(
            spec,
            micro_batch=c.micro_batch,
            tp=c.tp,
            sequence_parallel=c.sequence_parallel and c.tp > 1,
            recompute=c.recompute,
            layer=rep,
            ep=c.ep,
            etp=c.etp,
            cp=c.cp,
        ).activation_bytes
        for rep, _ in spec.layer_kinds()
    )
    counts = layers_per_stage(spec.num_layers, c.pp)
    m = bounds.training.global_batch // (c.micro_batch * c.dp)
    held = [m if c.schedule == "gpipe" else min(c.pp - s, m) for s in range(c.pp)]
    most = max(h * n for h, n in zip(held, counts, strict=True))
    return float(most * per_layer) * (1 - 1e-9)


def _hsdp(c: Candidate) -> bool:
    """``c`` shards inside groups smaller than its data-parallel group."""
    return c.shard_group is not None and c.shard_group < c.dp


def _stream_s(bounds: Bounds, c: Candidate, walked: list[float] | None) -> float:
    """The compute stream's floor alone (:meth:`Bounds._compute`, tightened by the pipeline
    walk when given): its data-parallel calls and optimizer left out, which only add."""
    floor: list[float] = bounds._compute(c)[0]
    if walked is not None:
        floor = [max(a, b) for a, b in zip(floor, walked, strict=True)]
    return max(floor) * (1 - 1e-9)
