"""Stragglers in the step DES: slow GPUs, slow nodes and degraded links on named ranks.

Must-show: one GPU at 0.9x clock in a synchronous 3D job slows the step by what the critical
path says, checked against an independent recurrence over the schedule's op order; the reduced
set of simulated ranks matches the simulation of every rank; the report names who waited for
whom; the closed form walks a slow GPU and refuses a degraded link.
"""

from __future__ import annotations

from pathlib import Path

import pytest
from click.testing import CliRunner

from collsim.cli import cli
from collsim.core.errors import ConfigError
from collsim.parallel.config import ParallelConfig, TrainingConfig
from collsim.parallel.pipeline import Phase
from collsim.play.engine import prepare_step, simulate_step
from collsim.play.engine.core import simulated_ranks
from collsim.play.walk import estimate_step
from collsim.step.build import build_schedule
from collsim.step.stragglers import SlowGPU, SlowLink, SlowNode, StragglerConfig

from .conftest import topology


def _gpu(rank: int, factor: float = 0.9) -> StragglerConfig:
    return StragglerConfig(slow_gpu=SlowGPU(ranks=(rank,), clock_factor=factor))


def _critical_path_s(schedule, factors: dict[int, float]) -> float:
    """The step of one pipeline with zero communication, computed from the schedule alone.

    Each stage runs its ops in the schedule's order; a forward of micro-batch m on stage s
    starts after the forward of m on s - 1, a backward after the backward of m on s + 1 (the
    last stage's backward follows its own forward, earlier in its order). An op lasts its
    segments' compute divided by the stage's clock factor. After its last op a stage runs its
    optimizer (also slowed); the gradient reductions and the tied-embedding all-reduce cost
    nothing, but the latter makes the first and last stage wait for each other.
    """
    p = schedule.plan.pp
    end: dict[tuple[int, Phase, int], float] = {}
    free = [0.0] * p
    todo = {s: list(schedule.pipeline[s]) for s in range(p)}
    while any(todo.values()):
        progressed = False
        for s in range(p):
            while todo[s]:
                op = todo[s][0]
                if op.phase is Phase.FORWARD:
                    dep = (s - 1, Phase.FORWARD, op.microbatch) if s > 0 else None
                else:
                    dep = (s + 1, Phase.BACKWARD, op.microbatch) if s < p - 1 else None
                if dep is not None and dep not in end:
                    break
                chunk = schedule.stages[s].chunks[op.chunk]
                segs = chunk.forward if op.phase is Phase.FORWARD else chunk.backward
                start = max(free[s], end[dep] if dep is not None else 0.0)
                free[s] = start + sum(seg.compute_s for seg in segs) / factors.get(s, 1.0)
                end[(s, op.phase, op.microbatch)] = free[s]
                todo[s].pop(0)
                progressed = True
        assert progressed, "the schedule's op order deadlocks"
    if p > 1 and schedule.plan.spec.tied_embeddings:
        free[0] = free[p - 1] = max(free[0], free[p - 1])
    return max(
        free[s]
        + (schedule.framework_step_s.get(s, 0.0) + schedule.optimizer_s[s]) / factors.get(s, 1.0)
        for s in range(p)
    )


# -- must show 4: a 0.9x GPU in a 3D job ------------------------------------------------------


@pytest.mark.parametrize("straggler", [1, 6, 13], ids=["dp0-pp0-tp1", "dp1-pp1-tp0", "dp3-pp0"])
def test_one_gpu_at_0_9_slows_the_step_by_the_critical_path(small_spec, straggler: int) -> None:
    """tp 2 x pp 2 x dp 4 on two DGX A100, 1F1B, 8 micro-batches, no communication cost."""
    topo = topology("dgx_a100", 2)
    tr = TrainingConfig(global_batch=32, micro_batch=1, recompute="selective")
    par = ParallelConfig(tp=2, pp=2, dp=4, zero=1)
    schedule = build_schedule(topo, small_spec, tr, par)
    stage = schedule.plan.coords(straggler).pp
    base_hand = _critical_path_s(schedule, {})
    slow_hand = _critical_path_s(schedule, {stage: 0.9})
    slow = simulate_step(
        topo, small_spec, tr, par, zero_communication=True, stragglers=_gpu(straggler)
    )
    st = slow.stragglers
    assert st.baseline_step_time_s == pytest.approx(base_hand, rel=1e-9)
    assert slow.step_time_s == pytest.approx(slow_hand, rel=1e-9)
    assert st.slowdown == pytest.approx(slow_hand / base_hand, rel=1e-9)
    # the slowed stage is not the bottleneck of every op: less than the full 1/0.9
    assert 1.0 < st.slowdown < 1 / 0.9
    # the closed form walks the same critical path
    closed = estimate_step(
        topo, small_spec, tr, par, zero_communication=True, stragglers=_gpu(straggler)
    )
    assert closed.step_time_s == pytest.approx(slow_hand, rel=1e-9)


