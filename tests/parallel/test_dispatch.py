"""Expert dispatch: the routing closed forms against the seeded router, the tokens each
dispatcher sends over the network per MoE layer by hand, the one-line errors, and the two
fidelities on plans that use the new dispatch."""

from __future__ import annotations

import subprocess
import sys
import warnings
from dataclasses import replace
from math import prod
from pathlib import Path

import pytest

from collsim.cluster.topology import load_topology
from collsim.core.errors import CollsimWarning
from collsim.parallel.config import ParallelConfig, TrainingConfig
from collsim.parallel.dispatch import expected_reach, simulate_routing
from collsim.parallel.layer_comms import layer_comms
from collsim.parallel.plan import build_plan
from collsim.play.engine import simulate_step
from collsim.play.walk import estimate_step
from collsim.workload import get_preset

REPO = Path(__file__).resolve().parents[2]

CASES = [
    # experts, top_k, gpus (ep), nodes, routing, M
    (256, 8, 64, 8, "uniform", 0),
    (128, 8, 16, 2, "uniform", 0),
    (256, 8, 64, 8, "node_limited", 4),  # DeepSeek-V3 (section 3.2.2: M = 4)
    (256, 8, 128, 16, "node_limited", 4),
    (64, 8, 16, 2, "node_limited", 2),
    (128, 4, 64, 8, "balanced", 0),
    (128, 8, 32, 4, "balanced", 0),
    (96, 6, 24, 3, "balanced", 0),
]


@pytest.mark.parametrize("case", CASES, ids=[f"{c[4]}-{c[0]}e-{c[2]}g" for c in CASES])
def test_closed_form_matches_seeded_router(case: tuple[int, int, int, int, str, int]) -> None:
    e, k, g, n, routing, m = case
    closed = expected_reach(experts=e, top_k=k, gpus=g, nodes=n, routing=routing, limit_nodes=m)
    seen = simulate_routing(
        experts=e, top_k=k, gpus=g, nodes=n, routing=routing, limit_nodes=m, seed=7
    )
    assert closed.gpus == pytest.approx(seen.gpus, rel=0.02)
    assert closed.nodes == pytest.approx(seen.nodes, rel=0.02)
    assert closed.remote_nodes == pytest.approx(seen.remote_nodes, rel=0.02)


def _plan(nodes: int, ep: int, **par: object):  # type: ignore[no-untyped-def]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", CollsimWarning)
        return build_plan(
            load_topology("dgx_h100", nodes=nodes),
            get_preset("deepseek-v3"),
            TrainingConfig(global_batch=ep, micro_batch=1),
            ParallelConfig(dp=ep, ep=ep, zero=3, **par),  # type: ignore[arg-type]
            for_simulation=False,
        )


