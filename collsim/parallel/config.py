"""Training and parallel-plan configuration: frozen dataclasses that check themselves.

These are the ``training`` and ``parallel`` sections of a scenario after loading. Values that are
malformed on their own raise :class:`ConfigError` with the key path. Combinations that cannot
work on a cluster (tp x pp x dp != GPUs, heads not divisible by tp, ...) are checked when the plan
is built against a model and a topology, and also raise ConfigError naming the key (exit 2); a
plan that does not fit in memory raises InfeasibleError (exit 1).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from collsim.core.errors import ConfigError
from collsim.core.vocab import (
    CPAlgorithm,
    Dtype,
    FP8Recipe,
    Optimizer,
    RankOrder,
    RecomputeMode,
    ScheduleKind,
    parse_enum,
)
from collsim.parallel.pipeline import get_schedule
from collsim.parallel.tp_overlap import TP_OVERLAP_MODES, check_tp_overlap

Recompute = RecomputeMode
"""The older name of :class:`collsim.core.vocab.RecomputeMode`."""

__all__ = [
    "STACKS",
    "STACK_KEYS",
    "TrainingConfig",
    "DDPConfig",
    "FSDPConfig",
    "ParallelConfig",
    # the glossary's names, re-exported for callers of this module (see collsim.core.vocab)
    "Dtype",
    "Recompute",
    "ScheduleKind",
    "CPAlgorithm",
    "FP8Recipe",
    "STACK_CHOICES",
    "ZERO_STAGES",
    "PIPELINE_SPLITS",
    "EP_OVERLAP_MODES",
    "DISPATCHERS",
    "ROUTINGS",
    "REDUCE_DTYPES",
    "GRAD_SYNCS",
    "RankOrder",
]


def _positive(value: float, key: str) -> None:
    if value <= 0:
        raise ConfigError(f"must be > 0, got {value}", key_path=key)


STACK_KEYS = (
    "attention_kernel",
    "execution",
    "fused_kernels",
    "grad_reduce_dtype",
    "grad_clip",
    "optimizer_implementation",
    "fsdp_version",
)
"""Training keys a ``stack:`` sets (explicit keys override them)."""

STACKS: dict[str, dict[str, object]] = {
    # Megatron-Core with Transformer Engine: TE's fused attention (cuDNN backend on Hopper;
    # FlashAttention-2 on Ampere, which the tables give for "cudnn" there), apex/TE fused
    # LayerNorm / bias-dropout-add / softmax kernels, main gradients accumulated and reduced in
    # fp32 (--accumulate-allreduce-grads-in-fp32, required with bf16), --clip-grad 1.0,
    # FusedAdam.
    "megatron_te": {
        "attention_kernel": "cudnn",
        "execution": "eager",
        "fused_kernels": True,
        "grad_reduce_dtype": "fp32",
        "grad_clip": True,
        "optimizer_implementation": "fused",
        "fsdp_version": 1,
    },
    # torchtitan (FSDP2): SDPA (its flash backend is FlashAttention-2), eager by default
    # (compile is opt-in), RMSNorm in eager PyTorch, mixed_precision_reduce = float32,
    # max_norm 1.0, AdamW implementation "fused", fully_shard per block.
    "torchtitan": {
        "attention_kernel": "flash2",
        "execution": "eager",
        "fused_kernels": False,
        "grad_reduce_dtype": "fp32",
        "grad_clip": True,
        "optimizer_implementation": "fused",
        "fsdp_version": 2,
    },
    # MosaicML llm-foundry (Composer + torch FSDP1): flash attention (attn_impl flash; the
    # 2023 benchmark tables ran triton), PyTorch eager, FSDP mixed precision DEFAULT (gradients
    # reduced in fp32), clipping_threshold 1.0, Composer's DecoupledAdamW (a per-parameter
    # loop: foreach traffic).
    "llm_foundry": {
        "attention_kernel": "flash2",
        "execution": "eager",
        "fused_kernels": False,
        "grad_reduce_dtype": "fp32",
        "grad_clip": True,
        "optimizer_implementation": "foreach",
        "fsdp_version": 1,
    },
    # plain torch FSDP / DDP with SDPA: FSDP without a reduce_dtype reduces in the fp32
    # parameter dtype, torch AdamW's foreach default, clip_grad_norm_.
    "fsdp": {
        "attention_kernel": "flash2",
        "execution": "eager",
        "fused_kernels": False,
        "grad_reduce_dtype": "fp32",
        "grad_clip": True,
        "optimizer_implementation": "foreach",
        "fsdp_version": 1,
    },
    # NeMo Automodel (FSDP2, nemo_automodel/components/models/common/utils.py BackendConfig at
    # 36044ad): attn "te" when Transformer Engine is installed on a GPU (TE fused attention,
    # cuDNN on Hopper), rms_norm "torch_fp32" (unfused), FSDP2 with fp32 reduction as
    # torchtitan, clip_grad_norm 1.0, fused AdamW.
    "nemo_automodel": {
        "attention_kernel": "cudnn",
        "execution": "eager",
        "fused_kernels": False,
        "grad_reduce_dtype": "fp32",
        "grad_clip": True,
        "optimizer_implementation": "fused",
        "fsdp_version": 2,
    },
    # DeepSpeed ZeRO: communication_data_type defaults to the model dtype (bf16),
    # gradient_clipping 1.0, DeepSpeed's FusedAdam, flat partitioned buffers.
    "deepspeed": {
        "attention_kernel": "flash2",
        "execution": "eager",
        "fused_kernels": False,
        "grad_reduce_dtype": "bf16",
        "grad_clip": True,
        "optimizer_implementation": "fused",
        "fsdp_version": 1,
    },
}
"""What each ``training.stack`` sets (sources in the comments; keys in STACK_KEYS)."""

_NO_STACK: dict[str, object] = {
    "attention_kernel": None,
    "execution": "eager",
    "fused_kernels": True,
    "grad_reduce_dtype": "bf16",
    "grad_clip": False,
    "optimizer_implementation": "fused",
    "fsdp_version": 1,
}
"""Defaults without a stack: the model's own attention choice (``flash_attention`` of its
preset; unfused for a hand-written model), fused kernels as Megatron counts them, gradients
reduced in the compute dtype, no clipping, a fused optimizer."""

STACK_CHOICES: dict[str, tuple[object, ...]] = {
    "attention_kernel": ("flash2", "flash3", "cudnn", "triton", "eager"),
    "execution": ("eager", "compiled", "cuda_graphs"),
    "grad_reduce_dtype": ("fp32", "bf16"),
    "optimizer_implementation": ("fused", "foreach"),
    "fsdp_version": (1, 2),
}


"""Values of the stack keys that take a choice (``training.attention_kernel``, ...)."""

ZERO_STAGES = (0, 1, 2, 3)
"""``parallel.zero``: 0 = DDP, 1 optimizer states, 2 + gradients, 3 + parameters sharded."""
DISPATCHERS = ("alltoall", "deepep", "hybridep", "allgather")
"""``parallel.dispatcher`` values (Megatron-Core ``moe_token_dispatcher_type`` alltoall /
allgather, ``flex`` with ``moe_flex_dispatcher_backend`` deepep / hybridep)."""

ROUTINGS = ("uniform", "node_limited", "balanced")
"""``parallel.routing`` values: uniform random top-k (Megatron-Core
``moe_router_force_load_balancing``: random logits, ``moe_utils.apply_random_logits``),
node-limited to M nodes (DeepSeek-V3 report section 2.1.2 / 3.2.2, M = 4), consecutive experts
(NeMo Automodel ``FakeBalancedGate``: token i picks experts (i k + j) mod E)."""

EP_OVERLAP_MODES = ("none", "a2a", "dualpipe", "dualpipev")
"""``parallel.ep_overlap`` modes (true = ``a2a``, false = ``none``)."""
PIPELINE_SPLITS = ("even", "balanced")
"""``parallel.pipeline_split`` values (see :attr:`ParallelConfig.pipeline_split`)."""
GRAD_SYNCS = ("microbatch", "step")
"""``parallel.fsdp.grad_sync`` values: ZeRO-3 gradients reduced every micro-batch or once."""
REDUCE_DTYPES = ("bf16", "fp16", "fp32")
"""``parallel.fsdp.reduce_dtype`` values: the dtypes a gradient reduction runs in."""


@dataclass(frozen=True, slots=True, kw_only=True)
class TrainingConfig:
    """The ``training`` section."""

    global_batch: int
    """Sequences per optimizer step, over all data-parallel replicas."""
    micro_batch: int = 1
    """Sequences per micro-batch on one pipeline/data-parallel rank."""
    dtype: Dtype = Dtype.BF16
    """Compute and activation dtype (mixed precision keeps fp32 master weights with Adam)."""
    optimizer: Optimizer = Optimizer.ADAM
    recompute: RecomputeMode = RecomputeMode.NONE
    fp8_recipe: FP8Recipe | None = None
    """FP8 scaling recipe (needs ``dtype: fp8``); None with fp8 means ``tensorwise``."""
    stack: str | None = None
    """``megatron_te``, ``nemo_automodel``, ``torchtitan``, ``llm_foundry``, ``fsdp`` or
    ``deepspeed``: sets the keys
    below as that stack does (:data:`STACKS`); explicit keys override it."""
    attention_kernel: str | None = None
    """``flash2``, ``flash3``, ``cudnn``, ``triton`` or ``eager``; None: the stack's, else the
    model's own (its preset's ``flash_attention``). Decides time and activation memory."""
    execution: str | None = None
    """``eager``, ``compiled`` (torch.compile) or ``cuda_graphs``: host issue cost per kernel."""
    fused_kernels: bool | None = None
    """Hand-fused norm / bias-dropout-add / softmax kernels (Megatron, TE, apex, a compiler)."""
    grad_reduce_dtype: str | None = None
    """``fp32`` or ``bf16``: the dtype gradients are reduced in (fp32 doubles the bytes)."""
    grad_clip: bool | None = None
    """Clip gradients by their global norm (a norm pass and a scalar all-reduce per step)."""
    optimizer_implementation: str | None = None
    """``fused`` (one kernel per tensor chunk) or ``foreach`` (torch's multi-tensor default)."""
    fsdp_version: int | None = None
    """1 (torch FSDP flat parameters) or 2 (FSDP2 per-parameter: adds a copy-out per
    all-gather)."""
    fp8_weight_cache: bool | None = None
    """Transformer Engine casts the FP8 weights once per step and reuses them in the other
    micro-batches (``is_first_microbatch``); None: True under ``megatron_te``
    (:func:`collsim.workload.fp8.weight_cache_of`). Needs ``stack: megatron_te``."""
    fp8_param_gather: bool | None = None
    """Weights kept in FP8 and all-gathered as FP8 (Megatron ``--fp8-param-gather``; sets
    ``parallel.fsdp.fp8_all_gather``); None: True for FP8 under ``megatron_te`` with a sharded
    optimizer (:func:`collsim.workload.fp8.fp8_param_gather_of`)."""
    expandable_segments: bool | None = None
    """``PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True`` for the caching allocator; None:
    the stack's launch setting (:func:`collsim.step.allocator.expandable_segments_of`)."""

    def __post_init__(self) -> None:
        if self.stack is not None and self.stack not in STACKS:
            raise ConfigError(
                f"must be one of {', '.join(STACKS)}; got {self.stack!r}", key_path="training.stack"
            )
        base = STACKS[self.stack] if self.stack is not None else _NO_STACK
        for key in STACK_KEYS:
            value = getattr(self, key)
            if value is None:
                object.__setattr__(self, key, base[key])
            elif key in STACK_CHOICES and value not in STACK_CHOICES[key]:
                choices = ", ".join(map(str, STACK_CHOICES[key]))
                raise ConfigError(
                    f"must be one of {choices}; got {value!r}", key_path=f"training.{key}"
                )
        if self.attention_kernel is None and self.stack is None:
            pass  # the model decides (ComputeModel reads spec.flash_attention)
        if self.fp8_weight_cache is not None and self.stack != "megatron_te":
            raise ConfigError(
                "Transformer Engine's FP8 weight cache needs training.stack: megatron_te, got "
                f"stack {self.stack}",
                key_path="training.fp8_weight_cache",
            )
        _positive(self.global_batch, "training.global_batch")
        _positive(self.micro_batch, "training.micro_batch")
        if self.fp8_recipe is not None:
            object.__setattr__(
                self,
                "fp8_recipe",
                parse_enum(FP8Recipe, self.fp8_recipe, key_path="training.fp8_recipe"),
            )
            if str(self.dtype).lower() != "fp8":
                raise ConfigError(
                    f"an fp8 recipe needs dtype: fp8, got dtype: {self.dtype}",
                    key_path="training.fp8_recipe",
                )
        object.__setattr__(self, "dtype", parse_enum(Dtype, self.dtype, key_path="training.dtype"))
        object.__setattr__(
            self, "optimizer", parse_enum(Optimizer, self.optimizer, key_path="training.optimizer")
        )
        object.__setattr__(
            self,
            "recompute",
            parse_enum(RecomputeMode, self.recompute, key_path="training.recompute"),
        )


@dataclass(frozen=True, slots=True, kw_only=True)
class DDPConfig:
    """``parallel.ddp``: gradient buckets as torch DistributedDataParallel builds them."""

    bucket_mb: float = 25.0
    """Bucket capacity in MB (torch's bucket_cap_mb, 1 MB = 2**20 bytes there)."""
    first_bucket_mb: float = 1.0
    """torch's small first bucket (dist._DEFAULT_FIRST_BUCKET_BYTES = 1 MiB)."""
    overlap: bool = True
    """Launch each bucket's all-reduce as soon as its last gradient is produced."""
    gradient_as_bucket_view: bool = False
    """torch DDP's ``gradient_as_bucket_view`` (default False there too): when False, DDP keeps
    flat bucket tensors beside ``param.grad``, one more copy of the gradients in memory; when
    True, the gradients are views into the buckets."""

    def __post_init__(self) -> None:
        _positive(self.bucket_mb, "parallel.ddp.bucket_mb")
        _positive(self.first_bucket_mb, "parallel.ddp.first_bucket_mb")


@dataclass(frozen=True, slots=True, kw_only=True)
class FSDPConfig:
    """``parallel.fsdp``: per-layer units, prefetch, reshard, offload (ZeRO-3 / FSDP)."""

    prefetch: int = 1
    """How many units ahead the all-gather is issued (0 = no prefetch), forward and backward."""
    reshard_after_forward: bool = True
    """False keeps the all-gathered parameters from forward to backward (no second
    all-gather; the Llama 3 405B choice, arXiv 2407.21783 section 3.3.2)."""
    offload: bool = False
    """Keep sharded parameters, gradients and optimizer state in CPU memory (PCIe traffic)."""
    shard_group_size: int | None = None
    """HSDP (torch FSDP2 ``HYBRID_SHARD`` / a 2-D device mesh ``(replicate, shard)``): shard
    inside groups of this many consecutive data-parallel ranks and replicate across the
    dp / size groups; gradients reduce-scatter inside a group, then all-reduce across. None
    shards over the whole data-parallel group."""
    reduce_dtype: Dtype | None = None
    """Gradient reduction dtype (FSDP2 ``MixedPrecisionPolicy.reduce_dtype``): ``fp32`` as in
    Llama 3 405B; None reduces in the training dtype."""
    fp8_all_gather: bool = False
    """All-gather the FP8 copies of the weights instead of bf16 (torchao
    ``enable_fsdp_float8_all_gather``; Megatron ``--fp8-param-gather``): half the bytes."""
    grad_sync: str | None = None
    """When ZeRO-3 / FSDP reduces gradients (:data:`GRAD_SYNCS`): ``microbatch`` (every
    backward, FSDP's default) or ``step`` (accumulated unsharded and reduced once, at the last
    backward: torch.distributed.pipelining with FSDP2). None: ``step`` for an FSDP2 stack with
    pipelining, else ``microbatch`` (:func:`collsim.parallel.fsdp.grad_sync_of`)."""

    def __post_init__(self) -> None:
        if self.prefetch < 0:
            raise ConfigError(
                f"must be >= 0, got {self.prefetch}", key_path="parallel.fsdp.prefetch"
            )
        if self.shard_group_size is not None:
            _positive(self.shard_group_size, "parallel.fsdp.shard_group_size")
        if self.grad_sync is not None and self.grad_sync not in GRAD_SYNCS:
            raise ConfigError(
                f"must be one of {', '.join(GRAD_SYNCS)}; got {self.grad_sync!r}",
                key_path="parallel.fsdp.grad_sync",
            )
        if self.reduce_dtype is not None:
            value = parse_enum(Dtype, self.reduce_dtype, key_path="parallel.fsdp.reduce_dtype")
            if value not in REDUCE_DTYPES:
                raise ConfigError(
                    f"must be one of {', '.join(REDUCE_DTYPES)}; got {self.reduce_dtype!r}",
                    key_path="parallel.fsdp.reduce_dtype",
                )
            object.__setattr__(self, "reduce_dtype", value)


@dataclass(frozen=True, slots=True, kw_only=True)
class ParallelConfig:
    """The ``parallel`` section: TP x PP x DP, schedule, ZeRO stage, DDP and FSDP knobs."""

    tp: int = 1
    pp: int = 1
    dp: int = 1
    schedule: ScheduleKind = ScheduleKind.ONE_F_ONE_B
    virtual_stages: int = 1
    """Model chunks per pipeline stage (interleaved 1F1B); 1 otherwise."""
    sequence_parallel: bool = False
    zero: int = 0
    """0 = DDP, 1 = optimizer states sharded, 2 = + gradients, 3 = + parameters (FSDP full
    shard)."""
    ddp: DDPConfig = field(default_factory=DDPConfig)
    fsdp: FSDPConfig = field(default_factory=FSDPConfig)
    ep: int = 1
    """Expert-parallel size: routed experts split over ep ranks (folded over tp x cp x dp)."""
    etp: int = 1
    """Expert tensor-parallel size: each expert's inner width split over etp ranks."""
    dispatcher: str | None = None
    """MoE token dispatcher (:data:`DISPATCHERS`): ``alltoall`` (k
    copies), ``deepep`` / ``hybridep`` (once per node over the network, then NVLink per GPU),
    ``allgather``; None: the stack's (``collsim.parallel.dispatch.STACK_DISPATCHER``), else
    ``alltoall``."""
    routing: str = "uniform"
    """Routing model of the dispatch volumes: ``uniform``, ``node_limited`` (with
    ``routing_nodes``), ``balanced`` (consecutive experts); the measured imbalance factor is
    ``model.load_imbalance``."""
    routing_nodes: int | None = None
    """M of node-limited routing: the nodes a token may reach (DeepSeek-V3: 4)."""
    dispatch_sms: int | None = None
    """SMs the dispatch kernels hold while they run beside compute (None: the dispatcher's)."""
    ep_overlap_mode: str = "none"
    """``none``, ``a2a`` (Megatron-Core --overlap-moe-expert-parallel-comm), ``dualpipe`` or
    ``dualpipev``; set from ``ep_overlap`` (true means ``a2a``)."""
    ep_overlap: bool | str = False
    """Hide the EP all-to-alls of the steady-state 1F1B ops behind compute (Megatron-Core
    ``--overlap-moe-expert-parallel-comm``: a forward and a backward of two micro-batches run
    layer by layer together, each one's dispatch and combine beside the other's compute;
    DeepSeek-V3's DualPipe pairs chunks the same way); see :mod:`collsim.step.comm_overlap`."""
    cp: int = 1
    """Context-parallel size: the sequence split over cp ranks (tp x cp x pp x dp GPUs)."""
    cp_algorithm: CPAlgorithm = CPAlgorithm.RING
    """``ring`` (Megatron-Core's default p2p exchange) or ``all_gather`` (Llama 3)."""
    cp_load_balance: bool = True
    """Causal load balancing: the sequence in 2 x cp chunks, rank i holding chunks i and
    2 cp - 1 - i (Megatron-Core / TE), so every rank has the same causal work."""
    layers_per_stage: tuple[int, ...] | None = None
    """Explicit layers per virtual pipeline stage (pp x virtual_stages entries, in virtual-stage
    order c x pp + s); the first (embedding) and last (head and loss) entries may be 0, the
    others must be positive; None: as ``pipeline_split`` says."""
    pipeline_split: str = "even"
    """``even``: layers / (pp x virtual_stages) per chunk, which must divide (as Megatron
    without first/last-stage layer counts); ``balanced``: as even as possible when they do
    not divide (``collsim.workload.memory.balanced_chunk_layers``)."""
    account_for_embedding: bool = False
    """The split counts the input embedding as one layer on the first stage (Megatron
    ``--account-for-embedding-in-pipeline-split``); implies a balanced split."""
    account_for_loss: bool = False
    """Balanced split counts the LM head and loss as one layer on the last stage (Megatron
    ``--account-for-loss-in-pipeline-split``)."""
    order: RankOrder | None = None
    """Rank layout (:class:`RankOrder`); None: :data:`DEFAULT_ORDER` for the plan (see
    :func:`default_order`)."""
    tp_overlap: bool | str = False
    """Overlap the sequence-parallel collectives with the GEMMs in chunks: ``userbuffers``
    (Megatron ``--tp-comm-overlap``, Transformer Engine), ``async_tp`` (torch AsyncTP,
    torchtitan ``enable_async_tensor_parallel``), true (the stack's: AsyncTP under
    torchtitan, else userbuffers) or false; see :mod:`collsim.parallel.tp_overlap`. Every
    stack ships it off (Megatron-Core ``ModelParallelConfig.tp_comm_overlap = False`` at
    d98e8a6; torchtitan ``enable_async_tensor_parallel = False`` at b5bcd76): recipes turn it
    on."""
    tp_overlap_mode: str = "none"
    """``none``, ``userbuffers``, ``async_tp`` or ``stack`` (true), set from ``tp_overlap``."""

    def __post_init__(self) -> None:
        for key in ("tp", "pp", "dp", "virtual_stages", "ep", "etp", "cp"):
            _positive(getattr(self, key), f"parallel.{key}")
        self._check_dispatch_keys()
        self._check_tp_overlap()
        object.__setattr__(
            self,
            "cp_algorithm",
            parse_enum(CPAlgorithm, self.cp_algorithm, key_path="parallel.cp_algorithm"),
        )
        if self.order is not None:
            object.__setattr__(
                self, "order", parse_enum(RankOrder, self.order, key_path="parallel.order")
            )
        if self.pipeline_split not in PIPELINE_SPLITS:
            raise ConfigError(
                f"must be one of {', '.join(PIPELINE_SPLITS)}; got {self.pipeline_split!r}",
                key_path="parallel.pipeline_split",
            )
        if self.layers_per_stage is not None:
            layers = tuple(self.layers_per_stage)
            if len(layers) != self.pp * self.virtual_stages or any(
                not isinstance(n, int) or isinstance(n, bool) or n < 0 for n in layers
            ):
                raise ConfigError(
                    f"must list pp x virtual_stages = {self.pp * self.virtual_stages} "
                    f"non-negative layer counts, got {list(layers)}",
                    key_path="parallel.layers_per_stage",
                )
            empty = [i for i, n in enumerate(layers[1:-1], start=1) if n == 0]
            if empty or sum(layers) == 0:
                raise ConfigError(
                    "only the first part (the embedding) and the last part (the head and "
                    f"loss) may hold 0 layers; part {empty[0] if empty else 0} of "
                    f"{list(layers)} is empty",
                    key_path="parallel.layers_per_stage",
                )
            object.__setattr__(self, "layers_per_stage", layers)
        object.__setattr__(
            self, "schedule", parse_enum(ScheduleKind, self.schedule, key_path="parallel.schedule")
        )
        if self.zero not in ZERO_STAGES:
            raise ConfigError(
                f"must be one of {', '.join(map(str, ZERO_STAGES))}; got {self.zero!r}",
                key_path="parallel.zero",
            )
        chunks = get_schedule(self.schedule).chunks(self.virtual_stages)
        if self.virtual_stages not in (1, chunks):
            raise ConfigError(
                f"virtual_stages > 1 needs schedule: interleaved, got schedule: {self.schedule}"
                if chunks == 1
                else f"schedule {self.schedule} holds {chunks} chunks per stage, got "
                f"virtual_stages {self.virtual_stages}",
                key_path="parallel.virtual_stages",
            )
        object.__setattr__(self, "virtual_stages", chunks)

    def _check_tp_overlap(self) -> None:
        """``tp_overlap`` on its own and against tp and sequence parallelism."""
        mode = self.tp_overlap
        if isinstance(mode, bool):
            mode = "stack" if mode else "none"
        if mode not in (*TP_OVERLAP_MODES, "stack"):
            raise ConfigError(
                f"must be true, false or one of {', '.join(TP_OVERLAP_MODES)}; got {mode!r}",
                key_path="parallel.tp_overlap",
            )
        object.__setattr__(self, "tp_overlap_mode", mode)  # tp_overlap kept as given
        check_tp_overlap(mode, tp=self.tp, sequence_parallel=self.sequence_parallel)

    def _check_dispatch_keys(self) -> None:
        """The MoE dispatch keys on their own (their fit to the cluster is checked with the
        plan: :func:`collsim.parallel.dispatch.check_dispatch`)."""
        mode = self.ep_overlap
        if isinstance(mode, bool):
            mode = "a2a" if mode else "none"
        if mode not in EP_OVERLAP_MODES:
            raise ConfigError(
                f"must be true, false or one of {', '.join(EP_OVERLAP_MODES)}; got {mode!r}",
                key_path="parallel.ep_overlap",
            )
        object.__setattr__(self, "ep_overlap_mode", mode)
        object.__setattr__(self, "ep_overlap", mode != "none")
        if self.dispatcher is not None and self.dispatcher not in DISPATCHERS:
            raise ConfigError(
                f"must be one of {', '.join(DISPATCHERS)}; got {self.dispatcher!r}",
                key_path="parallel.dispatcher",
            )
        if self.routing not in ROUTINGS:
            raise ConfigError(
                f"must be one of {', '.join(ROUTINGS)}; got {self.routing!r}",
                key_path="parallel.routing",
            )
        if self.routing_nodes is not None:
            _positive(self.routing_nodes, "parallel.routing_nodes")
            if self.routing != "node_limited":
                raise ConfigError(
                    f"needs routing: node_limited, got routing: {self.routing}",
                    key_path="parallel.routing_nodes",
                )
        if self.dispatch_sms is not None and self.dispatch_sms < 0:
            raise ConfigError(
                f"must be >= 0, got {self.dispatch_sms}", key_path="parallel.dispatch_sms"
            )

    @property
    def world_size(self) -> int:
        return self.tp * self.cp * self.pp * self.dp
