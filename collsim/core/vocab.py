"""The glossary of collsim: every enumerated name, and the one way to parse one.

This module sits at the bottom of the import graph: it imports only the standard library and
:mod:`collsim.core.errors` (itself a leaf), so every layer above, from the topology loader to the
CLI, names ops, algorithms, axes and dtypes with the same types. Each enum is a ``StrEnum``:
a member equals, hashes and formats as its value (``ParallelAxis.TP == "tp"``), so a member
can stand wherever its string did.

- collectives: :class:`CollectiveOp`, :class:`Algorithm`, :class:`Protocol`;
- parallelism: :class:`ParallelAxis`, :class:`ScheduleKind`, :class:`PipelinePhase`,
  :class:`CPAlgorithm`;
- training: :class:`Dtype` (with its element size), :class:`Optimizer`,
  :class:`RecomputeMode`, :class:`FP8Recipe`;
- workload: :class:`OpKind`;
- hardware: :class:`LinkKind`, :class:`Interconnect`, :class:`FabricKind`.

:func:`parse_enum` turns user input into a member, or raises a :class:`ConfigError` that lists
the choices.
"""

from __future__ import annotations

from enum import StrEnum
from typing import TypeVar

from collsim.core.errors import ConfigError

__all__ = [
    "parse_enum",
    "CollectiveOp",
    "Algorithm",
    "Protocol",
    "ParallelAxis",
    "DATA_PARALLEL_AXES",
    "RankOrder",
    "ScheduleKind",
    "PipelinePhase",
    "CPAlgorithm",
    "Dtype",
    "NCCL_TESTS_TYPE_BYTES",
    "Optimizer",
    "RecomputeMode",
    "FP8Recipe",
    "OpKind",
    "LinkKind",
    "Interconnect",
    "FabricKind",
]

_E = TypeVar("_E", bound=StrEnum)


def parse_enum(
    enum_cls: type[_E], value: object, what: str = "value", *, key_path: str | None = None
) -> _E:
    """``enum_cls(value)`` (case-insensitive) or a ConfigError that lists the choices.

    With ``key_path`` (a key of an input file), the message is the file rule's form,
    ``<key_path>: must be one of a, b; got 'x'``; without it (an argument of a library call),
    ``unknown <what> 'x'; choose from a, b``.
    """
    if isinstance(value, enum_cls):
        return value
    try:
        return enum_cls(str(value).lower())
    except ValueError:
        choices = ", ".join(e.value for e in enum_cls)
        if key_path is not None:
            raise ConfigError(
                f"must be one of {choices}; got {value!r}", key_path=key_path
            ) from None
        raise ConfigError(f"unknown {what} {value!r}; choose from {choices}") from None


# -- collectives ----------------------------------------------------------------------------


class CollectiveOp(StrEnum):
    """A collective operation (nccl-tests names)."""

    ALL_REDUCE = "all_reduce"
    REDUCE_SCATTER = "reduce_scatter"
    ALL_GATHER = "all_gather"
    BROADCAST = "broadcast"
    REDUCE = "reduce"
    ALL_TO_ALL = "all_to_all"
    SEND_RECV = "send_recv"


class Algorithm(StrEnum):
    """How a collective moves its bytes. ``auto`` picks the cheapest, as NCCL does."""

    AUTO = "auto"
    RING = "ring"
    TREE = "tree"  # double binary tree (NCCL), intra-node chains
    HALVING_DOUBLING = "halving_doubling"  # recursive halving / doubling (Rabenseifner)
    DIRECT = "direct"  # every rank to every peer at once
    HIERARCHICAL = "hierarchical"  # intra-node, then inter-node, then intra-node
    NVLS = "nvls"  # in-switch reduction (NVLink SHARP)
    NVLS_TREE = "nvls_tree"  # NVLS inside each node, double binary tree across nodes
    COLLNET_DIRECT = "collnet_direct"  # all-to-all to NIC heads, in-network (SHARP) reduction
    COLLNET_CHAIN = "collnet_chain"  # chain to the head, in-network (SHARP) reduction
    PAT = "pat"  # parallel aggregated trees (NCCL 2.23+): all_gather / reduce_scatter


class Protocol(StrEnum):
    """NCCL's wire protocols (gloo uses ``simple``)."""

    LL = "ll"
    LL128 = "ll128"
    SIMPLE = "simple"


# -- parallelism ----------------------------------------------------------------------------


