"""Read a PyTorch profiler (Kineto) Chrome trace, ``.json`` or ``.json.gz``, into the events a
breakdown needs: complete events (``ph: "X"``) with their category (``cpu_op``,
``user_annotation``, ``cuda_runtime``, ``kernel``, ``gpu_memcpy``, ``gpu_memset``...), thread or
stream, and the arguments Kineto records (``correlation``, ``External id``, ``stream``,
``device``, ``Input Dims`` / ``Input type``, and on NCCL kernels and ``record_param_comms`` the
``Collective name``, ``In msg nelems``, ``dtype``, ``Group size``, ``Process Group Ranks``), plus
the ``distributedInfo`` and ``deviceProperties`` metadata (and ``collsim``'s own: the cores a
rank of ``collsim validate step`` could run on). The format is Kineto's
``ChromeTraceLogger`` output as PyTorch writes it (``torch.profiler.profile.export_chrome_trace``)
and as HolisticTraceAnalysis reads it (``hta/common/trace_parser.py``). Every malformed input
raises one :class:`~collsim.core.errors.ConfigError` line naming the file (exit 2). The JSON parser
is
chosen by :func:`default_reader` from :data:`READERS`, by the measurement in
:data:`PEAK_BYTES_PER_TRACE_BYTE`.
"""

from __future__ import annotations

import gzip
import importlib.util
import io
import json
import os
import sys
import zlib
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Any

from collsim.core.errors import ConfigError

__all__ = [
    "Event",
    "Trace",
    "read_trace",
    "read_traces",
    "READERS",
    "STEP_PREFIX",
]

STEP_PREFIX = "ProfilerStep#"
"""The annotation ``torch.profiler.profile.step()`` opens around each step (Kineto traces of
torch 1.8 on; the number is the profiler's step count)."""

#: Arguments kept from each event (the rest of Kineto's args are dropped while reading).
KEPT_ARGS = frozenset(
    {
        "correlation",
        "External id",
        "stream",
        "device",
        "Input Dims",
        "Input type",
        "Concrete Inputs",
        "Collective name",
        "In msg nelems",
        "Out msg nelems",
        "In split size",
        "dtype",
        "Group size",
        "Process Group Ranks",
        "Process Group Name",
    }
)


@dataclass(slots=True)
class Event:
    """One complete event of a trace (times in microseconds, as Kineto writes them)."""

    name: str
    cat: str
    ts_us: float
    dur_us: float
    pid: Any
    tid: Any
    args: dict[str, Any]

    @property
    def end_us(self) -> float:
        return self.ts_us + self.dur_us


@dataclass
class Trace:
    """The events of one rank's trace and what its metadata says."""

    path: str
    events: list[Event]
    rank: int | None = None
    world_size: int | None = None
    backend: str | None = None
    devices: list[str] = field(default_factory=list)
    """``deviceProperties[].name`` (empty on a CPU-only trace)."""
    cores: int | None = None
    """The CPU cores the rank could run on while traced (``collsim.cores``, written by
    ``collsim validate step --profile-dir``; None in other traces)."""
    local_ranks: int | None = None
    """The ranks of the job on the rank's node (``collsim.local_ranks``; None likewise)."""
    cpu_share: float | None = None
    """The share of a core the step's thread got over the traced steps (its CPU time over the
    wall time, ``collsim.cpu_share``; None likewise)."""

    @property
    def ranks_per_core(self) -> float | None:
        """The job's ranks per core the rank could run on (None: not recorded)."""
        if self.cores is None or self.local_ranks is None or self.cores <= 0:
            return None
        return self.local_ranks / self.cores

    @property
    def label(self) -> str:
        return f"rank {self.rank}" if self.rank is not None else Path(self.path).name

    def steps(self) -> list[Event]:
        """The ``ProfilerStep#N`` annotations on the host, in time order (one per step)."""
        found = [
            e
            for e in self.events
            if e.name.startswith(STEP_PREFIX) and e.cat in ("user_annotation", "cpu_op")
        ]
        return sorted(found, key=lambda e: e.ts_us)

    @property
    def on_gpu(self) -> bool:
        """Whether the trace holds device activity (kernels, copies, memsets)."""
        return any(e.cat in GPU_CATS for e in self.events)


