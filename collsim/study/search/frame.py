"""The table of a search: :func:`search_frame` writes one row per estimated plan (its knobs, the
closed form's ``est_*`` columns and the engine's ``sim_*`` columns for the re-simulated ones),
and :func:`known_from_frame` reads such a table back as estimates by plan label, so that
``collsim search --resume`` continues an earlier run without estimating its plans again.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from collsim.core.errors import ConfigError
from collsim.step.result import BREAKDOWN_KEYS, MEMORY_KEYS, Breakdown
from collsim.step.result import StepResult as Result

if TYPE_CHECKING:  # pragma: no cover
    import pandas as pd

    from collsim.step.result import StepResult
    from collsim.study.search.loop import SearchResult

__all__ = ["search_frame", "known_from_frame"]


def search_frame(result: SearchResult, *, limit: int | None = None) -> pd.DataFrame:
    """One row per feasible plan, best estimate first: the plan's knobs, ``est_*`` columns of
    the closed form (step time, breakdown, memory, MFU) and ``sim_*`` columns for the
    re-simulated ones (NaN otherwise)."""
    # start-up: pandas loads only when a frame is asked for (the run path stays light)
    import pandas as pd

    rows = []
    for index, entry in enumerate(result.ranked[:limit] if limit else result.ranked):
        est = entry.estimate
        row: dict[str, Any] = {
            "rank_estimate": index + 1,
            **entry.candidate.as_dict(),
            "num_microbatches": est.num_microbatches,
            "est_step_time_s": est.step_time_s,
            "est_tokens_per_s": est.tokens_per_s,
            "est_mfu": est.mfu,
        }
        for key in BREAKDOWN_KEYS:
            row[f"est_{key}_s"] = est.breakdown_s[key]
        row["est_memory_peak_bytes"] = est.memory_peak_bytes
        for key in MEMORY_KEYS:
            row[f"est_mem_{key}_bytes"] = est.memory_bytes[key]
        res = entry.result
        row["simulated"] = res is not None
        row["sim_reason"] = entry.reason or ""
        row["sim_step_time_s"] = res.step_time_s if res is not None else float("nan")
        row["sim_mfu"] = res.mfu if res is not None else float("nan")
        row["sim_memory_peak_bytes"] = res.memory_peak_bytes if res is not None else float("nan")
        row["sim_fits"] = res.fits if res is not None else pd.NA
        for key in BREAKDOWN_KEYS:
            row[f"sim_{key}_s"] = res.breakdown_s.get(key, 0.0) if res is not None else float("nan")
        rows.append(row)
    return pd.DataFrame.from_records(rows)


def known_from_frame(frame: pd.DataFrame) -> dict[str, StepResult]:
    """The estimates a :func:`search_frame` table holds, by plan label (``--resume``): each
    rebuilt from its ``est_*`` columns (what the table and a new frame show of it), so that a
    resumed search ranks and writes them as the earlier run did.

    Raises:
        ConfigError: the table lacks a column a search writes.
    """

    needed = ["plan", "num_microbatches", "est_step_time_s", "est_tokens_per_s", "est_mfu"]
    needed += [f"est_{key}_s" for key in BREAKDOWN_KEYS] + ["est_memory_peak_bytes"]
    needed += [f"est_mem_{key}_bytes" for key in MEMORY_KEYS]
    missing = [c for c in needed if c not in frame.columns]
    if missing:
        raise ConfigError(f"not a search table: no column {missing[0]!r}", key_path="--resume")
    out: dict[str, StepResult] = {}
    for row in frame.to_dict("records"):
        out[str(row["plan"])] = Result(
            step_time_s=float(row["est_step_time_s"]),
            tokens_per_s=float(row["est_tokens_per_s"]),
            model_tflops_per_gpu=float("nan"),
            hardware_tflops_per_gpu=float("nan"),
            mfu=float(row["est_mfu"]),
            hfu=float("nan"),
            breakdown_s=Breakdown.of({key: float(row[f"est_{key}_s"]) for key in BREAKDOWN_KEYS}),
            memory_peak_bytes=float(row["est_memory_peak_bytes"]),
            memory_bytes={key: float(row[f"est_mem_{key}_bytes"]) for key in MEMORY_KEYS},
            memory_capacity_bytes=float("nan"),
            fits=True,
            num_microbatches=int(row["num_microbatches"]),
        )
    return out
