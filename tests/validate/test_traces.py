"""``collsim validate trace``: Kineto traces from outside the project (HolisticTraceAnalysis'
test data, tests/data/traces/README.md) and from ``validate step --profile-dir``; kernel
classes; malformed inputs; the device profile learned from a trace."""

from __future__ import annotations

import gzip
import json
from pathlib import Path
from typing import Any

import pytest

from collsim.cli import main
from collsim.validate.data.kineto import read_trace, read_traces
from collsim.validate.measure.traces.breakdown import breakdown, summarise
from collsim.validate.measure.traces.classify import classify
from collsim.validate.measure.traces.report import classified_share

DATA = Path(__file__).parents[1] / "data" / "traces"
REPO = Path(__file__).parents[2]
GLOO = REPO / "validate" / "data" / "traces"


def _run(args: list[str], capsys: pytest.CaptureFixture[str]) -> tuple[int, str, str]:
    code = 0
    try:
        main(["validate", "trace", *args])
    except SystemExit as exc:
        code = int(exc.code or 0)
    out, err = capsys.readouterr()
    return code, out, err


@pytest.mark.parametrize(
    ("files", "kernels", "steps", "step_ms"),
    [
        (["hta_v100_single_rank.json.gz"], 1219, 2, (95.0, 98.0)),
        (["hta_sampled_rank-0.json.gz", "hta_sampled_rank-1.json.gz"], 590, 4, (600.0, 625.0)),
        (["hta_mi250_rocm.json.gz"], 16, 1, (8.0, 10.0)),
    ],
)
def test_real_traces_from_outside_are_read_and_classified(
    files: list[str], kernels: int, steps: int, step_ms: tuple[float, float]
) -> None:
    """Single rank (V100), two ranks of a 128-rank job (A100, NCCL), AMD MI250 (ROCm): every
    step found, at least 99 % of the kernels' time classified, and the exclusive times of the
    kinds and idle add up to the step."""
    traces = read_traces([str(DATA / f) for f in files])
    found = [b for t in traces for b in breakdown(t)]
    summary = summarise(found)
    n, _, by_time = classified_share(summary)
    assert len(found) == steps and n == kernels
    assert by_time >= 0.99
    assert step_ms[0] <= summary.step_s * 1e3 <= step_ms[1]
    for b in found:
        assert sum(b.exclusive_s.values()) == pytest.approx(b.step_s, rel=1e-6)


def test_the_multi_rank_set_finds_its_nccl_collectives(
    capsys: pytest.CaptureFixture[str],
) -> None:
    code, out, _ = _run(
        [str(DATA / "hta_sampled_rank-0.json.gz"), str(DATA / "hta_sampled_rank-1.json.gz")], capsys
    )
    assert code == 0
    assert "rank 0, rank 1 of world size 128, nccl; GPU" in out
    assert "SendRecv" in out and "communication" in out


@pytest.mark.parametrize(
    ("name", "kind"),
    [
        ("sm90_xmma_gemm_bf16bf16_bf16f32_f32_tn_n_tilesize128x128x64_warpgroupsize1x1x1", "gemm"),
        ("nvjet_tst_128x256_64x4_1x2_h_bz_coopA_NTN", "gemm"),
        (
            "cutlass::Kernel2<cutlass_80_tensorop_bf16_s16816gemm_relu_bf16_64x64_64x4_tn_align8>",
            "gemm",
        ),
        ("triton_tem_fused_mm_0", "gemm"),
        ("Cijk_Alik_Bljk_HHS_BH_MT128x128x32_MI32x32x8x1_SN", "gemm"),
        ("ampere_sgemm_128x64_tn", "gemm"),
        ("void flash_fwd_kernel<Flash_fwd_kernel_traits<128, 128, 64, 4>, true>", "attention"),
        ("fmha_cutlassF_bf16_aligned_64x64_rf_sm80", "attention"),
        ("cudnn_generated_fort_native_sdpa_sm90_flash_fprop_wgmma_f16_knob_3", "attention"),
        (
            "ncclDevKernel_AllReduce_Sum_bf16_RING_LL(ncclDevKernelArgsStorage<4096ul>)",
            "communication",
        ),
        ("gloo:all_reduce", "communication"),
        ("void cudnn::detail::implicit_convolve_sgemm<float, float, 128, 5, 5>", "convolution"),
        ("sm80_xmma_fprop_implicit_gemm_indexed_tf32f32", "convolution"),
        ("void at::native::(anonymous namespace)::vectorized_layer_norm_kernel<float>", "norm"),
        (
            "void at::native::vectorized_elementwise_kernel<4, at::native::GeluCUDAKernelImpl>",
            "elementwise",
        ),
        ("triton_poi_fused_add_mul_0", "elementwise"),
        (
            "void at::native::multi_tensor_apply_kernel<FusedAdamMathFunctor>",
            "optimizer",
        ),
        ("void at::native::indexSelectLargeIndex<float, long, unsigned int>", "embedding"),
        (
            "void cunn_SoftMaxForward<4, float, float, float, LogSoftMaxForwardEpilogue>",
            "loss",
        ),
        ("Memcpy DtoD (Device -> Device)", "copy"),
        ("void at::native::unrolled_elementwise_kernel<direct_copy_kernel_cuda>", "copy"),
        ("aten::addmm", "gemm"),
        ("aten::_scaled_dot_product_flash_attention_for_cpu", "attention"),
        ("autograd::engine::evaluate_function: AddmmBackward0", "gemm"),
        ("aten::view", "framework"),
        ("some_kernel_nobody_knows", "unclassified"),
    ],
)
def test_kernel_names_are_classified(name: str, kind: str) -> None:
    assert classify(name) == kind


