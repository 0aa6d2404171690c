"""A straggler on purpose: one of 2 gloo ranks slowed, measured, and simulated as a straggler.

The recorded runs (``data/straggler_localhost_gloo_n2.json``, written by ``collsim validate step
--world-sizes 2 --topology localhost_gloo_n2 --straggler-rank 1 --straggler-delay-ms 100 --iters
25 --warmup 3 -o`` on the 2-core development machine, shared with other jobs: see its ``note``)
are simulated again here, on the topology fitted to the collectives each run timed in its own
loop (collsim.validate.measure.insitu); the live runs need torch and spawn real ranks.
"""

from __future__ import annotations

import json
import statistics
from pathlib import Path

import pytest

from collsim.validate.check.step import simulate_modes, straggler_ratios
from collsim.validate.measure.step_model import STRAGGLER_SUFFIX, StepConfig

DATA = Path(__file__).parent / "data" / "straggler_localhost_gloo_n2.json"


def test_bad_straggler_settings() -> None:
    with pytest.raises(ValueError, match="straggler_rank"):
        StepConfig(straggler_rank=-1)
    with pytest.raises(ValueError, match="straggler_repeat"):
        StepConfig(straggler_rank=1, straggler_repeat=1)
    with pytest.raises(ValueError, match="straggler_delay_s"):
        StepConfig(straggler_rank=1, straggler_delay_s=-0.1)
    cfg = StepConfig(straggler_rank=1, modes=("ddp_b1", "fsdp"))
    assert cfg.straggler_modes == ("ddp_b1" + STRAGGLER_SUFFIX,)
    assert StepConfig().straggler_modes == ()


def _recorded() -> list[dict]:
    runs = json.loads(DATA.read_text())["runs"]
    assert runs
    return runs


def test_recorded_straggler_ratio_is_predicted_within_15_percent() -> None:
    """Every recorded run re-simulated: every straggler ratio (both DDP modes, three runs) is
    within 15 %, and so are the normal DDP steps' and the FSDP steps' median |error|. The runs
    were taken at 1-minute loads 1.5-3.7 on the 2 cores (the local step's thread got 0.52 of
    a core); their worst normal steps: ddp_b1 of the second run at -16.3 %, its FSDP step at
    -13.1 %."""
    from collsim.cluster.topology import load_topology

    errors = []
    normal: list[float] = []
    fsdp: list[float] = []
    for report in _recorded():
        topo = load_topology(report["topology"], nodes=1, gpus_per_node=2)
        sim = simulate_modes(report, topo, measured_factor=True)
        # the collectives were priced on the topology fitted to the ones timed in the loop
        assert report["insitu_note"] == "", report["insitu_note"]
        assert report["comm_probe"] and report["ddp_copies_s"] > 0
        ratios = straggler_ratios(report, sim)
        assert ratios
        for base, r in ratios.items():
            # the stored comparison is what the simulator gives today
            assert r["simulated_ratio"] == pytest.approx(
                report["straggler"][base]["simulated_ratio"], rel=1e-6
            )
            assert r["measured_ratio"] > 1.5  # a 100 ms spin on a ~70 ms step shows
            assert r["simulated_ratio"] > 1.2
            errors.append(abs(r["error"]))
            assert abs(r["error"]) <= 0.15, (base, r)
        for mode in ("ddp_b1", "ddp_b25", "fsdp"):
            measured = report["modes"][mode]["median_s"]
            err = (sim[mode].step_time_s - measured) / measured
            assert err == pytest.approx(report["modes"][mode]["error"], abs=1e-9)
            (fsdp if mode == "fsdp" else normal).append(abs(err))
    assert len(errors) == 6
    assert statistics.median(errors) <= 0.15, errors
    assert statistics.median(normal) <= 0.15, normal
    assert statistics.median(fsdp) <= 0.15, fsdp


@pytest.mark.torch
def test_live_straggler_step_is_measured_and_simulated(tmp_path: Path) -> None:
    pytest.importorskip("torch")
    from collsim.cluster.topology import load_topology
    from collsim.validate.measure.step import run_step

    cfg = StepConfig(
        num_layers=2,
        hidden=64,
        ffn_hidden=256,
        vocab=256,
        seq_len=16,
        iters=2,
        warmup=1,
        modes=("ddp_b25",),
        straggler_rank=1,
        straggler_delay_s=0.05,
        progress_path=str(tmp_path / "prog"),
    )
    report, _ = run_step(cfg, world_size=2, timeout_s=120)
    slowed = report["modes"]["ddp_b25" + STRAGGLER_SUFFIX]
    assert len(slowed["times_s"]) == 2
    assert slowed["extra_median_s"] >= 0.05  # the spin ran on rank 1 (MAX over ranks)
    assert min(slowed["times_s"]) >= 0.05
    # every iteration (warm-up included) was written by each rank as it was taken
    for rank in (0, 1):
        lines = (tmp_path / f"prog.rank{rank}.jsonl").read_text().splitlines()
        assert [json.loads(x)["iteration"] for x in lines] == [0, 1, 2]
    extra_on = [json.loads(x)["ddp_b25+straggler.extra"] for x in lines]
    assert min(extra_on) >= 0.05  # rank 1's own extra seconds
    topo = load_topology("localhost_gloo_n2", nodes=1, gpus_per_node=2)
    sim = simulate_modes(report, topo, measured_factor=True)
    local = report["local_step_s"]
    from collsim.validate.measure.insitu import peer_idle_boost, straggler_span_s

    # its measured extra seconds, then its compute, faster once its peer waits (insitu)
    span = straggler_span_s(local, slowed["extra_median_s"], peer_idle_boost(report))
    assert sim["ddp_b25" + STRAGGLER_SUFFIX].clock_factor == pytest.approx(local / span, rel=1e-9)
    r = straggler_ratios(report, sim)["ddp_b25"]
    assert r["simulated_ratio"] > 1.0 and r["measured_ratio"] > 1.0


@pytest.mark.slow
@pytest.mark.torch
def test_live_straggler_ratio_within_15_percent() -> None:
    """The must-show on this machine: 2 gloo ranks, rank 1 spinning 100 ms before its step,
    simulated on the topology fitted to the collectives timed in the same loop. Load from
    other processes moves it (the recorded runs above, and their note)."""
    pytest.importorskip("torch")
    from collsim.cluster.topology import load_topology
    from collsim.validate.measure.step import run_step

    cfg = StepConfig(iters=15, warmup=3, modes=("ddp_b1",), straggler_rank=1, straggler_delay_s=0.1)
    report, _ = run_step(cfg, world_size=2, timeout_s=600)
    topo = load_topology("localhost_gloo_n2", nodes=1, gpus_per_node=2)
    r = straggler_ratios(report, simulate_modes(report, topo, measured_factor=True))["ddp_b1"]
    assert abs(r["error"]) <= 0.15, r
