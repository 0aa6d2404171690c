"""``collsim validate compute`` (a device profile from a generic kernel grid) and the step
prediction from the compute model fed by such a profile."""

from __future__ import annotations

import functools
import json
from dataclasses import asdict
from pathlib import Path
from typing import Any

import pytest

from collsim.cluster.hardware import get_device
from collsim.validate.check.step import simulate_modes
from collsim.validate.measure.compute import GEMM_DIMS, ComputeGrid, write_profile
from collsim.validate.measure.concurrency import cpu_share
from collsim.validate.measure.step_model import StepConfig, model_spec

# a synthetic profile: rates that do not depend on shape, so the expected times are by hand
MEASURED = {
    "gemm": [[m, n, k, "fp32", 0.05] for m in (64, 4096) for n in (64, 4096) for k in (64, 4096)],
    "attention": [["flash2", True, 64, s, 0.02, 0.02] for s in (128, 4096)],
    "bandwidth": [[65536.0, 10.0], [268435456.0, 10.0]],
    "optimizer_bytes_per_s": 1e10,
    "launch_us": 0.0,
    "host_us": 0.0,
    "notes": {"threads": 1, "torch": "none", "device": "cpu", "measured_at_utc": "-"},
}


def test_grid_avoids_the_validated_model_shapes() -> None:
    spec = model_spec(StepConfig())
    model_dims = {spec.hidden, 3 * spec.hidden, spec.ffn_hidden, spec.vocab}
    assert not model_dims & set(GEMM_DIMS)
    assert min(GEMM_DIMS) == 64 and max(GEMM_DIMS) == 4096


def test_cpu_share_counts_threads_over_cores() -> None:
    assert cpu_share(2, 1, 2, 1) == 1.0
    assert cpu_share(4, 1, 2, 1) == 2.0
    assert cpu_share(4, 2, 2, 1) == 4.0
    assert cpu_share(1, 1, 2, 2) == 2.0  # the profile had two threads, the rank one


def _report(world: int, cores: int) -> dict:  # type: ignore[type-arg]
    cfg = StepConfig(modes=("ddp_b25",))
    return {
        "config": asdict(cfg),
        "world_size": world,
        "local_world_size": world,
        "cpu_count": cores,
        "threads_per_rank": 1,
        "backend": "gloo",
        "modes": {"ddp_b25": {"median_s": 1.0}},
        # no "profile" (per-block timings) and no "compute_scale": the prediction must not
        # need them
    }


def test_prediction_uses_the_profile_and_the_cpu_share(tmp_path: Path) -> None:
    from collsim.cluster.topology import load_topology

    path = write_profile(tmp_path / "p.yaml", MEASURED)
    assert get_device(str(path)).measured is not None
    topo = load_topology("localhost", gpus_per_node=4)
    quiet = simulate_modes(_report(4, 4), topo, overlap=False, device_profile=str(path))
    shared = simulate_modes(_report(4, 2), topo, overlap=False, device_profile=str(path))
    c_quiet = quiet["ddp_b25"].breakdown_s["compute"]
    c_shared = shared["ddp_b25"].breakdown_s["compute"]
    assert c_quiet > 0
    assert c_shared == pytest.approx(2 * c_quiet, rel=1e-9)  # 4 ranks on 2 cores: half a core


