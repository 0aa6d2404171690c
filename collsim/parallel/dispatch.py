"""Expert dispatch as the stacks run it: dispatchers, routing models and the distinct nodes and
GPUs a token reaches (closed forms, and the seeded router they are checked against).

A routing model says which experts a token picks; a dispatcher says what crosses the wire for
those picks. Megatron-Core's ``alltoall`` sends one copy per (token, expert) pair, k copies;
DeepEP's normal kernels and Megatron's HybridEP send a token over the network once per target
node (to the GPU with the sender's in-node index) and forward it over NVLink once per target
GPU; ``allgather`` gathers every token of the EP group to every rank. The per-token counts
(``k``, expected distinct nodes, expected distinct GPUs) are closed forms of the routing model
(derivations and sources in docs/dispatch.md); :func:`simulate_routing` runs the router itself
on seeded random scores and is what the tests hold the closed forms to.
"""

from __future__ import annotations

from dataclasses import dataclass
from math import comb, gcd
from typing import TYPE_CHECKING, Protocol

import numpy as np

from collsim.core.errors import ConfigError
from collsim.parallel.config import DISPATCHERS, ROUTINGS, ParallelConfig, TrainingConfig

if TYPE_CHECKING:
    from collsim.cluster.topology import Topology
    from collsim.workload.model import TransformerSpec

__all__ = [
    "DISPATCHERS",
    "ROUTINGS",
    "DEEPEP_MAX_RDMA_PEERS",
    "DEEPEP_MAX_NVL_PEERS",
    "DISPATCH_SMS",
    "STACK_DISPATCHER",
    "DispatchPlan",
    "Reach",
    "ep_layout",
    "expected_reach",
    "simulate_routing",
    "dispatcher_of",
    "dispatch_sms_of",
    "check_dispatch",
]


class DispatchPlan(Protocol):
    """What the dispatch rules read of a plan; :class:`collsim.parallel.plan.Plan` is one (named
    by its shape, so that the plan can check its dispatch keys here)."""

    @property
    def parallel(self) -> ParallelConfig: ...
    @property
    def training(self) -> TrainingConfig: ...
    @property
    def spec(self) -> TransformerSpec: ...
    @property
    def topology(self) -> Topology: ...
    def group_of(self, rank: int, axis: str) -> tuple[int, ...]: ...


DEEPEP_MAX_RDMA_PEERS = 20
"""Nodes one DeepEP normal-kernel group may span: ``LEGACY_NUM_MAX_RDMA_PEERS`` 20
(deepseek-ai/DeepEP ``csrc/kernels/legacy/compiled.cuh`` at dd758ca; the Buffer API Megatron's
flex dispatcher calls)."""

DEEPEP_MAX_NVL_PEERS = 8
"""GPUs of one node in a DeepEP group: ``LEGACY_NUM_MAX_NVL_PEERS`` 8 (same file); a group of
more than 8 ranks must be a multiple of 8 (``csrc/legacy/config.hpp``,
``get_nvl_buffer_size_hint``)."""

DISPATCH_SMS: dict[str, int | None] = {
    # NCCL all-to-all / all-gather: the device's nccl_sms (None: the device decides)
    "alltoall": None,
    "allgather": None,
    # DeepEP normal kernels: Buffer.num_sms = 20 (deep_ep/buffers/legacy.py at dd758ca);
    # DeepSeek-V3 report section 3.2.2: "only 20 SMs" for the dispatch and combine
    "deepep": 20,
    # HybridEP: its default lives in DeepEP's hybrid-ep branch (not read here); assumed equal to
    # DeepEP's 20 until a scenario states parallel.dispatch_sms
    "hybridep": 20,
}
"""SMs a dispatcher's kernels hold while they run (``parallel.dispatch_sms`` overrides)."""

STACK_DISPATCHER: dict[str, str] = {
    # Megatron-Core TransformerConfig.moe_token_dispatcher_type = "allgather"
    # (megatron/core/transformer/transformer_config.py at d98e8a6)
    "megatron_te": "allgather",
    # NeMo Automodel: BackendConfig.dispatcher = "deepep" when DeepEP is importable on a GPU
    # (else uccl_ep, else "torch": DTensor all-gather / reduce-scatter), dispatcher_num_sms 20
    # (nemo_automodel/components/models/common/utils.py at 36044ad)
    "nemo_automodel": "deepep",
    # torchtitan: moe_comm_backend "standard" by default (torchtitan/models/deepseek_v3/
    # __init__.py at b5bcd76) -> AllToAllTokenDispatcher, all_to_all_single
    # (torchtitan/models/common/config_utils.py, token_dispatcher.py)
    "torchtitan": "alltoall",
    # llm-foundry MoE (MegaBlocks), plain FSDP and DeepSpeed-MoE (_AllToAll in
    # deepspeed/moe/sharded_moe.py): all-to-all expert parallelism; their sources are not
    # stored here, so these three are assumptions until read
    "llm_foundry": "alltoall",
    "fsdp": "alltoall",
    "deepspeed": "alltoall",
}
"""The dispatcher each ``training.stack`` runs when ``parallel.dispatcher`` is not given."""