def test_without_pipeline_the_step_stretches_by_one_over_the_factor(small_spec) -> None:
    """pp = 1, nothing communicated: every op and the optimizer of the slow replica take
    1 / 0.9 as long and the others wait for it: the step is exactly 1 / 0.9 longer."""
    topo = topology("dgx_a100", 1)
    tr = TrainingConfig(global_batch=16, micro_batch=1)
    par = ParallelConfig(tp=2, pp=1, dp=4, zero=0)
    slow = simulate_step(topo, small_spec, tr, par, zero_communication=True, stragglers=_gpu(5))
    assert slow.stragglers.slowdown == pytest.approx(1 / 0.9, rel=1e-12)


def test_with_communication_the_slowdown_is_the_slowed_pipelines_critical_path(small_spec) -> None:
    """With real collectives the DES (fused, nothing contended) and the closed form agree."""
    topo = topology("dgx_a100", 2)
    tr = TrainingConfig(global_batch=32, micro_batch=1, recompute="selective")
    par = ParallelConfig(tp=2, pp=2, dp=4, zero=1, sequence_parallel=True)
    des = simulate_step(topo, small_spec, tr, par, fidelity="fused", stragglers=_gpu(6))
    closed = estimate_step(topo, small_spec, tr, par, stragglers=_gpu(6))
    assert des.stragglers.slowdown > 1.0
    assert closed.step_time_s == pytest.approx(des.step_time_s, rel=1e-9)
    assert closed.stragglers.baseline_step_time_s == pytest.approx(
        des.stragglers.baseline_step_time_s, rel=1e-9
    )


# -- the reduced set of simulated ranks -------------------------------------------------------

CASES = [  # (topology, nodes, tp, pp, dp, zero, stragglers)
    ("dgx_a100", 1, 2, 2, 2, 0, _gpu(7, 0.8)),
    ("dgx_a100", 1, 2, 2, 2, 0, _gpu(1, 0.8)),  # on the representative pipeline
    ("dgx_a100", 2, 2, 2, 4, 1, _gpu(13, 0.7)),
    ("dgx_a100", 2, 4, 2, 2, 3, _gpu(9, 0.8)),  # FSDP
    ("pcie_8gpu", 2, 2, 2, 4, 0, _gpu(1, 0.8)),  # dp contends: DES peers
    ("dgx_a100", 2, 2, 2, 4, 1, StragglerConfig(slow_node=SlowNode(nodes=(1,), clock_factor=0.9))),
    (
        "dgx_a100",
        2,
        2,
        2,
        4,
        1,
        StragglerConfig(slow_link=SlowLink(ranks=(15,), port="nic", bandwidth_factor=0.25)),
    ),
    (
        "pcie_8gpu",
        2,
        2,
        2,
        4,
        0,
        StragglerConfig(slow_link=SlowLink(ranks=(6,), port="nvlink", bandwidth_factor=0.5)),
    ),
    (
        "dgx_a100",
        2,
        2,
        2,
        4,
        0,
        StragglerConfig(
            slow_gpu=SlowGPU(ranks=(2,), clock_factor=0.9),
            slow_link=SlowLink(links=("n1.nic3.tx",), bandwidth_factor=0.5),
        ),
    ),
]


SCHEDULES = {  # case index -> (schedule, virtual stages), 1F1B otherwise
    2: ("interleaved", 2),
    5: ("gpipe", 1),
}


@pytest.mark.parametrize("case", CASES, ids=[f"case{i}" for i in range(len(CASES))])
def test_reduced_ranks_match_all_ranks(small_spec, case) -> None:
    name, nodes, tp, pp, dp, zero, stragglers = case
    topo = topology(name, nodes)
    tr = TrainingConfig(global_batch=4 * dp, micro_batch=1, recompute="selective")
    schedule, virtual = SCHEDULES.get(CASES.index(case), ("1f1b", 1))
    # pcie_8gpu (one NIC per node): these cases put the contended dp axis on the DES, as with
    # dp outermost; with pp outermost the pp sends cross the shared NIC instead, where the
    # representatives' peers do not reproduce the all-ranks run with a straggler exactly
    order = "tp-cp-ep-pp-dp" if name == "pcie_8gpu" else None
    par = ParallelConfig(
        tp=tp, pp=pp, dp=dp, zero=zero, schedule=schedule, virtual_stages=virtual, order=order
    )
    few = simulate_step(topo, small_spec, tr, par, stragglers=stragglers)
    every = simulate_step(topo, small_spec, tr, par, stragglers=stragglers, all_ranks=True)
    assert len(few.simulated_ranks) < tp * pp * dp
    assert few.stragglers.slowdown > 1.0
    assert few.step_time_s == pytest.approx(every.step_time_s, rel=1e-9)
    assert few.memory_peak_bytes == every.memory_peak_bytes
    for key, value in few.breakdown_s.items():
        assert value == pytest.approx(every.breakdown_s[key], rel=1e-9, abs=1e-12)


