"""The single-H200 recordings of validate/data/h200/: a device profile learned from the traced
steps of one GPT size predicts the measured step of the other; the catalogue H200 (sustained
clock) is pessimistic on them; what a GPU profile writes; the GPU grid's aligned shapes."""

from __future__ import annotations

import csv
import json
from pathlib import Path

import pytest

import collsim
from collsim.cluster.hardware import get_device
from collsim.validate.data.kineto import Event, read_trace
from collsim.validate.fit.trace_profile import (
    MODEL_CURVE_SEQS,
    _model_rates,
    attention_along_model,
    profile_from_traces,
    write_trace_profile,
)
from collsim.validate.fit.trace_rates import attention_rows, op_times
from collsim.validate.measure.compute import (
    GPU_GEMM_DIMS,
    GPU_OPTIMIZER_PARAMS,
    SGD_STEP_BYTES_PER_PARAM,
    ComputeGrid,
    write_profile,
)

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
    traced = attention_rows(op_times(read_trace(str(RUN / "trace_h1024.json.gz"))))
    assert [tuple(r[:4]) for r in traced] == [("cudnn", True, 128, 1024)]
    fwd, bwd = traced[0][4], traced[0][5]
    assert 100 < bwd < fwd < 990  # TFLOP/s below the H200's bf16 peak; backward the slower
    # the profile carries the traced point along the base model's sequence curve
    rows = get_device(str(_learned("h1024", tmp_path))).measured.attention
    assert [r[3] for r in rows] == list(MODEL_CURVE_SEQS)
    assert [tuple(r) for r in rows if r[3] == 1024] == [tuple(traced[0])]


def test_attention_rows_follow_the_model_from_the_nearest_traced_length() -> None:
    h200 = get_device("h200")
    traced = [["cudnn", True, 128, 1024, 300.0, 200.0], ["cudnn", True, 128, 8192, 500.0, 450.0]]
    rows, added = attention_along_model([list(r) for r in traced], h200)
    assert added == len(MODEL_CURVE_SEQS) - 2
    by_seq = {r[3]: r for r in rows}
    assert by_seq[1024] == traced[0] and by_seq[8192] == traced[1]  # kept as traced
    for s, anchor in ((128, traced[0]), (2048, traced[0]), (4096, traced[1]), (32768, traced[1])):
        model_s = _model_rates(h200, "cudnn", True, 128, s)
        model_a = _model_rates(h200, "cudnn", True, 128, anchor[3])
        assert by_seq[s][4] == pytest.approx(anchor[4] * model_s[0] / model_a[0], rel=1e-6)
        assert by_seq[s][5] == pytest.approx(anchor[5] * model_s[1] / model_a[1], rel=1e-6)
    # a kernel the base's generation does not price keeps its traced rows alone
    a100 = get_device("a100")
    only, none_added = attention_along_model([["flash3", True, 128, 1024, 300.0, 200.0]], a100)
    assert none_added == 0 and only == [["flash3", True, 128, 1024, 300.0, 200.0]]


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
    "663-849 TFLOP/s (burst clock); 30-32 % pessimistic (validate/data/h200/README.md)",
)
@pytest.mark.parametrize("size", SIZES)
def test_the_catalogue_h200_predicts_the_measured_steps_within_15_percent(size: str) -> None:
    sim = collsim.simulate(DATA / f"gpt_{size}.yaml")
    assert abs(sim.result.step_time_s / _measured_s(size) - 1) < 0.15


