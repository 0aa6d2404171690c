"""Reading a large Kineto trace: time and peak memory of each JSON parser of
:mod:`collsim.validate.data.kineto` (the standard library, orjson, ijson), each in a fresh
process (peak resident memory from ``getrusage``), and the breakdown after it.

Run: ``python benchmarks/bench_trace_read.py SRC.json.gz --copies 150 --out /tmp/big.json``:
builds a trace of ``copies`` x the steps of SRC (a ``validate step --profile-dir`` trace; the
copies shifted in time one after another, each step renumbered), uncompressed and gzipped,
then reads each with every parser. Times are CPU seconds of the reading process (its wall
time too: on a loaded host only the CPU time compares). The large files stay where ``--out``
puts them.
"""

from __future__ import annotations

import argparse
import gzip
import json
import os
import subprocess
import sys
import time
from pathlib import Path

CHILD = """
import resource, sys, time
from collsim.validate.measure.traces.breakdown import breakdown
from collsim.validate.data.kineto import read_trace
c0, t0 = time.process_time(), time.perf_counter()
trace = read_trace(sys.argv[1], reader=sys.argv[2], progress=False)
c1, t1 = time.process_time(), time.perf_counter()
steps = breakdown(trace)
c2 = time.process_time()
peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
print(f"{c1 - c0:.2f} {t1 - t0:.2f} {c2 - c1:.2f} {peak:.0f} {len(trace.events)} {len(steps)}")
"""


def build(src: str, copies: int, out: Path) -> None:
    with gzip.open(src, "rt") as f:
        doc = json.load(f)
    events = doc["traceEvents"]
    xs = [e for e in events if e.get("ph") == "X" and isinstance(e.get("ts"), int | float)]
    lo = min(e["ts"] for e in xs)
    span = max(e["ts"] + e.get("dur", 0) for e in xs) - lo
    steps = sum(1 for e in xs if str(e.get("name", "")).startswith("ProfilerStep#"))
    with open(out, "w") as f:
        head = {k: v for k, v in doc.items() if k != "traceEvents"}
        f.write(json.dumps(head)[:-1] + ', "traceEvents": [\n')
        first = True
        for c in range(copies):
            for e in events:
                if e.get("ph") != "X":
                    if c:
                        continue
                    e2 = e
                else:
                    e2 = dict(e, ts=e["ts"] + c * span)
                    name = str(e.get("name", ""))
                    if name.startswith("ProfilerStep#"):
                        e2["name"] = f"ProfilerStep#{c * steps + int(name[13:])}"
                f.write(("" if first else ",\n") + json.dumps(e2))
                first = False
        f.write("\n]}\n")
    with open(out, "rb") as src_f, gzip.open(f"{out}.gz", "wb", compresslevel=1) as dst:
        while chunk := src_f.read(1 << 24):
            dst.write(chunk)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("src")
    parser.add_argument("--copies", type=int, default=150)
    parser.add_argument("--out", default="/tmp/collsim_big_trace.json")
    parser.add_argument("--readers", default="json,orjson,ijson")
    args = parser.parse_args()
    out = Path(args.out)
    if not out.exists():
        build(args.src, args.copies, out)
    for path in (out, Path(f"{out}.gz")):
        size_mb = os.path.getsize(path) / 1e6
        for reader in args.readers.split(","):
            t0 = time.perf_counter()
            done = subprocess.run(
                [sys.executable, "-c", CHILD, str(path), reader],
                capture_output=True,
                text=True,
                check=False,
            )
            wall = time.perf_counter() - t0
            if done.returncode:
                print(f"{path.name} {reader}: failed: {done.stderr.strip()[-300:]}")
                continue
            read_cpu, read_wall, breakdown_cpu, peak_mb, events, steps = done.stdout.split()
            print(
                f"{path.name} ({size_mb:.0f} MB) {reader:7s} read {read_cpu} s CPU ({read_wall} s "
                f"wall), breakdown {breakdown_cpu} s CPU, peak RSS {peak_mb} MB, {events} "
                f"events, {steps} steps (process {wall:.1f} s wall)"
            )


if __name__ == "__main__":
    main()