def test_validate_compute_quick_writes_a_profile(tmp_path: Path) -> None:
    pytest.importorskip("torch")
    from click.testing import CliRunner

    from collsim.cli import cli

    # --quick's promise (seconds, not minutes) is a bounded grid, checked as work, not time
    quick, full = ComputeGrid.quick(), ComputeGrid.full("cpu")
    assert quick.gemm_max_flops < full.gemm_max_flops
    assert quick.attention_max_flops < full.attention_max_flops
    assert quick.mem_max_bytes < full.mem_max_bytes and not quick.concurrency
    assert len(quick.gemm_dims) < len(full.gemm_dims) and quick.reps <= full.reps
    result = CliRunner().invoke(
        cli, ["validate", "compute", "--quick", "-o", str(tmp_path / "q.yaml")]
    )
    assert result.exit_code == 0, result.output
    device = get_device(str(tmp_path / "q.yaml"))
    tables = device.measured
    assert {r[3] for r in tables.gemm} >= {"fp32"}
    assert {r[0] for r in tables.attention} >= {"flash2"}
    assert len(tables.bandwidth) >= 4 and tables.optimizer_bytes_per_s > 0
    assert tables.host_us is not None and tables.host_us > 0
    assert {r[0] for r in tables.activation} == {"gelu", "swiglu"}
    assert all(r[2] > 0 and r[3] > 0 for r in tables.activation)


def test_cpu_share_applies_the_measured_concurrency_slowdown() -> None:
    assert cpu_share(2, 1, 2, 1, 1.5) == 1.5  # two ranks on two cores, each 1.5x slower
    assert cpu_share(4, 1, 2, 1, 1.5) == 3.0
    assert cpu_share(1, 1, 2, 1, 1.5) == 1.0  # one thread alone: as profiled


QUIET = Path(__file__).resolve().parents[2] / "validate" / "data"


CPU_COMPUTE_GAP = (
    "not met on these earlier recordings (18-36 % fast): their model started from PyTorch's "
    "module defaults, whose subnormal softmax terms made its no-communication step 39-43 ms "
    "in the harness against 17-22 ms in a plain loop, and their profiles timed GEMM results "
    "and memory-bound kernels hot and had no activation rows; a GPU SM-interference term "
    "misapplied to the CPU device had hidden the gap. The third host's recording, with both "
    "fixed, is held below (validate/README.md)"
)


@pytest.mark.xfail(strict=True, reason=CPU_COMPUTE_GAP)
def test_recorded_steps_from_the_quiet_profile_are_within_15_percent() -> None:
    """The three recorded runs of ``collsim validate step --world-sizes 2,4 --iters 15
    --device-profile validate/data/cpu_profile.yaml`` (validate/README.md, "The step predicted
    from a device profile"), simulated again from the profile and the collectives each run
    timed in its own loop with today's code: every DDP step and the median of each (world
    size, mode) are within 15 % of the measured median; FSDP is reported, and its median error
    is held to the same 15 %. Nothing is scaled to a measured step: the profile is a generic
    kernel grid taken before the runs."""
    import statistics

    from collsim.cluster.topology import load_topology

    profile = QUIET / "cpu_profile.yaml"
    errors: dict[tuple[int, str], list[float]] = {}
    for run in (1, 2, 3):
        reports = json.loads((QUIET / f"step_profile_quiet_run{run}.json").read_text())
        assert [r["world_size"] for r in reports] == [2, 4]
        for report in reports:
            n = int(report["world_size"])
            assert report["compute_scale"] != 1.0  # measured, and not applied below
            sim = simulate_modes(
                report,
                load_topology("localhost", nodes=1, gpus_per_node=n),
                device_profile=str(profile),
            )
            for mode, got in sim.items():
                measured = report["modes"][mode]["median_s"]
                errors.setdefault((n, mode), []).append((got.step_time_s - measured) / measured)
    for (n, mode), errs in errors.items():
        assert len(errs) == 3
        if mode.startswith("ddp"):
            assert max(abs(e) for e in errs) <= 0.15, (n, mode, errs)
        assert abs(statistics.median(errs)) <= 0.15, (n, mode, errs)


SECOND = QUIET / "second_host"


def _steps(reports: list[dict], profile: Path) -> dict[tuple[int, str], float]:
    """(world size, mode) -> the step simulated from ``profile``, seconds."""
    from collsim.cluster.topology import load_topology

    out = {}
    for report in reports:
        n = int(report["world_size"])
        sim = simulate_modes(
            report,
            load_topology("localhost", nodes=1, gpus_per_node=n),
            device_profile=str(profile),
        )
        for mode, got in sim.items():
            out[(n, mode)] = got.step_time_s
    return out


