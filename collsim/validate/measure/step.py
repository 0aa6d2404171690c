"""Step-level validation, the measuring half: on real ranks, profile the small GPT's blocks and
time one step of every mode (DDP with a bucket size, the FSDP sketch, the local step without
communication, and a straggler's modes) interleaved iteration by iteration, with the in-situ
probes (:mod:`collsim.validate.measure.step_probes`) and the traced steps
(:mod:`collsim.validate.measure.step_trace`); the model is
:mod:`collsim.validate.measure.step_model`, and :mod:`collsim.validate.check.step` simulates
the same step (derivations, measurements and sources: docs/derivations.md,
``collsim.validate.measure.step``)."""

from __future__ import annotations

import json
import statistics
import time
from dataclasses import asdict
from typing import Any, TextIO

from collsim.validate.measure.launch import current_scheduling, run_distributed
from collsim.validate.measure.sketch import FlatShard
from collsim.validate.measure.step_model import (
    EXTRA_SUFFIX,
    LOCAL,
    STRAGGLER_SUFFIX,
    StepConfig,
    build_gpt,
    rank_batch,
)
from collsim.validate.measure.step_probes import insitu_probes, probe_report, run_probes
from collsim.validate.measure.step_trace import sched_autogroup, trace_modes, usable_cores

__all__ = ["step_rank", "run_step", "ddp_bucket_count"]


def _profile_once(
    torch: Any, model: Any, cfg: StepConfig, idx: Any, targets: Any, sync: Any = lambda: None
) -> dict[str, float]:
    """One pass of per-block forward/backward timings (seconds) on this rank.

    ``sync`` waits for the device (cuda.synchronize with nccl) before each clock reading.
    """
    h = cfg.hidden

    def clock() -> float:
        sync()
        return time.perf_counter()

    out: dict[str, float] = {}
    model.zero_grad()  # as a step starts: no gradients to accumulate into
    t0 = clock()
    emb = model.embed(idx)
    t1 = clock()
    emb.backward(torch.ones_like(emb))
    t2 = clock()
    out["embedding.forward"], out["embedding.backward"] = t1 - t0, t2 - t1
    for layer, block in enumerate(model.blocks):
        x = torch.randn(cfg.micro_batch, cfg.seq_len, h, device=idx.device, requires_grad=True)
        g = torch.randn(cfg.micro_batch, cfg.seq_len, h, device=idx.device)
        t0 = clock()
        y = block(x)
        t1 = clock()
        y.backward(g)
        t2 = clock()
        out[f"layer{layer}.forward"], out[f"layer{layer}.backward"] = t1 - t0, t2 - t1
    x = torch.randn(cfg.micro_batch, cfg.seq_len, h, device=idx.device, requires_grad=True)
    t0 = clock()
    loss = model.head_loss(x, targets)
    t1 = clock()
    loss.backward()
    t2 = clock()
    out["head.forward"], out["head.backward"] = t1 - t0, t2 - t1
    opt = torch.optim.SGD(model.parameters(), lr=cfg.lr)
    t3 = clock()
    opt.step()
    model.zero_grad()
    out["optimizer"] = clock() - t3
    return out


def ddp_bucket_count(ddp: Any) -> tuple[int | None, str]:
    """The number of gradient buckets a ``DistributedDataParallel`` module all-reduces.

    torch has no public accessor; the C++ reducer of torch 2.13 offers the private
    ``_get_zeros_like_grad_buckets()`` (one tensor per bucket). The attribute is checked, not
    tried: a torch without it gives ``(None, reason)``, and an error inside it is not hidden.
    Read it after two iterations or more: the reducer rebuilds its buckets, in the order the
    gradients arrived, after the first backward (before that, 3 MiB of gradients with a 1 MB
    cap show as one bucket in torch 2.13).

    Returns:
        ``(count, "")``, or ``(None, why the count is unknown)``.
    """
    reducer = getattr(ddp, "reducer", None)
    if reducer is None:
        return None, f"{type(ddp).__name__} has no reducer"
    get_buckets = getattr(reducer, "_get_zeros_like_grad_buckets", None)
    if get_buckets is None:
        return None, "this torch's DDP reducer has no _get_zeros_like_grad_buckets()"
    return len(get_buckets()), ""


def _ddp_step(torch: Any, cfg: StepConfig, ctx: Any, bucket_mb: int) -> tuple[Any, Any]:
    # torch is optional (the validate extra): imported where ranks run
    from torch.nn.parallel import DistributedDataParallel

    torch.manual_seed(cfg.seed)
    model = DistributedDataParallel(build_gpt(torch, cfg).to(ctx.device), bucket_cap_mb=bucket_mb)
    opt = torch.optim.SGD(model.parameters(), lr=cfg.lr)
    idx, targets = rank_batch(torch, cfg, ctx.rank, ctx.device)

    def step() -> None:
        opt.zero_grad()  # torch's default since 2.0: set_to_none=True (see docs/derivations.md)
        model(idx, targets).backward()
        opt.step()
        ctx.sync()

    return step, model


