"""Fit a topology to measured collectives: link latency and bandwidth, and per op the algorithm,
a fixed overhead and an efficiency, so that collsim's own cost formula reproduces the times.

Derivations, measurements and sources: docs/derivations.md, ``collsim.validate.fit.calibrate``.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from collsim.cluster.topology import load_topology, parse_topology, resolve_topology_path
from collsim.collectives import Group, phases_for, supported
from collsim.core.errors import ConfigError
from collsim.core.vocab import Algorithm, CollectiveOp
from collsim.core.yamlio import load_yaml
from collsim.validate.data.dataset import Measurements
from collsim.validate.fit.numerics import (
    KNEE_ALPHA,
    RegimeFit,
    fit_line,
    fit_two_regime,
)

__all__ = [
    "OpFit",
    "Calibration",
    "select_rows",
    "calibrate",
    "topology_yaml",
    "write_topology",
    "SUBSETS",
]

#: ``all`` sizes, or every other power of two: ``even`` (2^10, 2^12, ...) or ``odd``.
SUBSETS = ("all", "even", "odd")


_PROBE_LATENCY_S = 1e-6
_PROBE_BANDWIDTH_BPS = 1e9


@dataclass(frozen=True, slots=True, kw_only=True)
class OpFit:
    """The fit of one op."""

    op: str
    algorithm: str
    intercept_s: float
    """a of time = a + b x size."""
    seconds_per_byte: float
    """b of time = a + b x size."""
    overhead_s: float
    efficiency: float
    latency_steps: float
    """k_lat: link latencies paid per collective under the algorithm."""
    bytes_factor: float
    """k_bw: bytes on the busiest link per byte of size under the algorithm."""
    num_points: int
    fit_median_abs_error: float
    """Median |relative residual| of the fitted model (line, or line with its knee) on the
    points it was fitted to."""
    kernels: tuple[str, ...] = ()
    line_median_abs_error: float = 0.0
    """The same for the plain line (what the knee had to halve)."""
    knee_bytes: float | None = None
    """K of the second regime, or None (one line)."""
    extra_seconds_per_byte: float = 0.0
    """c: added to b for every byte above the knee."""
    knee_efficiency: float | None = None
    """The op's efficiency for the bytes above the knee (<= ``efficiency``)."""


@dataclass
class Calibration:
    """A fitted topology: link latency and bandwidth, and per-op fits."""

    world_size: int
    ranks_per_node: int
    link_latency_s: float
    link_bandwidth_bps: float
    ops: dict[str, OpFit]
    base: str
    subset: str
    source: str
    metadata: dict[str, Any] = field(default_factory=dict)
    notes: list[str] = field(default_factory=list)


def _log2_parity(size_bytes: int) -> int | None:
    """0 for even powers of two, 1 for odd, None for sizes that are not near a power of two."""
    if size_bytes <= 0:
        return None
    exp = math.log2(size_bytes)
    nearest = round(exp)
    # Split ops round the count down to a multiple of n: still within 1% of the power of two.
    if abs(size_bytes - 2**nearest) > 0.01 * 2**nearest:
        return None
    return nearest % 2


def select_rows(
    rows: list[dict[str, Any]],
    subset: str = "all",
    *,
    min_bytes: int = 0,
    max_bytes: int | None = None,
    ops: tuple[str, ...] | None = None,
) -> list[dict[str, Any]]:
    """Rows whose size is in ``subset`` and [min_bytes, max_bytes], for ``ops`` (all if None).

    Raises:
        ConfigError: unknown subset.
    """
    if subset not in SUBSETS:
        raise ConfigError(
            f"must be one of {', '.join(SUBSETS)}; got {subset!r}", key_path="--subset"
        )
    out = []
    for row in rows:
        size = int(row["size_bytes"])
        if size < min_bytes or (max_bytes is not None and size > max_bytes):
            continue
        if ops is not None and row["op"] not in ops:
            continue
        if subset != "all":
            parity = _log2_parity(size)
            if parity is None or parity != (0 if subset == "even" else 1):
                continue
        out.append(row)
    return out


