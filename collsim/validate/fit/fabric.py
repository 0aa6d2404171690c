"""Fit a multi-node topology to nccl-tests (or rccl-tests) runs on one node and on several: the
intra-node link and the library's fixed cost from one-node data, the NICs and the transport's
own terms from multi-node data, through collsim's own cost of every measured point.

Derivations, measurements and sources: docs/derivations.md, ``collsim.validate.fit.calibrate``.
"""

from __future__ import annotations

import itertools
import math
import statistics
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from collsim.cluster.topology import load_topology, parse_topology, resolve_topology_path
from collsim.collectives import Group, cost
from collsim.core.errors import ConfigError
from collsim.core.yamlio import load_yaml
from collsim.validate.data.dataset import Measurements
from collsim.validate.fit.numerics import (
    f_critical,
    nelder_mead,
)

__all__ = [
    "FabricCalibration",
    "FileFit",
    "base_for_device",
    "calibrate_fabric",
    "fabric_yaml",
    "write_fabric_topology",
]


#: Figures a fabric calibration fits, by stage: one-node data fit the NVLink (or PCIe) link
#: and the library's fixed cost; multi-node data fit the NICs. Each is a (section, key) of the
#: topology file.
INTRA_PARAMETERS = (
    ("intra_node", "efficiency"),
    ("intra_node", "latency_us"),
    ("collectives", "overhead_us"),
)
NETWORK_PARAMETERS = (("nics", "efficiency"), ("nics", "latency_us"))
#: The transport's own terms (collsim.cluster.transports), fitted on multi-node data where the
#: base's
#: transport has them (a plugin latency or a completion cost: EFA, TCPXO); InfiniBand's and
#: RoCE's are NCCL's own NET row, which the fit leaves to the links.
TRANSPORT_PARAMETERS = (("fabric", "net_latency_us"), ("fabric", "completion_us"))

#: Significance of the F-test that lets fitted transport terms replace the base's.
TRANSPORT_ALPHA = 0.05

#: Start grids of the transport stage, us (search grids, not figures of a machine).
FABRIC_START_NET_LATENCIES_US = (3.0, 30.0, 100.0)
FABRIC_START_COMPLETIONS_US = (1.0, 10.0, 100.0)

#: A term is decided by the data when moving it by ``DECIDED_STEP`` (relative: an efficiency
#: down, a latency or cost up, by ``DECIDED_FLOOR_US`` at least) moves some point's simulated
#: time by at least ``DECIDED_SHIFT``; a term that moves none is kept at the base's figure and
#: reported so.
DECIDED_STEP = 0.10
DECIDED_FLOOR_US = 1.0
DECIDED_SHIFT = 0.005

#: Relative residual at which the loss turns from quadratic to linear (pseudo-Huber on the
#: log ratio): a few points far off (a congested size) do not drag the rest.
FABRIC_HUBER_DELTA = 0.05

#: Evaluations of the simplex search per stage (each evaluates every point once).
FABRIC_MAX_EVALUATIONS = 240

#: Restarts of the simplex from its best point (a simplex that has collapsed along a kink of
#: the loss, where a latency floor switches, stops early; a new one moves on).
FABRIC_RESTARTS = 6

#: Efficiencies and latencies each staged search also starts from, every combination with
#: the base's figures added (search grids, not figures of a machine); the
#: ``FABRIC_STARTS_KEPT`` starts with the lowest loss are searched from.
FABRIC_START_EFFICIENCIES = (0.3, 0.4, 0.5, 0.6, 0.7, 0.8, 0.9)
FABRIC_START_LATENCIES_US = (1.0, 3.0, 10.0)
FABRIC_STARTS_KEPT = 4

#: Device names in nccl-tests' rank lines -> the shipped topology of that machine.
_DEVICE_BASES = (
    ("H200", "dgx_h200"),
    ("H100", "dgx_h100"),
    ("B200", "dgx_b200"),
    ("A100", "dgx_a100"),
)