def test_layer_fidelity_matches_all_ranks(small_spec) -> None:
    """On the flow network the representatives' peer groups run at the representatives'
    times; in the all-ranks run the unslowed groups may also be delayed by the slowed group's
    traffic. The two differ by 4e-4 of the step here (they are equal without stragglers)."""
    topo = topology("pcie_8gpu", 2)
    tr = TrainingConfig(global_batch=16, micro_batch=1)
    par = ParallelConfig(tp=2, pp=2, dp=4, zero=0, order="tp-cp-ep-pp-dp")
    kw = {"fidelity": "layer", "stragglers": _gpu(9, 0.8)}
    few = simulate_step(topo, small_spec, tr, par, **kw)
    every = simulate_step(topo, small_spec, tr, par, all_ranks=True, **kw)
    assert few.step_time_s == pytest.approx(every.step_time_s, rel=1e-3)
    assert few.stragglers.slowdown > 1.0


def test_simulated_set_rule(small_spec) -> None:
    """Pipelines dp 0 and the straggler's, at tp 0 (its TP group's stand-in); a straggler on
    dp 0 adds the first unaffected replica; a degraded link adds its rank's tp index."""
    topo = topology("dgx_a100", 2)
    tr = TrainingConfig(global_batch=16, micro_batch=1)
    plan = build_schedule(topo, small_spec, tr, ParallelConfig(tp=2, pp=2, dp=4)).plan

    def ranks(cfg: StragglerConfig) -> set[tuple[int, int, int]]:
        out = set()
        for r in simulated_ranks(plan, cfg.resolve(topo)):
            c = plan.coords(r)
            out.add((c.dp, c.pp, c.tp))
        return out

    dp_of_13, tp_of_13 = plan.coords(13).dp, plan.coords(13).tp
    assert tp_of_13 == 1
    assert ranks(_gpu(13)) == {(d, s, 0) for d in (0, dp_of_13) for s in (0, 1)}
    assert ranks(_gpu(plan.rank(dp=0, pp=1, tp=1))) == {(d, s, 0) for d in (0, 1) for s in (0, 1)}
    link = StragglerConfig(slow_link=SlowLink(ranks=(13,), bandwidth_factor=0.5))
    assert ranks(link) == {(d, s, t) for d in (0, dp_of_13) for s in (0, 1) for t in (0, 1)}
    assert simulated_ranks(plan, None) == [plan.rank(dp=0, pp=s, tp=0) for s in (0, 1)]


# -- who waits for whom -----------------------------------------------------------------------


def test_report_names_the_rendezvous_that_waited_for_the_straggler(small_spec) -> None:
    topo = topology("dgx_a100", 2)
    tr = TrainingConfig(global_batch=16, micro_batch=1)
    par = ParallelConfig(tp=2, pp=2, dp=4, zero=0)
    result = simulate_step(topo, small_spec, tr, par, stragglers=_gpu(13, 0.8))
    plan = prepare_step(topo, small_spec, tr, par).plan
    c = plan.coords(13)
    stand_in = plan.rank(dp=c.dp, pp=c.pp, tp=0)
    representative = plan.rank(dp=0, pp=c.pp, tp=0)
    st = result.stragglers
    assert st.tp_paced_ranks == sorted(plan.group_of(13, "tp"))
    waits = [w for w in st.waits if str(w["axis"]) == "dp" and representative in w["group"]]
    assert waits, st.waits
    wait = waits[0]
    assert wait["waited_for"] == stand_in
    assert set(wait["waits_s"]) == {representative}
    assert wait["wait_s"] > 0
    # the step costs what the slowed pipeline adds
    assert st.extra_s == pytest.approx(st.step_time_s - st.baseline_step_time_s)


def test_full_speed_is_no_straggler(small_spec) -> None:
    topo = topology("dgx_a100", 1)
    tr = TrainingConfig(global_batch=8, micro_batch=1)
    par = ParallelConfig(tp=2, pp=2, dp=2)
    plain = simulate_step(topo, small_spec, tr, par)
    same = simulate_step(topo, small_spec, tr, par, stragglers=_gpu(3, 1.0))
    assert same.step_time_s == plain.step_time_s
    assert same.stragglers is None


# -- the closed form walks a slow GPU, refuses what it cannot place ---------------------------


