"""Measured and simulated collective tables on disk: one CSV schema, JSON, nccl-tests logs.

Derivations, measurements and sources: docs/derivations.md, ``collsim.validate.data.dataset``.
"""

from __future__ import annotations

import csv
import io
import json
from pathlib import Path
from typing import Any

from collsim.core.errors import ConfigError
from collsim.core.yamlio import read_input_bytes
from collsim.validate.data.nccltests import looks_like_log, parse_json, parse_log
from collsim.validate.data.records import (
    COLUMN_ALIASES,
    COLUMNS,
    KEY_COLUMN,
    OPS,
    ROW_KEY,
    SCHEMA,
    UNITS,
    Measurements,
    canonical_op,
    check_value,
)

__all__ = [
    "COLUMNS",
    "SCHEMA",
    "UNITS",
    "OPS",
    "Measurements",
    "write_measurements",
    "read_measurements",
    "read_text",
    "sniff",
    "canonical_op",
    "check_value",
    "csv_preamble",
    "csv_row",
    "format_table",
]


def _cell(row: dict[str, Any], column: str, metadata: dict[str, Any]) -> str:
    key = ROW_KEY.get(column, column)
    value = row.get(key)
    if value is None and column == "nodes":
        value = metadata.get("num_nodes")
    if value is None and column == "ranks":
        value = metadata.get("world_size")
    if value is None:
        return ""
    if isinstance(value, float):
        return f"{value:.9g}"
    return str(value)


def csv_preamble(metadata: dict[str, Any]) -> str:
    """The ``#`` lines and the header row of a CSV (for writers that append rows as they go)."""
    lines = [f"# schema: {json.dumps(SCHEMA)}", f"# units: {json.dumps(UNITS)}"]
    lines += [f"# {key}: {json.dumps(value)}" for key, value in metadata.items()]
    lines.append(",".join(COLUMNS))
    return "\n".join(lines) + "\n"


def csv_row(row: dict[str, Any], metadata: dict[str, Any] | None = None) -> str:
    """One row of the schema as a CSV line (with its newline)."""
    buffer = io.StringIO()
    csv.writer(buffer, lineterminator="\n").writerow(
        [_cell(row, column, metadata or {}) for column in COLUMNS]
    )
    return buffer.getvalue()


def _schema_row(row: dict[str, Any]) -> dict[str, Any]:
    return {KEY_COLUMN.get(k, k): v for k, v in row.items()}


def write_measurements(
    path: str | Path, rows: list[dict[str, Any]], metadata: dict[str, Any]
) -> Path:
    """Write rows and metadata as CSV (``.csv``) or JSON (``.json``), in the schema.

    Raises:
        ConfigError: the suffix is neither .csv nor .json.
    """
    out = Path(path)
    out.parent.mkdir(parents=True, exist_ok=True)
    if out.suffix == ".json":
        doc = {
            "schema": SCHEMA,
            "units": UNITS,
            "metadata": metadata,
            "points": [_schema_row(r) for r in rows],
        }
        out.write_text(json.dumps(doc, indent=1) + "\n")
        return out
    if out.suffix != ".csv":
        raise ConfigError(f"output must end in .csv or .json, got {out.name!r}", key_path="-o")
    with out.open("w", newline="") as handle:
        handle.write(csv_preamble(metadata))
        for row in rows:
            handle.write(csv_row(row, metadata))
    return out


def _convert(
    cells: dict[str, str], path: str, line: int, metadata: dict[str, Any]
) -> dict[str, Any]:
    """One row of text cells (schema names) as a checked row dict."""
    out: dict[str, Any] = {}
    for column in COLUMNS:
        text = cells.get(column)
        if text is None or not str(text).strip() or str(text).strip().upper() == "N/A":
            continue
        out[ROW_KEY.get(column, column)] = check_value(column, str(text), file=path, line=line)
    for column in ("op", "size_bytes", "time_us"):
        if ROW_KEY.get(column, column) not in out:
            raise ConfigError("missing value", key_path=column, file=path, line=line)
    if "world_size" not in out:
        if "world_size" not in metadata:
            raise ConfigError(
                "missing value (no 'ranks' column and no '# world_size:' line)",
                key_path="ranks",
                file=path,
                line=line,
            )
        out["world_size"] = check_value("ranks", str(metadata["world_size"]), file=path, line=line)
    return out