def _fsdp_step(torch: Any, cfg: StepConfig, ctx: Any) -> Any:
    torch.manual_seed(cfg.seed)
    model = build_gpt(torch, cfg).to(ctx.device)
    root = torch.nn.ModuleList([model.tok, model.pos, model.ln_f])
    units = [FlatShard(root)] + [FlatShard(block) for block in model.blocks]
    idx, targets = rank_batch(torch, cfg, ctx.rank, ctx.device)

    def step() -> None:
        units[0].unshard()
        x = model.embed(idx)
        for unit, block in zip(units[1:], model.blocks):
            unit.unshard()
            x = block(x)
        model.head_loss(x, targets).backward()
        for unit in reversed(units):
            unit.reduce_grads()
            unit.reshard()
            unit.shard.add_(unit.shard_grad, alpha=-cfg.lr)
        ctx.sync()

    return step


def _mode_steps(torch: Any, cfg: StepConfig, ctx: Any) -> tuple[dict[str, Any], dict[str, Any]]:
    """One step function per mode of ``cfg``, and the DDP module of each DDP mode."""
    steps: dict[str, Any] = {}
    ddp_modules: dict[str, Any] = {}
    for mode in cfg.modes:
        if mode == "fsdp":
            steps[mode] = _fsdp_step(torch, cfg, ctx)
        else:
            steps[mode], ddp = _ddp_step(torch, cfg, ctx, int(mode[5:]))
            ddp_modules[mode] = ddp
    return steps, ddp_modules


def _local_model(torch: Any, cfg: StepConfig, ctx: Any) -> tuple[Any, Any, Any, Any]:
    """The model this rank profiles, its batch (inputs, targets), and a step of it without
    communication."""
    torch.manual_seed(cfg.seed)
    prof_model = build_gpt(torch, cfg).to(ctx.device)
    idx, targets = rank_batch(torch, cfg, ctx.rank, ctx.device)
    local_opt = torch.optim.SGD(prof_model.parameters(), lr=cfg.lr)

    def local_step() -> None:
        local_opt.zero_grad()
        prof_model(idx, targets).backward()
        local_opt.step()
        ctx.sync()

    return prof_model, idx, targets, local_step


def _add_straggler_steps(
    cfg: StepConfig, ctx: Any, steps: dict[str, Any], local_step: Any
) -> dict[str, list[float]]:
    """Add the straggler modes to ``steps``; per straggler mode, the list its extra seconds are
    appended to.

    Raises:
        ValueError: the straggler rank is not a rank of this job.
    """
    rank = ctx.rank
    if cfg.straggler_rank is not None and cfg.straggler_rank >= ctx.world_size:
        raise ValueError(
            f"straggler_rank {cfg.straggler_rank} is not a rank of {ctx.world_size} ranks"
        )
    extra_s: dict[str, list[float]] = {}
    for slowed in cfg.straggler_modes:
        steps[slowed], extra_s[slowed] = _straggler_step(
            steps[slowed.removesuffix(STRAGGLER_SUFFIX)],
            local_step,
            cfg.straggler_repeat - 1 if rank == cfg.straggler_rank else 0,
            cfg.straggler_delay_s if rank == cfg.straggler_rank else 0.0,
        )
    return extra_s


def _time_modes(
    dist: Any, steps: dict[str, Any], timed: list[str], shares: list[float] | None
) -> list[float]:
    """One step of each mode of ``timed``, each after a barrier: their wall-clock seconds.
    ``shares`` (None in warmup) gets the share of a core the local step's thread got."""
    row: list[float] = []
    for mode in timed:
        dist.barrier()
        start = time.perf_counter()
        cpu0 = time.thread_time()
        steps[mode]()
        row.append(time.perf_counter() - start)
        if mode == LOCAL and shares is not None:
            # the share of a core this rank's one compute thread got
            # (collsim.validate.measure.insitu)
            shares.append((time.thread_time() - cpu0) / max(row[-1], 1e-9))
    return row


