"""Overlapped tensor parallelism: how Transformer Engine's userbuffers and torch's AsyncTP
split the sequence-parallel all-gathers and reduce-scatters into chunks under the GEMMs.

The chunking, the SMs the communication holds and the closed form of one overlapped GEMM are
derived in docs/tp_overlap.md; :mod:`collsim.step.comm_overlap` writes them into the step
program (:func:`collsim.step.comm_overlap.overlap_tp`) so that both interpreters price them.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from collsim.core.errors import ConfigError

__all__ = [
    "TP_OVERLAP_MODES",
    "Chunking",
    "USERBUFFERS",
    "ASYNC_TP",
    "tp_overlap_of",
    "check_tp_overlap",
    "margin_factor",
    "ring_gather_s",
    "ring_scatter_s",
    "pipelined_scatter_s",
]

TP_OVERLAP_MODES = ("none", "userbuffers", "async_tp")
"""``parallel.tp_overlap`` values (true: the stack's, false: ``none``)."""


@dataclass(frozen=True, slots=True)
class Chunking:
    """How one overlapped GEMM and its collective are cut (docs/tp_overlap.md).

    Attributes:
        method: ``ring`` (a point-to-point ring: ``chunks = tp`` steps, the local chunk
            first), ``pipeline`` (``chunks`` reduce-scatters, each after its GEMM piece) or
            ``bulk`` (the whole collective beside another whole GEMM).
        chunks: pieces of the GEMM (0: the tensor-parallel size).
        sms: SMs the communication kernels hold.
        sm_margin: the GEMM runs on ``sm_count - sms`` SMs for its whole length (TE's
            ``set_sm_margin``); else only while the communication runs is it slowed.
    """

    method: str
    chunks: int
    sms: int
    sm_margin: bool


USERBUFFERS: dict[str, Chunking] = {
    "fprop_ag": Chunking("ring", 0, 1, False),
    "fprop_rs": Chunking("pipeline", 4, 16, True),
    "dgrad_ag": Chunking("ring", 0, 1, False),
    "dgrad_bulk_ag": Chunking("bulk", 1, 16, True),
    "wgrad_bulk_rs": Chunking("bulk", 1, 16, True),
}
"""Transformer Engine's defaults (``initialize_ub``, transformer_engine/pytorch/module/base.py
at d0067d0, TE 2.20.0.dev0): ``ring_exchange`` for qkv_fprop, fc1_fprop, proj_dgrad and
fc2_dgrad (1 SM, copy engine, num_splits = tp, no SM margin); ``pipeline`` for proj_fprop and
fc2_fprop (16 SMs, 4 splits, SM margin); ``bulk`` for qkv/fc1 dgrad (the all-gather of the
norm output the wgrad needs) and qkv/fc1 wgrad (the reduce-scatter of the dgrad output), 16
SMs with SM margin."""

ASYNC_TP: dict[str, Chunking] = {
    "fprop_ag": Chunking("ring", 0, 0, False),
    "fprop_rs": Chunking("ring", 0, 0, False),
    "dgrad_ag": Chunking("ring", 0, 0, False),
    "dgrad_rs": Chunking("ring", 0, 0, False),
}
"""torch's AsyncTP (inductor's micro-pipeline TP pass, ``_fused_all_gather_matmul`` and
``_fused_matmul_reduce_scatter`` over symmetric memory; torchtitan ``enable_async_tensor_parallel``,
torchtitan/config/configs.py at b5bcd76): every all-gather -> matmul and matmul ->
reduce-scatter of the compiled graph, forward and backward, cut into tp chunks moved by the
copy engines (no SMs held). The gathered input is kept for the wgrad (no re-gather)."""


def tp_overlap_of(mode: str, stack: str | None) -> str:
    """The overlap a plan runs: ``none``, ``userbuffers`` or ``async_tp``; ``true`` (read as
    ``stack``) is AsyncTP under ``torchtitan`` and userbuffers otherwise."""
    if mode == "stack":
        return "async_tp" if stack == "torchtitan" else "userbuffers"
    return mode


def check_tp_overlap(
    mode: str, *, tp: int, sequence_parallel: bool, execution: str | None = None
) -> None:
    """The plan rules of overlapped TP.

    Raises:
        ConfigError: overlap without sequence parallelism (Megatron-LM arguments.py l.1441 at
            d98e8a6: "Tensor parallel communication/GEMM overlap can happen only when sequence
            parallelism is enabled"), or AsyncTP without torch.compile (torchtitan configs.py
            ``CompileConfig.__post_init__`` at b5bcd76).
    """
    if mode == "none":
        return
    if tp < 2 or not sequence_parallel:
        raise ConfigError(
            f"tp_overlap {mode} needs sequence_parallel: true with tp > 1, got tp {tp}, "
            f"sequence_parallel {str(sequence_parallel).lower()}",
            key_path="parallel.tp_overlap",
        )
    if mode == "async_tp" and execution is not None and execution != "compiled":
        raise ConfigError(
            f"tp_overlap async_tp needs training.execution: compiled (AsyncTP is an inductor "
            f"pass), got {execution}",
            key_path="parallel.tp_overlap",
        )


def margin_factor(device: Any, sms: int) -> float:
    """Factor on a GEMM that runs on ``sm_count - sms`` SMs: ``sm / (sm - sms)`` (the SM term
    of :func:`collsim.workload.interference.overlap_slowdown`)."""
    count = int(getattr(device, "sm_count", None) or 108)
    if sms <= 0:
        return 1.0
    return count / max(1, count - sms)


def ring_gather_s(gemm_s: float, step_s: float, chunks: int, factor: float = 1.0) -> float:
    """Closed form of a ring all-gather under its GEMM in ``chunks`` pieces: ``chunks - 1``
    point-to-point steps of ``step_s``, each beside one GEMM piece of ``gemm_s / chunks``
    (slowed ``factor`` while the step runs), then the last piece alone::

        (n - 1) x (t + max(0, g / n - t / f)) + g / n
    """
    piece = gemm_s / chunks
    return (chunks - 1) * (step_s + max(0.0, piece - step_s / factor)) + piece


def ring_scatter_s(gemm_s: float, step_s: float, chunks: int, factor: float = 1.0) -> float:
    """Closed form of a ring reduce-scatter after its GEMM pieces: the first piece alone, then
    ``chunks - 1`` steps each sending the previous partial beside the next piece (the rank's
    own piece is computed last and not sent)::

        g / n + (n - 1) x (t + max(0, g / n - t / f))
    """
    return ring_gather_s(gemm_s, step_s, chunks, factor)


def pipelined_scatter_s(gemm_s: float, chunk_s: float, chunks: int, margin: float) -> float:
    """Closed form of TE's pipelined GEMM + reduce-scatter: the GEMM on fewer SMs
    (``margin``), the reduce-scatter of piece i beside piece i + 1, the last one exposed::

        g' / n + (n - 1) x max(c, g' / n) + c,    g' = margin x g
    """
    piece = margin * gemm_s / chunks
    return piece + (chunks - 1) * max(chunk_s, piece) + chunk_s
