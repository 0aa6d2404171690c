"""The Perfetto / Chrome trace: format, nesting per thread, counters, every op present."""

from __future__ import annotations

import gzip
import json
from collections import defaultdict
from pathlib import Path
from typing import Any

from click.testing import CliRunner

import collsim
from collsim.cli import cli
from collsim.report.trace import STREAM_TIDS, to_chrome_trace, write_trace
from collsim.step.result import TraceEvent


def check_chrome_trace(data: dict[str, Any]) -> list[dict[str, Any]]:
    """Assert the Chrome Trace Event Format rules collsim relies on; return the X slices."""
    assert isinstance(data["traceEvents"], list)
    named_pids, named_threads = set(), set()
    slices = []
    for event in data["traceEvents"]:
        assert event["ph"] in ("X", "M", "C", "s", "t", "f"), event
        if event["ph"] in ("s", "t", "f"):
            continue  # flow events: check_flows
        assert isinstance(event["pid"], int) and isinstance(event["tid"], int)
        if event["ph"] == "M":
            assert event["name"] in (
                "process_name",
                "thread_name",
                "process_sort_index",
                "thread_sort_index",
            )
            if event["name"] == "process_name":
                named_pids.add(event["pid"])
                assert event["args"]["name"]
            if event["name"] == "thread_name":
                named_threads.add((event["pid"], event["tid"]))
                assert event["args"]["name"]
        elif event["ph"] == "X":
            assert isinstance(event["name"], str) and event["name"]
            assert isinstance(event["ts"], float | int) and event["ts"] >= 0
            assert isinstance(event["dur"], float | int) and event["dur"] >= 0
            assert isinstance(event["args"], dict)
            slices.append(event)
        else:
            assert isinstance(event["ts"], float | int)
            assert event["args"] and all(isinstance(v, float | int) for v in event["args"].values())
    for event in slices:
        assert event["pid"] in named_pids
        assert (event["pid"], event["tid"]) in named_threads
    # Slices on one thread nest or are disjoint: never a partial overlap. Viewers hold
    # timestamps as integer nanoseconds, so compare on that grid.
    per_thread: dict[tuple[int, int], list[dict[str, Any]]] = defaultdict(list)
    for event in slices:
        per_thread[(event["pid"], event["tid"])].append(event)
    for events in per_thread.values():
        events.sort(key=lambda e: (e["ts"], -e["dur"]))
        open_ends: list[int] = []
        for event in events:
            start = round(event["ts"] * 1000)
            while open_ends and open_ends[-1] <= start:
                open_ends.pop()
            end = start + round(event["dur"] * 1000)
            assert not open_ends or end <= open_ends[-1], f"partial overlap at {event}"
            open_ends.append(end)
    check_flows(data, slices)
    return slices


