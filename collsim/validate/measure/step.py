"""Step-level validation: time real training steps of a small GPT and simulate the same step.

Derivations, measurements and sources: docs/derivations.md, ``collsim.validate.measure.step``.
"""

from __future__ import annotations

import gzip
import json
import math
import os
import shutil
import statistics
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, TextIO

from collsim.validate.measure.insitu import (
    COPIES_KEY,
    OVERLAP_KEYS,
    PROBE_PREFIX,
    ddp_probe,
    fsdp_probe,
    overlap_probe,
    time_ddp_copies,
)
from collsim.validate.measure.launch import current_scheduling, run_distributed
from collsim.validate.measure.sketch import FlatShard
from collsim.workload.model import TransformerSpec

#: The name of the no-communication step timed beside the modes.
LOCAL = "local"

__all__ = [
    "StepConfig",
    "model_spec",
    "build_gpt",
    "step_rank",
    "run_step",
    "ddp_bucket_count",
    "MODES",
    "STRAGGLER_SUFFIX",
]

#: Suffix of a mode timed with one rank slowed on purpose (``ddp_b25+straggler``).
STRAGGLER_SUFFIX = "+straggler"

#: Column of the slowed rank's extra seconds in a straggler mode (``ddp_b25+straggler.extra``).
EXTRA_SUFFIX = ".extra"

#: Modes of a measured step: DDP with a bucket size in MB, or the FSDP sketch.
MODES = ("ddp_b1", "ddp_b25", "fsdp")


@dataclass(frozen=True, slots=True, kw_only=True)
class StepConfig:
    """The model, the batch and how long to time."""

    num_layers: int = 4
    hidden: int = 256
    num_heads: int = 4
    ffn_hidden: int = 1024
    seq_len: int = 32
    vocab: int = 1024
    micro_batch: int = 2
    """Sequences per rank per step."""
    iters: int = 10
    warmup: int = 3
    modes: tuple[str, ...] = MODES
    lr: float = 1e-3
    seed: int = 0
    straggler_rank: int | None = None
    """A rank slowed on purpose in the ``<ddp mode>+straggler`` modes (None: none timed)."""
    straggler_repeat: int = 2
    """The slowed rank runs its compute this many times (clock factor 1 / repeat)."""
    straggler_delay_s: float = 0.0
    """If > 0: the slowed rank instead spins on the wall clock for this long before its step
    (a busy loop of known duration, whatever share of the cores it gets)."""
    progress_path: str | None = None
    """Each rank appends its per-iteration timings to ``<path>.rank<r>.jsonl`` as taken."""
    profile_dir: str | None = None
    """After the timed iterations, each rank traces ``trace_steps`` more steps of every mode
    with the torch profiler (CPU activities, input shapes) into
    ``<dir>/n<world size>_<mode>_rank<r>.json.gz`` (:func:`_trace_modes`)."""
    trace_steps: int = 3

    def __post_init__(self) -> None:
        for mode in self.modes:
            if mode != "fsdp" and not (mode.startswith("ddp_b") and mode[5:].isdigit()):
                raise ValueError(f"unknown mode {mode!r}: ddp_b<MB> or fsdp")
        if self.straggler_rank is not None and self.straggler_rank < 0:
            raise ValueError(f"straggler_rank must be >= 0, got {self.straggler_rank}")
        if self.straggler_delay_s < 0:
            raise ValueError(f"straggler_delay_s must be >= 0, got {self.straggler_delay_s}")
        if self.straggler_repeat < 2:
            raise ValueError(f"straggler_repeat must be >= 2, got {self.straggler_repeat}")
        if self.trace_steps < 1:
            raise ValueError(f"trace_steps must be >= 1, got {self.trace_steps}")

    @property
    def straggler_modes(self) -> tuple[str, ...]:
        """The modes timed with the straggler (every DDP mode, when a rank is named)."""
        if self.straggler_rank is None:
            return ()
        return tuple(m + STRAGGLER_SUFFIX for m in self.modes if m.startswith("ddp"))