def _gloo_trace() -> list[str]:
    return sorted(str(p) for p in GLOO.glob("run1/n2_ddp_b25_rank*.json.gz"))


def test_a_traced_gloo_step_adds_up_within_2_percent(capsys: pytest.CaptureFixture[str]) -> None:
    """``validate trace`` on the world-size-2 DDP trace of ``validate step --profile-dir``:
    the per-kind table, and its exclusive times (kinds and idle) add up to the traced step
    within 2 %, per step and rank; the all-reduce of DDP's one 25 MB bucket is found."""
    files = _gloo_trace()
    assert len(files) == 2
    code, out, _ = _run(files, capsys)
    assert code == 0
    for kind in ("gemm", "attention", "norm", "optimizer", "idle"):
        assert any(line.startswith(kind) for line in out.splitlines()), (kind, out)
    assert "all_reduce" in out
    for trace in read_traces(files):
        for b in breakdown(trace):
            assert abs(sum(b.exclusive_s.values()) - b.step_s) <= 0.02 * b.step_s
            assert b.exclusive_s["gemm"] > 0.2 * b.step_s


def _truncated(tmp_path: Path) -> Path:
    data = (DATA / "hta_mi250_rocm.json.gz").read_bytes()
    path = tmp_path / "truncated.json.gz"
    path.write_bytes(data[: len(data) // 2])
    return path


def _no_events(tmp_path: Path) -> Path:
    path = tmp_path / "no_events.json"
    path.write_text(json.dumps({"schemaVersion": 1, "events": []}))
    return path


def _no_steps(tmp_path: Path) -> Path:
    with gzip.open(DATA / "hta_mi250_rocm.json.gz", "rt") as f:
        doc = json.load(f)
    doc["traceEvents"] = [
        e for e in doc["traceEvents"] if not str(e.get("name", "")).startswith("ProfilerStep")
    ]
    path = tmp_path / "no_steps.json.gz"
    with gzip.open(path, "wt") as f:
        json.dump(doc, f)
    return path


def _rank_two(tmp_path: Path) -> Path:
    with gzip.open(DATA / "hta_sampled_rank-1.json.gz", "rt") as f:
        doc = json.load(f)
    doc["distributedInfo"]["rank"] = 2
    path = tmp_path / "rank-2.json.gz"
    with gzip.open(path, "wt") as f:
        json.dump(doc, f)
    return path


@pytest.mark.parametrize(
    ("make", "words"),
    [
        (_truncated, "truncated gzip"),
        (_no_events, "no 'traceEvents'"),
        (_no_steps, "no 'ProfilerStep#N' annotation"),
        (_rank_two, "rank 1 missing"),
    ],
)
@pytest.mark.parametrize("reader", ["json", "orjson", "ijson"])
def test_malformed_traces_get_one_line_and_exit_2(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], make: object, words: str, reader: str
) -> None:
    pytest.importorskip(reader)
    bad = make(tmp_path)  # type: ignore[operator]
    files = [str(DATA / "hta_sampled_rank-0.json.gz"), str(bad)] if "rank" in words else [str(bad)]
    code, out, err = _run([*files, "--reader", reader], capsys)
    lines = [line for line in (out + err).splitlines() if line.strip()]
    assert code == 2
    assert len(lines) == 1 and words in lines[0], lines
    assert "Traceback" not in out + err


@pytest.mark.parametrize("reader", ["orjson", "ijson"])
def test_the_readers_agree(reader: str) -> None:
    pytest.importorskip(reader)
    path = str(DATA / "hta_v100_single_rank.json.gz")
    ref = read_trace(path, reader="json")
    got = read_trace(path, reader=reader)
    assert len(got.events) == len(ref.events)
    assert got.rank == ref.rank and got.devices == ref.devices
    assert [(e.name, e.ts_us, e.args) for e in got.events] == [
        (e.name, e.ts_us, e.args) for e in ref.events
    ]


def test_a_profile_learned_from_the_gloo_trace_is_a_device(tmp_path: Path) -> None:
    """The profile of the world-size-2 trace reads back as a device whose GEMM table holds
    the model's own shapes (hidden 256, ffn 1024, 64 tokens) at the rates the trace timed, and
    says where each section came from."""
    from collsim.cluster.hardware import get_device
    from collsim.validate.fit.trace_profile import profile_from_traces, write_trace_profile

    learned = profile_from_traces(read_traces(_gloo_trace()))
    path = write_trace_profile(tmp_path / "p.yaml", learned)
    device = get_device(str(path))
    assert device.measured is not None
    shapes = {(m, n, k) for m, n, k, _, _ in device.measured.gemm}
    assert (64, 768, 256) in shapes and (64, 256, 1024) in shapes
    assert all(r > 0 for *_, r in device.measured.gemm)
    assert device.measured.attention and device.measured.bandwidth
    assert learned.sources["gemm"].startswith("trace")


def test_a_gemm_no_traced_shape_reaches_is_priced_by_the_base_device(tmp_path: Path) -> None:
    """A shape of the predicted model farther than 2x from every shape the trace ran gets no
    rate from the traced rows (the nearest of them, 64x768x256 at a few GFLOP/s of a 2-core
    host, would say nothing about an 8192-cube GEMM): the profile prices it with the figures
    of its base catalogue device, as the catalogue device itself does; a traced shape keeps
    its traced rate."""
    import dataclasses

    from collsim.cluster.hardware import get_device
    from collsim.validate.fit.trace_profile import profile_from_traces, write_trace_profile
    from collsim.workload.compute import ComputeModel
    from collsim.workload.ops import Gemm

    learned = profile_from_traces(read_traces(_gloo_trace()), base="cpu")
    assert "cpu's own figures" in learned.sources["gemm"]
    device = get_device(str(write_trace_profile(tmp_path / "p.yaml", learned)))
    assert device.measured is not None and device.measured.extra["gemm_reach"] == 2.0
    assert device.measured.gemm_rate(8192, 8192, 8192, "fp32") is None
    traced = device.measured.gemm_rate(64, 768, 256, "fp32")
    assert traced is not None and traced > 0

    big = Gemm(8192, 8192, 8192)
    catalogue = get_device("cpu")
    got, _, _ = ComputeModel(device, "fp32").gemm_time_s(big)
    want, _, _ = ComputeModel(catalogue, "fp32").gemm_time_s(big)
    assert got == pytest.approx(want, rel=0.01)
    # without the reach the nearest traced rows would price it: a different answer
    unreached = dataclasses.replace(
        device,
        measured=dataclasses.replace(
            device.measured,
            extra={k: v for k, v in device.measured.extra.items() if k != "gemm_reach"},
        ),
    )
    nearest, _, _ = ComputeModel(unreached, "fp32").gemm_time_s(big)
    assert nearest > 2 * want


def _event(name: str, ts: float, dur: float, tid: int = 1) -> Any:
    from collsim.validate.data.kineto import Event

    cat = "user_annotation" if name.startswith(("ProfilerStep", "Optimizer.")) else "cpu_op"
    return Event(name, cat, ts, dur, 1, tid, {})


def test_host_cost_per_launch_is_the_step_threads_unpriced_time_per_priced_op() -> None:
    """On a CPU trace the host time is the gaps between the outermost ops and the self time of
    the ops no table prices (a view), leaving out the optimizer's insides and the gap while a
    collective ran on another thread; the launches are the priced ops inside no other priced
    op (an add's nested sum is part of it)."""
    from collsim.validate.data.kineto import Trace
    from collsim.validate.fit.trace_host import host_per_launch

    events = [
        _event("ProfilerStep#0", 0, 1000),
        _event("aten::mm", 100, 200),  # gap 0-100
        _event("aten::view", 350, 50),  # gap 300-350; 50 us of framework
        _event("aten::add", 400, 100),
        _event("aten::sum", 420, 30),  # inside the add: not a launch
        _event("Optimizer.step#SGD.step", 500, 200),
        _event("aten::view", 550, 20),  # inside the optimizer: priced by its rate
        _event("gloo:all_reduce", 650, 230, tid=2),  # the gap 700-880 is a wait
    ]
    got = host_per_launch(Trace("synthetic", events))
    assert got.steps == 1 and got.launches == 2
    assert got.host_s * 1e6 == pytest.approx(100 + 50 + 50 + 20 + 100)
    assert got.per_launch_us == pytest.approx(160.0)


def _timed_trace(cores: int | None, step_us: float, rank: int) -> Any:
    from collsim.validate.data.kineto import Trace

    events = [_event(f"ProfilerStep#{i}", i * 10_000, step_us) for i in range(3)]
    return Trace(f"r{rank}", events, rank=rank, world_size=2, cores=cores, local_ranks=2)


def test_the_time_sharing_slowdown_is_the_pinned_step_over_the_even_share() -> None:
    """Two ranks on one core against two ranks on two cores: a step 2.4 x as long is 1.2 x
    the even share; traces that do not record their cores, or pinned ones that share no more,
    get one line."""
    from collsim.core.errors import ConfigError
    from collsim.validate.fit.trace_host import time_sharing

    reference = [_timed_trace(2, 1000.0, r) for r in (0, 1)]
    pinned = [_timed_trace(1, 2400.0, r) for r in (0, 1)]
    got = time_sharing(pinned, reference)
    assert got.slowdown == pytest.approx(1.2)
    assert "2 ranks per core" in got.source and "/ 2" in got.source
    with pytest.raises(ConfigError, match="collsim.cores"):
        time_sharing([_timed_trace(None, 2400.0, r) for r in (0, 1)], reference)
    with pytest.raises(ConfigError, match="pin the ranks"):
        time_sharing(reference, pinned)


def test_the_time_sharing_slowdown_applies_where_the_ranks_exceed_the_cores(
    tmp_path: Path,
) -> None:
    """``profile_device``: a profile's time-sharing slowdown multiplies the even share at 4
    gloo ranks on 2 cores, and nothing at 2 ranks on 2 cores."""
    import yaml

    from collsim.validate.check.step import profile_device
    from collsim.validate.fit.trace_profile import profile_from_traces, write_trace_profile

    learned = profile_from_traces(read_traces(_gloo_trace()))
    learned.measured["notes"]["time_sharing_slowdown"] = 1.25
    path = write_trace_profile(tmp_path / "p.yaml", learned)
    assert yaml.safe_load(path.read_text())["measured"]["notes"]["time_sharing_slowdown"] == 1.25
    report = {"world_size": 4, "local_world_size": 4, "cpu_count": 2, "backend": "gloo"}
    _, share, memory_share = profile_device(report, str(path))
    assert share == pytest.approx(2.5) and memory_share == pytest.approx(2.5)
    report = dict(report, world_size=2, local_world_size=2)
    assert profile_device(report, str(path))[1] == pytest.approx(1.0)


def test_pinned_traces_without_their_cores_get_one_line(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """``--pinned`` needs ``--profile-out``, and traces that record their cores (the quiet
    runs' traces predate it)."""
    files = _gloo_trace()
    code, out, err = _run([*files, "--pinned", files[0]], capsys)
    assert code == 2 and "need --profile-out" in (out + err)
    out_path = str(tmp_path / "p.yaml")
    code, out, err = _run([*files, "--profile-out", out_path, "--pinned", files[0]], capsys)
    lines = [line for line in err.splitlines() if line.strip()]
    assert code == 2 and len(lines) == 1 and "collsim.cores" in lines[0], lines


def test_record_sh_gives_the_profile_its_pinned_time_sharing_slowdown() -> None:
    """A run of ``record.sh`` with its pinned step (``loaded/record_dev``, one run at 1-min
    loads of 17-22, for the wiring only, recorded before the pinned pair got a companion on
    core 1): the pinned traces record one core for the two ranks, the reference two; the profile
    ``validate trace --pinned`` wrote then holds the slowdown this code measures from them and
    the same host cost per launch; this code leaves that slowdown out (its pinned GEMM ops ran
    x1.06 the reference's rate), saying why."""
    import yaml

    from collsim.validate.fit.trace_host import time_sharing
    from collsim.validate.fit.trace_profile import profile_from_traces

    run = LOADED / "record_dev" / "run1"
    pinned = read_traces(sorted(str(p) for p in (run / "pinned").glob("n2_local_rank*.json.gz")))
    reference = read_traces(sorted(str(p) for p in run.glob("n2_local_rank*.json.gz")))
    assert [(t.cores, t.local_ranks) for t in pinned] == [(1, 2), (1, 2)]
    assert [(t.cores, t.local_ranks) for t in reference] == [(2, 2), (2, 2)]
    assert all(t.cpu_share is not None for t in pinned + reference)
    learned = profile_from_traces(
        read_traces(sorted(str(p) for p in run.glob("n2_ddp_b25_rank*.json.gz"))),
        pinned=pinned,
        pinned_reference=reference,
    )
    recorded = yaml.safe_load((run / "trace_profile.yaml").read_text())["measured"]
    assert recorded["notes"]["time_sharing_slowdown"] == time_sharing(pinned, reference).slowdown
    assert recorded["host_us"] == learned.measured["host_us"]
    # its pinned ops ran x1.06 the reference's rate: this code leaves the slowdown out, saying why
    notes = learned.measured["notes"]
    assert "time_sharing_slowdown" not in notes
    assert (
        notes["time_sharing_source"].startswith("not applied: ")
        and "x1.06" in notes["time_sharing_source"]
    )


def _rebuilt_errors(run: Path) -> dict[tuple[int, str], float]:
    """(world size, mode or ``local``) -> error of ``run`` simulated from the profile this
    checkout learns from the run's traces (as ``validate/probes/trace_profile_predict.py``);
    ``local``: the simulated compute and optimizer against the measured step without
    communication."""
    import tempfile

    from collsim.cluster.topology import load_topology
    from collsim.validate.check.step import simulate_modes
    from collsim.validate.fit.trace_profile import profile_from_traces, write_trace_profile

    files = sorted(str(p) for p in run.glob("n2_ddp_b25_rank*.json.gz"))
    pinned = sorted(str(p) for p in (run / "pinned").glob("n2_local_rank*.json.gz"))
    reference = sorted(str(p) for p in run.glob("n2_local_rank*.json.gz"))
    learned = profile_from_traces(
        read_traces(files),
        pinned=read_traces(pinned) if pinned else None,
        pinned_reference=read_traces(reference) if pinned and reference else None,
    )
    out = {}
    with tempfile.TemporaryDirectory() as tmp:
        profile = str(write_trace_profile(Path(tmp) / "p.yaml", learned))
        for report in json.loads((run / f"step_trace_{run.name}.json").read_text()):
            n = int(report["world_size"])
            sim = simulate_modes(
                report, load_topology("localhost", nodes=1, gpus_per_node=n), device_profile=profile
            )
            for mode, got in sim.items():
                measured = float(report["modes"][mode]["median_s"])
                out[(n, mode)] = (got.step_time_s - measured) / measured
            parts = sim["ddp_b25"].breakdown_s
            local = parts.get("compute", 0.0) + parts.get("optimizer", 0.0)
            out[(n, "local")] = (local - report["local_step_s"]) / report["local_step_s"]
    return out


def test_the_world_size_2_step_without_communication_is_predicted_from_its_own_trace() -> None:
    """The profile learned from a run's world-size-2 DDP trace (with its host cost per launch)
    gives back the run's measured world-size-2 step without communication within 5 %, median
    over the quiet runs: the traced rates and the host time between the ops are all the step
    holds."""
    import statistics

    errors = [_rebuilt_errors(run)[(2, "local")] for run in RUNS]
    assert abs(statistics.median(errors)) <= 0.05, errors


def _trace_prediction_errors(run: Path) -> dict[tuple[int, str], float]:
    """(world size, mode) -> error of the step simulated from the profile recorded beside
    ``run``'s world-size-2 DDP trace, against the run's measured median."""
    from collsim.cluster.topology import load_topology
    from collsim.validate.check.step import simulate_modes

    out = {}
    for report in json.loads((run / f"step_trace_{run.name}.json").read_text()):
        n = int(report["world_size"])
        sim = simulate_modes(
            report,
            load_topology("localhost", nodes=1, gpus_per_node=n),
            device_profile=str(run / "trace_profile.yaml"),
        )
        for mode, got in sim.items():
            measured = float(report["modes"][mode]["median_s"])
            out[(n, mode)] = (got.step_time_s - measured) / measured
    return out


RUNS = [GLOO / f"run{i}" for i in (1, 2, 3)]
"""The repeat protocol on a quiet host (each run started at a 1-min load under 1.0)."""
PINNED_QUIET_RUNS = [GLOO / "pinned_quiet" / f"run{i}" for i in (1, 2, 3)]
"""The same protocol recorded again on a quiet host, with the pinned step of ``record.sh``."""
PINNED_BUSY_RUNS = [GLOO / "pinned_busy" / f"run{i}" for i in (1, 2, 3)]
"""Recorded again on a quiet host with the pinned pair beside a busy core (``record.sh`` now)."""
LOADED = GLOO / "loaded"
LOADED_RUNS = [LOADED / f"run{i}" for i in (1, 2, 3)]
"""The same protocol recorded earlier at 1-min loads of 4-26 (validate/data/traces/README.md)."""


def test_the_recorded_trace_profiles_are_what_their_traces_give(tmp_path: Path) -> None:
    """Each run's ``trace_profile.yaml`` is rebuilt from the two ranks' world-size-2 DDP traces
    kept beside it (``collsim validate trace ... --profile-out``): the same GEMM rows; the
    quiet runs' profiles (written again by this code) the same host cost per launch too."""
    import yaml

    from collsim.validate.fit.trace_profile import profile_from_traces

    for run in RUNS + PINNED_QUIET_RUNS + PINNED_BUSY_RUNS + LOADED_RUNS:
        files = sorted(str(p) for p in run.glob("n2_ddp_b25_rank*.json.gz"))
        learned = profile_from_traces(read_traces(files))
        recorded = yaml.safe_load((run / "trace_profile.yaml").read_text())["measured"]
        assert learned.measured["gemm"] == recorded["gemm"]
        assert learned.measured["bandwidth"] == recorded["bandwidth"]
        if run not in LOADED_RUNS:
            assert learned.measured["host_us"] == recorded["host_us"]


def test_a_pinned_step_beside_an_idle_core_gives_no_time_sharing_slowdown() -> None:
    """In two of the three pinned quiet runs the pinned pair ran its GEMM ops 14 and 17 % faster
    than the world-size-2 reference (the other core idle, where the reference's and world size
    4's are busy): their step ratios (x0.79, x0.71) are that gain, not a time-sharing cost, and
    the recorded profiles leave them out; the third run's pinned ops ran no faster and its
    slowdown applies."""
    import yaml

    from collsim.validate.fit.trace_host import PINNED_OP_SPEED_LIMIT, time_sharing

    applied = []
    for run in PINNED_QUIET_RUNS:
        pinned = read_traces(sorted(str(p) for p in (run / "pinned").glob("n2_local_rank*.gz")))
        reference = read_traces(sorted(str(p) for p in run.glob("n2_local_rank*.json.gz")))
        got = time_sharing(pinned, reference)
        notes = yaml.safe_load((run / "trace_profile.yaml").read_text())["measured"]["notes"]
        assert got.op_speed is not None
        assert ("time_sharing_slowdown" in notes) == got.applies
        if not got.applies:
            assert got.op_speed > PINNED_OP_SPEED_LIMIT and got.slowdown < 1.0
        applied.append(got.applies)
    assert applied == [False, False, True]


def test_world_size_4_ddp_from_the_world_size_2_trace_is_within_15_percent() -> None:
    """The loop: trace ``validate step`` at world size 2, learn a profile from the trace,
    predict the DDP steps at world size 4; on each of the three quiet recordings the median
    over its three runs (the repeat protocol of validate/README.md) within 15 % for each DDP
    mode. The figures (validate/data/traces/README.md): run1-3 -10.1 % (1 MB buckets) and
    -11.8 % (25 MB), pinned_quiet -11.7 % and -7.2 %, pinned_busy -1.2 % and +6.7 %."""
    import statistics

    for runs in (RUNS, PINNED_QUIET_RUNS, PINNED_BUSY_RUNS):
        errors = [_trace_prediction_errors(run) for run in runs]
        for mode in ("ddp_b1", "ddp_b25"):
            errs = [r[(4, mode)] for r in errors]
            assert abs(statistics.median(errs)) <= 0.15, (runs[0].parent.name, mode, errs)


def test_the_quiet_runs_predict_fast_where_a_ranks_cpu_time_grows() -> None:
    """What the trace loop misses on the quiet runs, read from the runs themselves: the CPU time
    of a rank's local step (its wall time x the share of a core its thread got, both measured
    by the harness) is larger at world size 4 (two ranks per core) than at world size 2 in every
    run, by 10 % or more in the median; the world-size-4 DDP steps are predicted fast (negative
    error) in every run, as a profile learned at one rank per core must."""
    import statistics

    growth = []
    for run in RUNS:
        reports = {
            int(r["world_size"]): r
            for r in json.loads((run / f"step_trace_{run.name}.json").read_text())
        }
        cpu_s = {n: r["local_step_s"] * r["local_cpu_share"] for n, r in reports.items()}
        growth.append(cpu_s[4] / cpu_s[2])
        if _time_shared(run):
            continue  # the claim below is about a profile learned at one rank per core only
        errors = _trace_prediction_errors(run)
        assert errors[(4, "ddp_b1")] < 0 and errors[(4, "ddp_b25")] < 0, (run.name, errors)
    assert all(g > 1.0 for g in growth), growth
    assert statistics.median(growth) >= 1.10, growth


def _time_shared(run: Path) -> bool:
    """Whether ``run``'s recorded profile holds a time-sharing slowdown (``record.sh`` with the
    pinned traces)."""
    import yaml

    notes = yaml.safe_load((run / "trace_profile.yaml").read_text())["measured"]["notes"]
    return "time_sharing_slowdown" in notes


def _grid_errors(run: Path, profile: Path) -> dict[str, float]:
    """The world-size-4 DDP errors of ``run`` simulated from a ``validate compute`` profile."""
    from collsim.cluster.topology import load_topology
    from collsim.validate.check.step import simulate_modes

    for report in json.loads((run / f"step_trace_{run.name}.json").read_text()):
        if int(report["world_size"]) != 4:
            continue
        sim = simulate_modes(
            report,
            load_topology("localhost", nodes=1, gpus_per_node=4),
            device_profile=str(profile),
        )
        return {
            m: (sim[m].step_time_s - report["modes"][m]["median_s"])
            / report["modes"][m]["median_s"]
            for m in ("ddp_b1", "ddp_b25")
        }
    raise AssertionError(f"{run}: no world-size-4 report")


def test_under_load_the_trace_profile_follows_the_load_the_grid_does_not() -> None:
    """On the runs recorded under load (1-min loads 4-26), the world-size-4 DDP steps predicted
    from the world-size-2 trace miss by less than those predicted from the ``validate compute``
    profile taken before the runs, median over the three runs: the trace's rates carry the
    load the traced steps met, the grid's do not."""
    import statistics

    trace_runs = [_trace_prediction_errors(run) for run in LOADED_RUNS]
    grid_runs = [_grid_errors(run, LOADED / "cpu_profile.yaml") for run in LOADED_RUNS]
    for mode in ("ddp_b1", "ddp_b25"):
        trace = statistics.median(r[(4, mode)] for r in trace_runs)
        grid = statistics.median(r[mode] for r in grid_runs)
        assert abs(trace) < abs(grid), (mode, trace, grid)


@pytest.mark.slow
def test_validate_step_profile_dir_writes_a_readable_trace_per_rank(tmp_path: Path) -> None:
    """``validate step --profile-dir``: one gzipped Kineto trace per mode and rank, each with
    its steps annotated, that ``validate trace`` reads as one job."""
    pytest.importorskip("torch")
    from collsim.validate.measure.step import run_step
    from collsim.validate.measure.step_model import StepConfig

    cfg = StepConfig(
        iters=1, warmup=0, modes=("ddp_b25",), profile_dir=str(tmp_path), trace_steps=2
    )
    report, _ = run_step(cfg, world_size=2, timeout_s=600)
    files = sorted(str(p) for p in tmp_path.glob("n2_ddp_b25_rank*.json.gz"))
    assert len(files) == 2 and (tmp_path / "n2_local_rank0.json.gz").exists()
    traces = read_traces(files)
    assert [t.rank for t in traces] == [0, 1]
    found = [b for t in traces for b in breakdown(t)]
    assert len(found) == 4
    assert any(c.collective == "all_reduce" for b in found for c in b.comms)
    assert all(t.cores is not None and t.local_ranks == 2 for t in traces)
    shares = report["traces"]["cpu_share"]
    assert set(shares) == {"local", "ddp_b25"} and all(0 < v <= 1.05 for v in shares.values())


def test_the_reader_streams_when_the_parse_would_not_fit(monkeypatch: pytest.MonkeyPatch) -> None:
    """orjson (the fastest measured) unless its measured peak for the file would pass half
    the memory available: then ijson, which streams."""
    pytest.importorskip("orjson")
    pytest.importorskip("ijson")
    from collsim.validate.data import kineto as reader

    path = str(DATA / "hta_v100_single_rank.json.gz")
    assert (
        reader._uncompressed_bytes(path)
        > 2 * (DATA / "hta_v100_single_rank.json.gz").stat().st_size
    )
    monkeypatch.setattr(reader, "_available_bytes", lambda: 64 << 30)
    assert reader.default_reader(path) == "orjson"
    monkeypatch.setattr(reader, "_available_bytes", lambda: 1 << 20)
    assert reader.default_reader(path) == "ijson"


def test_nccl_collectives_carry_their_name_size_and_group() -> None:
    """A trace whose NCCL collectives carry ``Collective name``, ``In msg nelems``, ``dtype``
    and ``Group size``: each all-reduce of DDP's buckets with its size in bytes and its group."""
    trace = read_trace(str(DATA / "hta_nccl_args_rank0.json.gz"))
    rows = summarise(breakdown(trace)).comm_table()
    reduces = [r for r in rows if r[0] == "allreduce"]
    assert len(reduces) == 5
    assert all(r[1] is not None and r[1] > 1 << 20 and r[2] == 2 for r in reduces)
    assert any(r[0] == "broadcast" for r in rows)


def test_against_a_scenario_with_the_side_by_side_trace(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """``--scenario``: each traced step and each kind against the simulated step, largest
    difference first; ``--trace-out``: the traced step's ops and the simulated step's slices in
    one Perfetto file, on separate processes."""
    from collsim.validate.check.trace import TRACED_PID

    out_path = tmp_path / "side.json.gz"
    scenario = str(GLOO / "step_gpt_ddp_n2.yaml")
    code, out, _ = _run(
        [*_gloo_trace(), "--scenario", scenario, "--trace-out", str(out_path)], capsys
    )
    assert code == 0, out
    rows = out.split("largest difference first\n", 1)[1].splitlines()[1:11]
    diffs = [abs(float(r.split()[-2])) for r in rows if not r.startswith("step")]
    assert diffs == sorted(diffs, reverse=True) and len(diffs) >= 8
    with gzip.open(out_path, "rt") as f:
        events = json.load(f)["traceEvents"]
    pids = {e.get("pid") for e in events if e.get("ph") == "X"}
    assert TRACED_PID in pids and len(pids) >= 2


def test_reading_a_trace_needs_no_torch(tmp_path: Path) -> None:
    """``validate trace``, its scenario comparison and its profile run with torch unimportable."""
    import subprocess
    import sys

    files = _gloo_trace()
    code = (
        "import sys; sys.modules['torch'] = None\n"
        "from collsim.cli import main\n"
        f"main(['validate', 'trace', *{files!r}, '--profile-out', {str(tmp_path / 'p.yaml')!r},"
        f" '--scenario', {str(GLOO / 'step_gpt_ddp_n2.yaml')!r}])\n"
    )
    proc = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=300, cwd=REPO
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "largest difference first" in proc.stdout and (tmp_path / "p.yaml").exists()
    # the model's own shapes were traced (its one unfused attention product 256 x 32 x 64 not)
    assert "the scenario's GEMM shapes: 9 within 2x of a traced shape, 1 not" in proc.stdout


def test_the_predict_probe_prints_per_run_and_median_errors() -> None:
    """``validate/probes/trace_profile_predict.py`` on a ``record.sh`` folder: the profile's
    host cost and time-sharing slowdown, then per run and as medians the error of every mode
    and of the step without communication at both world sizes, for the trace profile and for
    ``cpu_profile.yaml``."""
    import subprocess
    import sys

    probe = REPO / "validate" / "probes" / "trace_profile_predict.py"
    done = subprocess.run(
        [sys.executable, str(probe), str(LOADED / "record_dev")],
        capture_output=True,
        text=True,
        timeout=300,
        env={"PYTHONPATH": str(REPO), "PATH": ""},
        check=True,
    )
    lines = done.stdout.splitlines()
    assert any(line.startswith("# run1: time sharing not applied, x") for line in lines), lines
    for n in (2, 4):
        for mode in ("ddp_b1", "ddp_b25", "local"):
            for label in ("trace", "compute"):
                assert any(line.startswith(f"run1 n={n} {mode:8s} {label:7s}") for line in lines), (
                    n,
                    mode,
                    label,
                )
                assert any(
                    line.startswith(f"n={n} {mode:8s} {label:7s} median") for line in lines
                ), (n, mode, label)
