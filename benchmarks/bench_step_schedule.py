"""Speed targets of the step-schedule work, measured as ratios in one run.

Run: ``python benchmarks/bench_step_schedule.py [--repeats 7] [--skip-des-collective]
[--baseline DIR]``.

Every figure is a median over ``--repeats`` interleaved repeats (each repeat runs every case
once, in turn, so a burst of load hits all of them alike). CPU seconds (user + system of the
child process) are the measure: wall time on a shared two-core machine moves with the load.
Bytecode is written and warmed first (``PYTHONDONTWRITEBYTECODE`` is removed for the children),
as on a user's machine.

Targets (ratio <= 1 meets the target):

1. ``collsim run scenarios/3d_175b.yaml``, whole process, at most 1.5 x
   ``python -c 'import numpy, simpy, click, yaml'`` in the same environment, with numpy's
   OpenBLAS held to one thread as the ``collsim`` command holds it (:data:`FLOOR`: the threads
   OpenBLAS would start cost the bare import a third to a half more CPU, a cost the command
   does not pay);
2. the engine, from a loaded scenario to the result, at most 30 ms CPU for 3d_175b;
3. the 3d_175b plan at 65,536 GPUs with the same 96 micro-batches per replica, whole process, at
   most 1.3 x the CPU of the 1,024-GPU run;
4. ``collsim collective --topology dgx_h100 --nodes 1024 --gpus 8192 --op all_reduce -b 1K
   -e 1G --mode des`` under 4 s CPU (one repeat: it is long);
5. ``collsim search scenarios/3d_175b.yaml --gpus 1024``: at least 1,000,000 plans in the
   space, at least 100,000 estimated or pruned by a bound, under 60 s (one repeat).

``--baseline DIR`` (a checkout of another revision, e.g. ``git worktree add /tmp/base REV``)
adds the regression check: the engine alone, the whole ``collsim run`` process and the closed
form of one plan (``estimate_step`` of each top-level scenario both checkouts ship) of that
checkout and of this one, child processes alternating, with the ratio this / baseline of the
medians (at most 1: no regression). Where a revision replays PyTorch's caching allocator (work
older revisions did not do), its share is timed too and the ratio is also given without it:
the same work as the baseline. CPU time on a shared machine moves by 10-30 % between
runs; ``--instructions`` adds the engine's instructions per run counted by valgrind's
cachegrind (the same count every run; needs ``valgrind`` on the path, about a minute).
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
PY = sys.executable
COLLSIM = str(Path(PY).parent / "collsim")
SCENARIO = str(REPO / "scenarios" / "3d_175b.yaml")
BIG = ["--set", "cluster.nodes=8192", "--set", "parallel.dp=1024"]
BIG += ["--set", "training.global_batch=98304"]
TIMEOUT_S = 600


def _env() -> dict[str, str]:
    env = dict(os.environ)
    env.pop("PYTHONDONTWRITEBYTECODE", None)
    return env


def cpu_of(cmd: list[str], tree: Path | None = None) -> tuple[float, float]:
    """(CPU seconds, peak RSS MB) of one child process (with the package of checkout ``tree``
    first on the path when given)."""
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    done = subprocess.run(
        cmd,
        cwd=tree or REPO,
        env=_env() if tree is None else _env_of(tree),
        capture_output=True,
        text=True,
        timeout=TIMEOUT_S,
        check=False,
    )
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    if done.returncode not in (0, 1):
        raise SystemExit(f"{' '.join(cmd)} exited {done.returncode}:\n{done.stderr[-2000:]}")
    cpu = (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)
    return cpu, after.ru_maxrss / 1024


FLOOR = (
    "import os; os.environ.setdefault('OPENBLAS_NUM_THREADS', '1'); "
    "import numpy, simpy, click, yaml"
)
"""The import floor of target 1: the command's dependencies imported as ``collsim`` imports
them (:func:`collsim.cli.one_blas_thread`)."""

CHILD_PRELUDE = r"""
import json, statistics, sys, time, warnings
warnings.simplefilter("ignore")
from collsim.cli import one_blas_thread
one_blas_thread()  # as the collsim command starts (numpy's BLAS threads never used)
try:
    from collsim.study.scenario import load_scenario
    from collsim.play.engine import simulate_step
    from collsim.play.walk import estimate_step
