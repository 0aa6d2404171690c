"""The cost of one op in one phase on one device: kernel rates, GEMM shapes, launch and host.

The op-level half of the compute model: for every op of :mod:`collsim.workload.ops` on one
rank, its kernels at the device's GEMM, attention and HBM rates (or a measured profile's), with
the launch floor and the host issue cost; :class:`~collsim.workload.compute.ComputeModel` sums
them over whole blocks. Derivations and sources: docs/derivations.md,
``collsim.workload.op_costs``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Protocol

from collsim.core.errors import ConfigError
from collsim.core.vocab import Dtype, OpKind, parse_enum
from collsim.workload.fp8 import TE_FP8_OPS, FP8Casts, LinearShape, linear_cast_bytes
from collsim.workload.kernels import (
    ATTENTION_KERNELS,
    EAGER_PASSES,
    EXECUTIONS,
    FP8_CAST_KERNELS,
    HOST_OVERHEAD_S,
    attention_rate_flops,
    default_attention_kernel,
    fp8_cast_bytes,
    hbm_efficiency,
)
from collsim.workload.ops import FLOPS_PER_ELEMENT, OP_NAMES, Gemm, Op

__all__ = [
    "DeviceLike",
    "OpCost",
    "OpCostModel",
    "shape_efficiency",
    "SM_COUNTS",
    "FP8_LINEAR_OPS",
    "FLASH_FORWARD_EFFICIENCY",
    "FLASH_BACKWARD_EFFICIENCY",
    "TABLE_CTAS",
]

TILE = 128
K_OVERHEAD = 128

FLASH_FORWARD_EFFICIENCY = 0.84
"""Generic fused-attention forward rate over MAMF where a generation has no kernel table:
FlashAttention-2 reaches up to 73 % of the A100 peak (Dao 2023), i.e. 0.73 / 0.869 of MAMF."""
FLASH_BACKWARD_EFFICIENCY = 0.72
"""Generic fused-attention backward rate over MAMF: up to 63 % of the A100 peak (Dao 2023)."""
TABLE_CTAS = 2048
"""CTAs of the published attention benchmarks: batch 16k / s, 16 heads of 128 (or 32 of 64),
s / 128 query blocks each (flash-attention README): 2048, full waves on any GPU here."""

FP8_LINEAR_OPS = frozenset({"qkv_proj", "out_proj", "mlp_up", "mlp_down"})
"""Linears that run in FP8 under ``dtype: fp8`` (Transformer Engine / torchao recipes keep the
attention core, the LM head and the loss in 16-bit)."""

SM_COUNTS: dict[str, int] = {
    "a100": 108,
    "h100": 132,
    "h200": 132,
    "h800": 132,
    "gh200": 132,
    "b200": 148,
    "b300": 148,
    "gb200": 148,
    "mi300x": 304,
    "v100": 80,
    "h100 pcie": 114,
    "generic cpu": 32,
}
"""Streaming multiprocessors (compute units) per GPU by lower-case name prefix (datasheets),
used when the device gives no ``sm_count``; for the generic CPU, its 32 cores."""
_DEFAULT_SMS = 108

_NORM_OPS = ("attn_norm", "mlp_norm", "final_norm")


class DeviceLike(Protocol):
    """What the compute model needs from ``collsim.cluster.hardware.Device`` (other fields optional:
    ``generation``, ``sm_count``, ``sustained_clock_fraction``, ``mamf_for``, ``measured``)."""

    @property
    def name(self) -> str: ...
    @property
    def matmul_efficiency(self) -> float: ...
    @property
    def memory_bandwidth_bps(self) -> float: ...

    def peak_flops_for(self, dtype: str) -> float: ...


def _sm_count(device: DeviceLike) -> int:
    count = getattr(device, "sm_count", None)
    if count:
        return int(count)
    key = device.name.lower()
    for prefix in sorted(SM_COUNTS, key=len, reverse=True):
        if key.startswith(prefix):
            return SM_COUNTS[prefix]
    return _DEFAULT_SMS


def shape_efficiency(gemm: Gemm, num_sms: int) -> float:
    """Fraction of the best-shape (MAMF) rate a GEMM of this shape reaches (formula above)."""
    tm, tn = math.ceil(gemm.m / TILE), math.ceil(gemm.n / TILE)
    tiles = gemm.batch * tm * tn
    tile_eff = gemm.m * gemm.n / (tm * TILE * tn * TILE)
    wave_eff = tiles / (math.ceil(tiles / num_sms) * num_sms)
    k_eff = gemm.k / (gemm.k + K_OVERHEAD)
    return tile_eff * wave_eff * k_eff


@dataclass(frozen=True, slots=True, kw_only=True)
class OpCost:
    """The modelled cost of one op in one phase on one rank."""

    name: str
    phase: str
    """``forward``, ``backward`` or ``recompute``."""
    kind: OpKind
    flops: float
    size_bytes: float
    time_s: float
    bound: str
    """``compute``, ``memory``, ``host`` (the host issue cost) or ``override``."""
    matmul_efficiency: float = 0.0
    """Achieved fraction of the dtype's peak FLOP/s (matmuls; 0 for element-wise ops)."""
    wgrad_s: float = 0.0
    """Of a linear's backward: the weight-gradient GEMM's share of ``time_s``."""