def check_flows(data: dict[str, Any], slices: list[dict[str, Any]]) -> dict[Any, list[dict]]:
    """The Trace Event Format's rules for flow events; returns the flows by (cat, id).

    - ``ph`` is ``s`` (start), ``t`` (step) or ``f`` (end); ``id``, ``cat`` and ``name`` are
      the same on every event of one flow; each flow has exactly one ``s`` and one ``f``, the
      ``s`` first, then its ``t`` steps, then the ``f``, in non-decreasing ``ts``;
    - ``pid``, ``tid`` and ``ts`` place each event on a thread; an ``s`` or ``t`` binds to the
      slice of its thread that encloses its ``ts``, so one must; an ``f`` with ``bp: "e"``
      binds to its enclosing slice too (without ``bp`` it would bind to the next slice that
      starts after its ``ts``, so one must exist);
    - ``bp``, if present, is ``"e"``.
    """
    by_thread: dict[tuple[int, int], list[tuple[int, int]]] = defaultdict(list)
    for s in slices:
        start = round(s["ts"] * 1000)
        by_thread[(s["pid"], s["tid"])].append((start, start + round(s["dur"] * 1000)))

    def encloses(event: dict[str, Any]) -> bool:
        ts = round(event["ts"] * 1000)
        return any(a <= ts <= b for a, b in by_thread.get((event["pid"], event["tid"]), []))

    def next_slice(event: dict[str, Any]) -> bool:
        ts = round(event["ts"] * 1000)
        return any(a >= ts for a, _ in by_thread.get((event["pid"], event["tid"]), []))

    flows: dict[Any, list[dict[str, Any]]] = defaultdict(list)
    for event in data["traceEvents"]:
        if event["ph"] not in ("s", "t", "f"):
            continue
        assert isinstance(event["id"], int | str), event
        assert isinstance(event["cat"], str) and event["cat"], event
        assert isinstance(event["name"], str) and event["name"], event
        assert isinstance(event["pid"], int) and isinstance(event["tid"], int)
        assert isinstance(event["ts"], float | int) and event["ts"] >= 0
        assert event.get("bp", "e") == "e", event
        flows[(event["cat"], event["id"])].append(event)
    for key, events in flows.items():
        phases = [e["ph"] for e in events]
        assert phases[0] == "s" and phases[-1] == "f", (key, phases)
        assert phases.count("s") == 1 and phases.count("f") == 1, (key, phases)
        assert len({e["name"] for e in events}) == 1, key
        times = [e["ts"] for e in events]
        assert times == sorted(times), (key, times)
        for event in events:
            if event["ph"] in ("s", "t") or event.get("bp") == "e":
                assert encloses(event), f"flow {key} {event['ph']} not inside a slice"
            else:
                assert next_slice(event), f"flow {key} ends after every slice of its thread"
    return flows


def test_trace_has_every_op_with_its_facts(pipeline, result_factory, tmp_path: Path) -> None:
    events = pipeline("1f1b", stages=4, microbatches=8)
    result = result_factory(
        events=events,
        memory_timeline={
            0: [(0.0, 2**30), (0.004, 3 * 2**30), (0.02, 2 * 2**30)],
            3: [(0.0, 2**30), (0.01, 1.5 * 2**30)],
        },
    )
    path = write_trace(result, tmp_path / "step.json", name="tiny")
    data = json.loads(path.read_text())
    slices = check_chrome_trace(data)
    assert len(slices) == len(events)
    got = sorted((s["pid"], s["name"], round(s["ts"], 3), round(s["dur"], 3)) for s in slices)
    want = sorted(
        (e.rank, e.name, round(e.start_s * 1e6, 3), round((e.end_s - e.start_s) * 1e6, 3))
        for e in events
    )
    assert got == want
    # collectives keep bytes and algorithm; streams land on their own threads
    sends = [s for s in slices if s["name"].startswith("send")]
    assert sends and all(
        s["args"]["bytes"] == 1 << 20 and s["args"]["algorithm"] == "direct" for s in sends
    )
    assert {s["tid"] for s in sends} == {STREAM_TIDS["pp"]}
    assert {s["tid"] for s in slices if s["name"].startswith(("fwd", "bwd"))} == {
        STREAM_TIDS["compute"]
    }
    names = {
        (e["pid"], e["args"]["name"])
        for e in data["traceEvents"]
        if e["ph"] == "M" and e["name"] == "process_name"
    }
    assert names == {(r, f"rank {r}") for r in range(4)}
    counters = [e for e in data["traceEvents"] if e["ph"] == "C"]
    assert [(c["pid"], c["ts"], c["args"]["GiB"]) for c in counters if c["pid"] == 0] == [
        (0, 0.0, 1.0),
        (0, 4000.0, 3.0),
        (0, 20000.0, 2.0),
    ]
    assert data["otherData"]["scenario"] == "tiny"