def _errors(reports: list[dict], profile: Path) -> dict[tuple[int, str], float]:
    """(world size, mode) -> error of the step simulated from ``profile`` against the measured
    median."""
    measured = {
        (int(r["world_size"]), mode): r["modes"][mode]["median_s"]
        for r in reports
        for mode in r["modes"]
    }
    return {k: (s - measured[k]) / measured[k] for k, s in _steps(reports, profile).items()}


@pytest.mark.xfail(strict=True, reason=CPU_COMPUTE_GAP)
def test_second_host_runs_from_its_own_profile_are_within_15_percent() -> None:
    """The repeat protocol again on another host of the same kind (its GEMMs about 1.6 x the
    first's peak): a profile taken there, then three step runs, each started at a 1-min load
    under 1.0 (validate/README.md). Every DDP step and every median are within 15 %."""
    import statistics

    runs = [
        _errors(
            json.loads((SECOND / f"step_profile_run{i}.json").read_text()),
            SECOND / "cpu_profile.yaml",
        )
        for i in (1, 2, 3)
    ]
    for key in runs[0]:
        errs = [run[key] for run in runs]
        if key[1].startswith("ddp"):
            assert max(abs(e) for e in errs) <= 0.15, (key, errs)
        assert abs(statistics.median(errs)) <= 0.15, (key, errs)


def test_the_profile_of_the_host_decides_the_prediction() -> None:
    """The same recorded run priced with the first host's profile (its GEMMs slower: fp32
    peak 102 against 167 GFLOP/s) is more than 5 % slower in every DDP mode than with the
    second host's own profile: a profile describes the host it was taken on."""
    report = json.loads((SECOND / "step_first_host_profile.json").read_text())
    first = _steps(report, QUIET / "cpu_profile.yaml")
    own = _steps(report, SECOND / "cpu_profile.yaml")
    ddp = [k for k in own if k[1].startswith("ddp")]
    assert len(ddp) == 4 and all(first[k] > 1.05 * own[k] for k in ddp), (first, own)


def test_a_cpu_profile_adds_no_sm_interference() -> None:
    """A CPU device holds no SMs for a collective (collsim.cluster.hardware.Device.nccl_sms): the
    sharing of the cores by gloo and the compute is the in-situ model's (dp_on_busy_cores),
    so the GPU interference term is left with the HBM share of the memory-bound kernels,
    well under 1 % of every simulated step."""
    from collsim.cluster.hardware import get_device
    from collsim.cluster.topology import load_topology

    report = json.loads((SECOND / "step_profile_run1.json").read_text())[0]
    topo = load_topology("localhost", nodes=1, gpus_per_node=int(report["world_size"]))
    for profile in (QUIET / "cpu_profile.yaml", SECOND / "cpu_profile.yaml"):
        assert get_device(str(profile)).nccl_sms == 0
        sim = simulate_modes(report, topo, device_profile=str(profile))
        for got in sim.values():
            assert got.breakdown_s["interference"] < 0.01 * got.step_time_s, got.breakdown_s
            assert got.breakdown_s["dp_on_busy_cores"] > 0


def test_a_gpu_profile_does_not_add_a_launch_floor_to_its_measured_times(tmp_path: Path) -> None:
    # each grid point's time already holds what the launch floor stands for (a call and its
    # wait on a CPU, the gaps of a queued burst on a GPU); the model's default 4 us floor on
    # top would count small kernels twice
    from collsim.workload.compute import ComputeModel

    measured = dict(MEASURED, launch_us=None)
    path = write_profile(tmp_path / "gpu.yaml", measured, device="cuda")
    device = get_device(str(path))
    assert device.measured is not None and device.measured.launch_us == 0.0
    assert ComputeModel(device, "fp32").launch_s == 0.0