def _over_ranks(
    torch: Any, dist: Any, ctx: Any, rows: list[list[float]], num_prof: int
) -> list[list[float]]:
    """Per column of ``rows``: the mean over ranks of the first ``num_prof`` (the profiled
    blocks), the slowest rank of the others (steps and probes); one list per column."""
    table = torch.tensor(rows, dtype=torch.float64, device=ctx.device)
    # Steps: the slowest rank. Profiled blocks: the mean over ranks (a per-block max over ranks
    # would add up the noise of every block; the step's own max is taken once, in the engine's
    # synchronisation points).
    prof_part = table[:, :num_prof].clone()
    dist.all_reduce(prof_part)
    prof_part /= ctx.world_size
    step_part = table[:, num_prof:].clone()
    dist.all_reduce(step_part, op=dist.ReduceOp.MAX)
    table = torch.cat([prof_part, step_part], dim=1).cpu()
    return [[float(v) for v in table[:, j]] for j in range(table.shape[1])]


def _write_progress(progress: TextIO, it: int, keys: list[str], row: list[float]) -> None:
    """Append iteration ``it``'s timings to the open progress file, one JSON line."""

    progress.write(json.dumps({"iteration": it, **dict(zip(keys, row))}) + "\n")
    progress.flush()


def _mean_over_ranks(torch: Any, dist: Any, ctx: Any, value: float) -> float:
    """The mean over ranks of one number of each rank."""
    share = torch.tensor([value], dtype=torch.float64, device=ctx.device)
    dist.all_reduce(share)
    mean: float = float(share[0]) / ctx.world_size
    return mean


def _profile_sum(profile: dict[str, float], num_layers: int) -> float:
    """The profiled blocks of one step added up: every non-layer block and ``num_layers``
    layers' forward and backward."""
    return sum(profile[k] for k in profile if not k.startswith("layer")) + num_layers * (
        profile["layer.forward"] + profile["layer.backward"]
    )


def _block_profile(
    columns: dict[str, list[float]], not_blocks: set[str], num_layers: int
) -> dict[str, float]:
    """Seconds per block (embedding, head, optimizer, and a layer's forward and backward as
    the mean over layers): the mean over iterations.

    A block lasts a few ms, about one scheduler time slice on a shared machine, so its median
    is an iteration in which it was not preempted, while a whole step (tens of blocks) always
    is; the mean keeps the preemptions in.
    """
    means = {k: statistics.fmean(v) for k, v in columns.items() if k not in not_blocks}
    profile = {k: means[k] for k in means if not k.startswith("layer")}
    profile["layer.forward"] = statistics.fmean(
        means[f"layer{i}.forward"] for i in range(num_layers)
    )
    profile["layer.backward"] = statistics.fmean(
        means[f"layer{i}.backward"] for i in range(num_layers)
    )
    return profile


def _mode_entries(
    cfg: StepConfig,
    columns: dict[str, list[float]],
    medians: dict[str, float],
    ddp_modules: dict[str, Any],
    extra_s: dict[str, list[float]],
) -> dict[str, Any]:
    """The report of each timed mode: its times, their median and minimum, a DDP mode's
    bucket count and a straggler mode's extra seconds."""
    modes: dict[str, Any] = {}
    for mode in (*cfg.modes, *cfg.straggler_modes):
        entry: dict[str, Any] = {
            "median_s": medians[mode],
            "min_s": min(columns[mode]),
            "times_s": columns[mode],
        }
        if mode in ddp_modules:
            count, reason = ddp_bucket_count(ddp_modules[mode])
            if cfg.warmup + cfg.iters < 2:
                count, reason = None, "read before the reducer rebuilt its buckets (1 step)"
            entry["buckets"] = "unknown" if count is None else count
            if count is None:
                entry["buckets_unknown_reason"] = reason
        if mode in extra_s:
            entry["extra_median_s"] = medians[mode + EXTRA_SUFFIX]
            entry["extra_times_s"] = columns[mode + EXTRA_SUFFIX]
        modes[mode] = entry
    return modes


