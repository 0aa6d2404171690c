"""The engine's pipeline messages: routes between stages, sends and the receive gather.

:class:`PipeMessages` works out, once per op, the mailbox an op's input arrives in and where
its output goes (:meth:`~PipeMessages.routes`), sends an output on the rank's pp stream (or
reserves it there in closed form), and completes a received message with Megatron's TP
all-gather where the sends are scattered.
"""

from __future__ import annotations

from dataclasses import dataclass

import simpy

from collsim.core.vocab import ParallelAxis
from collsim.parallel.pipeline import Phase, PipeOp, flow
from collsim.play.engine.comm import linked_peers
from collsim.play.engine.segments import SegmentCalls
from collsim.play.engine.streams import CallRecord, GroupStream, Mail, RankState
from collsim.step.stats import CallKey

__all__ = ["PipeMessages", "PipeRoute", "RECV_STREAM"]

TP, PP = ParallelAxis.TP, ParallelAxis.PP

RECV_STREAM = "pp recv"
"""Trace stream of a rank's pipeline receives (the same transfers as the sender's ``pp``
slices, seen from the receiver; a thread of its own, as receives overlap the rank's sends)."""


@dataclass(slots=True)
class PipeRoute:
    """Where a pipeline op's output goes (:meth:`Engine.outbox`)."""

    stage: int
    dst: int
    """The receiving rank (the same grid position on ``stage``)."""
    mail: Mail
    peers: list[tuple[int, ...]]
    """Pairs that share the send's links (DES only)."""
    reserve: tuple[GroupStream, float, CallKey, float] | None = None
    """Closed form on a one-member stream: (stream, seconds, statistics key, busbw)."""


