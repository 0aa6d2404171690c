"""Speed of the collective models: closed-form evaluations per second, set-up time of large
groups, the ``collsim collective`` sweep at 8,192 GPUs, and a 1,024-GPU DES.

Run: ``python benchmarks/bench_collectives.py`` (prints medians of several repeats).
Targets: closed-form cost >= 100,000 evaluations/s on cached groups (8 to 8,192 GPUs);
``collsim collective --topology dgx_h100 --nodes 1024 -b 1K -e 1G`` under 2 s for every op (auto);
setting up all_reduce auto on 16,384 GPUs under 0.5 s; DES of one ring all_reduce over 1,024
GPUs (128 DGX H100 nodes) under 1 s.
"""

from __future__ import annotations

import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

import simpy

from collsim.cluster.network import FlowNetwork
from collsim.cluster.topology import Topology, load_topology
from collsim.collectives import Group, cost, simulate

REPEATS = 5


OPS = (
    "all_reduce",
    "reduce_scatter",
    "all_gather",
    "broadcast",
    "reduce",
    "all_to_all",
    "send_recv",
)
CLI_REPEATS = 3


def cli_sweep_seconds(op: str, nodes: int = 1024) -> float:
    """Wall seconds of the ``collsim collective`` closed-form sweep 1K..1G (a fresh process:
    interpreter start, topology build, per-group set-up and 21 sizes)."""
    exe = Path(sys.executable).with_name("collsim")
    start = time.perf_counter()
    subprocess.run(
        [
            str(exe),
            "collective",
            "--topology",
            "dgx_h100",
            "--nodes",
            str(nodes),
            "--op",
            op,
            "-b",
            "1K",
            "-e",
            "1G",
        ],
        check=True,
        capture_output=True,
        timeout=120,
    )
    return time.perf_counter() - start


def setup_seconds(nodes: int, op: str = "all_reduce") -> tuple[float, float]:
    """Seconds to build a ``nodes``-node DGX H100 topology, and then to set up the op's auto
    candidates on all its GPUs (the first cost() call)."""
    start = time.perf_counter()
    topo = load_topology("dgx_h100", nodes=nodes)
    group = Group.all(topo)
    built = time.perf_counter()
    cost(op, 1 << 20, group)
    return built - start, time.perf_counter() - built


def closed_form_rate(
    group: Group, algorithm: str, evaluations: int = 50_000, op: str = "all_reduce"
) -> tuple[float, float]:
    """Evaluations per wall second and per CPU second of cost() over a spread of sizes.

    The per-group schedules are built once first (that is the cache a sweep warms). CPU time
    is reported beside wall time because the machine may be shared.
    """
    sizes = [1 << (10 + i % 25) for i in range(evaluations)]
    cost(op, 1 << 20, group, algorithm)  # warm the per-group cache
    wall, cpu = time.perf_counter(), time.process_time()
    for size in sizes:
        cost(op, size, group, algorithm)
    return (evaluations / (time.perf_counter() - wall), evaluations / (time.process_time() - cpu))


def des_ring_seconds(nodes: int, *, cold: bool) -> tuple[float, float, float]:
    """Wall and CPU seconds of one ring all_reduce DES over ``nodes`` DGX H100 nodes, and the
    simulated busbw (GB/s)."""
    if cold:
        topo = load_topology("dgx_h100", nodes=nodes)
    else:
        topo = _WARM.get(nodes) or _WARM.setdefault(nodes, load_topology("dgx_h100", nodes=nodes))
    group = Group.all(topo)
    wall, cpu = time.perf_counter(), time.process_time()
    env = simpy.Environment()
    net = FlowNetwork(env, topo)
    proc = simulate(env, net, "all_reduce", 1 << 30, group, "ring")
    env.run(proc)
    return (time.perf_counter() - wall, time.process_time() - cpu, proc.value.busbw_bps / 1e9)


_WARM: dict[int, Topology] = {}


def main() -> int:
    """Print the medians and whether each target is met."""
    h100 = load_topology("dgx_h100")
    cluster = load_topology("dgx_h100", nodes=16)
    load = os.getloadavg()[0]
    print(f"load average {load:.2f} on {os.cpu_count()} CPUs; medians of {REPEATS} repeats")
    big = load_topology("dgx_h100", nodes=1024)
    ok = True
    for label, group, algorithm, op in [
        ("8 GPUs, ring", Group.all(h100), "ring", "all_reduce"),
        ("8 GPUs, auto", Group.all(h100), "auto", "all_reduce"),
        ("128 GPUs (16 nodes), auto", Group.all(cluster), "auto", "all_reduce"),
        ("8,192 GPUs (1,024 nodes), auto", Group.all(big), "auto", "all_reduce"),
        ("8,192 GPUs (1,024 nodes), auto", Group.all(big), "auto", "all_to_all"),
    ]:
        rates = [closed_form_rate(group, algorithm, op=op) for _ in range(REPEATS)]
        wall = statistics.median(r[0] for r in rates)
        cpu = statistics.median(r[1] for r in rates)
        ok &= wall >= 100_000
        print(
            f"closed form, {op} {label:<31}: {wall:>10,.0f} evaluations per wall s, "
            f"{cpu:>10,.0f} per CPU s (target >= 100,000 per s: "
            f"{'met' if wall >= 100_000 else 'NOT met'})"
        )
    for nodes in (1024, 2048):
        runs = [setup_seconds(nodes) for _ in range(REPEATS)]
        topo_s = statistics.median(r[0] for r in runs)
        setup_s = statistics.median(r[1] for r in runs)
        met = nodes != 2048 or setup_s < 0.5
        ok &= met
        target = f" (target < 0.5 s: {'met' if met else 'NOT met'})" if nodes == 2048 else ""
        print(
            f"set-up, all_reduce auto on {nodes * 8:,} GPUs: {setup_s:.3f} s{target}; "
            f"topology build {topo_s:.3f} s"
        )
    for op in OPS:
        wall = statistics.median(cli_sweep_seconds(op) for _ in range(CLI_REPEATS))
        ok &= wall < 2.0
        print(
            f"collsim collective --topology dgx_h100 --nodes 1024 --op {op:<14} -b 1K -e 1G: "
            f"{wall:.2f} s (median of {CLI_REPEATS}; target < 2 s: "
            f"{'met' if wall < 2.0 else 'NOT met'})"
        )
    cold = [des_ring_seconds(128, cold=True) for _ in range(REPEATS)]
    warm = [des_ring_seconds(128, cold=False) for _ in range(REPEATS)]
    for label, runs in (
        ("cold (topology, paths, schedule built)", cold),
        ("warm (schedule cached)", warm),
    ):
        wall = statistics.median(r[0] for r in runs)
        cpu = statistics.median(r[1] for r in runs)
        ok &= wall < 1.0
        print(
            f"DES ring all_reduce 1 GiB, 1,024 GPUs (128 DGX H100), {label}: {wall:.3f} s "
            f"wall, {cpu:.3f} s CPU (target < 1 s: {'met' if wall < 1.0 else 'NOT met'}); "
            f"simulated busbw {runs[0][2]:.1f} GB/s"
        )
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