def base_for_device(device: str) -> str | None:
    """The shipped topology for a GPU named as nccl-tests prints it (``NVIDIA H100 80GB
    HBM3`` -> ``dgx_h100``), or None."""
    for needle, base in _DEVICE_BASES:
        if needle in device.upper():
            return base
    return None


@dataclass
class FileFit:
    """How the fitted topology reproduces one input file."""

    path: str
    nodes: int
    ranks: int
    points: int
    median_abs_error_before: float
    median_abs_error: float
    max_abs_error: float
    by_choice: dict[str, tuple[int, float]]
    """Per (algorithm/protocol) the simulator chose: points and median |error| after the fit."""


@dataclass
class FabricCalibration:
    """A fitted multi-node topology: the base file with fitted link figures."""

    base: str
    values: dict[str, float]
    """``section.key`` -> fitted value."""
    fitted: list[str]
    """The keys fitted (a stage without data leaves its keys at the base's values)."""
    decided: list[str]
    """The fitted keys the data decided; the others are the base's figures (see notes)."""
    data: dict[str, Any]
    """The topology document (the base's, with the fitted values)."""
    files: list[FileFit]
    nodes: int
    gpus_per_node: int
    notes: list[str] = field(default_factory=list)


def _fabric_data(base_data: dict[str, Any], values: dict[str, float]) -> dict[str, Any]:
    data = {k: (dict(v) if isinstance(v, dict) else v) for k, v in base_data.items()}
    for dotted, value in values.items():
        section, key = dotted.split(".")
        data.setdefault(section, {})[key] = value
    if "fabric.completion_us" in values:  # the Simple step is 2 x latency + completion then
        data["fabric"].pop("net_simple_latency_us", None)
    return data


def _encode(key: str, value: float) -> float:
    """Search coordinate of a figure: the logit of an efficiency, a latency in us as it is
    (decoded as its absolute value, so that the search space has no edge and no flat part)."""
    if key.endswith("efficiency"):
        v = min(max(value, 1e-4), 1 - 1e-6)
        return math.log(v / (1 - v))
    return value


def _decode(key: str, x: float) -> float:
    if key.endswith("efficiency"):
        return 1.0 / (1.0 + math.exp(-max(min(x, 50.0), -50.0)))
    return abs(x)


def _steps(keys: list[str], x0: list[float]) -> list[float]:
    """First simplex steps: 0.5 in logit, or half a latency (at least 0.5 us)."""
    return [0.5 if k.endswith("efficiency") else max(0.5, 0.5 * abs(x)) for k, x in zip(keys, x0)]


def _points(meas: Measurements) -> list[tuple[str, int, float]]:
    out = []
    for row in meas.rows:
        if int(row.get("wrong", 0) or 0) > 0:
            raise ConfigError(
                f"{row['op']} {row['size_bytes']} B has #wrong {row['wrong']}: wrong results "
                "are not a measurement",
                file=meas.path,
            )
        out.append((str(row["op"]), int(row["size_bytes"]), float(row["time_us"]) * 1e-6))
    return out


def _simulate_files(
    base_doc: Any, values: dict[str, float], files: list[Measurements]
) -> list[list[tuple[float, str]]]:
    """Simulated (time, algorithm/protocol) of every point of every file."""

    data = _fabric_data(base_doc.data, values)
    doc = type(base_doc)(data=data, file=base_doc.file, lines=base_doc.lines)
    groups: dict[tuple[int, int], Any] = {}
    out = []
    for meas in files:
        shape = (meas.num_nodes, meas.ranks_per_node)
        if shape not in groups:
            groups[shape] = Group.all(parse_topology(doc, nodes=shape[0], gpus_per_node=shape[1]))
        group = groups[shape]
        sims = []
        for op, size, _ in _points(meas):
            result = cost(op, size, group)
            sims.append((result.time_s, result.label))
        out.append(sims)
    return out


