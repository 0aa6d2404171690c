"""Floors of plans that differ in the MoE, CP, HSDP and dtype knobs: one :class:`Bounds` per
combination, each built on the scenario's sections with that combination's values.

:class:`Bounds` reads the expert tensor-parallel size, the EP overlap and the dtype from the
sections it is built on and keeps its tables per plan shape, so plans that differ only in those
knobs (:class:`collsim.study.search.space.Extra`, ``etp``) need their own; plans of an HSDP
group smaller than dp reduce as their own data-parallel rules say (inside the shard group, then
across the replicas).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from collsim.study.search.bounds import Bounds

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

    def _of(self, c: Candidate) -> Bounds:
        key = (c.etp, c.dispatcher, c.ep_overlap, c.cp_algorithm, c.shard_group, c.dtype)
        hit = self._by.get(key)
        if hit is None:
            training, parallel = c.configs(self.training, self.base)
            hit = self._by[key] = Bounds(self.topology, self.spec, training, parallel)
            hit.program = self.program  # one set of program parts for every combination
        return hit

    def memory_bytes(self, c: Candidate) -> float:
        """:meth:`Bounds.memory_bytes` of the plan's combination."""
        return self._of(c).memory_bytes(c)

    def step_s(self, c: Candidate) -> float:
        """:meth:`Bounds.step_s` of the plan's combination."""
        return self._of(c).step_s(c)

    def refined_s(self, c: Candidate) -> float:
        """:meth:`Bounds.refined_s` of the plan's combination."""
        return self._of(c).refined_s(c)
