"""Topology files: the shipped presets, finding and loading a file, and its description.

Derivations, measurements and sources: docs/derivations.md, ``collsim.cluster.topology``.
"""

from __future__ import annotations

from dataclasses import replace
from functools import lru_cache
from pathlib import Path
from typing import Any

from collsim.cluster.hardware import DEVICE, Device, device_from_reader, get_device, list_devices
from collsim.cluster.topology.graph import Topology
from collsim.cluster.topology.links import (
    FABRIC_DEFAULTS,
    CollectiveSettings,
    FabricDefaults,
    _FabricSpec,
    _IntraSpec,
    _NicSpec,
)
from collsim.cluster.transports import (
    EFA_PLATFORMS,
    NCCL_RELEASES,
    TUNERS,
    transport_for,
)
from collsim.core.errors import ConfigError
from collsim.core.schema import (
    Either,
    Section,
    Spec,
    Value,
    check,
    choice_value,
    flag_value,
    fraction_value,
    non_negative_value,
    positive_value,
    raise_errors,
    read_described,
    scaled,
    text_value,
    values_of,
)
from collsim.core.units import US, gbit_to_bps, gbps_to_bps
from collsim.core.vocab import Algorithm, CollectiveOp, FabricKind, Interconnect, Protocol
from collsim.core.yamlio import ConfigReader, YamlDoc, load_yaml

__all__ = [
    "TOPOLOGY",
    "CPU_VENDORS",
    "LIBRARIES",
    "TOPOLOGY_MAX_RANKS",
    "PRESET_DIR",
    "load_topology",
    "read_topology_file",
    "parse_topology",
    "topology_dirs",
    "resolve_topology_path",
]

CPU_VENDORS = ("intel", "amd")
"""``host.cpu_vendor`` values."""
LIBRARIES = ("nccl", "gloo")
"""``collectives.library`` values."""

TOPOLOGY_MAX_RANKS = 4 * 262_144
"""The most ranks (and NIC ports) a topology file may build, whatever ``--max-gpus`` says: 4 x
the default limit (:class:`collsim.study.limits.Limits`), checked before a link is built."""
_OP_NAMES = tuple(op.value for op in CollectiveOp)
_ALGORITHM_NAMES = tuple(a.value for a in Algorithm)


# -- loading ------------------------------------------------------------------------------
PRESET_DIR = Path(__file__).resolve().parents[2] / "data" / "topologies"
"""The shipped topology presets, inside the package (found after any install). The repository's
top-level ``topologies/`` holds the same files for users to read and copy (a test keeps the two
identical)."""


def topology_dirs() -> list[Path]:
    """Folders searched for topology names: the package's presets, then the cwd's
    ``topologies/``."""
    return [PRESET_DIR, Path.cwd() / "topologies"]


def resolve_topology_path(spec: str | Path) -> Path:
    """A path to an existing file, or a name (``dgx_h100``) looked up in :func:`topology_dirs`.

    Raises:
        ConfigError: nothing found; the message lists the known names.
    """
    path = Path(spec)
    if path.is_file():
        return path
    if path.suffix == "" and len(path.parts) == 1:
        for folder in topology_dirs():
            candidate = folder / f"{path.name}.yaml"
            if candidate.is_file():
                return candidate
    known = sorted({p.stem for d in topology_dirs() if d.is_dir() for p in d.glob("*.yaml")})
    raise ConfigError(
        f"no topology file or name {str(spec)!r} (known names: {', '.join(known) or 'none'})"
    )


def load_topology(
    spec: str | Path,
    *,
    nodes: int | None = None,
    gpus_per_node: int | None = None,
    device: Device | None = None,
) -> Topology:
    """Load a topology from a YAML file or a name in ``topologies/``.

    Args:
        spec: path to a YAML file, or a name such as ``"dgx_h100"``.
        nodes: node count; defaults to the file's ``nodes`` (1 if absent).
        gpus_per_node: ranks per node override (used for ``localhost``: N CPU ranks).
        device: a device that replaces the file's (a scenario's ``cluster.device``).

    Raises:
        ConfigError: malformed file (``file:line: key.path: message``), or bad arguments.
    """
    return parse_topology(
        read_topology_file(spec), nodes=nodes, gpus_per_node=gpus_per_node, device=device
    )