def model_spec(cfg: StepConfig) -> Any:
    """The collsim spec of the measured model."""

    return TransformerSpec(
        name="validate-gpt",
        num_layers=cfg.num_layers,
        hidden=cfg.hidden,
        num_heads=cfg.num_heads,
        ffn_hidden=cfg.ffn_hidden,
        seq_len=cfg.seq_len,
        vocab=cfg.vocab,
        dropout=False,
    )


def build_gpt(torch: Any, cfg: StepConfig) -> Any:
    """The torch model of :func:`model_spec` (parameters registered in collsim's order)."""
    nn = torch.nn
    # torch is passed in (imported lazily, so collsim loads without it): its Module is Any
    module: Any = nn.Module
    F = torch.nn.functional
    h, heads = cfg.hidden, cfg.num_heads

    class Block(module):  # type: ignore[misc]  # subclassing Any (see above)
        def __init__(self) -> None:
            super().__init__()
            self.ln1 = nn.LayerNorm(h)
            self.qkv = nn.Linear(h, 3 * h)
            self.proj = nn.Linear(h, h)
            self.ln2 = nn.LayerNorm(h)
            self.fc1 = nn.Linear(h, cfg.ffn_hidden)
            self.fc2 = nn.Linear(cfg.ffn_hidden, h)

        def forward(self, x: Any) -> Any:
            b, s, _ = x.shape
            q, k, v = self.qkv(self.ln1(x)).split(h, dim=2)
            q, k, v = (t.view(b, s, heads, h // heads).transpose(1, 2) for t in (q, k, v))
            att = F.scaled_dot_product_attention(q, k, v, is_causal=True)
            x = x + self.proj(att.transpose(1, 2).reshape(b, s, h))
            return x + self.fc2(F.gelu(self.fc1(self.ln2(x))))

    class GPT(module):  # type: ignore[misc]  # subclassing Any (see above)
        def __init__(self) -> None:
            super().__init__()
            self.tok = nn.Embedding(cfg.vocab, h)
            self.pos = nn.Embedding(cfg.seq_len, h)
            self.blocks = nn.ModuleList(Block() for _ in range(cfg.num_layers))
            self.ln_f = nn.LayerNorm(h)
            init_like_gpt2(torch, self, cfg.num_layers)

        def embed(self, idx: Any) -> Any:
            return self.tok(idx) + self.pos(torch.arange(idx.shape[1], device=idx.device))

        def head_loss(self, x: Any, targets: Any) -> Any:
            logits = self.ln_f(x) @ self.tok.weight.t()  # tied LM head
            return F.cross_entropy(logits.reshape(-1, cfg.vocab), targets.reshape(-1))

        def forward(self, idx: Any, targets: Any) -> Any:
            x = self.embed(idx)
            for block in self.blocks:
                x = block(x)
            return self.head_loss(x, targets)

    return GPT()


#: Standard deviation of GPT-2's initial weights (Radford et al. 2019, as in nanoGPT's
#: ``_init_weights`` and Megatron-LM's ``--init-method-std`` default).
GPT2_INIT_STD = 0.02


def init_like_gpt2(torch: Any, model: Any, num_layers: int) -> None:
    """GPT-2's initialisation: linear and embedding weights N(0, 0.02), biases zero, the
    projections that end on the residual stream (attention output, MLP down) N(0, 0.02 /
    sqrt(2 x layers)); LayerNorms keep (1, 0).

    With PyTorch's module defaults instead (embeddings N(0, 1)), the tied LM head gives logits
    of standard deviation sqrt(hidden) = 16 at hidden 256: the first loss is ~168 where
    ln(vocab) = 6.9 is expected, and the softmax's exponentials underflow to subnormal floats.
    An x86 core takes a microcode assist for each subnormal operand or result, so the step's
    time then depends on how far training has gone (the step times with and without are in
    docs/derivations.md, measurements, and validate/README.md). No real training starts
    there, and neither the compute model nor a GPU sees that effect.
    """
    residual = GPT2_INIT_STD / math.sqrt(2 * num_layers)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith(".bias"):
                param.zero_()
            elif name.endswith(("proj.weight", "fc2.weight")):
                param.normal_(0.0, residual)
            elif name.endswith(".weight") and param.dim() == 2:
                param.normal_(0.0, GPT2_INIT_STD)


def _batch(torch: Any, cfg: StepConfig, rank: int, device: str = "cpu") -> tuple[Any, Any]:
    gen = torch.Generator().manual_seed(cfg.seed * 7919 + rank)
    idx = torch.randint(cfg.vocab, (cfg.micro_batch, cfg.seq_len), generator=gen)
    return idx.to(device), torch.roll(idx, -1, dims=1).to(device)


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
    idx, targets = _batch(torch, cfg, ctx.rank, ctx.device)

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
    idx, targets = _batch(torch, cfg, ctx.rank, ctx.device)

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
    idx, targets = _batch(torch, cfg, ctx.rank, ctx.device)
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
    probes, copies = _probes(torch, dist, cfg, ctx, ddp_modules, prof_model)
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
        probe_keys, probe_row = _run_probes(dist, probes, copies, probe_sizes)
        row += probe_row
        keys += probe_keys
        if progress is not None:
            _write_progress(progress, it, keys, row)
        if it >= cfg.warmup:
            rows.append(row)
    if progress is not None:
        progress.close()
    traces = _trace_modes(torch, dist, cfg, ctx, steps) if cfg.profile_dir else {}
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
        "cpu_count": _cores(),
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
        "sched_autogroup": _autogroup(),
        **({"traces": traces} if traces else {}),
        **_probe_report(columns, probes, probe_sizes),
    }


def _trace_modes(
    torch: Any, dist: Any, cfg: StepConfig, ctx: Any, steps: dict[str, Any]
) -> dict[str, Any]:
    """Trace ``cfg.trace_steps`` steps of every mode of ``cfg`` (and the local step) with the
    torch profiler, after the timed iterations so that the profiler's cost falls on none of
    them; each step after a barrier, inside a ``ProfilerStep#<i>`` annotation as
    ``torch.profiler.profile.step`` names it. One gzipped Kineto trace per mode and rank.
    Returns this rank's paths (``files``) and, per mode, the share of a core its thread got
    over the traced steps (``cpu_share``: thread CPU time over wall time, as
    :mod:`collsim.validate.measure.insitu` measures the local step's), which tells whether the
    traced
    steps ran under the load the timed ones did."""

    # optional: torch loads only where it is used (the run path stays light)
    from torch.profiler import ProfilerActivity, profile, record_function

    assert cfg.profile_dir is not None
    folder = Path(cfg.profile_dir)
    folder.mkdir(parents=True, exist_ok=True)
    written: list[str] = []
    shares: dict[str, float] = {}
    for mode in [LOCAL, *cfg.modes]:
        dist.barrier()
        steps[mode]()  # one untraced step: the profiler's own start-up stays out of the trace
        wall = cpu = 0.0
        with profile(activities=[ProfilerActivity.CPU], record_shapes=True) as prof:
            for i in range(cfg.trace_steps):
                dist.barrier()
                start, cpu0 = time.perf_counter(), time.thread_time()
                with record_function(f"ProfilerStep#{i}"):
                    steps[mode]()
                wall += time.perf_counter() - start
                cpu += time.thread_time() - cpu0
            # what a time-sharing slowdown is learned from (collsim.validate.fit.trace_profile):
            # the cores this rank could run on, the ranks beside it, its thread's share of a core
            prof.add_metadata_json(
                "collsim",
                json.dumps(
                    {
                        "cores": _cores(),
                        "local_ranks": ctx.local_world_size,
                        "cpu_share": round(cpu / max(wall, 1e-9), 4),
                    }
                ),
            )
        shares[mode] = cpu / max(wall, 1e-9)
        path = folder / f"n{ctx.world_size}_{mode}_rank{ctx.rank}.json"
        prof.export_chrome_trace(str(path))
        with open(path, "rb") as src, gzip.open(f"{path}.gz", "wb") as dst:
            shutil.copyfileobj(src, dst)
        os.remove(path)
        written.append(f"{path}.gz")
    return {"files": written, "cpu_share": shares}


def _cores() -> int:
    """The cores this process may run on (its CPU affinity: ``taskset`` narrows it)."""
    getter = getattr(os, "sched_getaffinity", None)
    return len(getter(0)) if getter is not None else os.cpu_count() or 1


def _autogroup() -> bool | None:
    """Whether Linux groups the fair scheduler's share by session (``sched_autogroup``):
    then the ranks of one command share one session's CPU whatever their thread count."""

    try:
        return Path("/proc/sys/kernel/sched_autogroup_enabled").read_text().strip() == "1"
    except OSError:
        return None


def _probes(
    torch: Any, dist: Any, cfg: StepConfig, ctx: Any, ddp_modules: dict[str, Any], model: Any
) -> tuple[dict[str, Any], Any]:
    """The in-situ probes of :mod:`collsim.validate.measure.insitu` for this rank's modes
    (gloo only:
    on GPUs the collectives run on their own engines and the bench's calibration stands)."""
    if ctx.backend != "gloo":
        return {}, None

    probes: dict[str, Any] = {}
    for mode in cfg.modes:
        if mode == "fsdp":
            root = [model.tok, model.pos, model.ln_f]
            units = [sum(p.numel() for m in root for p in m.parameters())]
            units += [sum(p.numel() for p in block.parameters()) for block in model.blocks]
            probes[mode] = fsdp_probe(torch, dist, units)
        else:
            probes[mode] = ddp_probe(torch, dist, ddp_modules[mode], int(mode[5:]))
    ddp = any(m.startswith("ddp") for m in cfg.modes)
    copies = time_ddp_copies(torch, list(model.parameters()), ctx.world_size) if ddp else None
    if probes:
        numel = sum(int(p.numel()) for p in model.parameters())
        probes["overlap"] = overlap_probe(torch, dist, numel)
    return probes, copies


def _run_probes(
    dist: Any, probes: dict[str, Any], copies: Any, sizes: dict[str, dict[str, list[int]]]
) -> tuple[list[str], list[float]]:
    """One iteration of the probes, each after a barrier: column names and values (a DDP
    mode's group time; each FSDP call's time; the copies). ``sizes`` gets each probe's call
    sizes (bytes per call, per op) of this run."""

    keys: list[str] = []
    row: list[float] = []
    for mode, probe in probes.items():
        if mode == "overlap":
            keys += list(OVERLAP_KEYS)
            row += list(probe())
            continue
        dist.barrier()
        got = probe()
        for op, value in got.items():
            if mode.startswith("ddp"):
                keys.append(f"{PROBE_PREFIX}{mode}:{op}")
                row.append(value[0])
            else:
                for i, (t, _) in enumerate(value):
                    keys.append(f"{PROBE_PREFIX}{mode}:{op}:{i}")
                    row.append(t)
        sizes[mode] = {
            op: (value[1] if mode.startswith("ddp") else [b for _, b in value])
            for op, value in got.items()
        }
    if copies is not None:
        dist.barrier()
        keys.append(COPIES_KEY)
        row.append(copies())
    return keys, row


def _probe_report(
    columns: dict[str, list[float]],
    probes: dict[str, Any],
    sizes: dict[str, dict[str, list[int]]],
) -> dict[str, Any]:
    """The probes' medians over iterations (slowest rank) for the report."""

    if not probes:
        return {}
    out: dict[str, Any] = {}
    result: dict[str, Any] = {}
    for mode in probes:
        if mode == "overlap":
            c, m, b = (statistics.median(columns[k]) for k in OVERLAP_KEYS)
            result["overlap_probe"] = {"compute_s": c, "comm_s": m, "both_s": b}
            continue
        entry: dict[str, Any] = {}
        for op, call_sizes in sizes.get(mode, {}).items():
            key = f"{PROBE_PREFIX}{mode}:{op}"
            if mode.startswith("ddp"):
                entry[op] = {
                    "sizes_bytes": call_sizes,
                    "median_s": statistics.median(columns[key]),
                    "times_s": columns[key],
                }
            else:
                calls = [columns[f"{key}:{i}"] for i in range(len(call_sizes))]
                entry[op] = {
                    "sizes_bytes": call_sizes,
                    "call_median_s": [statistics.median(c) for c in calls],
                    "median_s": statistics.median([sum(t) for t in zip(*calls)]),
                }
        out[mode] = entry
    result["comm_probe"] = out
    if COPIES_KEY in columns:
        result["ddp_copies_s"] = statistics.median(columns[COPIES_KEY])
        result["ddp_copies_times_s"] = columns[COPIES_KEY]
    return result


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
