"""Speed of the training-step engine (``simulate_step``): medians over repeats, peak RSS.

GPT-3 175B, TP 8 x PP 8 x DP 16 on 128 DGX A100 nodes (global batch 1536, micro-batch 1, full
recompute, 1F1B, ZeRO-1), then the same plan with DP 256 on 2048 nodes (16,384 GPUs).
Targets: under 0.5 s and under 5 s per step simulated, peak RSS under 500 MB.

    .venv/bin/python benchmarks/bench_engine.py [--repeats 5]
"""

from __future__ import annotations

import argparse
import resource
import statistics
import time
import warnings

from collsim.cluster.topology import load_topology
from collsim.core.errors import CollsimWarning
from collsim.parallel.config import ParallelConfig, TrainingConfig
from collsim.play.engine import simulate_step
from collsim.workload.presets import get_preset

CASES = [  # (label, nodes, dp, target seconds)
    ("175B 1024 GPUs", 128, 16, 0.5),
    ("175B 16384 GPUs", 2048, 256, 5.0),
]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()
    spec = get_preset("gpt3-175b")
    tr = TrainingConfig(global_batch=1536, micro_batch=1, recompute="full")
    warnings.simplefilter("ignore", CollsimWarning)
    print(
        "wall = elapsed seconds per simulate_step call; cpu = this process's CPU seconds "
        "(less sensitive to other load on the machine)"
    )
    print(
        f"{'case':<18} {'cold s':>8} {'median s':>9} {'cpu s':>7} {'target s':>9} "
        f"{'ratio':>6} {'step s':>8} {'fidelity':>8}"
    )
    for label, nodes, dp, target in CASES:
        topo = load_topology("dgx_a100", nodes=nodes)
        par = ParallelConfig(tp=8, pp=8, dp=dp, schedule="1f1b", zero=1)
        t0 = time.perf_counter()
        result = simulate_step(topo, spec, tr, par)
        cold = time.perf_counter() - t0
        times, cpu = [], []
        for _ in range(args.repeats):
            t0, c0 = time.perf_counter(), time.process_time()
            simulate_step(topo, spec, tr, par)
            times.append(time.perf_counter() - t0)
            cpu.append(time.process_time() - c0)
        median = statistics.median(times)
        print(
            f"{label:<18} {cold:8.3f} {median:9.3f} {statistics.median(cpu):7.3f} "
            f"{target:9.1f} {median / target:6.2f} {result.step_time_s:8.2f} "
            f"{result.fidelity:>8}"
        )
    rss_mb = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    print(f"peak RSS {rss_mb:.0f} MB (target 500 MB, ratio {rss_mb / 500:.2f})")


if __name__ == "__main__":
    main()
