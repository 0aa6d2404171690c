"""Kernel-level rates per device: attention-kernel tables, achievable memory bandwidth by access
size, host overhead and FP8 casts. A device's sustained clock and the tables its profile
measured are device data (:mod:`collsim.cluster.hardware`, :mod:`collsim.cluster.kernel_tables`).

Every figure is from /work/shared/reference/compute.md (section named beside it) unless marked
ASSUMPTION or FITTED. The op costs (:mod:`collsim.workload.op_costs`) combine them per op.

Attention tables
----------------
TFLOP/s of the kernel benchmarks of compute.md 2a-2c (FlashAttention repo assets and the FA3
paper), with FLOPs counted as those benchmarks count them and as :mod:`collsim.workload.ops`
counts executed FLOPs: forward ``4 b s^2 heads d`` (halved when causal), backward 2.5 x forward.
Columns are sequence lengths 512, 1k, 2k, 4k, 8k, 16k; ``None`` marks a bar whose label is
hidden in the figure. A rate between the columns is interpolated linearly in (log seq, log rate),
beyond the columns extrapolated from the two nearest (clamped to within 2x of the nearest
figure); between head dims 64, 128 (256) the same in log head dim, clamped outside. Where a
table gives only the forward+backward rate (FlashAttention-2 on A100, 2a), the forward and
backward rates are split with the forward/backward rate ratio the same kernel shows on H100 at
the same sequence and head dim (2b vs 2c). Where a kernel lacks its causal table, its
non-causal one is scaled by the causal/non-causal ratio of FA3's forward at the same point
(2b). Kernels without figures on a generation borrow another's (noted per entry).
"""

from __future__ import annotations

import math
from collections.abc import Sequence

from collsim.cluster.kernel_tables import interp_log_extrapolated
from collsim.core.errors import ConfigError

__all__ = [
    "ATTENTION_KERNELS",
    "EXECUTIONS",
    "SEQS",
    "attention_rate_flops",
    "default_attention_kernel",
    "hbm_efficiency",
    "HBM_EFFICIENCY_BY_SIZE",
    "HOST_OVERHEAD_S",
    "EAGER_PASSES",
    "fp8_cast_bytes",
    "GPU_SPREAD",
    "slowest_gpu_factor",
]

ATTENTION_KERNELS = ("flash2", "flash3", "cudnn", "triton", "eager")
"""Attention kernel families a scenario can name (``training.attention_kernel``)."""
EXECUTIONS = ("eager", "compiled", "cuda_graphs")
"""How the framework issues kernels (``training.execution``)."""

SEQS = (512, 1024, 2048, 4096, 8192, 16384)
_Row = tuple[float | None, ...]

# (kernel, phase, causal, head_dim) -> TFLOP/s at SEQS. phase: fwd, bwd or fb (fwd+bwd).
_H100: dict[tuple[str, str, bool, int], _Row] = {
    # 2a FlashAttention-2 fwd+bwd, H100 80GB SXM5
    ("flash2", "fb", False, 64): (215, 254, 274, 288, 294, 296),
    ("flash2", "fb", False, 128): (248, 294, 320, 326, 335, 338),
    ("flash2", "fb", True, 64): (141, 192, 232, 257, 273, 284),
    ("flash2", "fb", True, 128): (163, 221, 265, 294, 308, 328),
    # 2b forward (FA3 paper figure), FA2 columns
    ("flash2", "fwd", False, 128): (309, 350, 362, 368, 370, 370),
    ("flash2", "fwd", True, 128): (191, 260, 298, 319, 333, 335),
    # 2c backward (FA3 paper backward figures, non-causal)
    ("flash2", "bwd", False, 64): (198, 238, 264, 279, 287, 291),
    ("flash2", "bwd", False, 128): (214, 260, 291, 310, 318, 322),
    # FA3
    ("flash3", "fwd", False, 64): (333, 392, 460, 476, 496, 497),
    ("flash3", "fwd", True, 64): (197, 265, 371, 420, 460, 473),
    ("flash3", "fwd", False, 128): (467, 565, 625, 638, 646, 648),
    ("flash3", "fwd", True, 128): (292, 423, 521, 579, 602, 616),
    ("flash3", "fwd", False, 256): (482, None, 707, 736, 746, 756),
    ("flash3", "fwd", True, 256): (286, 427, 537, 612, 628, 642),
    ("flash3", "bwd", False, 64): (272, 363, 422, 453, 472, 474),
    ("flash3", "bwd", False, 128): (316, 424, 501, 542, 559, 561),
    # cuDNN
    ("cudnn", "fwd", False, 64): (335, 373, 395, 408, 412, 413),
    ("cudnn", "fwd", False, 128): (497, 574, 617, 609, 600, 595),
    ("cudnn", "fwd", True, 128): (315, 410, 484, 518, 529, 539),
    ("cudnn", "bwd", False, 64): (266, 348, 395, 417, 432, 433),
    ("cudnn", "bwd", False, 128): (305, 408, 465, 499, 518, 516),
}