def _loss(base_doc: Any, values: dict[str, float], files: list[Measurements]) -> float:
    total = 0.0
    for meas, sims in zip(files, _simulate_files(base_doc, values, files)):
        for (_, _, measured), (simulated, _) in zip(_points(meas), sims):
            r = math.log(simulated / measured) / FABRIC_HUBER_DELTA
            total += math.sqrt(1.0 + r * r) - 1.0
    return total


def _file_fits(
    base_doc: Any,
    before: dict[str, float],
    after: dict[str, float],
    files: list[Measurements],
) -> list[FileFit]:
    out = []
    sims_before = _simulate_files(base_doc, before, files)
    sims_after = _simulate_files(base_doc, after, files)
    for meas, sb, sa in zip(files, sims_before, sims_after):
        pts = _points(meas)
        err_b = [abs(s - t) / t for (_, _, t), (s, _) in zip(pts, sb)]
        err_a = [abs(s - t) / t for (_, _, t), (s, _) in zip(pts, sa)]
        by: dict[str, list[float]] = {}
        for e, (_, label) in zip(err_a, sa):
            by.setdefault(label, []).append(e)
        out.append(
            FileFit(
                path=meas.path,
                nodes=meas.num_nodes,
                ranks=meas.world_size,
                points=len(pts),
                median_abs_error_before=statistics.median(err_b),
                median_abs_error=statistics.median(err_a),
                max_abs_error=max(err_a),
                by_choice={k: (len(v), statistics.median(v)) for k, v in by.items()},
            )
        )
    return out


def _fabric_base(files: list[Measurements], base: str | None) -> tuple[str, Any]:
    """The base topology's name (``base``, else the shipped file of the GPU the logs name)
    and its document, which must be an NCCL one."""

    if base is None:
        devices = {str(m.metadata.get("device", "")) for m in files}
        guesses = {base_for_device(d) for d in devices}
        if len(guesses) != 1 or None in guesses:
            raise ConfigError(
                f"cannot tell the machine from the device names {sorted(devices)}; name the "
                "base topology (a file or a shipped name such as dgx_h100)",
                key_path="--base",
            )
        base = str(guesses.pop())
    base_doc = load_yaml(resolve_topology_path(base))
    library = (base_doc.data.get("collectives") or {}).get("library", "nccl")
    if library != "nccl":
        raise ConfigError(
            f"the base topology {base} is a {library} topology; a multi-node fit needs an NCCL one",
            key_path="--base",
        )
    return base, base_doc


def _stage_starts(keys: list[str], values: dict[str, float], multistart: bool) -> list[list[float]]:
    """Search coordinates to start a stage from: the current figures and, with
    ``multistart``, every combination of the start grids (and the current figure) per key."""
    starts = [[_encode(k, values[k]) for k in keys]]
    if multistart:  # the auto choice of algorithm switches with the figures: local minima
        grids = [_start_grid(key) + (values[key],) for key in keys]
        starts += [
            [_encode(k, v) for k, v in zip(keys, combo)] for combo in itertools.product(*grids)
        ]
    return starts


def _start_grid(key: str) -> tuple[float, ...]:
    if key.endswith("efficiency"):
        return FABRIC_START_EFFICIENCIES
    if key == "fabric.net_latency_us":
        return FABRIC_START_NET_LATENCIES_US
    if key == "fabric.completion_us":
        return FABRIC_START_COMPLETIONS_US
    return FABRIC_START_LATENCIES_US


def _transport_start(base_doc: Any) -> dict[str, float] | None:
    """The base's transport terms (``fabric.net_latency_us``, ``fabric.completion_us``) as its
    file and its kind's defaults set them, or None where the transport adds none (NCCL's own
    NET row: InfiniBand, RoCE, no kind)."""

    fabric = parse_topology(base_doc, nodes=2).fabric
    net_us = fabric.net_latency_s * 1e6
    simple_us = fabric.net_simple_latency_s * 1e6
    if net_us == 0 and simple_us == 0:
        return None
    return {"fabric.net_latency_us": net_us, "fabric.completion_us": simple_us - 2 * net_us}


