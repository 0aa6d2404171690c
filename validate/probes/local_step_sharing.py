"""The local step of ``collsim validate step`` (its GPT, no communication) timed over many steps
in processes placed on the cores in several ways, to separate what slows a rank when ranks
share a host::

    python validate/probes/local_step_sharing.py --steps 150 --rounds 3

Each process runs the step as a rank of ``validate step`` does (one intra-op and one inter-op
thread, ``OMP_NUM_THREADS=1``), pinned with ``sched_setaffinity`` to its cores, and every step
starts after a barrier of all the processes of its placement. Per step it records the wall time
and its thread's CPU time (``time.thread_time``). Placements (``cores`` of each process):

* ``solo``: one process on core 0 (core 1 left to the rest of the host);
* ``pair``: two processes on cores 0 and 1 (world size 2 on 2 cores);
* ``pinned``: two processes both on core 0 (``record.sh``'s ``taskset -c 0`` step);
* ``pinned_busy``: the two on core 0 and one more on core 1 (core 1 as busy as in ``pair``);
* ``quad``: four processes, two on core 0 and two on core 1 (world size 4 on 2 cores).

Printed per placement: the median over steps and processes of the wall time and of the CPU time
per step, and the mean share of a core (CPU over wall); then the ratios that separate the
mechanisms: CPU per step of ``pair`` over ``solo`` (what the other core's rank costs a rank:
shared cache, memory bandwidth, whatever the VM's vCPUs share), of ``pinned`` over ``solo``
(what switching between two ranks on one core costs, the other core idle), of ``pinned_busy``
over ``pair`` (the same with the other core busy) and of ``quad`` over ``pair`` (world size 4
against 2: the time-sharing slowdown a trace at world size 2 needs). Placements are interleaved
round by round so that the host's other load falls alike on each; the 1-minute load average at
the start and end of every placement is printed beside it.
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import os
import statistics
import time
from typing import Any

PLACEMENTS: dict[str, list[set[int]]] = {
    "solo": [{0}],
    "pair": [{0}, {1}],
    "pinned": [{0}, {0}],
    "pinned_busy": [{0}, {0}, {1}],
    "quad": [{0}, {0}, {1}, {1}],
}


def _worker(cores: set[int], steps: int, warmup: int, barrier: Any, out: Any, rank: int) -> None:
    for key in ("OMP_NUM_THREADS", "MKL_NUM_THREADS", "OPENBLAS_NUM_THREADS"):
        os.environ[key] = "1"
    os.sched_setaffinity(0, cores)
    import torch

    from collsim.validate.measure.step_model import StepConfig, build_gpt, rank_batch

    torch.set_num_threads(1)
    torch.set_num_interop_threads(1)
    cfg = StepConfig()
    torch.manual_seed(cfg.seed)
    model = build_gpt(torch, cfg)
    opt = torch.optim.SGD(model.parameters(), lr=cfg.lr)
    idx, targets = rank_batch(torch, cfg, rank)

    def step() -> None:
        opt.zero_grad()
        model(idx, targets).backward()
        opt.step()

    for _ in range(warmup):
        step()
    walls: list[float] = []
    cpus: list[float] = []
    for _ in range(steps):
        barrier.wait(timeout=120)
        t0, c0 = time.perf_counter(), time.thread_time()
        step()
        walls.append(time.perf_counter() - t0)
        cpus.append(time.thread_time() - c0)
    out.put((rank, walls, cpus))


def _run(name: str, steps: int, warmup: int) -> tuple[list[float], list[float]]:
    ctx = mp.get_context("spawn")
    cores = PLACEMENTS[name]
    barrier, out = ctx.Barrier(len(cores)), ctx.Queue()
    procs = [
        ctx.Process(target=_worker, args=(c, steps, warmup, barrier, out, r))
        for r, c in enumerate(cores)
    ]
    for p in procs:
        p.start()
    walls: list[float] = []
    cpus: list[float] = []
    try:
        for _ in procs:
            _, w, c = out.get(timeout=600)
            walls += w
            cpus += c
    finally:
        for p in procs:
            p.join(timeout=30)
            if p.is_alive():
                p.terminate()
    return walls, cpus


def _load() -> str:
    with open("/proc/loadavg") as f:
        return f.read().split()[0]


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=150)
    parser.add_argument("--warmup", type=int, default=10)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--placements", default=",".join(PLACEMENTS))
    args = parser.parse_args()
    names = args.placements.split(",")
    if len(os.sched_getaffinity(0)) < 2:
        raise SystemExit("needs cores 0 and 1")
    got: dict[str, tuple[list[float], list[float]]] = {n: ([], []) for n in names}
    for r in range(args.rounds):
        for name in names:
            before = _load()
            walls, cpus = _run(name, args.steps, args.warmup)
            got[name][0].extend(walls)
            got[name][1].extend(cpus)
            wall_ms, cpu_ms = statistics.median(walls) * 1e3, statistics.median(cpus) * 1e3
            print(
                f"# round {r + 1} {name:12s} load {before} -> {_load()}: wall {wall_ms:.2f} ms,"
                f" cpu {cpu_ms:.2f} ms",
                flush=True,
            )
    cpu: dict[str, float] = {}
    print("placement     procs  wall ms  cpu ms  share")
    for name in names:
        walls, cpus = got[name]
        cpu[name] = statistics.median(cpus)
        share = statistics.fmean(c / w for c, w in zip(cpus, walls))
        print(
            f"{name:12s} {len(PLACEMENTS[name]):5d} {statistics.median(walls) * 1e3:8.2f}"
            f" {cpu[name] * 1e3:7.2f} {share:6.2f}"
        )
    for a, b, what in (
        ("pair", "solo", "the other core's rank (CPU per step)"),
        ("pinned", "solo", "two ranks on one core, the other core idle (CPU per step)"),
        ("pinned_busy", "pair", "two ranks on one core, the other core busy (CPU per step)"),
        ("quad", "pair", "world size 4 over 2 (CPU per step)"),
    ):
        if a in cpu and b in cpu:
            print(f"{a} / {b}: x{cpu[a] / cpu[b]:.3f}  {what}")
    if "quad" in got and "pair" in got:
        ratio = statistics.median(got["quad"][0]) / statistics.median(got["pair"][0])
        print(f"quad / pair wall: x{ratio:.3f} (x2 is the even share)")


if __name__ == "__main__":
    main()
