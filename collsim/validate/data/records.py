"""The vocabulary of a collective table: its CSV columns and units, op names, value checks
and :class:`Measurements`, shared by the writer and every reader
(:mod:`collsim.validate.data.dataset`
for collsim's CSV and JSON, :mod:`collsim.validate.data.nccltests` for nccl-tests logs)."""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from collsim.core.errors import ConfigError

__all__ = [
    "COLUMNS",
    "SCHEMA",
    "UNITS",
    "OPS",
    "UNMODELLED_OPS",
    "COLUMN_ALIASES",
    "ROW_KEY",
    "KEY_COLUMN",
    "Measurements",
    "canonical_op",
    "check_value",
]

#: The schema's name and version, written as ``# schema:``.
SCHEMA = "collsim-collectives/2"

#: Columns of the CSV schema, in order.
COLUMNS = (
    "op",
    "size_bytes",
    "count",
    "dtype",
    "redop",
    "root",
    "ranks",
    "nodes",
    "algorithm",
    "protocol",
    "time_us",
    "algbw_gbps",
    "busbw_gbps",
    "wrong",
    "in_place_time_us",
    "in_place_algbw_gbps",
    "in_place_busbw_gbps",
    "in_place_wrong",
    "min_us",
    "p90_us",
    "iters",
    "simulated_us",
    "error",
)

#: Units of the columns, written as ``# units:`` (nccl-tests' units; GB = 1e9 bytes).
UNITS = {
    "size_bytes": "bytes",
    "count": "elements",
    "time_us": "microseconds",
    "algbw_gbps": "GB/s (1e9 bytes/s), size / time",
    "busbw_gbps": "GB/s (1e9 bytes/s), algbw x nccl-tests' bus factor of op and ranks",
    "in_place_time_us": "microseconds",
    "min_us": "microseconds",
    "p90_us": "microseconds",
    "simulated_us": "microseconds",
    "error": "(simulated - measured) / measured",
}

#: Ops collsim models (nccl-tests' collectives under collsim's names).
OPS = (
    "all_reduce",
    "all_gather",
    "reduce_scatter",
    "broadcast",
    "reduce",
    "all_to_all",
    "send_recv",
)

#: Other spellings of the ops: nccl-tests' binary names and their stems.
_OP_ALIASES = {
    "allreduce": "all_reduce",
    "allgather": "all_gather",
    "reducescatter": "reduce_scatter",
    "alltoall": "all_to_all",
    "sendrecv": "send_recv",
}

#: nccl-tests collectives collsim does not model (src/*.cu of nccl-tests 2.19.6).
UNMODELLED_OPS = ("gather", "scatter", "hypercube", "alltoallv")

#: Header names of older files, mapped to the schema's.
COLUMN_ALIASES = {
    "type": "dtype",
    "world_size": "ranks",
    "algbw_GBps": "algbw_gbps",
    "busbw_GBps": "busbw_gbps",
}

#: Schema column -> key of the in-memory row (the bench's field names).
ROW_KEY = {"dtype": "type", "ranks": "world_size"}
KEY_COLUMN = {v: k for k, v in ROW_KEY.items()}


def canonical_op(text: str) -> str | None:
    """collsim's name of an op written as collsim or nccl-tests does (``allreduce``,
    ``all_reduce_perf``, ``alltoall``), or None."""
    name = text.strip().lower()
    name = name.removesuffix("_perf").removesuffix("_mpi")
    if name in OPS:
        return name
    return _OP_ALIASES.get(name.replace("_", ""))


def _unknown_op(text: str) -> str:
    name = text.strip().lower().removesuffix("_perf")
    if name in UNMODELLED_OPS:
        return f"nccl-tests' {name} is not modelled by collsim (modelled: {', '.join(OPS)})"
    return f"unknown op {text!r} (choose from {', '.join(OPS)})"


def _finite(text: str) -> float:
    value = float(text)
    if not math.isfinite(value):
        raise ValueError
    return value


def _integer(text: str) -> int:
    value = float(text)
    if not math.isfinite(value) or value != int(value):
        raise ValueError
    return int(value)


MAX_TIME_US = 1e12
"""Longest time one measured call may take (11.6 days): beyond it a value is a typo or a
corrupt file, and its logarithm would overflow the plots."""


MAX_SIZE_BYTES = 2**50
"""Largest message one measured call may move (1 PiB, thousands of times any device's memory):
beyond it a value is a typo or a corrupt file, and fits of time against size overflow."""


def _size(text: str) -> str | None:
    value = float(text)
    if value < 0:
        return "must be >= 0"
    return None if value <= MAX_SIZE_BYTES else f"must be <= 2**50 bytes, got {value:g}"


