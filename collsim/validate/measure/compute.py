"""``collsim validate compute``: time a generic grid of kernels on the local device and write a
device profile (the device schema of :mod:`collsim.cluster.hardware`, with a ``measured:`` section).

Derivations, measurements and sources: docs/derivations.md, ``collsim.validate.measure.compute``.
"""

from __future__ import annotations

import functools
import os
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

from collsim.cluster.hardware import get_device
from collsim.validate.measure.cold import _cold_blocks, _next_slot, _pool, _slot
from collsim.validate.measure.concurrency import concurrency_slowdown

__all__ = [
    "ComputeGrid",
    "GEMM_DIMS",
    "GPU_GEMM_DIMS",
    "measure_profile",
    "write_profile",
    "attention_shape",
    "CPU_ATTENTION_HEADS",
    "CUDA_ATTENTION_TOKENS",
    "CUDA_ATTENTION_HIDDEN",
]

GEMM_DIMS = (64, 160, 400, 1000, 2500, 4096)
"""GEMM dimensions of the default CPU grid (about x2.5 apart from 64 to 4096)."""

GPU_GEMM_DIMS = (64, 192, 512, 1536, 4096, 8192)
"""GEMM dimensions of the default GPU grid: about x2.7 apart from 64 to 8192, each a multiple
of 64 elements as a model's dimensions are. cuBLAS runs its fastest tensor-core kernels only on
16-byte-aligned leading dimensions; on an H200 the CPU grid's 2500 (a bf16 row of 5000 bytes)
ran 3.3x slower than its aligned neighbour (4096 x 2500 x 4096 at 235 TFLOP/s, 4096^3 at 782:
validate/data/h200/queued_unaligned/h200_profile.yaml), and a model's aligned shapes
interpolated between such rows came out at half their rate."""

SGD_STEP_BYTES_PER_PARAM = 12.0
"""Bytes per fp32 parameter of the timed optimizer step: torch.optim.SGD without momentum
(torch/optim/sgd.py, ``_multi_tensor_sgd`` / ``_single_tensor_sgd``) adds the scaled gradient
to the parameter in place, reading both and writing one (4 + 4 + 4)."""

GPU_OPTIMIZER_PARAMS = 64_000_000
"""fp32 parameters of the GPU grid's optimizer step: 256 MB of parameters and as many of
gradients, about ten times the 50 MB L2 of an H100 (NVIDIA H100 Tensor Core GPU Architecture
whitepaper; torch reports 60 MB on the H200 of validate/data/h200), so the step streams from
HBM. With the CPU grid's 4 M (32 MB in all) an H200's step
stayed partly in L2 (validate/data/h200/aligned_duties/h200_profile.yaml)."""

CPU_ATTENTION_HEADS = 4
"""Heads of the one sequence attention is timed on with a CPU (a profile without
``attention_tokens`` in its notes was timed so)."""
CUDA_ATTENTION_TOKENS = 16384
CUDA_ATTENTION_HIDDEN = 2048
"""On CUDA attention is timed as the FlashAttention benchmarks run it (flash-attention
``benchmarks/benchmark_flash_attention.py``: batch 16k / seq, hidden 2048, i.e. 16 heads of 128
or 32 of 64): full waves of CTAs on any GPU, as the compute model reads a table's rate
(``collsim.workload.op_costs.TABLE_CTAS``); one sequence of 4 heads would fill 4 x s / 128 of
an H100's 132 SMs."""