def test_a_profile_prices_the_activation_at_its_measured_rate(tmp_path: Path) -> None:
    """A profile's ``activation`` rows replace bytes / bandwidth for the MLP activation: GELU
    (exact erf) is compute-bound on a CPU. Rates interpolate in log elements; a gated MLP
    takes the SwiGLU rows; a shared core halves the rate."""
    import dataclasses
    import math

    from collsim.workload.compute import ComputeModel

    rows = [
        ["gelu", 1e4, 0.5, 0.25],
        ["gelu", 1e6, 1.0, 0.5],
        ["swiglu", 1e4, 2.0, 1.0],
        ["swiglu", 1e6, 2.0, 1.0],
    ]
    path = write_profile(tmp_path / "act.yaml", dict(MEASURED, activation=rows))
    device = get_device(str(path))
    spec = dataclasses.replace(model_spec(StepConfig()), flash_attention=True)
    elements = 2 * spec.seq_len * spec.ffn_hidden  # micro-batch 2
    t = math.log(elements / 1e4) / math.log(1e6 / 1e4)
    fwd_rate = math.exp(math.log(0.5) + t * math.log(2.0)) * 1e9  # 0.5 -> 1.0 Gelem/s

    def act(model: ComputeModel, s: object = spec) -> tuple[float, float]:
        ops = model.layer_times(s, micro_batch=2).ops  # type: ignore[arg-type]
        got = {c.phase: c.time_s for c in ops if c.name == "activation"}
        return got["forward"], got["backward"]

    fwd, bwd = act(ComputeModel(device, "fp32"))
    assert fwd == pytest.approx(elements / fwd_rate, rel=1e-9)
    assert bwd == pytest.approx(2 * elements / fwd_rate, rel=1e-9)  # half the rate
    plain = get_device(str(write_profile(tmp_path / "plain.yaml", MEASURED)))
    mem_fwd, _ = act(ComputeModel(plain, "fp32"))
    assert mem_fwd == pytest.approx(2 * 4 * elements / 10e9, rel=1e-9)  # 8 B/element at 10 GB/s
    gated = dataclasses.replace(spec, gated_mlp=True)
    g_fwd, g_bwd = act(ComputeModel(device, "fp32"), gated)
    assert (g_fwd, g_bwd) == pytest.approx((elements / 2e9, elements / 1e9), rel=1e-9)
    shared = dataclasses.replace(device, measured=device.measured.shared(2.0))
    assert act(ComputeModel(shared, "fp32"))[0] == pytest.approx(2 * fwd, rel=1e-9)


THIRD = QUIET / "third_host"


def test_third_host_runs_from_its_own_profile_are_within_15_percent() -> None:
    """The repeat protocol on a third host, after the harness and profile fixes
    (validate/README.md, "A third host"): a profile taken there, then three step runs, each
    started at a 1-min load under 1.0. The criterion of the earlier hosts' tests: every DDP
    step and every median (FSDP's too) within 15 % of the measured step; nothing is scaled to
    a measured step. As recorded: DDP -9.7 to +6.5 % (medians +0.8 / -5.8 / -4.6 / +3.0 %),
    FSDP -10.4 to -23.4 % (medians -13.0 / -14.7 %)."""
    import statistics

    runs = [
        _errors(
            json.loads((THIRD / f"step_profile_run{i}.json").read_text()),
            THIRD / "cpu_profile.yaml",
        )
        for i in (1, 2, 3)
    ]
    assert len(runs[0]) == 6
    for key in runs[0]:
        errs = [run[key] for run in runs]
        if key[1].startswith("ddp"):
            assert max(abs(e) for e in errs) <= 0.15, (key, errs)
        assert abs(statistics.median(errs)) <= 0.15, (key, errs)
    # the profile has the activation rows the prediction used
    assert {r[0] for r in get_device(str(THIRD / "cpu_profile.yaml")).measured.activation} == {
        "gelu",
        "swiglu",
    }


