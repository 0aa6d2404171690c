"""The in-situ probes of a measured step on gloo: per mode the collectives of
:mod:`collsim.validate.measure.insitu` timed alone in the step's own loop (a DDP mode's bucket
all-reduces, the FSDP sketch's all-gathers and reduce-scatters), DDP's gradient copies and the
overlap probe, one iteration at a time beside the timed steps, and their medians over iterations
(slowest rank) for the report.
"""

from __future__ import annotations

import statistics
from typing import Any

from collsim.validate.measure.insitu import (
    COPIES_KEY,
    OVERLAP_KEYS,
    PROBE_PREFIX,
    ddp_probe,
    fsdp_probe,
    overlap_probe,
    time_ddp_copies,
)
from collsim.validate.measure.step_model import StepConfig

__all__ = ["insitu_probes", "run_probes", "probe_report"]


def insitu_probes(
    torch: Any, dist: Any, cfg: StepConfig, ctx: Any, ddp_modules: dict[str, Any], model: Any
) -> tuple[dict[str, Any], Any]:
    """The in-situ probes of :mod:`collsim.validate.measure.insitu` for this rank's modes
    (gloo only: on GPUs the collectives run on their own engines and the bench's calibration
    stands)."""
    if ctx.backend != "gloo":
        return {}, None

    probes: dict[str, Any] = {}
    for mode in cfg.modes:
        if mode == "fsdp":
            root = [model.tok, model.pos, model.ln_f]
            units = [sum(p.numel() for m in root for p in m.parameters())]
            units += [sum(p.numel() for p in block.parameters()) for block in model.blocks]
            probes[mode] = fsdp_probe(torch, dist, units)
        else:
            probes[mode] = ddp_probe(torch, dist, ddp_modules[mode], int(mode[5:]))
    ddp = any(m.startswith("ddp") for m in cfg.modes)
    copies = time_ddp_copies(torch, list(model.parameters()), ctx.world_size) if ddp else None
    if probes:
        numel = sum(int(p.numel()) for p in model.parameters())
        probes["overlap"] = overlap_probe(torch, dist, numel)
    return probes, copies


def run_probes(
    dist: Any, probes: dict[str, Any], copies: Any, sizes: dict[str, dict[str, list[int]]]
) -> tuple[list[str], list[float]]:
    """One iteration of the probes, each after a barrier: column names and values (a DDP
    mode's group time; each FSDP call's time; the copies). ``sizes`` gets each probe's call
    sizes (bytes per call, per op) of this run."""

    keys: list[str] = []
    row: list[float] = []
    for mode, probe in probes.items():
        if mode == "overlap":
            keys += list(OVERLAP_KEYS)
            row += list(probe())
            continue
        dist.barrier()
        got = probe()
        for op, value in got.items():
            if mode.startswith("ddp"):
                keys.append(f"{PROBE_PREFIX}{mode}:{op}")
                row.append(value[0])
            else:
                for i, (t, _) in enumerate(value):
                    keys.append(f"{PROBE_PREFIX}{mode}:{op}:{i}")
                    row.append(t)
        sizes[mode] = {
            op: (value[1] if mode.startswith("ddp") else [b for _, b in value])
            for op, value in got.items()
        }
    if copies is not None:
        dist.barrier()
        keys.append(COPIES_KEY)
        row.append(copies())
    return keys, row


def probe_report(
    columns: dict[str, list[float]],
    probes: dict[str, Any],
    sizes: dict[str, dict[str, list[int]]],
) -> dict[str, Any]:
    """The probes' medians over iterations (slowest rank) for the report."""

    if not probes:
        return {}
    out: dict[str, Any] = {}
    result: dict[str, Any] = {}
    for mode in probes:
        if mode == "overlap":
            c, m, b = (statistics.median(columns[k]) for k in OVERLAP_KEYS)
            result["overlap_probe"] = {"compute_s": c, "comm_s": m, "both_s": b}
            continue
        entry: dict[str, Any] = {}
        for op, call_sizes in sizes.get(mode, {}).items():
            key = f"{PROBE_PREFIX}{mode}:{op}"
            if mode.startswith("ddp"):
                entry[op] = {
                    "sizes_bytes": call_sizes,
                    "median_s": statistics.median(columns[key]),
                    "times_s": columns[key],
                }
            else:
                calls = [columns[f"{key}:{i}"] for i in range(len(call_sizes))]
                entry[op] = {
                    "sizes_bytes": call_sizes,
                    "call_median_s": [statistics.median(c) for c in calls],
                    "median_s": statistics.median([sum(t) for t in zip(*calls)]),
                }
        out[mode] = entry
    result["comm_probe"] = out
    if COPIES_KEY in columns:
        result["ddp_copies_s"] = statistics.median(columns[COPIES_KEY])
        result["ddp_copies_times_s"] = columns[COPIES_KEY]
    return result