def _probe_topology(base: str, ranks_per_node: int, num_nodes: int) -> Any:
    """The base topology with probe link figures, zero overhead and no per-op settings."""

    doc = load_yaml(resolve_topology_path(base))
    data = _probe_data(dict(doc.data))
    doc.data = data
    return parse_topology(doc, nodes=num_nodes, gpus_per_node=ranks_per_node)


def _probe_data(data: dict[str, Any]) -> dict[str, Any]:
    intra = dict(data["intra_node"])
    intra.update(
        bandwidth_gbps=_PROBE_BANDWIDTH_BPS / 1e9, latency_us=_PROBE_LATENCY_S * 1e6, efficiency=1.0
    )
    data["intra_node"] = intra
    coll = dict(data.get("collectives") or {})
    coll["overhead_us"] = 0.0
    coll.pop("ops", None)
    coll.pop("algorithms", None)
    data["collectives"] = coll
    return data


def _coefficients(topology: Any, op: str) -> dict[str, tuple[float, float]]:
    """(k_lat, k_bw) per algorithm that can run ``op`` on the whole topology (gloo: no NVLS)."""

    group = Group.all(topology)
    out: dict[str, tuple[float, float]] = {}
    for algorithm in supported(CollectiveOp(op)):
        if algorithm is Algorithm.NVLS:
            continue
        try:
            timing = phases_for(CollectiveOp(op), group, algorithm).timings[0]
        except ConfigError:
            continue  # not on this group
        out[algorithm.value] = (
            timing.latency_s / _PROBE_LATENCY_S,
            timing.seconds_per_byte * _PROBE_BANDWIDTH_BPS,
        )
    return out


#: What gloo runs when nothing else is known (gloo/allreduce.cc ring, allgather.cc ring,
#: alltoall.cc pairwise): ring for reductions and gathers, direct for all_to_all and send_recv.
PREFERRED = ("ring", "direct", "tree", "halving_doubling", "hierarchical")


def _preferred(op: str, options: dict[str, float]) -> str:
    for name in PREFERRED:
        if name in options:
            return name
    return next(iter(options))


def _world_size_of(meas: Measurements, rows: list[dict[str, Any]]) -> int:
    """The one world size of the selected rows; none of them may have wrong results."""
    sizes = {int(r["world_size"]) for r in rows}
    if len(sizes) != 1:
        raise ConfigError(
            f"need one world size per calibration, got {sorted(sizes)}", file=meas.path
        )
    bad = [r for r in rows if int(r.get("wrong", 0) or 0) > 0]
    if bad:
        raise ConfigError(
            f"{len(bad)} measured point(s) have wrong results "
            f"(e.g. {bad[0]['op']} {bad[0]['size_bytes']} B)",
            file=meas.path,
        )
    return sizes.pop()


def _chosen_algorithms(
    implied: dict[str, dict[str, float]], algorithms: dict[str, str] | None, n: int
) -> dict[str, str]:
    """Per op the pinned algorithm (checked against those that run it), else the preferred."""
    chosen: dict[str, str] = {}
    for op, options in implied.items():
        pinned = (algorithms or {}).get(op)
        if pinned is not None and pinned not in options:
            raise ConfigError(
                f"{pinned} cannot run {op} on {n} ranks; choose from {', '.join(options)}",
                key_path=f"--algorithm {op}",
            )
        chosen[op] = pinned or _preferred(op, options)
    return chosen


def _op_fit(
    op: str,
    alg: str,
    regime: RegimeFit,
    count: int,
    *,
    k_lat: float,
    k_bw: float,
    latency_s: float,
    efficiency: float,
    kernels: tuple[str, ...],
) -> OpFit:
    """One op's fit: its line (and knee) and what the shared link figures leave to it."""
    a, b, err = regime.intercept_s, regime.seconds_per_byte, regime.median_abs_error
    return OpFit(
        op=op,
        algorithm=alg,
        intercept_s=a,
        seconds_per_byte=b,
        overhead_s=max(0.0, a - k_lat * latency_s),
        efficiency=efficiency,
        latency_steps=k_lat,
        bytes_factor=k_bw,
        num_points=count,
        fit_median_abs_error=err,
        kernels=kernels,
        line_median_abs_error=regime.line_median_abs_error,
        knee_bytes=regime.knee_bytes,
        extra_seconds_per_byte=regime.extra_seconds_per_byte,
        knee_efficiency=(
            None
            if regime.knee_bytes is None
            else efficiency * b / (b + regime.extra_seconds_per_byte)
        ),
    )