@dataclass(frozen=True, slots=True)
class Reach:
    """What one token reaches under a routing model.

    Attributes:
        copies: (token, expert) pairs, k.
        gpus: expected distinct GPUs of the EP group among its experts.
        nodes: expected distinct nodes among them.
        remote_nodes: expected distinct nodes other than the sender's.
    """

    copies: float
    gpus: float
    nodes: float
    remote_nodes: float


def _miss(total: int, unit: int, k: int) -> float:
    """P(a set of ``unit`` experts gets none of k distinct experts drawn uniformly from
    ``total``): C(total - unit, k) / C(total, k) (the hypergeometric zero term)."""
    if unit <= 0:
        return 1.0
    return comb(total - unit, k) / comb(total, k) if total - unit >= k else 0.0


def _balanced(experts: int, k: int, gpus: int, nodes: int) -> tuple[float, float]:
    """Mean distinct GPUs and nodes of FakeBalancedGate's tokens: token i holds experts
    i k, ..., i k + k - 1 (mod E); its start runs over the E / gcd(E, k) offsets of one period,
    each as often, so the mean over one period is exact."""
    per_gpu, per_node = experts // gpus, experts // nodes
    starts = range(0, experts // gcd(experts, k) * k, k)
    g = n = 0
    for s in starts:
        ids = [(s + j) % experts for j in range(k)]
        g += len({i // per_gpu for i in ids})
        n += len({i // per_node for i in ids})
    count = len(starts)
    return g / count, n / count


def expected_reach(
    *, experts: int, top_k: int, gpus: int, nodes: int, routing: str, limit_nodes: int = 0
) -> Reach:
    """Closed-form distinct GPUs and nodes a token reaches (docs/dispatch.md).

    Experts are laid out consecutively: GPU j of the EP group holds experts j E/G ... (Megatron's
    local experts), node i the G/N GPUs i G/N ... so E/N experts.

    - uniform: the k experts are a uniform k-subset of E (top-k of i.i.d. random logits), so a
      set of u experts is hit with probability 1 - C(E - u, k) / C(E, k) and
      E[distinct GPUs] = G (1 - C(E - E/G, k) / C(E, k)), nodes likewise with u = E/N.
    - node_limited (M): the router keeps M of the N nodes (by symmetry each set of M alike) and
      picks the top k of their P = M E / N experts. A node is kept for its best experts, so each
      kept node is taken to get its best expert (on any of its G/N GPUs alike) and the other
      k - M picks a uniform subset of the remaining P - M: M nodes, and a GPU of a kept node
      (u = E/G experts) is hit with probability 1/g + (1 - 1/g)(1 - C(P - M - u, k - M) /
      C(P - M, k - M)), g = G/N. The node count is exact only when every kept node wins a pick:
      the seeded router gives 3.97 of M = 4 at DeepSeek-V3's k = 8 and 2.90 of 3 at k = 6.
    - balanced: the exact mean over FakeBalancedGate's start offsets (:func:`_balanced`).

    By symmetry a reached node is the sender's own with probability 1/N, so the remote nodes
    are nodes (N - 1) / N.
    """
    e, k, g, n = experts, top_k, gpus, nodes
    if routing == "uniform":
        d_g = g * (1.0 - _miss(e, e // g, k))
        d_n = n * (1.0 - _miss(e, e // n, k))
    elif routing == "node_limited":
        m = min(limit_nodes, n)
        pool, per = m * e // n, g // n
        if k >= m:
            d_n = float(m)
            hit = 1.0 / per + (1.0 - 1.0 / per) * (1.0 - _miss(pool - m, e // g, k - m))
        else:
            d_n = m * (1.0 - _miss(pool, e // n, k))
            hit = d_n / m * (1.0 - _miss(pool, e // g, k)) / (1.0 - _miss(pool, e // n, k))
        d_g = m * per * hit
    elif routing == "balanced":
        d_g, d_n = _balanced(e, k, g, n)
    else:
        raise ConfigError(
            f"must be one of {', '.join(ROUTINGS)}; got {routing!r}", key_path="parallel.routing"
        )
    return Reach(float(k), d_g, d_n, d_n * (n - 1) / n)


def simulate_routing(
    *,
    experts: int,
    top_k: int,
    gpus: int,
    nodes: int,
    routing: str,
    limit_nodes: int = 0,
    tokens: int = 20_000,
    seed: int = 0,
) -> Reach:
    """The router itself on seeded random scores: the mean distinct GPUs and nodes per token.

    uniform: top-k of i.i.d. normal logits (Megatron's random logits). node_limited: DeepSeek-V3's
    group-limited gate with a group per node: sigmoid scores, a group's score the sum of its two
    best, the top M groups kept, the top k of their experts. balanced: FakeBalancedGate's
    indices, token i -> (i k + j) mod E. The sender is token i's rank (i mod G), for the remote
    count."""
    rng = np.random.default_rng(seed)
    e, k, g, n = experts, top_k, gpus, nodes
    if routing == "balanced":
        idx = (np.arange(tokens * k).reshape(tokens, k)) % e
    else:
        logits = rng.standard_normal((tokens, e))
        if routing == "node_limited":
            scores = 1.0 / (1.0 + np.exp(-logits))
            grouped = scores.reshape(tokens, n, e // n)
            top2 = np.sort(grouped, axis=2)[:, :, -2:].sum(axis=2)
            keep = np.argsort(-top2, axis=1)[:, :limit_nodes]
            mask = np.zeros((tokens, n), dtype=bool)
            np.put_along_axis(mask, keep, True, axis=1)
            scores = np.where(np.repeat(mask, e // n, axis=1), scores, -np.inf)
            logits = scores
        idx = np.argpartition(-logits, k - 1, axis=1)[:, :k]
    gpu = idx // (e // g)
    node = idx // (e // n)
    d_g = np.mean([len(set(row)) for row in gpu.tolist()])
    nodes_of = [set(row) for row in node.tolist()]
    d_n = np.mean([len(s) for s in nodes_of])
    sender = (np.arange(tokens) % g) // (g // n)
    remote = np.mean([len(s - {int(o)}) for s, o in zip(nodes_of, sender, strict=True)])
    return Reach(float(k), float(d_g), float(d_n), float(remote))


def ep_layout(plan: DispatchPlan, rank: int = 0) -> tuple[int, int]:
    """(nodes, GPUs per node) of ``rank``'s EP group on the cluster."""
    group = plan.group_of(rank, "ep")
    gpn = plan.topology.gpus_per_node
    nodes = len({r // gpn for r in group})
    return nodes, len(group) // nodes


def dispatcher_of(plan: DispatchPlan) -> str:
    """The plan's dispatcher: ``parallel.dispatcher``, else its stack's
    (:data:`STACK_DISPATCHER`), else ``alltoall``."""
    chosen = plan.parallel.dispatcher
    if chosen is not None:
        return str(chosen)
    stack = plan.training.stack
    return STACK_DISPATCHER.get(str(stack), "alltoall") if stack is not None else "alltoall"


def dispatch_sms_of(plan: DispatchPlan) -> int | None:
    """SMs the dispatch kernels hold (``parallel.dispatch_sms``, else :data:`DISPATCH_SMS`;
    None: the device's NCCL figure)."""
    if plan.parallel.dispatch_sms is not None:
        return int(plan.parallel.dispatch_sms)
    return DISPATCH_SMS[dispatcher_of(plan)]


def check_dispatch(plan: DispatchPlan) -> None:
    """The dispatch keys against the plan and the cluster (ConfigError, exit 2)."""
    par, spec = plan.parallel, plan.spec
    name = dispatcher_of(plan)
    explicit = par.dispatcher is not None
    if explicit and name in ("deepep", "hybridep", "allgather") and par.ep < 2:
        raise ConfigError(
            f"dispatcher {name} needs expert parallelism (parallel.ep > 1), got ep {par.ep}",
            key_path="parallel.dispatcher",
        )
    if par.routing == "node_limited" and par.routing_nodes is None:
        raise ConfigError(
            "routing: node_limited needs parallel.routing_nodes (M, DeepSeek-V3: 4)",
            key_path="parallel.routing_nodes",
        )
    if par.ep_overlap and name == "allgather":
        raise ConfigError(
            "ep_overlap needs an all-to-all dispatcher (alltoall, deepep, hybridep), got "
            "allgather (Megatron-Core: alltoall or flex only, transformer_config.py)",
            key_path="parallel.ep_overlap",
        )
    if not spec.is_moe:
        return
    nodes, _ = ep_layout(plan) if par.ep > 1 else (1, 1)
    m = par.routing_nodes
    if m is not None and m > nodes:
        raise ConfigError(
            f"routing_nodes {m} exceeds the {nodes} node(s) an EP group of ep {par.ep} spans",
            key_path="parallel.routing_nodes",
        )
    if par.ep < 2:
        return
    if name == "deepep":
        if nodes > DEEPEP_MAX_RDMA_PEERS:
            raise ConfigError(
                f"deepep normal kernels reach at most {DEEPEP_MAX_RDMA_PEERS} nodes "
                f"(LEGACY_NUM_MAX_RDMA_PEERS); ep {par.ep} spans {nodes}",
                key_path="parallel.dispatcher",
            )
        if par.ep > DEEPEP_MAX_NVL_PEERS and par.ep % DEEPEP_MAX_NVL_PEERS:
            raise ConfigError(
                f"deepep needs ep < {DEEPEP_MAX_NVL_PEERS} or a multiple of "
                f"{DEEPEP_MAX_NVL_PEERS}, got ep {par.ep}",
                key_path="parallel.ep",
            )
    if par.routing == "node_limited" and spec.num_experts % nodes:
        raise ConfigError(
            f"node-limited routing needs experts ({spec.num_experts}) divisible by the "
            f"{nodes} nodes of an EP group",
            key_path="parallel.routing",
        )