def test_memory_bound_rates_take_the_memory_slowdown(tmp_path: Path) -> None:
    """Ranks on separate cores slow one another's streaming kernels (shared memory bandwidth)
    more than their GEMMs: a profile's ``concurrent_memory_slowdown`` divides the bandwidth
    and optimizer rates, ``concurrent_slowdown`` the compute rates; a profile from before
    the split has one figure, used for both."""
    from collsim.validate.check.step import profile_device

    report = _report(2, 2)
    both = dict(MEASURED, concurrent_slowdown=1.05, concurrent_memory_slowdown=1.2)
    device, share, memory_share = profile_device(
        report, str(write_profile(tmp_path / "both.yaml", both))
    )
    assert (share, memory_share) == pytest.approx((1.05, 1.2))
    tables = device.measured
    assert tables.gemm[0][4] == pytest.approx(0.05 / 1.05)
    assert tables.bandwidth[0][1] == pytest.approx(10.0 / 1.2)
    assert tables.optimizer_bytes_per_s == pytest.approx(1e10 / 1.2)
    old = dict(MEASURED, concurrent_slowdown=1.1)
    _, share, memory_share = profile_device(report, str(write_profile(tmp_path / "old.yaml", old)))
    assert share == memory_share == pytest.approx(1.1)
    # 4 ranks on 2 cores: half a core each, then the slowdowns on top
    _, share, memory_share = profile_device(
        _report(4, 2), str(write_profile(tmp_path / "both4.yaml", both))
    )
    assert (share, memory_share) == pytest.approx((2.1, 2.4))


def test_cold_gemm_timings_never_reuse_a_slot_until_the_pool_wraps() -> None:
    """Consecutive timed GEMMs, across the three layouts and across shapes, write into
    different result blocks (one cursor for every cold timing): a cursor restarted per
    layout would send each layout's calls to the blocks the previous one just wrote."""
    torch = pytest.importorskip("torch")
    from collsim.validate.measure import compute

    seen: list[int] = []

    class Recording:
        def __getattr__(self, name: str) -> Any:
            return getattr(torch, name)

        @staticmethod
        def mm(a: Any, b: Any, out: Any) -> Any:
            seen.append(out.data_ptr())
            return torch.mm(a, b, out=out)

    dev = torch.device("cpu")
    for shape in ((64, 64, 64), (64, 160, 64)):
        timer = functools.partial(compute._median_time, sync=lambda: None)
        compute._gemm_time(Recording(), dev, torch.float32, *shape, 3, timer)
    # 2 shapes x 3 layouts x (1 warm-up + 3 timed) calls, all into different blocks
    assert len(seen) == 24 and len(set(seen)) == 24


def test_the_concurrency_probe_runs_both_kinds_in_process() -> None:
    import queue
    import threading

    torch = pytest.importorskip("torch")
    from collsim.validate.measure.concurrency import (
        PROBE_KINDS,
        _probe_worker,
        concurrency_slowdown,
    )

    threads = torch.get_num_threads()
    try:
        for kind in PROBE_KINDS:
            start, out = threading.Event(), queue.Queue()  # type: ignore[var-annotated]
            start.set()
            _probe_worker(kind, 2, start, out)
            assert out.get_nowait() > 0
    finally:
        torch.set_num_threads(threads)  # the worker sets 1 for its own process
    with pytest.raises(ValueError, match="kind must be one of"):
        concurrency_slowdown(2, "disk")


