"""Compute-time model: a roofline per op with a shape-dependent matmul efficiency.

For every op (see :mod:`collsim.workload.ops`)::

    time_s = max(flops / achievable_flops, size_bytes / achievable_bandwidth) + launch_s

per kernel (a matmul's backward is two GEMM kernels). The rates:

- achievable matmul FLOP/s = peak(dtype) x device.matmul_efficiency (MAMF / peak: the best-shape
  rate measured by the ml-engineering "maximum achievable matmul FLOPS" benchmark, see
  reference/hardware.yaml) x shape_efficiency(GEMM);
- achievable memory bandwidth = HBM bandwidth x ``memory_efficiency`` (default 0.85: streaming
  kernels such as BabelStream reach 80-90 % of the datasheet HBM bandwidth on A100/H100);
- element-wise FLOPs run at the fp32 (non-tensor-core) peak when the device lists one.

Shape efficiency of a GEMM C[m, n] = A[m, k] B[k, n] (batch of them), after NVIDIA's
"Matrix Multiplication Background User's Guide" (Deep Learning Performance documentation,
sections on tile quantization and wave quantization)::

    tiles      = batch * ceil(m / 128) * ceil(n / 128)          # 128 x 128 output tiles
    tile_eff   = m * n / (ceil(m / 128) * 128 * ceil(n / 128) * 128)
    wave_eff   = tiles / (ceil(tiles / num_sms) * num_sms)       # last wave partly idle
    k_eff      = k / (k + 128)                                   # per-tile prologue/epilogue
    shape_efficiency = tile_eff * wave_eff * k_eff

The k term charges each output tile a fixed cost equal to 128 elements of the reduction
dimension (filling the multistage shared-memory pipeline and writing the tile back), so thin
GEMMs with a short reduction (attention with head_dim 64-128, small micro-batch wgrads) fall
below MAMF while large square GEMMs stay within 2 % of it. This is our modelling assumption, not
a measured curve; per-op ``overrides`` replace any modelled time with a measured one.

Fused (Flash) attention runs at a fixed share of MAMF (:data:`FLASH_FORWARD_EFFICIENCY`,
:data:`FLASH_BACKWARD_EFFICIENCY`) times the wave efficiency of its thread blocks.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Protocol

from collsim.errors import ConfigError
from collsim.workload.model import TransformerSpec
from collsim.workload.ops import (
    OP_NAMES,
    SELECTIVE_OPS,
    Gemm,
    Op,
    OpKind,
    RecomputeMode,
    embedding_ops,
    head_ops,
    kept_bytes,
    layer_ops,
    parse_recompute,
)

__all__ = [
    "DeviceLike",
    "OpCost",
    "LayerTimes",
    "ComputeModel",
    "shape_efficiency",
    "optimizer_bytes_per_param",
    "SM_COUNTS",
]

TILE = 128
K_OVERHEAD = 128

FLASH_FORWARD_EFFICIENCY = 0.84
"""FlashAttention-2 forward rate over MAMF: Dao 2023 reports up to 73 % of the A100 peak
(head_dim 128, long sequences), i.e. 0.73 / 0.869 of the A100 MAMF."""
FLASH_BACKWARD_EFFICIENCY = 0.72
"""FlashAttention-2 backward rate over MAMF: up to 63 % of the A100 peak (Dao 2023)."""

SM_COUNTS: dict[str, int] = {
    "a100": 108,
    "h100": 132,
    "h200": 132,
    "gh200": 132,
    "b200": 148,
    "b300": 148,
    "gb200": 148,
    "mi300x": 304,
    "v100": 80,
    "h100 pcie": 114,
    "generic cpu": 32,
}
"""Streaming multiprocessors (compute units) per GPU, by lower-case name prefix (datasheets);
for the generic CPU, its 32 cores."""
_DEFAULT_SMS = 108
_GEMM_BYTES = {"bf16": 2, "fp16": 2, "fp32": 4, "fp8": 1}


class DeviceLike(Protocol):
    """What the compute model needs from ``collsim.hardware.Device``."""

    @property
    def name(self) -> str: ...
    @property
    def matmul_efficiency(self) -> float: ...
    @property
    def memory_bandwidth_bps(self) -> float: ...

    def peak_flops_for(self, dtype: str) -> float: ...


def _sm_count(name: str) -> int:
    key = name.lower()
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


def optimizer_bytes_per_param(optimizer: str, dtype: str) -> float:
    """HBM bytes one optimizer step moves per parameter.

    Adam, mixed precision (Megatron: fp32 master weights and fp32 main gradients): read master 4,
    grad 4, m 4, v 4; write master 4, m 4, v 4 and the 16-bit model copy 2 = 30 bytes.
    Adam, fp32: read param, grad, m, v (16); write param, m, v (12) = 28 bytes.
    SGD with momentum: mixed 22 (read 12, write 4 + 4 + 2), fp32 20 (read 12, write 8).
    """
    opt = str(optimizer).lower()
    mixed = str(dtype).lower() != "fp32"
    table = {("adam", True): 30.0, ("adam", False): 28.0, ("sgd", True): 22.0, ("sgd", False): 20.0}
    if (opt, mixed) not in table:
        raise ConfigError(
            f"must be one of adam, sgd; got {optimizer!r}", key_path="training.optimizer"
        )
    return table[(opt, mixed)]


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
    """``compute``, ``memory`` or ``override`` (a measured time replaced the model)."""
    matmul_efficiency: float = 0.0
    """Achieved fraction of the dtype's peak FLOP/s (matmuls; 0 for element-wise ops)."""


