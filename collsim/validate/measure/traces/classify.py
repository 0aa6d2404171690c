"""Sort a traced kernel or CPU op into one of collsim's op kinds by its name: the kernel names
of cuBLAS / cuBLASLt (``sm90_xmma_gemm_*``, ``nvjet_*``, ``ampere_sgemm_*``), CUTLASS, Triton
(``triton_tem_fused_mm*``, ``triton_poi_*``), rocBLAS / hipBLASLt (``Cijk_*``), FlashAttention,
cuDNN, NCCL / RCCL, PyTorch's own ATen kernels and, on a CPU-only trace, the ``aten::`` ops.
Rules are tried in order (:data:`RULES`: communication before GEMM so that ``ncclDevKernel_*``
is not read as a copy; attention before convolutions, as cuDNN's fused attention is
an ``fprop``; convolutions before GEMMs, since cuDNN's implicit-GEMM convolutions have
``gemm`` in their names); a name no rule matches is ``unclassified``, counted and shown."""

from __future__ import annotations

import re
from functools import lru_cache

__all__ = ["KINDS", "COMPUTE_KINDS", "classify", "RULES"]

#: The op kinds, in the order the tables print them.
KINDS = (
    "gemm",
    "attention",
    "convolution",
    "norm",
    "elementwise",
    "optimizer",
    "embedding",
    "loss",
    "copy",
    "communication",
    "framework",
    "unclassified",
)

COMPUTE_KINDS = frozenset(
    {
        "gemm",
        "attention",
        "convolution",
        "norm",
        "elementwise",
        "optimizer",
        "embedding",
        "loss",
        "unclassified",
    }
)
"""Kinds that keep a device busy computing (the rest: copies, communication, host bookkeeping)."""

RULES: tuple[tuple[str, str], ...] = (
    # collectives and point-to-point: NCCL / RCCL kernels, c10d ops, gloo's annotations
    (
        "communication",
        r"nccl|rccl|^gloo:|^c10d::|record_param_comms|allreduce|all_reduce|allgather|"
        r"all_gather|reduce_scatter|reducescatter|alltoall|all_to_all|broadcast_|sendrecv",
    ),
    # attention: FlashAttention 1-3, PyTorch's efficient / math SDPA, cuDNN's fused SDPA
    (
        "attention",
        r"flash|fmha|attention|attn|sdpa|scaled_dot_product|mem_eff|cutlassf_|"
        r"cudnn_generated_fort_native_sdpa",
    ),
    # convolutions: cuDNN / MIOpen / CUTLASS conv kernels and the aten ops
    (
        "convolution",
        r"conv(?!ert)|fprop|dgrad|wgrad|winograd|implicit_gemm|implicit_convolve|fft2d|"
        r"miopen.*(fwd|bwd)|igemm|scudnn|hcudnn|cask_cudnn|scalepackedtensor",
    ),
    # GEMMs: cuBLAS / cuBLASLt / CUTLASS / Triton / rocBLAS / hipBLASLt and the aten ops
    (
        "gemm",
        r"gemm|cutlass|cublas|xmma|nvjet|sgemm|hgemm|matmul|^aten::(mm|addmm|bmm|baddbmm|"
        r"linear|_addmm_activation|addbmm)$|triton_tem_fused_.*mm|^cijk_|wvsplitk|"
        r"hipblaslt|^(addmm|mm|bmm)backward|ampere_.*_\d+x\d+|volta_.*_\d+x\d+|splitkreduce",
    ),
    (
        "norm",
        r"layer_?norm|rms_?norm|batch_?norm|group_?norm|instance_?norm|\bbn_(fw|bw)|welford|"
        r"gammabetabackward|rowwisemoments|computefusedparams",
    ),
    (
        "optimizer",
        r"adam|sgd|lamb|adagrad|multi_tensor_apply|foreach|^optimizer\.|fused_sgd|"
        r"clip_grad|zero_grad|accumulategrad",
    ),
    (
        "embedding",
        r"embedding|index_select|indexselect|^aten::index$|indexing_backward|"
        r"linearize_index|bounds_check_indices|split_embedding",
    ),
    ("loss", r"cross_entropy|nll_loss|log_softmax|logsoftmax|mse_loss|nllloss|softmax_cross"),
    (
        "copy",
        r"memcpy|memset|copy|^aten::(to|_to_copy|contiguous|clone|cat|stack)$|catarray|"
        r"concat|cast|convert|transpose_kernel|bucket_to_grad|mul_out|nchwtonhwc|nhwctonchw",
    ),
    (
        "elementwise",
        r"elementwise|reduce_kernel|softmax|gelu|relu|silu|swish|sigmoid|tanh|dropout|"
        r"triton_(poi|red|per)_|^aten::(add|add_|sub|sub_|mul|mul_|div|div_|sum|mean|"
        r"fill_|zero_|zeros|ones_like|where|pow|sqrt|rsqrt|exp|neg|clamp|masked_fill|"
        r"addcmul_|addcdiv_|lerp_|max|min|abs|norm|arange|tril|triu|rand|randn|"
        r"bernoulli_|native_dropout|_softmax|threshold_backward)$|^(add|mul|sub|div|neg|"
        r"gelu|split|sum|mean|pow|expand|cat|select|slice|where)backward|fill|"
        r"pool|upsample|vectorized|unrolled|distribution|philox|indexing|scatter|gather|"
        r"sort|topk|cumsum|reduce|devicescan|^triton_",
    ),
    # host bookkeeping on a CPU trace: views, allocations, autograd's own nodes
    (
        "framework",
        r"^aten::(view|_unsafe_view|reshape|t|transpose|permute|as_strided|expand|"
        r"expand_as|squeeze|unsqueeze|narrow|slice|select|split|split_with_sizes|chunk|"
        r"unbind|detach|detach_|alias|empty|empty_like|empty_strided|resize_|"
        r"resolve_conj|resolve_neg|lift_fresh|numpy_t|matrix_h|flatten|unflatten|"
        r"is_nonzero|item|_local_scalar_dense|result_type|set_|_reshape_alias|"
        r"broadcast_tensors|contiguous)$|^detach$|^(t|view|transpose|permute|unsafeview|"
        r"reshapealias|unsqueeze|squeeze|detach|unbind|alias)backward|^autograd::|"
        r"^torch::autograd::|^distributeddataparallel|^torch\.distributed|^cudastream|"
        r"^profilerstep#|^enumerate\(dataloader\)|^##",
    ),
)

_COMPILED = tuple((kind, re.compile(pattern)) for kind, pattern in RULES)
_BACKWARD = re.compile(r"^autograd::engine::evaluate_function: ")


@lru_cache(maxsize=16384)
def classify(name: str, cat: str = "") -> str:
    """The op kind of a kernel or op called ``name`` (Kineto category ``cat``)."""
    if cat in ("gpu_memcpy", "gpu_memset"):
        return "copy"
    low = _BACKWARD.sub("", name).strip().lower()
    if _BACKWARD.match(name):
        # autograd's node for a backward function: the kind of the function it runs
        low = re.sub(r"backward\d*$", "backward", low)
    for kind, pattern in _COMPILED:
        if pattern.search(low):
            return kind
    return "unclassified"
