"""Read the output of nccl-tests and rccl-tests: text logs and ``-J`` JSON (the writers are
:mod:`collsim.validate.data.nccltests_format`).

Derivations, measurements and sources: docs/derivations.md, ``collsim.validate.data.nccltests``.
"""

from __future__ import annotations

import math
import re
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from collsim.core.errors import ConfigError
from collsim.validate.data.records import (
    OPS,
    Measurements,
    canonical_op,
    check_value,
)
from collsim.validate.data.records import UNMODELLED_OPS as _UNMODELLED

__all__ = [
    "looks_like_log",
    "parse_log",
    "parse_json",
    "bus_factor",
]

#: nccl-tests' busbw factor per op (src/<op>.cu ``*GetBw`` of nccl-tests 2.19.6).
_BUS: dict[str, Callable[[int], float]] = {
    "all_reduce": lambda n: 2.0 * (n - 1) / n,
    "all_gather": lambda n: (n - 1) / n,
    "reduce_scatter": lambda n: (n - 1) / n,
    "all_to_all": lambda n: (n - 1) / n,
    "broadcast": lambda n: 1.0,
    "reduce": lambda n: 1.0,
    "send_recv": lambda n: 1.0,
}

_RANK = re.compile(
    r"^#\s+Rank\s+(?P<rank>\d+)(?:\s+Group\s+(?P<group>\d+))?\s+Pid\s+(?P<pid>\d+)\s+on\s+"
    r"(?P<host>\S+)\s+device\s+(?P<device>\d+)\s+\[(?P<bus>[^\]]*)\]\s*(?P<name>.*)$"
)
_CONFIG = re.compile(
    r"^#\s*nThread\s+(?P<nthreads>\d+)\s+nGpus\s+(?P<ngpus>\d+)\s+minBytes\s+(?P<min>\d+)\s+"
    r"maxBytes\s+(?P<max>\d+)\s+step:\s*(?P<step>\d+)\((?P<steptype>\w+)\)\s+warmup iters:\s*"
    r"(?P<warmup>\d+)\s+iters:\s*(?P<iters>\d+)(?:\s+agg iters:\s*(?P<agg>\d+))?\s+"
    r"validation:\s*(?P<check>\d+)(?:\s+graph:\s*(?P<graph>\d+))?(?:\s+unalign:\s*\d+)?"
)
_VERSION = re.compile(
    r"^#\s*nccl-tests version\s+(?P<version>\S+)(?:\s+nccl-headers=(?P<headers>\d+))?"
    r"(?:\s+nccl-library=(?P<library>\d+))?"
)
_STARTING = re.compile(r"^#\s*Collective test starting:\s*(?P<program>\S+)")
_RCCL = re.compile(r"^rccl-tests: Version\s*(?P<version>\S*)")
_FOOTER_BW = re.compile(r"^#\s*Avg bus bandwidth\s*:\s*(?P<value>\S+)")
_FOOTER_OOB = re.compile(r"^#\s*Out of bounds values\s*:\s*(?P<value>\S+)")
_TIMESTAMP = re.compile(r"^\d{4}-\d{2}-\d{2}$")
#: What launchers put in front of every line: OpenMPI's ``--tag-output`` (``[1,0]<stdout>:``)
#: and Slurm's ``srun -l`` (``0: ``).
_PREFIX = re.compile(r"^(?:\[\d+,\d+\]<std(?:out|err)>:|\s*\d+: )")


def looks_like_log(text: str) -> bool:
    """True when ``text`` is the output of an nccl-tests or rccl-tests binary."""
    for raw in text.splitlines()[:400]:
        line = _PREFIX.sub("", raw).lstrip()
        if (
            _VERSION.match(line)
            or _STARTING.match(line)
            or _CONFIG.match(line)
            or _RCCL.match(line)
            or ("out-of-place" in line and line.startswith("#"))
            or (line.startswith("#") and "in-place" in line and "size" not in line)
        ):
            return True
    return False


def bus_factor(op: str, ranks: int) -> float:
    """nccl-tests' busbw / algbw for ``op`` on ``ranks`` ranks."""
    return float(_BUS[op](ranks))


