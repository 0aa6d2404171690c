"""The parallel plan: checks a TP x CP x PP x DP combination (with EP folded in) and maps
ranks onto the cluster. The rank grid is in :mod:`collsim.parallel.grid`, the plan's rules
beyond its sizes in :mod:`collsim.parallel.checks`, its layout in words in
:mod:`collsim.parallel.describe`.

Derivations, measurements and sources: docs/derivations.md, ``collsim.parallel.plan``.
"""

from __future__ import annotations

import copy
import dataclasses
import warnings
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import numpy as np

from collsim.core.errors import CollsimWarning, ConfigError
from collsim.core.vocab import ParallelAxis, RankOrder
from collsim.parallel.checks import (
    check_experts_and_context,
    check_torch_cp,
    chunk_sizes,
    uneven_split_note,
)
from collsim.parallel.config import ParallelConfig, TrainingConfig
from collsim.parallel.dispatch import check_dispatch
from collsim.parallel.grid import (
    GRID_ORDER,
    GridAxis,
    RankCoords,
    grid_index,
    grid_rank,
    rank_axes,
)
from collsim.parallel.pipeline import PipelineSchedule, get_schedule
from collsim.parallel.tp_overlap import check_tp_overlap, tp_overlap_of
from collsim.workload.fp8 import fp8_param_gather_of

if TYPE_CHECKING:
    from collsim.cluster.topology import Topology
    from collsim.workload.model import TransformerSpec

__all__ = [
    "GRID_ORDER",
    "GridAxis",
    "ParallelAxis",
    "RankCoords",
    "Plan",
    "build_plan",
    "default_order",
    "dp_variant_plan",
    "grid_index",
    "grid_rank",
    "rank_axes",
]


_GRID_DIMS = {
    ParallelAxis.PP: ("pp",),
    ParallelAxis.DP: ("dp",),
    ParallelAxis.CP: ("cp",),
    ParallelAxis.TP: ("tp",),
    ParallelAxis.DP_CP: ("dp", "cp"),
    ParallelAxis.MP: ("pp", "cp", "tp"),
    ParallelAxis.TP_DP_CP: ("dp", "cp", "tp"),
}
"""Axes whose groups are grid lines of :meth:`Plan.grid`: the grid axes a group spans, in group
order (dp_cp: dp major, cp minor, as ``group_of``; mp: pp, cp, tp, which is rank order in
either layout; tp_dp_cp: a stage's ranks, as ``stage_ranks``)."""