def _log_ssr(
    base_doc: Any, values: dict[str, float], data: list[Measurements]
) -> tuple[float, int]:
    """Sum of squared log(simulated / measured) over the points of ``data``, and their count."""
    total, count = 0.0, 0
    for meas, sims in zip(data, _simulate_files(base_doc, values, data)):
        for (_, _, measured), (simulated, _) in zip(_points(meas), sims):
            total += math.log(simulated / measured) ** 2
            count += 1
    return total, count


def _transport_gains(
    base_doc: Any,
    held: dict[str, float],
    fitted: dict[str, float],
    data: list[Measurements],
    keys: int,
) -> bool:
    """Whether fitting the two transport terms improves on the base's significantly: the
    F-test of the nested fits (2 more parameters, ``keys`` in all) at TRANSPORT_ALPHA, on the
    squared log residuals (as :func:`fit_two_regime` tests a knee)."""
    ssr0, n = _log_ssr(base_doc, held, data)
    ssr1, _ = _log_ssr(base_doc, fitted, data)
    gained = ssr0 - ssr1
    if gained <= 1e-12 * max(ssr0, 1e-300):
        return False
    d2 = n - keys
    if ssr1 <= 0.0 or d2 < 1:
        return d2 >= 1 or gained > 0
    return (gained / 2.0) / (ssr1 / d2) > f_critical(d2, TRANSPORT_ALPHA)


def _decided(
    base_doc: Any, values: dict[str, float], keys: list[str], data: list[Measurements]
) -> list[str]:
    """The ``keys`` the points of ``data`` decide: moving one by DECIDED_STEP (see there) moves
    some point's simulated time by DECIDED_SHIFT or more."""
    at = [t for sims in _simulate_files(base_doc, values, data) for t, _ in sims]
    out = []
    for key in keys:
        value = values[key]
        trial = dict(values)
        if key.endswith("efficiency"):
            trial[key] = value * (1 - DECIDED_STEP)
        else:  # a latency or cost: up, by at least DECIDED_FLOOR_US (it may sit at 0)
            trial[key] = value + max(DECIDED_STEP * value, DECIDED_FLOOR_US)
        shifted = [t for sims in _simulate_files(base_doc, trial, data) for t, _ in sims]
        if max(abs(b / a - 1) for a, b in zip(at, shifted)) >= DECIDED_SHIFT:
            out.append(key)
    return out


def _fit_stage(
    base_doc: Any,
    values: dict[str, float],
    fitted: list[str],
    keys: list[str],
    data: list[Measurements],
    multistart: bool,
) -> None:
    """Fit ``keys`` on ``data`` with the other figures held: the best starts, each refined by
    the simplex and restarted where it stopped; ``values`` gets the best, ``fitted`` the keys."""

    def fun(x: Any) -> float:
        trial = dict(values)
        trial.update({k: _decode(k, float(v)) for k, v in zip(keys, x)})
        return _loss(base_doc, trial, data)

    ranked = sorted(_stage_starts(keys, values, multistart), key=fun)[:FABRIC_STARTS_KEPT]
    found = []
    for start in ranked:
        best, f_best = nelder_mead(
            fun, start, steps=_steps(keys, start), max_evaluations=FABRIC_MAX_EVALUATIONS
        )
        for _ in range(FABRIC_RESTARTS):  # a fresh simplex where the last one stopped
            again, f_again = nelder_mead(
                fun, best, steps=_steps(keys, best), max_evaluations=FABRIC_MAX_EVALUATIONS
            )
            if f_again >= f_best - 1e-9 * max(f_best, 1e-12):
                break
            best, f_best = again, f_again
        found.append((f_best, best))
    best = min(found, key=lambda pair: pair[0])[1]
    values.update({k: _decode(k, v) for k, v in zip(keys, best)})
    for k in keys:
        if k not in fitted:
            fitted.append(k)


