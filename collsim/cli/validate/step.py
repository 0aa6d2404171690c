"""``collsim validate step``: time real training steps and compare them with the simulated step."""

from __future__ import annotations

import json
from pathlib import Path
from typing import TYPE_CHECKING, Any

import click

from collsim.cli.common import OneLineCommand, check_output_path
from collsim.cli.validate.shared import vars_of

if TYPE_CHECKING:
    from collsim.validate.measure.step_model import StepConfig

__all__ = ["step"]


def _world_sizes(ctx: click.Context, param: click.Parameter, value: str) -> list[int]:
    try:
        sizes = [int(s) for s in value.split(",") if s.strip()]
    except ValueError:
        raise click.BadParameter(f"expected comma-separated integers, got {value!r}") from None
    if not sizes or any(n < 1 for n in sizes):
        raise click.BadParameter(f"expected world sizes >= 1, got {value!r}")
    return sizes


@click.command(cls=OneLineCommand)
@click.option(
    "--world-sizes",
    default="2,4",
    show_default=True,
    callback=_world_sizes,
    help="Comma-separated world sizes to measure and simulate.",
)
@click.option("--backend", type=click.Choice(["gloo", "nccl"]), default="gloo", show_default=True)
@click.option(
    "--topology",
    default=None,
    help="Calibrated topology to simulate on; default: measure collectives at each "
    "world size and calibrate first (in this command).",
)
@click.option("--iters", type=click.IntRange(1), default=10, show_default=True)
@click.option("--warmup", type=click.IntRange(0), default=3, show_default=True)
@click.option("--layers", type=click.IntRange(1), default=4, show_default=True)
@click.option("--hidden", type=click.IntRange(8), default=256, show_default=True)
@click.option("--micro-batch", type=click.IntRange(1), default=2, show_default=True)
@click.option(
    "--target",
    type=click.FloatRange(0, 1),
    default=0.15,
    show_default=True,
    help="|simulated - measured| / measured allowed for DDP steps.",
)
@click.option(
    "--timeout", "timeout_s", type=click.FloatRange(min=1), default=900.0, show_default=True
)
@click.option(
    "-o",
    "--output",
    type=click.Path(dir_okay=False),
    default=None,
    help="JSON report (measured, profiled, simulated).",
)
@click.option(
    "--straggler-rank",
    type=click.IntRange(0),
    default=None,
    help="Slow this rank on purpose: every DDP mode is also timed with it running its "
    "compute --straggler-repeat times, and simulated with that rank at clock 1/repeat.",
)
@click.option("--straggler-repeat", type=click.IntRange(2), default=2, show_default=True)
@click.option(
    "--straggler-delay-ms",
    type=click.FloatRange(min=0),
    default=0.0,
    show_default=True,
    help="Slow the rank with a busy loop of this many ms on the wall clock instead of "
    "repeated compute (0: repeat).",
)
@click.option(
    "--progress",
    "progress_path",
    type=click.Path(dir_okay=False),
    default=None,
    help="Append every iteration's timings to PATH.rank<r>.jsonl as they are taken.",
)
@click.option(
    "--device-profile",
    "device_profile",
    type=click.Path(exists=True, dir_okay=False),
    default=None,
    help="Device profile from `collsim validate compute`: simulate the compute with the "
    "compute model fed by it (no block profile of this model, no scaling to the step).",
)
@click.option(
    "--profile-dir",
    "profile_dir",
    type=click.Path(file_okay=False),
    default=None,
    help="After the timed steps, trace 3 more steps of each mode with the torch profiler "
    "(CPU activities, shapes): DIR/n<N>_<mode>_rank<r>.json.gz, for `validate trace`.",
)
def step(
    world_sizes: list[int],
    backend: str,
    topology: str | None,
    iters: int,
    warmup: int,
    layers: int,
    hidden: int,
    micro_batch: int,
    target: float,
    timeout_s: float,
    output: str | None,
    straggler_rank: int | None,
    straggler_repeat: int,
    straggler_delay_ms: float,
    progress_path: str | None,
    device_profile: str | None,
    profile_dir: str | None,
) -> None:
    """Time real DDP (bucket 1 and 25 MB) and FSDP-sketch steps of a small GPT; simulate them."""
    # start-up: loaded only when this runs (--help and bad input stay fast)
    import tempfile

    # start-up: loaded only when this runs (--help and bad input stay fast)
    from collsim.validate.measure.launch import in_torchrun
    from collsim.validate.measure.step import run_step
    from collsim.validate.measure.step_model import StepConfig

    sizes: list[int | None] = list(world_sizes)
    if in_torchrun():
        sizes = [None]  # the job's own world size
    cfg = StepConfig(
        num_layers=layers,
        hidden=hidden,
        ffn_hidden=4 * hidden,
        micro_batch=micro_batch,
        iters=iters,
        warmup=warmup,
        straggler_rank=straggler_rank,
        straggler_repeat=straggler_repeat,
        straggler_delay_s=straggler_delay_ms / 1e3,
        progress_path=progress_path,
        profile_dir=None if profile_dir is None else str(Path(profile_dir).resolve()),
    )
    check_output_path(output, "-o/--output", suffixes=(".json",))
    _check_step_before_work(cfg, [n for n in sizes if n is not None])
    # removed when the command ends, however it ends (click closes the context)
    ctx = click.get_current_context()
    folder = Path(ctx.with_resource(tempfile.TemporaryDirectory(prefix="collsim-step-")))
    reports = []
    failures: list[str] = []
    for n in sizes:
        # Steps and their calibration run under the default policy: with more ranks than
        # cores, SCHED_RR lets a rank keep a core for a whole 100 ms quantum, so the profiled
        # blocks see an unshared core that the real step does not have.
        topo_spec = topology or str(_calibrate_here(n, backend, timeout_s, folder))
        report, is_reporter = run_step(cfg, world_size=n, backend=backend, timeout_s=timeout_s)
        if not is_reporter:
            continue
        n = int(report["world_size"])
        topo, overlap, simulated, other = _simulate_step(report, topo_spec, device_profile)
        _echo_step_notes(report, cfg, topo, topo_spec, overlap, other, device_profile)
        if report.get("traces"):
            shares = ", ".join(f"{m} {v:.2f}" for m, v in report["traces"]["cpu_share"].items())
            click.echo(
                f"# traced {cfg.trace_steps} steps per mode into {profile_dir} (rank 0's thread "
                f"got {shares} of a core over them)"
            )
        failures += _echo_step_modes(report, simulated, target, n)
        failures += _echo_straggler(
            report, cfg, topo, overlap, simulated, target, n, straggler_delay_ms
        )
        failures += _echo_bucket_effect(report, simulated, n)
        reports.append(report)
    if output and reports:
        Path(output).write_text(json.dumps(reports, indent=1) + "\n")
        click.echo(f"# wrote {output}", err=True)
    if failures:
        raise click.ClickException(f"outside the target: {', '.join(failures)}")