def test_overlapping_events_on_one_stream_move_to_an_extra_thread(result_factory) -> None:
    # Two dp collectives in flight at once (0-10 us and 5-15 us) plus one nested slice.
    events = [
        TraceEvent(
            rank=0,
            stream="dp",
            name="all_reduce bucket 0",
            start_s=0.0,
            end_s=10e-6,
            args={"bytes": 100, "algorithm": "ring"},
        ),
        TraceEvent(
            rank=0,
            stream="dp",
            name="all_reduce bucket 1",
            start_s=5e-6,
            end_s=15e-6,
            args={"bytes": 200, "algorithm": "tree"},
        ),
        TraceEvent(rank=0, stream="dp", name="nested", start_s=1e-6, end_s=2e-6),
        TraceEvent(rank=0, stream="custom", name="other stream", start_s=0.0, end_s=1e-6),
    ]
    data = to_chrome_trace(result_factory(events=events, memory_timeline={}))
    slices = check_chrome_trace(data)
    assert len(slices) == 4
    tids = {s["name"]: s["tid"] for s in slices}
    assert tids["all_reduce bucket 0"] == tids["nested"] == STREAM_TIDS["dp"]
    assert tids["all_reduce bucket 1"] not in set(STREAM_TIDS.values())
    thread_names = {
        e["tid"]: e["args"]["name"]
        for e in data["traceEvents"]
        if e["ph"] == "M" and e["name"] == "thread_name"
    }
    assert thread_names[tids["all_reduce bucket 1"]] == "dp #2"
    assert thread_names[tids["other stream"]] == "custom"


def test_args_become_plain_json(result_factory, tmp_path: Path) -> None:
    import numpy as np

    from collsim.parallel.config import ScheduleKind

    events = [
        TraceEvent(
            rank=1,
            stream="tp",
            name="all_reduce",
            start_s=0.0,
            end_s=1e-3,
            args={
                "bytes": np.int64(64),
                "bw": np.float64(1.5),
                "schedule": ScheduleKind.GPIPE,
                "nan": float("nan"),
            },
        )
    ]
    path = write_trace(result_factory(events=events, memory_timeline={}), tmp_path / "t.json")
    (slice_,) = check_chrome_trace(json.loads(path.read_text()))
    assert slice_["args"] == {"bytes": 64, "bw": 1.5, "schedule": "gpipe", "nan": None}


def test_unwritable_trace_path_is_a_config_error(result_factory, tmp_path: Path) -> None:
    import pytest

    from collsim.core.errors import ConfigError

    with pytest.raises(ConfigError, match="trace: cannot write"):
        write_trace(result_factory(memory_timeline={}), tmp_path / "no-such-folder" / "t.json")


def test_trace_of_a_simulated_step_has_every_op(tmp_path: Path) -> None:
    import warnings

    from collsim.cluster.topology import load_topology
    from collsim.core.errors import CollsimWarning
    from collsim.parallel.config import ParallelConfig, TrainingConfig
    from collsim.play.engine import simulate_step
    from collsim.workload import TransformerSpec

    spec = TransformerSpec(
        name="tiny", num_layers=4, hidden=256, num_heads=8, ffn_hidden=1024, seq_len=128, vocab=1000
    )
    topology = load_topology("dgx_h100", nodes=1)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", CollsimWarning)
        result = simulate_step(
            topology,
            spec,
            TrainingConfig(global_batch=8, micro_batch=1),
            ParallelConfig(tp=2, pp=2, dp=2, zero=1),
            trace=True,
        )
    data = json.loads(write_trace(result, tmp_path / "step.json").read_text())
    slices = check_chrome_trace(data)
    assert len(result.trace_events) > 0
    assert sorted((s["pid"], s["cat"], s["name"], s["ts"]) for s in slices) == sorted(
        (e.rank, e.stream, e.name, round(e.start_s * 1e9) / 1e3) for e in result.trace_events
    )
    # every stage runs a forward and a backward of each of the 8 / (1 x 2) = 4 micro-batches
    for rank in {e.rank for e in result.trace_events}:
        compute = [
            s["name"].split()[:2] for s in slices if s["pid"] == rank and s["cat"] == "compute"
        ]
        assert sorted(c for c in compute if c[0] == "F") == [["F", f"mb{k}"] for k in range(4)]
        assert sorted(c for c in compute if c[0] == "B") == [["B", f"mb{k}"] for k in range(4)]
    counters = [e for e in data["traceEvents"] if e["ph"] == "C"]
    assert {c["pid"] for c in counters} == set(result.memory_timeline)
    assert len(counters) == sum(len(v) for v in result.memory_timeline.values())


