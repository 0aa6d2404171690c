"""DDP and FSDP from scratch on real ranks, with the checks that prove them right.

Data parallelism is two collectives and one rule: broadcast the parameters at start, average the
gradients after backward, and never let ranks disagree about which step they are on.

* :class:`MinimalDDP` broadcasts every parameter and buffer from rank 0 when it is built, and
  after backward all-reduces each gradient and divides it by N (``SUM/N``), or uses
  ``ReduceOp.AVG``; with ``overlap=True`` each gradient's all-reduce is launched asynchronously
  from a post-accumulate-grad hook while backward goes on, and :meth:`MinimalDDP.finish` waits.
* :class:`FlatShard` is the FSDP sketch: flatten a module's parameters into one buffer, pad it to
  a multiple of N, keep only this rank's 1/N slice; :meth:`FlatShard.unshard` all-gathers the
  full buffer and points the parameters into it (before forward), :meth:`FlatShard.reduce_grads`
  reduce-scatters the gradients into the shard, :meth:`FlatShard.reshard` frees the full buffer.

:func:`sketch_rank` runs all the checks of the lesson on every rank and returns a report:
gradient equivalence with one process on the concatenated batch, parameter divergence over
training steps, the FSDP round trip (bit-exact) and the per-rank parameter bytes (about 1/N),
AVG versus SUM/N, and the overlapped versus the after-backward all-reduce, each timed.
"""

from __future__ import annotations

import copy
import statistics
import time
from dataclasses import dataclass
from typing import Any

from collsim.validate.measure.launch import run_distributed

__all__ = [
    "SketchConfig",
    "MinimalDDP",
    "FlatShard",
    "sketch_rank",
    "run_sketch",
    "check_report",
    "GRAD_TOLERANCE",
    "DIVERGENCE_TOLERANCE",
]


@dataclass(frozen=True, slots=True, kw_only=True)
class SketchConfig:
    """Sizes of the checks (small: a check runs in seconds)."""

    batch_per_rank: int = 8
    in_features: int = 32
    hidden: int = 64
    out_features: int = 8
    steps: int = 5
    """Training steps over which parameter divergence is tracked."""
    lr: float = 0.1
    timing_hidden: int = 256
    """Width of the deeper MLP used to time AVG vs SUM/N and overlap (bigger gradients)."""
    timing_layers: int = 6
    timing_iters: int = 10
    seed: int = 0
    parts: tuple[str, ...] = ("ddp", "fsdp", "timing")
    """Which checks to run: ``ddp`` (broadcast, gradient equivalence, sync), ``fsdp`` (round
    trip, memory, sharded gradient), ``timing`` (AVG vs SUM/N, overlap)."""


#: Tolerances of the lesson: gradients and parameters agree to within 1e-3.
GRAD_TOLERANCE = 1e-3
DIVERGENCE_TOLERANCE = 1e-3


