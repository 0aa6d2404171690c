"""The rules a parallel plan must meet beyond its sizes: the layer split over the pipeline
chunks, and what experts, context parallelism, overlapped expert dispatch and sharded data
parallelism ask of the model and of each other (each rule names the scenario key it checks).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from collsim.core.errors import ConfigError
from collsim.parallel.config import ParallelConfig, TrainingConfig
from collsim.workload.memory import balanced_chunk_layers
from collsim.workload.torch_cp import is_torch_cp

if TYPE_CHECKING:
    from collsim.workload.model import TransformerSpec

__all__ = ["check_experts_and_context", "check_torch_cp", "chunk_sizes", "uneven_split_note"]


def chunk_sizes(spec: TransformerSpec, parallel: ParallelConfig) -> tuple[int, ...]:
    """Layers per virtual stage: explicit, even, or balanced (see docs/derivations.md)."""

    pp, v = parallel.pp, parallel.virtual_stages
    n = pp * v
    if parallel.layers_per_stage is not None:
        total = sum(parallel.layers_per_stage)
        if total != spec.num_layers:
            raise ConfigError(
                f"layer counts {list(parallel.layers_per_stage)} sum to {total}, the model has "
                f"{spec.num_layers} layers",
                key_path="parallel.layers_per_stage",
            )
        return parallel.layers_per_stage
    first = 1.0 if parallel.account_for_embedding else 0.0
    last = 1.0 if parallel.account_for_loss else 0.0
    if spec.num_layers + first + last < n:
        key = "parallel.virtual_stages" if v > 1 else "parallel.pp"
        raise ConfigError(
            f"model layers ({spec.num_layers}) must be at least "
            f"pp x virtual_stages = {pp} x {v} (one layer per chunk; the embedding and the "
            "loss count as one with parallel.account_for_embedding / account_for_loss)",
            key_path=key,
        )
    balanced = parallel.pipeline_split == "balanced" or first or last
    if spec.num_layers % n == 0 and not first and not last:
        return (spec.num_layers // n,) * n
    if not balanced:
        key = "parallel.virtual_stages" if v > 1 else "parallel.pp"
        raise ConfigError(
            f"model layers ({spec.num_layers}) must be divisible by "
            f"pp x virtual_stages = {pp} x {v} (or set parallel.pipeline_split: balanced, or "
            "list parallel.layers_per_stage)",
            key_path=key,
        )
    return tuple(balanced_chunk_layers(spec.num_layers, n, first_offset=first, last_offset=last))


def check_experts_and_context(
    spec: TransformerSpec, training: TrainingConfig, parallel: ParallelConfig
) -> None:
    tp, cp, dp, ep, etp = parallel.tp, parallel.cp, parallel.dp, parallel.ep, parallel.etp
    if (ep > 1 or etp > 1) and not spec.is_moe:
        key = "parallel.ep" if ep > 1 else "parallel.etp"
        raise ConfigError(
            f"{ep if ep > 1 else etp} > 1 needs a model with routed experts (model.num_experts)",
            key_path=key,
        )
    if spec.is_moe:
        if spec.num_experts % ep:
            raise ConfigError(
                f"model experts ({spec.num_experts}) must be divisible by ep, got {ep}",
                key_path="parallel.ep",
            )
        if (tp * cp * dp) % (ep * etp):
            raise ConfigError(
                f"ep x etp = {ep} x {etp} must divide tp x cp x dp = {tp} x {cp} x {dp} "
                f"= {tp * cp * dp} (experts are folded over the ranks of a stage)",
                key_path="parallel.ep",
            )
        if spec.expert_ffn_hidden % etp:
            raise ConfigError(
                f"expert ffn ({spec.expert_ffn_hidden}) must be divisible by etp, got {etp}",
                key_path="parallel.etp",
            )
        if tp > 1 and ep > 1 and not parallel.sequence_parallel:
            raise ConfigError(
                f"tp {tp} with ep {ep} needs sequence_parallel: true (Megatron-Core's rule for "
                "expert parallelism under tensor parallelism)",
                key_path="parallel.sequence_parallel",
            )
        if spec.shared_ffn_hidden % tp:
            raise ConfigError(
                f"shared-expert ffn ({spec.shared_ffn_hidden}) must be divisible by tp, got {tp}",
                key_path="parallel.tp",
            )
    if not spec.is_mla and spec.num_heads % spec.kv_heads:
        raise ConfigError(
            f"model heads ({spec.num_heads}) must be divisible by kv_heads ({spec.kv_heads})",
            key_path="model.kv_heads",
        )
    chunks = 2 * cp if (cp > 1 and parallel.cp_load_balance) else cp
    if spec.seq_len % chunks:
        rule = f"2 x cp = {chunks} (causal load balancing)" if chunks != cp else f"cp = {cp}"
        raise ConfigError(
            f"model seq_len ({spec.seq_len}) must be divisible by {rule}",
            key_path="parallel.cp",
        )
    if parallel.ep_overlap:
        # Megatron-Core's rules for --overlap-moe-expert-parallel-comm
        # (TransformerConfig.__post_init__, megatron/core/transformer/transformer_config.py)
        if ep < 2:
            raise ConfigError(
                f"needs expert parallelism (parallel.ep > 1), got ep {ep}",
                key_path="parallel.ep_overlap",
            )
        if parallel.ep_overlap_mode == "a2a" and parallel.pp > 1 and parallel.virtual_stages < 2:
            raise ConfigError(
                f"with pp {parallel.pp} needs schedule: interleaved with virtual_stages > 1 "
                "or schedule: dualpipev "
                "(Megatron's combined 1F1B pairs the ops of the interleaved schedule)",
                key_path="parallel.ep_overlap",
            )
        if str(training.recompute) == "full":
            raise ConfigError(
                "does not combine with training.recompute: full (Megatron refuses it: the "
                "paired forward and backward cannot replay a recomputed layer)",
                key_path="parallel.ep_overlap",
            )
    g = parallel.fsdp.shard_group_size
    if g is not None and dp % g:
        raise ConfigError(
            f"{g} must divide dp ({dp}) (shard inside groups, replicate across)",
            key_path="parallel.fsdp.shard_group_size",
        )
    fp8 = str(training.dtype) == "fp8"
    if parallel.fsdp.fp8_all_gather and not fp8:
        raise ConfigError(
            f"fp8_all_gather needs training.dtype: fp8, got {training.dtype}",
            key_path="parallel.fsdp.fp8_all_gather",
        )


TORCH_CP_KERNELS = ("flash2", "cudnn")
"""Attention kernels torch's context parallelism runs: it replaces only SDPA's flash,
memory-efficient and cuDNN ops (``_sdpa_handler``: "CP only supports flash attention and
memory efficient attention now"), so FlashAttention-3, Triton kernels and eager attention
(SDPA's math path) are refused."""


def check_torch_cp(training: TrainingConfig, parallel: ParallelConfig) -> None:
    """torch's context parallelism needs a stack that calls SDPA through torch (Megatron-Core
    runs Transformer Engine's own, ``cp_comm_type``) and one of SDPA's fused kernels."""
    algorithm = str(parallel.cp_algorithm)
    if parallel.cp < 2 or not is_torch_cp(algorithm):
        return
    if training.stack == "megatron_te":
        raise ConfigError(
            f"{algorithm} is torch's context parallelism; Megatron-Core runs Transformer "
            "Engine's (cp_algorithm: ring or all_gather), not torch's",
            key_path="parallel.cp_algorithm",
        )
    kernel = training.attention_kernel
    if kernel is not None and kernel not in TORCH_CP_KERNELS:
        raise ConfigError(
            f"{algorithm} runs only SDPA's fused kernels ({', '.join(TORCH_CP_KERNELS)}), "
            f"got attention_kernel {kernel}",
            key_path="training.attention_kernel",
        )


def uneven_split_note(sizes: tuple[int, ...], parallel: ParallelConfig) -> str | None:
    """The note of a split whose chunks hold different numbers of layers, the embedding and
    the loss counted as a layer each where the split accounts for them (Megatron-LM's
    ``account_for_embedding_in_pipeline_split`` / ``account_for_loss_in_pipeline_split``)."""
    equivalents = list(sizes)
    equivalents[0] += int(parallel.account_for_embedding)
    equivalents[-1] += int(parallel.account_for_loss)
    if len(set(equivalents)) == 1:
        return None
    counted = (
        " (the embedding and the loss as one each)"
        if parallel.account_for_embedding or parallel.account_for_loss
        else ""
    )
    return (
        f"uneven pipeline split: {_span_counts(tuple(equivalents))} layers per virtual "
        f"stage{counted}"
    )


def _span_counts(sizes: tuple[int, ...]) -> str:
    if len(sizes) <= 16:
        return str(list(sizes))
    return f"{list(sizes[:4])} ... {list(sizes[-4:])} ({len(sizes)} chunks)"
