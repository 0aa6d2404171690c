"""What a CPU trace says of the host beside the kernels: the host cost per launch
(:func:`host_per_launch`: on each traced step's thread the time no priced op holds, per op the
simulation prices one by one) and the time-sharing slowdown (:func:`time_sharing`: the same step
traced with more ranks per core against fewer), both read by
:mod:`collsim.validate.fit.trace_profile` into a device profile.
"""

from __future__ import annotations

import statistics
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from collsim.core.errors import ConfigError
from collsim.validate.data.kineto import STEP_PREFIX, Event, Trace
from collsim.validate.fit.trace_rates import gemm_op_rates, outermost
from collsim.validate.measure.traces.classify import classify

__all__ = [
    "HOST_KINDS",
    "PRICED_KINDS",
    "PRICED_ELSEWHERE",
    "HostTime",
    "host_per_launch",
    "TimeSharing",
    "time_sharing",
    "PINNED_OP_SPEED_LIMIT",
]

HOST_KINDS = frozenset({"framework", "copy", "unclassified"})
"""Op kinds no table of the profile prices: their self time on the step's thread is host time
(views, transposes, autograd bookkeeping, allocations, layout copies)."""

PRICED_KINDS = frozenset(
    {"gemm", "attention", "convolution", "norm", "elementwise", "embedding", "loss"}
)
"""Op kinds the simulation prices one kernel at a time: each op of one of these kinds inside no
other, outside the optimizer and DDP's reducer, is one launch of :func:`host_per_launch`."""

PRICED_ELSEWHERE = ("Optimizer.", "reducer::")
"""Annotations whose insides the simulation prices as a whole: the optimizer step and
zero_grad (``optimizer_bytes_per_s``), and DDP's reducer (``torch::distributed::reducer::
mul_out``, ``torch.distributed.ddp.reducer::copy_bucket_to_grad``: the gradient copies priced
from their bytes, ``collsim.validate.check.step``)."""


@dataclass
class HostTime:
    """The host time of a CPU trace's steps that no priced op holds (:func:`host_per_launch`)."""

    host_s: float
    """Summed over the steps: self time of :data:`HOST_KINDS` ops and the step thread's gaps
    between ops, outside :data:`PRICED_ELSEWHERE` and not while a collective of the rank ran."""
    launches: int
    """Ops of :data:`PRICED_KINDS` inside no other such op, summed over the steps."""
    steps: int

    @property
    def per_launch_us(self) -> float:
        return self.host_s / max(self.launches, 1) * 1e6


def _overlap_us(lo: float, hi: float, spans: list[tuple[float, float]]) -> float:
    return sum(max(0.0, min(hi, b) - max(lo, a)) for a, b in spans)


def _step_host_us(
    ops: list[Event], step: Event, comm: list[tuple[float, float]]
) -> tuple[float, int]:
    """(host microseconds, launches) of one step's ops on its thread, in time order."""
    host_us = 0.0
    launches = 0
    stack: list[tuple[Event, str, bool, list[float]]] = []  # op, kind, elsewhere, kids' time
    last_end = step.ts_us

    def pop() -> None:
        nonlocal host_us, launches
        op, kind, elsewhere, kids = stack.pop()
        span = max(0.0, min(op.end_us, step.end_us) - op.ts_us)
        if stack:
            stack[-1][3][0] += span
        if elsewhere:
            return
        if kind in HOST_KINDS:
            host_us += max(0.0, span - kids[0])
        elif kind in PRICED_KINDS and not any(k in PRICED_KINDS for _, k, _, _ in stack):
            launches += 1  # a priced op inside another (a GEMM's bias sum) is part of it

    for op in ops:
        while stack and stack[-1][0].end_us <= op.ts_us:
            pop()
        if not stack and op.ts_us > last_end:  # a gap between outermost ops
            host_us += (op.ts_us - last_end) - _overlap_us(last_end, op.ts_us, comm)
        elsewhere = any(p in op.name for p in PRICED_ELSEWHERE) or bool(stack and stack[-1][2])
        stack.append((op, classify(op.name, op.cat), elsewhere, [0.0]))
        if len(stack) == 1:
            last_end = max(last_end, op.end_us)
    while stack:
        pop()
    if step.end_us > last_end:
        host_us += (step.end_us - last_end) - _overlap_us(last_end, step.end_us, comm)
    return host_us, launches