def check_report(report: dict[str, Any]) -> list[tuple[str, bool, str]]:
    """(check, passed, figure) rows for a report of :func:`sketch_rank`."""
    rows: list[tuple[str, bool, str]] = []
    n = report["world_size"]
    if "grad_max_abs_diff" in report:
        rows.append(
            (
                "broadcast at construction makes replicas equal",
                report["divergence_after_broadcast"] == 0.0,
                f"{report['divergence_before_broadcast']:.3g} -> "
                f"{report['divergence_after_broadcast']:.3g}",
            )
        )
        rows.append(
            (
                "all-reduced gradient == one process on the N*B batch (< 1e-3)",
                report["grad_max_abs_diff"] < GRAD_TOLERANCE,
                f"max |diff| {report['grad_max_abs_diff']:.3g}",
            )
        )
        rows.append(
            (
                f"parameters in sync over {len(report['divergence_per_step'])} steps (< 1e-3)",
                report["divergence_max"] < DIVERGENCE_TOLERANCE,
                f"max divergence {report['divergence_max']:.3g}",
            )
        )
    if "fsdp" in report:
        f = report["fsdp"]
        ideal = -(-f["full_parameter_bytes"] // (4 * n)) * 4
        rows.append(
            (
                "FSDP round trip (flatten, pad, shard, all-gather) is bit-exact",
                f["round_trip_bit_exact"],
                str(f["round_trip_bit_exact"]),
            )
        )
        rows.append(
            (
                f"per-rank parameter bytes ~ 1/N (N={n}) at rest",
                f["resting_parameter_bytes_per_rank"] <= ideal + 4 * n,
                f"{f['resting_parameter_bytes_per_rank']} of {f['full_parameter_bytes']} B "
                f"({f['resting_fraction']:.3f})",
            )
        )
        rows.append(
            (
                "reduce-scattered shard gradient == one process (< 1e-3)",
                f["shard_grad_max_abs_diff"] < GRAD_TOLERANCE,
                f"max |diff| {f['shard_grad_max_abs_diff']:.3g}",
            )
        )
    if "timing" in report:
        t = report["timing"]
        rows.append(
            (
                "AVG gives the same gradients as SUM/N",
                t["avg_vs_sum_div_max_abs_diff"] < GRAD_TOLERANCE,
                f"all_reduce SUM/N {t['all_reduce_sum_div_s'] * 1e3:.2f} ms, "
                f"AVG {t['all_reduce_avg_s'] * 1e3:.2f} ms",
            )
        )
        rows.append(
            (
                "overlapped hook all-reduce gives the same gradients",
                t["overlap_vs_sum_div_max_abs_diff"] < GRAD_TOLERANCE,
                f"step after-backward {t['sum_div_step_s'] * 1e3:.2f} ms, overlapped "
                f"{t['overlap_step_s'] * 1e3:.2f} ms (x{t['overlap_speedup']:.2f})",
            )
        )
    return rows


def _mlp(torch: Any, sizes: list[int]) -> Any:
    """An MLP with a non-trainable buffer, so that buffer broadcast is exercised too."""
    nn = torch.nn
    # torch is passed in (imported lazily, so collsim loads without it): its Module is Any
    module: Any = nn.Module

    class ScaledMLP(module):  # type: ignore[misc]  # subclassing Any (see above)
        def __init__(self) -> None:
            super().__init__()
            layers: list[Any] = []
            for i, (a, b) in enumerate(zip(sizes[:-1], sizes[1:])):
                layers.append(nn.Linear(a, b))
                if i < len(sizes) - 2:
                    layers.append(nn.Tanh())
            self.net = nn.Sequential(*layers)
            self.register_buffer("input_scale", torch.rand(sizes[0]) + 0.5)

        def forward(self, x: Any) -> Any:
            return self.net(x * self.input_scale)

    return ScaledMLP()


class MinimalDDP:
    """The smallest correct DDP: broadcast at construction, average gradients after backward.

    Args:
        module: the local replica (any ``torch.nn.Module``).
        average: ``"sum_div"`` (all-reduce SUM, then divide by N) or ``"avg"`` (ReduceOp.AVG).
        overlap: launch each gradient's all-reduce from a post-accumulate-grad hook during
            backward (async), instead of all of them after backward.
    """

    def __init__(self, module: Any, *, average: str = "sum_div", overlap: bool = False) -> None:
        # torch is optional (the validate extra): imported where ranks run
        import torch.distributed as dist

        self.module = module
        self.average = average
        self.overlap = overlap
        self.world_size = dist.get_world_size()
        self._pending: list[tuple[Any, Any]] = []
        for tensor in list(module.parameters()) + list(module.buffers()):
            dist.broadcast(tensor.data, src=0)
        self._hooks = []
        if overlap:
            for param in module.parameters():
                if param.requires_grad:
                    self._hooks.append(param.register_post_accumulate_grad_hook(self._launch))

    def __call__(self, *args: Any) -> Any:
        return self.module(*args)

    def _op(self) -> Any:
        # torch is optional (the validate extra): imported where ranks run
        import torch.distributed as dist

        return dist.ReduceOp.AVG if self.average == "avg" else dist.ReduceOp.SUM

    def _launch(self, param: Any) -> None:
        # torch is optional (the validate extra): imported where ranks run
        import torch.distributed as dist

        work = dist.all_reduce(param.grad, op=self._op(), async_op=True)
        self._pending.append((param, work))

    def finish(self) -> None:
        """Make every gradient the average over ranks (call after ``loss.backward()``)."""
        # torch is optional (the validate extra): imported where ranks run
        import torch
        import torch.distributed as dist

        if self.overlap:
            for param, work in self._pending:
                work.wait()
                if self.average != "avg":
                    param.grad.div_(self.world_size)
            self._pending.clear()
            return
        for param in self.module.parameters():
            if param.grad is None:
                param.grad = torch.zeros_like(param.data)
            dist.all_reduce(param.grad, op=self._op())
            if self.average != "avg":
                param.grad.div_(self.world_size)


class FlatShard:
    """FSDP sketch for one module: one flat, padded buffer; each rank keeps 1/N of it.

    After construction the module's parameters are empty (zero-size) until :meth:`unshard`.
    """

    def __init__(self, module: Any) -> None:
        # torch is optional (the validate extra): imported where ranks run
        import torch
        import torch.distributed as dist

        self.module = module
        self.world_size = dist.get_world_size()
        self.rank = dist.get_rank()
        self.params = [p for p in module.parameters()]
        self.shapes = [p.shape for p in self.params]
        self.numels = [p.numel() for p in self.params]
        self.numel = sum(self.numels)
        self.padded = -(-self.numel // self.world_size) * self.world_size
        self.shard_numel = self.padded // self.world_size
        self.device = self.params[0].device
        flat = torch.zeros(self.padded, dtype=self.params[0].dtype, device=self.device)
        flat[: self.numel] = torch.cat([p.detach().reshape(-1) for p in self.params])
        lo = self.rank * self.shard_numel
        self.shard = flat[lo : lo + self.shard_numel].clone()
        self.shard_grad = torch.zeros_like(self.shard)
        self.full: Any = None
        self.reshard()

    def unshard(self) -> Any:
        """All-gather the full flat buffer and point the parameters into it; return it."""
        # torch is optional (the validate extra): imported where ranks run
        import torch
        import torch.distributed as dist

        full = torch.empty(self.padded, dtype=self.shard.dtype, device=self.device)
        gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
        gather(full, self.shard)
        self.full = full
        offset = 0
        for param, shape, numel in zip(self.params, self.shapes, self.numels):
            param.data = full[offset : offset + numel].view(shape)
            offset += numel
        return full

    def reduce_grads(self) -> None:
        """Reduce-scatter the full gradients (averaged) into this rank's shard gradient."""
        # torch is optional (the validate extra): imported where ranks run
        import torch
        import torch.distributed as dist

        flat_grad = torch.zeros(self.padded, dtype=self.shard.dtype, device=self.device)
        offset = 0
        for param, numel in zip(self.params, self.numels):
            if param.grad is not None:
                flat_grad[offset : offset + numel] = param.grad.reshape(-1)
            offset += numel
        scatter = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
        scatter(self.shard_grad, flat_grad)
        self.shard_grad.div_(self.world_size)

    def reshard(self) -> None:
        """Drop the full buffer and the full gradients; keep only the shard."""
        # torch is optional (the validate extra): imported where ranks run
        import torch

        for param in self.params:
            param.data = torch.empty(0, dtype=self.shard.dtype, device=self.device)
            param.grad = None
        self.full = None

    def parameter_bytes(self) -> int:
        """Bytes of parameter storage this rank holds now (shard + any gathered parameters)."""
        held = self.shard.numel() * self.shard.element_size()
        if self.full is not None:
            held += self.full.numel() * self.full.element_size()
        return held


def _flat_params(torch: Any, module: Any) -> Any:
    return torch.cat([p.detach().reshape(-1) for p in module.parameters()])


def _divergence(torch: Any, dist: Any, module: Any) -> float:
    """max over ranks and elements of |param - rank 0's param|."""
    mine = _flat_params(torch, module)
    ref = mine.clone()
    dist.broadcast(ref, src=0)
    diff = torch.tensor([float((mine - ref).abs().max())], dtype=torch.float64)
    dist.all_reduce(diff, op=dist.ReduceOp.MAX)
    return float(diff.item())


def _global_batch(torch: Any, cfg: SketchConfig, n: int, step: int) -> tuple[Any, Any]:
    gen = torch.Generator().manual_seed(cfg.seed * 1000 + step)
    x = torch.randn(cfg.batch_per_rank * n, cfg.in_features, generator=gen)
    y = torch.randn(cfg.batch_per_rank * n, cfg.out_features, generator=gen)
    return x, y


def _timed(fn: Any, iters: int, dist: Any) -> float:
    """Median seconds of ``fn`` over iterations, slowest rank (barrier before each)."""
    # torch is optional (the validate extra): imported where ranks run
    import torch

    times = torch.zeros(iters, dtype=torch.float64)
    for i in range(iters):
        dist.barrier()
        start = time.perf_counter()
        fn()
        times[i] = time.perf_counter() - start
    dist.all_reduce(times, op=dist.ReduceOp.MAX)
    return statistics.median(float(t) for t in times)


def sketch_rank(ctx: Any, cfg: SketchConfig) -> dict[str, Any]:
    """All the checks of the lesson, on this rank; returns the (rank-reduced) report."""
    # torch is optional (the validate extra): imported where ranks run
    import torch
    import torch.distributed as dist

    n, rank = ctx.world_size, ctx.rank
    sizes = [cfg.in_features, cfg.hidden, cfg.hidden, cfg.out_features]
    report: dict[str, Any] = {"world_size": n, "backend": ctx.backend}
    if "ddp" in cfg.parts:
        report.update(_ddp_checks(torch, dist, cfg, rank, n, sizes))
    if "fsdp" in cfg.parts:
        report["fsdp"] = _fsdp_checks(torch, dist, cfg, rank, n, sizes)
    if "timing" in cfg.parts:
        report["timing"] = _timings(torch, dist, cfg, rank, n)
    return report


def _ddp_checks(
    torch: Any, dist: Any, cfg: SketchConfig, rank: int, n: int, sizes: list[int]
) -> dict[str, Any]:
    report: dict[str, Any] = {}
    # 1. Broadcast at construction: every rank starts from a different seed.
    torch.manual_seed(cfg.seed + 1 + rank)
    model = _mlp(torch, sizes)
    before = _divergence(torch, dist, model)
    ddp = MinimalDDP(model)
    report["divergence_before_broadcast"] = before
    report["divergence_after_broadcast"] = _divergence(torch, dist, model)

    # 2. Gradient equivalence: N ranks x B samples == one process on the N*B batch.
    reference = copy.deepcopy(model)
    x, y = _global_batch(torch, cfg, n, 0)
    lo = rank * cfg.batch_per_rank
    loss = torch.nn.functional.mse_loss(
        ddp(x[lo : lo + cfg.batch_per_rank]), y[lo : lo + cfg.batch_per_rank]
    )
    loss.backward()
    ddp.finish()
    torch.nn.functional.mse_loss(reference(x), y).backward()
    grad_diff = max(
        float((p.grad - q.grad).abs().max())
        for p, q in zip(model.parameters(), reference.parameters())
    )
    worst = torch.tensor([grad_diff], dtype=torch.float64)
    dist.all_reduce(worst, op=dist.ReduceOp.MAX)
    report["grad_max_abs_diff"] = float(worst.item())

    # 3. Parameters stay in sync over training steps.
    opt = torch.optim.SGD(model.parameters(), lr=cfg.lr)
    divergence = []
    for step in range(cfg.steps):
        opt.zero_grad()
        x, y = _global_batch(torch, cfg, n, step + 1)
        out = ddp(x[lo : lo + cfg.batch_per_rank])
        torch.nn.functional.mse_loss(out, y[lo : lo + cfg.batch_per_rank]).backward()
        ddp.finish()
        opt.step()
        divergence.append(_divergence(torch, dist, model))
    report["divergence_per_step"] = divergence
    report["divergence_max"] = max(divergence)
    return report


def _fsdp_checks(
    torch: Any, dist: Any, cfg: SketchConfig, rank: int, n: int, sizes: list[int]
) -> dict[str, Any]:
    lo = rank * cfg.batch_per_rank
    # 4. FSDP sketch: round trip bit-exact, parameter bytes ~ 1/N, a step equal to DDP's.
    torch.manual_seed(cfg.seed)
    fsdp_model = _mlp(torch, sizes)
    original = [p.detach().clone() for p in fsdp_model.parameters()]
    full_bytes = sum(p.numel() * p.element_size() for p in original)
    shard = FlatShard(fsdp_model)
    resting_bytes = shard.parameter_bytes()
    shard.unshard()
    exact = all(torch.equal(p.data, o) for p, o in zip(fsdp_model.parameters(), original))
    gathered_bytes = shard.parameter_bytes()
    x, y = _global_batch(torch, cfg, n, 0)
    torch.nn.functional.mse_loss(
        fsdp_model(x[lo : lo + cfg.batch_per_rank]), y[lo : lo + cfg.batch_per_rank]
    ).backward()
    shard.reduce_grads()
    shard.reshard()
    # The reference gradient of the same parameters on the whole batch, one process.
    torch.manual_seed(cfg.seed)
    single = _mlp(torch, sizes)
    single.input_scale.copy_(fsdp_model.input_scale)
    torch.nn.functional.mse_loss(single(x), y).backward()
    flat_ref = torch.zeros(shard.padded)
    flat_ref[: shard.numel] = torch.cat([p.grad.reshape(-1) for p in single.parameters()])
    ref_shard = flat_ref[rank * shard.shard_numel : (rank + 1) * shard.shard_numel]
    flags = torch.tensor(
        [0.0 if exact else 1.0, float((shard.shard_grad - ref_shard).abs().max())],
        dtype=torch.float64,
    )
    dist.all_reduce(flags, op=dist.ReduceOp.MAX)
    return {
        "round_trip_bit_exact": bool(flags[0].item() == 0.0),
        "full_parameter_bytes": full_bytes,
        "padded_numel": shard.padded,
        "resting_parameter_bytes_per_rank": resting_bytes,
        "gathered_parameter_bytes_per_rank": gathered_bytes,
        "resting_fraction": resting_bytes / full_bytes,
        "shard_grad_max_abs_diff": float(flags[1].item()),
        "after_reshard_parameter_bytes_per_rank": shard.parameter_bytes(),
    }


def _timings(torch: Any, dist: Any, cfg: SketchConfig, rank: int, n: int) -> dict[str, Any]:
    sizes = [cfg.timing_hidden] * (cfg.timing_layers + 1)
    torch.manual_seed(cfg.seed)
    x = torch.randn(cfg.batch_per_rank, cfg.timing_hidden)
    out: dict[str, Any] = {"model_parameters": 0}
    grads: dict[str, list[Any]] = {}
    for name, average, overlap in (
        ("sum_div", "sum_div", False),
        ("avg", "avg", False),
        ("overlap", "sum_div", True),
    ):
        torch.manual_seed(cfg.seed)
        model = _mlp(torch, sizes)
        out["model_parameters"] = sum(p.numel() for p in model.parameters())
        ddp = MinimalDDP(model, average=average, overlap=overlap)

        def step() -> None:
            model.zero_grad(set_to_none=False)
            ddp(x * (rank + 1)).square().mean().backward()
            ddp.finish()

        step()  # warm-up, and the gradients compared below
        grads[name] = [p.grad.clone() for p in model.parameters()]
        out[f"{name}_step_s"] = _timed(step, cfg.timing_iters, dist)
    # Reduction-only timings on one flat gradient-sized buffer.
    flat = torch.randn(out["model_parameters"])

    def sum_div() -> None:
        dist.all_reduce(flat, op=dist.ReduceOp.SUM)
        flat.div_(n)

    out["all_reduce_sum_div_s"] = _timed(sum_div, cfg.timing_iters, dist)
    out["all_reduce_avg_s"] = _timed(
        lambda: dist.all_reduce(flat, op=dist.ReduceOp.AVG), cfg.timing_iters, dist
    )
    out["avg_vs_sum_div_max_abs_diff"] = max(
        float((a - b).abs().max()) for a, b in zip(grads["avg"], grads["sum_div"])
    )
    out["overlap_vs_sum_div_max_abs_diff"] = max(
        float((a - b).abs().max()) for a, b in zip(grads["overlap"], grads["sum_div"])
    )
    out["overlap_speedup"] = out["sum_div_step_s"] / out["overlap_step_s"]
    return out


def run_sketch(
    cfg: SketchConfig, *, world_size: int, backend: str = "gloo", timeout_s: float = 120.0
) -> dict[str, Any]:
    """Run :func:`sketch_rank` on ``world_size`` spawned ranks; rank 0's report.

    Raises:
        RankFailure: a rank failed or the run timed out.
    """

    report, _ = run_distributed(
        sketch_rank, world_size, args=(cfg,), backend=backend, timeout_s=timeout_s
    )
    return dict(report)