def _op_from_name(name: str) -> str | None:
    """The op a binary or file name names (``all_reduce_perf``, ``allreduce_2node.log``)."""
    stem = Path(name).name.lower()
    squashed = re.sub(r"[^a-z]", "", stem)
    # longest names first: "reducescatter" before "reduce", "allreduce" before "reduce"
    candidates = sorted(
        [(op.replace("_", ""), op) for op in OPS]
        + [("alltoall", "all_to_all"), ("sendrecv", "send_recv")],
        key=lambda pair: -len(pair[0]),
    )
    for key, op in candidates:
        if key in squashed:
            return op
    return None


def _unmodelled_in(name: str) -> str | None:
    stem = re.sub(r"[^a-z]", "", Path(name).name.lower())
    for other in sorted(_UNMODELLED, key=len, reverse=True):
        if stem.startswith(other):
            return other
    return None


def _op_for(program: str | None, path: str, given: str | None = None) -> str:
    """The op of a log: its ``Collective test starting`` program, else ``given`` (the
    caller's ``--op``), else the file name."""
    if not program and given is not None:
        return given
    for source in (program, path):
        if not source:
            continue
        name = Path(source).name
        other = _unmodelled_in(name)
        if other:
            raise ConfigError(
                f"nccl-tests' {other} is not modelled by collsim (modelled: {', '.join(OPS)})",
                key_path="op",
                file=path,
            )
        op = canonical_op(name) or _op_from_name(name)
        if op is not None:
            return op
    raise ConfigError(
        "cannot tell the collective: the log has no 'Collective test starting' line (rccl-tests "
        "and older nccl-tests print none) and the file name names no op; give --op (e.g. "
        "--op all_reduce) or name the file after the binary, e.g. all_reduce_perf.log",
        key_path="op",
        file=path,
    )


def _group(hosts: list[str], ranks: int, path: str, line: int | None) -> tuple[int, int, list[str]]:
    """(nodes, ranks per node, host names in first-seen order) of the rank lines."""
    order: list[str] = []
    per: dict[str, int] = {}
    for host in hosts:
        if host not in per:
            order.append(host)
            per[host] = 0
        per[host] += 1
    nodes = max(1, len(order))
    counts = set(per.values()) or {ranks}
    if len(counts) != 1:
        raise ConfigError(
            "ranks are spread unevenly over the hosts ("
            + ", ".join(f"{h} {per[h]}" for h in order)
            + "); collsim models the same number of ranks on every node",
            file=path,
            line=line,
        )
    return nodes, ranks // nodes, order


def _footer_number(text: str, path: str, line: int) -> float:
    try:
        value = float(text)
    except ValueError:
        value = math.nan
    if not math.isfinite(value) or value < 0:
        raise ConfigError(
            f"must be a finite number >= 0, got {text}",
            key_path="Avg bus bandwidth",
            file=path,
            line=line,
        )
    return value


def _parse_row(
    tokens: list[str], width: int, path: str, line: int
) -> tuple[list[str], list[list[str]]]:
    """Preamble and blocks of one result row (``width`` numbers per block)."""
    if len(tokens) >= 2 and _TIMESTAMP.match(tokens[-2]):
        tokens = tokens[:-2]  # -S 1: a timestamp after the in-place block
    rest = tokens[5:]
    if len(tokens) < 5 or len(rest) not in (width, 2 * width):
        raise ConfigError(
            f"malformed nccl-tests row: expected 5 fields (size count type redop root) and "
            f"{width} per out-of-place and in-place block ({5 + width} or {5 + 2 * width} in "
            f"all), got {len(tokens)}: {' '.join(tokens)!r}",
            file=path,
            line=line,
        )
    return tokens[:5], [rest[i : i + width] for i in range(0, len(rest), width)]


@dataclass
class _LogScan:
    """What :func:`parse_log` has read of a text log so far."""

    meta: dict[str, Any] = field(default_factory=lambda: {"tool": "nccl-tests"})
    hosts: list[str] = field(default_factory=list)
    devices: list[str] = field(default_factory=list)
    ranks_seen: list[int] = field(default_factory=list)
    width: int = 4
    blocks: list[str] = field(default_factory=lambda: ["out_of_place", "in_place"])
    raw_rows: list[tuple[int, list[str], list[list[str]], str | None]] = field(default_factory=list)
    programs: list[str] = field(default_factory=list)
    earlier: list[tuple[int, int, int]] = field(default_factory=list)
    """(line, ranks, hosts) of runs appended before."""
    first_rank_line: int | None = None