except ImportError:  # revisions before the package's layout of collsim/{study,play}
    from collsim.scenario import load_scenario
    from collsim.engine import simulate_step
    from collsim.estimate import estimate_step
try:
    import collsim.step.assemble as assemble
except ImportError:
    assemble = None
replay, replays = getattr(assemble, "reserved_memory", None), []  # absent in old revisions
def timed_replay(*args, **kwargs):  # the allocator replay's share of a step
    t0 = time.process_time()
    out = replay(*args, **kwargs)
    replays.append(time.process_time() - t0)
    return out
if replay is not None:
    assemble.reserved_memory = timed_replay
"""
"""What both timing children run first: the package of the checkout on the path (either
layout), the caching-allocator replay timed apart where the revision has one."""

ENGINE_CHILD = (
    CHILD_PRELUDE
    + r"""
sc = load_scenario(sys.argv[1]); topo = sc.cluster.load()
simulate_step(topo, sc.model, sc.training, sc.parallel)  # warm (imports, first costs)
times, shares = [], []  # per run: its seconds, and those of its replays
for _ in range(int(sys.argv[2])):
    sc = load_scenario(sys.argv[1]); topo = sc.cluster.load()
    replays.clear()
    t0 = time.process_time()
    simulate_step(topo, sc.model, sc.training, sc.parallel)
    times.append(time.process_time() - t0)
    shares.append(sum(replays))
print(json.dumps([times, shares]))
"""
)

CLOSED_CHILD = (
    CHILD_PRELUDE
    + r"""
out = {}
for path in sys.argv[2:]:
    sc = load_scenario(path); topo = sc.cluster.load()
    estimate_step(topo, sc.model, sc.training, sc.parallel)  # warm
    whole, less = [], []
    for _ in range(int(sys.argv[1])):
        replays.clear()
        t0 = time.process_time()
        estimate_step(topo, sc.model, sc.training, sc.parallel)
        t = time.process_time() - t0
        whole.append(t)
        less.append(t - sum(replays))
    out[path.rsplit("/", 1)[-1]] = [statistics.median(whole), statistics.median(less)]