_A100: dict[tuple[str, str, bool, int], _Row] = {
    # 2a FlashAttention-2 fwd+bwd, A100 80GB SXM4
    ("flash2", "fb", False, 64): (132, None, 162, 171, 175, 176),
    ("flash2", "fb", False, 128): (None, None, 187, 196, 201, 203),
    ("flash2", "fb", True, 64): (88, 119, 140, 156, 165, 171),
    ("flash2", "fb", True, 128): (99, 133, 155, 173, 182, 189),
}

_TABLES = {"hopper": _H100, "ampere": _A100}

_BORROW = {
    # kernel -> the kernel whose table it uses, per generation
    "triton": "flash2",
    # MPT's Triton FlashAttention (2023) has no published figures; compute.md 2d lists the
    # 2024 Triton tutorial kernel on H100 at 329-477 TFLOP/s forward, above FA2 there. We take
    # FlashAttention-2's tables (same algorithm, same tiling).
}
_BORROW_AMPERE = {"cudnn": "flash2"}  # cuDNN fused attention on A100: no figure; FA2's
_SCALED = {
    # generation -> (table generation, scale by the MAMF ratio); ASSUMPTION: the kernel keeps
    # the same share of the best-shape matmul rate on the newer part.
    "blackwell": ("hopper", 1745.0 / 794.5),  # B200 / H100 SXM bf16 MAMF (compute.md 1a)
    "cdna3": ("hopper", 668.4 / 794.5),  # MI300X / H100 SXM bf16 MAMF (compute.md 1a)
}

DEFAULT_FUSED_KERNEL = {
    "ampere": "flash2",
    "hopper": "flash2",
    "blackwell": "cudnn",
    "cdna3": "flash2",
}
"""The fused kernel a model with ``flash_attention: true`` gets when no kernel is named: what
PyTorch SDPA's flash backend (FlashAttention-2) runs on Ampere/Hopper; cuDNN on Blackwell."""


def default_attention_kernel(generation: str, fused: bool) -> str:
    """The kernel used when a scenario names none: ``eager`` or the generation's fused one."""
    if not fused:
        return "eager"
    return DEFAULT_FUSED_KERNEL.get(generation, "flash2")


def _row(
    table: dict[tuple[str, str, bool, int], _Row], kernel: str, phase: str, causal: bool, d: int
) -> _Row | None:
    return table.get((kernel, phase, causal, d))


def _fa3_causal_ratio(d: int, seq: float) -> float | None:
    """FA3 forward causal / non-causal rate on H100 at head dim ``d`` (2b)."""
    dd = 64 if d < 96 else (128 if d < 192 else 256)
    c = interp_log_extrapolated(SEQS, _H100[("flash3", "fwd", True, dd)], seq)
    n = interp_log_extrapolated(SEQS, _H100[("flash3", "fwd", False, dd)], seq)
    return None if c is None or n is None else c / n


def _direct(
    table: dict[tuple[str, str, bool, int], _Row],
    kernel: str,
    phase: str,
    causal: bool,
    d: int,
    seq: float,
) -> float | None:
    """A phase's rate straight from a table, or its non-causal one x FA3's causal ratio."""
    row = _row(table, kernel, phase, causal, d)
    if row is not None:
        return interp_log_extrapolated(SEQS, row, seq)
    if causal:
        row = _row(table, kernel, phase, False, d)
        ratio = _fa3_causal_ratio(d, seq)
        if row is not None and ratio is not None:
            rate = interp_log_extrapolated(SEQS, row, seq)
            return None if rate is None else rate * ratio
    return None