def _scan_comment(scan: _LogScan, stripped: str, number: int, path: str) -> None:
    """Read one ``#`` line: the version, the program, the config, a rank, the column header
    or the footer."""
    meta = scan.meta
    if m := _VERSION.match(stripped):
        meta["nccl_tests_version"] = m["version"]
        if m["library"]:
            meta["nccl_version"] = int(m["library"])
    elif m := _STARTING.match(stripped):
        meta["program"] = m["program"]
        scan.programs.append(m["program"])
    elif m := _CONFIG.match(stripped):
        meta.update(
            nthreads=int(m["nthreads"]),
            ngpus=int(m["ngpus"]),
            min_bytes=int(m["min"]),
            max_bytes=int(m["max"]),
            warmup=int(m["warmup"]),
            iters=int(m["iters"]),
            agg_iters=int(m["agg"] or 1),
            validation=int(m["check"]),
            graph=int(m["graph"] or 0),
        )
        meta["step_factor" if m["steptype"] == "factor" else "step_bytes"] = int(m["step"])
    elif re.match(r"^#\s*Using devices", stripped):
        if scan.ranks_seen:  # another run's output appended: its own rank lines follow
            assert scan.first_rank_line is not None
            scan.earlier.append((scan.first_rank_line, len(scan.ranks_seen), len(set(scan.hosts))))
        scan.ranks_seen, scan.hosts, scan.devices, scan.first_rank_line = [], [], [], None
    elif m := _RANK.match(stripped):
        if scan.first_rank_line is None:
            scan.first_rank_line = number
        scan.ranks_seen.append(int(m["rank"]))
        scan.hosts.append(m["host"])
        scan.devices.append(m["name"].strip())
    elif "out-of-place" in stripped or "in-place" in stripped:
        scan.width = 8 if "per-iteration" in stripped else 4
        scan.blocks = ["out_of_place", "in_place"] if "out-of-place" in stripped else ["in_place"]
    elif "cputime" in stripped and "algbw" in stripped:
        meta["timing"] = "cputime"
    elif m := _FOOTER_BW.match(stripped):
        meta["avg_busbw_gbps"] = _footer_number(m["value"], path, number)
    elif m := _FOOTER_OOB.match(stripped):
        try:
            meta["out_of_bounds"] = int(m["value"])
        except ValueError:
            raise ConfigError(
                f"not an integer: {m['value']!r}",
                key_path="out_of_bounds",
                file=path,
                line=number,
            ) from None


def _scan_log(text: str, path: str) -> _LogScan:
    """Every line of the log read: metadata, ranks and the raw result rows."""
    scan = _LogScan()
    for number, line in enumerate(text.splitlines(), start=1):
        stripped = _PREFIX.sub("", line).strip()
        if not stripped:
            continue
        if stripped.startswith("#"):
            _scan_comment(scan, stripped, number, path)
            continue
        if m := _RCCL.match(stripped):
            scan.meta["tool"] = "rccl-tests"
            scan.meta["rccl_tests_version"] = m["version"]
            continue
        tokens = stripped.split()
        if not re.fullmatch(r"\d+", tokens[0]):
            continue  # NCCL INFO / WARN lines, launcher messages, an error string
        preamble, row_blocks = _parse_row(tokens, scan.width, path, number)
        scan.raw_rows.append((number, preamble, row_blocks, scan.meta.get("program")))
    return scan


def _log_shape(scan: _LogScan, path: str) -> tuple[int, int, int, list[str]]:
    """(ranks, nodes, ranks per node, host names) of the log, checked: rows, rank lines, no
    rank twice, and every appended run of the same shape."""
    if not scan.raw_rows:
        raise ConfigError("no result rows in this nccl-tests log", file=path)
    if not scan.ranks_seen:
        raise ConfigError(
            "no '#  Rank N ... on HOST device D' lines: cannot tell the number of ranks",
            file=path,
        )
    if len(set(scan.ranks_seen)) != len(scan.ranks_seen):
        raise ConfigError("a rank is listed twice", file=path, line=scan.first_rank_line)
    world = len(scan.ranks_seen)
    nodes, per_node, order = _group(scan.hosts, world, path, scan.first_rank_line)
    for line_no, ranks, num_hosts in scan.earlier:
        if (ranks, num_hosts) != (world, nodes):
            raise ConfigError(
                f"runs of {ranks} ranks on {num_hosts} host(s) and of {world} on {nodes} are "
                "appended in one log; give each shape its own file",
                file=path,
                line=line_no,
            )
    return world, nodes, per_node, order