def calibrate(
    meas: Measurements,
    *,
    base: str = "localhost",
    subset: str = "all",
    min_bytes: int = 0,
    max_bytes: int | None = None,
    algorithms: dict[str, str] | None = None,
    knees: bool = True,
    knee_alpha: float = KNEE_ALPHA,
) -> Calibration:
    """Fit the topology ``base`` to the measurements (see docs/derivations.md).

    Args:
        meas: measured points with metadata (one world size).
        base: topology file or name whose shape (interconnect, device) is kept.
        subset: sizes to fit on: ``all``, ``even`` or ``odd`` powers of two.
        min_bytes: ignore smaller sizes.
        max_bytes: ignore larger sizes.
        algorithms: pin the algorithm of some ops (``{"broadcast": "tree"}``).
        knees: allow an op a knee (second regime) when it earns it; False: one line per op.
        knee_alpha: significance level of the F-test a knee must pass.

    Raises:
        ConfigError: mixed world sizes, an op with fewer than two sizes, or wrong results in
            the data (a measurement with #wrong > 0 is not a measurement).
    """
    rows = select_rows(meas.rows, subset, min_bytes=min_bytes, max_bytes=max_bytes)
    n = _world_size_of(meas, rows)
    ranks_per_node = int(meas.metadata.get("ranks_per_node", n))
    num_nodes = max(1, n // ranks_per_node)
    probe = _probe_topology(base, ranks_per_node, num_nodes)
    kernels = meas.metadata.get("kernels") or {}
    regimes: dict[str, RegimeFit] = {}
    coeffs: dict[str, dict[str, tuple[float, float]]] = {}
    counts: dict[str, int] = {}
    for op in [o for o in meas.ops() if any(r["op"] == o for r in rows)]:
        pts = [r for r in rows if r["op"] == op]
        sizes_b = [float(r["size_bytes"]) for r in pts]
        times = [float(r["time_us"]) * 1e-6 for r in pts]
        if knees:
            fit = fit_two_regime(sizes_b, times, alpha=knee_alpha)
        else:
            a, b, err = fit_line(sizes_b, times)
            fit = RegimeFit(a, b, err, err)
        regimes[op] = fit
        counts[op] = len(pts)
        coeffs[op] = _coefficients(probe, op)
    if not regimes:
        raise ConfigError("no measured points in the selected sizes", file=meas.path)
    implied = {
        op: {alg: kb / regimes[op].seconds_per_byte for alg, (_, kb) in algs.items()}
        for op, algs in coeffs.items()
    }
    chosen = _chosen_algorithms(implied, algorithms, n)
    bandwidth = max(implied[op][chosen[op]] for op in chosen)
    with_steps = [
        regimes[op].intercept_s / coeffs[op][chosen[op]][0]
        for op in chosen
        if coeffs[op][chosen[op]][0] > 0
    ]
    latency = min(with_steps) if with_steps else 0.0
    fits: dict[str, OpFit] = {}
    for op, alg in chosen.items():
        k_lat, k_bw = coeffs[op][alg]
        fits[op] = _op_fit(
            op,
            alg,
            regimes[op],
            counts[op],
            k_lat=k_lat,
            k_bw=k_bw,
            latency_s=latency,
            efficiency=min(1.0, implied[op][alg] / bandwidth),
            kernels=tuple(kernels.get(op, ())),
        )
    notes = _notes(fits, kernels)
    return Calibration(
        world_size=n,
        ranks_per_node=ranks_per_node,
        link_latency_s=latency,
        link_bandwidth_bps=bandwidth,
        ops=fits,
        base=base,
        subset=subset,
        source=meas.path,
        metadata=dict(meas.metadata),
        notes=notes,
    )


def _notes(fits: dict[str, OpFit], kernels: dict[str, list[str]]) -> list[str]:
    notes = []
    for op, names in kernels.items():
        ran = sorted({name.split(":", 1)[-1] for name in names})
        if (
            op in ("reduce_scatter", "all_gather", "broadcast", "all_reduce", "all_to_all")
            and ran
            and op not in ran
        ):
            notes.append(
                f"{op}: the backend ran {', '.join(names)} (the profiler shows no "
                f"{op} kernel), so its fitted efficiency covers that extra traffic"
            )
    if "reduce_scatter" in fits and "all_reduce" in fits:
        rs, ar = fits["reduce_scatter"], fits["all_reduce"]
        notes.append(
            f"reduce_scatter takes {rs.seconds_per_byte / ar.seconds_per_byte:.2f} x "
            f"all_reduce's time per byte of the same input"
        )
    return notes


def _yaml_float(value: float) -> str:
    """``value`` to 6 significant digits as YAML reads a float back: ``5e+08`` is a string to
    YAML 1.1 (PyYAML), ``5.0e+08`` a number."""
    text = f"{value:.6g}"
    if "e" in text and "." not in text:
        text = text.replace("e", ".0e")
    return text


def topology_yaml(cal: Calibration, name: str) -> str:
    """The calibrated topology as YAML text (the base file's shape, fitted figures)."""

    base = load_yaml(resolve_topology_path(cal.base)).data
    intra = dict(base["intra_node"])
    md = cal.metadata
    lines = [
        f"# Calibrated by `collsim validate calibrate` from {cal.source}",
        f"# measured: backend {md.get('backend')}, world size {cal.world_size}, "
        f"{cal.ranks_per_node} ranks per node, torch {md.get('torch_version')}, "
        f"host {md.get('host')}, {md.get('date')}",
        f"# fitted on sizes: {cal.subset}; per op: time = overhead + steps x latency "
        f"+ size x bytes_factor / (bandwidth x efficiency)",
    ]
    if any(fit.knee_bytes is not None for fit in cal.ops.values()):
        lines.append("# with a knee: the bytes above knee_bytes at knee_efficiency instead")
    lines += [f"# note: {note}" for note in cal.notes]
    lines += [
        f"name: {name}",
        f"description: {json.dumps(str(base.get('description', '')) + ' (calibrated)')}",
        f"device: {base['device']}",
        f"nodes: {max(1, cal.world_size // cal.ranks_per_node)}",
        f"gpus_per_node: {cal.ranks_per_node}",
        "intra_node:",
        f"  interconnect: {intra['interconnect']}",
        f"  bandwidth_gbps: {_yaml_float(cal.link_bandwidth_bps / 1e9)}",
        "  efficiency: 1.0",
        f"  latency_us: {_yaml_float(cal.link_latency_s * 1e6)}",
        f"  nvls: {str(bool(intra.get('nvls', False))).lower()}",
    ]
    if "host" in base:
        lines += ["host:", f"  bandwidth_gbps: {base['host'].get('bandwidth_gbps', 32.0)}"]
    overheads = [f.overhead_s for f in cal.ops.values()]
    library = (base.get("collectives") or {}).get("library", "gloo")
    lines += [
        "collectives:",
        f"  library: {library}",
        f"  overhead_us: {_yaml_float(min(overheads) * 1e6)}",
        "  algorithms:",
    ]
    lines += [f"    {op}: {fit.algorithm}" for op, fit in cal.ops.items()]
    lines.append("  ops:")
    for op, fit in cal.ops.items():
        kern = f"  # ran {', '.join(fit.kernels)}" if fit.kernels else ""
        knee = ""
        if fit.knee_bytes is not None and fit.knee_efficiency is not None:
            knee_eff = _yaml_float(fit.knee_efficiency)
            knee = f", knee_bytes: {fit.knee_bytes:.0f}, knee_efficiency: {knee_eff}"
        lines.append(
            f"    {op}: {{overhead_us: {_yaml_float(fit.overhead_s * 1e6)}, "
            f"efficiency: {_yaml_float(fit.efficiency)}{knee}}}{kern}"
        )
    return "\n".join(lines) + "\n"


def write_topology(cal: Calibration, path: str | Path, name: str | None = None) -> Path:
    """Write the calibrated topology and check that it loads back."""

    out = Path(path)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(topology_yaml(cal, name or out.stem))
    load_topology(out)
    return out
