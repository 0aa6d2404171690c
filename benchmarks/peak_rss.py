"""Peak memory of a command and every process it starts: the sum of their resident sets.

``/usr/bin/time -v`` reports the largest resident set of one process; a bench of four ranks is
five processes at once, so this samples the whole tree (psutil, every 50 ms) and reports the
largest sum, with the wall time. Two sums: of the resident sets (RSS: a page of a shared
library counts once per process that maps it, an upper bound) and of the proportional sets
(PSS, Linux ``smaps_rollup``: a shared page split between the processes that share it, what
the tree takes from the machine)::

    python benchmarks/peak_rss.py -- collsim validate bench --world-size 4 -b 1K -e 256M

A short peak between two samples can be missed; the figure is a lower bound of the true peak
within one sampling period of allocation.
"""

from __future__ import annotations

import signal
import subprocess
import sys
import time

import psutil  # type: ignore[import-untyped]  # pip install psutil (not a collsim dependency)


def tree_bytes(root: psutil.Process) -> tuple[int, int]:
    """(RSS, PSS) bytes of ``root`` and all its descendants (those that vanish are skipped)."""
    rss = pss = 0
    for proc in [root, *root.children(recursive=True)]:
        try:
            info = proc.memory_full_info()
        except (psutil.NoSuchProcess, psutil.AccessDenied):
            continue
        rss += info.rss
        pss += getattr(info, "pss", info.rss)
    return rss, pss


def main(argv: list[str]) -> int:
    if "--" in argv:
        argv = argv[argv.index("--") + 1 :]
    if not argv:
        print("usage: peak_rss.py -- COMMAND [ARGS...]", file=sys.stderr)
        return 2
    start = time.perf_counter()
    child = subprocess.Popen(argv)
    proc = psutil.Process(child.pid)
    peak_rss = peak_pss = 0
    stopped = []

    def stop(signum: int, frame: object) -> None:
        # a SIGTERM to this script: stop the command as Ctrl-C would, still report the peak
        stopped.append(signum)
        child.send_signal(signal.SIGINT)

    signal.signal(signal.SIGTERM, stop)
    while child.poll() is None:
        try:
            rss, pss = tree_bytes(proc)
        except psutil.NoSuchProcess:
            break
        peak_rss, peak_pss = max(peak_rss, rss), max(peak_pss, pss)
        time.sleep(0.05)
    wall_s = time.perf_counter() - start
    print(
        f"# peak over the process tree: {peak_pss / 2**30:.2f} GiB PSS, "
        f"{peak_rss / 2**30:.2f} GiB RSS; {wall_s:.1f} s, exit {child.returncode}"
        + (" (stopped by SIGTERM)" if stopped else ""),
        file=sys.stderr,
    )
    return int(child.returncode or 0)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
