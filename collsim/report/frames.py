"""Results as tidy pandas frames, one fact per row, units in the column names.

Sweeps, searches, plots and the CLI read simulated steps through these functions, never through
the :class:`~collsim.step.result.StepResult` fields directly, so that a CSV written by
``collsim sweep -o`` can be plotted again later by ``collsim plot`` without re-simulating.

Column conventions (STYLE.md section 7): ``*_s`` seconds, ``*_bytes`` bytes, ``*_bps`` bytes per
second, ``*_per_s`` rates, ``mfu``/``hfu`` fractions in [0, 1]. Breakdown parts are
``compute_s``, ``tp_exposed_s``, ... (:data:`BREAKDOWN_COLUMNS`); memory categories are
``mem_parameters_bytes``, ... (:data:`MEMORY_COLUMNS`).

pandas is imported here; ``collsim run`` must not import this module unless asked for a report.
"""

from __future__ import annotations

import io
import math
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

import pandas as pd

from collsim.collectives import cost
from collsim.core.errors import CollsimError, ConfigError
from collsim.core.vocab import Algorithm, CollectiveOp
from collsim.core.yamlio import read_input_text
from collsim.step.result import BREAKDOWN_KEYS, MEMORY_KEYS, StepResult

if TYPE_CHECKING:  # pragma: no cover
    from collsim.study.sweep import SweepOutcome

__all__ = [
    "sweep_frame",
    "BREAKDOWN_COLUMNS",
    "MEMORY_COLUMNS",
    "RESULT_COLUMNS",
    "result_record",
    "results_frame",
    "collectives_frame",
    "trace_frame",
    "event_phase",
    "memory_timeline_frame",
    "read_collective_csv",
    "collective_cost_frame",
]

#: Step-time parts, in the order they stack: column name per :data:`BREAKDOWN_KEYS`.
BREAKDOWN_COLUMNS: dict[str, str] = {key: f"{key}_s" for key in BREAKDOWN_KEYS}
#: Memory categories at the peak: column name per :data:`MEMORY_KEYS`.
MEMORY_COLUMNS: dict[str, str] = {key: f"mem_{key}_bytes" for key in MEMORY_KEYS}

#: Every scalar field of a StepResult, flattened, in the order they appear in a results frame.
RESULT_COLUMNS: tuple[str, ...] = (
    "step_time_s",
    "tokens_per_s",
    "model_tflops_per_gpu",
    "hardware_tflops_per_gpu",
    "mfu",
    "hfu",
    *BREAKDOWN_COLUMNS.values(),
    "memory_peak_bytes",
    *MEMORY_COLUMNS.values(),
    "memory_reserved_bytes",
    "memory_capacity_bytes",
    "fits",
    "num_gpus",
    "comm_bytes_tp",
    "comm_bytes_pp",
    "comm_bytes_dp",
    "num_warnings",
)


def result_record(result: StepResult) -> dict[str, Any]:
    """Flatten one StepResult into a row of scalars (the :data:`RESULT_COLUMNS`).

    Collective bytes are summed per axis (``comm_bytes_tp`` ...: count x nccl-tests size of every
    call of that axis on one rank in one step).
    """
    row: dict[str, Any] = {
        "step_time_s": float(result.step_time_s),
        "tokens_per_s": float(result.tokens_per_s),
        "model_tflops_per_gpu": float(result.model_tflops_per_gpu),
        "hardware_tflops_per_gpu": float(result.hardware_tflops_per_gpu),
        "mfu": float(result.mfu),
        "hfu": float(result.hfu),
    }
    for key, column in BREAKDOWN_COLUMNS.items():
        row[column] = float(result.breakdown_s.get(key, 0.0))
    row["memory_peak_bytes"] = float(result.memory_peak_bytes)
    for key, column in MEMORY_COLUMNS.items():
        row[column] = float(result.memory_bytes.get(key, 0.0))
    # what the caching allocator reserves at the peak; NaN where it was not replayed (a
    # search replays only plans near the memory limit)
    reserved = result.memory_reserved_bytes
    row["memory_reserved_bytes"] = math.nan if reserved is None else float(reserved)
    row["memory_capacity_bytes"] = float(result.memory_capacity_bytes)
    row["fits"] = bool(result.fits)
    row["num_gpus"] = int(result.num_gpus)
    for axis in ("tp", "pp", "dp"):
        row[f"comm_bytes_{axis}"] = float(
            sum(stat.total_bytes for stat in result.collectives if stat.axis == axis)
        )
    row["num_warnings"] = len(result.warnings)
    return row