def parse_log(text: str, path: str, op: str | None = None) -> Measurements:
    """Rows and metadata of an nccl-tests or rccl-tests text log (see docs/derivations.md).

    Rows carry the out-of-place block as ``time_us``, ``algbw_gbps``, ``busbw_gbps``,
    ``wrong`` and the in-place block as ``in_place_*``; a log with one block per row gives it
    as the main one (``metadata['blocks']`` says which). ``op`` (collsim's name) is the
    collective of a log that does not name its binary.

    Raises:
        ConfigError: a malformed row, a bad value, no rows, or no way to tell the op or the
            rank count (``file:line: column: message``).
    """
    scan = _scan_log(text, path)
    world, nodes, per_node, order = _log_shape(scan, path)
    meta, blocks, devices = scan.meta, scan.blocks, scan.devices
    ops = {program: _op_for(program, path) for program in scan.programs}
    given = op
    op = _op_for(meta.get("program"), path, given)
    meta.update(
        op=op,
        world_size=world,
        ranks_per_node=per_node,
        num_nodes=nodes,
        hosts=order,
        device=devices[0] if devices else "",
    )
    rows = []
    for number, pre, row_blocks, program in scan.raw_rows:
        names = blocks if len(row_blocks) == len(blocks) else ["in_place"]
        row_op = ops.get(program, op) if program else op  # logs of several binaries, appended
        row = _row(row_op, pre, row_blocks, names, world, nodes, meta, path, number)
        rows.append(row)
    meta["blocks"] = (
        ["out_of_place", "in_place"]
        if any("in_place_time_us" in r for r in rows)
        else ["out_of_place" if blocks[0] == "out_of_place" and len(blocks) == 1 else "in_place"]
    )
    kind = "rccl-tests" if meta["tool"] == "rccl-tests" else "nccl-tests"
    return Measurements(rows=rows, metadata=meta, path=path, kind=kind)


def _row(
    op: str,
    pre: list[str],
    row_blocks: list[list[str]],
    names: list[str],
    world: int,
    nodes: int,
    meta: dict[str, Any],
    path: str,
    line: int,
) -> dict[str, Any]:
    row: dict[str, Any] = {
        "op": op,
        "size_bytes": check_value("size_bytes", pre[0], file=path, line=line),
        "count": check_value("count", pre[1], file=path, line=line),
        "type": pre[2],
        "redop": pre[3],
        "root": check_value("root", pre[4], file=path, line=line),
    }
    for name, values in zip(names, row_blocks):
        prefix = "" if name == names[0] else "in_place_"
        time_us, algbw, busbw, wrong = values[:4]
        row[f"{prefix}time_us"] = check_value(f"{prefix}time_us", time_us, file=path, line=line)
        row[f"{prefix}algbw_gbps"] = check_value(f"{prefix}algbw_gbps", algbw, file=path, line=line)
        row[f"{prefix}busbw_gbps"] = check_value(f"{prefix}busbw_gbps", busbw, file=path, line=line)
        wrong = wrong.rstrip("*")
        if wrong.upper() != "N/A":
            row[f"{prefix}wrong"] = check_value(f"{prefix}wrong", wrong, file=path, line=line)
    row["world_size"] = world
    row["nodes"] = nodes
    if "iters" in meta:
        row["iters"] = meta["iters"]
    return row


