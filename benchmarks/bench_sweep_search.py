"""Speed of sweeps and plan search, and the plan the search finds for GPT-3 175B.

Run: ``python benchmarks/bench_sweep_search.py [--repeats N]`` (prints medians of N repeats,
each in a fresh process state except for the topology cache, which a sweep keeps by design).

Targets:
- a sweep of scenarios/3d_175b.yaml over 64, 128, ..., 4096 GPUs (7 DES runs) under 30 s;
- ``collsim search scenarios/3d_175b.yaml --gpus 1024`` (GPT-3 175B on 1,024 A100 GPUs):
  at least 1,000,000 plans in the grid, at least 100,000 estimated or pruned by a bound, the
  best 10 re-simulated by the DES, under 60 s (``--jobs`` as the command's default: the
  cores).

It also prints the best plan found next to Megatron-LM's published choice for this model
(Narayanan et al. 2021, SC21, Table 1: GPT-3 175B on 1,024 A100 GPUs with tensor parallel 8,
pipeline parallel 16, interleaved 1F1B schedule, full recompute, global batch 1536), simulated
by the same engine, so the two can be compared on equal terms.
"""

from __future__ import annotations

import argparse
import dataclasses
import statistics
import sys
import time
import warnings
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
SCENARIO = REPO / "scenarios" / "3d_175b.yaml"


def bench_sweep() -> tuple[float, int, int]:
    """Seconds for the 64..4096 weak-scaling sweep; points run and feasible."""
    from collsim.study.sweep import build_points, parse_gpus, run_sweep

    start = time.perf_counter()
    outcomes = run_sweep(SCENARIO, build_points(gpus=parse_gpus("64,128,...,4096")))
    return time.perf_counter() - start, len(outcomes), sum(o.feasible for o in outcomes)


def bench_search() -> tuple[float, object]:
    """Seconds for the 1,024-GPU search (branch and bound, the best 10 simulated); the result."""
    from collsim.core.jobs import default_jobs
    from collsim.study.scenario import load_scenario
    from collsim.study.search import search_plans

    start = time.perf_counter()
    scenario = load_scenario(SCENARIO)
    topology = scenario.cluster.load()
    result = search_plans(
        topology,
        scenario.model,
        scenario.training,
        scenario.parallel,
        top_k=10,
        jobs=default_jobs(),
    )
    return time.perf_counter() - start, result


def megatron_reference() -> list[tuple[str, object]]:
    """Megatron-LM's published 175B plans (TP 8, PP 8 and 16, interleaved), simulated."""
    from collsim.play.engine import simulate_step
    from collsim.study.scenario import load_scenario

    scenario = load_scenario(SCENARIO)
    topology = scenario.cluster.load()
    out = []
    for pp, dp in ((16, 8), (8, 16)):
        parallel = dataclasses.replace(
            scenario.parallel, pp=pp, dp=dp, schedule="interleaved", virtual_stages=2
        )
        result = simulate_step(topology, scenario.model, scenario.training, parallel)
        out.append((f"tp8 pp{pp} dp{dp} mb1 interleaved v2 zero1 rc=full", result))
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args(argv)
    from collsim.core.errors import CollsimWarning

    warnings.simplefilter("ignore", CollsimWarning)

    sweeps = [bench_sweep() for _ in range(args.repeats)]
    sweep_s = statistics.median(s for s, _, _ in sweeps)
    _, points, feasible = sweeps[0]
    print(
        f"sweep 3d_175b 64..4096 GPUs: median {sweep_s:.2f} s over {args.repeats} runs "
        f"({points} points, {feasible} feasible); target < 30 s: "
        f"{'met' if sweep_s < 30 else 'NOT met'}"
    )

    searches = [bench_search() for _ in range(args.repeats)]
    search_s = statistics.median(s for s, _ in searches)
    result = searches[0][1]
    bounded = result.estimated + result.rejected["bound"] + result.rejected["memory_bound"]
    met = search_s < 60 and result.considered >= 1_000_000 and bounded >= 100_000
    print(
        f"search GPT-3 175B on 1,024 A100: median {search_s:.2f} s over {args.repeats} runs; "
        f"{result.considered:,} plans in the grid, {result.buildable:,} buildable, "
        f"{result.estimated:,} estimated (closed form, {result.estimate_s:.2f} s), "
        f"{bounded - result.estimated:,} pruned by a bound, {len(result.ranked):,} fit, "
        f"{len(result.simulated)} re-simulated ({result.simulate_s:.2f} s); target >= 1,000,000 "
        f"plans, >= 100,000 estimated or pruned, < 60 s: {'met' if met else 'NOT met'}"
    )
    print(
        "rejected by reason: " + ", ".join(f"{k} {v:,}" for k, v in result.rejected.most_common())
    )
    best = result.best
    if best is None or best.result is None:
        print("no plan found")
        return 1
    print(
        f"best plan (DES): {best.candidate.label}: step {best.result.step_time_s:.2f} s, "
        f"MFU {100 * best.result.mfu:.1f} %, {best.result.model_tflops_per_gpu:.0f} model / "
        f"{best.result.hardware_tflops_per_gpu:.0f} hardware TFLOP/s per GPU, peak "
        f"{best.result.memory_peak_bytes / 1e9:.1f} GB "
        f"(estimate {best.estimate.step_time_s:.2f} s)"
    )
    for label, ref in megatron_reference():
        print(
            f"Megatron-LM published ({label}) (DES): step {ref.step_time_s:.2f} s, "
            f"MFU {100 * ref.mfu:.1f} %, {ref.model_tflops_per_gpu:.0f} model / "
            f"{ref.hardware_tflops_per_gpu:.0f} hardware TFLOP/s per GPU, peak "
            f"{ref.memory_peak_bytes / 1e9:.1f} GB; best found is "
            f"{ref.step_time_s / best.result.step_time_s:.2f}x faster"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
