"""Write nccl-tests and rccl-tests output (text logs and ``-J`` JSON) from collsim measurements,
in the formats :mod:`collsim.validate.data.nccltests` reads, so that a simulated or measured
sweep can be laid beside a real nccl-tests run (formats and sources: docs/derivations.md,
``collsim.validate.data.nccltests``).
"""

# ruff: noqa: UP031  (printf formats on purpose: they are nccl-tests' own, src/util.cu)
from __future__ import annotations

import math
from typing import Any

from collsim.validate.data.nccltests import _op_for, bus_factor

__all__ = ["float_str", "format_log", "format_json"]


def float_str(value: float, width: int) -> str:
    """nccl-tests' ``getFloatStr``: ``%.2f``, else ``%.1f``, ``%.0f``, then ``%.1e`` (width >=
    7) or ``%.0e``, the first that fits in ``width`` characters (src/util.cu)."""
    for fmt in (f"%{width}.2f", f"%{width}.1f", f"%{width}.0f"):
        text = fmt % value
        if len(text) <= width:
            return text
    return (f"%{width}.1e" if width >= 7 else f"%{width}.0e") % value


def _g(value: float) -> str:
    return "%6g" % value


def _log_device_lines(hosts: list[str], ranks_per_node: int, device_name: str) -> list[str]:
    """The ``#  Rank ...`` lines of a log, ``ranks_per_node`` ranks on each host in turn."""
    out = []
    rank = 0
    for node, host in enumerate(hosts):
        for local in range(ranks_per_node):
            out.append(
                "#  Rank %2d Group %2d Pid %6d on %10s device %2d [%04x:%02x:%02x] %s"
                % (
                    rank,
                    0,
                    4000 + 97 * node + local,
                    host,
                    local,
                    0,
                    0x18 + 0x11 * local,
                    0,
                    device_name,
                )
            )
            rank += 1
    return out


def _log_column_header() -> list[str]:
    """The three lines above the result rows (block names, column names, units)."""
    row = "# %10s  %12s  %8s  %6s  %6s  %7s  %6s  %6s  %6s  %7s  %6s  %6s  %6s %*s"
    return [
        "# %10s  %12s  %8s  %6s  %6s           out-of-place"
        "                       in-place          " % ("", "", "", "", ""),
        row
        % (
            "size",
            "count",
            "type",
            "redop",
            "root",
            "time",
            "algbw",
            "busbw",
            "#wrong",
            "time",
            "algbw",
            "busbw",
            "#wrong",
            0,
            "",
        ),
        row
        % (
            "(B)",
            "(elements)",
            "",
            "",
            "",
            "(us)",
            "(GB/s)",
            "(GB/s)",
            "",
            "(us)",
            "(GB/s)",
            "(GB/s)",
            "",
            0,
            "",
        ),
    ]


def _log_row(r: dict[str, Any], op: str, ranks: int) -> tuple[str, list[float], list[int]]:
    """One result row of a log, and the busbw and #wrong of its out-of-place and in-place
    blocks (in that order)."""
    line = "%12li  %12li  %8s  %6s  %6s" % (
        r["size_bytes"],
        r["count"],
        r["type"],
        r["redop"],
        "%6i" % r["root"],
    )
    busbws: list[float] = []
    wrongs: list[int] = []
    for prefix in ("", "in_place_"):
        t = float(r[f"{prefix}time_us"])
        algbw = r["size_bytes"] / 1e9 / (t * 1e-6)
        busbw = algbw * bus_factor(op, ranks)
        wrong = int(r.get(f"{prefix}wrong", 0))
        wrongs.append(wrong)
        busbws.append(busbw)
        line += "  %7s  %6s  %6s  %6s" % (
            float_str(t, 7),
            float_str(algbw, 6),
            float_str(busbw, 6),
            _g(wrong),
        )
    return line, busbws, wrongs


