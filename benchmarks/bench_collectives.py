"""Speed of the collective models: closed-form evaluations per second and a 1,024-GPU DES.

Run: ``python benchmarks/bench_collectives.py`` (prints medians of several repeats).
Targets: closed-form cost >= 100,000 evaluations/s; DES of one ring all_reduce over 1,024 GPUs
(128 DGX H100 nodes) under 1 s.
"""

from __future__ import annotations

import statistics
import sys
import time

import simpy

from collsim.collectives import Group, cost, simulate
from collsim.network import FlowNetwork
from collsim.topology import load_topology

REPEATS = 5


def closed_form_rate(group: Group, algorithm: str, evaluations: int = 50_000) -> float:
    """Evaluations per second of cost() over a spread of sizes (schedules already cached)."""
    sizes = [1 << (10 + i % 25) for i in range(evaluations)]
    cost("all_reduce", 1 << 20, group, algorithm)          # warm the per-group cache
    start = time.perf_counter()
    for size in sizes:
        cost("all_reduce", size, group, algorithm)
    return evaluations / (time.perf_counter() - start)


def des_ring_seconds(nodes: int, *, cold: bool) -> tuple[float, float]:
    """Wall seconds of one ring all_reduce DES over ``nodes`` DGX H100 nodes, and its result."""
    topo = load_topology("dgx_h100", nodes=nodes) if cold else _WARM.setdefault(
        nodes, load_topology("dgx_h100", nodes=nodes))
    group = Group.all(topo)
    start = time.perf_counter()
    env = simpy.Environment()
    net = FlowNetwork(env, topo)
    proc = simulate(env, net, "all_reduce", 1 << 30, group, "ring")
    env.run(proc)
    return time.perf_counter() - start, proc.value.busbw_bps / 1e9


_WARM: dict[int, object] = {}


def main() -> int:
    """Print the medians and whether each target is met."""
    h100 = load_topology("dgx_h100")
    cluster = load_topology("dgx_h100", nodes=16)
    ok = True
    for label, group, algorithm in [
        ("8 GPUs, ring", Group.all(h100), "ring"),
        ("8 GPUs, auto", Group.all(h100), "auto"),
        ("128 GPUs (16 nodes), auto", Group.all(cluster), "auto"),
    ]:
        rates = [closed_form_rate(group, algorithm) for _ in range(REPEATS)]
        median = statistics.median(rates)
        ok &= median >= 100_000
        print(f"closed form, all_reduce {label:<28}: median {median:>12,.0f} evaluations/s "
              f"(target >= 100,000: {'met' if median >= 100_000 else 'NOT met'})")
    cold = [des_ring_seconds(128, cold=True) for _ in range(REPEATS)]
    warm = [des_ring_seconds(128, cold=False) for _ in range(REPEATS)]
    for label, runs in (("cold (topology, paths, schedule built)", cold),
                        ("warm (schedule cached)", warm)):
        median = statistics.median(t for t, _ in runs)
        ok &= median < 1.0
        print(f"DES ring all_reduce 1 GiB, 1,024 GPUs (128 DGX H100), {label}: median "
              f"{median:.3f} s (target < 1 s: {'met' if median < 1.0 else 'NOT met'}); "
              f"busbw {runs[0][1]:.1f} GB/s")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