def sniff(text: str) -> str:
    """What a decoded file holds: ``json``, ``nccl-tests`` (an nccl-tests or rccl-tests text
    log) or ``csv``."""

    head = text.lstrip()
    if head.startswith("{"):
        return "json"
    if looks_like_log(text):
        return "nccl-tests"
    return "csv"


def read_text(path: str | Path) -> str:
    """A measurement file's text.

    Raises:
        ConfigError: missing, unreadable, or binary (NUL bytes or not UTF-8), with the line of
            the first bad byte.
    """

    src = Path(path)
    if not src.exists():
        raise ConfigError("no such measurement file", file=str(src))
    data = read_input_bytes(src, what="measurement file")
    what = "a binary file, not a CSV, JSON or nccl-tests log"
    nul = data.find(b"\x00")
    if nul >= 0:
        line = data.count(b"\n", 0, nul) + 1
        raise ConfigError(f"{what} (NUL byte at offset {nul})", file=str(src), line=line)
    try:
        return data.decode("utf-8").removeprefix("\ufeff")
    except UnicodeDecodeError as exc:
        line = data.count(b"\n", 0, exc.start) + 1
        raise ConfigError(
            f"{what} (byte 0x{data[exc.start]:02x} at offset {exc.start} is not UTF-8)",
            file=str(src),
            line=line,
        ) from None


def read_measurements(path: str | Path, op: str | None = None) -> Measurements:
    """Read a collective table: schema CSV or JSON, an older bench CSV, ``collective -F csv``
    or ``-F json``, an nccl-tests or rccl-tests log, or nccl-tests ``-J`` JSON. ``op`` (collsim's
    name) is the collective of an nccl-tests or rccl-tests log that does not say which it is.

    Raises:
        ConfigError: the file is missing, binary, not one of those, or holds a bad value
            (``file:line: column: message``).
    """
    src = Path(path)
    text = read_text(src)
    kind = sniff(text)
    if kind == "nccl-tests":
        return parse_log(text, str(src), op)
    if kind == "json":
        return _read_json(text, str(src))
    return _read_csv(text, str(src))


def _read_json(text: str, path: str) -> Measurements:
    try:
        doc = json.loads(text)
    except json.JSONDecodeError as exc:
        raise ConfigError(f"JSON syntax error: {exc.msg}", file=path, line=exc.lineno) from None
    if not isinstance(doc, dict):
        raise ConfigError("expected a JSON object", file=path)
    if "results" in doc and ("nccl_version" in doc or "config" in doc):
        return parse_json(doc, text, path)
    if "rows" in doc and "op" in doc:  # collsim collective -F json
        metadata = {k: v for k, v in doc.items() if k != "rows"}
        metadata.setdefault("world_size", doc.get("ranks"))
        metadata.setdefault("num_nodes", doc.get("nodes"))
        rows = []
        for i, point in enumerate(doc["rows"]):
            if not isinstance(point, dict):
                raise ConfigError("expected an object", key_path=f"rows[{i}]", file=path)
            cells = {COLUMN_ALIASES.get(str(k), str(k)): _json_cell(v) for k, v in point.items()}
            cells.setdefault("op", str(doc["op"]))
            if "/" in cells.get("algorithm", ""):  # the label, algorithm/protocol
                cells["algorithm"], cells["protocol"] = cells["algorithm"].split("/", 1)
            rows.append(_convert(cells, path, _json_line(text, "rows", i), metadata))
        return _finish(rows, metadata, path, "collective-json", {})
    points = doc.get("points")
    if not isinstance(points, list):
        raise ConfigError(
            "expected a collsim table ('points'), `collsim collective -F json` ('rows') or "
            "nccl-tests -J output ('results')",
            file=path,
        )
    metadata = dict(doc.get("metadata") or {})
    rows = []
    for i, point in enumerate(points):
        if not isinstance(point, dict):
            raise ConfigError("expected an object", key_path=f"points[{i}]", file=path)
        cells = {COLUMN_ALIASES.get(str(k), str(k)): _json_cell(v) for k, v in point.items()}
        rows.append(_convert(cells, path, _json_line(text, "points", i), metadata))
    header = {k: doc[k] for k in ("schema", "units") if k in doc}
    return _finish(rows, metadata, path, "json", header)