def _network_tokens(plan, rank: int = 0) -> float:  # type: ignore[no-untyped-def]
    """Tokens rank ``rank`` sends to other nodes in one forward dispatch, read off the layer's
    collectives in the nccl-tests convention (an all-to-all buffer is split evenly over the
    group; an all-gather's gathered buffer holds one block per member)."""
    spec = plan.spec
    token_bytes = spec.hidden * 2  # bf16
    gpn = plan.topology.gpus_per_node
    out = 0.0
    for c in layer_comms(plan, spec.num_layers - 1):
        if c.phase != "forward" or not c.name.startswith("ep_dispatch"):
            continue
        group = plan.group_of(rank, c.axis)
        off = sum(1 for r in group if r // gpn != rank // gpn)
        block = c.size_bytes / len(group)  # per peer (all_to_all) or per member (all_gather)
        out += block * off / token_bytes
    return out


T = 4096  # deepseek-v3 preset: seq 4096, micro-batch 1, no TP: tokens per rank


def _miss(total: int, unit: int, k: int) -> float:
    """C(total - unit, k) / C(total, k) as the product of the k draws, by hand."""
    return prod((total - unit - i) / (total - i) for i in range(k))


def test_tokens_over_the_network_by_hand() -> None:
    """DeepSeek-V3 (256 experts, top-8) on ep 64 = 8 nodes of 8 GPUs, 4096 tokens a rank."""
    k = 8
    # Megatron alltoall: k copies, 56 of the 64 destinations off the node
    assert _network_tokens(_plan(8, 64, dispatcher="alltoall")) == pytest.approx(T * k * 56 / 64)
    # DeepEP, uniform: once per remote node reached, 7 (1 - C(224, 8) / C(256, 8)) of them
    remote = 7 * (1 - _miss(256, 32, 8))
    got = _network_tokens(_plan(8, 64, dispatcher="deepep"))
    assert got == pytest.approx(T * remote, rel=1e-9)
    # DeepEP, node-limited M = 4: 4 nodes, the sender's own with probability 1/8
    got = _network_tokens(
        _plan(8, 64, dispatcher="deepep", routing="node_limited", routing_nodes=4)
    )
    assert got == pytest.approx(T * 4 * 7 / 8, rel=1e-9)
    # HybridEP, balanced (FakeBalancedGate): 8 consecutive experts from a multiple of 8 stay in
    # one node of 32 experts, so one node a token, remote with probability 7/8
    got = _network_tokens(_plan(8, 64, dispatcher="hybridep", routing="balanced"))
    assert got == pytest.approx(T * 7 / 8, rel=1e-9)
    # allgather: every token to every one of the 56 off-node ranks
    assert _network_tokens(_plan(8, 64, dispatcher="allgather")) == pytest.approx(T * 56)
    # the routing model does not change what alltoall sends
    assert _network_tokens(
        _plan(8, 64, dispatcher="alltoall", routing="node_limited", routing_nodes=4)
    ) == pytest.approx(T * k * 56 / 64)


def test_nvlink_forward_per_target_gpu() -> None:
    """DeepEP's NVLink leg carries T D_g h e per rank (D_g = 64 (1 - C(252, 8) / C(256, 8)))."""
    plan = _plan(8, 64, dispatcher="deepep")
    nvl = [c for c in layer_comms(plan, 60) if c.name == "ep_dispatch_nvl" and c.phase == "forward"]
    assert len(nvl) == 1 and nvl[0].axis == "ep_local"
    d_g = 64 * (1 - _miss(256, 4, 8))
    assert nvl[0].size_bytes == pytest.approx(T * d_g * 7168 * 2, rel=1e-9)
    assert plan.group_of(0, "ep_local") == tuple(range(8))
    assert plan.group_of(3, "ep_node") == tuple(range(3, 64, 8))


def _yaml(tmp_path: Path, nodes: int, ep: int, extra: str) -> Path:
    path = tmp_path / "plan.yaml"
    path.write_text(
        f"name: t\ncluster: {{topology: dgx_h100, nodes: {nodes}}}\n"
        "model: {preset: deepseek-v3, layers: 4, first_k_dense: 1}\n"
        f"training: {{global_batch: {nodes * 8}, micro_batch: 1}}\n"
        f"parallel: {{dp: {nodes * 8}, ep: {ep}, zero: 3, {extra}}}\n"
    )
    return path


@pytest.mark.parametrize(
    ("nodes", "ep", "extra", "needle"),
    [
        (1, 1, "dispatcher: deepep", "parallel.dispatcher"),
        (32, 256, "dispatcher: deepep", "at most 20 nodes"),
        (1, 8, "routing: node_limited, routing_nodes: 4", "parallel.routing_nodes"),
        (2, 16, "dispatcher: allgather, ep_overlap: a2a", "parallel.ep_overlap"),
    ],
)
def test_bad_dispatch_plans_exit_2(
    tmp_path: Path, nodes: int, ep: int, extra: str, needle: str
) -> None:
    path = _yaml(tmp_path, nodes, ep, extra)
    proc = subprocess.run(
        [
            sys.executable,
            "-c",
            "import sys; from collsim.cli import main; sys.exit(main())",
            "run",
            str(path),
        ],
        capture_output=True,
        text=True,
        timeout=300,
        cwd=REPO,
        env={"PYTHONPATH": str(REPO), "PATH": "/usr/bin:/bin"},
    )
    assert proc.returncode == 2, proc.stderr
    lines = [ln for ln in proc.stderr.strip().splitlines() if ln.strip()]
    assert len(lines) == 1 and needle in lines[0], proc.stderr
    assert "Traceback" not in proc.stderr


@pytest.mark.parametrize(
    "par",
    [
        {"dispatcher": "deepep", "routing": "node_limited", "routing_nodes": 2},
        {"dispatcher": "hybridep", "routing": "balanced"},
        {"dispatcher": "deepep", "ep_overlap": "dualpipev"},
        {"dispatcher": "allgather"},
    ],
)
def test_closed_form_equals_engine_on_new_dispatch(par: dict[str, object]) -> None:
    topo = load_topology("dgx_h100", nodes=2)
    spec = replace(get_preset("deepseek-v3"), num_layers=4, first_k_dense=1)
    training = TrainingConfig(global_batch=64, micro_batch=1)
    parallel = ParallelConfig(dp=16, ep=16, zero=1, **par)  # type: ignore[arg-type]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", CollsimWarning)
        des = simulate_step(topo, spec, training, parallel, fidelity="fused")
        closed = estimate_step(topo, spec, training, parallel)
    assert closed.step_time_s == pytest.approx(des.step_time_s, rel=0.01)
    assert des.breakdown_s["ep_exposed"] > 0


def test_nvlink_leg_runs_beside_the_network_leg() -> None:
    """The dispatch step of a two-node DeepEP plan carries its NVLink leg beside its network
    leg, and lasts as long as the slower of the two (not their sum)."""
    from collsim.step.build import build_schedule
    from collsim.step.pricing import ClosedPricer, SegmentPrices

    topo = load_topology("dgx_h100", nodes=2)
    spec = replace(get_preset("deepseek-v3"), num_layers=4, first_k_dense=1)
    training = TrainingConfig(global_batch=16, micro_batch=1)
    parallel = ParallelConfig(dp=16, ep=16, zero=1, dispatcher="deepep")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", CollsimWarning)
        sched = build_schedule(topo, spec, training, parallel)
    prices = SegmentPrices(sched.plan, ClosedPricer(topo))
    layer = sched.stages[0].chunks[0].forward[-2]  # an MoE layer
    legs = [st for st in layer.steps if st.op and st.axis == "ep_node"]
    assert len(legs) == 2  # dispatch and combine
    for st in legs:
        (nvl,) = st.beside
        assert nvl.axis == "ep_local"
        net_s = prices.pricer.cost(st.op, st.size_bytes, prices.step_group(0, st)).time_s
        nvl_s = prices.pricer.cost(nvl.op, nvl.size_bytes, prices.step_group(0, nvl)).time_s
        assert net_s > 0 and nvl_s > 0
        assert prices.collective_s(0, st) == pytest.approx(max(net_s, nvl_s))


def test_overlap_hides_the_exchange_and_its_sms_slow_the_compute() -> None:
    """DualPipeV pairing hides most of DeepEP's exchange; the compute beside it loses the SMs
    the kernels hold: more SMs, more interference (1 / (1 - s / 132) on an H100)."""
    topo = load_topology("dgx_h100", nodes=2)
    spec = replace(get_preset("deepseek-v3"), num_layers=4, first_k_dense=1)
    training = TrainingConfig(global_batch=64, micro_batch=1)

    def run(**par: object):  # type: ignore[no-untyped-def]
        parallel = ParallelConfig(dp=16, ep=16, zero=1, dispatcher="deepep", **par)  # type: ignore[arg-type]
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", CollsimWarning)
            return estimate_step(topo, spec, training, parallel).breakdown_s

    plain = run()
    paired = run(ep_overlap="dualpipev")
    more_sms = run(ep_overlap="dualpipev", dispatch_sms=40)
    assert paired["ep_exposed"] < 0.5 * plain["ep_exposed"]
    assert paired["interference"] > plain["interference"]
    assert more_sms["interference"] > paired["interference"]


@pytest.mark.parametrize(
    ("stack", "explicit", "expected"),
    [
        ("megatron_te", None, "allgather"),  # TransformerConfig's default
        ("nemo_automodel", None, "deepep"),  # BackendConfig's default with DeepEP installed
        ("torchtitan", None, "alltoall"),
        (None, None, "alltoall"),
        ("nemo_automodel", "hybridep", "hybridep"),  # an explicit key overrides the stack
    ],
)
def test_stack_sets_the_dispatcher(stack: str | None, explicit: str | None, expected: str) -> None:
    from collsim.parallel.dispatch import dispatcher_of

    with warnings.catch_warnings():
        warnings.simplefilter("ignore", CollsimWarning)
        plan = build_plan(
            load_topology("dgx_h100", nodes=2),
            get_preset("deepseek-v3"),
            TrainingConfig(global_batch=16, micro_batch=1, stack=stack),
            ParallelConfig(dp=16, ep=16, zero=3, dispatcher=explicit),
            for_simulation=False,
        )
    assert dispatcher_of(plan) == expected
