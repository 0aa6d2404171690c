"""The trace-to-prediction loop on recorded runs of ``collsim validate step --profile-dir``::

    python validate/probes/trace_profile_predict.py validate/data/traces

For each ``runN`` folder under the given one (its ``step_trace_runN.json`` report and its
``n2_ddp_b25_rank*.json.gz`` traces): learn a device profile from the world-size-2 DDP trace
(:func:`collsim.validate.fit.trace_profile.profile_from_traces`), then simulate every mode of every
world size of the run from it, as ``validate step --device-profile`` does, and print the
error against the measured median beside the error from ``cpu_profile.yaml`` (the
``validate compute`` profile of the same runs) when the folder has one. Ends with the median
over runs per (world size, mode).
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
from pathlib import Path


def _errors(report: dict, profile: str) -> dict[str, float]:
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
    return out


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("folder", type=Path)
    args = parser.parse_args()
    from collsim.validate.data.kineto import read_traces
    from collsim.validate.fit.trace_profile import profile_from_traces, write_trace_profile

    compute = args.folder / "cpu_profile.yaml"
    table: dict[tuple[int, str, str], list[float]] = {}
    for run in sorted(p for p in args.folder.glob("run*") if p.is_dir()):
        traces = read_traces(sorted(str(p) for p in run.glob("n2_ddp_b25_rank*.json.gz")))
        learned = profile_from_traces(traces)
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