def _comm_spans(trace: Trace) -> list[tuple[float, float]]:
    """The (start, end) microseconds of the trace's collectives, in order."""
    return sorted(
        (e.ts_us, e.end_us)
        for e in trace.events
        if e.name.startswith("gloo:") or e.name == "record_param_comms"
    )


def _step_ops(trace: Trace, step: Any) -> list[Event]:
    """The CPU ops and annotations on ``step``'s thread inside it (the step's own mark left out)."""
    return [
        e
        for e in trace.events
        if e.cat in ("cpu_op", "user_annotation")
        and e.tid == step.tid
        and e.pid == step.pid
        and step.ts_us <= e.ts_us < step.end_us
        and not e.name.startswith(STEP_PREFIX)
    ]


def host_per_launch(trace: Trace) -> HostTime:
    """The host cost per launch a CPU trace's steps show: on each step's thread, the self time
    of the ops of kinds no table prices (:data:`HOST_KINDS`) plus the gaps between the
    outermost ops (Python and the autograd engine between ops), leaving out what the simulation
    prices as a whole (:data:`PRICED_ELSEWHERE`) and the gaps while a collective of the rank ran
    (a wait, priced as exposed communication); over the ops the simulation prices one by one
    (:data:`PRICED_KINDS`, those inside no other priced op). On a CPU the host cost adds to each
    kernel's time (``collsim.workload.compute.ComputeModel``), so these seconds, spread over
    the launches, are what the simulated step lacks without them."""

    comm = _comm_spans(trace)
    host_us = 0.0
    launches = 0
    steps = trace.steps()
    for step in steps:
        ops = sorted(_step_ops(trace, step), key=lambda e: (e.ts_us, -e.dur_us))
        h, n = _step_host_us(ops, step, comm)
        host_us += h
        launches += n
    return HostTime(host_us * 1e-6, launches, len(steps))


def _busy_step_s(traces: list[Trace]) -> float:
    """Mean seconds per step of the steps' threads less their waits on a collective (the gaps
    between outermost ops while a collective of the rank ran), over every step of every rank."""
    total_us = 0.0
    count = 0
    for trace in traces:
        comm = _comm_spans(trace)
        for step in trace.steps():
            top = outermost(_step_ops(trace, step))
            edges = [step.ts_us, *(x for e in top for x in (e.ts_us, e.end_us)), step.end_us]
            waits = sum(
                _overlap_us(edges[i], edges[i + 1], comm)
                for i in range(0, len(edges) - 1, 2)
                if edges[i + 1] > edges[i]
            )
            total_us += step.dur_us - waits
            count += 1
    return total_us / max(count, 1) * 1e-6


PINNED_OP_SPEED_LIMIT = 1.05
"""The largest median GEMM op rate of the pinned traces over the reference's at which the
pinned step still counts as run beside cores as busy as the reference's (:func:`time_sharing`).
Chosen: four times the spread of that median between the three quiet reference recordings of
``validate/data/traces/pinned_quiet`` (59.9-61.3 GFLOP/s, +-1.2 % around their mean), well below
the +14 and +17 % of the two pinned steps there that ran with the other core idle."""


@dataclass
class TimeSharing:
    """The slowdown beyond an even share of a core, learned from the same step traced with the
    ranks on their own cores and with more ranks per core (:func:`time_sharing`)."""

    slowdown: float
    source: str
    op_speed: float | None = None
    """The median GEMM op rate of the pinned traces over the reference's (None: no GEMM)."""

    @property
    def applies(self) -> bool:
        """Whether the slowdown describes ranks time-sharing cores that all stay busy (the
        world size it is for): the pinned ops ran no faster than the reference's, within
        :data:`PINNED_OP_SPEED_LIMIT`."""
        return self.op_speed is None or self.op_speed <= PINNED_OP_SPEED_LIMIT