#: Copies of the parameters a rank of ``validate step`` holds at once: the parameters, their
#: gradients, DDP's bucket views of them and FSDP's gathered copy (SGD keeps no state).
_STEP_PARAMETER_COPIES = 4


def _check_step_before_work(cfg: Any, world_sizes: list[int]) -> None:
    """What ``validate step`` can refuse before it starts a rank: a slowed rank outside the
    smallest world size, a hidden size the heads do not divide, a model the ranks cannot hold
    in this machine's available memory."""
    # start-up: loaded only when this runs (--help and bad input stay fast)
    from collsim.validate.measure.bench import RANK_BASE_BYTES, available_memory_bytes

    if cfg.straggler_rank is not None and world_sizes and cfg.straggler_rank >= min(world_sizes):
        raise click.BadParameter(
            f"must be < the smallest world size ({min(world_sizes)}), got {cfg.straggler_rank}",
            param_hint="--straggler-rank",
        )
    if cfg.hidden % cfg.num_heads:
        raise click.BadParameter(
            f"must be a multiple of the {cfg.num_heads} heads, got {cfg.hidden}",
            param_hint="--hidden",
        )
    h, ffn = cfg.hidden, cfg.ffn_hidden
    params = (
        cfg.num_layers * (4 * h * h + 2 * h * ffn + 9 * h + ffn) + (cfg.vocab + cfg.seq_len) * h
    )
    per_rank = RANK_BASE_BYTES + _STEP_PARAMETER_COPIES * 4 * params
    need = max(world_sizes, default=1) * per_rank
    have = available_memory_bytes()
    if have is not None and need > have:
        raise click.BadParameter(
            f"a model of {params:,} fp32 parameters needs about {need / 2**30:.1f} GiB on "
            f"{max(world_sizes, default=1)} ranks ({_STEP_PARAMETER_COPIES} copies each), this "
            f"machine has {have / 2**30:.1f} GiB available; use a smaller --hidden or --layers",
            param_hint="--hidden/--layers",
        )