def test_all_gemm_load_settles_at_the_power_limited_clock() -> None:
    # 60 s of back-to-back 8192^3 GEMMs: after the first second the board sits at its 700 W
    # limit (software power cap, event reason 0x4) and the SM clock near 1485 MHz, 0.75 of the
    # 1980 MHz boost: the premise of the catalogue's sustained-clock fraction
    lines = [x for x in (RUN / "clock.csv").read_text().splitlines() if not x.startswith("#")]
    rows = list(csv.DictReader(lines))
    steady = rows[2:]
    clocks = sorted(float(r["sm_mhz"]) for r in steady)
    assert len(steady) > 50
    assert 0.72 < clocks[len(clocks) // 2] / 1980 < 0.78
    assert all(float(r["power_w"]) > 0.95 * float(r["power_limit_w"]) for r in steady)
    assert all(int(r["throttle_reasons_hex"], 16) & 0x4 for r in steady)  # the power cap


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


def _op(name: str, dims: list[int], concrete: list[str]) -> Event:
    return Event(
        name, "cpu_op", 0.0, 1000.0, 0, 0, {"Input Dims": [dims], "Concrete Inputs": concrete}
    )


def test_the_kernels_own_attention_ops_are_read_in_their_layout_and_causality() -> None:
    # SDPA hands flash and memory-efficient attention transposed views: (b, s, h, d); cuDNN's
    # own op keeps (b, h, s, d); is_causal is read at its place in each signature, not from the
    # first True (cuDNN's forward passes compute_log_sumexp=True before it)
    c = [""] * 16
    flash_fwd = c[:8] + ["True"] + c[9:]
    flash_bwd = c[:11] + ["True"] + c[12:]
    cudnn_fwd = c[:8] + ["True", "0.", "False"] + c[11:]  # log-sum-exp on, not causal
    mask_fwd = c[:9] + ["1"] + c[10:]  # memory-efficient: mask type 1, causal
    ops = [
        (_op("aten::_flash_attention_forward", [2, 2048, 16, 128], flash_fwd), 1e-3),
        (_op("aten::_flash_attention_backward", [2, 2048, 16, 128], flash_bwd), 2e-3),
        (_op("aten::_cudnn_attention_forward", [2, 16, 1024, 64], cudnn_fwd), 1e-3),
        (_op("aten::_efficient_attention_forward", [4, 512, 8, 64], mask_fwd), 1e-3),
    ]
    rows = {tuple(r[:4]): r[4:] for r in attention_rows(ops)}
    assert set(rows) == {
        ("flash2", True, 128, 2048),
        ("cudnn", False, 64, 1024),
        ("eager", True, 64, 512),
    }
    fwd_flops = 4.0 * 2 * 16 * 2048**2 * 128 / 2
    assert rows[("flash2", True, 128, 2048)][0] == pytest.approx(fwd_flops / 1e-3 / 1e12)
    assert rows[("flash2", True, 128, 2048)][1] == pytest.approx(2.5 * fwd_flops / 2e-3 / 1e12)


def _clock_rows(run: str) -> dict[float, list[dict[str, str]]]:
    lines = (DATA / run / "clock.csv").read_text().splitlines()
    by_duty: dict[float, list[dict[str, str]]] = {}
    for r in csv.DictReader(x for x in lines if not x.startswith("#")):
        by_duty.setdefault(float(r["duty"]), []).append(r)
    return {d: rows[2:] for d, rows in by_duty.items()}  # the first second ramps up


@pytest.mark.parametrize("run", ["aligned_duties", "repeat_steady"])
def test_a_lower_gemm_share_raises_the_gemm_rate_while_the_board_stays_at_its_limit(
    run: str,
) -> None:
    by_duty = _clock_rows(run)
    assert sorted(by_duty) == [0.5, 0.75, 1.0]

    def median(d: float, key: str) -> float:
        values = sorted(float(r[key]) for r in by_duty[d])
        return values[len(values) // 2]

    assert median(1.0, "gemm_tflops") < median(0.75, "gemm_tflops") < median(0.5, "gemm_tflops")
    assert median(0.5, "gemm_tflops") > 1.03 * median(1.0, "gemm_tflops")
    assert median(0.5, "sm_mhz") > median(1.0, "sm_mhz")
    for rows in by_duty.values():  # the adds' HBM traffic keeps the board at its cap
        assert all(float(r["power_w"]) > 0.95 * float(r["power_limit_w"]) for r in rows)
        assert all(int(r["clock_event_reasons_hex"], 16) & 0x4 for r in rows)


def test_a_step_holds_its_rate_over_thirty_seconds() -> None:
    report = json.loads((DATA / "repeat_steady" / "steady" / "gpu_step.json").read_text())
    times = report["sizes"]["h2048"]["step_times_s"]
    assert len(times) == 600 and sum(times) > 30
    first, last = sorted(times[:20])[10], sorted(times[-200:])[100]
    assert 1.0 <= last / first < 1.02


@pytest.mark.parametrize("size", SIZES)
def test_the_aligned_grid_profile_predicts_the_steps_within_12_percent(size: str) -> None:
    run = DATA / "repeat_steady"
    profile = str(run / "h200_profile.yaml")
    sim = collsim.simulate(DATA / f"gpt_{size}.yaml", {"cluster.device": profile})
    measured = json.loads((run / "gpu_step.json").read_text())["sizes"][size]["median_step_s"]
    assert abs(sim.result.step_time_s / measured - 1) < 0.12, (sim.result.step_time_s, measured)


def test_the_optimizer_probe_streams_from_hbm_once_it_outgrows_the_l2() -> None:
    # 4 M parameters counted at 20 bytes came out above the HBM's copy rate (L2, and bytes
    # SGD without momentum does not move); 64 M counted at 12 came out below it
    def rates(run: str) -> tuple[float, float, dict]:
        measured = get_device(str(DATA / run / "h200_profile.yaml")).measured
        best_copy = max(bw[1] for bw in measured.bandwidth) * 1e9
        return float(measured.optimizer_bytes_per_s), best_copy, dict(measured.extra or {})

    small, copy_small, notes_small = rates("aligned_duties")
    large, copy_large, notes_large = rates("repeat_steady")
    assert notes_small["optimizer_params"] == 4_000_000 and small > 1.5 * copy_small
    assert "optimizer_bytes_per_param" not in notes_small
    assert notes_large["optimizer_params"] == GPU_OPTIMIZER_PARAMS
    assert notes_large["optimizer_bytes_per_param"] == SGD_STEP_BYTES_PER_PARAM
    assert 0.6 * copy_large < large < copy_large


def test_a_gpu_profile_records_the_gpus_own_figures() -> None:
    device = get_device(str(DATA / "repeat_steady" / "h200_profile.yaml"))
    assert device.sm_count == 132
    assert 780e12 < device.peak_flops_for("bf16") < 990e12
    assert 140e9 < device.memory_bytes < 160e9


def _fp8_rows(name: str) -> dict[tuple[int, int, int], dict[str, float]]:
    """Per shape (m, n, k), each variant's seconds in ``fp8_gemm/<name>``."""
    lines = (DATA / "fp8_gemm" / name).read_text().splitlines()
    rows: dict[tuple[int, int, int], dict[str, float]] = {}
    for r in csv.DictReader(x for x in lines if not x.startswith("#")):
        shape = (int(r["m"]), int(r["n"]), int(r["k"]))
        rows.setdefault(shape, {})[r["variant"]] = float(r["time_us"]) * 1e-6
    return rows


@pytest.mark.parametrize("variant", ["fp8_tensor", "fp8_tensor_fast", "fp8_row_fast"])
def test_the_models_fp8_speedup_over_bf16_is_the_h200s_within_10_percent(variant: str) -> None:
    from collsim.workload.compute import ComputeModel
    from collsim.workload.ops import Gemm

    h200 = get_device("h200")
    bf16, fp8 = ComputeModel(h200, "bf16"), ComputeModel(h200, "fp8")
    ratios = []
    for shape, t in _fp8_rows("fp8_gemm_graph.csv").items():
        if min(shape) < 2048:
            continue  # smaller GEMMs leave the GPU partly idle, as the model says in its own way
        measured = t["bf16"] / t[variant]
        modelled = bf16.gemm_time_s(Gemm(*shape))[0] / fp8.gemm_time_s(Gemm(*shape))[0]
        ratios.append(measured / modelled)
    ratios.sort()
    assert len(ratios) == 60
    assert 0.9 < ratios[len(ratios) // 2] < 1.1


def test_fp8_gemms_queued_from_python_wait_for_the_host_where_small() -> None:
    # the same calls replayed from CUDA graphs: the GPU's time alone, never more than queued;
    # at 1024^3 the host's launch is most of the queued time, more so for _scaled_mm
    eager, graph = _fp8_rows("fp8_gemm_eager.csv"), _fp8_rows("fp8_gemm_graph.csv")
    assert eager.keys() == graph.keys() and len(graph) == 212
    small = (1024, 1024, 1024)
    assert graph[small]["bf16"] < 0.5 * eager[small]["bf16"]
    assert graph[small]["fp8_tensor_fast"] < graph[small]["bf16"]  # faster on the GPU...
    assert eager[small]["fp8_tensor_fast"] > eager[small]["bf16"]  # ...slower queued
    big = (8192, 8192, 8192)
    for variant in ("bf16", "fp8_tensor_fast"):
        assert graph[big][variant] == pytest.approx(eager[big][variant], rel=0.15)


def test_a_gpu_profile_prices_fp8_gemms_from_its_own_fp8_rows() -> None:
    from collsim.workload.compute import ComputeModel
    from collsim.workload.ops import Gemm

    profile = get_device(str(DATA / "fp8_profile" / "h200_profile.yaml"))
    rows = {tuple(r[:4]): r[4] for r in profile.measured.gemm}
    shapes = {r[:3] for r in rows}
    assert len(shapes) == len(GPU_GEMM_DIMS) ** 3
    assert all((*s, "fp8") in rows and (*s, "bf16") in rows for s in shapes)
    big = (8192, 8192, 8192)
    assert 1.5 < rows[(*big, "fp8")] / rows[(*big, "bf16")] < 2.5
    assert profile.peak_flops_for("fp8") > 1.5 * profile.peak_flops_for("bf16")
    fp8 = ComputeModel(profile, "fp8")
    time_s = fp8.gemm_time_s(Gemm(*big))[0]
    assert 2.0 * 8192**3 / time_s / 1e12 == pytest.approx(rows[(*big, "fp8")], rel=1e-6)
