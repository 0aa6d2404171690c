"""The traced steps of ``collsim validate step --profile-dir``: after the timed iterations, each
rank traces a few more steps of every mode with the torch profiler into one gzipped Kineto
trace per mode and rank, with ``collsim`` metadata (the cores the rank could run on, the ranks
beside it, its thread's share of a core) that :mod:`collsim.validate.fit.trace_profile` reads;
and the host facts a report records (the usable cores, the scheduler's autogroup setting).
"""

from __future__ import annotations

import gzip
import json
import os
import shutil
import time
from pathlib import Path
from typing import Any

from collsim.validate.measure.step_model import LOCAL, StepConfig

__all__ = ["trace_modes", "usable_cores", "sched_autogroup"]


def trace_modes(
    torch: Any, dist: Any, cfg: StepConfig, ctx: Any, steps: dict[str, Any]
) -> dict[str, Any]:
    """Trace ``cfg.trace_steps`` steps of every mode of ``cfg`` (and the local step) with the
    torch profiler, after the timed iterations so that the profiler's cost falls on none of
    them; each step after a barrier, inside a ``ProfilerStep#<i>`` annotation as
    ``torch.profiler.profile.step`` names it. One gzipped Kineto trace per mode and rank.
    Returns this rank's paths (``files``) and, per mode, the share of a core its thread got
    over the traced steps (``cpu_share``: thread CPU time over wall time, as
    :mod:`collsim.validate.measure.insitu` measures the local step's), which tells whether the
    traced steps ran under the load the timed ones did."""

    # optional: torch loads only where it is used (the run path stays light)
    from torch.profiler import ProfilerActivity, profile, record_function

    assert cfg.profile_dir is not None
    folder = Path(cfg.profile_dir)
    folder.mkdir(parents=True, exist_ok=True)
    written: list[str] = []
    shares: dict[str, float] = {}
    for mode in [LOCAL, *cfg.modes]:
        dist.barrier()
        steps[mode]()  # one untraced step: the profiler's own start-up stays out of the trace
        wall = cpu = 0.0
        with profile(activities=[ProfilerActivity.CPU], record_shapes=True) as prof:
            for i in range(cfg.trace_steps):
                dist.barrier()
                start, cpu0 = time.perf_counter(), time.thread_time()
                with record_function(f"ProfilerStep#{i}"):
                    steps[mode]()
                wall += time.perf_counter() - start
                cpu += time.thread_time() - cpu0
            # what a time-sharing slowdown is learned from (collsim.validate.fit.trace_profile):
            # the cores this rank could run on, the ranks beside it, its thread's share of a core
            prof.add_metadata_json(
                "collsim",
                json.dumps(
                    {
                        "cores": usable_cores(),
                        "local_ranks": ctx.local_world_size,
                        "cpu_share": round(cpu / max(wall, 1e-9), 4),
                    }
                ),
            )
        shares[mode] = cpu / max(wall, 1e-9)
        path = folder / f"n{ctx.world_size}_{mode}_rank{ctx.rank}.json"
        prof.export_chrome_trace(str(path))
        with open(path, "rb") as src, gzip.open(f"{path}.gz", "wb") as dst:
            shutil.copyfileobj(src, dst)
        os.remove(path)
        written.append(f"{path}.gz")
    return {"files": written, "cpu_share": shares}


def usable_cores() -> int:
    """The cores this process may run on (its CPU affinity: ``taskset`` narrows it)."""
    getter = getattr(os, "sched_getaffinity", None)
    return len(getter(0)) if getter is not None else os.cpu_count() or 1


def sched_autogroup() -> bool | None:
    """Whether Linux groups the fair scheduler's share by session (``sched_autogroup``):
    then the ranks of one command share one session's CPU whatever their thread count."""

    try:
        return Path("/proc/sys/kernel/sched_autogroup_enabled").read_text().strip() == "1"
    except OSError:
        return None
