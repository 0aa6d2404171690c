"""Whole-process cost of the branch-and-bound searches whose floors are read off the step program.

Targets (issue 25, must-show 2): the Qwen3-30B-A3B MoE search on 16 GPUs over ep 1, 2, 4, 8
under 60 s; the DeepSeek-V3 1,024-GPU search over ``benchmarks/spaces/deepseek_v3_1024.yaml``
under 10 minutes; the dense 3d_175b search on 1,024 GPUs no slower in CPU time than before. On
a shared machine wall time depends on the load, so each search reports its wall time, its CPU
time (user + system of the process and its workers: what it costs on idle cores) and the
1-minute load average, with the counts line ``collsim search`` prints::

    python benchmarks/bench_search_bounds.py            # all three
    python benchmarks/bench_search_bounds.py moe dsv3   # some of them
"""

from __future__ import annotations

import argparse
import os
import resource
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
SEARCHES = {
    "moe": (
        ["scenarios/published/moe_qwen3_30b_a3b_h100_16_fp8.yaml", "--gpus", "16"]
        + ["--ep", "1,2,4,8"],
        60.0,
    ),
    "dsv3": (
        ["scenarios/published/moe_deepseek_v3_h100_1024.yaml"]
        + ["--space", "benchmarks/spaces/deepseek_v3_1024.yaml"],
        600.0,
    ),
    "dense": (["scenarios/3d_175b.yaml", "--gpus", "1024"], 60.0),
}
TIMEOUT_S = 1800


def _once(args: list[str]) -> tuple[float, float, int, str]:
    """(wall_s, cpu_s, exit code, output) of one ``collsim search ARGS`` in a fresh
    interpreter."""
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    start = time.perf_counter()
    proc = subprocess.run(
        [sys.executable, "-c", "from collsim.cli import main; main()", "search", *args],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=TIMEOUT_S,
        env={**os.environ, "PYTHONPATH": str(REPO)},
        check=False,
    )
    wall = time.perf_counter() - start
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    cpu = (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)
    return wall, cpu, proc.returncode, proc.stdout + proc.stderr


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("which", nargs="*", help=f"some of {', '.join(SEARCHES)} (default all)")
    names = parser.parse_args().which or list(SEARCHES)
    unknown = [n for n in names if n not in SEARCHES]
    if unknown:
        parser.error(f"unknown search {unknown[0]!r}: one of {', '.join(SEARCHES)}")
    for name in names:
        args, target_s = SEARCHES[name]
        load = os.getloadavg()[0]
        wall, cpu, rc, out = _once(args)
        counts = next((ln.strip() for ln in out.splitlines() if "plans in the grid" in ln), "")
        print(
            f"{name}: wall {wall:.1f} s, cpu {cpu:.1f} s (target {target_s:.0f} s), "
            f"exit {rc}, load {load:.1f}\n  {counts}"
        )
        for line in out.splitlines():
            if line.lstrip().startswith(("1 ", "2 ", "3 ")) or "pruned" in line:
                print("  " + line.strip())


if __name__ == "__main__":
    main()
