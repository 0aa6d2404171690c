"""The single-H200 recordings of validate/data/h200/: a device profile learned from the traced
steps of one GPT size predicts the measured step of the other; the catalogue H200 (sustained
clock) is pessimistic on them; what a GPU profile writes; the GPU grid's aligned shapes."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

import collsim
from collsim.cluster.hardware import get_device
from collsim.validate.data.kineto import read_trace
from collsim.validate.fit.trace_profile import profile_from_traces, write_trace_profile
from collsim.validate.measure.compute import GPU_GEMM_DIMS, ComputeGrid, write_profile

DATA = Path(__file__).resolve().parents[2] / "validate" / "data" / "h200"
RUN = DATA / "queued_unaligned"
SIZES = ("h2048", "h1024")


def _measured_s(size: str) -> float:
    report = json.loads((RUN / "gpu_step.json").read_text())
    return float(report["sizes"][size]["median_step_s"])


def _learned(size: str, tmp_path: Path) -> Path:
    learned = profile_from_traces([read_trace(str(RUN / f"trace_{size}.json.gz"))], base="h200")
    return write_trace_profile(tmp_path / f"learned_{size}.yaml", learned)


def test_gpu_traces_give_the_attention_kernels_their_launching_ops_time(tmp_path: Path) -> None:
    # on a GPU the cuDNN kernels belong to aten::_cudnn_attention_forward / _backward, the ops
    # under the SDPA op; both phases are learned, the backward at its own rate
    rows = get_device(str(_learned("h1024", tmp_path))).measured.attention
    assert [tuple(r[:4]) for r in rows] == [("cudnn", True, 128, 1024)]
    fwd, bwd = rows[0][4], rows[0][5]
    assert 100 < bwd < fwd < 990  # TFLOP/s below the H200's bf16 peak; backward the slower


@pytest.mark.parametrize(("learn", "predict"), [("h2048", "h1024"), ("h1024", "h2048")])
def test_a_profile_learned_from_one_size_predicts_the_other_within_10_percent(
    tmp_path: Path, learn: str, predict: str
) -> None:
    profile = _learned(learn, tmp_path)
    sim = collsim.simulate(DATA / f"gpt_{predict}.yaml", {"cluster.device": str(profile)})
    measured = _measured_s(predict)
    assert abs(sim.result.step_time_s / measured - 1) < 0.10, (sim.result.step_time_s, measured)


@pytest.mark.xfail(
    strict=True,
    reason="not met: the catalogue H200 prices GEMMs at the sustained clock fraction fitted to "
    "H100 runs at scale (0.735 of boost), where these single-GPU steps ran their GEMMs at "
    "712-828 TFLOP/s (burst clock); 30-32 % pessimistic (validate/data/h200/README.md)",
)
@pytest.mark.parametrize("size", SIZES)
def test_the_catalogue_h200_predicts_the_measured_steps_within_15_percent(size: str) -> None:
    sim = collsim.simulate(DATA / f"gpt_{size}.yaml")
    assert abs(sim.result.step_time_s / _measured_s(size) - 1) < 0.15


def test_all_gemm_load_settles_at_the_power_limited_clock() -> None:
    # 60 s of back-to-back 8192^3 GEMMs: after the first second the board sits at its 700 W
    # limit (software power cap, event reason 0x4) and the SM clock near 1485 MHz, 0.75 of the
    # 1980 MHz boost: the premise of the catalogue's sustained-clock fraction
    rows = [
        line.split(",")
        for line in (RUN / "clock.csv").read_text().splitlines()[1:]
        if not line.startswith("#")
    ]
    steady = rows[2:]
    clocks = sorted(float(r[2]) for r in steady)
    assert len(steady) > 50
    assert 0.72 < clocks[len(clocks) // 2] / 1980 < 0.78
    assert all(float(r[4]) > 0.95 * float(r[5]) for r in steady)  # power at its limit
    assert all(int(r[7], 16) & 0x4 for r in steady)


def test_a_gpu_profile_keeps_each_dtypes_best_rate_and_the_devices_own_figures(
    tmp_path: Path,
) -> None:
    measured = {
        "gemm": [[4096, 4096, 4096, "bf16", 780.0], [4096, 4096, 4096, "fp32", 50.0]],
        "attention": [],
        "bandwidth": [[268435452.0, 4000.0]],
        "optimizer_bytes_per_s": 1e12,
        "launch_us": 0.0,
        "host_us": 10.0,
        "notes": {"threads": 1, "device": "cuda", "gpu": "X", "sm_count": 132,
                  "memory_bytes": 150_754_820_096},
    }  # fmt: skip
    device = get_device(str(write_profile(tmp_path / "gpu.yaml", measured, device="cuda")))
    assert device.peak_flops_for("bf16") == pytest.approx(780e12)
    assert device.peak_flops_for("fp32") == pytest.approx(50e12)
    assert device.sm_count == 132
    assert device.memory_bytes == pytest.approx(150_754_820_096, rel=1e-6)


def test_the_gpu_grid_times_aligned_shapes_up_to_8192() -> None:
    # an unaligned row (2500) ran 3.3x slower than its aligned neighbour on the H200 and pulled
    # the interpolated rate of aligned model shapes down with it
    rows = {tuple(r[:4]): r[4] for r in get_device(str(RUN / "h200_profile.yaml")).measured.gemm}
    assert rows[(4096, 4096, 4096, "bf16")] > 3 * rows[(4096, 2500, 4096, "bf16")]
    grid = ComputeGrid.full("cuda")
    assert grid.gemm_dims == GPU_GEMM_DIMS and max(GPU_GEMM_DIMS) == 8192
    assert all(d % 64 == 0 for d in grid.gemm_dims)
    assert 2.0 * 8192**3 <= grid.gemm_max_flops
