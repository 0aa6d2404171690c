"""Speed of ``collsim run``: end to end, import time, the engine alone, peak memory, 16k GPUs.

Prints medians over repeats and the ratio to each target (ratio < 1 meets it)::

    .venv/bin/python benchmarks/bench_run.py                 # 5 repeats
    .venv/bin/python benchmarks/bench_run.py --repeats 3 --profile

Targets (from the training-step issue): ``collsim run scenarios/3d_175b.yaml`` under 2 s wall
in a fresh process; the engine alone under 0.5 s; peak RSS under 500 MB; the same plan at
16,384 GPUs (``cluster.nodes=2048``, ``parallel.dp=256``) under 5 s end to end.
"""

from __future__ import annotations

import argparse
import cProfile
import io
import json
import os
import pstats
import resource
import statistics
import subprocess
import sys
import time
import warnings
from collections.abc import Sequence
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
SCENARIO = REPO / "scenarios" / "3d_175b.yaml"
BIG = ("cluster.nodes=2048", "parallel.dp=256")  # 2048 x 8 = 8 x 8 x 256 = 16,384 GPUs
HEAVY = ("pandas", "matplotlib", "torch", "scipy")
TIMEOUT_S = 300

# Runs `collsim run` in this process and reports wall time, peak RSS and heavy imports as JSON
# on the last line of stderr (stdout carries the report, which is discarded).
_CHILD = r"""
import json, resource, sys, time
t0 = time.perf_counter()
from collsim.cli import main
code = 0
try:
    main(["run", *sys.argv[1:]])
except SystemExit as exc:
    code = exc.code or 0
wall = time.perf_counter() - t0
heavy = sorted(m for m in %r if m in sys.modules)
rss_kib = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
print(json.dumps({"code": code, "inner_s": wall, "rss_bytes": rss_kib * 1024,
                  "heavy": heavy, "modules": len(sys.modules)}), file=sys.stderr)
""" % (HEAVY,)


def _child(args: Sequence[str]) -> dict[str, Any]:
    """One fresh interpreter running ``collsim run ARGS``; wall time measured from outside."""
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    start = time.perf_counter()
    proc = subprocess.run(
        [sys.executable, "-c", _CHILD, *args],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=TIMEOUT_S,
    )
    wall = time.perf_counter() - start
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    cpu = (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)
    lines = proc.stderr.strip().splitlines()
    try:
        info = json.loads(lines[-1])
    except (IndexError, json.JSONDecodeError):
        raise SystemExit(f"collsim run {' '.join(args)} failed:\n{proc.stderr[-3000:]}") from None
    if info["code"] not in (0, 1):
        raise SystemExit(
            f"collsim run {' '.join(args)} exited {info['code']}:\n{proc.stderr[-3000:]}"
        )
    info["wall_s"] = wall
    info["cpu_s"] = cpu
    return info


def _end_to_end(args: Sequence[str], repeats: int) -> dict[str, Any]:
    runs = [_child(args) for _ in range(repeats)]
    return {
        "wall_s": statistics.median(r["wall_s"] for r in runs),
        "cpu_s": statistics.median(r["cpu_s"] for r in runs),
        "inner_s": statistics.median(r["inner_s"] for r in runs),
        "rss_bytes": max(r["rss_bytes"] for r in runs),
        "heavy": runs[0]["heavy"],
        "modules": runs[0]["modules"],
    }


def _import_time(top: int) -> tuple[float, list[tuple[float, str]]]:
    """``python -X importtime`` of the run path: total and the slowest modules (cumulative)."""
    code = (
        "import collsim.cli, collsim.cli.run, collsim.study.scenario, collsim.cluster.topology, "
        "collsim.play.engine, collsim.report.tables"
    )
    proc = subprocess.run(
        [sys.executable, "-X", "importtime", "-c", code],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=TIMEOUT_S,
    )
    rows: list[tuple[float, str]] = []
    total = 0.0
    for line in proc.stderr.splitlines():
        if not line.startswith("import time:") or "cumulative" in line:
            continue
        _, cumulative_us, name = line[len("import time:") :].split("|", 2)
        seconds = int(cumulative_us) / 1e6
        if not name.startswith("   "):  # top level: one space of indent
            total += seconds
        rows.append((seconds, name.strip()))
    return total, sorted(rows, reverse=True)[:top]