def results_frame(
    rows: Iterable[tuple[Mapping[str, Any], StepResult | None]],
    *,
    reasons: Sequence[str | None] | None = None,
) -> pd.DataFrame:
    """One row per simulated point: the point's parameters, then every result field.

    Args:
        rows: ``(params, result)`` pairs; ``params`` are the point's coordinates (``num_gpus``,
            ``parallel.zero``, a ``plan`` label, ...). ``result`` is None for infeasible points.
        reasons: for each row, why it is infeasible (None when it ran). Rows with a reason get
            ``feasible = False`` and NaN result fields.

    Returns:
        A frame with the parameter columns first, then ``feasible``, ``reason`` and
        :data:`RESULT_COLUMNS`. A parameter named like a result column (``num_gpus``) wins.
    """
    records: list[dict[str, Any]] = []
    param_order: list[str] = []
    pairs = list(rows)
    if reasons is not None and len(reasons) != len(pairs):
        raise ValueError(f"reasons has {len(reasons)} entries for {len(pairs)} rows")
    for index, (params, result) in enumerate(pairs):
        for key in params:
            if key not in param_order:
                param_order.append(key)
        reason = reasons[index] if reasons is not None else None
        record: dict[str, Any] = {column: math.nan for column in RESULT_COLUMNS}
        if result is not None:
            record.update(result_record(result))
        record.update(params)
        record["feasible"] = result is not None and reason is None
        record["reason"] = reason if reason is not None else ""
        records.append(record)
    columns = (
        param_order + ["feasible", "reason"] + [c for c in RESULT_COLUMNS if c not in param_order]
    )
    return pd.DataFrame.from_records(records, columns=columns)


def collectives_frame(result: StepResult) -> pd.DataFrame:
    """One row per kind of collective in the step (nccl-tests style fields, SI units)."""
    records = [
        {
            "axis": stat.axis,
            "op": stat.op,
            "group_size": int(stat.group_size),
            "algorithm": stat.algorithm,
            "count": int(stat.count),
            "size_bytes": float(stat.size_bytes),
            "total_bytes": float(stat.total_bytes),
            "time_s": float(stat.time_s),
            "busbw_bps": float(stat.busbw_bps),
        }
        for stat in result.collectives
    ]
    return pd.DataFrame.from_records(
        records,
        columns=[
            "axis",
            "op",
            "group_size",
            "algorithm",
            "count",
            "size_bytes",
            "total_bytes",
            "time_s",
            "busbw_bps",
        ],
    )


def trace_frame(result: StepResult) -> pd.DataFrame:
    """One row per trace event: ``rank, stream, name, start_s, end_s, duration_s`` plus
    ``phase`` (forward / backward / recompute / optimizer / comm / other, see
    :func:`event_phase`), ``stage`` and ``microbatch`` when the engine recorded them in args.
    """
    records = []
    for event in result.trace_events:
        args = event.args or {}
        records.append(
            {
                "rank": int(event.rank),
                "stream": str(event.stream),
                "name": str(event.name),
                "start_s": float(event.start_s),
                "end_s": float(event.end_s),
                "duration_s": float(event.end_s - event.start_s),
                "phase": event_phase(event.stream, event.name, args),
                "stage": args.get("stage", pd.NA),
                "microbatch": args.get("microbatch", args.get("mb", pd.NA)),
            }
        )
    return pd.DataFrame.from_records(
        records,
        columns=[
            "rank",
            "stream",
            "name",
            "start_s",
            "end_s",
            "duration_s",
            "phase",
            "stage",
            "microbatch",
        ],
    )


def event_phase(stream: str, name: str, args: Mapping[str, Any] | None = None) -> str:
    """Classify a trace event for timelines: ``forward``, ``backward``, ``recompute``,
    ``optimizer``, ``comm`` or ``other``.

    ``args["phase"]`` wins when the engine set it; otherwise the name's first word decides
    (``fwd mb3 L12`` -> forward, ``bwd ...``, ``I ...``, ``W ...`` -> backward); events on a
    communication stream are ``comm``.
    """
    if args and isinstance(args.get("phase"), str):
        return str(args["phase"])
    if stream not in ("compute",):
        return "comm"
    head = name.strip().split(" ", 1)[0].lower() if name.strip() else ""
    if head in ("fwd", "forward", "f"):
        return "forward"
    if head in ("bwd", "backward", "b", "i", "w"):  # a whole backward, or its I and W parts
        return "backward"
    if head.startswith("recomp"):
        return "recompute"
    if head.startswith("opt"):
        return "optimizer"
    return "other"


def memory_timeline_frame(result: StepResult, rank: int | None = None) -> pd.DataFrame:
    """Memory in use over the step: ``rank, time_s, memory_bytes`` (step-wise: each value holds
    until the next row of the same rank).

    Args:
        rank: keep this rank only; None keeps every simulated rank.

    Raises:
        ConfigError: ``rank`` was not simulated (the message lists the ranks that were).
    """
    timeline = result.memory_timeline
    if rank is not None and rank not in timeline:
        known = ", ".join(str(r) for r in sorted(timeline)) or "none"
        raise ConfigError(
            f"rank {rank} has no memory timeline; simulated ranks: {known}", key_path="rank"
        )
    ranks = [rank] if rank is not None else sorted(timeline)
    records = [
        {"rank": int(r), "time_s": float(t), "memory_bytes": float(b)}
        for r in ranks
        for t, b in timeline[r]
    ]
    return pd.DataFrame.from_records(records, columns=["rank", "time_s", "memory_bytes"])


