"""Measured datasets on disk: CSV with ``# key: value`` metadata lines, or JSON; and the table.

A CSV written here starts with metadata lines (``# backend: gloo``, values in JSON), then one row
per measured point with the columns of :class:`~collsim.validate.bench.BenchPoint`. pandas reads
it with ``comment='#'``; :func:`read_measurements` returns the rows and the metadata. The same
content as JSON is ``{"metadata": {...}, "points": [{...}, ...]}``.

The printed table follows nccl-tests (``size(B) count(elements) type redop root | time(us)
algbw(GB/s) busbw(GB/s) #wrong``, ``#``-prefixed headers, ``# Avg bus bandwidth`` footer), one
block per op, so a real nccl-tests log can be read beside it.
"""

from __future__ import annotations

import csv
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from collsim.errors import ConfigError

__all__ = [
    "COLUMNS",
    "Measurements",
    "write_measurements",
    "read_measurements",
    "format_table",
]

#: Columns of a measured CSV, in order (BenchPoint's fields).
COLUMNS = (
    "op",
    "size_bytes",
    "count",
    "type",
    "redop",
    "root",
    "time_us",
    "min_us",
    "p90_us",
    "algbw_gbps",
    "busbw_gbps",
    "wrong",
    "world_size",
    "iters",
)
_INT_COLUMNS = {"size_bytes", "count", "root", "wrong", "world_size", "iters"}
_STR_COLUMNS = {"op", "type", "redop"}


@dataclass
class Measurements:
    """Rows of a measured dataset (dicts keyed by :data:`COLUMNS`) and its metadata."""

    rows: list[dict[str, Any]]
    metadata: dict[str, Any]
    path: str = ""

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


def write_measurements(
    path: str | Path, rows: list[dict[str, Any]], metadata: dict[str, Any]
) -> Path:
    """Write rows and metadata as CSV (``.csv``) or JSON (``.json``).

    Raises:
        ConfigError: the suffix is neither .csv nor .json.
    """
    out = Path(path)
    out.parent.mkdir(parents=True, exist_ok=True)
    if out.suffix == ".json":
        out.write_text(json.dumps({"metadata": metadata, "points": rows}, indent=1) + "\n")
        return out
    if out.suffix != ".csv":
        raise ConfigError(f"output must end in .csv or .json, got {out.name!r}", key_path="-o")
    with out.open("w", newline="") as handle:
        for key, value in metadata.items():
            handle.write(f"# {key}: {json.dumps(value)}\n")
        writer = csv.DictWriter(handle, fieldnames=list(COLUMNS), extrasaction="ignore")
        writer.writeheader()
        for row in rows:
            writer.writerow(
                {k: (f"{row[k]:.9g}" if isinstance(row[k], float) else row[k]) for k in COLUMNS}
            )
    return out


def _convert(row: dict[str, str], path: Path, line: int) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for key in COLUMNS:
        if key not in row or row[key] is None:
            raise ConfigError(f"missing column {key!r}", file=str(path), line=line)
        text = row[key]
        try:
            out[key] = (
                text if key in _STR_COLUMNS else int(text) if key in _INT_COLUMNS else float(text)
            )
        except ValueError:
            raise ConfigError(f"{key}: not a number: {text!r}", file=str(path), line=line) from None
    return out


def read_measurements(path: str | Path) -> Measurements:
    """Read a dataset written by :func:`write_measurements`.

    Raises:
        ConfigError: the file is missing, or a row is malformed (with its line).
    """
    src = Path(path)
    if not src.exists():
        raise ConfigError("no such measurement file", file=str(src))
    if src.suffix == ".json":
        doc = json.loads(src.read_text())
        rows = [
            _convert({k: str(v) for k, v in r.items()}, src, i + 1)
            for i, r in enumerate(doc.get("points", []))
        ]
        return Measurements(rows=rows, metadata=dict(doc.get("metadata", {})), path=str(src))
    metadata: dict[str, Any] = {}
    body: list[str] = []
    first_body_line = 1
    for number, line in enumerate(src.read_text().splitlines(), start=1):
        if line.startswith("#"):
            key, sep, value = line[1:].partition(":")
            if sep:
                try:
                    metadata[key.strip()] = json.loads(value.strip())
                except json.JSONDecodeError:
                    metadata[key.strip()] = value.strip()
            first_body_line = number + 1
        elif line.strip():
            body.append(line)
    reader = csv.DictReader(body)
    rows = [_convert(r, src, first_body_line + i + 1) for i, r in enumerate(reader)]
    if not rows:
        raise ConfigError("no measured rows", file=str(src))
    return Measurements(rows=rows, metadata=metadata, path=str(src))


def format_table(rows: list[dict[str, Any]], metadata: dict[str, Any]) -> str:
    """nccl-tests-style text table, one block per op, with the metadata in the header."""
    lines = [
        f"# collsim validate bench: backend {metadata.get('backend')}, "
        f"world size {metadata.get('world_size')} ({metadata.get('ranks_per_node')} ranks per "
        f"node), torch {metadata.get('torch_version')}, host {metadata.get('host')}, "
        f"{metadata.get('date')}",
        f"# {metadata.get('timing', '')}; iters {metadata.get('iters')}, "
        f"warmup {metadata.get('warmup')}, rounds {metadata.get('rounds', 1)}"
        + (f"; ranks under {metadata['scheduling']}" if metadata.get("scheduling") else ""),
    ]
    ops: list[str] = []
    for row in rows:
        if row["op"] not in ops:
            ops.append(row["op"])
    header = (
        f"# {'size(B)':>12} {'count(elements)':>15} {'type':>6} {'redop':>6} {'root':>5}"
        f" {'time(us)':>11} {'algbw(GB/s)':>11} {'busbw(GB/s)':>11} {'#wrong':>7}"
    )
    for op in ops:
        lines += ["#", f"# {op}", header]
        op_rows = [r for r in rows if r["op"] == op]
        for r in op_rows:
            lines.append(
                f"  {r['size_bytes']:>12} {r['count']:>15} {r['type']:>6} {r['redop']:>6} "
                f"{r['root']:>5} {r['time_us']:>11.1f} {r['algbw_gbps']:>11.3f} "
                f"{r['busbw_gbps']:>11.3f} {r['wrong']:>7}"
            )
        mean_bus = sum(r["busbw_gbps"] for r in op_rows) / len(op_rows)
        lines.append(
            f"# Out of bounds values : {sum(1 for r in op_rows if r['wrong'])} "
            f"{'OK' if not any(r['wrong'] for r in op_rows) else 'FAILED'}"
        )
        lines.append(f"# Avg bus bandwidth    : {mean_bus:.4g}")
    if "overhead_noop_us" in metadata:
        lines += [
            "#",
            f"# bench overhead: timing loop around nothing "
            f"{metadata['overhead_noop_us']:.1f} us; 4-byte all_reduce "
            f"{metadata['overhead_all_reduce_4B_us']:.1f} us",
        ]
    if metadata.get("load_average_start") is not None:
        lines.append(
            f"# load average (1, 5, 15 min): {metadata['load_average_start']} at the "
            f"start, {metadata.get('load_average_end')} at the end, "
            f"{metadata.get('duration_s')} s"
            + (
                f"; CPU time stolen by the hypervisor {metadata['cpu_steal_share']:.1%}"
                if metadata.get("cpu_steal_share") is not None
                else ""
            )
        )
    kernels = metadata.get("kernels") or {}
    if kernels:
        lines.append(
            "# backend kernels per op: "
            + "; ".join(f"{op} -> {', '.join(names) or '?'}" for op, names in kernels.items())
        )
    return "\n".join(lines)