@dataclass(frozen=True, slots=True, kw_only=True)
class LayerTimes:
    """Times of one layer (or the embedding / head) on one rank for one micro-batch.

    ``backward_s`` excludes recomputation; the backward pass of a step costs
    ``backward_s + recompute_s`` (the recomputed forward runs just before the backward).
    ComputeModel memoizes these per argument set: treat them as read-only.
    """

    forward_s: float
    backward_s: float
    recompute_s: float
    ops: tuple[OpCost, ...] = ()
    activation_bytes: float = 0.0
    """Bytes kept from forward to backward (Korthikanti's per-layer activation memory)."""
    transient_bytes: float = 0.0
    """Extra bytes rebuilt during the backward of this layer when it recomputes (0 otherwise)."""
    forward_flops: float = 0.0
    backward_flops: float = 0.0
    recompute_flops: float = 0.0


class ComputeModel:
    """Roofline compute times of transformer ops on one device.

    Args:
        device: a ``collsim.hardware.Device`` (anything with name, peak_flops_for(dtype),
            matmul_efficiency and memory_bandwidth_bps).
        dtype: ``bf16``, ``fp16``, ``fp32`` or ``fp8`` (GEMM dtype; activations 16-bit for fp8).
        overrides: measured times by op name; ``name`` sets the forward (and recompute) time
            of that op, ``name.backward`` its backward time, in seconds.
        launch_s: fixed cost per kernel (launch and tail), seconds.
        memory_efficiency: achievable fraction of the HBM bandwidth.
        num_sms: SM count for wave quantization (default: from the device name, else 108).

    Example:
        >>> model = ComputeModel(get_device("a100"), "bf16")            # doctest: +SKIP
        >>> model.layer_times(get_preset("megatron-22b"), micro_batch=4, tp=8).forward_s
    """

    def __init__(
        self,
        device: DeviceLike,
        dtype: str = "bf16",
        *,
        overrides: dict[str, float] | None = None,
        launch_s: float = 4e-6,
        memory_efficiency: float = 0.85,
        num_sms: int | None = None,
    ) -> None:
        self.device = device
        self.dtype = str(dtype).lower()
        if self.dtype not in ("bf16", "fp16", "fp32", "fp8"):
            raise ConfigError(
                f"must be one of bf16, fp16, fp32, fp8; got {dtype!r}", key_path="training.dtype"
            )
        if not 0 < memory_efficiency <= 1:
            raise ConfigError(
                f"must be in (0, 1], got {memory_efficiency}", key_path="memory_efficiency"
            )
        if launch_s < 0:
            raise ConfigError(f"must be >= 0, got {launch_s}", key_path="launch_s")
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
        self.num_sms = num_sms if num_sms is not None else _sm_count(device.name)
        self.matmul_peak_flops = device.peak_flops_for(self.dtype) * device.matmul_efficiency
        try:
            self.vector_peak_flops = device.peak_flops_for("fp32")
        except ConfigError:  # a device without an fp32 entry
            self.vector_peak_flops = device.peak_flops_for(self.dtype)
        self.bandwidth_bps = device.memory_bandwidth_bps * memory_efficiency
        self._memo: dict[tuple[object, ...], LayerTimes] = {}

    # ---- one kernel / one op -------------------------------------------------------------
    def gemm_time_s(self, gemm: Gemm) -> tuple[float, str, float]:
        """(time_s, bound, achieved fraction of peak) of one GEMM kernel (any batch)."""
        eff = shape_efficiency(gemm, self.num_sms)
        compute = gemm.flops / (self.matmul_peak_flops * eff)
        memory = gemm.bytes(_GEMM_BYTES[self.dtype]) / self.bandwidth_bps
        time = max(compute, memory) + self.launch_s
        peak = self.matmul_peak_flops / self.device.matmul_efficiency
        return time, ("compute" if compute >= memory else "memory"), gemm.flops / time / peak

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
            gemms = op.backward_gemms if backward else op.gemms
            time, bound = 0.0, "compute"
            for gemm in gemms:
                t, b, _ = self.gemm_time_s(gemm)
                time += t
                bound = "memory" if b == "memory" else bound
            # The op's own byte count (e.g. 16-bit score matrices under fp8) is a floor too.
            floor = size / self.bandwidth_bps + self.launch_s * len(gemms)
            if floor > time:
                time, bound = floor, "memory"
            peak = self.matmul_peak_flops / self.device.matmul_efficiency
            return OpCost(
                name=op.name,
                phase=phase,
                kind=op.kind,
                flops=flops,
                size_bytes=size,
                time_s=time,
                bound=bound,
                matmul_efficiency=flops / time / peak,
            )
        if op.kind is OpKind.FUSED_ATTENTION:
            return self._flash_cost(op, phase, flops, size)
        compute = flops / self.vector_peak_flops
        memory = size / self.bandwidth_bps
        return OpCost(
            name=op.name,
            phase=phase,
            kind=op.kind,
            flops=flops,
            size_bytes=size,
            time_s=max(compute, memory) + self.launch_s,
            bound="compute" if compute > memory else "memory",
        )

    def _flash_cost(self, op: Op, phase: str, flops: float, size: float) -> OpCost:
        """FlashAttention: a fixed share of MAMF, times the wave efficiency of its CTAs.

        One CTA per 128 queries of one head (FlashAttention-2 parallelises over batch, heads
        and query blocks), so ``ctas = batch * heads * ceil(s / 128)`` fill ``num_sms`` slots
        in waves as a GEMM's tiles do.
        """
        gemm = op.gemms[0]
        ctas = gemm.batch * math.ceil(gemm.m / TILE)
        wave_eff = ctas / (math.ceil(ctas / self.num_sms) * self.num_sms)
        share = FLASH_BACKWARD_EFFICIENCY if phase == "backward" else FLASH_FORWARD_EFFICIENCY
        compute = flops / (self.matmul_peak_flops * share * wave_eff)
        memory = size / self.bandwidth_bps
        time = max(compute, memory) + self.launch_s
        peak = self.matmul_peak_flops / self.device.matmul_efficiency
        return OpCost(
            name=op.name,
            phase=phase,
            kind=op.kind,
            flops=flops,
            size_bytes=size,
            time_s=time,
            bound="compute" if compute >= memory else "memory",
            matmul_efficiency=flops / time / peak,
        )

    # ---- whole blocks ----------------------------------------------------------------------
    def _times(self, ops: list[Op], recompute: RecomputeMode, layer: bool) -> LayerTimes:
        costs: list[OpCost] = []
        forward = backward = again = 0.0
        fwd_flops = bwd_flops = re_flops = 0.0
        for op in ops:
            fc = self.op_cost(op, "forward")
            bc = self.op_cost(op, "backward")
            costs += [fc, bc]
            forward += fc.time_s
            backward += bc.time_s
            fwd_flops += op.flops
            bwd_flops += op.backward_flops
            if recompute is RecomputeMode.FULL or (
                recompute is RecomputeMode.SELECTIVE and op.name in SELECTIVE_OPS
            ):
                rc = OpCost(
                    name=fc.name,
                    phase="recompute",
                    kind=fc.kind,
                    flops=fc.flops,
                    size_bytes=fc.size_bytes,
                    time_s=fc.time_s,
                    bound=fc.bound,
                    matmul_efficiency=fc.matmul_efficiency,
                )
                costs.append(rc)
                again += rc.time_s
                re_flops += op.flops
        kept, transient = (
            kept_bytes(ops, recompute) if layer else (float(sum(op.saved_bytes for op in ops)), 0.0)
        )
        return LayerTimes(
            forward_s=forward,
            backward_s=backward,
            recompute_s=again,
            ops=tuple(costs),
            activation_bytes=kept,
            transient_bytes=transient,
            forward_flops=fwd_flops,
            backward_flops=bwd_flops,
            recompute_flops=re_flops,
        )

    def layer_times(
        self,
        spec: TransformerSpec,
        *,
        micro_batch: int,
        tp: int = 1,
        sequence_parallel: bool = False,
        recompute: str = "none",
        layer: int | None = None,
        ep: int = 1,
        etp: int = 1,
        cp: int = 1,
    ) -> LayerTimes:
        """Forward, backward and recompute times of ONE transformer layer on one rank.

        Excludes tensor-parallel communication (2 all-reduces forward and 2 backward, or their
        reduce-scatter + all-gather halves with SP): the engine schedules those.

        Args:
            spec: the model.
            micro_batch: sequences per micro-batch.
            tp: tensor-parallel size.
            sequence_parallel: Megatron sequence parallelism.
            recompute: ``none``, ``selective`` (core attention) or ``full`` (whole layer).
            layer, ep, etp, cp: which layer (its kind: dense / MoE, full / windowed
                attention; None the most common) and the expert / context split, passed to
                :func:`collsim.workload.ops.layer_ops`.
        """
        mode = parse_recompute(recompute)
        key = ("layer", spec, micro_batch, tp, bool(sequence_parallel), mode, layer, ep, etp, cp)
        if key not in self._memo:
            ops = layer_ops(
                spec,
                micro_batch=micro_batch,
                tp=tp,
                sequence_parallel=sequence_parallel,
                dtype=self.dtype,
                layer=layer,
                ep=ep,
                etp=etp,
                cp=cp,
            )
            self._memo[key] = self._times(ops, mode, layer=True)
        return self._memo[key]

    def embedding_times(
        self,
        spec: TransformerSpec,
        *,
        micro_batch: int,
        tp: int = 1,
        sequence_parallel: bool = False,
    ) -> LayerTimes:
        """Input embedding (lookup, position add, dropout) on one rank; never recomputed."""
        key = ("embedding", spec, micro_batch, tp, bool(sequence_parallel))
        if key not in self._memo:
            ops = embedding_ops(
                spec,
                micro_batch=micro_batch,
                tp=tp,
                sequence_parallel=sequence_parallel,
                dtype=self.dtype,
            )
            self._memo[key] = self._times(ops, RecomputeMode.NONE, layer=False)
        return self._memo[key]

    def head_times(
        self,
        spec: TransformerSpec,
        *,
        micro_batch: int,
        tp: int = 1,
        sequence_parallel: bool = False,
    ) -> LayerTimes:
        """Final norm, LM head and cross-entropy loss on one rank; never recomputed."""
        key = ("head", spec, micro_batch, tp, bool(sequence_parallel))
        if key not in self._memo:
            ops = head_ops(
                spec,
                micro_batch=micro_batch,
                tp=tp,
                sequence_parallel=sequence_parallel,
                dtype=self.dtype,
            )
            self._memo[key] = self._times(ops, RecomputeMode.NONE, layer=False)
        return self._memo[key]

    def optimizer_time_s(self, num_params_local: float, optimizer: str = "adam") -> float:
        """Time of one optimizer step over ``num_params_local`` parameters: bytes / bandwidth.

        Bytes per parameter from :func:`optimizer_bytes_per_param` (fused multi-tensor kernels,
        memory bound; the launch cost is charged once).
        """
        if num_params_local < 0:
            raise ConfigError(f"must be >= 0, got {num_params_local}", key_path="num_params")
        if num_params_local == 0:
            return 0.0
        per_param = optimizer_bytes_per_param(optimizer, self.dtype)
        return num_params_local * per_param / self.bandwidth_bps + self.launch_s