class OpCostModel:
    """Kernel-level costs of single transformer ops on one device.

    Args:
        device: a ``collsim.cluster.hardware.Device`` (anything with name, peak_flops_for(dtype),
            matmul_efficiency and memory_bandwidth_bps; the other Device fields are optional).
        dtype: ``bf16``, ``fp16``, ``fp32`` or ``fp8`` (GEMM dtype; activations 16-bit for fp8).
        overrides: measured times by op name; ``name`` sets the forward (and recompute) time
            of that op, ``name.backward`` its backward time, in seconds.
        launch_s: fixed cost per kernel (launch and tail), seconds (a measured profile's
            ``launch_us`` replaces the default).
        memory_efficiency: a constant achievable fraction of the HBM bandwidth; None (default):
            the access-size curve (or the profile's measured bandwidths).
        num_sms: SM count for wave quantization (default: the device's ``sm_count``).
        attention_kernel: ``flash2``, ``flash3``, ``cudnn``, ``triton`` or ``eager``; None:
            the spec's ``flash_attention`` flag picks the generation's fused kernel or eager.
        execution: ``eager``, ``compiled`` or ``cuda_graphs`` (host issue cost per kernel).
        fused_kernels: hand-fused norm / bias-dropout-add / softmax kernels (Megatron, TE,
            apex, or a compiler); False: PyTorch eager op by op (:data:`EAGER_PASSES`).
        causal: causal attention (the fused kernels compute the lower triangle only).
        fp8_casts: with ``dtype: fp8``, how Transformer Engine quantizes around its FP8
            linears (:class:`~collsim.workload.fp8.FP8Casts`: experts and MLA projections in
            FP8, weight casts per step, fused norm quantization); None: torchao's tensorwise
            casts of every input and weight in every micro-batch (:func:`fp8_cast_bytes`).
    """

    def __init__(
        self,
        device: DeviceLike,
        dtype: str = "bf16",
        *,
        overrides: dict[str, float] | None = None,
        launch_s: float | None = None,
        memory_efficiency: float | None = None,
        num_sms: int | None = None,
        attention_kernel: str | None = None,
        execution: str = "eager",
        fused_kernels: bool = True,
        causal: bool = True,
        fp8_casts: FP8Casts | None = None,
    ) -> None:
        self.device = device
        self.fp8_casts = fp8_casts
        self._fp8_ops = FP8_LINEAR_OPS if fp8_casts is None else TE_FP8_OPS
        self.dtype: str = parse_enum(Dtype, dtype, key_path="training.dtype").value
        if memory_efficiency is not None and not 0 < memory_efficiency <= 1:
            raise ConfigError(
                f"must be in (0, 1], got {memory_efficiency}", key_path="memory_efficiency"
            )
        self.measured: Any = getattr(device, "measured", None)
        if launch_s is None:
            measured_launch = getattr(self.measured, "launch_us", None)
            launch_s = measured_launch * 1e-6 if measured_launch is not None else 4e-6
        if launch_s < 0:
            raise ConfigError(f"must be >= 0, got {launch_s}", key_path="launch_s")
        if attention_kernel is not None and str(attention_kernel) not in ATTENTION_KERNELS:
            raise ConfigError(
                f"must be one of {', '.join(ATTENTION_KERNELS)}; got {attention_kernel!r}",
                key_path="training.attention_kernel",
            )
        if str(execution) not in EXECUTIONS:
            raise ConfigError(
                f"must be one of {', '.join(EXECUTIONS)}; got {execution!r}",
                key_path="training.execution",
            )
        self.overrides = dict(overrides or {})
        for key, value in self.overrides.items():
            base = key.removesuffix(".backward")
            if base not in OP_NAMES:
                raise ConfigError(
                    f"unknown op {base!r}; valid ops: {', '.join(OP_NAMES)} "
                    f"(add .backward for the backward time)",
                    key_path=f"op_time_overrides.{key}",
                )
            if value < 0:
                raise ConfigError(
                    f"must be >= 0 seconds, got {value}", key_path=f"op_time_overrides.{key}"
                )
        self.launch_s = launch_s
        self.attention_kernel = None if attention_kernel is None else str(attention_kernel)
        self.execution = str(execution)
        self.fused_kernels = bool(fused_kernels)
        self.causal = bool(causal)
        measured_host = getattr(self.measured, "host_us", None)
        self.host_s = (
            measured_host * 1e-6
            if measured_host is not None and self.execution == "eager"
            else HOST_OVERHEAD_S[self.execution]
        )
        self.generation = str(getattr(device, "generation", "generic"))
        self.num_sms = num_sms if num_sms is not None else _sm_count(device)
        self.clock = float(getattr(device, "sustained_clock_fraction", 1.0))
        self.matmul_peak_flops = self._mamf(self.dtype) * self.clock
        self._mamf16 = self._mamf("fp16" if self.dtype == "fp16" else "bf16") * self.clock
        try:
            self.vector_peak_flops = device.peak_flops_for("fp32")
        except ConfigError:  # a device without an fp32 entry
            self.vector_peak_flops = device.peak_flops_for(self.dtype)
        self.memory_efficiency = memory_efficiency
        self.bandwidth_bps = device.memory_bandwidth_bps * (memory_efficiency or 0.9)
        """The large-access bandwidth (0.9 x HBM by default)."""

    # ---- rates -----------------------------------------------------------------------------
    def _mamf(self, dtype: str) -> float:
        mamf_for = getattr(self.device, "mamf_for", None)
        if mamf_for is not None:
            return float(mamf_for(dtype))
        return self.device.peak_flops_for(dtype) * self.device.matmul_efficiency

    def _peak(self, dtype: str) -> float:
        return self.device.peak_flops_for(dtype)

    def memory_bandwidth_at(self, size_bytes: float) -> float:
        """Achievable bytes/s of one memory-bound kernel moving ``size_bytes``."""
        if self.memory_efficiency is not None:
            return self.device.memory_bandwidth_bps * self.memory_efficiency
        if self.measured is not None:
            measured = self.measured.bandwidth_bps(size_bytes)
            if measured is not None:
                return float(measured)
        return self.device.memory_bandwidth_bps * hbm_efficiency(size_bytes)

    def memory_time_s(self, size_bytes: float, kernels: int = 1) -> float:
        """Time of ``kernels`` memory-bound kernels moving ``size_bytes`` in all: bytes at the
        per-kernel access size's bandwidth + launch floor, each at least its host cost."""
        if size_bytes <= 0:
            return 0.0
        per = size_bytes / kernels
        device_s = per / self.memory_bandwidth_at(per) + self.launch_s
        return kernels * max(device_s, self.host_s)

    def _kernel(self, device_s: float) -> tuple[float, bool]:
        """(time, host-bound) of one kernel whose device time is ``device_s``.

        An accelerator runs its kernels asynchronously behind the host, so only the longer of
        the two shows (max); a CPU device computes on the thread that issues the op, so the
        host cost adds (sum)."""
        if self.generation == "cpu":
            return device_s + self.host_s, False
        if self.host_s > device_s:
            return self.host_s, True
        return device_s, False

    # ---- one kernel / one op -------------------------------------------------------------
    def gemm_time_s(self, gemm: Gemm, dtype: str | None = None) -> tuple[float, str, float]:
        """(time_s, bound, achieved fraction of peak) of one GEMM kernel (any batch)."""
        dt = self.dtype if dtype is None else dtype
        rate = self.matmul_peak_flops if dt == self.dtype else self._mamf(dt) * self.clock
        eff = shape_efficiency(gemm, self.num_sms)
        achievable = rate * eff
        if self.measured is not None:
            measured = self.measured.gemm_rate(gemm.m, gemm.n, gemm.k, dt)
            if measured is not None:
                achievable = float(measured)
        compute = gemm.flops / achievable
        size = gemm.bytes(Dtype(dt).size_bytes)
        memory = size / self.memory_bandwidth_at(size)
        time, host = self._kernel(max(compute, memory) + self.launch_s)
        bound = "host" if host else ("compute" if compute >= memory else "memory")
        return time, bound, gemm.flops / time / self._peak(dt)

    def op_cost(self, op: Op, phase: str) -> OpCost:
        """Cost of ``op`` in ``phase`` (forward, backward or recompute)."""
        backward = phase == "backward"
        flops = op.backward_flops if backward else op.flops
        size = op.backward_bytes if backward else op.size_bytes
        key = f"{op.name}.backward" if backward else op.name
        if key in self.overrides:
            return OpCost(
                name=op.name,
                phase=phase,
                kind=op.kind,
                flops=flops,
                size_bytes=size,
                time_s=self.overrides[key],
                bound="override",
            )
        if op.kind is OpKind.MATMUL:
            return self._matmul_cost(op, phase, flops, size, backward)
        if op.kind is OpKind.FUSED_ATTENTION:
            return self._flash_cost(op, phase, flops, size)
        moved = size * self._eager_passes(op.name)
        memory_s = moved / self.memory_bandwidth_at(moved)
        measured_s = self._measured_activation_s(op, phase)
        if measured_s is None:
            compute_s = flops / self.vector_peak_flops
            device_s, reported = max(compute_s, memory_s), moved
        else:  # a profile's time of the activation holds its memory traffic and its math
            compute_s, device_s, reported = measured_s, measured_s, size
        kernels = op.backward_kernels if backward else op.kernels
        if kernels > 1:  # a chain of eager kernels, each with its launch (and host floor)
            per, host = self._kernel(device_s / kernels + self.launch_s)
            time = per * kernels
        else:
            time, host = self._kernel(device_s + self.launch_s)
        return OpCost(
            name=op.name,
            phase=phase,
            kind=op.kind,
            flops=flops,
            size_bytes=reported,
            time_s=time,
            bound="host" if host else ("compute" if compute_s > memory_s else "memory"),
        )

    def _matmul_cost(self, op: Op, phase: str, flops: float, size: float, backward: bool) -> OpCost:
        gemms = op.backward_gemms if backward else op.gemms
        fp8 = self.dtype == "fp8" and op.name in self._fp8_ops
        dtype = self.dtype if fp8 or self.dtype != "fp8" else "bf16"
        time, bound = 0.0, "compute"
        last = 0.0
        for gemm in gemms:
            t, b, _ = self.gemm_time_s(gemm, dtype)
            time += t
            last = t
            bound = b if b != "compute" else bound
        share = last / time if backward and op.weight_gradient and time > 0 else 0.0
        # The op's own byte count (e.g. 16-bit score matrices) is a floor too.
        floor = size / self.memory_bandwidth_at(size) + self.launch_s * len(gemms)
        if floor > time:
            time, bound = floor, "memory"
        if fp8:
            time += self._cast_s(op, backward)
        peak = self._peak(dtype)
        return OpCost(
            name=op.name,
            phase=phase,
            kind=op.kind,
            flops=flops,
            size_bytes=size,
            time_s=time,
            bound=bound,
            matmul_efficiency=flops / time / peak,
            wgrad_s=time * share,
        )

    def _cast_s(self, op: Op, backward: bool) -> float:
        """Seconds of the FP8 casts around one linear in one phase of one micro-batch
        (:func:`fp8_cast_bytes`, or Transformer Engine's :func:`linear_cast_bytes`: one
        kernel per quantized tensor, and an amax kernel before each under current scaling)."""
        g = op.gemms[0]
        casts = self.fp8_casts
        if casts is None:
            fwd_bytes, bwd_bytes = fp8_cast_bytes(g.m, g.n, g.k, g.batch)
            kernels = FP8_CAST_KERNELS[1] if backward else FP8_CAST_KERNELS[0]
            return self.memory_time_s(bwd_bytes if backward else fwd_bytes, kernels)
        shape = LinearShape(op.name, g.m, g.n, g.k, g.batch)
        fwd_bytes, bwd_bytes = linear_cast_bytes(shape, casts)
        per = 2 if casts.recipe == "tensorwise" else 1
        weights = not (casts.weight_cache or casts.param_gather)
        kernels = per if backward else per * (2 if weights else 1)
        return self.memory_time_s(bwd_bytes if backward else fwd_bytes, kernels)

    def _measured_activation_s(self, op: Op, phase: str) -> float | None:
        """A CPU profile's measured time of the dense MLP activation ``op`` (GELU, or SwiGLU
        for a gated MLP, as eager PyTorch runs them) in ``phase``; None elsewhere (then bytes /
        bandwidth against flops / vector peak, as for any element-wise op): on an accelerator
        the activation is fused or memory-bound, MoE experts run one kernel each, and the
        profile's grid stops at 4 Mi elements."""
        if (
            self.generation != "cpu"
            or op.name != "activation"
            or not getattr(self.measured, "activation", ())
        ):
            return None
        kind = "swiglu" if self._gated else "gelu"
        elements = op.flops / FLOPS_PER_ELEMENT[kind]
        out: float | None = self.measured.activation_time_s(
            kind, elements, "backward" if phase == "backward" else "forward"
        )
        return out

    def _eager_passes(self, name: str) -> float:
        if self.fused_kernels:
            return 1.0
        if name in _NORM_OPS:
            return EAGER_PASSES["rmsnorm"] if self._norm == "rmsnorm" else 1.0
        if name == "rotary":
            return EAGER_PASSES["rotary"]
        if name == "activation":
            return EAGER_PASSES["swiglu"] if self._gated else 1.0
        if name.endswith("_dropout_add"):
            return EAGER_PASSES["dropout_add"]
        if name in ("loss", "softmax"):
            return EAGER_PASSES[name]
        return 1.0

    _norm = "layernorm"
    _gated = False

    def attention_rate_flops(
        self, phase: str, *, head_dim: int, seq_len: int, causal: bool | None = None
    ) -> float | None:
        """FLOP/s of this model's fused attention kernel in ``phase`` (``fwd``/``bwd``) at full
        waves, sustained clock applied (``causal``: the call's mask, None the model's); None
        where neither a profile nor a table covers it."""
        kernel = self._kernel_name(True)
        masked = self.causal if causal is None else causal
        if self.measured is not None:
            rate = self.measured.attention_rate(
                kernel, phase, causal=masked, head_dim=head_dim, seq_len=seq_len
            )
            if rate is not None:
                return float(rate)
        rate = attention_rate_flops(
            self.generation, kernel, phase, causal=masked, head_dim=head_dim, seq_len=seq_len
        )
        return None if rate is None else rate * self.clock

    def _kernel_name(self, fused: bool) -> str:
        if self.attention_kernel is not None and self.attention_kernel != "eager":
            return self.attention_kernel
        return default_attention_kernel(self.generation, fused)

    def _flash_cost(self, op: Op, phase: str, flops: float, size: float) -> OpCost:
        """Fused attention: the kernel table's rate x the wave ratio of its CTAs (one CTA per
        128 queries of one head: ``ctas = batch * heads * ceil(s / 128)``, in waves of
        ``num_sms``), or the generic share of MAMF where no table covers the device."""
        gemm = op.gemms[0]
        ctas = gemm.batch * math.ceil(gemm.m / TILE)
        wave_eff = ctas / (math.ceil(ctas / self.num_sms) * self.num_sms)
        table_wave = TABLE_CTAS / (math.ceil(TABLE_CTAS / self.num_sms) * self.num_sms)
        key = "bwd" if phase == "backward" else "fwd"
        rate = self.attention_rate_flops(key, head_dim=gemm.k, seq_len=gemm.m, causal=op.causal)
        if rate is not None:
            compute = flops / (rate * wave_eff / table_wave)
            memory = 0.0
        else:
            share = FLASH_BACKWARD_EFFICIENCY if phase == "backward" else FLASH_FORWARD_EFFICIENCY
            compute = flops / (self._mamf16 * share * wave_eff)
            memory = size / self.memory_bandwidth_at(size)
        time, host = self._kernel(max(compute, memory) + self.launch_s)
        peak = self._peak("fp16" if self.dtype == "fp16" else "bf16")
        return OpCost(
            name=op.name,
            phase=phase,
            kind=op.kind,
            flops=flops,
            size_bytes=size,
            time_s=time,
            bound="host" if host else ("compute" if compute >= memory else "memory"),
            matmul_efficiency=flops / time / peak,
        )