def _written(
    values: dict[str, float],
    fitted: list[str],
    decided: list[str],
    transport: dict[str, float] | None,
) -> dict[str, float]:
    """The figures the calibrated file sets: the decided ones, and both transport terms when
    one is (the Simple step is 2 x latency + completion)."""
    written = {k for k in fitted if k in decided}
    if transport is not None and written & set(transport):
        written |= set(transport)
    return {k: values[k] for k in sorted(written)}


def _fit_transport(
    base_doc: Any,
    values: dict[str, float],
    fitted: list[str],
    keys: list[str],
    many: list[Measurements],
    notes: list[str],
) -> list[str]:
    """Fit the transport's ``keys`` with the rails' efficiency on the multi-node files; keep
    them only when the F-test prefers them to the base's. Returns the keys kept fitted."""
    held = dict(values)
    _fit_stage(base_doc, values, fitted, keys + ["nics.efficiency"], many, True)
    network = len(NETWORK_PARAMETERS) + len(keys)
    if _transport_gains(base_doc, held, values, many, network):
        return keys
    values.update(held)  # the base's transport terms do as well
    notes.append(
        f"the fitted transport terms do not beat the base's (F-test at {TRANSPORT_ALPHA:.0%}): "
        + ", ".join(f"{k} = {held[k]:.6g}" for k in keys)
        + " kept"
    )
    for key in keys:
        fitted.remove(key)
    return []


def calibrate_fabric(files: list[Measurements], *, base: str | None = None) -> FabricCalibration:
    """Fit a multi-node NCCL topology to nccl-tests measurements of one and more nodes.

    The base topology (``base``, else the shipped file of the GPU the logs name) keeps its
    shape and NCCL's own per-protocol tables (:mod:`collsim.collectives.protocols`); what is
    fitted are the figures of the topology file, by minimising the pseudo-Huber loss of
    log(simulated / measured) over every point with a downhill simplex, each figure searched
    in an unbounded transform (logit of an efficiency, log of a latency):

    1. on the one-node files: ``intra_node.efficiency`` (NVLink), ``intra_node.latency_us``
       and ``collectives.overhead_us``;
    2. on the multi-node files, with those held: ``nics.efficiency`` and ``nics.latency_us``
       (the network latency per hop, NIC to NIC);
    3. all of them together on every file, from where 1 and 2 ended.

    A stage without files keeps the base's figures and says so in the notes. NCCL's
    per-protocol latencies (tuning.cc) are not keys of a topology file, so the fit is per
    link, and each point's error is reported per (algorithm, protocol) the simulator chose.

    Raises:
        ConfigError: no files, a #wrong > 0, no base topology for the device, or a file whose
            op the base cannot run.
    """
    if not files:
        raise ConfigError("no measurement files")
    for meas in files:
        for row in meas.rows:
            t = float(row["time_us"])
            if not (math.isfinite(t) and t > 0):
                raise ConfigError(f"measured times must be finite and > 0, got {t}", file=meas.path)
    base, base_doc = _fabric_base(files, base)
    one = [m for m in files if m.num_nodes == 1]
    many = [m for m in files if m.num_nodes > 1]
    if many and "nics" not in base_doc.data:
        raise ConfigError(f"the base topology {base} has no nics section", key_path="--base")
    start: dict[str, float] = {}
    for section, key in INTRA_PARAMETERS + NETWORK_PARAMETERS:
        sec = base_doc.data.get(section) or {}
        start[f"{section}.{key}"] = float(sec.get(key, 1.0 if key == "efficiency" else 0.0))
    values = dict(start)
    notes = []
    fitted: list[str] = []
    intra_keys = [f"{s}.{k}" for s, k in INTRA_PARAMETERS]
    net_keys = [f"{s}.{k}" for s, k in NETWORK_PARAMETERS]
    if one:
        _fit_stage(base_doc, values, fitted, intra_keys, one, True)
    else:
        notes.append("no one-node file: NVLink figures and the fixed cost kept from the base")
    transport = _transport_start(base_doc) if many else None
    if transport is not None:
        start.update(transport)
        values.update(transport)
    if many:
        _fit_stage(base_doc, values, fitted, net_keys, many, True)
        if transport is not None:
            net_keys += _fit_transport(base_doc, values, fitted, list(transport), many, notes)
    else:
        notes.append("no multi-node file: NIC figures kept from the base")
    decided = _decided(base_doc, values, intra_keys, one) if one else []
    decided += _decided(base_doc, values, net_keys, many) if many else []
    kept = [k for k in fitted if k not in decided]
    for key in kept:  # nothing in the data moves it: the base's figure stays
        values[key] = start[key]
    if one and many:
        joint = [k for k in intra_keys + net_keys if k in decided]
        _fit_stage(base_doc, values, fitted, joint, files, False)
    if kept:
        notes.append(
            f"kept from the base (no point moves by {DECIDED_SHIFT:.1%} when the figure moves "
            f"by {DECIDED_STEP:.0%}, a latency by {DECIDED_FLOOR_US:g} us at least): "
            + ", ".join(f"{k} = {start[k]:.6g}" for k in kept)
        )
    if many and transport is None:
        notes.append(
            "the base's transport adds no latency of its own (NCCL's NET row, tuning.cc): "
            "fabric.net_latency_us and fabric.completion_us not fitted"
        )
    notes.append(
        "NCCL's per-protocol base and per-hop latencies (src/graph/tuning.cc) are the "
        "simulator's tables, not topology keys: the fit sets the link and transport figures"
    )
    data = _fabric_data(base_doc.data, _written(values, fitted, decided, transport))
    nodes = max(m.num_nodes for m in files)
    per_node = {m.ranks_per_node for m in files}
    if len(per_node) != 1:
        raise ConfigError(
            f"the files have {sorted(per_node)} ranks per node; calibrate one node shape at a time"
        )
    gpus = per_node.pop()
    data["nodes"] = nodes
    data["gpus_per_node"] = gpus
    return FabricCalibration(
        base=base,
        values={k: values[k] for k in fitted},
        fitted=fitted,
        decided=decided,
        data=data,
        files=_file_fits(base_doc, start, values, files),
        nodes=nodes,
        gpus_per_node=gpus,
        notes=notes,
    )


