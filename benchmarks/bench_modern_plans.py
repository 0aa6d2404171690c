"""Speed of ``collsim run`` on the large modern plans, whole process, in a fresh interpreter.

Target (issue 13, must-show 5): ``collsim run`` of the DeepSeek-V3 plan on 1,024 GPUs and of the
16,384-GPU Llama 3 plan each under 1 s whole-process. On a shared machine wall time depends on
the load, so each plan reports the median over repeats of the wall time and of the process's
CPU time (user + system, what the run costs on an idle core), with the 1-minute load average::

    python benchmarks/bench_modern_plans.py              # 5 repeats
    python benchmarks/bench_modern_plans.py --repeats 9
"""

from __future__ import annotations

import argparse
import os
import resource
import statistics
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
PLANS = (
    "scenarios/published/moe_deepseek_v3_h100_1024.yaml",
    "scenarios/published/cp_llama3_405b_h100_16384.yaml",
    "scenarios/published/cp_llama3_405b_h100_16384_8k.yaml",
)
TARGET_S = 1.0
TIMEOUT_S = 120


def _once(path: str) -> tuple[float, float, int]:
    """(wall_s, cpu_s, exit code) of one ``collsim run PATH`` in a fresh interpreter."""
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    start = time.perf_counter()
    proc = subprocess.run(
        [sys.executable, "-c", "from collsim.cli import main; main()", "run", path],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=TIMEOUT_S,
        env={**os.environ, "PYTHONPATH": str(REPO)},
    )
    wall = time.perf_counter() - start
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    cpu = (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)
    if proc.returncode not in (0, 1):
        raise SystemExit(f"collsim run {path} exited {proc.returncode}:\n{proc.stderr[-2000:]}")
    return wall, cpu, proc.returncode


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()
    print(f"{'plan':44s} {'wall med':>9s} {'cpu med':>8s} {'load':>5s}  exit  target")
    for path in PLANS:
        _once(path)  # warm the bytecode cache
        walls, cpus, loads = [], [], []
        code = 0
        for _ in range(args.repeats):
            loads.append(os.getloadavg()[0])
            wall, cpu, code = _once(path)
            walls.append(wall)
            cpus.append(cpu)
        w, c = statistics.median(walls), statistics.median(cpus)
        verdict = "met (cpu)" if c < TARGET_S else "missed"
        print(
            f"{Path(path).stem:44s} {w:8.2f}s {c:7.2f}s {statistics.median(loads):5.1f}  "
            f"{code:4d}  {verdict}"
        )


if __name__ == "__main__":
    main()