@dataclass(frozen=True, slots=True, kw_only=True)
class Plan:
    """A checked plan: sizes, micro-batches, layer split and the rank mapping.

    Build it with :func:`build_plan`; the engine and the reports read it.
    """

    topology: Topology
    """The cluster (``collsim.cluster.topology.Topology``)."""
    spec: TransformerSpec
    """The model (``collsim.workload.TransformerSpec``)."""
    training: TrainingConfig
    parallel: ParallelConfig
    num_microbatches: int
    """Micro-batches per step on one data-parallel replica: global / (micro x dp)."""
    warnings: tuple[str, ...] = field(default=())
    _coords: dict[int, RankCoords] = field(
        default_factory=dict, init=False, repr=False, compare=False
    )
    """Ranks already placed on the grid (:meth:`coords`, asked for on every simulated op)."""
    _axes: tuple[GridAxis, ...] = field(default=(), init=False, repr=False, compare=False)
    """:attr:`axes`, made once."""
    _head: int = field(default=-1, init=False, repr=False, compare=False)
    """:attr:`head_stage`, worked out once (-1: not yet)."""
    _strides: tuple[int, int, int, int] = field(
        default=(0, 0, 0, 0), init=False, repr=False, compare=False
    )
    """How far one step along dp, pp, tp and cp moves the global rank (:meth:`rank`)."""

    def __post_init__(self) -> None:
        par = self.parallel
        sizes = {"tp": par.tp, "cp": par.cp, "dp": par.dp, "pp": par.pp}
        axes = rank_axes(self.order, sizes)
        object.__setattr__(self, "_axes", axes)
        stride, strides = 1, {}
        for axis in axes:  # fastest first: each axis steps over all the faster ones
            strides[axis.name] = stride
            stride *= axis.size
        object.__setattr__(
            self, "_strides", tuple(strides.get(name, 0) for name in ("dp", "pp", "tp", "cp"))
        )

    @property
    def tp(self) -> int:
        return self.parallel.tp

    @property
    def pp(self) -> int:
        return self.parallel.pp

    @property
    def dp(self) -> int:
        return self.parallel.dp

    @property
    def virtual_stages(self) -> int:
        return self.parallel.virtual_stages

    @property
    def pipeline_schedule(self) -> PipelineSchedule:
        """The pipeline schedule (op order, chunk placement, dependencies)."""
        return get_schedule(self.parallel.schedule)

    @property
    def head_stage(self) -> int:
        """The stage holding the last model part (final norm, LM head, loss)."""
        if self._head < 0:
            n = self.pp * self.virtual_stages
            head = self.pipeline_schedule.where(n - 1, self.pp, self.virtual_stages)[0]
            object.__setattr__(self, "_head", head)
        return self._head

    chunk_sizes: tuple[int, ...] = ()
    """Layers of each virtual stage, in virtual-stage order (c x pp + s); set by build_plan."""
    order: RankOrder = RankOrder.PP_OUTER
    """The rank layout: ``parallel.order``, else :func:`default_order` (set by build_plan)."""

    @property
    def cp(self) -> int:
        return self.parallel.cp

    @property
    def ep(self) -> int:
        return self.parallel.ep

    @property
    def etp(self) -> int:
        return self.parallel.etp

    @property
    def edp(self) -> int:
        """Expert data-parallel size: tp x cp x dp / (ep x etp)."""
        return self.tp * self.cp * self.dp // (self.ep * self.etp)

    @property
    def shard_group_size(self) -> int:
        """FSDP shard group size (the whole dp group without HSDP)."""
        g = self.parallel.fsdp.shard_group_size
        return self.dp if g is None else g

    @property
    def num_gpus(self) -> int:
        return self.tp * self.cp * self.pp * self.dp

    def _sizes(self) -> tuple[int, ...]:
        if self.chunk_sizes:
            return self.chunk_sizes
        n = self.pp * self.virtual_stages
        return (self.spec.num_layers // n,) * n

    @property
    def even_split(self) -> bool:
        """Every virtual stage holds the same number of layers."""
        return len(set(self._sizes())) == 1

    @property
    def layers_per_chunk(self) -> int:
        """Layers per model chunk (the largest chunk when the split is uneven)."""
        return max(self._sizes())

    @property
    def layers_per_stage(self) -> int:
        """Layers per pipeline stage (the largest stage when the split is uneven)."""
        return max(len(self.stage_layers(s)) for s in range(self.pp))

    # ---- mapping ---------------------------------------------------------------------------
    @property
    def pp_outer(self) -> bool:
        """Pipeline outermost (``tp-cp-ep-dp-pp``): a stage's ranks are consecutive."""
        return self.order is RankOrder.PP_OUTER

    @property
    def axes(self) -> tuple[GridAxis, ...]:
        """The rank grid as named axes in the configured order, fastest-varying first."""
        return self._axes

    def rank(self, *, dp: int, pp: int, tp: int, cp: int = 0) -> int:
        """Global rank of grid position (dp, pp, cp, tp) (docs/derivations.md):
        :func:`~collsim.parallel.grid.grid_rank`, which is linear in each index, as the sum
        of each index times its axis's stride."""
        s_dp, s_pp, s_tp, s_cp = self._strides
        return dp * s_dp + pp * s_pp + tp * s_tp + cp * s_cp

    def coords(self, rank: int) -> RankCoords:
        """Grid position of a global rank."""
        hit = self._coords.get(rank)
        if hit is not None:
            return hit
        hit = self._coords[rank] = RankCoords(**grid_index(self.axes, rank))
        return hit

    def stage_of(self, rank: int) -> int:
        """The pipeline stage that ``rank`` runs."""
        return self.coords(rank).pp

    def pipeline_peers(self, rank: int) -> tuple[int | None, int | None]:
        """The ranks of the previous and the next pipeline stage that ``rank`` receives from
        and sends to (same dp, cp and tp index); None at either end of the pipeline."""
        c = self.coords(rank)
        before = self.rank(dp=c.dp, pp=c.pp - 1, tp=c.tp, cp=c.cp) if c.pp > 0 else None
        after = self.rank(dp=c.dp, pp=c.pp + 1, tp=c.tp, cp=c.cp) if c.pp < self.pp - 1 else None
        return before, after

    def grid(self) -> np.ndarray:
        """Every rank at its grid position, indexed in :data:`GRID_ORDER` (``[pp, dp, cp, tp]``)."""
        axes = self.axes
        outer_first = [a.name for a in reversed(axes)]
        ranks = np.arange(self.num_gpus).reshape([a.size for a in reversed(axes)])
        return ranks.transpose([outer_first.index(name) for name in GRID_ORDER])

    def _stage_index(self, c: RankCoords) -> int:
        """Position of a rank among the tp x cp x dp ranks of its stage (tp fastest)."""
        return (c.dp * self.cp + c.cp) * self.tp + c.tp

    def _from_stage_index(self, pp: int, j: int) -> int:
        tp = j % self.tp
        cp = (j // self.tp) % self.cp
        dp = j // (self.tp * self.cp)
        return self.rank(dp=dp, pp=pp, tp=tp, cp=cp)

    def expert_coords(self, rank: int) -> tuple[int, int, int]:
        """(etp, ep, edp) index of a rank in its stage's expert grid."""
        j = self._stage_index(self.coords(rank))
        return j % self.etp, (j // self.etp) % self.ep, j // (self.etp * self.ep)

    def _line(self, c: RankCoords, axis: str, size: int) -> tuple[int, ...]:
        """The ranks of ``c``'s grid line along one grid axis (dp, pp, cp or tp), index 0
        first: the rank is linear in each grid index (:func:`grid_rank`), so a line is a range
        with the axis's stride."""
        at = {"dp": c.dp, "pp": c.pp, "tp": c.tp, "cp": c.cp}
        at[axis] = 0
        first = self.rank(**at)
        if size < 2:
            return (first,)
        at[axis] = 1
        stride = self.rank(**at) - first
        return tuple(range(first, first + size * stride, stride))

    def group_of(self, rank: int, axis: ParallelAxis | str) -> tuple[int, ...]:
        """The ranks of ``rank``'s group along ``axis``, in group order."""
        c = self.coords(rank)
        match ParallelAxis(axis):
            case ParallelAxis.TP:
                return self._line(c, "tp", self.tp)
            case ParallelAxis.PP:
                return self._line(c, "pp", self.pp)
            case ParallelAxis.DP:
                return self._line(c, "dp", self.dp)
            case ParallelAxis.CP:
                return self._line(c, "cp", self.cp)
            case ParallelAxis.DP_CP:
                return tuple(
                    self.rank(dp=d, pp=c.pp, tp=c.tp, cp=k)
                    for d in range(self.dp)
                    for k in range(self.cp)
                )
            case ParallelAxis.MP:
                return tuple(self.grid()[:, c.dp].ravel().tolist())
            case ParallelAxis.TP_DP_CP:
                return tuple(self.stage_ranks(c.pp))
            case ParallelAxis.DP_SHARD:
                g = self.shard_group_size
                first = c.dp - c.dp % g
                return self._line(c, "dp", self.dp)[first : first + g]
            case ParallelAxis.DP_REPLICATE:
                g = self.shard_group_size
                return tuple(
                    self.rank(dp=c.dp % g + i * g, pp=c.pp, tp=c.tp, cp=c.cp)
                    for i in range(self.dp // g)
                )
            case ParallelAxis.DP_CP_SHARD:
                return tuple(
                    sorted(
                        r
                        for d in self.group_of(rank, ParallelAxis.DP_SHARD)
                        for r in self.group_of(d, ParallelAxis.CP)
                    )
                )
            case ParallelAxis.EDP_SHARD:
                shard = set(self.group_of(rank, ParallelAxis.DP_CP_SHARD))
                return tuple(r for r in self.group_of(rank, ParallelAxis.EDP) if r in shard)
            case ParallelAxis.EDP_REPLICATE:
                mine = self.group_of(rank, ParallelAxis.EDP_SHARD)
                pos = mine.index(rank)
                out = []
                for r in self.group_of(rank, ParallelAxis.EDP):
                    block = self.group_of(r, ParallelAxis.EDP_SHARD)
                    if block.index(r) == pos:
                        out.append(r)
                return tuple(out)
            case ParallelAxis.EP_NODE | ParallelAxis.EP_LOCAL as ax:
                gpn = self.topology.gpus_per_node
                ep_group = self.group_of(rank, ParallelAxis.EP)
                local = [r for r in ep_group if r // gpn == rank // gpn]
                if ax is ParallelAxis.EP_LOCAL:
                    return tuple(local)
                pos = local.index(rank)
                by_node: dict[int, list[int]] = {}
                for r in ep_group:
                    by_node.setdefault(r // gpn, []).append(r)
                return tuple(m[pos] for m in by_node.values() if len(m) > pos)
            case ParallelAxis.ETP | ParallelAxis.EP | ParallelAxis.EDP as ax:
                t, e, d = self.expert_coords(rank)
                et, ep = self.etp, self.ep
                if ax is ParallelAxis.ETP:
                    idx = [(d * ep + e) * et + i for i in range(et)]
                elif ax is ParallelAxis.EP:
                    idx = [(d * ep + i) * et + t for i in range(ep)]
                else:
                    idx = [(i * ep + e) * et + t for i in range(self.edp)]
                return tuple(self._from_stage_index(c.pp, j) for j in idx)
            case _:  # pragma: no cover - StrEnum conversion already rejects others
                raise ConfigError(f"unknown axis {axis!r}")

    def group_rows(self, axis: ParallelAxis | str) -> np.ndarray:
        """All groups along ``axis`` as one array, a group per row, ordered by their first
        rank (:meth:`groups` as an array; every group of an axis has the same size)."""
        axis = ParallelAxis(axis)
        names = _GRID_DIMS.get(axis)
        if names is None:
            return np.asarray(self.groups(axis), dtype=np.int64)
        grid = self.grid()
        dims = [GRID_ORDER.index(name) for name in names]
        rest = [d for d in range(grid.ndim) if d not in dims]
        rows = grid.transpose(*rest, *dims).reshape(-1, int(np.prod([grid.shape[d] for d in dims])))
        return rows[np.argsort(rows[:, 0], kind="stable")]

    def groups(self, axis: ParallelAxis | str) -> list[tuple[int, ...]]:
        """All groups along ``axis``, each once, ordered by their first rank."""
        axis = ParallelAxis(axis)
        if axis in _GRID_DIMS:  # the plain axes, from the grid at once
            return list(map(tuple, self.group_rows(axis).tolist()))
        seen: set[int] = set()
        out: list[tuple[int, ...]] = []
        for r in range(self.num_gpus):
            if r in seen:
                continue
            g = self.group_of(r, axis)
            seen.update(g)
            out.append(g)
        return sorted(out, key=lambda g: g[0])

    # ---- groups active at once (contention) ------------------------------------------------
    def node_local_groups(self, groups: np.ndarray) -> np.ndarray:
        """When every group lies inside one node, only the groups of the first node: transfers
        inside a node use that node's links only, and the nodes are alike, so groups on other
        nodes neither slow these down nor contend differently among themselves."""
        gpn = self.topology.gpus_per_node
        nodes = groups // gpn
        if len(groups) and bool((nodes == nodes[:, :1]).all()):
            first: np.ndarray = groups[nodes[:, 0] == 0]
            return first
        return groups

    @property
    def rails_alike(self) -> bool:
        """One NIC per GPU on rails of a symmetric cluster: each GPU index's GPU links, NIC and
        rail leaves are alike and disjoint from the other indices' (:meth:`one_rail_groups`)."""
        topo = self.topology
        gpn = topo.gpus_per_node
        return (
            topo.symmetric
            and topo.nics is not None
            and topo.fabric.rails
            and topo.nics.count == gpn
            and gpn >= 2
        )

    def pipeline_pairs(self, *, node_local: bool = False) -> np.ndarray:
        """The pipeline sends of every stage but the last to the next, one row (sender, receiver)
        per rank, in rank order; with ``node_local``, those of the first GPU index only where
        :meth:`one_rail_groups` would keep them.

        (dp d, pp s, cp k, tp t) -> (d, s + 1, k, t): the next stage is a fixed rank offset in
        either layout (cp x tp with dp outermost, dp x cp x tp with pp outermost). With pp
        outermost, a stage a whole number of nodes and that offset a whole number of nodes, every
        send keeps its GPU index and the senders are the ranks below the last stage, so each
        index's rows are the first index's moved to it: the first index's rows are made directly
        (a 65,536-GPU plan's 57,344 rows are not built to keep 7,168 of them)."""
        step = self.tp * self.cp * (self.dp if self.pp_outer else 1)
        gpn = self.topology.gpus_per_node
        stage_size = self.num_gpus // self.pp
        whole_nodes = stage_size % gpn == 0 and step % gpn == 0
        if node_local and self.pp_outer and whole_nodes and self.rails_alike:
            first = np.arange(0, (self.pp - 1) * stage_size, gpn, dtype=np.int64)
            return np.stack([first, first + step], axis=1)
        senders = np.sort(self.grid()[:-1].ravel())
        rows = np.stack([senders, senders + step], axis=1)
        return self.one_rail_groups(rows) if node_local else rows

    def one_rail_groups(self, groups: np.ndarray) -> np.ndarray:
        """When each group keeps to one index inside its nodes (the GPU and NIC of that index,
        so the rail of that NIC), and the groups of every other index are these moved to it, only
        the groups of the first index: with one NIC per GPU on rails, the indices use disjoint
        links (GPU links, NIC, rail leaves) that are alike, so the axis contends on all of them
        exactly when it does on one."""
        gpn = self.topology.gpus_per_node
        if not len(groups) or not self.rails_alike:
            return groups
        local = groups % gpn
        if not bool((local == local[:, :1]).all()):
            return groups
        index = local[:, 0]
        first: np.ndarray = groups[index == index[0]]
        # every other index's groups, moved to the first index, are the first index's groups (in
        # the same order: the rows come ordered by first rank, which a move within nodes keeps);
        # all indices at once: the rows of each index in order, shifted, as blocks like the first
        num_indices = len(set(index.tolist()))
        if len(groups) != num_indices * len(first):
            return groups
        order = np.argsort(index, kind="stable")
        moved = groups[order] - (index[order] - index[0])[:, None]
        if not bool((moved.reshape(num_indices, *first.shape) == first).all()):
            return groups
        return first

    def active_groups(self, *, node_local: bool = False) -> dict[ParallelAxis, np.ndarray]:
        """Every group of each axis that may be active at once (the engine's contention check),
        one per row; with context parallelism the dense gradients are reduced over dp x cp.
        ``node_local``: where every group of an axis lies inside one node, only those of the
        first node (:meth:`node_local_groups`), and where the groups of each GPU index keep to
        its rail, only those of the first index (:meth:`one_rail_groups`): enough to decide
        contention, not to name every shared link."""
        tp = self.group_rows(ParallelAxis.TP)
        dp = self.group_rows(ParallelAxis.DP if self.cp == 1 else ParallelAxis.DP_CP)
        if node_local:
            tp, dp = self.node_local_groups(tp), self.one_rail_groups(self.node_local_groups(dp))
        out: dict[ParallelAxis, np.ndarray] = {
            ParallelAxis.TP: tp,
            ParallelAxis.DP: dp,
            ParallelAxis.PP: self.pipeline_pairs(node_local=node_local),
        }
        for axis, size in ((ParallelAxis.EP, self.ep), (ParallelAxis.CP, self.cp)):
            if size > 1:
                groups = self.group_rows(axis)
                out[axis] = self.node_local_groups(groups) if node_local else groups
        return out

    def stage_ranks(self, stage: int) -> list[int]:
        """All ranks that run pipeline stage ``stage`` (every tp, cp and dp index, in the
        order (dp, cp, tp))."""
        ranks: list[int] = self.grid()[stage].ravel().tolist()
        return ranks

    def chunk_layers(self, stage: int, chunk: int) -> range:
        """Global layer indices of model chunk ``chunk`` on ``stage`` (the model part the
        schedule places there: virtual stage c*pp+s, or the V of DualPipeV)."""
        sizes = self._sizes()
        v = self.pipeline_schedule.part_of(stage, chunk, self.pp, self.virtual_stages)
        first = sum(sizes[:v])
        return range(first, first + sizes[v])

    def stage_layers(self, stage: int) -> list[int]:
        """Global layer indices of every chunk of ``stage``, in chunk order."""
        return [i for c in range(self.virtual_stages) for i in self.chunk_layers(stage, c)]


DEFAULT_ORDER = RankOrder.PP_OUTER
"""The layout of every supported stack: Megatron-Core's default ``tp-cp-ep-dp-pp`` and
torchtitan's device mesh (pp outermost, tp innermost); see :class:`RankOrder`."""


def default_order() -> RankOrder:
    """The rank layout of a plan that does not set ``parallel.order``: :data:`DEFAULT_ORDER`,
    whatever the model and the plan (every supported stack lays ranks out the same way)."""
    return DEFAULT_ORDER


def build_plan(
    topology: Topology,
    spec: TransformerSpec,
    training: TrainingConfig,
    parallel: ParallelConfig,
    *,
    for_simulation: bool = True,
) -> Plan:
    """Check a plan against the model and the cluster, and map its ranks.

    Args:
        for_simulation: kept for callers (every checked plan can be simulated: the step
            schedule prices EP, etp, CP and HSDP traffic); no effect.

    Raises:
        ConfigError: tp x cp x pp x dp is not the cluster's GPU count (``parallel``), heads
            not divisible by tp (``parallel.tp``), fewer layers than pp x virtual_stages or
            explicit layer counts that do not add up (``parallel.pp``,
            ``parallel.layers_per_stage``), experts not divisible by ep or ep x etp not
            dividing tp x cp x dp (``parallel.ep``), the sequence not divisible by cp (2 x cp
            with load balancing, ``parallel.cp``), kv_heads not dividing heads
            (``model.kv_heads``), global batch not divisible by micro_batch x dp
            (``training.global_batch``), interleaving with a micro-batch count that is not a
            multiple of pp (``parallel.schedule``, Megatron's rule).

    Warns:
        CollsimWarning: tp larger than a node; fewer micro-batches than stages (bubble).
    """
    tp, pp, dp, cp = parallel.tp, parallel.pp, parallel.dp, parallel.cp
    gpus = topology.num_ranks
    if tp * cp * pp * dp != gpus:
        if cp == 1:
            sizes = f"tp x pp x dp = {tp} x {pp} x {dp} = {tp * pp * dp}"
        else:
            sizes = f"tp x cp x pp x dp = {tp} x {cp} x {pp} x {dp} = {tp * cp * pp * dp}"
        raise ConfigError(
            f"{sizes} must equal the GPUs of the "
            f"cluster (cluster.nodes x gpus per node = {topology.num_nodes} x "
            f"{topology.gpus_per_node} = {gpus})",
            key_path="parallel",
        )
    if spec.num_heads % tp:
        raise ConfigError(
            f"model heads ({spec.num_heads}) must be divisible by tp, got {tp}",
            key_path="parallel.tp",
        )
    if spec.ffn_hidden % tp:
        raise ConfigError(
            f"model ffn_hidden ({spec.ffn_hidden}) must be divisible by tp, got {tp}",
            key_path="parallel.tp",
        )
    sizes_per_chunk = chunk_sizes(spec, parallel)
    check_experts_and_context(spec, training, parallel)
    check_torch_cp(training, parallel)
    if training.global_batch % (training.micro_batch * dp):
        raise ConfigError(
            f"global batch ({training.global_batch}) must be divisible by micro_batch x dp = "
            f"{training.micro_batch} x {dp}",
            key_path="training.global_batch",
        )
    m = training.global_batch // (training.micro_batch * dp)
    pipeline = get_schedule(parallel.schedule)
    pipeline.check(num_stages=pp, num_microbatches=m, virtual_stages=parallel.virtual_stages)
    notes: list[str] = []
    if tp > topology.gpus_per_node:
        notes.append(
            f"tp ({tp}) is larger than a node ({topology.gpus_per_node} GPUs): "
            "tensor-parallel collectives cross the network"
        )
    if m < pp:
        notes.append(
            f"fewer micro-batches ({m}) than pipeline stages ({pp}): most of the step "
            "is pipeline bubble"
        )
    order = parallel.order or default_order()
    if order is RankOrder.DP_OUTER and pp > 1 and parallel.ep * parallel.etp > tp * cp:
        notes.append(
            f"order {order.value} with ep x etp = {parallel.ep * parallel.etp} > tp x cp = "
            f"{tp * cp}: expert groups stride over the {pp} pipeline stages (Megatron-Core "
            "requires edp = dp without pp outermost)"
        )
    uneven = uneven_split_note(sizes_per_chunk, parallel)
    if uneven:
        notes.append(uneven)
    for note in notes:
        warnings.warn(note, CollsimWarning, stacklevel=2)
    parallel = _with_fp8_params(training, parallel)
    check_tp_overlap(
        tp_overlap_of(parallel.tp_overlap_mode, training.stack),
        tp=tp,
        sequence_parallel=parallel.sequence_parallel,
        execution=str(training.execution),
    )
    plan = Plan(
        topology=topology,
        spec=spec,
        training=training,
        parallel=parallel,
        num_microbatches=m,
        warnings=tuple(notes),
        chunk_sizes=tuple(sizes_per_chunk),
        order=order,
    )

    check_dispatch(plan)  # the dispatch keys against the EP groups' nodes
    return plan


def dp_variant_plan(plan: Plan, parallel: ParallelConfig) -> Plan:
    """The plan :func:`build_plan` makes for ``parallel``, a config that differs from the one
    ``plan`` was built from only in knobs none of its checks reads (``ddp``: buckets,
    overlap; ``fsdp.prefetch``): ``plan``'s checked facts (micro-batches, warnings, layer
    split, rank order) with ``parallel`` in place, checked and mapped once per program
    instead of once per variant (the caller checks that only those knobs differ:
    :func:`collsim.step.build.ddp_variant`)."""
    return dataclasses.replace(plan, parallel=_with_fp8_params(plan.training, parallel))


def _with_fp8_params(training: TrainingConfig, parallel: ParallelConfig) -> ParallelConfig:
    """``parallel`` with the FP8 weight all-gather on when the plan keeps FP8 parameters
    (``training.fp8_param_gather``: :func:`collsim.workload.fp8.fp8_param_gather_of`)."""
    on = fp8_param_gather_of(
        training.stack,
        training.fp8_param_gather,
        fp8=str(training.dtype) == "fp8",
        zero=parallel.zero,
    )
    if not on or parallel.fsdp.fp8_all_gather:
        return parallel
    out = copy.copy(parallel)
    object.__setattr__(out, "fsdp", dataclasses.replace(parallel.fsdp, fp8_all_gather=True))
    return out
