"""The trace-to-prediction loop on recorded runs of ``collsim validate step --profile-dir``::

    python validate/probes/trace_profile_predict.py validate/data/traces

For each ``runN`` folder under the given one (its ``step_trace_runN.json`` report, its
``n2_ddp_b25_rank*.json.gz`` traces, and where ``record.sh`` kept them its ``n2_local_rank*``
traces and ``pinned/n2_local_rank*`` traced with both ranks on one core): learn a device profile
from the world-size-2 DDP trace as ``collsim validate trace ... --profile-out`` does
(:func:`collsim.validate.fit.trace_profile.profile_from_traces`, with the time-sharing slowdown
where the pinned traces are there), then simulate every mode of every world size of the run from
it, as ``validate step --device-profile`` does, and print the error against the measured median
beside the error from ``cpu_profile.yaml`` (the ``validate compute`` profile of the same runs)
when the folder has one. The ``local`` rows: the simulated compute and optimizer of a step (no
communication) against the measured step without communication. Ends with the median over runs
per (world size, mode).
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
from pathlib import Path
from typing import Any


def _errors(report: dict[str, Any], profile: str) -> dict[str, float]:
    from collsim.cluster.topology import load_topology
    from collsim.validate.check.step import simulate_modes

    n = int(report["world_size"])
    sim = simulate_modes(
        report, load_topology("localhost", nodes=1, gpus_per_node=n), device_profile=profile
    )
    out = {}
    for mode, got in sim.items():
        measured = float(report["modes"][mode]["median_s"])
        out[mode] = (got.step_time_s - measured) / measured
    parts = next(iter(sim.values())).breakdown_s
    local = parts.get("compute", 0.0) + parts.get("optimizer", 0.0)
    out["local"] = (local - float(report["local_step_s"])) / float(report["local_step_s"])
    return out


def _files(folder: Path, pattern: str) -> list[str]:
    return sorted(str(p) for p in folder.glob(pattern))


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("folder", type=Path)
    args = parser.parse_args()
    from collsim.validate.data.kineto import read_traces
    from collsim.validate.fit.trace_profile import profile_from_traces, write_trace_profile

    compute = args.folder / "cpu_profile.yaml"
    table: dict[tuple[int, str, str], list[float]] = {}
    for run in sorted(p for p in args.folder.glob("run*") if p.is_dir()):
        traces = read_traces(_files(run, "n2_ddp_b25_rank*.json.gz"))
        pinned = _files(run / "pinned", "n2_local_rank*.json.gz")
        reference = _files(run, "n2_local_rank*.json.gz")
        learned = profile_from_traces(
            traces,
            pinned=read_traces(pinned) if pinned else None,
            pinned_reference=read_traces(reference) if pinned and reference else None,
        )
        print(f"# {run.name}: host {learned.sources['host']}")
        print(f"# {run.name}: time sharing {learned.sources.get('time sharing', 'none traced')}")
        with tempfile.TemporaryDirectory() as tmp:
            profile = str(write_trace_profile(Path(tmp) / f"{run.name}.yaml", learned))
            reports = json.loads((run / f"step_trace_{run.name}.json").read_text())
            for report in reports:
                n = int(report["world_size"])
                sources = {"trace": profile}
                if compute.exists():
                    sources["compute"] = str(compute)
                for label, path in sources.items():
                    for mode, err in _errors(report, path).items():
                        table.setdefault((n, mode, label), []).append(err)
                        print(f"{run.name} n={n} {mode:8s} {label:7s} {err:+7.1%}")
    print("# median over runs")
    for (n, mode, label), errs in sorted(table.items()):
        runs = " ".join(f"{e:+.1%}" for e in errs)
        print(f"n={n} {mode:8s} {label:7s} median {statistics.median(errs):+7.1%}  ({runs})")


if __name__ == "__main__":
    main()
