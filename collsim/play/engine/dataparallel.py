"""Data-parallel traffic of the engine: DDP/ZeRO buckets, FSDP units, embedding sync, optimizer.

The rules (what is reduced when, what each collective holds in memory) are the schedule's
:class:`~collsim.step.dataparallel.DataParallelRules`; this object plays them on the dp
stream of each simulated rank through a narrow interface of the engine (:class:`CallSite`):
issue a call on a group's stream, the rank's group and its peers on an axis.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Protocol

import simpy

from collsim.core.errors import SimulationError
from collsim.core.vocab import ParallelAxis
from collsim.parallel.buckets import Bucket
from collsim.parallel.pipeline import Phase, PipeOp
from collsim.parallel.plan import Plan
from collsim.play.engine.streams import RankState
from collsim.step.dataparallel import DataParallelRules, DPCall
from collsim.step.ops import ChunkModel, Segment

__all__ = ["CallSite", "DataParallel"]

DP = ParallelAxis.DP
PP = ParallelAxis.PP


class CallSite(Protocol):
    """What data-parallel work needs from the engine."""

    def call(
        self,
        rank: int,
        axis: str,
        op: str,
        size: float,
        ranks: tuple[int, ...],
        name: str,
        *,
        ready_s: float | None = None,
        extra_s: float = 0.0,
        peers: list[tuple[int, ...]] | None = None,
        stream_group: tuple[int, ...] | None = None,
    ) -> simpy.Event: ...

    def reserve(
        self,
        rank: int,
        axis: str,
        op: str,
        size: float,
        ranks: tuple[int, ...],
        *,
        ready_s: float,
        stream_group: tuple[int, ...] | None = None,
    ) -> float | None: ...

    def group(self, rank: int, axis: str) -> tuple[int, ...]: ...

    def peers(self, rank: int, axis: str) -> list[tuple[int, ...]]: ...

    def pair_peers(
        self, pair: tuple[int, int], peers: list[tuple[int, ...]]
    ) -> list[tuple[int, ...]]: ...


class DataParallel:
    """Plays the data-parallel rules of one step for the simulated ranks.

    Args:
        plan: the checked plan.
        rules: the schedule's data-parallel rules.
        site: the engine's call interface.
        env: the simulation environment.
    """

    def __init__(
        self, plan: Plan, rules: DataParallelRules, site: CallSite, env: simpy.Environment
    ) -> None:
        self.plan = plan
        self.rules = rules
        self.site = site
        self.env = env
        self.unit_events: dict[tuple[int, int, Any], simpy.Event] = {}
        self.meet_on_group = bool(getattr(site, "all_ranks", False)) and DP in getattr(
            site, "des_axes", ()
        )

    def issue(
        self,
        prog: RankState,
        calls: list[DPCall],
        name: str,
        *,
        ready: float | None = None,
        extra_s: float = 0.0,
    ) -> simpy.Event | None:
        """Issue ``calls`` one after another on the rank's dp stream (each on the group of its
        axis; the offload copy before the first); the last call's event, None if none."""
        last = None
        stream = self.site.group(prog.rank, DP)
        for i, c in enumerate(calls):
            group = self.site.group(prog.rank, c.axis)
            last = self.site.call(
                prog.rank,
                DP,
                c.op,
                c.size_bytes,
                group,
                name if len(calls) == 1 else f"{name} ({c.axis})",
                ready_s=ready,
                extra_s=extra_s if i == 0 else 0.0,
                peers=self.site.peers(prog.rank, c.axis),
                # all of a rank's dp calls in order on one stream; with every rank simulated
                # and dp on the DES, the members of the call's group meet on its own stream
                # (else each dp stream of the group would move the bytes again)
                stream_group=group if self.meet_on_group else stream,
            )
        return last

    def reserve(self, prog: RankState, calls: list[DPCall], ready: float) -> float | None:
        """``calls`` reserved one after another on the rank's dp stream from ``ready``, as
        :meth:`issue` would run them, where nothing needs their events (gradient buckets
        without a buffer to free, the parameter all-gathers after the optimizer): the last
        one's end in seconds. None when they must be issued (:meth:`CallSite.reserve`); the
        calls of one issue share the stream and axis, so either all or none are reserved."""
        if self.meet_on_group or not calls:
            return None
        site, rank = self.site, prog.rank
        stream = site.group(rank, DP)
        end = None
        for i, c in enumerate(calls):
            end = site.reserve(
                rank,
                DP,
                c.op,
                c.size_bytes,
                site.group(rank, c.axis),
                ready_s=ready,
                stream_group=stream,
            )
            if end is None:
                if i:  # the first was reserved: issuing them all now would run it twice
                    raise SimulationError(f"rank {rank}: dp calls {calls} reserved in part")
                return None
        return end

    def allocate_states(self, prog: RankState) -> None:
        states = self.rules.state_bytes(prog.stage)
        prog.ledger.alloc(0.0, "parameters", states.parameters, "parameters")
        prog.ledger.alloc(0.0, "gradients", states.gradients, "gradients")
        prog.ledger.alloc(0.0, "optimizer", states.optimizer, "optimizer state")
        prog.ledger.alloc(0.0, "buffers", states.ddp_buckets, "ddp buckets")

    # ---- buckets ------------------------------------------------------------------------------
    def launch_bucket(
        self, prog: RankState, op: PipeOp, chunk: ChunkModel, bucket: Bucket, ready: float
    ) -> None:
        """Issue a bucket's reduction on the dp stream at its ready time.

        Without overlap the reductions wait for the end of the rank's whole backward (all
        micro-batches and chunks), as Megatron-LM did before overlapped gradient reduction.
        """
        if not self.rules.overlap:
            prog.deferred.append((op, chunk, bucket))
            return
        self._reduce_bucket(prog, op, chunk, bucket, ready)

    def _reduce_bucket(
        self,
        prog: RankState,
        op: PipeOp,
        chunk: ChunkModel,
        bucket: Bucket,
        ready: float | None,
    ) -> None:
        calls = self.rules.bucket_calls(bucket)
        if not self.rules.holds_bucket_buffer:
            end = self.reserve(prog, calls, self.env.now if ready is None else ready)
            if end is not None:
                prog.dp_done_s = max(prog.dp_done_s, end)
                return
        verb = self.rules.bucket_op
        kind = "expert bucket" if bucket.expert else "bucket"
        ev = self.issue(
            prog,
            calls,
            f"{verb} {kind} {bucket.index} c{chunk.index} mb{op.microbatch}",
            ready=ready,
        )
        if ev is None:
            return
        prog.dp_events.append(ev)
        if self.rules.holds_bucket_buffer:
            at = self.env.now if ready is None else ready
            prog.ledger.alloc(at, "buffers", bucket.size_bytes, "zero2 bucket")
            ev.callbacks.append(self._freer(prog, "buffers", bucket.size_bytes, "zero2 bucket"))

    def launch_deferred(self, prog: RankState) -> None:
        """Without overlap: issue every bucket now, after the last backward."""
        deferred, prog.deferred = prog.deferred, []
        for op, chunk, bucket in deferred:
            if self.rules.overlap:  # pragma: no cover - deferred only without overlap
                raise SimulationError("deferred buckets with overlap on")
            self._reduce_bucket(prog, op, chunk, bucket, None)

    def _freer(
        self, prog: RankState, category: str, size_bytes: float, label: str
    ) -> Callable[[simpy.Event], None]:
        """A SimPy callback that frees ``size_bytes`` of ``category`` when its event fires."""

        def free(_event: simpy.Event) -> None:
            prog.ledger.free(self.env.now, category, size_bytes, label)

        return free

    # ---- FSDP units ---------------------------------------------------------------------------
    def gather_unit(self, prog: RankState, op: PipeOp, chunk: ChunkModel, seg: Segment) -> None:
        ukey = self.rules.unit_key(chunk, seg)
        key = (prog.rank, chunk.index, ukey)
        if key in self.unit_events:
            return  # still gathered (root, no reshard after forward), or in flight
        size = self.rules.gather_bytes(chunk, ukey)
        prog.ledger.alloc(self.env.now, "parameters", size, f"gathered {ukey}")
        ev = self.issue(
            prog,
            self.rules.unit_gathers(chunk, ukey),
            f"all_gather {ukey} c{chunk.index} mb{op.microbatch} {op.phase.value}",
            extra_s=self.rules.offload_s(size),
        )
        if ev is None:
            ev = self.env.event()
            ev.succeed()
        self.unit_events[key] = ev

    def unit_ready(self, prog: RankState, chunk: ChunkModel, seg: Segment) -> simpy.Event | None:
        return self.unit_events.get((prog.rank, chunk.index, self.rules.unit_key(chunk, seg)))

    def release_unit(self, prog: RankState, op: PipeOp, chunk: ChunkModel, seg: Segment) -> None:
        """After a unit's forward: reshard. After its backward: reduce-scatter, reshard (a
        split backward: the input-gradient op reshards, the weight-gradient op reduces)."""
        phase = op.phase
        forward = phase is Phase.FORWARD
        if not self.rules.releases(chunk, seg, forward=forward, microbatch=op.microbatch):
            return
        ukey = self.rules.unit_key(chunk, seg)
        if phase is Phase.BACKWARD or phase is Phase.BACKWARD_WEIGHT:
            gsize = self.rules.grad_bytes(chunk, ukey)
            label = f"grad {ukey}"
            prog.ledger.alloc(self.env.now, "buffers", gsize, label)
            ev = (
                self.issue(
                    prog,
                    self.rules.unit_reductions(chunk, ukey),
                    f"reduce_scatter {ukey} c{chunk.index} mb{op.microbatch}",
                    extra_s=self.rules.offload_s(gsize),
                )
                if self.rules.reduces_units
                else None
            )
            if ev is not None:
                prog.dp_events.append(ev)
                ev.callbacks.append(self._freer(prog, "buffers", gsize, label))
            else:
                prog.ledger.free(self.env.now, "buffers", gsize, label)
        if phase is Phase.BACKWARD_WEIGHT:
            return
        del self.unit_events[(prog.rank, chunk.index, ukey)]
        prog.ledger.free(
            self.env.now, "parameters", self.rules.gather_bytes(chunk, ukey), f"reshard {ukey}"
        )

    # ---- end of step --------------------------------------------------------------------------
    def embedding_sync(self, prog: RankState) -> simpy.Event | None:
        """Tied embeddings with pp > 1: all-reduce the word-embedding gradient between the
        first and the last stage before the optimizer (Megatron-LM ``allreduce_embedding_grads``;
        the group is each (dp, cp, tp) pair of stage 0 and stage p - 1)."""
        plan = self.plan
        p = plan.head_stage  # the last stage, or the first with DualPipeV's V (no sync)
        if p == 0 or not plan.spec.tied_embeddings or prog.coords.pp not in (0, p):
            return None
        c = prog.coords
        pair = (
            plan.rank(dp=c.dp, pp=0, tp=c.tp, cp=c.cp),
            plan.rank(dp=c.dp, pp=p, tp=c.tp, cp=c.cp),
        )
        size = plan.spec.vocab / plan.tp * plan.spec.hidden * self.rules.bytes_per.grad
        # every other (dp, cp, tp) pair of the two stages, dp outermost, tp innermost
        grid = plan.grid()
        others: list[tuple[int, ...]] = list(
            zip(grid[0].ravel().tolist()[1:], grid[p].ravel().tolist()[1:], strict=True)
        )
        return self.site.call(
            prog.rank,
            PP,
            "all_reduce",
            size,
            pair,
            "all_reduce embedding grad",
            peers=self.site.pair_peers(pair, others),
            stream_group=pair,
        )

    def after_optimizer(self, prog: RankState) -> simpy.Event | float | None:
        """ZeRO-1/2: all-gather the updated parameters, bucket by bucket: the last one's
        event, or its end in seconds when they are reserved (:meth:`reserve`); None when there
        are none."""
        calls = self.rules.gathers_after_optimizer(prog.stage)
        if not calls:
            return None
        end = self.reserve(prog, calls, self.env.now)
        if end is not None:
            return end
        return self.issue(prog, calls, "all_gather params")