def step_rank(ctx: Any, cfg: StepConfig) -> dict[str, Any]:
    """Profile the blocks and time every mode, interleaved iteration by iteration.

    Each iteration runs one profiling pass and then one step of every mode, each after a
    barrier, so that load from other processes on the machine falls alike on the profile and
    on every mode. A step time is, per iteration, the slowest rank's (all-reduce MAX); a block
    time is the mean over ranks; then the median over iterations. Every rank returns the
    same data.
    """
    # torch is optional (the validate extra): imported where ranks run
    import torch
    import torch.distributed as dist

    rank = ctx.rank
    steps, ddp_modules = _mode_steps(torch, cfg, ctx)
    prof_model, idx, targets, local_step = _local_model(torch, cfg, ctx)
    steps[LOCAL] = local_step
    extra_s = _add_straggler_steps(cfg, ctx, steps, local_step)
    # The normal modes first, then the straggler modes: the paired ratio (same iteration)
    # still sees the same load. Timed each right after its normal mode, a normal mode that
    # followed the previous straggler mode (rank 1 spinning 100 ms) came out slow under load
    # (ddp_b25 after ddp_b1+straggler: straggler ratio +15 to +32 % in 4 runs at 1-min loads
    # 6-10; in this order +10 % in the one run at load 9.6).
    timed = [LOCAL, *cfg.modes, *cfg.straggler_modes]
    extra_keys = [m + EXTRA_SUFFIX for m in cfg.straggler_modes]
    probes, copies = insitu_probes(torch, dist, cfg, ctx, ddp_modules, prof_model)
    probe_keys: list[str] = []
    probe_sizes: dict[str, dict[str, list[int]]] = {}
    shares: list[float] = []
    progress = None
    if cfg.progress_path is not None:
        progress = open(f"{cfg.progress_path}.rank{rank}.jsonl", "a")  # noqa: SIM115
    rows: list[list[float]] = []
    keys: list[str] = []
    for it in range(cfg.warmup + cfg.iters):
        dist.barrier()
        prof = _profile_once(torch, prof_model, cfg, idx, targets, ctx.sync)
        row = [prof[k] for k in sorted(prof)]
        keys = sorted(prof) + timed
        row += _time_modes(dist, steps, timed, shares if it >= cfg.warmup else None)
        row += [extra_s[m][-1] for m in cfg.straggler_modes]
        keys += extra_keys
        # the collectives of each mode alone, and DDP's gradient copies
        # (collsim.validate.measure.insitu)
        probe_keys, probe_row = run_probes(dist, probes, copies, probe_sizes)
        row += probe_row
        keys += probe_keys
        if progress is not None:
            _write_progress(progress, it, keys, row)
        if it >= cfg.warmup:
            rows.append(row)
    if progress is not None:
        progress.close()
    traces = trace_modes(torch, dist, cfg, ctx, steps) if cfg.profile_dir else {}
    num_prof = len(keys) - len(timed) - len(extra_keys) - len(probe_keys)
    by_column = _over_ranks(torch, dist, ctx, rows, num_prof)
    local_cpu_share = _mean_over_ranks(torch, dist, ctx, statistics.median(shares))
    columns = dict(zip(keys, by_column))
    medians = {k: statistics.median(v) for k, v in columns.items()}
    not_blocks = {*timed, *extra_keys, *probe_keys}
    profile = _block_profile(columns, not_blocks, cfg.num_layers)
    block_medians = {k: v for k, v in medians.items() if k not in not_blocks}
    modes = _mode_entries(cfg, columns, medians, ddp_modules, extra_s)

    profile_sum = _profile_sum(profile, cfg.num_layers)
    return {
        "world_size": ctx.world_size,
        "local_world_size": ctx.local_world_size,
        "cpu_count": usable_cores(),
        "threads_per_rank": torch.get_num_threads(),
        "scheduling": current_scheduling(),
        "block_medians_s": block_medians,
        "backend": ctx.backend,
        "torch_version": torch.__version__,
        "profile": profile,
        "profile_sum_s": profile_sum,
        "local_step_s": medians[LOCAL],
        "local_step_min_s": min(columns[LOCAL]),
        "compute_scale": medians[LOCAL] / profile_sum,
        "modes": modes,
        "num_parameters": sum(p.numel() for p in prof_model.parameters()),
        "local_cpu_share": local_cpu_share,
        "sched_autogroup": sched_autogroup(),
        **({"traces": traces} if traces else {}),
        **probe_report(columns, probes, probe_sizes),
    }


def _straggler_step(
    step: Any, local_step: Any, extra: int, delay_s: float = 0.0
) -> tuple[Any, list[float]]:
    """``step`` preceded by the slowed rank's extra compute: a busy loop of ``delay_s`` on the
    wall clock when > 0, else ``extra`` local steps; and the list the extra seconds of each
    call are appended to (0 on the other ranks)."""
    times: list[float] = []

    def slowed() -> None:
        t0 = time.perf_counter()
        if delay_s > 0:
            while time.perf_counter() - t0 < delay_s:
                pass
        else:
            for _ in range(extra):
                local_step()
        times.append(time.perf_counter() - t0)
        step()

    return slowed, times


def run_step(
    cfg: StepConfig, *, world_size: int | None, backend: str = "gloo", timeout_s: float = 600.0
) -> tuple[dict[str, Any], bool]:
    """Measure on spawned ranks (or this torchrun job); the report and whether to print it."""

    report, is_reporter = run_distributed(
        step_rank, world_size, args=(cfg,), backend=backend, timeout_s=timeout_s
    )
    report = dict(report)
    report["config"] = asdict(cfg)
    return report, is_reporter