def test_closed_form_refuses_links_and_mixed_pipelines(small_spec) -> None:
    topo = topology("dgx_a100", 2)
    tr = TrainingConfig(global_batch=16, micro_batch=1)
    par = ParallelConfig(tp=2, pp=2, dp=4)
    link = StragglerConfig(slow_link=SlowLink(ranks=(3,), bandwidth_factor=0.5))
    with pytest.raises(ConfigError) as err:
        estimate_step(topo, small_spec, tr, par, stragglers=link)
    assert err.value.key_path == "stragglers.slow_link"
    assert "--fidelity" in str(err.value)
    plan = build_schedule(topo, small_spec, tr, par).plan
    two = StragglerConfig(
        slow_gpu=SlowGPU(
            ranks=(plan.rank(dp=1, pp=0, tp=0), plan.rank(dp=2, pp=1, tp=0)), clock_factor=0.9
        )
    )
    with pytest.raises(ConfigError, match="one slowed pipeline"):
        estimate_step(topo, small_spec, tr, par, stragglers=two)
    # the DES plays them: both replicas slowed, everyone waits for both
    des = simulate_step(topo, small_spec, tr, par, stragglers=two)
    every = simulate_step(topo, small_spec, tr, par, stragglers=two, all_ranks=True)
    assert des.step_time_s == pytest.approx(every.step_time_s, rel=1e-9)


# -- the scenario section ---------------------------------------------------------------------

SCENARIO = """\
name: strag
cluster: {topology: dgx_a100, nodes: 1}
model: {layers: 4, hidden: 256, heads: 4, seq_len: 128, vocab: 1024}
training: {global_batch: 8, micro_batch: 1}
parallel: {tp: 2, pp: 2, dp: 2, order: tp-cp-ep-pp-dp}
stragglers:
  slow_gpu: {ranks: [5], clock_factor: 0.9}
"""


@pytest.fixture
def scenario_file(tmp_path: Path) -> Path:
    path = tmp_path / "strag.yaml"
    path.write_text(SCENARIO)
    return path


def test_run_reports_the_straggler(scenario_file: Path, tmp_path: Path) -> None:
    out = tmp_path / "r.json"
    res = CliRunner().invoke(cli, ["run", str(scenario_file), "--json", str(out)])
    assert res.exit_code == 0, res.output
    assert "stragglers: rank 5 at 0.9x clock" in res.stdout
    assert "without stragglers" in res.stdout
    assert "waited" in res.stdout
    import json

    details = json.loads(out.read_text())["details"]["stragglers"]
    assert details["slowdown"] > 1.0
    assert details["longest_wait"]["waited_for"] in details["tp_paced_ranks"]
    assert details["longest_wait"]["for_straggler"]
    closed = CliRunner().invoke(cli, ["run", str(scenario_file), "--fidelity", "closed"])
    assert closed.exit_code == 0, closed.output
    assert "closed form" in closed.stdout


@pytest.mark.parametrize(
    "override, key",
    [
        ("stragglers.slow_gpu.clock_factor=1.5", "stragglers.slow_gpu.clock_factor"),
        ("stragglers.slow_gpu.clock_factor=0", "stragglers.slow_gpu.clock_factor"),
        ("stragglers.slow_gpu.ranks=[99]", "stragglers.slow_gpu.ranks"),
        ("stragglers.slow_gpu.ranks=[-1]", "stragglers.slow_gpu.ranks"),
        ("stragglers.slow_gpu.speed=0.5", "stragglers.slow_gpu.speed"),
        ("stragglers.slow_node.nodes=[3]", "stragglers.slow_node.clock_factor"),
        ("stragglers.slow_link={ranks: [1], port: pcie, bandwidth_factor: 0.5}", "slow_link.port"),
        ("stragglers.slow_link={links: [nowhere], bandwidth_factor: 0.5}", "slow_link.links"),
        ("stragglers.slow_link={bandwidth_factor: 0.5}", "stragglers.slow_link"),
        ("stragglers.slow_link={ranks: [1], bandwidth_factor: 2}", "slow_link.bandwidth_factor"),
    ],
)
def test_bad_straggler_input_is_one_line_exit_2(
    scenario_file: Path, override: str, key: str
) -> None:
    res = CliRunner().invoke(cli, ["run", str(scenario_file), "--set", override])
    assert res.exit_code == 2, res.output
    lines = res.stderr.strip().splitlines()
    assert len(lines) == 1 and key in lines[0], res.stderr
    assert "Traceback" not in res.output


def test_sweep_over_severity_gives_a_slowdown_curve(scenario_file: Path) -> None:
    from collsim.study.sweep import build_points, run_sweep

    factors = ["1.0", "0.95", "0.9", "0.8"]
    points = build_points(sets=[("stragglers.slow_gpu.clock_factor", factors)])
    outcomes = run_sweep(scenario_file, points)
    times = [o.result.step_time_s for o in outcomes if o.result is not None]
    assert len(times) == len(factors)
    assert times == sorted(times) and times[0] < times[-1]