def read_topology_file(spec: str | Path) -> YamlDoc:
    """The parsed topology file ``spec`` names (see :func:`load_topology`), read once per
    process while the file is unchanged: the limits check before the build and the build
    share it. The document is read, never changed.

    Raises:
        ConfigError: the file is missing or unreadable, or not YAML.
    """
    path = resolve_topology_path(spec)
    try:
        stat = Path(path).stat()
    except OSError:
        return load_yaml(path)  # reports the problem
    return _read_file(str(path), stat.st_mtime_ns, stat.st_size)


@lru_cache(maxsize=64)
def _read_file(path: str, mtime_ns: int, size_bytes: int) -> YamlDoc:
    return load_yaml(path)


def _read_device(root: ConfigReader, doc: YamlDoc) -> Device:
    """``device``: a catalogue key, a device file (``*.yaml``, relative to the topology file
    when it exists there) or an inline mapping in the device schema (collsim.cluster.hardware)."""
    if isinstance(root.data.get("device"), dict):
        return device_from_reader(root.section("device"), "inline", doc.file)
    key = root.get("device", str)
    if key.endswith((".yaml", ".yml")) and not Path(key).is_absolute() and doc.file:
        beside = Path(doc.file).parent / key
        key = str(beside) if beside.exists() else key
    try:
        return get_device(key)
    except ConfigError as exc:
        if exc.file is not None:
            raise
        raise root.error(exc.message, "device") from None


def parse_topology(
    doc: YamlDoc,
    *,
    nodes: int | None = None,
    gpus_per_node: int | None = None,
    device: Device | None = None,
) -> Topology:
    """Build a Topology from a parsed document (see docs/derivations.md for the schema);
    ``device`` replaces the file's (which is still checked).

    Every schema error of the file is reported at once (:func:`collsim.core.schema.check`), before
    the rules between keys are checked; the keys are read as :data:`TOPOLOGY` describes them.
    """
    raise_errors(check(doc, TOPOLOGY))
    root = ConfigReader(doc.data, doc=doc)
    top = read_described(root, TOPOLOGY)
    file_device = _read_device(root, doc)
    device = file_device if device is None else device

    intra = _IntraSpec(**_read_section(root, "intra_node"))
    nics, nics_has_efficiency = _read_nics(root)
    fabric, kind_defaults = _read_fabric(root)
    if nics is not None and not nics_has_efficiency and fabric.kind is not FabricKind.FAT_TREE:
        nics = replace(nics, efficiency=kind_defaults.nic_efficiency)
    host = _read_section(root, "host")
    collectives = _read_collectives(root)
    root.finish()

    num_nodes = top["num_nodes"] if nodes is None else nodes
    if num_nodes < 1:
        raise ConfigError(f"nodes must be >= 1, got {num_nodes}")
    ranks_per_node = top["gpus_per_node"] if gpus_per_node is None else gpus_per_node
    if ranks_per_node < 1:
        raise ConfigError(f"gpus_per_node must be >= 1, got {ranks_per_node}")
    if num_nodes > 1 and nics is None:
        raise root.error(f"{num_nodes} nodes asked but the topology has no 'nics' section")
    _check_size(root, num_nodes, ranks_per_node, nics.count if nics is not None else 0)
    return Topology(
        name=top["name"],
        device=device,
        num_nodes=num_nodes,
        gpus_per_node=ranks_per_node,
        intra=intra,
        nics=nics,
        fabric=fabric,
        collectives=collectives,
        source=doc.file,
        **host,
    )


