"""Physical topology: ranks, nodes, NVSwitch / PCIe switch, NICs and the fabric, from YAML.

:mod:`~collsim.cluster.topology.links` holds the links, NICs and fabrics,
:mod:`~collsim.cluster.topology.graph` the :class:`Topology` with its paths and symmetry keys,
:mod:`~collsim.cluster.topology.files` the presets and the reading of a file. Derivations,
measurements and sources: docs/derivations.md, ``collsim.cluster.topology``.
"""

from __future__ import annotations

from collsim.cluster.topology.files import (
    CPU_VENDORS,
    LIBRARIES,
    PRESET_DIR,
    TOPOLOGY,
    TOPOLOGY_MAX_RANKS,
    load_topology,
    parse_topology,
    read_topology_file,
    resolve_topology_path,
    topology_dirs,
)
from collsim.cluster.topology.graph import Topology
from collsim.cluster.topology.links import (
    FABRIC_DEFAULTS,
    CollectiveSettings,
    FabricDefaults,
    Link,
    LinkTable,
)
from collsim.core.vocab import FabricKind, Interconnect, LinkKind

__all__ = [
    "TOPOLOGY",
    "Link",
    "LinkKind",
    "CPU_VENDORS",
    "LIBRARIES",
    "Interconnect",
    "FabricKind",
    "FabricDefaults",
    "FABRIC_DEFAULTS",
    "CollectiveSettings",
    "Topology",
    "load_topology",
    "read_topology_file",
    "parse_topology",
    "topology_dirs",
    "resolve_topology_path",
    "LinkTable",
    "PRESET_DIR",
    "TOPOLOGY_MAX_RANKS",
]
