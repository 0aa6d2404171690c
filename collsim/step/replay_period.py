"""The steady state of an allocator replay: a pipeline's step repeats one period of memory
events (forwards and backwards of later and later micro-batches) many times, and once the
caching allocator and the live allocations come back to the same state a whole number of
periods apart, every later repeat of those periods makes the same requests of the same cache
and changes nothing but the micro-batch numbers. :func:`find_run` finds the repeating stretch
of a rank's events and :class:`Steady` lets :func:`collsim.step.allocator.replay_ledger` jump
over its repeats: the peaks, retries and unmatched bytes are those of a replay of every event
(a test compares both on every shipped scenario). The argument is in docs/memory.md.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

__all__ = ["MICROBATCH_AT", "MIN_REPEATS", "Run", "Steady", "find_run"]

MICROBATCH_AT = 2
"""Where a labelled activation's micro-batch sits: ``(kind, layer, micro-batch, chunk)``
(``act``, ``recompute`` and ``free`` labels of :class:`collsim.step.memory.MemoryEvent`) and
its pairing key ``(category, layer, micro-batch, chunk)``."""

_KINDS = ("act", "recompute", "free")

MIN_REPEATS = 2
"""Fewer repeats than this are replayed event by event (nothing to gain)."""

CANDIDATES = 4
"""How many later events of the same layer and chunk are tried as the twin that sets the
period (interleaved schedules run micro-batches in groups: the nearest is not always it)."""

MAX_BOUNDARIES = 512
"""Period boundaries a replay looks at for a repeated state before it gives up (bounds the
cost of a replay that never settles)."""

MAX_STATES = 8
"""Whole states a replay takes before it gives up (each costs about as much as replaying a
period)."""


@dataclass(frozen=True, slots=True)
class Run:
    """Events ``start .. end`` repeat with ``period``: ``events[i + period]`` is
    ``events[i]`` with its micro-batch ``shift`` on, for ``start <= i < end - period``."""

    start: int
    end: int
    period: int
    shift: int


def _twins(events: Sequence[Any], x: int, period: int, shift: int) -> bool:
    """Whether ``events[x + period]`` is ``events[x]`` with its micro-batch ``shift`` on."""
    a, b = events[x], events[x + period]
    if a[2] != b[2] or a[1] != b[1]:
        return False
    la, lb = a[3], b[3]
    if type(la) is tuple and len(la) == 4 and la[0] in _KINDS and type(la[2]) is int:
        return bool(lb == (la[0], la[1], la[2] + shift, la[3]))
    return bool(la == lb)


def _forward(events: Sequence[Any], s: int, period: int, shift: int) -> int:
    """The first ``x >= s`` where the twin relation fails (or the last ``x`` it can hold)."""
    n = len(events)
    end = s
    while end + period < n and _twins(events, end, period, shift):
        end += 1
    return end


def _backward(events: Sequence[Any], s: int, period: int, shift: int) -> int:
    """The first ``x <= s`` from which the twin relation holds up to ``s``."""
    start = s
    while start > 0 and _twins(events, start - 1, period, shift):
        start -= 1
    return start


def find_run(events: Sequence[Any]) -> Run | None:
    """The longest repeating stretch through a labelled activation a third of the way into
    a rank's sorted memory events (where a pipeline's steady state runs), its period set by
    one of the next :data:`CANDIDATES` events of the same layer and chunk with a later
    micro-batch; None when no stretch repeats :data:`MIN_REPEATS` times."""
    n = len(events)
    for s in range(n // 3, n):
        label = events[s][3]
        if not (type(label) is tuple and len(label) == 4 and label[0] in _KINDS):
            continue
        if type(label[2]) is not int:
            continue
        kind, layer, mb, chunk = label
        category, delta = events[s][1], events[s][2]
        best: tuple[int, int, int] | None = None  # (forward end, period, shift)
        tried = 0
        for j in range(s + 1, n):
            ev = events[j]
            lj = ev[3]
            if not (type(lj) is tuple and len(lj) == 4 and lj[0] == kind and lj[1] == layer):
                continue
            if lj[3] != chunk or type(lj[2]) is not int or lj[2] <= mb:
                continue
            if ev[2] != delta or ev[1] != category:
                continue
            end = _forward(events, s, j - s, lj[2] - mb)
            if best is None or end > best[0]:
                best = (end, j - s, lj[2] - mb)
            tried += 1
            if tried >= CANDIDATES or 2 * (end - s) >= n - s:
                break  # tried enough, or this one runs over most of what is left
        if best is None:
            return None
        end, period, shift = best
        run = Run(_backward(events, s, period, shift), end + period, period, shift)
        if (run.end - run.start) // period < 2 * MIN_REPEATS:
            return None
        return run
    return None


class Steady:
    """The period skip of one replay. At loop tops one period apart (boundaries) inside the
    run a cheap signature of the allocator is kept; when one comes back ``c`` boundaries
    later, the whole state (allocator, live allocations with their micro-batches counted from
    the boundary, the replay's own) is taken there and again ``c`` boundaries on. When the
    two are the same, the replay jumps over the whole cycles of ``c`` periods left in the
    run. The allocator's addresses may rotate over several periods (buffers of the
    micro-batches in flight), hence cycles, not single periods."""

    def __init__(self, run: Run) -> None:
        self.run = run
        self.anchor = -1
        """The loop top the boundaries are counted from (-1: none yet)."""
        self.due = run.start
        """The next boundary."""
        self.seen: dict[tuple[Any, ...], int] = {}
        """Boundary by signature (the latest)."""
        self.waiting: dict[int, tuple[tuple[Any, ...], int]] = {}
        """Boundary -> (the state taken a cycle before it, the cycle in periods)."""
        self.states = 0
        self.done = False

    def jump(self, i: int, alloc: Any, pairs: Any, extra: Any) -> int:
        """The loop top to go on from: ``i``, or past the repeats of the state at ``i``
        (``extra``: the replay's own state beside the allocator and the pairing)."""
        if i < self.due or self.done:
            return i
        run = self.run
        if i + run.period >= run.end:
            self.done = True
            return i
        if i > self.due or self.anchor < 0:  # the first boundary, or one stepped over
            self.anchor = i
            self.seen.clear()
            self.waiting.clear()
        k = (i - self.anchor) // run.period
        if k >= MAX_BOUNDARIES:
            self.done = True
            return i
        self.due = i + run.period
        st = alloc.stats
        sig = (
            st.allocated_bytes,
            st.reserved_bytes,
            st.num_alloc_retries,
            alloc._next_addr,
            tuple(sorted(alloc._free_sums.items())),
            len(alloc._unmapped_at),
            pairs.unmatched,
            pairs.early,
            extra,
        )
        before = self.seen.get(sig)
        self.seen[sig] = k
        wait = self.waiting.pop(k, None)
        if wait is not None:
            then, cycle = wait
            if _state(alloc, pairs, k * run.shift, extra) == then:
                return self._skip(i, cycle, pairs)
        if before is not None and k + (k - before) not in self.waiting:
            # the signature came back: take the state, to compare a cycle on
            self.states += 1
            if self.states > MAX_STATES:
                self.done = True
                return i
            now = _state(alloc, pairs, k * run.shift, extra)
            self.waiting[k + (k - before)] = (now, k - before)
        return i

    def _skip(self, i: int, cycle: int, pairs: Any) -> int:
        """Jump from loop top ``i``, whose state is the one ``cycle`` periods before, over
        the whole cycles left in the run (keeping the event after them in the run: the last
        skipped event may look one ahead, a layer's rebuilt activations and their free)."""
        run = self.run
        repeats = (run.end - 1 - i) // run.period // cycle * cycle
        if repeats < MIN_REPEATS:
            return i
        self.done = True
        _relabel(pairs, repeats * run.shift)
        return i + repeats * run.period


def _live(handles: Any) -> list[Any]:
    """The live handles of ``handles`` in order; the dead ones are dropped from it (the
    pairing skips them anyway)."""
    live = [h for h in handles if h[1]]
    if len(live) < len(handles):
        handles.clear()
        handles.extend(live)
    return live


def _state(alloc: Any, pairs: Any, less: int, extra: Any) -> tuple[Any, ...]:
    """What the rest of a replay depends on, with the pairing's micro-batches ``less``.

    The segments are the same wherever the reserved bytes, the next address and the retries
    are (none made or released between), so a block is told by its address: the free lists
    give the free ones with their sizes, each live allocation its blocks' addresses (the
    category stacks), and the queues and keys the pairing looks them up by their first
    block's address."""
    st = alloc.stats
    stacks = {
        category: tuple(tuple([b.addr for b in h[0]]) for h in live)
        for category, handles in pairs.stacks.items()
        if (live := _live(handles))
    }
    by_size = {
        key: tuple([h[0][0].addr if h[0] else -1 for h in live])
        for key, handles in pairs.by_size.items()
        if (live := _live(handles))
    }
    by_key = {}
    for key, handles in pairs.by_key.items():
        live = _live(handles)
        if live:
            mb = key[MICROBATCH_AT]
            if type(mb) is int:
                key = (key[0], key[1], mb - less, key[3])
            by_key[key] = tuple([h[0][0].addr if h[0] else -1 for h in live])
    unmapped = tuple(
        (pool, tuple((a, alloc._unmapped_at[a].size) for a in addrs))
        for pool, addrs in sorted(alloc._unmapped.items())
    )
    return (
        st.allocated_bytes,
        st.reserved_bytes,
        st.num_alloc_retries,
        alloc._next_addr,
        tuple((pool, tuple(lst)) for pool, lst in sorted(alloc._free.items())),
        unmapped,
        stacks,
        by_size,
        by_key,
        dict(pairs.pending),
        pairs.early,
        pairs.unmatched,
        extra,
    )


def _relabel(pairs: Any, by: int) -> None:
    """Move the pairing's activation keys ``by`` micro-batches on."""
    moved = {}
    for key, handles in pairs.by_key.items():
        mb = key[MICROBATCH_AT]
        if type(mb) is int:
            key = (key[0], key[1], mb + by, key[3])
        moved[key] = handles
    pairs.by_key = moved
