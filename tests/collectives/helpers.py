"""Helpers for collective tests: cached topologies and a one-call DES run."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import simpy

from collsim.cluster.network import FlowNetwork
from collsim.cluster.topology import Topology, load_topology, parse_topology, resolve_topology_path
from collsim.collectives import Group, simulate
from collsim.core.yamlio import parse_yaml_text

_CACHE: dict[tuple[str, int, int | None], Topology] = {}


def topo(name: str, nodes: int = 1, gpus_per_node: int | None = None) -> Topology:
    """A shared (cached) topology: per-group schedules are cached on it.

    ``NAME+sharp`` is the preset with in-network reduction (``fabric.sharp: true``)."""
    key = (name, nodes, gpus_per_node)
    if key not in _CACHE:
        if name.endswith("+sharp"):
            base = name.removesuffix("+sharp")
            text = Path(resolve_topology_path(base)).read_text()
            text = text.replace("\nfabric:\n", "\nfabric:\n  sharp: true\n", 1)
            _CACHE[key] = parse_topology(
                parse_yaml_text(text, f"{base}+sharp.yaml"),
                nodes=nodes,
                gpus_per_node=gpus_per_node,
            )
        else:
            _CACHE[key] = load_topology(name, nodes=nodes, gpus_per_node=gpus_per_node)
    return _CACHE[key]


def run_des(
    group: Group,
    op: str,
    size: float,
    algorithm: str = "auto",
    peers: tuple[Group, ...] = (),
    **kwargs: Any,
) -> tuple[Any, FlowNetwork]:
    """Simulate one collective on a fresh network; return (CollectiveCost, network)."""
    env = simpy.Environment()
    net = FlowNetwork(env, group.topology)
    proc = simulate(env, net, op, size, group, algorithm, peers=peers, **kwargs)
    env.run(proc)
    return proc.value, net