#: ``collsim collective`` CSV columns -> (frame column, factor to SI).
_COLLECTIVE_CSV = {
    "size_bytes": ("size_bytes", 1.0),
    "time_us": ("time_s", 1e-6),
    "algbw_GBps": ("algbw_bps", 1e9),
    "busbw_GBps": ("busbw_bps", 1e9),
}


def read_collective_csv(path: str | Path) -> pd.DataFrame:
    """Read a ``collsim collective`` CSV (``size_bytes,time_us,algbw_GBps,busbw_GBps,algorithm``)
    into SI columns ``size_bytes, time_s, algbw_bps, busbw_bps, algorithm`` (GB = 1e9).

    An ``algorithm/protocol`` value (``ring/ll128``) is split into ``algorithm`` and
    ``protocol``. Extra columns (``op``, ``group_size`` ...) are kept as they are. Without an
    ``algorithm``
    column (a measured nccl-tests sweep), the file's stem names the series.

    Raises:
        ConfigError: the file cannot be read as CSV, a required column is missing or holds
            something that is not a number.
    """

    path = Path(path)
    text = read_input_text(path, what="CSV file")
    try:
        frame = pd.read_csv(io.StringIO(text), comment="#")
    except pd.errors.EmptyDataError:
        raise ConfigError("empty file, expected a collsim collective CSV", file=str(path)) from None
    except (OSError, UnicodeDecodeError, pd.errors.ParserError) as exc:
        raise ConfigError(
            f"cannot read CSV: {' '.join(str(exc).split())}", file=str(path)
        ) from None
    missing = [c for c in _COLLECTIVE_CSV if c not in frame.columns]
    if missing:
        raise ConfigError(
            f"missing column(s) {', '.join(missing)}; expected "
            "size_bytes,time_us,algbw_GBps,busbw_GBps,algorithm",
            file=str(path),
        )
    out = frame.rename(columns={k: v for k, (v, _) in _COLLECTIVE_CSV.items()})
    for given, (column, factor) in _COLLECTIVE_CSV.items():
        try:
            out[column] = out[column].astype(float) * factor
        except ValueError:
            raise ConfigError(f"column {given!r} must hold numbers", file=str(path)) from None
    if "algorithm" in out.columns:
        # `collsim collective` writes the NCCL-style choice, e.g. ``ring/ll128``.
        parts = out["algorithm"].astype(str).str.split("/", n=1, expand=True)
        out["algorithm"] = parts[0]
        if parts.shape[1] > 1 and "protocol" not in out.columns:
            out["protocol"] = parts[1].fillna("")
    else:  # an nccl-tests sweep converted to CSV: one series named after the file
        out["algorithm"] = path.stem
    return out


def collective_cost_frame(
    op: str, sizes_bytes: Iterable[int], group: Any, algorithms: Iterable[str]
) -> pd.DataFrame:
    """Closed-form cost (``collsim.collectives.cost``) of ``op`` for every size and algorithm.

    Algorithms that do not apply to the group (``nvls`` without NVSwitch reduction, ...) raise
    ConfigError or InfeasibleError in ``cost`` and are left out.

    Returns:
        ``op, algorithm, protocol, size_bytes, time_s, algbw_bps, busbw_bps``.
    """

    sizes = list(sizes_bytes)
    records = []
    for name in algorithms:
        algorithm = Algorithm(name)
        for size in sizes:
            try:
                result = cost(CollectiveOp(op), int(size), group, algorithm)
            except CollsimError:
                break
            records.append(
                {
                    "op": str(op),
                    "algorithm": str(algorithm),
                    "protocol": str(result.protocol),
                    "size_bytes": float(result.size_bytes),
                    "time_s": float(result.time_s),
                    "algbw_bps": float(result.algbw_bps),
                    "busbw_bps": float(result.busbw_bps),
                }
            )
    return pd.DataFrame.from_records(
        records,
        columns=["op", "algorithm", "protocol", "size_bytes", "time_s", "algbw_bps", "busbw_bps"],
    )


def sweep_frame(outcomes: Sequence[SweepOutcome]) -> pd.DataFrame:
    """The results frame of a sweep (:func:`results_frame`): the point's
    coordinates, ``feasible``, ``reason``, every result field, the plan's ``warnings`` (joined
    with ``; ``) and ``elapsed_s`` (wall seconds of the point)."""
    frame = results_frame(
        [(o.params, o.result) for o in outcomes], reasons=[o.reason for o in outcomes]
    )
    frame["warnings"] = [
        "; ".join(
            dict.fromkeys([*o.warnings, *(o.result.warnings if o.result is not None else [])])
        )
        for o in outcomes
    ]
    frame["elapsed_s"] = [o.elapsed_s for o in outcomes]
    return frame