def _phase_rate(
    table: dict[tuple[str, str, bool, int], _Row],
    kernel: str,
    phase: str,
    causal: bool,
    d: int,
    seq: float,
) -> float | None:
    """TFLOP/s of one phase at one head dim from the tables (None: no way to get it)."""
    rate = _direct(table, kernel, phase, causal, d, seq)
    if rate is not None:
        return rate
    fb = _row(table, kernel, "fb", causal, d)
    if fb is None:
        return None
    total = interp_log_extrapolated(SEQS, fb, seq)
    # split fwd+bwd with the same kernel's H100 fwd/bwd ratio (see module docstring)
    f = _direct(_H100, kernel, "fwd", causal, d, seq)
    b = _direct(_H100, kernel, "bwd", causal, d, seq)
    if f is None or b is None or total is None:
        return total
    # t_f + t_b = 3.5 / total with t_f = 1 / R_f, t_b = 2.5 / R_b and R_f / R_b = f / b
    ratio = f / b
    r_f = total * (1 + 2.5 * ratio) / 3.5
    return r_f if phase == "fwd" else r_f / ratio


def _dims(table: dict[tuple[str, str, bool, int], _Row], kernel: str) -> list[int]:
    return sorted({k[3] for k in table if k[0] == kernel})


def attention_rate_flops(
    generation: str, kernel: str, phase: str, *, causal: bool, head_dim: int, seq_len: int
) -> float | None:
    """FLOP/s of a fused attention kernel in ``phase`` (``fwd`` or ``bwd``) from the tables,
    before the sustained-clock and wave corrections; None where the generation has no table
    (the compute model then uses its generic share of MAMF).

    Raises:
        ConfigError: an unknown kernel, or FlashAttention-3 on a GPU before Hopper.
    """
    if kernel not in ATTENTION_KERNELS or kernel == "eager":
        raise ConfigError(
            f"must be one of {', '.join(k for k in ATTENTION_KERNELS if k != 'eager')}; "
            f"got {kernel!r}",
            key_path="training.attention_kernel",
        )
    scale = 1.0
    gen = generation
    if gen in _SCALED:
        gen, scale = _SCALED[gen]
    table = _TABLES.get(gen)
    if table is None:
        return None
    if gen == "ampere" and kernel == "flash3":
        raise ConfigError(
            "flash3 (FlashAttention-3) runs on Hopper only; use flash2, cudnn or triton",
            key_path="training.attention_kernel",
        )
    k = _BORROW.get(kernel, kernel)
    if gen == "ampere":
        k = _BORROW_AMPERE.get(k, k)
    dims = _dims(table, k)
    if not dims:
        return None
    d = float(head_dim)
    lo = max([x for x in dims if x <= d], default=dims[0])
    hi = min([x for x in dims if x >= d], default=dims[-1])
    r_lo = _phase_rate(table, k, phase, causal, lo, seq_len)
    r_hi = _phase_rate(table, k, phase, causal, hi, seq_len) if hi != lo else r_lo
    if r_lo is None or r_hi is None:
        r = r_lo or r_hi
        return None if r is None else r * 1e12 * scale
    if hi == lo:
        rate = r_lo
    else:
        t = (math.log(d) - math.log(lo)) / (math.log(hi) - math.log(lo))
        rate = math.exp(math.log(r_lo) + t * (math.log(r_hi) - math.log(r_lo)))
    return rate * 1e12 * scale


# ---- memory-bound kernels ------------------------------------------------------------------

HBM_EFFICIENCY_BY_SIZE: tuple[tuple[float, float], ...] = (
    (1e5, 0.3),
    (1e6, 0.6),
    (1e7, 0.75),
    (1e8, 0.9),
)
"""Achievable share of the HBM bandwidth by the bytes one kernel moves: Calculon's A100 and
H100 system files (calculon@caa4b11 systems/a100_80g.json, h100_80g_nvl8.json
``mem1.MB_efficiency``: >= 100 MB 0.9, >= 10 MB 0.75, >= 1 MB 0.6, below 0.3; compute.md 3),
read as points at the left edge of each step and interpolated linearly in log size (constant
below 100 kB and above 100 MB)."""


def hbm_efficiency(size_bytes: float, curve: Sequence[tuple[float, float]] | None = None) -> float:
    """Achievable HBM share for a kernel moving ``size_bytes`` (see HBM_EFFICIENCY_BY_SIZE)."""
    pts = tuple(curve) if curve else HBM_EFFICIENCY_BY_SIZE
    if size_bytes <= pts[0][0]:
        return pts[0][1]
    if size_bytes >= pts[-1][0]:
        return pts[-1][1]
    lx = math.log(size_bytes)
    for (x0, y0), (x1, y1) in zip(pts, pts[1:], strict=False):
        if x0 <= size_bytes <= x1:
            return y0 + (y1 - y0) * (lx - math.log(x0)) / (math.log(x1) - math.log(x0))
    return pts[-1][1]


