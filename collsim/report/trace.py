"""Perfetto / Chrome trace of one simulated step (``collsim run --trace FILE``).

Derivations, measurements and sources: docs/derivations.md, ``collsim.report.trace``.
"""

from __future__ import annotations

import gzip
import json
import math
import re
from bisect import bisect_right
from collections import defaultdict
from enum import Enum
from pathlib import Path
from typing import Any

from collsim.core.errors import ConfigError
from collsim.step.result import StepResult, TraceEvent

__all__ = ["STREAM_TIDS", "to_chrome_trace", "write_trace"]

#: Thread id of each known stream; unknown streams get ids after these, in order of appearance.
STREAM_TIDS: dict[str, int] = {"compute": 1, "tp": 2, "pp": 3, "dp": 4, "offload": 5}


def _jsonable(value: Any) -> Any:
    """Args as JSON values: enums by value, numpy scalars as Python numbers, NaN as None."""
    if isinstance(value, Enum):
        return value.value
    if isinstance(value, bool) or value is None or isinstance(value, str):
        return value
    if isinstance(value, int):
        return value
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    if isinstance(value, dict):
        return {str(k): _jsonable(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_jsonable(v) for v in value]
    item = getattr(value, "item", None)  # numpy scalar
    if callable(item):
        return _jsonable(item())
    return str(value)


def _ns(time_s: float) -> int:
    """Whole nanoseconds: trace viewers (Perfetto) store timestamps as integer ns, so slices are
    laid out and nested on that grid, not on float microseconds that may round apart."""
    return int(round(time_s * 1e9))


def _lanes(spans: list[tuple[int, int]]) -> list[int]:
    """Lane (0 = the stream's own thread) of each (start_ns, end_ns) span so that no two slices
    on a lane overlap partially. Spans must be sorted by start, longest first on ties."""
    lane_ends: list[list[int]] = []  # per lane: stack of open slice ends (for nesting)
    out: list[int] = []
    for start, end in spans:
        placed = -1
        for index, stack in enumerate(lane_ends):
            while stack and stack[-1] <= start:
                stack.pop()
            if not stack or end <= stack[-1]:
                stack.append(end)
                placed = index
                break
        if placed < 0:
            lane_ends.append([end])
            placed = len(lane_ends) - 1
        out.append(placed)
    return out


def to_chrome_trace(result: StepResult, *, name: str | None = None) -> dict[str, Any]:
    """The step as a Chrome trace (``{"traceEvents": [...], ...}``), ready for ``json.dump``.

    Args:
        result: a StepResult simulated with ``trace=True`` (its ``trace_events`` and
            ``memory_timeline`` are what gets drawn).
        name: a title stored in ``otherData`` (the scenario name).

    Returns:
        The trace object. Every TraceEvent becomes exactly one ``X`` slice.
    """
    trace: list[dict[str, Any]] = []
    by_stream: dict[tuple[int, str], list[TraceEvent]] = defaultdict(list)
    for event in result.trace_events:
        by_stream[(int(event.rank), str(event.stream))].append(event)
    ranks = sorted({rank for rank, _ in by_stream} | {int(r) for r in result.memory_timeline})

    extra_tids: dict[str, int] = {}
    next_tid = max(STREAM_TIDS.values()) + 1

    def tid_of(stream: str) -> int:
        nonlocal next_tid
        if stream in STREAM_TIDS:
            return STREAM_TIDS[stream]
        if stream not in extra_tids:
            extra_tids[stream] = next_tid
            next_tid += 1
        return extra_tids[stream]

    trace.extend(_process_metadata(ranks))

    threads: dict[tuple[int, int], str] = {}
    slices: list[dict[str, Any]] = []
    placed: list[tuple[TraceEvent, dict[str, Any]]] = []
    for (rank, stream), events in sorted(
        by_stream.items(), key=lambda kv: (kv[0][0], tid_of(kv[0][1]))
    ):
        spans = sorted(
            ((_ns(e.start_s), max(_ns(e.start_s), _ns(e.end_s)), i) for i, e in enumerate(events)),
            key=lambda t: (t[0], t[0] - t[1], t[2]),
        )
        lanes = _lanes([(start, end) for start, end, _ in spans])
        for (start_ns, end_ns, index), lane in zip(spans, lanes):
            event = events[index]
            base = tid_of(stream)
            label = stream if lane == 0 else f"{stream} #{lane + 1}"
            tid = base if lane == 0 else tid_of(label)
            threads[(rank, tid)] = label
            args = _jsonable(dict(event.args or {}))
            record = {
                "ph": "X",
                "name": str(event.name),
                "cat": stream,
                "pid": rank,
                "tid": tid,
                "ts": start_ns / 1e3,
                "dur": (end_ns - start_ns) / 1e3,
                "args": args,
            }
            slices.append(record)
            placed.append((event, record))
    trace.extend(_thread_metadata(threads))
    trace.extend(slices)
    trace.extend(_flows(placed))
    trace.extend(_memory_counters(result))
    other = {
        "generator": "collsim",
        "step_time_s": float(result.step_time_s),
        "mfu": float(result.mfu),
        "num_gpus": int(result.num_gpus),
        "memory_peak_bytes": float(result.memory_peak_bytes),
    }
    if name:
        other["scenario"] = name
    return {"traceEvents": trace, "displayTimeUnit": "ms", "otherData": _jsonable(other)}


def _process_metadata(ranks: list[int]) -> list[dict[str, Any]]:
    """One process per rank, named ``rank N`` and sorted by rank."""
    out: list[dict[str, Any]] = []
    for rank in ranks:
        out.append(
            {
                "ph": "M",
                "name": "process_name",
                "pid": rank,
                "tid": 0,
                "args": {"name": f"rank {rank}"},
            }
        )
        out.append(
            {
                "ph": "M",
                "name": "process_sort_index",
                "pid": rank,
                "tid": 0,
                "args": {"sort_index": rank},
            }
        )
    return out


def _thread_metadata(threads: dict[tuple[int, int], str]) -> list[dict[str, Any]]:
    """The name and sort index of every (rank, thread) that holds a slice."""
    out: list[dict[str, Any]] = []
    for (rank, tid), label in sorted(threads.items()):
        out.append(
            {"ph": "M", "name": "thread_name", "pid": rank, "tid": tid, "args": {"name": label}}
        )
        out.append(
            {
                "ph": "M",
                "name": "thread_sort_index",
                "pid": rank,
                "tid": tid,
                "args": {"sort_index": tid},
            }
        )
    return out


def _memory_counters(result: StepResult) -> list[dict[str, Any]]:
    """A ``memory`` counter (GiB) per rank of the memory timeline."""
    return [
        {
            "ph": "C",
            "name": "memory",
            "pid": int(rank),
            "tid": 0,
            "ts": _ns(float(time_s)) / 1e3,
            "args": {"GiB": float(size_bytes) / 2**30},
        }
        for rank in sorted(result.memory_timeline)
        for time_s, size_bytes in result.memory_timeline[rank]
    ]


_SEND = re.compile(r"^send (?P<label>.+) -> stage (?P<to>\d+)$")
_RECV = re.compile(r"^recv (?P<label>.+) <- stage (?P<src>\d+)$")
#: Streams whose slices are collectives that wait on compute.
_COMM_STREAMS = ("tp", "dp", "pp")


def _flow_pair(
    flow_id: int, cat: str, name: str, src: dict[str, Any], src_ns: int, dst: dict[str, Any]
) -> list[dict[str, Any]]:
    """An arrow from inside ``src`` (at ``src_ns``) to the start of ``dst``."""
    dst_ns = round(dst["ts"] * 1e3)
    common = {"name": name, "cat": cat, "id": flow_id}
    return [
        {**common, "ph": "s", "pid": src["pid"], "tid": src["tid"], "ts": src_ns / 1e3},
        {
            **common,
            "ph": "f",
            "bp": "e",
            "pid": dst["pid"],
            "tid": dst["tid"],
            "ts": max(dst_ns, src_ns) / 1e3 if dst_ns >= src_ns else dst_ns / 1e3,
        },
    ]


def _flows(placed: list[tuple[TraceEvent, dict[str, Any]]]) -> list[dict[str, Any]]:
    """Flow arrows: pipeline send -> matching recv, and compute -> the collective after it.

    A send ``send F mb3 c0 -> stage 2`` on a rank of stage 1 pairs with the receive ``recv F
    mb3 c0 <- stage 1`` that starts at the same nanosecond on a rank of stage 2; when several
    ranks of a stage send the same micro-batch at once (data-parallel replicas, ``--all-ranks``),
    the k-th sender by rank pairs with the k-th receiver by rank.
    """
    out: list[dict[str, Any]] = []
    next_id = 1
    recvs: dict[tuple[str, int, int], list[dict[str, Any]]] = defaultdict(list)
    sends: dict[tuple[str, int, int], list[dict[str, Any]]] = defaultdict(list)
    for _, record in placed:
        if (m := _RECV.match(record["name"])) is not None:
            src = int(m["src"])
            recvs[(m["label"], src, round(record["ts"] * 1e3))].append(record)
    for _, record in placed:
        if (m := _SEND.match(record["name"])) is not None:
            to = int(m["to"])
            ts = round(record["ts"] * 1e3)
            here, other = (to - 1, to + 1) if m["label"].startswith("F") else (to + 1, to - 1)
            if (m["label"], here, ts) not in recvs and (m["label"], other, ts) in recvs:
                here = other  # a chunk that runs up the stages (DualPipeV's V)
            sends[(m["label"], here, ts)].append(record)
    for key, senders in sorted(sends.items(), key=lambda kv: (kv[0][2], kv[0][0], kv[0][1])):
        receivers = recvs.get(key, [])
        for send, recv in zip(
            sorted(senders, key=lambda r: r["pid"]), sorted(receivers, key=lambda r: r["pid"])
        ):
            out += _flow_pair(next_id, "pp_flow", key[0], send, round(send["ts"] * 1e3), recv)
            next_id += 1
    computes: dict[int, list[dict[str, Any]]] = defaultdict(list)
    for _, record in placed:
        if record["cat"] == "compute":
            computes[record["pid"]].append(record)
    starts_ns: dict[int, list[int]] = {}
    for pid, rank_slices in computes.items():
        rank_slices.sort(key=lambda r: (r["ts"], -r["dur"]))
        starts_ns[pid] = [round(c["ts"] * 1e3) for c in rank_slices]  # non-decreasing
    for _, record in placed:
        if record["cat"] not in _COMM_STREAMS or record["name"].startswith(("send ", "recv ")):
            continue
        start_ns = round(record["ts"] * 1e3)
        # the last compute slice of the rank, in that order, that starts by then
        k = bisect_right(starts_ns.get(record["pid"], ()), start_ns)
        if not k:
            continue
        compute = computes[record["pid"]][k - 1]
        c_start = round(compute["ts"] * 1e3)
        c_end = c_start + round(compute["dur"] * 1e3)
        if c_end <= c_start:
            continue
        # inside the compute slice: where the collective starts, or just before its end
        at = start_ns if start_ns < c_end else c_end - 1
        out += _flow_pair(next_id, "comm_flow", record["name"], compute, at, record)
        next_id += 1
    return out


def write_trace(result: StepResult, path: str | Path, *, name: str | None = None) -> Path:
    """Write the Chrome/Perfetto trace of ``result`` to ``path`` (JSON, gzip-compressed when
    the name ends in ``.gz``) and return the path.

    Open it at https://ui.perfetto.dev ("Open trace file") or in chrome://tracing.

    Raises:
        ConfigError: the file cannot be written (no such folder, a folder, no permission).
    """
    path = Path(path)
    data = to_chrome_trace(result, name=name)
    try:
        if path.suffix.lower() == ".gz":
            with gzip.open(path, "wt", encoding="utf-8") as zipped:
                json.dump(data, zipped, separators=(",", ":"), allow_nan=False)
        else:
            with path.open("w") as handle:
                json.dump(data, handle, separators=(",", ":"), allow_nan=False)
    except OSError as exc:
        raise ConfigError(
            f"cannot write {str(path)!r}: {exc.strerror or exc}", key_path="trace"
        ) from None
    return path