def format_log(
    program: str,
    rows: list[dict[str, Any]],
    *,
    hosts: list[str],
    ranks_per_node: int,
    device_name: str,
    min_bytes: int,
    max_bytes: int,
    step_factor: int = 2,
    warmup: int = 5,
    iters: int = 20,
    version: str = "2.19.6",
    nccl_version: int = 22807,
    comment: str = "",
) -> str:
    """An nccl-tests 2.19.6 text log of ``rows`` (each with ``size_bytes``, ``count``,
    ``type``, ``redop``, ``root``, ``time_us``, ``in_place_time_us``, ``wrong``,
    ``in_place_wrong``), printed with the printf formats of src/util.cu; algbw and busbw are
    computed from the size and times as nccl-tests does. ``comment`` lines go first, ``#``-
    prefixed (nccl-tests prints none; its readers skip ``#`` lines)."""
    op = _op_for(program, program)
    ranks = len(hosts) * ranks_per_node
    out = [f"# {c}" if c else "#" for c in comment.splitlines()]
    out.append(
        f"# nccl-tests version {version} nccl-headers={nccl_version} nccl-library={nccl_version}"
    )
    out.append(f"# Collective test starting: {program}")
    out.append(
        f"# nThread 1 nGpus 1 minBytes {min_bytes} maxBytes {max_bytes} step: "
        f"{step_factor}(factor) warmup iters: {warmup} iters: {iters} agg iters: 1 "
        f"validation: 1 graph: 0 unalign: 0"
    )
    out.append("#")
    out.append("# Using devices")
    out += _log_device_lines(hosts, ranks_per_node, device_name)
    out.append("#")
    out += _log_column_header()
    bw_sum = 0.0
    wrong_total = 0
    for r in rows:
        line, busbws, wrongs = _log_row(r, op, ranks)
        for busbw, wrong in zip(busbws, wrongs):
            wrong_total += wrong
            bw_sum += busbw
        out.append(line)
    avg = bw_sum / (2 * len(rows)) if rows else 0.0
    out.append(
        "# %-20s : %d %s" % ("Out of bounds values", wrong_total, "FAILED" if wrong_total else "OK")
    )
    out.append("# %-20s : %g %s" % ("Avg bus bandwidth", avg, ""))
    out.append("#")
    out.append(f"# Collective test concluded: {program}")
    out.append("#")  # finalizeFooter
    out.append("")  # writeErrors with no error: an empty line
    out.append("")
    return "\n".join(out)


def _jnum(value: float) -> str:
    return '"nan"' if math.isnan(value) else "%f" % value


def format_json(
    program: str,
    rows: list[dict[str, Any]],
    *,
    hosts: list[str],
    ranks_per_node: int,
    device_name: str,
    min_bytes: int,
    max_bytes: int,
    step_factor: int = 2,
    warmup: int = 5,
    iters: int = 20,
    nccl_version: int = 22807,
    start_time: str = "2026-01-01 00:00:00",
    end_time: str = "2026-01-01 00:00:01",
) -> str:
    """nccl-tests ``-J`` output of ``rows`` as src/util.cu writes it: one line, no spaces,
    ``%lf`` numbers, one device entry per process (one process per rank here, as under
    ``mpirun -np RANKS ... -g 1``), and ``errors`` holding ncclGetLastError's empty string."""
    op = _op_for(program, program)
    ranks = len(hosts) * ranks_per_node
    parts = [
        f'{{"version":3,"start_time":"{start_time}","args":["{program}","-b","{min_bytes}",'
        f'"-e","{max_bytes}","-f","{step_factor}","-g","1","-J","out.json"],"env":[],'
        f'"nccl_version":{nccl_version},"config":{{"nthreads":1,"ngpus":1,'
        f'"minimum_bytes":{min_bytes},"maximum_bytes":{max_bytes},"step_factor":{step_factor},'
        f'"warmup_iters":{warmup},"iterations":{iters},"aggregated_iterations":1,'
        f'"validation":1,"graph":0,"blocking_collectives":"false","per_iter_timing":"false",'
        f'"per_iter_skip":0,"parallel_init":"false","devices":['
    ]
    devices = []
    rank = 0
    for node, host in enumerate(hosts):
        for local in range(ranks_per_node):
            devices.append(
                f'{{"rank":{rank},"group":0,"pid":{4000 + 97 * node + local},'
                f'"hostname":"{host}","device":{local},'
                f'"device_hex":"0000:{0x18 + 0x11 * local:02x}:00","device_info":"{device_name}"}}'
            )
            rank += 1
    parts.append(",".join(devices) + ']},"results":[')
    results = []
    bw_sum = 0.0
    wrong_total = 0
    for r in rows:
        body = (
            f'{{"size":{r["size_bytes"]},"count":{r["count"]},"type":"{r["type"]}",'
            f'"redop":"{r["redop"]}","root":"{"%6i" % r["root"]}"'
        )
        for block, prefix in (("out_of_place", ""), ("in_place", "in_place_")):
            t = float(r[f"{prefix}time_us"])
            algbw = r["size_bytes"] / 1e9 / (t * 1e-6)
            busbw = algbw * bus_factor(op, ranks)
            wrong = int(r.get(f"{prefix}wrong", 0))
            wrong_total += wrong
            bw_sum += busbw
            body += (
                f',"{block}":{{"time":{_jnum(t)},"alg_bw":{_jnum(algbw)},'
                f'"bus_bw":{_jnum(busbw)},"nwrong":{_jnum(float(wrong))}}}'
            )
        body += f',"actual_iterations":{iters},"experiment_name":""}}'
        results.append(body)
    avg = bw_sum / (2 * len(rows)) if rows else 0.0
    parts.append(",".join(results))
    parts.append(
        f'],"out_of_bounds":{{"count":{wrong_total},"okay":"{str(wrong_total == 0).lower()}"}},'
        f'"average_bus_bandwidth":{{"bandwidth":{_jnum(avg)},"okay":"unchecked"}},'
        f'"errors":[""],"end_time":"{end_time}"}}'
    )
    return "".join(parts)