def _positive(text: str) -> str | None:
    try:
        value = float(text)
    except ValueError:
        return "not a number"
    if not (math.isfinite(value) and value > 0):
        return "must be a finite number > 0"
    return None if value <= MAX_TIME_US else f"must be <= {MAX_TIME_US:g} us, got {value:g}"


def _non_negative(text: str) -> str | None:
    try:
        value = float(text)
    except ValueError:
        return "not a number"
    return None if math.isfinite(value) and value >= 0 else "must be a finite number >= 0"


_Check = tuple[Callable[[str], Any], Callable[[str], str | None] | None, str]

#: Per column: how the text converts, the rule it must pass, and the rule in words.
_CHECKS: dict[str, _Check] = {
    "size_bytes": (_integer, _size, "an integer"),
    "count": (_integer, _size, "an integer"),
    "root": (_integer, None, "an integer"),
    "ranks": (_integer, lambda t: None if float(t) >= 1 else "must be >= 1", "an integer"),
    "nodes": (_integer, lambda t: None if float(t) >= 1 else "must be >= 1", "an integer"),
    "wrong": (_integer, lambda t: None if float(t) >= 0 else "must be >= 0", "an integer"),
    "in_place_wrong": (_integer, lambda t: None if float(t) >= 0 else "must be >= 0", "an integer"),
    "iters": (_integer, lambda t: None if float(t) >= 1 else "must be >= 1", "an integer"),
    "time_us": (_finite, _positive, "a number"),
    "in_place_time_us": (_finite, _positive, "a number"),
    "min_us": (_finite, _positive, "a number"),
    "p90_us": (_finite, _positive, "a number"),
    "simulated_us": (_finite, _positive, "a number"),
    "algbw_gbps": (_finite, _non_negative, "a number"),
    "busbw_gbps": (_finite, _non_negative, "a number"),
    "in_place_algbw_gbps": (_finite, _non_negative, "a number"),
    "in_place_busbw_gbps": (_finite, _non_negative, "a number"),
    "error": (_finite, None, "a number"),
}
_TEXT_COLUMNS = {"op", "dtype", "redop", "algorithm", "protocol"}


def check_value(column: str, text: str, *, file: str, line: int) -> Any:
    """The value of one cell, checked against its column's rule.

    Raises:
        ConfigError: ``file:line: column: rule, got text``.
    """
    raw = text.strip()
    if column == "op":
        op = canonical_op(raw)
        if op is None:
            raise ConfigError(_unknown_op(raw), key_path="op", file=file, line=line)
        return op
    if column in _TEXT_COLUMNS:
        return raw
    convert, rule, kind = _CHECKS[column]
    try:
        float(raw)
    except ValueError:
        raise ConfigError(f"not a number: {raw!r}", key_path=column, file=file, line=line) from None
    problem = rule(raw) if rule is not None else None
    if problem is None:
        try:
            return convert(raw)
        except (ValueError, OverflowError):
            problem = f"must be {kind}"
    raise ConfigError(f"{problem}, got {raw}", key_path=column, file=file, line=line)


@dataclass
class Measurements:
    """Rows of a collective table (dicts, see docs/derivations.md) and its metadata.

    ``kind`` says what the file was: ``csv``, ``json``, ``nccl-tests`` (a text log),
    ``nccl-tests-json`` (``-J``), ``rccl-tests`` or ``collective-json``.
    """

    rows: list[dict[str, Any]]
    metadata: dict[str, Any]
    path: str = ""
    kind: str = "csv"
    header: dict[str, Any] = field(default_factory=dict)
    """``schema`` and ``units`` lines of the file (kept apart from the metadata)."""

    def ops(self) -> list[str]:
        """Ops present, in first-seen order."""
        seen: list[str] = []
        for row in self.rows:
            if row["op"] not in seen:
                seen.append(row["op"])
        return seen

    @property
    def world_size(self) -> int:
        """World size of the measurement (metadata, else the rows)."""
        if "world_size" in self.metadata:
            return int(self.metadata["world_size"])
        return int(self.rows[0]["world_size"])

    @property
    def num_nodes(self) -> int:
        """Nodes of the measurement (metadata ``num_nodes``, else the rows' ``nodes``, else 1)."""
        if "num_nodes" in self.metadata:
            return int(self.metadata["num_nodes"])
        return int(self.rows[0].get("nodes", 1))

    @property
    def ranks_per_node(self) -> int:
        """Ranks per node (metadata, else world size / nodes)."""
        if "ranks_per_node" in self.metadata:
            return int(self.metadata["ranks_per_node"])
        return max(1, self.world_size // self.num_nodes)