def _engine_alone(overrides: Sequence[str], repeats: int, profile: bool) -> dict[str, Any]:
    """Load once, then time ``simulate_step`` alone in this process."""
    sys.path.insert(0, str(REPO))
    from collsim.core.errors import CollsimWarning
    from collsim.play.engine import simulate_step
    from collsim.study.scenario import load_scenario

    t0 = time.perf_counter()
    scenario = load_scenario(SCENARIO, overrides)
    topology = scenario.cluster.load()
    load_s = time.perf_counter() - t0
    times: list[float] = []
    cpu_times: list[float] = []
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", CollsimWarning)
        for _ in range(repeats):
            t0, c0 = time.perf_counter(), time.process_time()
            simulate_step(topology, scenario.model, scenario.training, scenario.parallel)
            times.append(time.perf_counter() - t0)
            cpu_times.append(time.process_time() - c0)
        report = ""
        if profile:
            prof = cProfile.Profile()
            prof.enable()
            simulate_step(topology, scenario.model, scenario.training, scenario.parallel)
            prof.disable()
            buf = io.StringIO()
            pstats.Stats(prof, stream=buf).sort_stats("cumulative").print_stats(18)
            report = buf.getvalue()
    return {
        "engine_s": statistics.median(times),
        "engine_cpu_s": statistics.median(cpu_times),
        "load_s": load_s,
        "profile": report,
    }


def _row(what: str, value: str, target: str, ratio: float | None) -> str:
    verdict = "" if ratio is None else f"{ratio:6.2f}  {'ok' if ratio < 1 else 'MISSED'}"
    return f"  {what:<44} {value:>10}  {target:>8}  {verdict}"


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument(
        "--profile",
        action="store_true",
        help="cProfile the engine at 1024 and 16,384 GPUs (top functions)",
    )
    parser.add_argument("--skip-big", action="store_true", help="skip the 16,384-GPU runs")
    args = parser.parse_args(argv)
    os.environ.setdefault("PYTHONWARNINGS", "ignore")

    print(
        f"collsim run benchmark: {SCENARIO.relative_to(REPO)}, medians of {args.repeats}, "
        f"python {sys.version.split()[0]}, {os.cpu_count()} CPUs, load average "
        f"{os.getloadavg()[0]:.1f} (wall times grow with load; CPU times less so)"
    )
    e2e = _end_to_end([str(SCENARIO)], args.repeats)
    import_s, slowest = _import_time(12)
    engine = _engine_alone((), args.repeats, args.profile)
    rows = [
        _row(
            "collsim run 3d_175b, fresh process (wall)",
            f"{e2e['wall_s']:.3f} s",
            "2 s",
            e2e["wall_s"] / 2.0,
        ),
        _row("  CPU time of that process (user + sys)", f"{e2e['cpu_s']:.3f} s", "", None),
        _row("  of which inside main() (after startup)", f"{e2e['inner_s']:.3f} s", "", None),
        _row("  import of the run path (-X importtime)", f"{import_s:.3f} s", "", None),
        _row(
            "engine alone, simulate_step (1024 GPUs)",
            f"{engine['engine_s']:.3f} s",
            "0.5 s",
            engine["engine_s"] / 0.5,
        ),
        _row("  engine CPU time (process_time)", f"{engine['engine_cpu_s']:.3f} s", "", None),
        _row("  scenario + topology load", f"{engine['load_s']:.3f} s", "", None),
        _row(
            "peak RSS of collsim run 3d_175b",
            f"{e2e['rss_bytes'] / 1e6:.0f} MB",
            "500 MB",
            e2e["rss_bytes"] / 500e6,
        ),
    ]
    big: dict[str, Any] | None = None
    big_engine: dict[str, Any] | None = None
    if not args.skip_big:
        big = _end_to_end([str(SCENARIO), *(a for o in BIG for a in ("--set", o))], args.repeats)
        big_engine = _engine_alone(BIG, max(1, args.repeats // 2), args.profile)
        rows += [
            _row(
                "collsim run at 16,384 GPUs (wall)",
                f"{big['wall_s']:.3f} s",
                "5 s",
                big["wall_s"] / 5.0,
            ),
            _row("  CPU time of that process (user + sys)", f"{big['cpu_s']:.3f} s", "", None),
            _row("  engine alone at 16,384 GPUs", f"{big_engine['engine_s']:.3f} s", "", None),
            _row("  peak RSS at 16,384 GPUs", f"{big['rss_bytes'] / 1e6:.0f} MB", "", None),
        ]
    print(f"  {'measure':<44} {'median':>10}  {'target':>8}  ratio")
    print("\n".join(rows))
    print(
        f"heavy modules imported by collsim run: {', '.join(e2e['heavy']) or 'none'} "
        f"({e2e['modules']} modules in all)"
    )
    print("slowest imports on the run path (cumulative):")
    for seconds, name in slowest:
        print(f"  {seconds * 1e3:8.1f} ms  {name.strip()}")
    if args.profile:
        print("\nengine profile, 1024 GPUs:\n" + engine["profile"])
        if big_engine is not None:
            print("engine profile, 16,384 GPUs:\n" + big_engine["profile"])
    return 0


if __name__ == "__main__":
    sys.exit(main())