def test_run_import_path_stays_light() -> None:
    import subprocess
    import sys

    code = (
        "import sys, collsim.report.trace, collsim.study.sweep, collsim.study.search; "
        "import collsim.play.walk; "
        "heavy = [m for m in ('pandas', 'matplotlib') if m in sys.modules]; "
        "print(','.join(heavy))"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=True
    )
    assert out.stdout.strip() == ""


REPO = Path(__file__).resolve().parents[2]
PIPE = REPO / "scenarios" / "pipeline_13b_1f1b.yaml"


def test_pipeline_sends_flow_to_their_receives() -> None:
    sim = collsim.simulate(PIPE, {"training.global_batch": 8}, trace=True)
    data = to_chrome_trace(sim.result, name="pp")
    slices = check_chrome_trace(data)  # includes check_flows
    flows = check_flows(data, slices)
    pp = [events for (cat, _), events in flows.items() if cat == "pp_flow"]
    sends = [s for s in slices if s["name"].startswith("send ")]
    assert len(pp) == len(sends) == 48  # 8 micro-batches x 3 stage boundaries x F and B
    by_pos = {(s["pid"], s["tid"], s["ts"]): s for s in slices}
    for start, end in pp:
        src = next(s for s in sends if (s["pid"], s["tid"], s["ts"]) == (start["pid"],
                   start["tid"], start["ts"]))  # fmt: skip
        dst = by_pos[(end["pid"], end["tid"], end["ts"])]
        assert dst["name"].startswith("recv ") and dst["pid"] != src["pid"]
        label = src["name"].split(" -> ")[0].removeprefix("send ")
        assert dst["name"].split(" <- ")[0] == f"recv {label}"
    comm = [events for (cat, _), events in flows.items() if cat == "comm_flow"]
    collectives = [s for s in slices if s["cat"] in ("tp", "dp", "pp")
                   and not s["name"].startswith(("send ", "recv "))]  # fmt: skip
    assert comm and len(comm) <= len(collectives)
    computes: dict[int, list[dict[str, Any]]] = {}
    for s in slices:
        if s["cat"] == "compute":
            computes.setdefault(s["pid"], []).append(s)
    for start, end in comm:
        assert start["tid"] == 1 and start["pid"] == end["pid"]  # from the rank's compute
        # from the latest compute slice of the rank that starts by the collective's start
        begun = [c["ts"] for c in computes[start["pid"]] if c["ts"] <= end["ts"]]
        latest = max(begun)
        inside = [
            c
            for c in computes[start["pid"]]
            if c["ts"] == latest and c["ts"] <= start["ts"] <= c["ts"] + c["dur"]
        ]
        assert inside, (start, end)


def test_trace_json_gz_is_gzip(tmp_path: Path) -> None:
    path = tmp_path / "step.json.gz"
    res = CliRunner().invoke(cli, ["run", str(PIPE), "--set", "training.global_batch=8",
                                   "--trace", str(path)])  # fmt: skip
    assert res.exit_code == 0, res.stderr
    assert path.read_bytes()[:2] == b"\x1f\x8b"
    with gzip.open(path, "rt") as handle:
        data = json.load(handle)
    check_chrome_trace(data)
    plain = tmp_path / "step.json"
    CliRunner().invoke(cli, ["run", str(PIPE), "--set", "training.global_batch=8",
                             "--trace", str(plain)])  # fmt: skip
    assert json.loads(plain.read_text())["traceEvents"] == data["traceEvents"]