def _read_section(root: ConfigReader, key: str) -> dict[str, Any]:
    """The described keys of the mapping ``key`` (an absent optional one reads as empty)."""
    spec = TOPOLOGY.fields[key]
    assert isinstance(spec, Section)
    sec = root.section(key, default_empty=not spec.required)
    out = read_described(sec, spec)
    sec.finish()
    return out


def _read_nics(root: ConfigReader) -> tuple[_NicSpec | None, bool]:
    """The ``nics`` section (None without one) and whether it sets its own efficiency."""
    if not root.has("nics"):
        return None, False
    has_efficiency = root.section("nics").has("efficiency")
    return _NicSpec(**_read_section(root, "nics")), has_efficiency


def _read_fabric(root: ConfigReader) -> tuple[_FabricSpec, FabricDefaults]:
    """The ``fabric`` section, with its kind's defaults (which also set the NICs' efficiency)."""
    sec = root.section("fabric", default_empty=True)
    values = read_described(sec, _FABRIC)
    kind = values["kind"]
    platform = values.get("platform")
    transport = transport_for(kind, platform if kind is FabricKind.EFA else None)
    kind_defaults = replace(
        FABRIC_DEFAULTS[kind],
        net_latency_us=transport.net_latency_us,
        net_simple_latency_us=transport.net_simple_latency_us,
        ll128=transport.ll128,
        source=transport.source,
    )
    net_latency_us = values.pop("net_latency_us", kind_defaults.net_latency_us)
    if "completion_us" in values and "net_simple_latency_us" in values:
        raise sec.error("give completion_us or net_simple_latency_us, not both", "completion_us")
    completion_us = values.pop("completion_us", None)
    simple_us = values.pop("net_simple_latency_us", kind_defaults.net_simple_latency_us)
    if completion_us is not None:
        simple_us = 2.0 * net_latency_us + completion_us
    values.setdefault("ll128", kind_defaults.ll128)
    values.setdefault("ll", Protocol.LL in transport.protocols)
    values.setdefault("tuner", transport.tuner)
    fabric = _FabricSpec(
        **values, net_latency_s=net_latency_us * US, net_simple_latency_s=simple_us * US
    )
    sec.finish()
    if platform is not None and kind is not FabricKind.EFA:
        raise sec.error("platform is an EFA instance family; needs kind: efa", "platform")
    return fabric, kind_defaults


def _read_collectives(root: ConfigReader) -> CollectiveSettings:
    sec = root.section("collectives", default_empty=True)
    values = read_described(sec, _COLLECTIVES)
    algorithms = sec.section("algorithms", default_empty=True)
    values["algorithms"] = read_described(algorithms, _section(_COLLECTIVES, "algorithms"))
    algorithms.finish()
    per_op = sec.section("ops", default_empty=True)
    ops = _section(_COLLECTIVES, "ops")
    assert isinstance(ops.values, Section)
    op_keys = [str(op) for op, _ in list(per_op.items())]
    for op in op_keys:
        if op not in _OP_NAMES:
            raise per_op.error(_OP_RULE.format(choices=", ".join(_OP_NAMES)), op)
    op_overhead_s: dict[str, float] = {}
    op_efficiency: dict[str, float] = {}
    op_knee: dict[str, tuple[float, float]] = {}
    for op in op_keys:
        one = per_op.section(op)
        read = read_described(one, ops.values)
        if "overhead_s" in read:
            op_overhead_s[op] = read["overhead_s"]
        if "efficiency" in read:
            op_efficiency[op] = read["efficiency"]
        if "knee_bytes" in read or "knee_efficiency" in read:
            op_knee[op] = _knee(one, read, op_efficiency.get(op, 1.0))
        one.finish()
    sec.finish()
    return CollectiveSettings(
        **values,
        op_overhead_s=op_overhead_s,
        op_efficiency=op_efficiency,
        op_knee=op_knee,
    )