def fabric_yaml(cal: FabricCalibration, name: str) -> str:
    """The calibrated topology as YAML text, with the fit in its header comments."""

    lines = [
        f"# Calibrated by `collsim validate calibrate` from {', '.join(f.path for f in cal.files)}",
        f"# base topology {cal.base}; fitted (pseudo-Huber on log(simulated/measured), "
        f"downhill simplex): " + ", ".join(f"{k} = {v:.6g}" for k, v in cal.values.items()),
    ]
    for f in cal.files:
        lines.append(
            f"# {f.path}: {f.ranks} ranks on {f.nodes} node(s), {f.points} points, median "
            f"|error| {f.median_abs_error_before:.1%} with the base -> {f.median_abs_error:.1%} "
            f"(max {f.max_abs_error:.1%})"
        )
    lines += [f"# note: {note}" for note in cal.notes]
    data = dict(cal.data)
    data["name"] = name
    data["description"] = f"{data.get('description', '')} (calibrated)".strip()
    rounded = {}
    for section, value in data.items():
        if isinstance(value, dict):
            value = {
                k: (float(f"{v:.6g}") if isinstance(v, float) else v) for k, v in value.items()
            }
        rounded[section] = value
    return "\n".join(lines) + "\n" + yaml.safe_dump(rounded, sort_keys=False)


def write_fabric_topology(
    cal: FabricCalibration, path: str | Path, name: str | None = None
) -> Path:
    """Write the calibrated multi-node topology and check that it loads back."""

    out = Path(path)
    out.parent.mkdir(parents=True, exist_ok=True)  # as write_topology does
    out.write_text(fabric_yaml(cal, name or out.stem))
    load_topology(out)
    return out
