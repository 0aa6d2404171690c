"""Communication streams: FIFO queues of ops that rendezvous over their group's members.

A :class:`GroupStream` is the communication stream of one process group (a tp, dp or pp
group), shared by the group's simulated members, like a NCCL communicator's stream: calls run
one after another in issue order, and call ``k`` starts once every simulated member has issued
it, its inputs are ready (``ready_s``) and call ``k - 1`` has finished (Streams and dependencies,
DESIGN.md). With one simulated member (symmetry reduction) the rendezvous is trivial.

Work is either a duration in seconds (a closed-form cost: the stream computes start and end
times without a SimPy process, a single timeout per call), or a factory of a SimPy process (a
collective or a transfer on the FlowNetwork): then a worker process runs the calls in order.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from functools import partial
from typing import TYPE_CHECKING, Any, Protocol

import simpy
from simpy.events import NORMAL, PENDING

from collsim.core.errors import SimulationError

if TYPE_CHECKING:
    from collsim.parallel.pipeline import PipeOp
    from collsim.parallel.plan import RankCoords
    from collsim.step.memory import MemoryLedger
    from collsim.step.ops import StageModel

__all__ = [
    "Work",
    "CallRecord",
    "GroupStream",
    "RendezvousWait",
    "ScheduledEvent",
    "Mail",
    "RankState",
]

Work = float | Callable[[], Any]
"""A closed-form duration (seconds) or a zero-argument factory of a SimPy process/event."""


class ScheduledEvent(simpy.Event):
    """An event triggered now (``succeed``) or, when the time it happens is known in advance,
    scheduled at once for then (:meth:`fire_in`): a closed-form call's end, a pipeline
    message's arrival."""

    def fire_in(self, delay_s: float, value: Any = None) -> None:
        """Happen ``delay_s`` from now with ``value``: the event schedules itself as SimPy's
        ``Timeout`` does (one event, no timer and callback in between).

        Raises:
            RuntimeError: the event has already been triggered.
        """
        if self._value is not PENDING:
            raise RuntimeError(f"{self} has already been triggered")
        self._ok = True
        self._value = value
        self.env.schedule(self, NORMAL, delay_s)


class Mail(ScheduledEvent):
    """A pipeline message: an event that fires on delivery (:meth:`ScheduledEvent.fire_in` at
    a closed-form send's end, or ``succeed`` when a played send ends), carrying when its
    producer op ended (``produced_s``) and its size; both are set by the send (the class values
    are what a message holds before it)."""

    produced_s: float = -1.0
    size_bytes: float = 0.0


class RankState(Protocol):
    """What the engine and the data-parallel rules read and write on a simulated rank
    (:class:`collsim.play.engine.program.RankProgram` is one)."""

    rank: int
    coords: RankCoords
    stage: StageModel
    ops: list[PipeOp]
    ledger: MemoryLedger
    breakdown_s: dict[str, float]
    dp_events: list[simpy.Event]
    dp_done_s: float
    end_s: float
    deferred: list[Any]

    def run(self) -> Any:
        """The rank's SimPy process body."""
        ...


@dataclass(slots=True)
class CallRecord:
    """One call on a stream, filled in when it runs."""

    name: str
    args: dict[str, Any]
    ready_s: float = 0.0
    start_s: float = -1.0
    end_s: float = -1.0


@dataclass(slots=True)
class _Pending:
    record: CallRecord
    work: Work
    arrived: int = 0
    event: simpy.Event | None = None
    members: list[int] = field(default_factory=list)
    arrive_s: dict[int, float] = field(default_factory=dict)
    """When each member was ready to start the call (issue time, or its ``ready_s``)."""


@dataclass(slots=True)
class RendezvousWait:
    """The call of a stream whose rendezvous waited longest: who came last, who waited."""

    call: str
    wait_s: float
    """Last member's arrival minus the first's."""
    waited_for: int
    """The member that arrived last."""
    waits_s: dict[int, float]
    """Per member: how long it waited for the last one."""