print(json.dumps(out))
"""
)
CLOSED_RUNS = 15
"""Timed ``estimate_step`` calls per scenario in one :data:`CLOSED_CHILD` (median)."""


def closed_seconds(tree: Path, names: list[str]) -> dict[str, list[float]]:
    """Per scenario of ``names`` (``scenarios/<name>`` of checkout ``tree``): the median CPU
    seconds of ``estimate_step`` of its plan, whole and less the allocator replay."""
    paths = [str(tree / "scenarios" / n) for n in names]
    done = _child(tree, CLOSED_CHILD, [str(CLOSED_RUNS), *paths])
    out: dict[str, list[float]] = json.loads(done.stdout.strip().splitlines()[-1])
    return out


def _common_scenarios(base: Path) -> list[str]:
    """The top-level scenarios both checkouts ship."""
    mine = {p.name for p in (REPO / "scenarios").glob("*.yaml")}
    return sorted(mine & {p.name for p in (base / "scenarios").glob("*.yaml")})


RUN_CHILD = "import sys; from collsim.cli import main; sys.argv[0] = 'collsim'; sys.exit(main())"
"""``collsim`` of the checkout on ``PYTHONPATH`` (the console script's own entry)."""


def _env_of(tree: Path) -> dict[str, str]:
    """:func:`_env` with ``tree``'s package first on the path."""
    return {**_env(), "PYTHONPATH": str(tree)}


def _scenario_of(tree: Path) -> str:
    """The 3d_175b scenario of checkout ``tree``."""
    return str(tree / "scenarios" / "3d_175b.yaml")


def _engine_child(
    tree: Path, runs: int, prefix: tuple[str, ...] = ()
) -> subprocess.CompletedProcess[str]:
    """:data:`ENGINE_CHILD` with the package of checkout ``tree`` and ``runs`` timed runs,
    under ``prefix`` (a command that runs it, e.g. valgrind) when given: the finished
    process."""
    return _child(tree, ENGINE_CHILD, [_scenario_of(tree), str(runs)], prefix)


def _child(
    tree: Path, code: str, args: list[str], prefix: tuple[str, ...] = ()
) -> subprocess.CompletedProcess[str]:
    """``python -c code args`` in checkout ``tree`` with its package first on the path, under
    ``prefix`` when given: the finished process (an error if it failed)."""
    return subprocess.run(
        [*prefix, PY, "-c", code, *args],
        cwd=tree,
        env=_env_of(tree),
        capture_output=True,
        text=True,
        timeout=TIMEOUT_S,
        check=True,
    )


def engine_seconds(repeats: int, tree: Path = REPO) -> tuple[list[float], list[float]]:
    """CPU seconds of the engine on 3d_175b per repeat, and of the allocator replays in each
    repeat (0 where the revision has none), with the package of checkout ``tree``."""
    done = _engine_child(tree, repeats)
    times, replays = json.loads(done.stdout.strip().splitlines()[-1])
    return times, replays


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--skip-des-collective", action="store_true")
    parser.add_argument("--skip-search", action="store_true")
    parser.add_argument("--baseline", type=Path, help="a checkout of another revision")
    parser.add_argument("--instructions", action="store_true", help="with --baseline")
    args = parser.parse_args()
    if args.baseline is not None:
        return against_baseline(args.baseline.resolve(), args.repeats, args.instructions)
    floor_cmd = [PY, "-c", FLOOR]
    run_cmd = [COLLSIM, "run", SCENARIO]
    big_cmd = [COLLSIM, "run", SCENARIO, *BIG]
    for cmd in (floor_cmd, run_cmd, big_cmd):  # warm bytecode and the page cache
        cpu_of(cmd)
    floor, run, big = [], [], []
    for _ in range(args.repeats):
        floor.append(cpu_of(floor_cmd)[0])
        run.append(cpu_of(run_cmd)[0])
        big.append(cpu_of(big_cmd)[0])
    engine, replay = engine_seconds(args.repeats)
    med = statistics.median
    print(f"load average {os.getloadavg()[0]:.2f}; {args.repeats} interleaved repeats, medians")
    rows = [
        ("import floor (numpy, simpy, click, yaml)", med(floor), None, None),
        ("collsim run 3d_175b, whole process", med(run), med(run) / med(floor), 1.5),
        ("engine alone, loaded scenario -> result", med(engine), med(engine) / 0.030, None),
        ("  of which the caching-allocator replay", med(replay), None, None),
        ("3d_175b at 65,536 GPUs, whole process", med(big), med(big) / med(run), 1.3),
    ]
    if not args.skip_des_collective:
        des_cmd = [COLLSIM, "collective", "--topology", "dgx_h100", "--nodes", "1024"]
        des_cmd += ["--gpus", "8192", "--op", "all_reduce", "-b", "1K", "-e", "1G", "--mode", "des"]
        cpu, rss = cpu_of(des_cmd)
        rows.append((f"collective DES 8,192 ranks (peak {rss:.0f} MB)", cpu, cpu / 4.0, None))
    for name, value, ratio, target in rows:
        extra = ""
        if ratio is not None:
            extra = f"  ratio {ratio:.2f}" + (f" (target {target})" if target else " of target")
        print(f"  {name:<48} {value:8.3f} s CPU{extra}")
    if not args.skip_search:
        t0 = time.perf_counter()
        done = subprocess.run(
            [COLLSIM, "search", SCENARIO, "--gpus", "1024"],
            cwd=REPO,
            env=_env(),
            capture_output=True,
            text=True,
            timeout=TIMEOUT_S,
            check=False,
        )
        wall = time.perf_counter() - t0
        grid = [line for line in done.stdout.splitlines() if "plans in the grid" in line]
        print(f"  search 3d_175b --gpus 1024: {wall:.1f} s wall; {grid[0].strip() if grid else ''}")
    return 0


def against_baseline(base: Path, repeats: int, instructions: bool = False) -> int:
    """The engine alone and the whole ``collsim run`` of checkout ``base`` and of this one,
    alternating per repeat (one engine child of three runs each), medians and their ratio;
    with ``instructions``, the engine's instructions per run too (:func:`engine_instructions`)."""
    if not (base / "collsim" / "__init__.py").is_file():
        print(f"--baseline {base}: not a checkout of collsim (no collsim/__init__.py)")
        return 2
    trees = {"this": REPO, "baseline": base}
    engine: dict[str, list[float]] = {k: [] for k in trees}
    engine_less: dict[str, list[float]] = {k: [] for k in trees}
    run: dict[str, list[float]] = {k: [] for k in trees}
    names = _common_scenarios(base)
    closed: dict[str, dict[str, list[list[float]]]] = {k: {n: [] for n in names} for k in trees}
    for tree in trees.values():  # warm bytecode and the page cache
        cpu_of([PY, "-c", RUN_CHILD, "run", _scenario_of(tree)], tree)
    for _ in range(repeats):
        for name, tree in trees.items():
            times, replays = engine_seconds(3, tree)
            engine[name] += times
            engine_less[name] += [t - r for t, r in zip(times, replays, strict=True)]
            run[name].append(cpu_of([PY, "-c", RUN_CHILD, "run", _scenario_of(tree)], tree)[0])
            for scenario, pair in closed_seconds(tree, names).items():
                closed[name][scenario].append(pair)
    med = statistics.median
    print(f"load average {os.getloadavg()[0]:.2f}; {repeats} alternating repeats, medians")
    print(f"  baseline: {base}")
    rows = (
        ("engine alone, 3d_175b", engine),
        ("  less the allocator replay", engine_less),
        ("collsim run 3d_175b", run),
    )
    for label, figures in rows:
        this, old = med(figures["this"]), med(figures["baseline"])
        print(
            f"  {label:<28} this {this:7.3f} s CPU  baseline {old:7.3f} s CPU"
            f"  ratio {this / old:.2f} (target 1)"
        )
    print("  closed form of one plan (estimate_step), ms CPU: this, this less the allocator")
    print("  replay, baseline (its own, less its replay when it has one); ratios to the baseline")
    for scenario in names:
        this_whole = med(p[0] for p in closed["this"][scenario]) * 1e3
        this_less = med(p[1] for p in closed["this"][scenario]) * 1e3
        old = med(p[1] for p in closed["baseline"][scenario]) * 1e3
        print(
            f"    {scenario:<30} {this_whole:7.2f} {this_less:7.2f} {old:7.2f}"
            f"  ratio {this_whole / old:.2f}, less the replay {this_less / old:.2f}"
        )
    if instructions:
        this_ir, old_ir = engine_instructions(REPO), engine_instructions(base)
        print(
            f"  {'engine instructions/run':<24} this {this_ir / 1e6:7.1f} M"
            f"    baseline {old_ir / 1e6:7.1f} M      ratio {this_ir / old_ir:.2f} (target 1)"
        )
    return 0


IR_RUNS = 4
"""Engine runs counted by :func:`engine_instructions` (beyond the one that warms)."""


def engine_instructions(tree: Path) -> float:
    """Instructions of one engine run on 3d_175b with the package of checkout ``tree``, its
    scenario and topology loaded anew as :data:`ENGINE_CHILD` does (the loading counted too),
    as counted by cachegrind: a child with :data:`IR_RUNS` more runs less one with none, over
    :data:`IR_RUNS`. A child without valgrind runs first, so that neither counted child
    compiles the checkout's bytecode (on a fresh checkout the first would, and the difference
    came out negative)."""
    _engine_child(tree, 0)
    valgrind: tuple[str, ...] = ("valgrind", "--tool=cachegrind", "--cache-sim=no")
    valgrind += ("--cachegrind-out-file=/dev/null",)
    counts = []
    for runs in (0, IR_RUNS):
        done = _engine_child(tree, runs, valgrind)
        refs = [line for line in done.stderr.splitlines() if "I   refs:" in line]
        counts.append(float(refs[-1].split(":")[1].replace(",", "")))
    return (counts[1] - counts[0]) / IR_RUNS


if __name__ == "__main__":
    sys.exit(main())