def parse_json(doc: dict[str, Any], text: str, path: str) -> Measurements:
    """Rows and metadata of nccl-tests ``-J`` output (JSON_FILE_VERSION 3).

    Raises:
        ConfigError: a missing section or a bad value (``file:line: key: message``).
    """
    config = doc.get("config")
    results = doc.get("results")
    if not isinstance(config, dict) or not isinstance(results, list):
        raise ConfigError("nccl-tests JSON without 'config' and 'results'", file=path)
    args = doc.get("args") or []
    program = str(args[0]) if args else None
    op = _op_for(program, path)
    devices = config.get("devices") or []
    if not isinstance(devices, list) or not devices:
        raise ConfigError(
            "no devices: cannot tell the number of ranks", key_path="config.devices", file=path
        )
    per_process = _json_int(config, "nthreads", path) * _json_int(config, "ngpus", path)
    world = len(devices) * per_process
    hosts = [str(d.get("hostname", "")) for d in devices if isinstance(d, dict)]
    nodes, _, order = _group(hosts, len(hosts), path, None)
    meta: dict[str, Any] = {
        "tool": "nccl-tests",
        "program": program,
        "nccl_version": doc.get("nccl_version"),
        "json_version": doc.get("version"),
        "start_time": doc.get("start_time"),
        "iters": config.get("iterations"),
        "warmup": config.get("warmup_iters"),
        "validation": config.get("validation"),
        "op": op,
        "world_size": world,
        "ranks_per_node": world // nodes,
        "num_nodes": nodes,
        "hosts": order,
        "device": str(devices[0].get("device_info", "")) if isinstance(devices[0], dict) else "",
    }
    bandwidth = (doc.get("average_bus_bandwidth") or {}).get("bandwidth")
    if bandwidth is not None:
        meta["avg_busbw_gbps"] = bandwidth
    rows = []
    lines = _result_lines(text)
    for i, result in enumerate(results):
        line = lines[i] if i < len(lines) else 1
        if not isinstance(result, dict):
            raise ConfigError("expected an object", key_path=f"results[{i}]", file=path, line=line)
        row: dict[str, Any] = {"op": op}
        for key, column in (("size", "size_bytes"), ("count", "count"), ("root", "root")):
            row[column] = _json_value(result, key, column, path, line, i)
        row["type"] = str(result.get("type", ""))
        row["redop"] = str(result.get("redop", ""))
        blocks = [b for b in ("out_of_place", "in_place") if isinstance(result.get(b), dict)]
        if not blocks:
            raise ConfigError(
                "neither out_of_place nor in_place", key_path=f"results[{i}]", file=path, line=line
            )
        for block in blocks:
            prefix = "" if block == blocks[0] else "in_place_"
            body = result[block]
            time_key = "time" if "time" in body else "cpu_time"
            where = f"results[{i}].{block}"
            row[f"{prefix}time_us"] = _json_value(
                body, time_key, f"{prefix}time_us", path, line, i, where
            )
            row[f"{prefix}algbw_gbps"] = _json_value(
                body, "alg_bw", f"{prefix}algbw_gbps", path, line, i, where
            )
            row[f"{prefix}busbw_gbps"] = _json_value(
                body, "bus_bw", f"{prefix}busbw_gbps", path, line, i, where
            )
            if body.get("nwrong") is not None:
                row[f"{prefix}wrong"] = _json_value(
                    body, "nwrong", f"{prefix}wrong", path, line, i, where
                )
        row["world_size"] = world
        row["nodes"] = nodes
        if isinstance(result.get("actual_iterations"), int) and result["actual_iterations"] > 0:
            row["iters"] = result["actual_iterations"]
        rows.append(row)
    if not rows:
        raise ConfigError("no results in this nccl-tests JSON", file=path)
    return Measurements(rows=rows, metadata=meta, path=path, kind="nccl-tests-json")


def _json_int(section: dict[str, Any], key: str, path: str) -> int:
    value = section.get(key, 1)
    if not isinstance(value, int) or value < 1:
        raise ConfigError(
            f"must be an integer >= 1, got {value!r}", key_path=f"config.{key}", file=path
        )
    return value


def _json_value(
    obj: dict[str, Any],
    key: str,
    column: str,
    path: str,
    line: int,
    index: int,
    where: str | None = None,
) -> Any:
    if key not in obj:
        raise ConfigError(
            f"missing {key!r}", key_path=where or f"results[{index}]", file=path, line=line
        )
    return check_value(column, str(obj[key]).strip(), file=path, line=line)


def _result_lines(text: str) -> list[int]:
    """Line of each object in the ``results`` list (nccl-tests writes them on one line)."""
    start = text.find('"results"')
    if start < 0:
        return []
    out = []
    depth = 0
    bracket = text.find("[", start)
    for i in range(bracket + 1, len(text)):
        ch = text[i]
        if ch == "{":
            if depth == 0:
                out.append(text.count("\n", 0, i) + 1)
            depth += 1
        elif ch == "}":
            depth -= 1
        elif ch == "]" and depth == 0:
            break
    return out