def _json_cell(value: Any) -> str:
    if value is None:
        return ""
    return str(value)


def _json_line(text: str, key: str, index: int) -> int:
    """Line of the ``index``-th object of the list under ``key`` (for messages)."""
    start = text.find(f'"{key}"')
    if start < 0:
        return 1
    pos = start
    depth = 0
    count = -1
    for i in range(start, len(text)):
        ch = text[i]
        if ch == "{":
            depth += 1
            if depth == 1:
                count += 1
                if count == index:
                    pos = i
                    break
        elif ch == "}":
            depth -= 1
    return text.count("\n", 0, pos) + 1


def _read_csv(text: str, path: str) -> Measurements:
    metadata: dict[str, Any] = {}
    header: dict[str, Any] = {}
    body: list[tuple[int, str]] = []
    for number, line in enumerate(text.splitlines(), start=1):
        if line.startswith("#"):
            key, sep, value = line[1:].partition(":")
            if sep:
                try:
                    parsed = json.loads(value.strip())
                except json.JSONDecodeError:
                    parsed = value.strip()
                target = header if key.strip() in ("schema", "units") else metadata
                target[key.strip()] = parsed
        elif line.strip():
            body.append((number, line))
    if not body:
        raise ConfigError("no header row and no measured rows", file=path)
    head_line, head = body[0]
    names = [COLUMN_ALIASES.get(n.strip(), n.strip()) for n in next(csv.reader([head]))]
    if "op" not in names and "op" not in metadata:
        raise ConfigError(
            f"no 'op' column (header {head.strip()!r}); expected the collsim CSV schema "
            f"({','.join(COLUMNS[:11])},...) or an nccl-tests log",
            file=path,
            line=head_line,
        )
    for required in ("size_bytes", "time_us"):
        if required not in names:
            raise ConfigError(
                f"missing column {required!r} (header {head.strip()!r})",
                file=path,
                line=head_line,
            )
    rows = []
    for number, line in body[1:]:
        values = next(csv.reader([line]))
        if len(values) != len(names):
            raise ConfigError(
                f"{len(values)} fields, the header has {len(names)}", file=path, line=number
            )
        cells = dict(zip(names, values))
        if "op" not in cells:
            cells["op"] = str(metadata["op"])
        rows.append(_convert(cells, path, number, metadata))
    return _finish(rows, metadata, path, "csv", header)


def _finish(
    rows: list[dict[str, Any]],
    metadata: dict[str, Any],
    path: str,
    kind: str,
    header: dict[str, Any],
) -> Measurements:
    if not rows:
        raise ConfigError("no measured rows", file=path)
    return Measurements(rows=rows, metadata=metadata, path=path, kind=kind, header=header)


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
    if metadata.get("in_place"):
        lines.append(f"# timed in place: {', '.join(metadata['in_place'])}")
    kernels = metadata.get("kernels") or {}
    if kernels:
        lines.append(
            "# backend kernels per op: "
            + "; ".join(f"{op} -> {', '.join(names) or '?'}" for op, names in kernels.items())
        )
    return "\n".join(lines)
