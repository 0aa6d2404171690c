"""Make the figures in docs/figures/ from simulations (run from the repository root).

    .venv/bin/python docs/make_figures.py            # all figures, about a minute on one core
    .venv/bin/python docs/make_figures.py scaling    # only some: scaling memory timeline
                                                     # step pipeline breakdown collectives
                                                     # algorithms

Every number drawn comes from collsim itself: the discrete-event engine for steps, the closed
form of collectives.cost for the collective curves (with the published nccl-tests sweep of a
DGX H100 from the shared reference data beside it when that file is present).
"""

from __future__ import annotations

import sys
import warnings
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
OUT = REPO / "docs" / "figures"
SCENARIOS = REPO / "scenarios"
NCCL_REFERENCE = REPO.parent / "shared" / "reference" / "nccl_allreduce_dgx_h100_8gpu.csv"


def _warn_quietly() -> None:
    from collsim.core.errors import CollsimWarning

    warnings.simplefilter("ignore", CollsimWarning)


def scaling() -> Path:
    """The seed chart for real: DDP, FSDP/ZeRO-3 and DDP with overlap, GPT-3 2.7B on DGX A100,
    1 to 512 GPUs, weak scaling with one 2048-token sequence per GPU (small per-GPU work, so
    that communication matters)."""
    from collsim.report.frames import sweep_frame
    from collsim.report.plots import plot_scaling, save_figure
    from collsim.study.sweep import build_points, parse_gpus, run_sweep

    plans = {
        "DDP": ["parallel.zero=0", "parallel.ddp.overlap=false"],
        "FSDP / ZeRO-3": ["parallel.zero=3"],
        "DDP + comm overlap": ["parallel.zero=0", "parallel.ddp.overlap=true"],
    }
    common = [
        "cluster.topology=dgx_a100",
        "model.preset=gpt3-2.7b",
        "training.global_batch=8",
        "training.micro_batch=1",
        "training.recompute=selective",
    ]
    plans = {name: common + over for name, over in plans.items()}
    points = build_points(gpus=parse_gpus("1,2,...,512"), plans=plans)
    frame = sweep_frame(run_sweep(SCENARIOS / "ddp_gpt3_1.3b.yaml", points))
    frame.to_csv(OUT / "scaling.csv", index=False)
    fig = plot_scaling(
        frame, title="GPT-3 2.7B on DGX A100, one sequence per GPU (simulated, weak scaling)"
    )
    return save_figure(fig, OUT / "scaling.png")


def memory() -> Path:
    """Per-GPU memory of a 7B model (fp32 Adam, as in the seed) for DDP and ZeRO-1/2/3."""
    from collsim.report.frames import sweep_frame
    from collsim.report.plots import plot_memory, save_figure
    from collsim.study.sweep import build_points, parse_gpus, run_sweep

    plans = {
        "DDP": ["parallel.zero=0"],
        "ZeRO-1": ["parallel.zero=1"],
        "ZeRO-2": ["parallel.zero=2"],
        "ZeRO-3 / FSDP": ["parallel.zero=3"],
    }
    points = build_points(gpus=parse_gpus("8,16,...,64"), plans=plans)
    frame = sweep_frame(run_sweep(SCENARIOS / "seed_7b_fp32_ddp.yaml", points))
    frame.to_csv(OUT / "memory.csv", index=False)
    fig = plot_memory(
        frame, title="Llama-2 7B, fp32 Adam, DGX A100 80GB: peak memory per GPU (simulated)"
    )
    return save_figure(fig, OUT / "memory.png")


def timeline() -> Path:
    """Memory over one FSDP step of Llama-2 7B on 16 H100s, rank 0."""
    from collsim.report.plots import plot_memory_timeline, save_figure
    from collsim.study.sweep import SweepPoint, run_point

    outcome = run_point(SCENARIOS / "fsdp_llama2_7b.yaml", SweepPoint("", None), trace=True)
    assert outcome.result is not None, outcome.reason
    fig = plot_memory_timeline(
        outcome.result,
        rank=0,
        title="FSDP (ZeRO-3) Llama-2 7B on 16 H100: memory of rank 0 over one step",
    )
    return save_figure(fig, OUT / "memory_timeline.png")


