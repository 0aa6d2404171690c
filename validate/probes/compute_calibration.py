"""The seven llm-foundry rows and the three Megatron Table 1 rows: ``collsim run`` as it stands
and an ESTIMATE with the framework costs, interference and slowest-GPU pace added here by hand,
as they were before the engine priced them. The engine now prices all three, so the ``run``
column holds them and the ``wired est.`` column (and ``--loo``, fitted on it) counts them twice:
``--loo`` gave the 0.7347 quoted at :data:`collsim.cluster.hardware.HOPPER_SUSTAINED_CLOCK_FRACTION`
before the engine priced them and gives 0.774 now; the ``run`` column's two H100 rows are within
0.3 % with the shipped fraction.

    PYTHONPATH=$PWD python validate/probes/compute_calibration.py [--loo]

The estimate (labelled "wired est."), per step on the critical rank:
- gradient reduce-scatter bytes x grad_reduce_bytes_per_element / 2 (fp32 doubles it): the
  extra link time of the dp reduce-scatters;
- interference: the dp collectives' link time W (capped at the compute time) slows the
  compute under it by overlap_slowdown(device, busbw, memory-bound share):
  extra = W x (1 - 1/factor) (collsim.workload.interference.slowed_compute_s);
- the slowest GPU sets the pace (collsim.workload.kernels.slowest_gpu_factor, the 5 % MAMF
  spread of compute.md 1a): compute x (factor - 1);
- framework costs (collsim.workload.framework): FSDP copy-in per unit per all-gather
  (2 per micro-batch with reshard), grad cast + copy-out per unit per reduce-scatter, the
  gradient-norm pass, the optimizer at the stack's implementation (replacing the engine's
  fused one), the per-step host cost.
"""

from __future__ import annotations

import csv
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from collsim.play.engine import simulate_step  # noqa: E402
from collsim.study.scenario import load_scenario  # noqa: E402
from collsim.workload.compute import ComputeModel  # noqa: E402
from collsim.workload.framework import framework_costs  # noqa: E402
from collsim.workload.interference import overlap_slowdown  # noqa: E402
from collsim.workload.kernels import slowest_gpu_factor  # noqa: E402
from collsim.workload.memory import layer_parameters_per_rank  # noqa: E402

DATA = ROOT / "tests" / "workload" / "data" / "training_calibration.csv"


def rows() -> list[dict[str, str]]:
    with DATA.open() as handle:
        return list(csv.DictReader(line for line in handle if not line.startswith("#")))


def estimate(path: Path) -> dict[str, float]:
    sc = load_scenario(path)
    topo = sc.cluster.load()
    tr, par, spec = sc.training, sc.parallel, sc.model
    res = simulate_step(topo, spec, tr, par)
    n = par.world_size
    tokens = tr.global_batch * spec.seq_len
    model = ComputeModel(
        topo.device,
        str(tr.dtype),
        attention_kernel=tr.attention_kernel,
        execution=str(tr.execution),
        fused_kernels=bool(tr.fused_kernels),
    )
    micro = tr.global_batch // (tr.micro_batch * par.dp)
    unit = float(layer_parameters_per_rank(spec, par.tp))
    local = spec.num_parameters() / (par.tp * par.pp * (par.dp if par.zero >= 1 else 1))
    fw = framework_costs(
        model,
        unit_params=unit,
        local_params=local,
        dp=par.dp,
        zero=par.zero,
        fsdp_version=int(tr.fsdp_version or 1),
        grad_reduce_dtype=str(tr.grad_reduce_dtype),
        grad_clip=bool(tr.grad_clip),
        optimizer=str(tr.optimizer),
        optimizer_implementation=str(tr.optimizer_implementation),
    )
    lt = model.layer_times(spec, micro_batch=tr.micro_batch, recompute=str(tr.recompute))
    block = lt.forward_s + lt.backward_s + lt.recompute_s
    mem_share = lt.memory_bound_s / block if block else 0.0
    compute = res.breakdown_s.get("compute", 0.0)
    dp_link = rs_extra = 0.0
    busbw = 0.0
    for c in res.collectives:
        if c.axis != "dp":
            continue
        t = c.time_s
        if c.op == "reduce_scatter":
            extra = t * (fw.grad_reduce_bytes_per_element / 2.0 - 1.0)
            rs_extra += extra
            t += extra
        dp_link += t
        busbw = max(busbw, c.busbw_bps)
    window = min(dp_link, compute)
    factor = overlap_slowdown(topo.device, busbw_bps=busbw, memory_bound_share=mem_share)
    interference = window * (1.0 - 1.0 / factor) if par.zero >= 3 or par.ddp.overlap else 0.0
    units = spec.num_layers
    ag_per_unit = micro * (2 if par.fsdp.reshard_after_forward else 1)
    framework = fw.per_step_s(
        units=units if par.zero >= 3 else 0,
        all_gathers_per_unit=ag_per_unit,
        reduce_scatters_per_unit=micro,
    ) - res.breakdown_s.get("optimizer", 0.0)
    exposed_rs = max(0.0, dp_link - compute) - res.breakdown_s.get("dp_exposed", 0.0)
    lottery = compute * (slowest_gpu_factor(n) - 1.0)
    wired = res.step_time_s + interference + framework + max(0.0, exposed_rs) + lottery
    return {
        "run_tok": tokens / res.step_time_s / n,
        "wired_tok": tokens / wired / n,
        "step_s": res.step_time_s,
        "compute_s": compute,
        "interference_s": interference,
        "framework_s": framework,
        "lottery_s": lottery,
        "rs_extra_s": rs_extra,
        "factor": factor,
        "mfu": res.mfu,
    }


