"""Trim a Kineto trace to a few steps: ``python trim.py IN.json.gz OUT.json.gz --steps 2``.

Keeps the top-level metadata, the ``M`` (name) events, the host events that start between the
first kept ``ProfilerStep#N`` and the step after the last kept one, and the device events
(kernels, copies, memsets) whose ``correlation`` is a kept launch. Flow events are dropped.
"""

from __future__ import annotations

import argparse
import gzip
import json

GPU = {"kernel", "gpu_memcpy", "gpu_memset", "gpu_user_annotation"}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("src")
    parser.add_argument("dst")
    parser.add_argument("--steps", type=int, default=2)
    parser.add_argument("--skip", type=int, default=0, help="steps to leave out first")
    args = parser.parse_args()
    with gzip.open(args.src, "rt") as f:
        doc = json.load(f)
    events = doc["traceEvents"]
    steps = sorted(
        (e for e in events if str(e.get("name", "")).startswith("ProfilerStep#")),
        key=lambda e: e["ts"],
    )
    first = steps[args.skip]
    after = steps[args.skip + args.steps] if len(steps) > args.skip + args.steps else None
    lo = first["ts"]
    hi = after["ts"] if after else float("inf")
    kept, launches = [], set()
    for e in events:
        if e.get("ph") == "M":
            kept.append(e)
        elif e.get("ph") == "X" and e.get("cat") not in GPU and lo <= e["ts"] < hi:
            kept.append(e)
            if "correlation" in e.get("args", {}):
                launches.add(e["args"]["correlation"])
    for e in events:
        if e.get("ph") == "X" and e.get("cat") in GPU:
            if e.get("args", {}).get("correlation") in launches:
                kept.append(e)
    doc["traceEvents"] = kept
    with gzip.open(args.dst, "wt") as f:
        json.dump(doc, f, separators=(",", ":"))


if __name__ == "__main__":
    main()
