"""Data-parallel work of the engine: model states, DDP/ZeRO buckets, FSDP units, optimizer.

ZeRO (Rajbhandari et al. 2020) and FSDP (Zhao et al. 2023) over the DP group of size N:
stage 0 is DDP (torch reducer: bucketed all-reduce in the last micro-batch's backward,
``no_sync`` before); stage 1 reduce-scatters buckets after the last micro-batch and
all-gathers the updated parameters after the optimizer (Megatron's distributed optimizer);
stage 2 reduce-scatters buckets in every micro-batch's backward (DeepSpeed keeps only the
reduced partition); stage 3 gathers each unit before its forward and backward and
reduce-scatters its gradient after its backward, in every micro-batch. Model states per GPU
follow: parameters 2 (4 in fp32) bytes per parameter, / N at stage 3; gradients the same, / N
from stage 2; optimizer state K bytes (12 for mixed-precision Adam: fp32 master, m, v), / N
from stage 1. With ``fsdp.offload`` the shards live in host memory: each gather first copies
the shard over PCIe (``topology.host_bandwidth_bps``), each reduce-scatter copies the gradient
shard back, and the optimizer runs on the CPU.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import simpy

from collsim.engine.comm import linked_peers
from collsim.engine.stage import ChunkModel, Segment
from collsim.errors import SimulationError
from collsim.parallel.buckets import Bucket
from collsim.parallel.plan import Plan
from collsim.parallel.schedules import Phase, PipeOp

if TYPE_CHECKING:
    from collsim.engine.program import RankProgram

__all__ = ["DataParallelMixin"]


class DataParallelMixin:
    """The data-parallel methods of :class:`~collsim.engine.core.Engine`."""

    plan: Plan
    env: simpy.Environment
    zero: int
    offload: bool
    bytes_per: dict[str, float]
    host_bps: float
    all_ranks: bool
    des_axes: frozenset[str]
    unit_events: dict[tuple[int, int, Any], simpy.Event]
    optimizer_time: Callable[[float, bool], float]

    def group(self, rank: int, axis: str) -> tuple[int, ...]:  # pragma: no cover - Engine
        raise NotImplementedError

    def peers(self, rank: int, axis: str) -> list[tuple[int, ...]]:  # pragma: no cover
        raise NotImplementedError

    def _call(self, *args: Any, **kwargs: Any) -> simpy.Event:  # pragma: no cover - Engine
        raise NotImplementedError

    def allocate_states(self, prog: RankProgram) -> None:
        n = float(self.plan.dp)
        numel = float(prog.stage.numel)
        b = self.bytes_per
        params = numel * b["param"] / (n if self.zero >= 3 else 1.0)
        grads = numel * b["grad"] / (n if self.zero >= 2 else 1.0)
        states = numel * b["optimizer"] / (n if self.zero >= 1 else 1.0)
        if self.offload:
            params = grads = states = 0.0
        prog.ledger.alloc(0.0, "parameters", params, "parameters")
        prog.ledger.alloc(0.0, "gradients", grads, "gradients")
        prog.ledger.alloc(0.0, "optimizer", states, "optimizer state")
        prog.ledger.alloc(0.0, "buffers", self.ddp_bucket_bytes(prog), "ddp buckets")

    def ddp_bucket_bytes(self, prog: RankProgram) -> float:
        """Bytes of torch DDP's flat bucket tensors kept beside ``param.grad``.

        torch ``DistributedDataParallel`` (C++ ``Reducer::initialize_buckets``) allocates one
        flat gradient tensor per bucket for the life of the model; with
        ``gradient_as_bucket_view=False`` (torch's default) ``param.grad`` is a separate tensor,
        so the gradients are held twice; with True, ``param.grad`` is a view into its bucket
        and nothing is added. Only plain DDP (ZeRO 0) over more than one replica builds them.
        """
        ddp = self.plan.parallel.ddp
        if self.zero != 0 or self.plan.dp < 2 or ddp.gradient_as_bucket_view:
            return 0.0
        return float(prog.stage.numel) * self.bytes_per["grad"]

    def reduces_in(self, microbatch: int) -> bool:
        """Does this micro-batch's backward reduce gradients? (no_sync before the last)."""
        if self.plan.dp < 2:
            return False
        return self.zero == 2 or microbatch == self.plan.num_microbatches - 1

    def launch_bucket(
        self, prog: RankProgram, op: PipeOp, chunk: ChunkModel, bucket: Bucket, ready: float
    ) -> None:
        """Issue a bucket's reduction on the dp stream at its ready time.

        Without overlap the reductions wait for the end of the rank's whole backward (all
        micro-batches and chunks), as Megatron-LM did before overlapped gradient reduction.
        """
        if not self.plan.parallel.ddp.overlap:
            prog.deferred.append((op, chunk, bucket))
            return
        verb = "all_reduce" if self.zero == 0 else "reduce_scatter"
        group = self.group(prog.rank, "dp")
        ev = self._call(
            prog.rank,
            "dp",
            verb,
            bucket.size_bytes,
            group,
            f"{verb} bucket {bucket.index} c{chunk.index} mb{op.microbatch}",
            ready_s=ready,
            peers=self.peers(prog.rank, "dp"),
        )
        prog.dp_events.append(ev)
        if self.zero == 2:
            prog.ledger.alloc(ready, "buffers", bucket.size_bytes, "zero2 bucket")
            ev.callbacks.append(self._freer(prog, "buffers", bucket.size_bytes, "zero2 bucket"))

    def launch_deferred(self, prog: RankProgram) -> None:
        """Without overlap: issue every bucket now, after the last backward."""
        deferred, prog.deferred = prog.deferred, []
        overlap = self.plan.parallel.ddp.overlap
        for op, chunk, bucket in deferred:
            if overlap:  # pragma: no cover - deferred only without overlap
                raise SimulationError("deferred buckets with overlap on")
            verb = "all_reduce" if self.zero == 0 else "reduce_scatter"
            ev = self._call(
                prog.rank,
                "dp",
                verb,
                bucket.size_bytes,
                self.group(prog.rank, "dp"),
                f"{verb} bucket {bucket.index} c{chunk.index} mb{op.microbatch}",
                peers=self.peers(prog.rank, "dp"),
            )
            prog.dp_events.append(ev)
            if self.zero == 2:
                prog.ledger.alloc(self.env.now, "buffers", bucket.size_bytes, "zero2 bucket")
                ev.callbacks.append(self._freer(prog, "buffers", bucket.size_bytes, "zero2 bucket"))

    def _freer(
        self, prog: RankProgram, category: str, size_bytes: float, label: str
    ) -> Callable[[simpy.Event], None]:
        """A SimPy callback that frees ``size_bytes`` of ``category`` when its event fires."""

        def free(_event: simpy.Event) -> None:
            prog.ledger.free(self.env.now, category, size_bytes, label)

        return free

    @staticmethod
    def unit_key(chunk: ChunkModel, seg: Segment) -> str | int:
        """FSDP unit of a segment. With the embedding and the head in one chunk, both belong
        to the root unit (torch FSDP: the root holds the non-wrapped, possibly tied,
        parameters; it is gathered for the whole forward and backward, never resharded after
        forward, and reduce-scattered at the end of backward)."""
        if seg.key in ("embedding", "head") and chunk.has_root:
            return "root"
        return seg.key

    @staticmethod
    def unit_numel(chunk: ChunkModel, key: str | int) -> float:
        keys = ("embedding", "head") if key == "root" else (key,)
        return float(sum(t.numel for t in chunk.tensors if t.segment in keys))

    def gather_unit(self, prog: RankProgram, op: PipeOp, chunk: ChunkModel, seg: Segment) -> None:
        ukey = self.unit_key(chunk, seg)
        key = (prog.rank, chunk.index, ukey)
        if key in self.unit_events:
            return  # still gathered (root, no reshard after forward), or in flight
        size = self.unit_numel(chunk, ukey) * self.bytes_per["param"]
        prog.ledger.alloc(self.env.now, "parameters", size, f"gathered {ukey}")
        extra = size / self.plan.dp / self.host_bps if self.offload else 0.0
        self.unit_events[key] = self._call(
            prog.rank,
            "dp",
            "all_gather",
            size,
            self.group(prog.rank, "dp"),
            f"all_gather {ukey} c{chunk.index} mb{op.microbatch} {op.phase.value}",
            extra_s=extra,
            peers=self.peers(prog.rank, "dp"),
        )

    def unit_ready(
        self, prog: RankProgram, op: PipeOp, chunk: ChunkModel, seg: Segment
    ) -> simpy.Event | None:
        return self.unit_events.get((prog.rank, chunk.index, self.unit_key(chunk, seg)))

    def release_unit(self, prog: RankProgram, op: PipeOp, chunk: ChunkModel, seg: Segment) -> None:
        """After a unit's forward: reshard. After its backward: reduce-scatter, reshard."""
        forward = op.phase is Phase.FORWARD
        ukey = self.unit_key(chunk, seg)
        if ukey == "root" and (forward or seg.key != "embedding"):
            return  # the root stays gathered until its last backward segment
        if forward and not self.plan.parallel.fsdp.reshard_after_forward:
            return
        numel = self.unit_numel(chunk, ukey)
        if not forward:
            gsize = numel * self.bytes_per["grad"]
            label = f"grad {ukey}"
            prog.ledger.alloc(self.env.now, "buffers", gsize, label)
            if self.plan.dp > 1 or self.offload:
                extra = gsize / self.plan.dp / self.host_bps if self.offload else 0.0
                ev = self._call(
                    prog.rank,
                    "dp",
                    "reduce_scatter",
                    gsize,
                    self.group(prog.rank, "dp"),
                    f"reduce_scatter {ukey} c{chunk.index} mb{op.microbatch}",
                    extra_s=extra,
                    peers=self.peers(prog.rank, "dp"),
                )
                prog.dp_events.append(ev)
                ev.callbacks.append(self._freer(prog, "buffers", gsize, label))
            else:
                prog.ledger.free(self.env.now, "buffers", gsize, label)
        del self.unit_events[(prog.rank, chunk.index, ukey)]
        prog.ledger.free(
            self.env.now, "parameters", numel * self.bytes_per["param"], f"reshard {ukey}"
        )

    def embedding_sync(self, prog: RankProgram) -> simpy.Event | None:
        """Tied embeddings with pp > 1: all-reduce the word-embedding gradient between the
        first and the last stage before the optimizer (Megatron-LM ``allreduce_embedding_grads``;
        the group is each (dp, tp) pair of stage 0 and stage p - 1)."""
        p = self.plan.pp
        if p < 2 or not self.plan.spec.tied_embeddings or prog.coords.pp not in (0, p - 1):
            return None
        c = prog.coords
        pair = (self.plan.rank(dp=c.dp, pp=0, tp=c.tp), self.plan.rank(dp=c.dp, pp=p - 1, tp=c.tp))
        size = self.plan.spec.vocab / self.plan.tp * self.plan.spec.hidden * self.bytes_per["grad"]
        peers = (
            []
            if self.all_ranks or "pp" not in self.des_axes
            else linked_peers(
                self.plan.topology,
                pair,
                [
                    (self.plan.rank(dp=d, pp=0, tp=t), self.plan.rank(dp=d, pp=p - 1, tp=t))
                    for d in range(self.plan.dp)
                    for t in range(self.plan.tp)
                    if d or t
                ],
            )
        )
        return self._call(
            prog.rank,
            "pp",
            "all_reduce",
            size,
            pair,
            "all_reduce embedding grad",
            peers=peers,
            stream_group=pair,
        )

    def optimizer_s(self, prog: RankProgram) -> float:
        local = prog.stage.numel / (self.plan.dp if self.zero >= 1 else 1)
        return float(self.optimizer_time(local, self.offload))

    def after_optimizer(self, prog: RankProgram) -> simpy.Event | None:
        """ZeRO-1/2: all-gather the updated parameters, bucket by bucket (None otherwise)."""
        if self.zero not in (1, 2) or self.plan.dp < 2:
            return None
        last = None
        group = self.group(prog.rank, "dp")
        for chunk in prog.stage.chunks:
            for bucket in chunk.buckets:
                last = self._call(
                    prog.rank,
                    "dp",
                    "all_gather",
                    bucket.numel * self.bytes_per["param"],
                    group,
                    f"all_gather params bucket {bucket.index} c{chunk.index}",
                    peers=self.peers(prog.rank, "dp"),
                )
        return last