def test_cold_adds_take_new_blocks_and_large_sizes_pools_of_their_own() -> None:
    """The bandwidth table's adds share the GEMMs' cursor (consecutive calls write different
    blocks), and a size whose 4 triples do not fit in the shared pool gets a pool of its own
    rather than one hot triple."""
    torch = pytest.importorskip("torch")
    from collsim.validate.measure import compute

    outs: dict[int, list[int]] = {}

    class Recording:
        def __getattr__(self, name: str) -> Any:
            return getattr(torch, name)

        @staticmethod
        def add(a: Any, b: Any, out: Any) -> Any:
            outs.setdefault(out.numel(), []).append(out.data_ptr())
            return torch.add(a, b, out=out)

    small, large = 64 * 1024, 32 * 2**20  # 4 triples of 32 MiB moved: 128 MiB > 64 MiB pool
    grid = compute.ComputeGrid(mem_sizes_bytes=(small, large), mem_max_bytes=large, reps=5)
    rows = compute._bandwidth_rates(
        Recording(),
        torch.device("cpu"),
        grid,
        functools.partial(compute._median_time, sync=lambda: None),
    )
    assert [r[0] for r in rows] == [float(12 * (small // 12)), float(12 * (large // 12))]
    for ptrs in outs.values():  # 1 warm-up + 5 timed calls per size
        assert len(ptrs) == 6 and len(set(ptrs)) >= 4, ptrs
    shared = compute._pool(torch, torch.device("cpu"), torch.float32, "out")
    lo, hi = shared.data_ptr(), shared.data_ptr() + shared.numel() * 4
    assert all(not lo <= p < hi for p in outs[large // 12])  # its own pool
    assert all(lo <= p < hi for p in outs[small // 12])


class _FakeGPU:
    """A device timeline and a host clock, as ``_QueuedTimer`` sees them through
    ``torch.cuda``: work queued runs after what is queued before it, an event completes when
    the device reaches it; the host advances by each call's host cost and waits on syncs."""

    def __init__(self) -> None:
        self.host = 0.0
        self.device = 0.0  # when the device is done with everything queued
        gpu = self

        class Event:
            def __init__(self, enable_timing: bool = False) -> None:
                self.t = 0.0

            def record(self) -> None:
                gpu.device = max(gpu.device, gpu.host)
                self.t = gpu.device

            def query(self) -> bool:
                return self.t <= gpu.host

            def synchronize(self) -> None:
                gpu.host = max(gpu.host, self.t)

            def elapsed_time(self, end: Any) -> float:
                return (end.t - self.t) * 1e3

        class Cuda:
            @staticmethod
            def synchronize() -> None:
                gpu.host = max(gpu.host, gpu.device)

            @staticmethod
            def _sleep(cycles: int) -> None:
                gpu.run(0.0, cycles * 1e-9)  # a 1 GHz clock

        Cuda.Event = Event  # type: ignore[attr-defined]
        self.cuda = Cuda

    def run(self, host_s: float, device_s: float, sync: bool = False) -> None:
        self.host += host_s
        self.device = max(self.device, self.host) + device_s
        if sync:
            self.host = self.device


@pytest.mark.parametrize(
    ("host_s", "device_s", "sync"),
    [(10e-6, 50e-6, False), (100e-6, 5e-6, False), (20e-6, 5e-6, True)],
)
def test_a_queued_gpu_timing_holds_the_device_time_and_always_ends(
    host_s: float, device_s: float, sync: bool
) -> None:
    from collsim.validate.measure import compute

    gpu = _FakeGPU()
    timer = compute._QueuedTimer(gpu)
    assert timer.s_per_cycle == pytest.approx(1e-9)
    measured = timer(lambda: gpu.run(host_s, device_s, sync), 3)
    if not sync:  # back to back behind the sleep, whichever side is slower per call
        assert measured == pytest.approx(device_s)
        assert timer.host_bound == 0
        assert (timer.sleeps > 0) == (host_s > device_s)  # a host-bound burst needed more sleep
    else:  # the host waits for each call: no sleep is long enough; taken as it ran
        assert timer.host_bound > 0
        assert host_s < measured <= host_s + device_s  # the first call's host hid in the sleep