HOST_OVERHEAD_S: dict[str, float] = {"eager": 10e-6, "compiled": 5e-6, "cuda_graphs": 0.0}
"""Host (CPU) time to issue one kernel, per execution mode. ASSUMPTION (no published figure in
compute.md): PyTorch eager dispatch of one ATen op costs ~10 us of Python + dispatcher time;
a compiled graph issues its kernels from generated code at about half that; CUDA graphs replay
without the host. The GPU waits only when a kernel is shorter than its issue cost, so the model
takes ``max(device time, host time)`` per kernel. ``collsim validate compute`` measures it on
the local device (``measured.host_us``)."""

EAGER_PASSES: dict[str, float] = {
    "rmsnorm": 3.0,
    "rotary": 3.0,
    "swiglu": 5.0 / 3.0,
    "dropout_add": 1.3,
    "loss": 2.0,
    "softmax": 3.0,
}
"""Memory traffic of a PyTorch-eager op over the fused kernel ops.py counts, for stacks
without hand-fused kernels (``fused_kernels: false``). Derived by counting the kernels eager
PyTorch runs: RMSNorm as pow, mean, rsqrt, mul, mul (3 full read+write passes for one);
rotary as the half-split, mul, mul, add (3); SwiGLU as silu then mul (5 tensor passes for 3);
dropout then add ((2e+1) + 3e bytes for 3e+1, e = 2); the loss as an fp32 upcast, log-softmax
and nll (2); unfused attention's scale, mask and softmax as 3 kernels for Megatron's one.
LayerNorm, GELU and the residual add are single ATen kernels either way (1)."""


GPU_SPREAD = 0.05
"""Spread of the best-shape matmul rate between the GPUs of one node: "5%+ MAMF spread
between GPUs" (ml-engineering "Silicon lottery", compute.md 1a; a lower bound). The MAMF of
the catalogue is one GPU's, taken as the middle of that band."""


def slowest_gpu_factor(num_gpus: int, spread: float = GPU_SPREAD) -> float:
    """Factor (>= 1) on the compute time of a step that synchronises ``num_gpus`` GPUs (data,
    tensor or pipeline parallel): "the slowest GPU sets the pace" (compute.md 1a).

    With rates spread uniformly over a band of width ``spread`` around the measured MAMF (its
    middle), the slowest of n sits at 1/(n+1) of the band (the expected minimum of n uniform
    draws), so the step computes at ``1 - spread x (1/2 - 1/(n+1))`` of the typical rate::

        factor = 1 / (1 - spread x (1/2 - 1/(n+1)))      # n = 1: 1; n = 8: 1.020; n -> oo: 1.026

    The uniform band is an ASSUMPTION (the source gives only the spread). The engine applies it
    to the compute of every rank of a synchronous step.
    """
    if num_gpus < 1:
        raise ConfigError(f"must be >= 1, got {num_gpus}", key_path="num_gpus")
    if not 0 <= spread < 1:
        raise ConfigError(f"must be in [0, 1), got {spread}", key_path="spread")
    return 1.0 / (1.0 - spread * (0.5 - 1.0 / (num_gpus + 1)))


def fp8_cast_bytes(gemm_m: int, gemm_n: int, gemm_k: int, batch: int = 1) -> tuple[float, float]:
    """HBM bytes of the FP8 casts and scales around one linear, (forward, backward), with
    tensorwise dynamic scaling as torchao's float8 training runs it (compute.md 1c).

    Forward: each 16-bit input (A[m,k] and the weight B[k,n]) is read for its amax (2 B per
    element) and read again and written in fp8 (2 + 1 B): 5 B per element. Backward: the output
    gradient dC[m,n] the same (5 B), plus the transposed fp8 copies of A and B the wgrad and
    dgrad GEMMs need (read 2, write 1: 3 B per element). Checked against the torchao float8
    microbenchmarks (speedups 0.80 and 1.39, tests/workload/test_kernels.py).
    """
    a = float(batch * gemm_m * gemm_k)
    b = float(batch * gemm_k * gemm_n)
    c = float(batch * gemm_m * gemm_n)
    return 5.0 * (a + b), 5.0 * c + 3.0 * (a + b)


FP8_CAST_KERNELS = (4, 6)
"""Kernels the casts add per linear (forward: amax + cast for each input; backward: amax + cast
of dC and two transposed casts + the scale update): launch and host costs are charged per
kernel."""