class ParallelAxis(StrEnum):
    """A parallelism axis (``dp`` also carries ZeRO / FSDP traffic).

    ``ep``, ``etp``, ``edp``: the expert grid of a stage (see :mod:`collsim.parallel.plan`);
    ``dp_cp``: the dp x cp ranks that reduce the non-expert gradients (Megatron's ``dp-cp``
    group); ``dp_shard`` / ``dp_replicate``: the HSDP split of ``dp``; ``dp_cp_shard``: a shard
    group with its cp ranks (dp_shard x cp, what the non-expert states are sharded over under
    HSDP); ``edp_shard``: the ranks of the edp group inside that shard group (torchtitan's
    ``efsdp``), ``edp_replicate``: the edp ranks at the same place in the other shard groups;
    ``mp``: a replica's model-parallel ranks.
    """

    TP = "tp"
    PP = "pp"
    DP = "dp"
    CP = "cp"
    EP = "ep"
    ETP = "etp"
    EDP = "edp"
    DP_CP = "dp_cp"
    DP_SHARD = "dp_shard"
    DP_REPLICATE = "dp_replicate"
    DP_CP_SHARD = "dp_cp_shard"
    EDP_SHARD = "edp_shard"
    EDP_REPLICATE = "edp_replicate"
    EP_NODE = "ep_node"
    """The ranks of an EP group at the same place in their nodes, one per node the group spans
    (the network leg of DeepEP / HybridEP: IB to the same in-node index)."""
    EP_LOCAL = "ep_local"
    """The ranks of an EP group on one node (the NVLink leg of DeepEP / HybridEP)."""
    MP = "mp"
    """The model-parallel ranks of one data-parallel replica (every tp, cp and pp index at one
    dp index): the group of the gradient-norm all-reduce."""
    TP_DP_CP = "tp_dp_cp"
    """Every rank of one pipeline stage (tp x dp x cp): Megatron-Core's FP8 amax reduction
    group (``get_amax_reduction_group(with_context_parallel=True)``)."""


DATA_PARALLEL_AXES = frozenset(
    axis for axis in ParallelAxis if axis.value.startswith(("dp", "edp"))
)
"""The data-parallel family: dp, its cp, HSDP shard and replicate groups, and the expert
data-parallel groups. Their calls share a rank's data-parallel stream."""


class RankOrder(StrEnum):
    """How the parallel dimensions are laid out on the ranks, fastest-varying first
    (Megatron-Core ``RankGenerator`` order strings; ``ep`` folds inside ``tp x cp x dp``).

    ``tp-cp-ep-dp-pp``: pipeline outermost, so one stage's tp x cp x dp ranks are consecutive
    and the EP groups folded over them are consecutive too (Megatron-Core's default,
    ``initialize_model_parallel(order="tp-cp-ep-dp-pp")`` in megatron/core/parallel_state.py;
    torchtitan's device mesh ``("pp", "dp_replicate", "dp_shard", "cp", "tp")``, outermost
    first, in torchtitan/distributed/parallel_dims.py). ``tp-cp-ep-pp-dp``: data parallel
    outermost, pp inside it (Megatron-LM ``--use-tp-pp-dp-mapping``; collsim's layout before
    this key existed).
    """

    PP_OUTER = "tp-cp-ep-dp-pp"
    DP_OUTER = "tp-cp-ep-pp-dp"


class ScheduleKind(StrEnum):
    """Pipeline schedules: GPipe, 1F1B (PipeDream-Flush), interleaved 1F1B (Megatron),
    zero-bubble ZB-H1 (Qi et al. 2024), DualPipeV (DeepSeek); see docs/pipelines.md."""

    GPIPE = "gpipe"
    ONE_F_ONE_B = "1f1b"
    INTERLEAVED = "interleaved"
    ZB_H1 = "zb_h1"
    DUALPIPEV = "dualpipev"


class PipelinePhase(StrEnum):
    """The passes a pipeline stage runs per micro-batch: forward, and either a whole backward
    or its input-gradient part (I) and weight-gradient part (W) as two ops (torch.distributed
    .pipelining's ``_ComputationType`` letters; the zero-bubble paper calls I "B")."""

    FORWARD = "F"
    BACKWARD = "B"
    BACKWARD_INPUT = "I"
    BACKWARD_WEIGHT = "W"


class CPAlgorithm(StrEnum):
    """How context-parallel ranks exchange keys and values.

    ``ring``: KV blocks passed around the CP ring, one step per peer, overlapped with the
    attention blocks (Liu et al. 2023 "Ring Attention", Megatron-Core / Transformer Engine
    ``cp_comm_type: p2p``). ``all_gather``: every rank all-gathers the whole sequence's K and
    V before attention ("The Llama 3 Herd of Models", arXiv 2407.21783, section 3.3.2; TE
    ``cp_comm_type: all_gather``). ``torch_allgather`` / ``torch_alltoall``: torch's
    experimental context parallelism for SDPA (``torch.distributed.tensor.experimental.
    context_parallel``, what torchtitan runs) with its rotate method ``allgather`` (the
    default) or ``alltoall``: one SDPA call per KV chunk and log-sum-exp merges
    (:mod:`collsim.workload.torch_cp`).
    """

    RING = "ring"
    ALL_GATHER = "all_gather"
    TORCH_ALLGATHER = "torch_allgather"
    TORCH_ALLTOALL = "torch_alltoall"