def time_sharing(pinned: list[Trace], reference: list[Trace]) -> TimeSharing:
    """How much slower a rank's step runs when ranks time-share the cores than the even share
    says: the mean step of ``pinned`` (the ranks pinned to fewer cores, e.g. ``taskset -c 0``,
    more ranks per core) over that of ``reference`` (the same step with fewer ranks per core),
    divided by the ratio of their ranks per core; waits on collectives left out. Above 1 when
    switching between ranks costs (each finds the cache the other filled). It describes the
    world size it is for only when the cores outside the pinned ones were as busy as in the
    reference (the ranks on each core also slow those on the others: shared cache, memory
    bandwidth, on a VM whatever its vCPUs share): a pinned pair on one core of an otherwise idle
    host runs each op faster than the reference, and their step ratio mixes that gain into the
    slowdown. ``op_speed``, the median GEMM op rate pinned over reference
    (:func:`collsim.validate.fit.trace_rates.gemm_op_rates`), shows it; above
    :data:`PINNED_OP_SPEED_LIMIT` the slowdown does not apply (:attr:`TimeSharing.applies`).
    ConfigError (exit 2) when a trace does not record its cores (``collsim validate step
    --profile-dir`` does) or the pinned ranks do not share more."""

    def per_core(traces: list[Trace]) -> float:
        shares = {t.ranks_per_core for t in traces}
        if None in shares or len(shares) != 1:
            bad = next((t for t in traces if t.ranks_per_core is None), traces[0])
            raise ConfigError(
                "no 'collsim.cores' / 'collsim.local_ranks' metadata (or the ranks disagree): "
                "record the traces with `collsim validate step --profile-dir`",
                file=bad.path,
            )
        value = shares.pop()
        assert value is not None
        return value

    if not pinned or not reference:
        raise ConfigError("the time-sharing slowdown needs pinned and reference traces")
    ratio = per_core(pinned) / per_core(reference)
    if ratio <= 1.0:
        raise ConfigError(
            f"the pinned traces run {per_core(pinned):g} ranks per core, the reference "
            f"{per_core(reference):g}: pin the ranks to fewer cores (taskset -c 0)",
            file=pinned[0].path,
        )
    busy_p, busy_r = _busy_step_s(pinned), _busy_step_s(reference)
    slowdown = busy_p / busy_r / ratio

    def got(traces: list[Trace]) -> str:
        shares = [t.cpu_share for t in traces if t.cpu_share is not None]
        return f", threads got {statistics.mean(shares):.2f} of a core" if shares else ""

    names = ", ".join("/".join(Path(t.path).parts[-2:]) for t in pinned)
    refs = ", ".join("/".join(Path(t.path).parts[-2:]) for t in reference)
    source = (
        f"pinned {names} ({per_core(pinned):g} ranks per core, {busy_p * 1e3:.2f} ms per step"
        f"{got(pinned)}) over {refs} ({per_core(reference):g}, {busy_r * 1e3:.2f} ms"
        f"{got(reference)}), / {ratio:g}"
    )
    rates_p, rates_r = gemm_op_rates(pinned), gemm_op_rates(reference)
    op_speed = None
    if rates_p and rates_r:
        op_speed = statistics.median(rates_p) / statistics.median(rates_r)
        source += f"; GEMM ops x{op_speed:.3f} the reference's rate"
        if op_speed > PINNED_OP_SPEED_LIMIT:
            source += (
                f" (over x{PINNED_OP_SPEED_LIMIT:g}: the other cores were idler than the "
                "reference's; trace the pinned step beside as many ranks on the other cores)"
            )
    return TimeSharing(round(slowdown, 4), source, None if op_speed is None else round(op_speed, 4))