GPU_CATS = frozenset({"kernel", "gpu_memcpy", "gpu_memset"})
"""Kineto's categories of device activity (CUDA and ROCm alike)."""


def _bad(path: str, what: str) -> ConfigError:
    return ConfigError(what, file=path)


class _Counting(io.RawIOBase):
    """A binary file that reports how far it has been read (for the progress bar)."""

    def __init__(self, raw: IO[bytes], total: int, tick: Callable[[int, int], None]) -> None:
        self._raw = raw
        self._total = total
        self._tick = tick
        self._done = 0

    def readable(self) -> bool:
        return True

    def readinto(self, buf: Any) -> int:
        n = self._raw.readinto(buf)  # type: ignore[attr-defined]
        self._done += n or 0
        self._tick(self._done, self._total)
        return int(n or 0)


def _progress(label: str) -> Callable[[int, int], None]:
    """A progress line on stderr when it is a terminal (none otherwise)."""
    if not sys.stderr.isatty():
        return lambda done, total: None
    last = [-1]

    def tick(done: int, total: int) -> None:
        pct = int(100 * done / max(total, 1))
        if pct != last[0]:
            last[0] = pct
            bar = "#" * (pct // 4)
            end = "\n" if done >= total else ""
            sys.stderr.write(f"\rreading {label} [{bar:<25}] {pct:3d} %{end}")
            sys.stderr.flush()

    return tick


def _open(path: str, progress: bool) -> tuple[IO[bytes], IO[bytes]]:
    """The file's bytes, decompressed when it is gzip (by its magic, whatever its name)."""
    try:
        raw = open(path, "rb")  # noqa: SIM115 - closed by the caller through the wrapper
    except FileNotFoundError:
        raise _bad(path, "no such file") from None
    except OSError as exc:
        raise _bad(path, f"cannot read: {exc.strerror}") from None
    total = os.fstat(raw.fileno()).st_size
    stream: IO[bytes] = raw
    if progress:
        counted = _Counting(raw, total, _progress(Path(path).name))
        stream = io.BufferedReader(counted, buffer_size=1 << 20)
    magic = raw.read(2)
    raw.seek(0)
    if magic == b"\x1f\x8b":
        return gzip.GzipFile(fileobj=stream, mode="rb"), raw  # type: ignore[return-value]
    return stream, raw


def _read_bytes(path: str, progress: bool) -> bytes:
    stream, raw = _open(path, progress)
    try:
        return stream.read()
    except EOFError:
        raise _bad(path, "truncated gzip: the file ends before its end-of-stream marker") from None
    except (OSError, zlib.error) as exc:
        raise _bad(path, f"not a readable gzip file ({exc})") from None
    finally:
        stream.close()
        raw.close()


def _doc_json(path: str, progress: bool) -> dict[str, Any]:
    data = _read_bytes(path, progress)
    try:
        doc = json.loads(data)
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise _bad(path, f"not valid JSON ({exc})") from None
    return _top(path, doc)


def _doc_orjson(path: str, progress: bool) -> dict[str, Any]:
    import orjson  # optional (the traces extra): loaded only when it is installed and chosen

    data = _read_bytes(path, progress)
    try:
        doc = orjson.loads(data)
    except orjson.JSONDecodeError as exc:
        raise _bad(path, f"not valid JSON ({exc})") from None
    return _top(path, doc)


def _top(path: str, doc: Any) -> dict[str, Any]:
    if not isinstance(doc, dict) or not isinstance(doc.get("traceEvents"), list):
        raise _bad(
            path,
            "no 'traceEvents' list at the top level: not a PyTorch profiler (Kineto) trace",
        )
    return doc


def _doc_ijson(path: str, progress: bool) -> dict[str, Any]:
    """Stream the file: each event is built, filtered (:func:`_event`) and dropped, so that
    memory holds the kept events, never the whole document."""
    # optional (the traces extra): loaded only when it is installed and chosen
    import ijson  # type: ignore[import-untyped,unused-ignore]

    stream, raw = _open(path, progress)
    doc: dict[str, Any] = {"traceEvents": []}
    kept: list[Event] = doc["traceEvents"]
    builder: Any = None
    depth = 0
    key: str | None = None
    seen_events = False
    try:
        for prefix, kind, value in ijson.parse(stream, use_float=True):
            if builder is not None:
                builder.event(kind, value)
                depth += kind in ("start_map", "start_array")
                depth -= kind in ("end_map", "end_array")
                if depth == 0:
                    if key is None:
                        event = _event(builder.value)
                        if event is not None:
                            kept.append(event)
                    else:
                        doc[key] = builder.value
                    builder = None
                continue
            if prefix == "traceEvents" and kind == "start_array":
                seen_events = True
            elif prefix == "traceEvents.item" and kind == "start_map":
                builder, depth, key = ijson.ObjectBuilder(), 1, None
                builder.event(kind, value)
            elif prefix in ("distributedInfo", "deviceProperties", "collsim") and kind in (
                "start_map",
                "start_array",
            ):
                builder, depth, key = ijson.ObjectBuilder(), 1, prefix
                builder.event(kind, value)
    except EOFError:
        raise _bad(path, "truncated gzip: the file ends before its end-of-stream marker") from None
    except (OSError, zlib.error) as exc:
        raise _bad(path, f"not a readable gzip file ({exc})") from None
    except ijson.JSONError as exc:
        raise _bad(path, f"not valid JSON ({exc})") from None
    finally:
        stream.close()
        raw.close()
    if not seen_events:
        _top(path, {})
    doc["_events_built"] = True
    return doc


READERS: dict[str, Callable[[str, bool], dict[str, Any]]] = {
    "json": _doc_json,
    "orjson": _doc_orjson,
    "ijson": _doc_ijson,
}
"""The JSON parsers a trace can be read with: the standard library, orjson (the whole file in
memory, fastest), ijson (streamed, memory bounded by the kept events)."""


PEAK_BYTES_PER_TRACE_BYTE = {"json": 7.1, "orjson": 9.2, "ijson": 4.5}
"""Peak resident memory per byte of uncompressed trace while reading, measured on a 259 MB
trace of 330 CPU steps (``benchmarks/bench_trace_read.py``, 732,050 events; torch 2.13, Python
3.11, orjson 3.13, ijson 3.6 with its yajl2_c backend): 1,829 / 2,378 / 1,162 MB. The same
run timed the parse at 17-22 / 9-12 / 41.5 CPU seconds (two runs of the first two)."""


def _uncompressed_bytes(path: str) -> int:
    """The trace's size once decompressed: a gzip's ISIZE trailer (its size modulo 2**32), or
    the file's size."""
    size = os.path.getsize(path)
    with open(path, "rb") as f:
        if f.read(2) != b"\x1f\x8b":
            return size
        f.seek(-4, os.SEEK_END)
        isize = int.from_bytes(f.read(4), "little")
    return isize if isize >= size else isize + (1 << 32)


def _available_bytes() -> int | None:
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        return None
    return None


def default_reader(path: str | None = None) -> str:
    """The parser a trace is read with when none is named: orjson where installed (the
    fastest in the measurement of :data:`PEAK_BYTES_PER_TRACE_BYTE`), else the standard
    library; ijson (streamed, bounded by the events kept) when that parser's measured peak
    for this file would pass half the memory available and ijson is installed."""

    fast = "orjson" if importlib.util.find_spec("orjson") is not None else "json"
    if path is None or importlib.util.find_spec("ijson") is None:
        return fast
    avail = _available_bytes()
    try:
        need = PEAK_BYTES_PER_TRACE_BYTE[fast] * _uncompressed_bytes(path)
    except OSError:
        return fast
    return "ijson" if avail is not None and need > avail / 2 else fast


def _event(raw: Any) -> Event | None:
    """A complete event with a name and times; anything else (metadata, flows, instants,
    counters) is None."""
    if not isinstance(raw, dict) or raw.get("ph") != "X":
        return None
    try:
        ts = float(raw["ts"])
        dur = float(raw.get("dur", 0.0))
    except (KeyError, TypeError, ValueError):
        return None
    args = raw.get("args") or {}
    kept = {k: v for k, v in args.items() if k in KEPT_ARGS} if isinstance(args, dict) else {}
    return Event(
        str(raw.get("name", "")),
        str(raw.get("cat", "")),
        ts,
        dur,
        raw.get("pid"),
        raw.get("tid"),
        kept,
    )


def _events(doc: dict[str, Any]) -> Iterator[Event]:
    if doc.get("_events_built"):
        yield from doc["traceEvents"]
        return
    raws = doc["traceEvents"]
    for i, raw in enumerate(raws):
        raws[i] = None  # each parsed event goes as it is converted: the peak holds one copy
        event = _event(raw)
        if event is not None:
            yield event


def read_trace(path: str | Path, *, reader: str | None = None, progress: bool = True) -> Trace:
    """One rank's trace; ConfigError (exit 2, one line naming the file) when it cannot be read,
    holds no ``traceEvents``, or no ``ProfilerStep#N`` annotation."""
    name = str(path)
    how = reader or default_reader(name)
    if how not in READERS:
        raise ConfigError(f"unknown reader {how!r}; choose from {', '.join(READERS)}")
    if how != "json":
        if importlib.util.find_spec(how) is None:
            raise ConfigError(
                f"reader {how!r} needs the {how} package (pip install 'collsim[traces]')",
                key_path="--reader",
            )
    doc = READERS[how](name, progress)
    events = list(_events(doc))
    dist = doc.get("distributedInfo") if isinstance(doc.get("distributedInfo"), dict) else {}
    props = doc.get("deviceProperties") if isinstance(doc.get("deviceProperties"), list) else []
    assert isinstance(dist, dict) and isinstance(props, list)
    ours = doc.get("collsim") if isinstance(doc.get("collsim"), dict) else {}
    assert isinstance(ours, dict)
    trace = Trace(
        name,
        events,
        rank=_int_or_none(dist.get("rank")),
        world_size=_int_or_none(dist.get("world_size")),
        backend=str(dist["backend"]) if "backend" in dist else None,
        devices=[str(p.get("name", "")) for p in props if isinstance(p, dict)],
        cores=_int_or_none(ours.get("cores")),
        local_ranks=_int_or_none(ours.get("local_ranks")),
        cpu_share=float(ours["cpu_share"])
        if isinstance(ours.get("cpu_share"), (int, float))
        else None,
    )
    if not events:
        raise _bad(name, "'traceEvents' holds no complete (ph 'X') event")
    if not trace.steps():
        raise _bad(
            name,
            f"no '{STEP_PREFIX}N' annotation: trace steps with torch.profiler.profile(...) and "
            "prof.step() (or record_function('ProfilerStep#<i>')) around each step",
        )
    return trace


def _int_or_none(value: Any) -> int | None:
    try:
        return None if value is None else int(value)
    except (TypeError, ValueError):
        return None


def read_traces(
    paths: list[str] | tuple[str, ...], *, reader: str | None = None, progress: bool = True
) -> list[Trace]:
    """Several ranks' traces of one job, ordered by rank. ConfigError when two files hold the
    same rank or a rank between the lowest and the highest given is missing (a set of ranks
    need not start at 0 nor hold the whole world: HolisticTraceAnalysis ships 2 of 128)."""
    traces = [read_trace(p, reader=reader, progress=progress) for p in paths]
    if len(traces) < 2:
        return traces
    ranked = [t for t in traces if t.rank is not None]
    if len(ranked) != len(traces):
        unnamed = next(t for t in traces if t.rank is None)
        raise _bad(unnamed.path, "no 'distributedInfo.rank' in a set of several ranks' traces")
    by_rank: dict[int, Trace] = {}
    for t in ranked:
        assert t.rank is not None
        if t.rank in by_rank:
            raise _bad(t.path, f"rank {t.rank} again (also in {by_rank[t.rank].path})")
        by_rank[t.rank] = t
    lo, hi = min(by_rank), max(by_rank)
    missing = [r for r in range(lo, hi + 1) if r not in by_rank]
    if missing:
        raise ConfigError(
            f"rank {missing[0]} missing from the traces given (ranks {lo}-{hi}: "
            f"{len(missing)} missing); give every rank's file",
            file=by_rank[lo].path,
        )
    worlds = {t.world_size for t in ranked if t.world_size is not None}
    if len(worlds) > 1:
        raise ConfigError(f"the traces disagree on the world size: {sorted(worlds)}")
    return [by_rank[r] for r in sorted(by_rank)]