class GroupStream:
    """The communication stream of one group.

    Args:
        env: the simulation environment.
        members: the simulated ranks that issue every call of this stream.
        stream: stream name for traces (``tp``, ``pp``, ``dp``).
        on_done: called with (member ranks, record) when a call finishes (traces, stats).
    """

    def __init__(
        self,
        env: simpy.Environment,
        members: tuple[int, ...],
        stream: str,
        on_done: Callable[[list[int], CallRecord], None] | None = None,
    ) -> None:
        self.env = env
        self.members = members
        self.stream = stream
        self.on_done = on_done
        self._issued = dict.fromkeys(members, 0)
        self._solo = len(members) == 1
        self._pending: dict[int, _Pending] = {}
        self._next = 0
        self.free_at = 0.0
        self._queue: simpy.Store | None = None
        self.wait_s = dict.fromkeys(members, 0.0)
        """Per member: seconds spent waiting for the other members at rendezvous."""
        self.longest: RendezvousWait | None = None
        """The call whose rendezvous waited longest (None: no member ever waited)."""

    def submit(
        self,
        member: int,
        name: str,
        work: Work,
        *,
        ready_s: float | None = None,
        args: dict[str, Any] | None = None,
    ) -> simpy.Event:
        """Issue the member's next call; the returned event fires when the call ends.

        Args:
            member: the issuing rank (one of ``members``).
            name: what runs (``all_reduce bucket 3``).
            work: duration in seconds, or a factory of the SimPy process that does it.
            ready_s: when the call's inputs are ready (default: now); may be in the future.
            args: extra facts for the trace.
        """
        now = self.env.now
        ready = now if ready_s is None else ready_s
        if ready < now - 1e-12:
            raise SimulationError(f"{self.stream}: call {name!r} ready at {ready} before now {now}")
        if self._solo and self._queue is None and not callable(work):
            return self._solo_call(member, name, float(work), ready, args)
        seq = self._issued[member]
        self._issued[member] = seq + 1
        pending = self._pending.get(seq)
        if pending is None:
            pending = _Pending(
                CallRecord(name, args if args is not None else {}, ready_s=ready), work
            )
            pending.event = self.env.event()
            self._pending[seq] = pending
        else:
            pending.record.ready_s = max(pending.record.ready_s, ready)
        pending.arrived += 1
        pending.members.append(member)
        if len(self.members) > 1:
            pending.arrive_s[member] = ready
        event = pending.event
        self._resolve()
        assert event is not None
        return event

    def reserve(self, work_s: float) -> float:
        """A closed-form call of a one-member stream, issued now, whose end is known at once
        (a pipeline send): it starts when the stream is free and holds it for ``work_s``.
        Nothing is scheduled; the caller delivers at the returned end and tallies the call.

        Raises:
            SimulationError: the stream rendezvous or runs SimPy work (use :meth:`submit`).
        """
        if not self._solo or self._queue is not None:
            raise SimulationError(f"{self.stream}: reserve() needs a one-member closed-form stream")
        now = self.env.now
        start = now if now > self.free_at else self.free_at
        self.free_at = start + work_s
        return self.free_at

    def reserve_from(self, ready_s: float, work_s: float) -> tuple[float, float]:
        """A closed-form call of a one-member stream whose inputs are ready at ``ready_s`` (now
        or later), reserved as :meth:`reserve` does: it starts when it is ready and the stream
        is free and holds the stream for ``work_s``; its (start, end) seconds. Nothing is
        scheduled: the caller records the call and waits for its end when it needs it (a
        gradient bucket: at the end of the step).

        Raises:
            SimulationError: the stream rendezvous or runs SimPy work (use :meth:`submit`).
        """
        if not self._solo or self._queue is not None:
            raise SimulationError(
                f"{self.stream}: reserve_from() needs a one-member closed-form stream"
            )
        start = ready_s if ready_s > self.free_at else self.free_at
        self.free_at = start + work_s
        return start, self.free_at

    @property
    def solo(self) -> bool:
        """One member and no SimPy worker: calls are priced in closed form (:meth:`reserve`)."""
        return self._solo and self._queue is None

    def _solo_call(
        self, member: int, name: str, work_s: float, ready: float, args: dict[str, Any] | None
    ) -> simpy.Event:
        """A closed-form call of a one-member stream: no rendezvous, so it starts when it is
        ready and the stream is free, and its record is complete when it is issued (``on_done``
        is told then); the event returned fires at its end with the record (one event per
        call)."""
        record = CallRecord(name, args if args is not None else {}, ready_s=ready)
        start = ready if ready > self.free_at else self.free_at
        record.start_s = start
        record.end_s = self.free_at = start + work_s
        done = ScheduledEvent(self.env)
        done.fire_in(record.end_s - self.env.now, record)
        if self.on_done is not None:
            self.on_done([member], record)
        return done

    def _resolve(self) -> None:
        while True:
            pending = self._pending.get(self._next)
            if pending is None or pending.arrived < len(self.members):
                return
            del self._pending[self._next]
            self._next += 1
            if pending.arrive_s:
                self._note_waits(pending)
            if callable(pending.work) or self._queue is not None:
                if self._queue is None:
                    self._queue = simpy.Store(self.env)
                    self.env.process(self._worker())
                self._queue.put(pending)
                continue
            record = pending.record
            record.start_s = max(record.ready_s, self.free_at)
            record.end_s = record.start_s + float(pending.work)
            self.free_at = record.end_s
            timer = self.env.timeout(record.end_s - self.env.now)
            timer.callbacks.append(partial(self._finish, pending))

    def _note_waits(self, pending: _Pending) -> None:
        """Account the rendezvous of one call: every member waits for the last to arrive."""
        arrive = pending.arrive_s
        last_member = max(arrive, key=lambda m: (arrive[m], -m))
        last = arrive[last_member]
        waits = {m: last - t for m, t in arrive.items()}
        for m, w in waits.items():
            self.wait_s[m] += w
        spread = last - min(arrive.values())
        if spread > 0 and (self.longest is None or spread > self.longest.wait_s):
            self.longest = RendezvousWait(
                pending.record.name, spread, last_member, {m: w for m, w in waits.items() if w}
            )

    def _finish(self, pending: _Pending, _event: simpy.Event | None = None) -> None:
        """Close a call (``_event``: the timer that ended it, when called back by SimPy)."""
        if self.on_done is not None:
            self.on_done(pending.members, pending.record)
        assert pending.event is not None
        pending.event.succeed(pending.record)

    def _worker(self) -> Any:
        assert self._queue is not None
        while True:
            pending = yield self._queue.get()
            record = pending.record
            # a closed-form call resolved before the first process work may still be running
            start = max(record.ready_s, self.env.now, self.free_at)
            if start > self.env.now:
                yield self.env.timeout(start - self.env.now)
            record.start_s = self.env.now
            job = pending.work() if callable(pending.work) else self.env.timeout(pending.work)
            if job is not None:
                value = yield job
                if record.args is not None and value is not None:
                    record.args.setdefault("result", value)
            record.end_s = self.env.now
            self.free_at = record.end_s
            self._finish(pending)