def _simulate_step(
    report: dict[str, Any], topo_spec: str, device_profile: str | None
) -> tuple[Any, bool, dict[str, Any], dict[str, Any]]:
    """The measured step simulated on ``topo_spec``, DDP's all-reduces overlapping backward
    or not as the cores allow, and the other choice; the report gets what was simulated.

    Returns:
        The topology, whether DDP overlaps, the simulated modes and the other choice's.
    """
    # start-up: loaded only when this runs (--help and bad input stay fast)
    from collsim.cluster.topology import load_topology
    from collsim.validate.check.step import cores_busy, simulate_modes

    n = int(report["world_size"])
    per_node = int(report.get("local_world_size", n))
    topo = load_topology(topo_spec, nodes=max(1, n // per_node), gpus_per_node=per_node)
    overlap = not cores_busy(report)
    simulated = simulate_modes(report, topo, overlap=overlap, device_profile=device_profile)
    other = simulate_modes(report, topo, overlap=not overlap, device_profile=device_profile)
    if device_profile is not None:
        # start-up: loaded only when this runs (--help and bad input stay fast)
        from collsim.validate.check.step import profile_device

        _, share, memory_share = profile_device(report, device_profile)
        report["device_profile"] = device_profile
        report["cpu_share"] = share
        report["cpu_share_memory"] = memory_share
    report["topology"] = topo_spec
    report["ddp_overlap_simulated"] = overlap
    report["simulated"] = {m: vars_of(s) for m, s in simulated.items()}
    report["simulated_other_overlap"] = {m: vars_of(s) for m, s in other.items()}
    return topo, overlap, simulated, other


def _echo_step_notes(
    report: dict[str, Any],
    cfg: StepConfig,
    topo: Any,
    topo_spec: str,
    overlap: bool,
    other: dict[str, Any],
    device_profile: str | None,
) -> None:
    """Print what the simulation assumed: DDP's overlap (or the in-situ CPU sharing), the
    model, the profiled blocks, where the compute comes from and the probes timed alone."""
    n = int(report["world_size"])
    if report.get("insitu_topology_yaml"):
        # start-up: loaded only when this runs (--help and bad input stay fast)
        from collsim.validate.measure.insitu import sharing_factor

        scope = "this session's" if report.get("sched_autogroup") else "every"
        click.echo(
            "# DDP all-reduces simulated overlapping backward; the ranks' CPU is shared by "
            f"{scope} runnable threads: the local step's thread got "
            f"{report.get('local_cpu_share', 1.0):.2f} of a core, so compute and a "
            f"collective beside it each run {sharing_factor(report):.2f}x slower "
            "(collsim.validate.measure.insitu)"
        )
    else:
        click.echo(
            f"# DDP all-reduces simulated {'overlapping' if overlap else 'after'} "
            f"backward ({report['world_size']} ranks x {report.get('threads_per_rank')} "
            f"thread(s) on {report.get('cpu_count')} cores); the other choice gives "
            + ", ".join(
                f"{m} {o.step_time_s * 1e3:.1f} ms" for m, o in other.items() if m.startswith("ddp")
            )
        )
    click.echo(
        f"# world size {n}, {report['num_parameters']} parameters, micro-batch "
        f"{cfg.micro_batch} x seq {cfg.seq_len}, topology {topo_spec}"
    )
    click.echo(
        "# profiled per block (ms): "
        + ", ".join(f"{k} {v * 1e3:.2f}" for k, v in sorted(report["profile"].items()))
    )
    if device_profile is None:
        click.echo(
            f"# a whole step without communication: {report['local_step_s'] * 1e3:.1f} "
            f"ms (slowest rank, median); the profiled blocks add up to "
            f"{report['profile_sum_s'] * 1e3:.1f} ms, so the simulated compute is "
            f"scaled by {report['compute_scale']:.3f}"
        )
    else:
        click.echo(
            f"# compute from the model fed by {device_profile} (rates / CPU share "
            f"{report['cpu_share']:.2f}, memory-bound rates / "
            f"{report.get('cpu_share_memory', report['cpu_share']):.2f}); for reference, a "
            f"whole step without "
            f"communication measured {report['local_step_s'] * 1e3:.1f} ms, the profiled "
            f"blocks {report['profile_sum_s'] * 1e3:.1f} ms (neither used)"
        )
    # start-up: loaded only when this runs (--help and bad input stay fast)
    from collsim.validate.measure.insitu import probe_summary

    lines = probe_summary(report, topo)
    if lines:
        click.echo(
            "# timed alone in the same loop (slowest rank, median): "
            + "; ".join(lines)
            + (
                "; collectives simulated on the topology fitted to these"
                if report.get("insitu_topology_yaml")
                else f" (not used: {report.get('insitu_note')})"
            )
        )


def _echo_step_modes(
    report: dict[str, Any], simulated: dict[str, Any], target: float, n: int
) -> list[str]:
    """Print measured against simulated per mode (each mode's error goes into the report);
    the DDP modes (without a straggler) outside ``target``."""
    click.echo(
        f"# {'mode':<9} {'measured(ms)':>12} {'min(ms)':>8} {'simulated(ms)':>13} "
        f"{'error':>7}  simulated breakdown (ms)"
    )
    failures = []
    for mode, meas in report["modes"].items():
        sim = simulated[mode]
        err = (sim.step_time_s - meas["median_s"]) / meas["median_s"]
        meas["error"] = err
        verdict = ""
        if mode.startswith("ddp") and not mode.endswith("+straggler"):
            verdict = "PASS" if abs(err) <= target else "FAIL"
            if verdict == "FAIL":
                failures.append(f"n={n} {mode}")
        parts = ", ".join(f"{k} {v * 1e3:.1f}" for k, v in sim.breakdown_s.items() if v)
        click.echo(
            f"  {mode:<9} {meas['median_s'] * 1e3:>12.1f} {meas['min_s'] * 1e3:>8.1f} "
            f"{sim.step_time_s * 1e3:>13.1f} {err * 100:>6.1f}%  {verdict:<4} {parts}"
        )
    return failures


def _echo_straggler(
    report: dict[str, Any],
    cfg: StepConfig,
    topo: Any,
    overlap: bool,
    simulated: dict[str, Any],
    target: float,
    n: int,
    straggler_delay_ms: float,
) -> list[str]:
    """Print the straggler slowdowns, measured and simulated (at the slowed rank's measured
    speed and at the nominal one; both go into the report); the ratios outside ``target``."""
    # start-up: loaded only when this runs (--help and bad input stay fast)
    from collsim.validate.check.step import simulate_modes, straggler_ratios

    ratios = straggler_ratios(
        report, simulate_modes(report, topo, overlap=overlap, measured_factor=True)
    )
    nominal = straggler_ratios(report, simulated)
    if ratios:
        report["straggler"] = ratios
        report["straggler_nominal_factor"] = nominal
        click.echo(
            f"# straggler: rank {cfg.straggler_rank} "
            + (
                f"spins {straggler_delay_ms:g} ms before its step; "
                if straggler_delay_ms
                else f"runs its compute {cfg.straggler_repeat}x; "
            )
            + "slowdown = straggler step / normal step of the same iteration (median over "
            "iterations); simulated with the slowed rank at its measured speed, local step "
            "/ (local step + its extra seconds), and at the nominal 1/repeat"
        )
    failures = []
    for base, r in ratios.items():
        ok = abs(r["error"]) <= target
        if not ok:
            failures.append(f"n={n} {base} straggler ratio")
        nom = nominal[base]
        click.echo(
            f"  {base:<9} measured {r['measured_ratio']:.3f}x (iterations "
            f"{r['measured_ratio_min']:.2f}-{r['measured_ratio_max']:.2f}; medians "
            f"{r['measured_straggler_s'] * 1e3:.1f} / {r['measured_normal_s'] * 1e3:.1f} ms;"
            f" extra {r['measured_extra_s'] * 1e3:.1f} ms), simulated "
            f"{r['simulated_ratio']:.3f}x at clock {r['simulated_clock_factor']:.3f}: "
            f"{r['error'] * 100:+.1f}% {'PASS' if ok else 'FAIL'}; at clock "
            f"{nom['simulated_clock_factor']:.3f}: {nom['simulated_ratio']:.3f}x "
            f"({nom['error'] * 100:+.1f}%)"
        )
    return failures


def _echo_bucket_effect(report: dict[str, Any], simulated: dict[str, Any], n: int) -> list[str]:
    """Print whether DDP's 25 MB buckets beat its 1 MB ones alike measured and simulated (into
    the report too); a failure when the signs differ."""
    modes = report["modes"]
    if "ddp_b1" not in modes or "ddp_b25" not in modes:
        return []
    measured_delta = modes["ddp_b25"]["median_s"] - modes["ddp_b1"]["median_s"]
    simulated_delta = simulated["ddp_b25"].step_time_s - simulated["ddp_b1"].step_time_s
    # a difference under the printed 0.1 ms, or under 0.5 % of the step, has no sign
    floor_s = max(BUCKET_EFFECT_FLOOR_S, BUCKET_EFFECT_FLOOR_SHARE * modes["ddp_b1"]["median_s"])
    measured_sign, simulated_sign = _sign(measured_delta, floor_s), _sign(simulated_delta, floor_s)
    same = measured_sign == simulated_sign
    report["bucket_effect"] = {
        "measured_s": measured_delta,
        "simulated_s": simulated_delta,
        "floor_s": floor_s,
        "same_sign": same,
    }
    verdict = "same sign" if same else "OPPOSITE SIGN"
    if not same and 0 in (measured_sign, simulated_sign):
        verdict = f"NOT THE SAME (a difference under {floor_s * 1e3:.2f} ms counts as none)"
    click.echo(
        f"# bucket 25 MB minus bucket 1 MB: measured {measured_delta * 1e3:+.1f} "
        f"ms, simulated {simulated_delta * 1e3:+.1f} ms -> {verdict}"
    )
    return [] if same else [f"n={n} bucket effect sign"]


#: Below this difference of two step times the bucket effect has no sign: the report prints
#: milliseconds to one decimal, so +0.0 ms is not a positive effect (0.1 ms).
BUCKET_EFFECT_FLOOR_S = 1e-4


#: ... nor is a difference under this share of the 1 MB-bucket step (0.5 %, a resolution chosen
#: well under the effect the check is for: the buckets change a gloo step by several percent).
BUCKET_EFFECT_FLOOR_SHARE = 0.005


def _sign(value: float, floor: float) -> int:
    """-1, 0 or +1: the sign of ``value``, 0 within ``floor`` of zero."""
    return 0 if abs(value) < floor else (1 if value > 0 else -1)


def _calibrate_here(world_size: int | None, backend: str, timeout_s: float, folder: Path) -> Path:
    """Measure the collectives a step uses at this world size and calibrate a topology."""
    # start-up: loaded only when this runs (--help and bad input stay fast)
    from collsim.validate.data.dataset import read_measurements, write_measurements
    from collsim.validate.fit.calibrate import calibrate as fit
    from collsim.validate.fit.calibrate import write_topology
    from collsim.validate.measure.bench import BenchConfig, run_bench, sizes_between

    config = BenchConfig(
        ops=("all_reduce", "all_gather", "reduce_scatter", "broadcast", "send_recv"),
        sizes_bytes=tuple(sizes_between("64K", "16M", 2)),
        iters=10,
        warmup=2,
        rounds=2,
    )
    result, _ = run_bench(config, world_size=world_size, backend=backend, timeout_s=timeout_s)
    n = result.metadata["world_size"]
    csv_path = write_measurements(folder / f"bench_n{n}.csv", result.rows(), result.metadata)
    cal = fit(read_measurements(csv_path))
    path = write_topology(cal, folder / f"calibrated_n{n}.yaml")
    click.echo(f"# calibrated {path} from {csv_path}")
    return path
