"""Write the nccl-tests fixtures of this folder (see README.md here): run from the repo root,
``PYTHONPATH=$PWD python tests/validate/data/make_nccltests_fixtures.py``.

The figures are not a measurement. They are collsim's closed form on a made-up cluster,
:data:`TRUTH` (a DGX H100 whose NVLink, NICs and software are slower than the shipped
``dgx_h100`` file says), with a deterministic +-1.5 % jitter per point, printed in the exact
formats of nccl-tests 2.19.6 (text and ``-J`` JSON, :mod:`collsim.validate.data.nccltests`) and of
rccl-tests. ``validate calibrate`` on them must find TRUTH again; ``validate compare`` judges.
"""

# ruff: noqa: UP031  (printf formats on purpose: they are the tools' own)
from __future__ import annotations

import random
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent

#: The made-up cluster's figures that differ from topologies/dgx_h100.yaml.
TRUTH = {
    "intra_node.efficiency": 0.60,
    "intra_node.latency_us": 0.5,
    "nics.efficiency": 0.65,
    "nics.latency_us": 6.0,
    "collectives.overhead_us": 8.0,
}

#: Host names of the two nodes (nccl-tests prints the short host name, %10s).
HOSTS = ("dgxh100-01", "dgxh100-02")

DEVICE = "NVIDIA H100 80GB HBM3"

#: Jitter of every time, +- this share (a quiet cluster's run-to-run spread).
JITTER = 0.015


def truth_topology(nodes: int) -> Any:
    """TRUTH applied to topologies/dgx_h100.yaml, sized to ``nodes`` nodes."""
    from collsim.cluster.topology import parse_topology, resolve_topology_path
    from collsim.core.yamlio import load_yaml

    doc = load_yaml(resolve_topology_path("dgx_h100"))
    data = {k: (dict(v) if isinstance(v, dict) else v) for k, v in doc.data.items()}
    for dotted, value in TRUTH.items():
        section, key = dotted.split(".")
        data[section][key] = value
    doc.data = data
    return parse_topology(doc, nodes=nodes)


def rows_for(op: str, nodes: int, sizes: list[int], seed: int) -> list[dict[str, Any]]:
    """nccl-tests rows of ``op`` on ``nodes`` TRUTH nodes (float, sum or none)."""
    from collsim.collectives import Group, cost
    from collsim.core.vocab import NCCL_TESTS_TYPE_BYTES

    group = Group.all(truth_topology(nodes))
    n = group.size
    rng = random.Random(seed)
    split = op in ("all_gather", "reduce_scatter", "all_to_all")
    rows = []
    for size in sizes:
        t_us = cost(op, size, group).time_s * 1e6
        rows.append(
            {
                "size_bytes": size,
                "count": size // NCCL_TESTS_TYPE_BYTES["float"] // (n if split else 1),
                "type": "float",
                "redop": "sum" if op in ("all_reduce", "reduce_scatter", "reduce") else "none",
                "root": 0 if op in ("broadcast", "reduce") else -1,
                "time_us": t_us * (1 + rng.uniform(-JITTER, JITTER)),
                "in_place_time_us": t_us * (1 + rng.uniform(-JITTER, JITTER)),
                "wrong": 0,
                "in_place_wrong": 0,
            }
        )
    return rows


def _rccl_time(t_us: float) -> str:
    """rccl-tests' time column: %7.0f from 10 ms, %7.1f from 100 us, else %7.2f."""
    if t_us >= 10000.0:
        return "%7.0f" % t_us
    if t_us >= 100.0:
        return "%7.1f" % t_us
    return "%7.2f" % t_us