class PipeMessages(SegmentCalls):
    """Pipeline routes, sends and receive gathers of the engine."""

    def pp_gather(self, prog: RankState, op: PipeOp) -> simpy.Event | None:
        """The all-gather that completes a received pipeline message (None when there is none).

        Megatron's scatter/gather optimisation (Narayanan et al. 2021, section 4.1): each TP
        rank sends only 1/t of the ``b x s x h`` activation (or gradient) over the network;
        the receiving stage all-gathers the pieces over its TP group (NVLink) before the op
        can start. With sequence parallelism the tensors are already sequence-sharded and
        Megatron sends the shards as they are: no gather.
        """
        if self.plan.tp < 2 or self.plan.parallel.sequence_parallel:
            return None
        name = (
            f"all_gather pp recv {op.phase.value} mb{op.microbatch} c{op.chunk}"
            if self.trace_on
            else "all_gather pp recv"
        )
        return self.tp_call(prog, "all_gather", self._p2p_size_bytes * self.plan.tp, name)

    def pp_gather_cost(self, prog: RankState) -> tuple[float, CallKey | None, float] | None:
        """The closed-form pipeline gather of ``prog``'s received messages: (seconds,
        statistics key or None when there is no gather, busbw); None when it must run on the tp
        stream (all ranks simulated, whose members rendezvous, or a tp axis on the DES)."""
        if self.plan.tp < 2 or self.plan.parallel.sequence_parallel:
            return 0.0, None, 0.0
        if self.all_ranks or TP in self.des_axes:
            return None
        if self.broken and len(self.stream(prog.rank, TP).members) > 1:
            return None  # simulated TP peers: they rendezvous on the tp stream
        hit = self._gathers.get(prog.rank)
        if hit is None:
            size = self._p2p_size_bytes * self.plan.tp
            group = self.group(prog.rank, TP)
            cost = self.pricer.cost("all_gather", size, group)
            key = CallKey(prog.rank, TP, "all_gather", size, len(group), cost.algorithm)
            hit = self._gathers[prog.rank] = (cost.time_s, key, cost.busbw_bps)
        return hit

    def pp_gather_s(self, prog: RankState, op: PipeOp) -> float | None:
        """The pipeline gather of :meth:`pp_gather` in closed form, starting now: its seconds
        (0 when there is none), recorded in the statistics and the trace as the tp stream
        would record it; None when it must run on the tp stream (:meth:`pp_gather_cost`). A
        fused op then starts after it, in the same timeout: the tp stream of a fused
        representative runs nothing else."""
        found = self.pp_gather_cost(prog)
        if found is None:
            return None
        time_s, key, busbw = found
        if key is None:
            return 0.0
        self.tally(key, time_s, busbw)
        if self.trace_on:
            now = self.env.now
            size = self._p2p_size_bytes * self.plan.tp
            self.add_trace(
                prog.rank,
                TP,
                f"all_gather pp recv {op.phase.value} mb{op.microbatch} c{op.chunk}",
                now,
                now + time_s,
                self.tp_args(prog.rank, "all_gather", size),
            )
        return time_s

    def _stage_rank(self, rank: int, stage: int) -> int:
        c = self.plan.coords(rank)
        return self.plan.rank(dp=c.dp, pp=stage, tp=c.tp, cp=c.cp)

    @property
    def _p2p_size_bytes(self) -> float:
        """Per TP rank: b s h / t activations (Megatron's scatter-gather of pipeline sends)."""
        return self.schedule.p2p_bytes

    def routes(self, prog: RankState) -> tuple[list[Mail | None], list[PipeRoute | None]]:
        """Per op of ``prog``, in order: the mailbox its input arrives in (None: it reads
        nothing from another stage, the schedule's
        :meth:`~collsim.parallel.pipeline.PipelineSchedule.input_of`) and where its output goes
        (None: to no other stage, :meth:`~collsim.parallel.pipeline.PipelineSchedule.output_of`).
        The output route also carries the pairs that share the
        send's links and, for a send priced in closed form on a one-member stream without a
        trace, that stream with the send's seconds and statistics key (the send is then
        reserved on it, not played).

        One pass over the ops (the engine's per-op set-up: 1,536 ops per 3d_175b step)."""
        p, v = self.plan.pp, self.plan.virtual_stages
        input_of = self.plan.pipeline_schedule.input_of
        output_of = self.plan.pipeline_schedule.output_of
        s, rank = prog.coords.pp, prog.rank
        mail, env, links = self.mail, self.env, self._links
        inboxes: list[Mail | None] = []
        outboxes: list[PipeRoute | None] = []
        # where an op's input comes from and its output goes depend on its phase and chunk
        # only (the micro-batch passes through): worked out once per (phase, chunk)
        # (a backward's message is named by its direction, flow(): I sends what B sends)
        shapes: dict[tuple[Phase, int], tuple[Phase | None, tuple[int, Phase, int] | None]] = {}
        for op in prog.ops:
            shape = shapes.get((op.phase, op.chunk))
            if shape is None:
                src = input_of(op, stage=s, num_stages=p, virtual_stages=v)
                dest = output_of(op, stage=s, num_stages=p, virtual_stages=v)
                shape = shapes[(op.phase, op.chunk)] = (
                    flow(op.phase) if src is not None and src[0] != s else None,
                    None
                    if dest is None or dest[0] == s
                    else (dest[0], dest[1].phase, dest[1].chunk),
                )
            direction, out = shape
            if direction is not None:
                key = (rank, direction, op.microbatch, op.chunk)
                box = mail.get(key)
                if box is None:
                    box = mail[key] = Mail(env)
                inboxes.append(box)
            else:
                inboxes.append(None)
            if out is None:
                outboxes.append(None)
                continue
            stage, dst_phase, dst_chunk = out
            link = links.get((rank, stage))
            if link is None:
                link = links[(rank, stage)] = self._pipe_link(prog, stage)
            dst, peers, reserve = link
            key = (dst, dst_phase, op.microbatch, dst_chunk)
            box = mail.get(key)
            if box is None:
                box = mail[key] = Mail(env)
            outboxes.append(PipeRoute(stage, dst, box, peers, reserve))
        return inboxes, outboxes

    def _pipe_link(
        self, prog: RankState, stage: int
    ) -> tuple[int, list[tuple[int, ...]], tuple[GroupStream, float, CallKey, float] | None]:
        """What every send of ``prog`` to ``stage`` shares (:class:`PipeRoute`): the receiving
        rank, the pairs on its links, and the closed-form reservation when there is one."""
        src, dst = prog.rank, self._stage_rank(prog.rank, stage)
        size = self._p2p_size_bytes
        pairs: list[tuple[int, ...]] = (
            []
            if self.all_ranks
            or PP not in self.des_axes
            or (self.broken and prog.rank not in self.representatives)
            else [
                (
                    self.plan.rank(dp=d, pp=prog.coords.pp, tp=t, cp=k),
                    self.plan.rank(dp=d, pp=stage, tp=t, cp=k),
                )
                for d in range(self.plan.dp)
                for k in range(self.plan.cp)
                for t in range(self.plan.tp)
                if d or t or k
            ]
        )
        peers = linked_peers(self.plan.topology, (src, dst), self._unsimulated(pairs))
        reserve = None
        if not self.trace_on and PP not in self.des_axes:
            stream = self.stream(src, PP)
            if stream.solo:
                work, args = self._priced("send_recv", size, (src, dst), peers=peers)
                call = CallKey(src, PP, "send_recv", size, 2, str(args["algorithm"]))
                reserve = (stream, float(work), call, float(args["busbw_bps"]))
        return dst, peers, reserve

    def send_output(self, prog: RankState, op: PipeOp, route: PipeRoute) -> None:
        """Send ``op``'s output along ``route`` (:meth:`outbox`) on the rank's pp stream."""
        src, dst, stage = prog.rank, route.dst, route.stage
        size = self._p2p_size_bytes
        mail = route.mail
        now = self.env.now
        mail.produced_s = now
        mail.size_bytes = size
        receiver = self.programs.get(dst)
        if route.reserve is not None:
            stream, work_s, call, busbw = route.reserve
            end = stream.reserve(work_s)
            self.tally(call, work_s, busbw)
            if receiver is not None:
                receiver.ledger.alloc(end, "buffers", size, "pp recv")
            mail.fire_in(end - now)
            return
        name = (
            f"send {op.phase.value} mb{op.microbatch} c{op.chunk} -> stage {stage}"
            if self.trace_on
            else "send"
        )
        done = self.call(src, PP, "send_recv", size, (src, dst), name, peers=route.peers)

        def deliver(ev: simpy.Event) -> None:
            if receiver is not None:
                receiver.ledger.alloc(self.env.now, "buffers", size, "pp recv")
                record = ev.value
                if self.trace_on and isinstance(record, CallRecord):
                    self.add_trace(
                        dst,
                        RECV_STREAM,
                        f"recv {op.phase.value} mb{op.microbatch} c{op.chunk} "
                        f"<- stage {prog.coords.pp}",
                        record.start_s,
                        record.end_s,
                        {**record.args, "src_rank": src},
                    )
            mail.succeed()

        done.callbacks.append(deliver)
