"""Data-parallel rules of a step: model states, DDP/ZeRO buckets, FSDP units, optimizer.

Derivations, measurements and sources: docs/derivations.md, ``collsim.step.dataparallel``.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from collsim.core.vocab import ParallelAxis
from collsim.parallel.buckets import Bucket
from collsim.parallel.fsdp import grad_sync_of
from collsim.parallel.plan import Plan
from collsim.parallel.states import rank_model_states
from collsim.step.ops import ChunkModel, Segment, StageModel

DP, EDP = ParallelAxis.DP, ParallelAxis.EDP

__all__ = [
    "BytesPer",
    "DPCall",
    "DataParallelRules",
    "GRAD_NORM_BYTES",
    "StateBytes",
    "grad_norm_groups",
]

GRAD_NORM_BYTES = 4.0
"""The global gradient norm travels as one fp32 scalar: Megatron-LM ``get_grad_norm_fp32``
(megatron/core/optimizer/clip_grads.py) all-reduces a one-element float tensor of the summed
squares; torch ``clip_grad_norm_`` reduces the local norms the same way (one value per call)."""


def grad_norm_groups(plan: Plan, rank: int) -> list[tuple[ParallelAxis, tuple[int, ...]]]:
    """The all-reduces of the global gradient norm before the clipped optimizer step, in
    order (none without ``training.grad_clip``).

    Every model-parallel rank of a replica (tp x cp x pp) holds other parameters, so the
    squared norms are summed over the replica's ``mp`` group (Megatron's model-parallel group
    in ``get_grad_norm_fp32``); when the gradients are sharded over data parallelism (ZeRO /
    FSDP) or experts are split by expert parallelism, the data-parallel ranks hold different
    pieces too and the sum also runs over the rank's dp group (Megatron's distributed
    optimizer reduces over its grad-stats group, model x data parallel; FSDP's
    ``clip_grad_norm_`` over the shard group). The world-wide sum is priced as these two
    reductions. Groups of one rank are left out.
    """
    if not plan.training.grad_clip:
        return []
    out: list[tuple[ParallelAxis, tuple[int, ...]]] = []
    mp = plan.group_of(rank, ParallelAxis.MP)
    if len(mp) > 1:
        out.append((ParallelAxis.MP, mp))
    if plan.dp > 1 and (plan.parallel.zero >= 1 or plan.ep > 1):
        out.append((ParallelAxis.DP, plan.group_of(rank, ParallelAxis.DP)))
    return out


@dataclass(frozen=True, slots=True, kw_only=True)
class BytesPer:
    """Bytes per parameter of each model state, and per activation element."""

    param: float
    grad: float
    optimizer: float
    activation: float


@dataclass(frozen=True, slots=True)
class DPCall:
    """One data-parallel collective: op, nccl-tests size and the plan axis of its group."""

    op: str
    size_bytes: float
    axis: str


@dataclass(frozen=True, slots=True, kw_only=True)
class StateBytes:
    """Model states of one rank, allocated for the whole step (bytes)."""

    parameters: float
    gradients: float
    optimizer: float
    ddp_buckets: float


@dataclass(frozen=True, slots=True, kw_only=True)
class DataParallelRules:
    """What the data-parallel dimension adds to a rank's step (see docs/derivations.md)."""

    dp: int
    zero: int
    overlap: bool
    """DDP / ZeRO-1/2 buckets reduce as their gradients are ready (else after backward)."""
    prefetch: int
    """ZeRO-3: units gathered ahead of the one computing."""
    reshard_after_forward: bool
    offload: bool
    gradient_as_bucket_view: bool
    num_microbatches: int
    bytes_per: BytesPer
    host_bps: float

    dense_groups: tuple[tuple[str, int], ...] = ((DP, 1), (DP, 1), ("", 1))
    """Non-expert gradients: (axis, size) of the whole reduction group, of the shard group and
    of the replicate group ("" when there is none)."""
    expert_groups: tuple[tuple[str, int], ...] = ((EDP, 1), (EDP, 1), ("", 1))
    """The same for the routed-expert gradients."""
    reduce_element_bytes: float = 0.0
    """Bytes per gradient element on the wire (fsdp.reduce_dtype; 0: the gradient dtype)."""
    gather_element_bytes: float = 0.0
    """Bytes per gathered weight element (1 with fp8_all_gather; 0: the parameter dtype)."""
    shard_sizes: tuple[int, int] = (1, 1)
    """(N, N_e): the shard groups of the non-expert and expert states (states.py)."""
    extra_parameter_bytes: tuple[float, ...] = ()
    """Per stage: FP8 weight copies and scales (zero < 3)."""
    sync_once: bool = False
    """ZeRO-3: gradients accumulate unsharded over the micro-batches and are reduced once, at
    each unit's last backward (``parallel.fsdp.grad_sync: step``,
    :func:`collsim.parallel.fsdp.grad_sync_of`); a unit is not resharded after a backward
    before then."""
    _units: dict[tuple[int, str | int, str], Any] = field(
        default_factory=dict, compare=False, repr=False
    )
    """Per (chunk, unit, what): the unit's calls and sizes, computed once (a step issues them
    for every micro-batch)."""
    _bucket_calls: dict[tuple[float, bool], list[DPCall]] = field(
        default_factory=dict, compare=False, repr=False
    )
    """Per bucket shape (elements, expert): its reduction calls (:meth:`bucket_calls`)."""
    _bucket_gathers: dict[tuple[float, bool], list[DPCall]] = field(
        default_factory=dict, compare=False, repr=False
    )
    """Per bucket shape (elements, expert): its gathers after the optimizer."""

    @classmethod
    def from_plan(cls, plan: Plan, bytes_per: BytesPer, *, host_bps: float) -> DataParallelRules:
        par = plan.parallel
        full = DP if plan.cp == 1 else ParallelAxis.DP_CP
        hsdp = plan.shard_group_size != plan.dp
        n_full = plan.dp * plan.cp
        fp8_copies = str(plan.training.dtype) == "fp8" and par.zero < 3
        if plan.spec.is_moe or fp8_copies:
            states = [rank_model_states(plan, s) for s in range(plan.pp if fp8_copies else 1)]
            n, n_e = states[0].shard_group, max(1, int(states[0].expert_shard_group))
            extra = tuple(st.fp8_copy_bytes for st in states) if fp8_copies else ()
        else:  # rank_model_states' shard group without experts: dp_shard x cp
            n, n_e, extra = plan.shard_group_size * plan.cp, 1, ()
        edp = plan.edp if plan.spec.is_moe else 1
        if not plan.spec.is_moe:
            n_e = 1
        dense: tuple[tuple[str, int], ...]
        expert: tuple[tuple[str, int], ...]
        if hsdp:
            dense = (
                (full, n_full),
                (ParallelAxis.DP_CP_SHARD, n),
                (ParallelAxis.DP_REPLICATE, n_full // n),
            )
            expert = (
                (EDP, edp),
                (ParallelAxis.EDP_SHARD, n_e),
                (ParallelAxis.EDP_REPLICATE, edp // n_e),
            )
        else:
            dense = ((full, n_full), (full, n_full), ("", 1))
            expert = ((EDP, edp), (EDP, edp), ("", 1))
        reduce = par.fsdp.reduce_dtype
        return cls(
            dp=plan.dp,
            zero=par.zero,
            overlap=par.ddp.overlap,
            prefetch=par.fsdp.prefetch,
            reshard_after_forward=par.fsdp.reshard_after_forward,
            offload=par.zero == 3 and par.fsdp.offload,
            gradient_as_bucket_view=par.ddp.gradient_as_bucket_view,
            num_microbatches=plan.num_microbatches,
            bytes_per=bytes_per,
            host_bps=host_bps,
            dense_groups=dense,
            expert_groups=expert,
            reduce_element_bytes=4.0 if reduce is not None and str(reduce) == "fp32" else 0.0,
            gather_element_bytes=1.0 if par.fsdp.fp8_all_gather else 0.0,
            shard_sizes=(n, n_e),
            extra_parameter_bytes=extra,
            sync_once=par.zero == 3
            and plan.num_microbatches > 1
            and grad_sync_of(par, plan.training) == "step",
        )

    # ---- sizes ---------------------------------------------------------------------------------
    @property
    def reduce_bytes(self) -> float:
        """Bytes per gradient element in a reduction."""
        return self.reduce_element_bytes or self.bytes_per.grad

    @property
    def gather_bytes_per(self) -> float:
        """Bytes per weight element in a parameter all-gather."""
        return self.gather_element_bytes or self.bytes_per.param

    @property
    def any_group(self) -> int:
        """The largest gradient-reduction group (1: nothing to reduce)."""
        return max(self.dense_groups[0][1], self.expert_groups[0][1])

    def _groups(self, expert: bool) -> tuple[tuple[str, int], ...]:
        return self.expert_groups if expert else self.dense_groups

    def reduce_calls(self, numel: float, *, expert: bool, shard: bool) -> list[DPCall]:
        """The collectives reducing ``numel`` gradient elements of one kind: an all-reduce
        over the whole group (``shard`` False: DDP), or a reduce-scatter inside the shard
        group then an all-reduce of the shard across the replicas (ZeRO / FSDP / HSDP)."""
        size = numel * self.reduce_bytes
        (full, n_full), (sh, n_sh), (rep, n_rep) = self._groups(expert)
        if size <= 0:
            return []
        if not shard:
            return [DPCall("all_reduce", size, full)] if n_full > 1 else []
        out = []
        if n_sh > 1:
            out.append(DPCall("reduce_scatter", size, sh))
        if n_rep > 1:
            out.append(DPCall("all_reduce", size / n_sh, rep))
        return out

    def gather_calls(self, numel: float, *, expert: bool) -> list[DPCall]:
        """The all-gather of ``numel`` sharded weight elements of one kind (inside its shard
        group)."""
        _, (sh, n_sh), _ = self._groups(expert)
        size = numel * self.gather_bytes_per
        return [DPCall("all_gather", size, sh)] if n_sh > 1 and size > 0 else []

    # ---- memory ------------------------------------------------------------------------------
    def state_bytes(self, stage: StageModel) -> StateBytes:
        """Model states of a rank of ``stage``: the ZeRO table with non-expert states sharded
        over N and routed-expert states over N_e
        (:func:`collsim.parallel.states.rank_model_states`), FP8 weight copies counted with
        the parameters."""
        n, n_e = (float(x) for x in self.shard_sizes)
        dense, expert = stage.split_numel()
        b = self.bytes_per

        def part(per: float, from_zero: int) -> float:
            if self.zero >= from_zero:
                return dense * per / n + expert * per / n_e
            return (dense + expert) * per

        params = part(b.param, 3)
        grads = part(b.grad, 2)
        states = part(b.optimizer, 1)
        if self.sync_once:
            # the unsharded accumulators of every FSDP-managed part, for the whole step; a
            # part with a shard group of one is left out of FSDP (NeMo Automodel passes the
            # experts as ignored_params when they are not sharded, nemo_automodel/components/
            # moe/parallelizer.py apply_fsdp at 005f663) and keeps its plain gradient
            grads += (dense * (n > 1) + expert * (n_e > 1)) * self.reduce_bytes
        if self.extra_parameter_bytes:
            params += self.extra_parameter_bytes[stage.stage]
        if self.offload:
            params = grads = states = 0.0
        return StateBytes(
            parameters=params,
            gradients=grads,
            optimizer=states,
            ddp_buckets=self.ddp_bucket_bytes(stage),
        )

    def ddp_bucket_bytes(self, stage: StageModel) -> float:
        """Bytes of torch DDP's flat bucket tensors kept beside ``param.grad``.

        torch ``DistributedDataParallel`` (C++ ``Reducer::initialize_buckets``) allocates one
        flat gradient tensor per bucket for the life of the model; with
        ``gradient_as_bucket_view=False`` (torch's default) ``param.grad`` is a separate tensor,
        so the gradients are held twice; with True, ``param.grad`` is a view into its bucket
        and nothing is added. Only plain DDP (ZeRO 0) over more than one replica builds them.
        """
        if self.zero != 0 or self.any_group < 2 or self.gradient_as_bucket_view:
            return 0.0
        return float(stage.numel) * self.bytes_per.grad

    # ---- buckets (ZeRO 0-2) ------------------------------------------------------------------
    @property
    def uses_buckets(self) -> bool:
        return self.zero in (0, 1, 2)

    def reduces_in(self, microbatch: int) -> bool:
        """Does this micro-batch's backward reduce gradients? (no_sync before the last)."""
        if self.any_group < 2:
            return False
        return self.zero == 2 or microbatch == self.num_microbatches - 1

    def reducing(self, count: int) -> tuple[bool, ...]:
        """:meth:`reduces_in` of micro-batches ``0 .. count - 1``, False for all without
        buckets."""
        if not self.uses_buckets or self.any_group < 2:
            return (False,) * count
        if self.zero == 2:
            return (True,) * count
        last = self.num_microbatches - 1
        return tuple([m == last for m in range(count)])

    @property
    def bucket_op(self) -> str:
        return "all_reduce" if self.zero == 0 else "reduce_scatter"

    @property
    def syncs_each_backward(self) -> bool:
        """ZeRO-2 with overlapped reductions waits for them at the end of every backward that
        reduces: DeepSpeed's stage 2 with ``overlap_comm`` ends each micro-step's backward with
        ``independent_gradient_partition_epilogue``, which reduces the last bucket and
        synchronizes the device (deepspeed/runtime/zero/stage_1_and_2.py at edaa722), so a
        micro-batch's reductions hide behind its own backward only, not behind the next
        forward."""
        return self.zero == 2 and self.overlap

    @property
    def holds_bucket_buffer(self) -> bool:
        """ZeRO-2 keeps a reduced bucket's buffer until its reduce-scatter ends."""
        return self.zero == 2

    def bucket_calls(self, bucket: Bucket) -> list[DPCall]:
        """The reduction of one bucket: DDP all-reduce, or ZeRO-1/2 reduce-scatter (+ the
        all-reduce across HSDP replicas), over the group of its kind. Computed once per
        bucket shape (a step reduces every bucket once per micro-batch or step): the list is
        shared, callers only read it."""
        key = (bucket.numel, bucket.expert)
        found = self._bucket_calls.get(key)
        if found is None:
            found = self._bucket_calls[key] = self.reduce_calls(
                bucket.numel, expert=bucket.expert, shard=self.zero != 0
            )
        return found

    @property
    def gathers_after_step(self) -> bool:
        """ZeRO-1/2 gather the updated parameters after the optimizer."""
        return self.zero in (1, 2)

    def gathers_after_optimizer(self, stage: StageModel) -> list[DPCall]:
        """ZeRO-1/2: the all-gathers of the updated parameters, bucket by bucket
        (:meth:`bucket_gathers`)."""
        if not self.gathers_after_step:
            return []
        out: list[DPCall] = []
        for chunk in stage.chunks:
            for bucket in chunk.buckets:
                out += self.bucket_gathers(bucket)
        return out

    def bucket_gathers(self, bucket: Bucket) -> list[DPCall]:
        """The gathers of one bucket's updated parameters after the optimizer, once per
        bucket shape (the list is shared, callers only read it)."""
        key = (bucket.numel, bucket.expert)
        calls = self._bucket_gathers.get(key)
        if calls is None:
            calls = self._bucket_gathers[key] = self.gather_calls(
                bucket.numel, expert=bucket.expert
            )
        return calls

    # ---- FSDP units (ZeRO 3) -----------------------------------------------------------------
    @staticmethod
    def unit_key(chunk: ChunkModel, seg: Segment) -> str | int:
        """FSDP unit of a segment. With the embedding and the head in one chunk, both belong
        to the root unit (torch FSDP: the root holds the non-wrapped, possibly tied,
        parameters; it is gathered for the whole forward and backward, never resharded after
        forward, and reduce-scattered at the end of backward)."""
        if seg.key in ("embedding", "head") and chunk.has_root:
            return "root"
        return seg.key

    def unit_numel(self, chunk: ChunkModel, key: str | int, expert: bool | None = None) -> float:
        """Elements of a unit's tensors (those of its routed experts or of the rest:
        ``expert``), added up in the chunk's order; the unit's tensors are listed once."""
        return self._unit_numel(chunk, key, expert)

    def _unit(self, chunk: ChunkModel, key: str | int, what: str) -> Any:
        slot = (id(chunk), key, what)
        hit = self._units.get(slot)
        if hit is None:
            numel = self._unit_numel
            if what == "numel":
                hit = numel(chunk, key, None)
            elif what == "gathers":
                hit = [
                    c
                    for expert in (False, True)
                    for c in self.gather_calls(numel(chunk, key, expert), expert=expert)
                ]
            else:
                hit = [
                    c
                    for expert in (False, True)
                    for c in self.reduce_calls(numel(chunk, key, expert), expert=expert, shard=True)
                ]
            self._units[slot] = hit
        return hit

    def _unit_numel(self, chunk: ChunkModel, key: str | int, expert: bool | None) -> float:
        """:meth:`unit_numel`, from every unit's elements added up in one pass over the
        chunk's tensors, in the chunk's order (all, non-expert, expert; the root's from the
        embedding's and the head's)."""
        slot = (id(chunk), "", "sums")
        sums = self._units.get(slot)
        if sums is None:
            sums = self._units[slot] = {}
            for t in chunk.tensors:
                keys = (t.segment, "root") if t.segment in ("embedding", "head") else (t.segment,)
                for k in keys:
                    acc = sums.get(k)
                    if acc is None:
                        acc = sums[k] = [0, 0, 0]
                    acc[0] += t.numel
                    acc[2 if t.expert else 1] += t.numel
        acc = sums.get(key)
        if acc is None:
            return 0.0
        return float(acc[0] if expert is None else acc[2] if expert else acc[1])

    def gather_bytes(self, chunk: ChunkModel, key: str | int) -> float:
        """Memory of a gathered unit (in the gathered dtype)."""
        return float(self._unit(chunk, key, "numel")) * self.gather_bytes_per

    def grad_bytes(self, chunk: ChunkModel, key: str | int) -> float:
        """Memory of a unit's unsharded gradient before its reduce-scatter (reduce dtype); 0
        when the gradients accumulate all step (:attr:`sync_once`: counted in
        :meth:`state_bytes`)."""
        if self.sync_once:
            return 0.0
        return float(self._unit(chunk, key, "numel")) * self.reduce_bytes

    def unit_gathers(self, chunk: ChunkModel, key: str | int) -> list[DPCall]:
        """A unit's all-gathers: its non-expert part, then its routed experts."""
        out: list[DPCall] = self._unit(chunk, key, "gathers")
        return out

    def unit_reductions(self, chunk: ChunkModel, key: str | int) -> list[DPCall]:
        """A unit's gradient reductions: its non-expert part, then its routed experts."""
        out: list[DPCall] = self._unit(chunk, key, "reductions")
        return out

    def offload_s(self, size_bytes: float) -> float:
        """PCIe copy of this rank's shard of ``size_bytes`` before a gather / after a
        reduce-scatter (FSDP CPU offload), else 0."""
        return size_bytes / self.shard_sizes[0] / self.host_bps if self.offload else 0.0

    def releases(
        self, chunk: ChunkModel, seg: Segment, *, forward: bool, microbatch: int | None = None
    ) -> bool:
        """Is the unit of ``seg`` released after it (resharded, and reduced in backward)?
        With :attr:`sync_once` a backward releases only in the last micro-batch (``None``:
        taken as the last)."""
        ukey = self.unit_key(chunk, seg)
        if ukey == "root" and (forward or seg.key != "embedding"):
            return False  # the root stays gathered until its last backward segment
        if forward:
            return self.reshard_after_forward
        return not (
            self.sync_once and microbatch is not None and microbatch < self.num_microbatches - 1
        )

    @property
    def reduces_units(self) -> bool:
        """ZeRO-3 reduce-scatters a unit's gradient (or copies it to the host with offload)."""
        return self.any_group > 1 or self.offload