def attention_shape(
    seq_len: int, head_dim: int, tokens: int | None = None, hidden: int | None = None
) -> tuple[int, int]:
    """(batch, heads) attention is timed with: ``max(1, tokens // seq_len)`` sequences of
    ``hidden // head_dim`` heads; without ``tokens`` (a CPU profile) one sequence of
    :data:`CPU_ATTENTION_HEADS` heads."""
    if not tokens:
        return 1, CPU_ATTENTION_HEADS
    return max(1, tokens // seq_len), max(1, (hidden or CUDA_ATTENTION_HIDDEN) // head_dim)


@dataclass(frozen=True, slots=True, kw_only=True)
class ComputeGrid:
    """What to time. ``quick()`` is the small grid the tests time."""

    gemm_dims: tuple[int, ...] = GEMM_DIMS
    gemm_max_flops: float = 4e9
    seqs: tuple[int, ...] = (128, 512, 2048, 4096)
    head_dims: tuple[int, ...] = (64, 128)
    attention_max_flops: float = 2e10
    mem_sizes_bytes: tuple[int, ...] = tuple(64 * 1024 * 4**i for i in range(8))  # 64K..1G cap
    mem_max_bytes: int = 256 * 2**20
    activation_elements: tuple[int, ...] = (2**14, 2**17, 2**20, 2**22)
    optimizer_params: int = 4_000_000
    reps: int = 3
    threads: int = 1
    concurrency: bool = True
    """Measure ``concurrent_slowdown`` and ``concurrent_memory_slowdown`` (CPU only; spawns one
    process per core)."""

    @classmethod
    def full(cls, device: str = "cpu") -> ComputeGrid:
        """The default grid; on CUDA :data:`GPU_GEMM_DIMS`, with FLOP caps that let every GEMM
        of the grid (up to 2 x 8192^3 = 1.1e12 FLOPs) and every attention point (up to 3.5 x
        2.7e11 FLOPs at seq 4096 in the benchmark layout) run: well under a second each on a
        datacentre GPU."""
        if device == "cpu":
            return cls()
        return cls(
            gemm_dims=GPU_GEMM_DIMS,
            gemm_max_flops=2.2e12,
            attention_max_flops=1e12,
            optimizer_params=GPU_OPTIMIZER_PARAMS,
            concurrency=False,
        )

    @classmethod
    def quick(cls) -> ComputeGrid:
        return cls(
            gemm_dims=(64, 400, 2500),
            gemm_max_flops=4e8,
            seqs=(128, 512),
            head_dims=(64,),
            attention_max_flops=5e8,
            mem_sizes_bytes=tuple(64 * 1024 * 4**i for i in range(5)),
            mem_max_bytes=16 * 2**20,
            activation_elements=(2**14, 2**18),
            optimizer_params=500_000,
            reps=2,
            concurrency=False,
        )


Timer = Callable[[Callable[[], Any], int], float]
"""Median seconds of one call of ``fn`` over ``reps`` timings (:func:`_median_time` on a CPU,
:class:`_QueuedTimer` on a GPU)."""


def _median_time(fn: Callable[[], Any], reps: int, sync: Callable[[], None]) -> float:
    fn()
    sync()
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        sync()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


class _QueuedTimer:
    """Device time of a call on a GPU as a training step's stream runs it: a burst of calls
    queued behind a device-side sleep (``torch.cuda._sleep``), timed by CUDA events around the
    burst; a burst whose sleep ended before the host had queued it all (the start event already
    passed) is queued again behind a sleep twice as long.

    A call timed alone between two synchronizes holds the host's launch and the wait for the
    device to report back (about 30 us a call on a virtualised H200: validate/data/h200/),
    which a step whose host runs ahead never waits for; a burst queued behind the sleep runs
    back to back, so each call's time holds the kernels and the gaps between them alone (the
    host's own cost per op is timed apart, :func:`_host_s`). A call that makes the host wait
    for the device (a synchronize inside it) outruns any sleep: at :attr:`MAX_SLEEP_S` its
    burst is taken as it ran, host waits included, and counted in :attr:`host_bound`."""

    BURST_DEVICE_S = 2e-3
    """Device seconds a burst aims at (at most :attr:`MAX_BURST` calls)."""
    MAX_BURST = 32
    FIRST_SLEEP_S = 1e-3
    MAX_SLEEP_S = 0.25

    def __init__(self, torch: Any) -> None:
        self.torch = torch
        cuda = torch.cuda
        cuda.synchronize()
        start, end = cuda.Event(enable_timing=True), cuda.Event(enable_timing=True)
        cycles = 10_000_000
        start.record()
        cuda._sleep(cycles)
        end.record()
        end.synchronize()
        # only sizes the sleeps: whether one was long enough is read off its start event
        self.s_per_cycle = start.elapsed_time(end) * 1e-3 / cycles
        self.sleep_s = self.FIRST_SLEEP_S
        """The current point's sleep (each point starts at :attr:`FIRST_SLEEP_S`)."""
        self.sleeps = 0
        """Bursts queued again behind a longer sleep."""
        self.host_bound = 0
        """Bursts taken with the host still queuing at the longest sleep."""

    def __call__(self, fn: Callable[[], Any], reps: int) -> float:
        self.sleep_s = self.FIRST_SLEEP_S  # a point's sleep grows over its bursts, not past it
        fn()
        self.torch.cuda.synchronize()
        one = self._burst(fn, 1)
        burst = max(1, min(self.MAX_BURST, int(self.BURST_DEVICE_S / max(one, 1e-7))))
        return statistics.median(self._burst(fn, burst) for _ in range(reps))

    def _burst(self, fn: Callable[[], Any], calls: int) -> float:
        """Seconds per call of ``calls`` calls queued behind the point's sleep."""
        cuda = self.torch.cuda
        while True:
            start, end = cuda.Event(enable_timing=True), cuda.Event(enable_timing=True)
            cuda._sleep(max(1, int(self.sleep_s / self.s_per_cycle)))
            t0 = time.perf_counter()
            start.record()
            for _ in range(calls):
                fn()
            end.record()
            host_s = time.perf_counter() - t0
            outran = bool(start.query())  # the sleep was over before the burst was queued
            end.synchronize()
            per_call = float(start.elapsed_time(end)) * 1e-3 / calls
            if not outran:
                return per_call
            if self.sleep_s >= self.MAX_SLEEP_S:
                self.host_bound += 1
                return per_call
            self.sleeps += 1
            self.sleep_s = min(self.MAX_SLEEP_S, max(2 * self.sleep_s, 2 * host_s))


def _gemm_time(
    torch: Any,
    dev: Any,
    dtype: Any,
    m: int,
    n: int,
    k: int,
    reps: int,
    timer: Timer,
) -> float:
    """Mean time of one GEMM of this shape over the three layouts training runs (forward
    A @ B, dgrad A @ B^T, wgrad A^T @ B), each on cold operands and into a cold result: views
    cycling through :data:`COLD_BYTES` of memory each.

    The result is cold too: in a training step a GEMM writes into memory that other kernels
    used last (the allocator hands back a block freed long before), not the block a benchmark
    loop freed one call earlier. It matters most where the result is large beside the work,
    the weight gradient with K = the tokens of a micro-batch (a wgrad into a hot result and
    into cycling results, and inside a real step: docs/derivations.md, measurements)."""
    per = m * k + k * n
    pool = _pool(torch, dev, dtype)
    if pool.numel() < per:  # one pair larger than the pool: a pool of its own
        pool = torch.randn(per, device=dev, dtype=dtype)
    results = _pool(torch, dev, dtype, "out")
    if results.numel() < m * n:
        results = torch.empty(m * n, device=dev, dtype=dtype)
    copies = max(1, min(64, pool.numel() // per, results.numel() // (m * n)))

    def operands(i: int, layout: int) -> tuple[Any, Any]:
        base = i * per
        a_flat, b_flat = pool[base : base + m * k], pool[base + m * k : base + per]
        a = a_flat.view(k, m).t() if layout == 2 else a_flat.view(m, k)
        b = b_flat.view(n, k).t() if layout == 1 else b_flat.view(k, n)
        return a, b

    total = 0.0
    for layout in range(3):
        ops = [operands(i, layout) for i in range(copies)]

        def run(ops: list[tuple[Any, Any]] = ops) -> None:
            i = _next_slot(len(ops))
            a, b = ops[i]
            torch.mm(a, b, out=results[i * m * n : (i + 1) * m * n].view(m, n))

        total += timer(run, reps)
    return total / 3


def _fp8_gemm_time(torch: Any, dev: Any, m: int, n: int, k: int, reps: int, timer: Timer) -> float:
    """Time of one FP8 GEMM of this shape: ``torch._scaled_mm`` on e4m3 operands (one scale
    per tensor, fast accumulation, a bf16 result), in the layout its kernels take (A
    row-major, B column-major: Transformer Engine hands the dgrad and wgrad GEMMs transposed
    FP8 copies, whose casts collsim prices apart, :func:`collsim.workload.kernels.
    fp8_cast_bytes`), on cold operands (copies cast once from views of the bf16 pool, taken
    in turn); each result is a new tensor, as a training step's is."""
    f8 = torch.float8_e4m3fn
    per = m * k + k * n
    pool = _pool(torch, dev, torch.bfloat16)
    if pool.numel() < per:
        pool = torch.randn(per, device=dev, dtype=torch.bfloat16)
    copies = max(1, min(16, pool.numel() // per))
    scale = torch.ones((), device=dev, dtype=torch.float32)
    ops = []
    for i in range(copies):
        flat = pool[i * per : (i + 1) * per]
        a = flat[: m * k].view(m, k).to(f8)
        b = flat[m * k :].view(n, k).to(f8).t()  # column-major k x n
        ops.append((a, b))

    def run() -> None:
        a, b = ops[_next_slot(len(ops))]
        torch._scaled_mm(
            a, b, scale_a=scale, scale_b=scale, out_dtype=torch.bfloat16, use_fast_accum=True
        )

    t: float = timer(run, reps)
    return t


def _runs_fp8(torch: Any, dev: Any) -> bool:
    """Whether the GPU runs FP8 GEMMs: compute capability 8.9 or later (Ada, Hopper,
    Blackwell) and a torch with ``_scaled_mm`` and e4m3."""
    if dev.type != "cuda" or not hasattr(torch, "float8_e4m3fn"):
        return False
    if not hasattr(torch, "_scaled_mm"):
        return False
    major, minor = torch.cuda.get_device_capability(dev)
    return (major, minor) >= (8, 9)


def _dtypes(torch: Any, device: str) -> list[tuple[str, Any]]:
    if device == "cpu":
        return [("fp32", torch.float32), ("bf16", torch.bfloat16)]
    return [("bf16", torch.bfloat16), ("fp16", torch.float16), ("fp32", torch.float32)]


def _sdpa_backends(torch: Any, device: str) -> list[tuple[str, Any]]:
    # torch is optional (the validate extra): imported where ranks run
    from torch.nn.attention import SDPBackend

    out = [("flash2", SDPBackend.FLASH_ATTENTION), ("eager", SDPBackend.MATH)]
    if device != "cpu" and hasattr(SDPBackend, "CUDNN_ATTENTION"):
        out.append(("cudnn", SDPBackend.CUDNN_ATTENTION))
    return out


def _gemm_rates(torch: Any, dev: Any, grid: ComputeGrid, timer: Timer) -> list[list[Any]]:
    """``[m, n, k, dtype, TFLOP/s]`` of every GEMM of the grid within its FLOP cap, in each
    dtype of :func:`_dtypes` and, on a GPU that runs them (:func:`_runs_fp8`), in FP8 (its
    kernels take dimensions in multiples of 16)."""
    kinds: list[tuple[str, Callable[[int, int, int], float]]] = [
        (name, functools.partial(_gemm_time, torch, dev, dtype, reps=grid.reps, timer=timer))
        for name, dtype in _dtypes(torch, dev.type)
    ]
    if _runs_fp8(torch, dev):
        kinds.append(
            ("fp8", functools.partial(_fp8_gemm_time, torch, dev, reps=grid.reps, timer=timer))
        )
    gemm: list[list[Any]] = []
    for name, time_of in kinds:
        for m in grid.gemm_dims:
            for n in grid.gemm_dims:
                for k in grid.gemm_dims:
                    flops = 2.0 * m * n * k
                    if flops > grid.gemm_max_flops or (name == "fp8" and min(m, n, k) % 16):
                        continue
                    t = time_of(m, n, k)
                    gemm.append([m, n, k, name, round(flops / t / 1e12, 6)])
    return gemm


def _attention_rates(torch: Any, dev: Any, grid: ComputeGrid, timer: Timer) -> list[list[Any]]:
    """``[kernel, causal, head dim, seq, forward TFLOP/s, backward TFLOP/s]`` of causal
    attention per SDPA backend that runs here, within the grid's FLOP cap (shapes and dtype:
    :func:`attention_shape`, :func:`attention_notes`)."""
    # torch is optional (the validate extra): imported where ranks run
    from torch.nn.attention import sdpa_kernel

    attention: list[list[Any]] = []
    layout = attention_notes(dev.type)
    dtype = torch.float32 if dev.type == "cpu" else torch.bfloat16
    for kernel, backend in _sdpa_backends(torch, dev.type):
        for d in grid.head_dims:
            for s in grid.seqs:
                batch, heads = attention_shape(
                    s, d, layout.get("attention_tokens"), layout.get("attention_hidden")
                )
                # causal half, as the tables count
                fwd_flops = 4.0 * batch * heads * s * s * d / 2
                if 3.5 * fwd_flops > grid.attention_max_flops:
                    continue
                q, k_, v = (
                    torch.randn(batch, heads, s, d, device=dev, dtype=dtype, requires_grad=True)
                    for _ in range(3)
                )
                try:
                    with sdpa_kernel(backend):

                        def fwd(q: Any = q, k_: Any = k_, v: Any = v) -> Any:
                            return torch.nn.functional.scaled_dot_product_attention(
                                q, k_, v, is_causal=True
                            )

                        t_f = timer(fwd, grid.reps)
                        out = fwd()
                        grad = torch.randn_like(out)

                        def both(q: Any = q, k_: Any = k_, v: Any = v, g: Any = grad) -> None:
                            o = torch.nn.functional.scaled_dot_product_attention(
                                q, k_, v, is_causal=True
                            )
                            o.backward(g)

                        t_fb = timer(both, grid.reps)
                except RuntimeError:  # the backend does not run here
                    break
                t_b = max(t_fb - t_f, 1e-9)
                attention.append(
                    [
                        kernel,
                        True,
                        d,
                        s,
                        round(fwd_flops / t_f / 1e12, 6),
                        round(2.5 * fwd_flops / t_b / 1e12, 6),
                    ]
                )
    return attention


def attention_notes(device: str) -> dict[str, Any]:
    """What a profile's notes say about its attention timing (``collsim validate kernels``
    reads them): the dtype, and on CUDA the benchmark layout's tokens and hidden size."""
    if device == "cpu":
        return {"attention_dtype": "fp32", "attention_heads": CPU_ATTENTION_HEADS}
    return {
        "attention_dtype": "bf16",
        "attention_tokens": CUDA_ATTENTION_TOKENS,
        "attention_hidden": CUDA_ATTENTION_HIDDEN,
    }


def _bandwidth_rates(torch: Any, dev: Any, grid: ComputeGrid, timer: Timer) -> list[list[float]]:
    """``[bytes moved, GB/s]`` of an elementwise add per size of the grid within its cap, on
    cold operands into a cold result as the GEMMs are (:func:`_gemm_time`): each call takes
    the next triple of a pool of at least 4 (the shared :data:`COLD_BYTES` pool, or one of
    the size's own up to :data:`MAX_COLD_BYTES`; a size past that is left out).

    A step's memory-bound kernels read tensors written many kernels before (saved
    activations in backward, gradients, parameters) and write into blocks the allocator
    hands back cold; an add repeated on one triple of buffers finds them in the core's own
    cache instead (hot and cold rates of an add: docs/derivations.md, measurements)."""
    bandwidth: list[list[float]] = []
    for size in grid.mem_sizes_bytes:
        if size > grid.mem_max_bytes:
            continue
        elems = max(1, size // 12)  # three fp32 tensors of size / 3 bytes
        cold = _cold_blocks(torch, dev, torch.float32, 3 * elems)
        if cold is None:
            continue
        pool, blocks = cold

        def run(e: int = elems, n: int = blocks, pool: Any = pool) -> None:
            a, b, c = _slot(pool, _next_slot(n), e, 3)
            torch.add(a, b, out=c)

        t = timer(run, max(grid.reps, 5))
        del run, pool  # a size's own pool goes before the next size's is made
        bandwidth.append([float(12 * elems), round(12 * elems / t / 1e9, 4)])
    return bandwidth


def _activation_rates(torch: Any, dev: Any, grid: ComputeGrid, timer: Timer) -> list[list[Any]]:
    """``[kind, elements, fwd_gelem_per_s, bwd_gelem_per_s]`` of the MLP activations as eager
    PyTorch runs them, on cold operands cycling through a pool (as :func:`_bandwidth_rates`;
    the results are fresh allocations), in the device's first training dtype:

    - ``gelu``: ``F.gelu`` (exact, erf) forward; ``aten.gelu_backward`` backward;
    - ``swiglu``: ``F.silu(a) * b`` forward (2 kernels); backward ``g * silu(a)`` for b (from
      the saved ``silu(a)``, as autograd keeps it) and ``aten.silu_backward(g * b, a)`` for a
      (3 kernels).
    """
    F = torch.nn.functional
    aten = torch.ops.aten
    dtype = _dtypes(torch, dev.type)[0][1]
    rows: list[list[Any]] = []
    # GELU: x, g; SwiGLU: a, b, g and silu(a) (autograd saves it: backward does not recompute)
    for kind, tensors in (("gelu", 2), ("swiglu", 4)):
        for elems in grid.activation_elements:
            cold = _cold_blocks(torch, dev, dtype, tensors * elems)
            if cold is None:
                continue
            pool, blocks = cold

            def views(e: int = elems, n: int = blocks, t: int = tensors, p: Any = pool) -> Any:
                return _slot(p, _next_slot(n), e, t)

            if kind == "gelu":

                def fwd(views: Any = views) -> None:
                    x, _ = views()
                    F.gelu(x)

                def bwd(views: Any = views) -> None:
                    x, g = views()
                    aten.gelu_backward(g, x)

            else:
                for i in range(blocks):  # each slot's saved silu(a), before any timing
                    a, _, _, saved = _slot(pool, i, elems, 4)
                    saved.copy_(F.silu(a))

                def fwd(views: Any = views) -> None:
                    a, b, _, _ = views()
                    F.silu(a) * b

                def bwd(views: Any = views) -> None:
                    a, b, g, saved = views()
                    gb = g * b
                    g * saved
                    aten.silu_backward(gb, a)

            reps = max(grid.reps, 5)
            t_fwd = timer(fwd, reps)
            t_bwd = timer(bwd, reps)
            rows.append([kind, elems, round(elems / t_fwd / 1e9, 6), round(elems / t_bwd / 1e9, 6)])
    return rows


def _host_s(torch: Any, dev: Any, sync: Callable[[], None]) -> float:
    """Host seconds per kernel in training: a forward + backward through 50 tiny autograd ops
    (100 kernels), so that autograd's recording and its backward engine are counted."""
    tiny = torch.ones(4, device=dev, requires_grad=True)

    def chain() -> None:
        x = tiny
        for _ in range(50):
            x = x * 1.0001
        x.sum().backward()

    return _median_time(chain, 7, sync) / 100


def _optimizer_bps(torch: Any, dev: Any, grid: ComputeGrid, timer: Timer) -> float:
    """Bytes per second of a plain SGD step (no momentum) over ``grid.optimizer_params`` fp32
    parameters: torch's step is one ``add_`` per parameter that reads the parameter and its
    gradient and writes the parameter, :data:`SGD_STEP_BYTES_PER_PARAM` bytes."""
    params = [
        torch.nn.Parameter(torch.randn(grid.optimizer_params // 8, device=dev)) for _ in range(8)
    ]
    for p in params:
        p.grad = torch.randn_like(p)
    opt = torch.optim.SGD(params, lr=1e-3)
    t_opt = timer(opt.step, max(grid.reps, 3))
    bps: float = grid.optimizer_params * SGD_STEP_BYTES_PER_PARAM / t_opt
    return bps


def _warm_clocks(torch: Any, dev: Any, sync: Callable[[], None], seconds: float = 0.25) -> float:
    """Run large bf16 GEMMs for ``seconds`` before the first timing; the seconds it took.

    An idle GPU may hold its SM clock far below boost until work arrives. A quarter of a second
    is short of the board's power limit: back-to-back GEMMs took about a second to reach it on
    an H200 and then held the clock at 0.75 of boost (validate/data/h200/queued_unaligned/
    clock.csv), which would slow the first shapes timed after a longer warm-up."""
    a = torch.randn(8192, 8192, device=dev, dtype=torch.bfloat16)
    b = torch.randn(8192, 8192, device=dev, dtype=torch.bfloat16)
    t0 = time.perf_counter()
    while time.perf_counter() - t0 < seconds:
        for _ in range(8):
            torch.mm(a, b)
        sync()
    return time.perf_counter() - t0


def measure_profile(
    grid: ComputeGrid,
    device: str = "cpu",
    on_section: Callable[[dict[str, Any]], None] | None = None,
) -> dict[str, Any]:
    """Time the grid on ``device`` (``cpu`` or ``cuda``); the ``measured`` section's data.

    ``on_section`` gets the tables measured so far after each section (GEMMs, attention,
    bandwidth, host and optimizer, concurrency), with ``notes.sections`` naming those done, so
    that a caller can write them before the next one starts."""

    # torch is optional (the validate extra): imported where ranks run
    import torch

    torch.set_num_threads(grid.threads)
    dev = torch.device(device)

    def sync() -> None:
        if dev.type == "cuda":
            torch.cuda.synchronize()

    notes: dict[str, Any] = {
        "torch": str(torch.__version__),
        "threads": grid.threads,
        "device": device,
        "measured_at_utc": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "optimizer_params": grid.optimizer_params,
        "optimizer_bytes_per_param": SGD_STEP_BYTES_PER_PARAM,
        "activation_dtype": _dtypes(torch, dev.type)[0][0],
        **attention_notes(dev.type),
    }
    if dev.type == "cuda":
        props = torch.cuda.get_device_properties(dev)
        notes["gpu"] = str(props.name)
        notes["sm_count"] = int(props.multi_processor_count)
        notes["memory_bytes"] = int(props.total_memory)
    out: dict[str, Any] = {
        "concurrent_slowdown": 1.0,
        "concurrent_memory_slowdown": 1.0,
        "gemm": [],
        "attention": [],
        "bandwidth": [],
        "activation": [],
        "optimizer_bytes_per_s": None,
        # a timed call holds what the model's launch floor stands for: on a CPU its launch and
        # the wait for it, on a GPU the gaps between back-to-back kernels of a queued burst
        # (_QueuedTimer); no second floor on top
        "launch_us": 0.0,
        "host_us": None,
        "notes": notes,
    }
    done: list[str] = []

    def section(name: str) -> None:
        done.append(name)
        if on_section is not None:
            on_section(dict(out, notes=dict(notes, sections=",".join(done))))

    timer: Timer = functools.partial(_median_time, sync=sync)
    queued: _QueuedTimer | None = None
    if dev.type == "cuda":
        notes["clock_warmup_s"] = round(_warm_clocks(torch, dev, sync), 3)
        timer = queued = _QueuedTimer(torch)
        notes["timing"] = "bursts queued behind a device sleep, CUDA events"
    out["gemm"] = _gemm_rates(torch, dev, grid, timer)
    section("gemm")
    out["attention"] = _attention_rates(torch, dev, grid, timer)
    section("attention")
    out["bandwidth"] = _bandwidth_rates(torch, dev, grid, timer)
    out["activation"] = _activation_rates(torch, dev, grid, timer)
    section("bandwidth,activation")
    out["host_us"] = round(_host_s(torch, dev, sync) * 1e6, 3)
    out["optimizer_bytes_per_s"] = round(_optimizer_bps(torch, dev, grid, timer), 1)
    if queued is not None:
        notes["requeued_bursts"] = queued.sleeps
        notes["host_bound_bursts"] = queued.host_bound
    section("host,optimizer")
    cores = os.cpu_count() or 1
    if grid.concurrency and dev.type == "cpu" and cores > 1:
        out["concurrent_slowdown"] = round(concurrency_slowdown(cores, "compute"), 4)
        out["concurrent_memory_slowdown"] = round(concurrency_slowdown(cores, "memory"), 4)
        section("concurrency")
    return out


def write_profile(
    path: str | Path,
    measured: dict[str, Any],
    *,
    device: str = "cpu",
    figures: dict[str, Any] | None = None,
) -> Path:
    """Write a device file (catalogue schema + ``measured``) that ``get_device(path)`` reads;
    ``figures`` replace the device-file keys derived from the tables (``peak_tflops``,
    ``mamf_tflops``, ``sm_count``, ...), e.g. with a catalogue device's own."""

    base = get_device("cpu")
    cores = os.cpu_count() or 1
    notes = measured["notes"]

    def best_of(dtype: str) -> float:
        return max((r[4] for r in measured["gemm"] if r[3] == dtype), default=1e-3)

    best = best_of("fp32")
    bw = max((r[1] for r in measured["bandwidth"]), default=1.0)
    tables: dict[str, Any] = {k: v for k, v in measured.items() if v is not None}
    tables["launch_us"] = 0.0  # the measured times hold the launch (see measure_profile)
    if device == "cpu":
        # peak := the best measured rate (the profile's tables carry the shape dependence)
        peaks = {"fp32": best, "bf16": best, "fp16": best}
        sm_count, memory_gb = int(notes["threads"]), base.memory_bytes / 1e9
    else:  # each dtype's own best (tensor cores run bf16 / fp16 many times faster than fp32)
        peaks = {dt: best_of(dt) for dt in ("fp32", "bf16", "fp16")}
        if any(r[3] == "fp8" for r in measured["gemm"]):
            peaks["fp8"] = best_of("fp8")
        sm_count = int(notes.get("sm_count", notes["threads"]))
        memory_gb = float(notes.get("memory_bytes", base.memory_bytes)) / 1e9
    doc: dict[str, Any] = {
        "key": Path(path).stem,
        "name": f"measured {notes.get('gpu', device)} ({cores} cores, "
        f"{notes['threads']} thread(s))",
        "generation": "cpu" if device == "cpu" else "generic",
        "peak_tflops": peaks,
        "mamf_tflops": {"bf16": peaks["bf16"]},
        "sm_count": sm_count,
        # gloo holds no SMs (collsim.cluster.hardware.Device.nccl_sms); a GPU's NCCL holds its
        # default
        **({"interference": {"nccl_sms": 0}} if device == "cpu" else {}),
        "memory_gb": memory_gb,
        "memory_bandwidth_tbps": bw / 1e3,
        "reserve_gib": 0.0,
        "measured": tables,
    }
    doc.update({k: v for k, v in (figures or {}).items() if k not in ("key", "measured")})
    out = Path(path)
    out.parent.mkdir(parents=True, exist_ok=True)
    header = (
        "# Device profile written by `collsim validate compute` (the device schema of\n"
        "# collsim.cluster.hardware):\n"
        "# measured kernel tables replace the catalogue figures where they cover an op.\n"
    )
    out.write_text(
        header + yaml.safe_dump(doc, sort_keys=False, width=100, default_flow_style=None)
    )
    return out