def rccl_log(text: str, rows: list[dict[str, Any]]) -> str:
    """``rows`` as rccl-tests (ROCm/rccl-tests ae3e635, src/common.cu) prints them, with the
    comment and device lines of the nccl-tests log ``text``: no version or 'starting' lines, a
    'rccl-tests: Version' line, rank lines without Group, its own column header spacing, the
    time as %7.0f/%7.1f/%7.2f, algbw and busbw as %6.2f, #wrong as %5g, the asterisk note
    before the footer and the (empty) last-error line after it."""
    import re

    from collsim.validate.data.nccltests import bus_factor

    out = []
    ranks = sum(1 for line in text.splitlines() if line.startswith("#  Rank"))
    for line in text.splitlines():
        if line.startswith("# nccl-tests version") or line.startswith("# Collective test"):
            continue
        if line.startswith("# Using devices"):
            out += ["rccl-tests: Version develop:ae3e635", line]
            continue
        m = re.match(r"^#  Rank (..) Group .. Pid (.{6}) on (.{10}) device (..) \[.*\] (.*)$", line)
        if m:
            bus = f"0000:{0x18 + 0x11 * int(m[4]):02x}:00.0"
            out.append(f"#   Rank {m[1]} Pid {m[2]} on {m[3]} device {m[4]} [{bus}] {m[5]}")
            continue
        if line.startswith("#       size"):
            out.append(
                "# %10s  %12s  %8s  %6s  %6s  %7s  %6s  %6s %6s  %7s  %6s  %6s %6s"
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
                )
            )
            continue
        if line.startswith("#        (B)"):
            out.append(
                "# %10s  %12s  %8s  %6s  %6s  %7s  %6s  %6s  %5s  %7s  %6s  %6s  %5s"
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
                )
            )
            continue
        if line.startswith("# Out of bounds"):
            out.append(
                "# Errors with asterisks indicate errors that have exceeded the maximum threshold."
            )
        if line.startswith("# Collective test concluded"):
            continue
        if line and not line.startswith("#"):
            continue  # rows are printed from ``rows`` below, in place of the first one
        out.append(line)
    body = []
    for r in rows:
        line = "%12li  %12li  %8s  %6s  %6s" % (
            r["size_bytes"],
            r["count"],
            r["type"],
            r["redop"],
            "%6i" % r["root"],
        )
        for prefix in ("", "in_place_"):
            t = r[f"{prefix}time_us"]
            algbw = r["size_bytes"] / 1e9 / (t * 1e-6)
            busbw = algbw * bus_factor("all_reduce", ranks)
            line += "  %7s  %6.2f  %6.2f  %5g" % (_rccl_time(t), algbw, busbw, r[f"{prefix}wrong"])
        body.append(line)
    at = next(i for i, line in enumerate(out) if line.startswith("# Errors with asterisks"))
    while out and out[-1] in ("", "#"):
        out.pop()  # nccl-tests' finalizeFooter and writeErrors lines
    out.append("#")
    return "\n".join(out[:at] + body + out[at:]) + "\n\n"  # then the empty last error


def main() -> None:
    from collsim.validate.data.nccltests_format import format_json, format_log

    note = (
        "Test fixture written by tests/validate/data/make_nccltests_fixtures.py: collsim's\n"
        "closed form on a made-up cluster (TRUTH there), not a measurement, in nccl-tests\n"
        "2.19.6's printed format."
    )
    specs = [
        ("all_reduce_perf", 1, 8, 8 << 30, 11),
        ("all_reduce_perf", 2, 8, 8 << 30, 12),
        ("all_gather_perf", 1, 1024, 8 << 30, 13),
        ("all_gather_perf", 2, 1024, 8 << 30, 14),
    ]
    for program, nodes, low, high, seed in specs:
        sizes = []
        size = low
        while size <= high:
            sizes.append(size)
            size *= 2
        rows = rows_for(program.removesuffix("_perf"), nodes, sizes, seed)
        shape = dict(
            hosts=list(HOSTS[:nodes]),
            ranks_per_node=8,
            device_name=DEVICE,
            min_bytes=low,
            max_bytes=high,
        )
        stem = f"{program}_{nodes}node"
        text = format_log(program, rows, comment=note, **shape)  # type: ignore[arg-type]
        (HERE / f"{stem}.log").write_text(text)
        if program == "all_reduce_perf":
            (HERE / f"{stem}.json").write_text(
                format_json(program, rows, **shape) + "\n"  # type: ignore[arg-type]
            )
        if program == "all_reduce_perf" and nodes == 1:
            (HERE / "rccl_all_reduce_1node.log").write_text(rccl_log(text, rows))


if __name__ == "__main__":
    main()
