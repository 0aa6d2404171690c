"""A plan search on a Dask cluster of two workers against one worker (the same search).

Run: ``python benchmarks/bench_dask_search.py [--scenario FILE] [--gpus N] [--prune-keep K]
[--repeat R] [--micro-batches 1,2]``.

Each cluster is a ``distributed.LocalCluster`` of single-thread worker processes on loopback
(ports chosen by the system), started before the clock and warmed by one small map (workers
import collsim). The search is ``collsim search``'s with no re-simulation (``top_k=0``) over a
space of about 1,500 plans of GPT-3 1.3B on 16 GPUs (micro-batches 1 and 2, recompute none or
full, the data-parallel knobs at their defaults), every plan estimated (``--prune-keep 0``: a
search that the bounds prune spends most of its time on them, in this process, and gains
little from more workers). Each cluster size runs ``--repeat`` times (a fresh cluster each
time; the context goes to each worker once, as a worker plugin); it prints every time, the
medians, their ratio and whether the two found the same best ten plans.

Target (issue 25): on a search of about 60 s on one worker, two workers at least 1.7x faster on
a machine with two free cores. The figure depends on the cores the machine has free while it
runs: report it with the machine's load (``os.getloadavg``, printed).
"""

from __future__ import annotations

import argparse
import os
import statistics
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def _space(micro_batches: tuple[int, ...] = (1, 2)) -> object:
    from collsim.study.search import SearchSpace

    return SearchSpace(
        micro_batches=micro_batches,
        recomputes=("none", "full"),
        bucket_mbs=(25.0,),
        overlaps=(True,),
        bucket_views=(False,),
        prefetches=(1,),
        offloads=(False,),
        reshards=(True,),
    )


SPACE = _space()


def _one(x: int) -> int:
    return x


def run(scenario_path: Path, gpus: int, workers: int, prune_keep: int) -> tuple[float, list]:
    """Seconds of the search on a fresh cluster of ``workers``; its best ten (plan, time)."""
    from distributed import Client, LocalCluster

    from collsim.study.scenario import load_scenario
    from collsim.study.search import search_plans
    from collsim.study.sweep import cluster_for

    scenario = load_scenario(scenario_path)
    topology = cluster_for(scenario.cluster.topology, gpus, None)
    with LocalCluster(
        n_workers=workers,
        threads_per_worker=1,
        processes=True,
        host="127.0.0.1",
        scheduler_port=0,
        dashboard_address="127.0.0.1:0",
    ) as cluster:
        with Client(cluster.scheduler_address, set_as_default=False) as client:
            client.gather(client.map(_one, range(4 * workers)))
            client.run(__import__, "collsim.play.walk")
        started = time.perf_counter()
        result = search_plans(
            topology,
            scenario.model,
            scenario.training,
            scenario.parallel,
            space=SPACE,
            top_k=0,
            prune_keep=prune_keep,
            scheduler=cluster.scheduler_address,
        )
        elapsed_s = time.perf_counter() - started
    best = [(r.candidate.label, r.estimate.step_time_s) for r in result.ranked[:10]]
    print(
        f"{workers} worker(s): {elapsed_s:.1f} s, {result.estimated:,} plans estimated, "
        f"load average {os.getloadavg()[0]:.1f}"
    )
    return elapsed_s, best


def _local(scenario_path: Path, gpus: int, prune_keep: int) -> float:
    """Seconds of the same search in this process (no cluster)."""
    from collsim.study.scenario import load_scenario
    from collsim.study.search import search_plans
    from collsim.study.sweep import cluster_for

    scenario = load_scenario(scenario_path)
    topology = cluster_for(scenario.cluster.topology, gpus, None)
    started = time.perf_counter()
    search_plans(
        topology,
        scenario.model,
        scenario.training,
        scenario.parallel,
        space=SPACE,
        top_k=0,
        prune_keep=prune_keep,
    )
    return time.perf_counter() - started


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    parser.add_argument("--scenario", type=Path, default=REPO / "scenarios" / "ddp_gpt3_1.3b.yaml")
    parser.add_argument("--gpus", type=int, default=16)
    parser.add_argument("--prune-keep", type=int, default=0)
    parser.add_argument("--repeat", type=int, default=3, help="runs per cluster size")
    parser.add_argument("--micro-batches", default="1,2", help="the space's micro-batch sizes")
    parser.add_argument("--no-local", action="store_true", help="skip the run without Dask")
    args = parser.parse_args()
    global SPACE
    SPACE = _space(tuple(int(v) for v in args.micro_batches.split(",")))
    print(f"cores: {os.cpu_count()}, load average before: {os.getloadavg()[0]:.1f}")
    if not args.no_local:
        local_s = _local(args.scenario, args.gpus, args.prune_keep)
        print(f"this process alone (jobs=1, no Dask): {local_s:.1f} s")
    ones, twos = [], []
    for _ in range(args.repeat):  # alternate, so that a change of load hits both alike
        one_s, one = run(args.scenario, args.gpus, 1, args.prune_keep)
        two_s, two = run(args.scenario, args.gpus, 2, args.prune_keep)
        ones.append(one_s)
        twos.append(two_s)
        print(f"same best ten plans: {one == two}")
    one_m, two_m = statistics.median(ones), statistics.median(twos)
    print(
        f"medians over {args.repeat}: 1 worker {one_m:.1f} s, 2 workers {two_m:.1f} s; "
        f"speed-up {one_m / two_m:.2f}x (target >= 1.7x); load average after: "
        f"{os.getloadavg()[0]:.1f}"
    )


if __name__ == "__main__":
    main()