def step() -> Path:
    """One step at a glance (what `collsim plot step` draws): GPT-3 13B, TP 8 x PP 4,
    interleaved 1F1B with 2 chunks per stage, 16 micro-batches."""
    from collsim.report.plots import plot_step, save_figure
    from collsim.study.sweep import SweepPoint, run_point

    outcome = run_point(
        SCENARIOS / "pipeline_13b_interleaved.yaml", SweepPoint("", None), trace=True
    )
    assert outcome.result is not None, outcome.reason
    fig = plot_step(
        outcome.result,
        stage_of=lambda rank: (rank // 8) % 4,
        title="GPT-3 13B, TP 8 x PP 4, interleaved 1F1B on 32 A100 (simulated)",
    )
    return save_figure(fig, OUT / "step.png")


def pipeline() -> Path:
    """GPipe, 1F1B and interleaved 1F1B on GPT-3 13B, TP 8 x PP 4, 8 micro-batches."""
    from collsim.report.plots import plot_pipeline, save_figure
    from collsim.study.sweep import SweepPoint, run_point

    results = {}
    for kind, label, v in (
        ("gpipe", "GPipe", 1),
        ("1f1b", "1F1B", 1),
        ("interleaved", "interleaved 1F1B (v=2)", 2),
    ):
        point = SweepPoint(
            "",
            None,
            (
                f"parallel.schedule={kind}",
                f"parallel.virtual_stages={v}",
                "training.global_batch=8",
            ),
        )
        outcome = run_point(SCENARIOS / "pipeline_13b_1f1b.yaml", point, trace=True)
        assert outcome.result is not None, outcome.reason
        results[label] = outcome.result
    fig = plot_pipeline(
        results,
        stage_of=lambda rank: (rank // 8) % 4,
        title="GPT-3 13B, TP 8 x PP 4 on 32 A100, 8 micro-batches (simulated)",
    )
    return save_figure(fig, OUT / "pipeline.png")


def breakdown() -> Path:
    """Where the step goes for GPT-3 175B on 1024 A100: the scenario's plan, Megatron's
    published plan and the best plans of `collsim search`, all simulated."""
    import dataclasses

    from collsim.play.engine import simulate_step
    from collsim.report.frames import results_frame
    from collsim.report.plots import plot_breakdown, save_figure
    from collsim.study.scenario import load_scenario
    from collsim.study.search import search_plans

    scenario = load_scenario(SCENARIOS / "3d_175b.yaml")
    topology = scenario.cluster.load()
    found = search_plans(topology, scenario.model, scenario.training, scenario.parallel, top_k=3)
    rows = []
    for entry in found.simulated:
        rows.append(({"plan": "search: " + entry.candidate.label}, entry.result))
    megatron8 = dataclasses.replace(scenario.parallel, schedule="interleaved", virtual_stages=2)
    megatron16 = dataclasses.replace(megatron8, pp=16, dp=8)
    for label, parallel in (
        ("scenario: tp8 pp8 dp16 mb1 1f1b zero1 rc=full", scenario.parallel),
        ("Megatron-like: tp8 pp8 dp16 mb1 interleaved v2 zero1 rc=full", megatron8),
        ("Megatron-like: tp8 pp16 dp8 mb1 interleaved v2 zero1 rc=full", megatron16),
    ):
        rows.append(
            ({"plan": label}, simulate_step(topology, scenario.model, scenario.training, parallel))
        )
    frame = results_frame(rows)
    frame.to_csv(OUT / "breakdown.csv", index=False)
    fig = plot_breakdown(frame, title="GPT-3 175B on 1024 A100, global batch 1536 (simulated)")
    return save_figure(fig, OUT / "breakdown.png")


def collectives() -> Path:
    """all_reduce bus bandwidth vs size on one DGX H100 per algorithm (closed form), with the
    published nccl-tests sweep of the same machine."""
    import pandas as pd

    from collsim.cluster.topology import load_topology
    from collsim.collectives import Group
    from collsim.report.frames import collective_cost_frame, read_collective_csv
    from collsim.report.plots import plot_collectives, save_figure

    topology = load_topology("dgx_h100", nodes=1)
    sizes = [1 << k for k in range(10, 35)]
    frame = collective_cost_frame(
        "all_reduce",
        sizes,
        Group.all(topology),
        ["ring", "tree", "halving_doubling", "direct", "nvls", "auto"],
    )
    frame["algorithm"] = frame["algorithm"].replace({"auto": "auto (NCCL-like choice)"})
    frames = [frame]
    if NCCL_REFERENCE.exists():
        measured = read_collective_csv(NCCL_REFERENCE)
        measured = measured[measured["size_bytes"] >= sizes[0]]
        measured["algorithm"] = "nccl-tests measured (DGX H100)"
        frames.append(measured)
    fig = plot_collectives(
        pd.concat(frames, ignore_index=True),
        title="all_reduce on 8 x H100 (NVLink4 + NVSwitch): closed form vs nccl-tests",
    )
    return save_figure(fig, OUT / "collectives.png")


def algorithms() -> Path:
    """all_reduce bus bandwidth vs size per NCCL algorithm across two nodes (closed form):
    GCP A3 Mega (8 x 200 Gb/s GPUDirect-TCPXO per node) with its published nccl-tests sweep,
    and what ``auto`` (NCCL 2.30.7's tuner) picks at each size."""
    import pandas as pd

    from collsim.cluster.topology import load_topology
    from collsim.collectives import Group
    from collsim.report.frames import collective_cost_frame, read_collective_csv
    from collsim.report.plots import plot_collectives, save_figure

    sizes = [1 << k for k in range(10, 34)]
    frames = []
    a3 = Group.all(load_topology("gcp_a3_mega", nodes=2))
    frame = collective_cost_frame("all_reduce", sizes, a3, ["ring", "tree", "auto"])
    frame["algorithm"] = frame["algorithm"].replace({"auto": "auto (NCCL 2.30.7 tuner)"})
    frame["algorithm"] = "A3 Mega x2: " + frame["algorithm"].astype(str)
    frames.append(frame)
    measured_path = REPO / "tests" / "data" / "nccl_allreduce_h100_2node_a3mega.csv"
    measured = read_collective_csv(measured_path)
    measured = measured[measured["size_bytes"] >= sizes[0]]
    measured["algorithm"] = "A3 Mega x2: nccl-tests measured"
    frames.append(measured)
    dgx = Group.all(load_topology("dgx_h100", nodes=2))
    frame = collective_cost_frame("all_reduce", sizes, dgx, ["ring", "nvls_tree", "auto"])
    frame["algorithm"] = "DGX H100 x2: " + frame["algorithm"].astype(str)
    frames.append(frame)
    fig = plot_collectives(
        pd.concat(frames, ignore_index=True),
        title="all_reduce on 2 nodes x 8 H100 per algorithm (closed form) vs nccl-tests",
    )
    pd.concat(frames, ignore_index=True).to_csv(OUT / "algorithms.csv", index=False)
    return save_figure(fig, OUT / "algorithms.png")


FIGURES = {
    "scaling": scaling,
    "memory": memory,
    "timeline": timeline,
    "step": step,
    "pipeline": pipeline,
    "breakdown": breakdown,
    "collectives": collectives,
    "algorithms": algorithms,
}


def main(argv: list[str]) -> int:
    names = argv or list(FIGURES)
    unknown = [n for n in names if n not in FIGURES]
    if unknown:
        print(
            f"unknown figure(s) {', '.join(unknown)}; choose from {', '.join(FIGURES)}",
            file=sys.stderr,
        )
        return 2
    OUT.mkdir(parents=True, exist_ok=True)
    with warnings.catch_warnings():
        _warn_quietly()
        for name in names:
            path = FIGURES[name]()
            print(f"wrote {path.relative_to(REPO)}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
