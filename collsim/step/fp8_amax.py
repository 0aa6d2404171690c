"""Delayed scaling's amax reductions in the step program: at the end of a model chunk's
forward (the exit of Megatron-Core's outer ``autocast``) and at the end of its backward (the
backward of its first FP8 module), a blocking all-reduce of the chunk's amaxes over the
stage's ranks and the kernel that folds them into the histories and scales
(:mod:`collsim.parallel.amax`)."""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

from collsim.parallel.amax import amax_plan
from collsim.step.ops import Step

if TYPE_CHECKING:
    from collsim.parallel.plan import Plan
    from collsim.step.ops import Segment

__all__ = ["ChunkAmax", "chunk_amax", "attach_chunk_amax"]

ChunkAmax = Callable[[int], tuple[list[Step], list[Step]]]
"""Layers in a chunk -> the (forward, backward) steps of its amax reductions."""


def chunk_amax(
    plan: Plan, *, linears_per_layer: int, memory_time_s: Callable[[float], float]
) -> ChunkAmax | None:
    """The amax steps of a chunk of ``plan`` by its layer count (None when the plan's
    recipe reduces nothing per chunk); ``memory_time_s`` prices the one update kernel."""
    if not amax_plan(plan, linears_per_layer=linears_per_layer, layers_per_chunk=1).update_bytes[0]:
        return None

    def steps(layers: int) -> tuple[list[Step], list[Step]]:
        a = amax_plan(plan, linears_per_layer=linears_per_layer, layers_per_chunk=layers)
        out: list[list[Step]] = []
        for i, phase in enumerate(("forward", "backward")):
            calls = [
                Step(op="all_reduce", size_bytes=r.size_bytes, axis=r.axis)
                for r in a.of("chunk", phase)
            ]
            update = a.update_bytes[i]
            out.append([*calls, Step(memory_time_s(update))] if update else calls)
        return out[0], out[1]

    return steps


def attach_chunk_amax(
    forward: list[Segment],
    backward: list[Segment],
    amax: ChunkAmax | None,
    paired: dict[int, Segment] | None = None,
) -> None:
    """Append the amax steps of a chunk to the forward segment of its last layer and the
    backward segment of its first layer, and to their paired forms in ``paired`` (by the
    segment's id), in place; nothing for a chunk without layers."""
    if amax is None:
        return
    fwd = [s for s in forward if isinstance(s.key, int)]
    bwd = [s for s in backward if isinstance(s.key, int)]
    if not fwd or not bwd:
        return
    f_steps, b_steps = amax(len(fwd))
    last = max(fwd, key=lambda s: int(s.key))
    first = min(bwd, key=lambda s: int(s.key))
    for seg, steps in ((last, f_steps), (first, b_steps)):
        other = (paired or {}).get(id(seg))
        seg.steps = [*seg.steps, *steps]
        if other is not None and other is not seg:
            other.steps = [*other.steps, *steps]
