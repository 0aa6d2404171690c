"""The rank layout of a plan in words: the rank formula, one group of each axis with the
nodes it spans, and each pipeline stage's layers, ranks and nodes (``collsim run`` prints it).
"""

from __future__ import annotations

import numpy as np

from collsim.core.vocab import ParallelAxis
from collsim.parallel.plan import Plan

__all__ = ["describe_mapping"]

_BASE_AXES = (ParallelAxis.TP, ParallelAxis.PP, ParallelAxis.DP)


def describe_mapping(plan: Plan) -> str:
    """A readable account of ``plan``'s rank layout and of one group of each axis."""
    topo = plan.topology
    gpn = topo.gpus_per_node

    def nodes(ranks: tuple[int, ...] | list[int] | np.ndarray) -> str:
        # (numpy.unique would load numpy.ma, 5 ms of start-up, to check for a mask)
        ids: list[int] = sorted(set((np.asarray(ranks) // gpn).tolist()))
        return _span(ids)

    plural = "s" if topo.num_nodes != 1 else ""
    head = f"{plan.num_gpus} GPUs = tp {plan.tp} x "
    head += f"cp {plan.cp} x " if plan.cp > 1 else ""
    head += f"pp {plan.pp} x dp {plan.dp} on {topo.num_nodes} node{plural} x {gpn} GPUs"
    head += f", order {plan.order.value}"
    inner = plan.cp * plan.tp
    cp_term = f"cp_index * {plan.tp} + " if plan.cp > 1 else ""
    cp_word = "then cp, " if plan.cp > 1 else ""
    if plan.pp_outer:
        formula = (
            f"rank = pp_index * {plan.dp * inner} + dp_index * {inner} + {cp_term}tp_index "
            f"(tp innermost, {cp_word}then dp, pp outermost)"
        )
    else:
        formula = (
            f"rank = dp_index * {plan.pp * inner} + pp_index * {inner} + {cp_term}tp_index "
            f"(tp innermost, {cp_word}then pp, dp outermost)"
        )
    lines = [head, formula]
    axes = list(_BASE_AXES)
    if plan.cp > 1:
        axes.append(ParallelAxis.CP)
    if plan.ep > 1 or plan.etp > 1:
        axes += [ParallelAxis.EP, ParallelAxis.ETP, ParallelAxis.EDP]
    if plan.shard_group_size != plan.dp:
        axes += [ParallelAxis.DP_SHARD, ParallelAxis.DP_REPLICATE]
    for axis in axes:
        g = plan.group_of(0, axis)  # the groups of an axis partition the ranks evenly
        lines.append(
            f"{axis.value} groups: {plan.num_gpus // len(g)} of {len(g)}; first "
            f"{_ranks(g)} on node(s) {nodes(g)}"
        )
    grid = plan.grid()
    for stage in range(plan.pp):
        ranks = grid[stage].ravel()  # stage_ranks(stage), kept as an array
        layers = [list(plan.chunk_layers(stage, c)) for c in range(plan.virtual_stages)]
        spans = ", ".join(_span(ls) if ls else "none" for ls in layers)
        first = _ranks(ranks[: plan.tp * plan.cp].tolist())
        lines.append(
            f"stage {stage}: layers {spans}; ranks {first}"
            f"{' + dp replicas' if plan.dp > 1 else ''}; nodes {nodes(ranks)}"
        )
    return "\n".join(lines)


def _span(ids: list[int]) -> str:
    if len(ids) == 1:
        return str(ids[0])
    if ids == list(range(ids[0], ids[-1] + 1)):
        return f"{ids[0]}-{ids[-1]}"
    if len(ids) <= 8:
        return ",".join(map(str, ids))
    return f"{','.join(map(str, ids[:4]))},...,{ids[-1]} ({len(ids)})"


def _ranks(ranks: tuple[int, ...] | list[int]) -> str:
    ranks = list(ranks)
    if len(ranks) <= 8:
        return "[" + ", ".join(map(str, ranks)) + "]"
    return f"[{ranks[0]}, {ranks[1]}, ..., {ranks[-1]}]"