def _fit_hopper(train: list[dict[str, str]]) -> float:
    """The Hopper sustained-clock fraction that zeroes the mean wired error of ``train``."""
    from collsim.cluster import hardware

    def mean_error(x: float) -> float:
        hardware.SUSTAINED_CLOCK_FRACTION["hopper"] = x
        errs = [
            estimate(ROOT / "scenarios" / "published" / f"{r['id']}.yaml")["wired_tok"]
            / float(r["published_tokens_per_s_per_gpu"])
            - 1
            for r in train
        ]
        return sum(errs) / len(errs)

    lo, hi = 0.5, 1.0
    for _ in range(30):
        mid = (lo + hi) / 2
        if mean_error(mid) > 0:
            hi = mid
        else:
            lo = mid
    return (lo + hi) / 2


def leave_one_out() -> None:
    """Leave-one-out for the one fitted constant (the Hopper sustained clock, fitted to the
    H100 rows): refit on the other H100 row, predict the held-out one. The A100 rows do not
    depend on it, so their held-out error is their in-sample error."""
    from collsim.cluster import hardware

    fitted = hardware.SUSTAINED_CLOCK_FRACTION["hopper"]
    h100 = [r for r in rows() if "h100" in r["id"]]
    print(f"fit on both H100 rows: {_fit_hopper(h100):.4f} (shipped {fitted})")
    for held in h100:
        train = [r for r in h100 if r is not held]
        x = _fit_hopper(train)
        hardware.SUSTAINED_CLOCK_FRACTION["hopper"] = x
        e = estimate(ROOT / "scenarios" / "published" / f"{held['id']}.yaml")
        err = e["wired_tok"] / float(held["published_tokens_per_s_per_gpu"]) - 1
        hardware.SUSTAINED_CLOCK_FRACTION["hopper"] = fitted
        ins = estimate(ROOT / "scenarios" / "published" / f"{held['id']}.yaml")
        err_in = ins["wired_tok"] / float(held["published_tokens_per_s_per_gpu"]) - 1
        print(
            f"{held['id']:26s} fit on the other: {x:.4f}  held-out {err:+.1%}  "
            f"in-sample {err_in:+.1%}"
        )


def main() -> None:
    if "--loo" in sys.argv:
        leave_one_out()
        return
    print(
        f"{'row':26s} {'published':>9s} {'run':>7s} {'err':>7s} {'wired est.':>10s} {'err':>7s}"
        f"  compute  interf.  framew.  factor"
    )
    errs_run, errs_wired = [], []
    for r in rows():
        e = estimate(ROOT / "scenarios" / "published" / f"{r['id']}.yaml")
        pub = float(r["published_tokens_per_s_per_gpu"])
        a, b = e["run_tok"] / pub - 1, e["wired_tok"] / pub - 1
        errs_run.append(a)
        errs_wired.append(b)
        print(
            f"{r['id']:26s} {pub:9.0f} {e['run_tok']:7.0f} {a:+7.1%} "
            f"{e['wired_tok']:10.0f} {b:+7.1%}  {e['compute_s']:7.3f}  "
            f"{e['interference_s']:7.3f}  {e['framework_s']:7.3f}  {e['factor']:.3f}"
        )
    for name, errs in (("run", errs_run), ("wired est.", errs_wired)):
        mean_abs = sum(abs(x) for x in errs) / len(errs)
        print(
            f"{name}: mean |error| {mean_abs:.1%}, signed mean {sum(errs) / len(errs):+.1%}, "
            f"worst {max(errs, key=abs):+.1%}"
        )
    sys.path.insert(0, str(ROOT / "tests" / "engine"))
    from collsim.workload.presets import get_preset
    from tests.engine.conftest import topology
    from tests.engine.test_calibration_megatron import ROWS, megatron_step

    meg, meg_wired = [], []
    for row in ROWS:
        res = megatron_step(row)
        got = res.hardware_tflops_per_gpu
        meg.append(got / float(row["tflops_per_gpu"]) - 1)
        # Megatron 2021: gradients reduced after the backward and TP communication not
        # overlapped (no interference); fused optimizer already in the run; + the slowest GPU
        # and the gradient-norm pass (clip-grad 1.0)
        gpus = int(row["num_gpus"])
        tp, pp = int(row["tp"]), int(row["pp"])
        spec = get_preset(f"megatron-{row['params_billion']}b")
        local = spec.num_parameters() / (tp * pp)
        device = topology("dgx_a100", gpus // 8).device
        clip = ComputeModel(device, "fp16").memory_time_s(12.0 * local, 3)
        extra = res.breakdown_s["compute"] * (slowest_gpu_factor(gpus) - 1.0) + clip
        got_w = got * res.step_time_s / (res.step_time_s + extra)
        meg_wired.append(got_w / float(row["tflops_per_gpu"]) - 1)
        print(
            f"megatron {row['params_billion']:>5s}B  run {got:6.1f} ({meg[-1]:+.1%}), wired est. "
            f"{got_w:6.1f} ({meg_wired[-1]:+.1%}) vs {row['tflops_per_gpu']} TFLOP/s"
        )
    for name, errs, megs in (
        ("run", errs_run, meg),
        ("wired est.", errs_wired, meg_wired),
    ):
        allr = errs + megs
        print(f"signed mean over 7 + 3 rows ({name}): {sum(allr) / len(allr):+.1%}")


if __name__ == "__main__":
    main()