def _check_size(root: ConfigReader, num_nodes: int, ranks_per_node: int, nics: int) -> None:
    """Refuse, before any link is built, a cluster whose ranks or NIC ports pass
    :data:`TOPOLOGY_MAX_RANKS` (the graph holds links per rank and per NIC:
    ``gpus_per_node: 100000000`` was a MemoryError)."""
    limit = TOPOLOGY_MAX_RANKS
    for what, path, count in (
        ("GPUs", ("gpus_per_node",), num_nodes * ranks_per_node),
        ("NIC ports", ("nics", "count"), num_nodes * nics),
    ):
        if count > limit:
            raise ConfigError(
                f"{num_nodes:,} node(s) x {count // num_nodes:,} = {count:,} {what}, more than "
                f"the limit of {limit:,}; use fewer",
                key_path=".".join(path),
                file=root.file,
                line=root.doc.line_of(path) if root.doc is not None else None,
            )


def _knee(one: ConfigReader, read: dict[str, Any], efficiency: float) -> tuple[float, float]:
    """``(knee_bytes, knee_efficiency)`` of one op: both keys, the second <= ``efficiency``."""
    for key in ("knee_bytes", "knee_efficiency"):
        if key not in read:
            raise one.error("knee_bytes and knee_efficiency go together; missing", key)
    knee_bytes, knee_eff = read["knee_bytes"], read["knee_efficiency"]
    if knee_eff > efficiency:
        raise one.error(
            f"must be <= the op's efficiency ({efficiency}), got {knee_eff}", "knee_efficiency"
        )
    return float(knee_bytes), knee_eff


def _section(parent: Section, key: str) -> Section:
    spec = parent.fields[key]
    assert isinstance(spec, Section)
    return spec


# -- topology (collsim.cluster.topology.parse_topology) --------------------------------------------

_us_to_s = scaled(US)
"""Microseconds in a file, seconds in the built topology."""


def _link(extra: dict[str, Spec]) -> dict[str, Spec]:
    return {
        **extra,
        "efficiency": fraction_value("Achievable / line rate.", default=1.0),
        "latency_us": non_negative_value(
            "number",
            "Per-hop latency in microseconds.",
            default=0.0,
            field="latency_s",
            convert=_us_to_s,
        ),
    }


_OPS = values_of(_OP_NAMES)
_OP_RULE = "unknown op (choose from {choices})"


def _op_value(spec: Value) -> Value:
    # per-op values are read when their key is present: null is refused there
    return replace(spec, nullable=False)


_FABRIC = Section(
    description="The network between nodes.",
    fields={
        "kind": choice_value(
            "Transport (sets defaults).",
            values_of(FabricKind),
            default=FabricKind.FAT_TREE.value,
            convert=FabricKind,
        ),
        "rails": flag_value("Rail-optimised.", default=False),
        "oversubscription": Value(
            kind="number",
            minimum=1,
            rule="must be >= 1 (1 = non-blocking), got {value}",
            description="Leaf uplink oversubscription.",
            default=1.0,
        ),
        "nodes_per_leaf": positive_value("integer", "Nodes per leaf switch.", default=1 << 30),
        "latency_us": non_negative_value(
            "number",
            "Per leaf <-> spine direction, us.",
            default=0.0,
            field="latency_s",
            convert=_us_to_s,
        ),
        "net_latency_us": non_negative_value("number", "Per LL/LL128 network step, us."),
        "net_simple_latency_us": non_negative_value("number", "Per Simple network step, us."),
        "ll128": flag_value("NCCL runs LL128 across nodes."),
        "ll": flag_value("NCCL runs LL across nodes."),
        "completion_us": non_negative_value(
            "number", "Per Simple network step beyond the flush, us."
        ),
        "platform": choice_value("EFA instance family.", values_of(EFA_PLATFORMS)),
        "tuner": choice_value("Whose choice auto follows.", values_of(TUNERS)),
        "sharp": flag_value(
            "CollNet / SHARP in-network reduction.", default=False, field="collnet"
        ),
    },
)

