"""Collectives: ops x algorithms, each with a closed-form cost and a SimPy process.

Ops: all_reduce, reduce_scatter, all_gather, broadcast, reduce, all_to_all, send_recv.
Algorithms (one module each): ring, tree (double binary tree), halving_doubling, direct,
hierarchical, nvls (in-switch reduction), nvls_tree (NVLS inside nodes, trees across),
collnet_direct / collnet_chain (in-network reduction, ``fabric.sharp``), pat (one rank per
node). With NCCL, ``auto`` picks the (algorithm, protocol) NCCL 2.30.7's own tuner picks
(:mod:`collsim.collectives.tuner`) and reports it; with gloo, the cheapest.

Example::

    topo = load_topology("dgx_h100")
    group = Group.all(topo)
    c = cost("all_reduce", 1 << 30, group)        # CollectiveCost(..., algorithm=nvls, ...)
    env = simpy.Environment(); net = FlowNetwork(env, topo)
    proc = simulate(env, net, "all_reduce", 1 << 30, group)
    env.run(proc)                                  # proc.value is the simulated CollectiveCost
"""

from __future__ import annotations

from collsim.collectives.phases import CollectivePhases, Timing
from collsim.collectives.select import choose, cost, phases_for, simulate, supported
from collsim.collectives.transfers import LoadPhase, Phase, Transfer
from collsim.collectives.types import CollectiveCost, Group, busbw_factor
from collsim.core.vocab import Algorithm, CollectiveOp, Protocol

__all__ = [
    "CollectiveOp",
    "Algorithm",
    "Protocol",
    "Group",
    "CollectiveCost",
    "busbw_factor",
    "cost",
    "simulate",
    "choose",
    "phases_for",
    "supported",
    "Phase",
    "LoadPhase",
    "CollectivePhases",
    "Timing",
    "Transfer",
]