# -- training -------------------------------------------------------------------------------


class Dtype(StrEnum):
    """Training (compute) dtypes."""

    BF16 = "bf16"
    FP16 = "fp16"
    FP32 = "fp32"
    FP8 = "fp8"

    @property
    def size_bytes(self) -> int:
        """Bytes per element: 2 for bf16 and fp16, 4 for fp32, 1 for fp8 (E4M3 and E5M2 are
        both 8-bit formats: Micikevicius et al. 2022, "FP8 Formats for Deep Learning")."""
        match self:
            case Dtype.FP32:
                return 4
            case Dtype.FP8:
                return 1
            case _:
                return 2

    @property
    def activation_dtype(self) -> Dtype:
        """The dtype activations are stored in: the compute dtype, except under fp8, where
        Transformer Engine runs the GEMMs in fp8 but keeps the activations in bf16."""
        return Dtype.BF16 if self is Dtype.FP8 else self


NCCL_TESTS_TYPE_BYTES: dict[str, int] = {
    # nccl-tests' -d names (src/common.cu ``test_typenames``, nccl-tests 2.19.6)
    "int8": 1,
    "uint8": 1,
    "int32": 4,
    "uint32": 4,
    "int64": 8,
    "uint64": 8,
    "half": 2,
    "float": 4,
    "double": 8,
    "bfloat16": 2,
    "f8e4m3": 1,
    "f8e5m2": 1,
    # NCCL's own aliases (nccl.h ``ncclChar`` = ncclInt8, ``ncclInt`` = ncclInt32,
    # ``ncclFloat16`` / ``ncclFloat32`` / ``ncclFloat64``)
    "char": 1,
    "int": 4,
    "float16": 2,
    "float32": 4,
    "float64": 8,
}
"""Bytes per element of the element types nccl-tests runs (``-d``) and logs (its ``type``
column): ``collsim collective --dtype`` and the nccl-tests fixtures' generator use it."""


class Optimizer(StrEnum):
    """Optimizers, by the state they keep."""

    ADAM = "adam"  # Adam / AdamW: fp32 master + m + v
    SGD = "sgd"  # SGD with momentum: fp32 master + momentum


class RecomputeMode(StrEnum):
    """Activation recomputation (Korthikanti 2022): none, selective (core attention), full."""

    NONE = "none"
    SELECTIVE = "selective"
    FULL = "full"


class FP8Recipe(StrEnum):
    """FP8 scaling recipes (Transformer Engine ``transformer_engine.common.recipe``).

    ``tensorwise``: one scale per tensor from its current amax (TE ``Float8CurrentScaling``,
    torchao ``Float8LinearConfig`` tensorwise, the torchtitan default); ``delayed``: one scale
    per tensor from an amax history (TE ``DelayedScaling``, history length 1024 by default);
    ``blockwise``: 128 x 128 weight blocks and 1 x 128 activation tiles, one fp32 scale each
    (DeepSeek-V3 report section 3.3.2; TE ``Float8BlockScaling``); ``mxfp8``: 32-element blocks
    with an E8M0 (1-byte) scale (OCP Microscaling Formats spec v1.0; TE ``MXFP8BlockScaling``,
    Blackwell).
    """

    TENSORWISE = "tensorwise"
    DELAYED = "delayed"
    BLOCKWISE = "blockwise"
    MXFP8 = "mxfp8"


# -- workload -------------------------------------------------------------------------------


class OpKind(StrEnum):
    """What kind of kernel a workload op is, which decides how it is timed."""

    MATMUL = "matmul"
    ELEMENTWISE = "elementwise"
    FUSED_ATTENTION = "fused_attention"
    """FlashAttention: QK^T, softmax, dropout and AV in one kernel, timed by compute.py."""


# -- hardware -------------------------------------------------------------------------------


class LinkKind(StrEnum):
    """Class of a link, which decides the per-hop latency NCCL's cost model charges."""

    NVLINK = "nvlink"
    PCIE = "pcie"
    LOOPBACK = "loopback"
    NETWORK = "network"


class Interconnect(StrEnum):
    """What connects the ranks inside a node."""

    NVSWITCH = "nvswitch"
    PCIE_SWITCH = "pcie_switch"
    LOOPBACK = "loopback"


class FabricKind(StrEnum):
    """The transport between nodes (``fabric.kind``); each has sourced defaults
    (:data:`collsim.cluster.topology.FABRIC_DEFAULTS`). ``fat_tree`` is the older spelling:
    InfiniBand's shape, no transport defaults."""

    INFINIBAND = "infiniband"
    ROCE = "roce"
    EFA = "efa"
    TCPXO = "tcpxo"
    FAT_TREE = "fat_tree"