_COLLECTIVES = Section(
    description="Collective library settings.",
    fields={
        "library": choice_value("Library.", values_of(LIBRARIES), default="nccl"),
        "overhead_us": non_negative_value(
            "number",
            "Launch overhead per call, microseconds.",
            default=0.0,
            field="overhead_s",
            convert=_us_to_s,
        ),
        "nccl_version": choice_value(
            "NCCL release assumed.", values_of(NCCL_RELEASES), default=NCCL_RELEASES[-1]
        ),
        "algorithms": Section(
            description="Algorithm per op.",
            keys=_OPS,
            key_rule=_OP_RULE,
            values=choice_value("Algorithm.", values_of(_ALGORITHM_NAMES), nullable=False),
        ),
        "ops": Section(
            description="Per-op calibration.",
            keys=_OPS,
            key_rule=_OP_RULE,
            values=Section(
                nullable=False,
                fields={
                    "overhead_us": _op_value(
                        non_negative_value(
                            "number",
                            "Overhead per call, us.",
                            field="overhead_s",
                            convert=_us_to_s,
                        )
                    ),
                    "efficiency": _op_value(fraction_value("Achievable / modelled bandwidth.")),
                    "knee_bytes": _op_value(
                        non_negative_value("number", "Size above which the knee holds.")
                    ),
                    "knee_efficiency": _op_value(fraction_value("Efficiency above the knee.")),
                },
            ),
        ),
    },
)

TOPOLOGY = Section(
    description="A collsim topology: one node type and the fabric (docs/topologies.md).",
    fields={
        "name": text_value("Topology name.", required=True),
        "description": text_value("Free text."),
        "device": Either(
            required=True,
            description="A device key, a device file (*.yaml) or a device mapping.",
            options=(text_value("A device key or file.", json_choices=list_devices), DEVICE),
            rule="must be a device key, a device file or a device mapping, got {value!r}",
        ),
        "nodes": positive_value("integer", "Default node count.", default=1, field="num_nodes"),
        "gpus_per_node": positive_value("integer", "Ranks per node.", required=True),
        "intra_node": Section(
            required=True,
            description="What connects the GPUs of a node.",
            fields=_link(
                {
                    "interconnect": choice_value(
                        "NVSwitch, a PCIe switch, or the kernel's loopback.",
                        values_of(Interconnect),
                        required=True,
                        convert=Interconnect,
                    ),
                    "bandwidth_gbps": positive_value(
                        "number",
                        "Per-direction bandwidth per GPU, GB/s.",
                        required=True,
                        field="bandwidth_bps",
                        convert=gbps_to_bps,
                    ),
                    "nvls": flag_value("NVSwitch reduction (NVLS).", default=False),
                }
            ),
        ),
        "nics": Section(
            nullable=False,
            description="Network interfaces of a node (needed for more than one node).",
            fields=_link(
                {
                    "count": positive_value("integer", "NICs per node.", required=True),
                    "rate_gbit": positive_value(
                        "number",
                        "Line rate per NIC, Gb/s.",
                        required=True,
                        field="bandwidth_bps",
                        convert=gbit_to_bps,
                    ),
                }
            ),
        ),
        "fabric": _FABRIC,
        "host": Section(
            description="Host memory link and CPU.",
            fields={
                "bandwidth_gbps": positive_value(
                    "number",
                    "Host <-> GPU bandwidth, GB/s.",
                    default=32.0,
                    field="host_bandwidth_bps",
                    convert=gbps_to_bps,
                ),
                "cpu_vendor": choice_value(
                    "Host CPU vendor.",
                    values_of(CPU_VENDORS),
                    default="intel",
                    field="host_cpu_vendor",
                ),
            },
        ),
        "collectives": _COLLECTIVES,
    },
)
