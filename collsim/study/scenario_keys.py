"""The description of every scenario key (:data:`SCENARIO`: its sections ``cluster``, ``model``,
``training``, ``parallel``, with ``reliability`` and ``stragglers`` from their modules): what
:func:`collsim.core.schema.check` checks a scenario file against, what the readers of
:mod:`collsim.study.scenario` read through, and what ``collsim schema scenario`` writes out.
"""

from __future__ import annotations

from collsim.cluster.hardware import list_devices
from collsim.core.schema import (
    Either,
    ListOf,
    Section,
    Value,
    choice_value,
    flag_value,
    non_negative_value,
    positive_value,
    text_value,
    values_of,
)
from collsim.core.vocab import Optimizer, RankOrder
from collsim.parallel.config import (
    DISPATCHERS,
    EP_OVERLAP_MODES,
    GRAD_SYNCS,
    PIPELINE_SPLITS,
    REDUCE_DTYPES,
    ROUTINGS,
    STACK_CHOICES,
    STACKS,
    ZERO_STAGES,
    CPAlgorithm,
    DDPConfig,
    Dtype,
    FP8Recipe,
    FSDPConfig,
    ParallelConfig,
    Recompute,
    ScheduleKind,
    TrainingConfig,
)
from collsim.parallel.tp_overlap import TP_OVERLAP_MODES
from collsim.step.stragglers import STRAGGLERS
from collsim.study.goodput.config import RELIABILITY
from collsim.workload.model import _NORMS, _POSITIONS, _ROUTERS
from collsim.workload.presets import preset_names

__all__ = ["SCENARIO"]

#: ``model.sliding_window_layers`` words (or a list of layer indices).
WINDOW_LAYER_CHOICES = ("all", "even", "odd")


_MODEL_SHAPE = ("layers", "hidden", "heads", "seq_len", "vocab")


def _size(field: str, text: str, zero: bool = False) -> Value:
    """A ``model`` integer, read into the TransformerSpec field ``field``: > 0 (>= 0 where
    ``zero``)."""
    return (non_negative_value if zero else positive_value)("integer", text, field=field)


_MODEL = Section(
    required=True,
    description="The transformer: a preset or an hf_config, and/or its shape.",
    one_of_required=(("preset",), ("hf_config",), _MODEL_SHAPE),
    missing_rule="missing required key (or give model.preset)",
    fields={
        "preset": choice_value(
            "A model preset name.",
            preset_names,
            fold_case=True,
            rule="unknown model preset {value!r}; valid presets: {choices}",
        ),
        "hf_config": text_value("A Hugging Face config.json (relative to the scenario file)."),
        "layers": _size("num_layers", "Transformer layers."),
        "hidden": _size("hidden", "Hidden size (model width)."),
        "heads": _size("num_heads", "Attention heads."),
        "kv_heads": _size(
            "num_kv_heads", "Key/value heads (grouped-query attention; default = heads)."
        ),
        "ffn_hidden": _size("ffn_hidden", "MLP inner size (default 4 x hidden without a preset)."),
        "seq_len": _size("seq_len", "Sequence length in tokens."),
        "vocab": _size("vocab", "Vocabulary size."),
        "head_dim": _size("head_size", "Head size when not hidden / heads."),
        "q_lora_rank": _size("q_lora_rank", "MLA query low-rank size."),
        "kv_lora_rank": _size("kv_lora_rank", "MLA key/value low-rank size."),
        "qk_nope_head_dim": _size(
            "qk_nope_head_dim", "MLA query/key head size without rotary part."
        ),
        "qk_rope_head_dim": _size(
            "qk_rope_head_dim", "MLA rotary part of the query/key head.", zero=True
        ),
        "v_head_dim": _size("v_head_dim", "MLA value head size."),
        "sliding_window": _size("sliding_window", "Sliding-window attention span, tokens."),
        "experts": _size("num_experts", "Routed experts per MoE layer (0 = dense).", zero=True),
        "top_k": _size("moe_top_k", "Experts each token is routed to."),
        "shared_experts": _size("num_shared_experts", "Shared experts per MoE layer.", zero=True),
        "expert_ffn_hidden": _size("moe_ffn_hidden", "Inner size of a routed expert."),
        "shared_expert_ffn_hidden": _size(
            "shared_expert_ffn_hidden", "Inner size of a shared expert."
        ),
        "first_k_dense": _size(
            "first_k_dense", "Leading dense layers before the MoE layers.", zero=True
        ),
        "gated_mlp": flag_value("SwiGLU-style MLP (three matrices)."),
        "norm": choice_value("Normalisation.", values_of(_NORMS)),
        "bias": flag_value("Linear layers carry biases."),
        "position_embedding": choice_value("Positions.", values_of(_POSITIONS)),
        "tied_embeddings": flag_value("The LM head shares the embedding matrix."),
        "dropout": flag_value("Dropout layers present."),
        "flash_attention": flag_value("Fused attention (no s x s scores kept)."),
        "qkv_bias": flag_value("Bias on the q, k, v projections only."),
        "qk_norm": flag_value("Norm on queries and keys."),
        "attention_sinks": flag_value("Learned attention sinks per head."),
        "router": choice_value("MoE router activation.", values_of(_ROUTERS)),
        "router_bias": flag_value("The router linear carries a bias."),
        "load_imbalance": Value(
            kind="number",
            minimum=1,
            rule="must be >= 1 (busiest over mean), got {value}",
            description="Busiest expert's tokens over the mean.",
        ),
        "capacity_factor": positive_value("number", "MoE capacity factor (null = dropless)."),
        "sliding_window_layers": Either(
            description="Layers with sliding-window attention: all, even, odd or a list.",
            options=(
                choice_value(
                    "all, even or odd.",
                    values_of(WINDOW_LAYER_CHOICES),
                    fold_case=True,
                    rule="must be all, even, odd or a list of layer indices; got {value!r}",
                ),
                ListOf(
                    items=non_negative_value("integer", "A layer index."),
                    description="Layer indices.",
                    item_rule="must list integer layer indices, got {item!r}",
                ),
            ),
            rule="must be all, even, odd or a list of layer indices; got {value!r}",
        ),
    },
)


_FIELD_TO_KEY = {
    spec.field: key for key, spec in _MODEL.fields.items() if isinstance(spec, Value) and spec.field
}
"""TransformerSpec field -> the ``model`` key it is read from, where the two names differ."""


_TRAINING = Section(
    builds=TrainingConfig,
    required=True,
    description="Batch, precision, optimizer, recompute, framework stack.",
    fields={
        "global_batch": positive_value(
            "integer", "Sequences per optimizer step, all replicas.", required=True
        ),
        "micro_batch": positive_value("integer", "Sequences per micro-batch."),
        "dtype": choice_value("Compute dtype.", values_of(Dtype), fold_case=True),
        "optimizer": choice_value("Optimizer.", values_of(Optimizer), fold_case=True),
        "recompute": choice_value(
            "Activation recomputation.", values_of(Recompute), fold_case=True
        ),
        "fp8_recipe": choice_value(
            "FP8 scaling recipe (with dtype: fp8).",
            values_of(FP8Recipe),
            fold_case=True,
        ),
        "stack": choice_value("Framework stack (sets the keys below).", values_of(STACKS)),
        "attention_kernel": choice_value(
            "Attention kernel.", values_of(STACK_CHOICES["attention_kernel"])
        ),
        "execution": choice_value("Host issue mode.", values_of(STACK_CHOICES["execution"])),
        "fused_kernels": flag_value("Hand-fused norm / bias-dropout-add / softmax kernels."),
        "grad_reduce_dtype": choice_value(
            "Dtype gradients are reduced in.", values_of(STACK_CHOICES["grad_reduce_dtype"])
        ),
        "grad_clip": flag_value("Clip gradients by their global norm."),
        "optimizer_implementation": choice_value(
            "fused or foreach.", values_of(STACK_CHOICES["optimizer_implementation"])
        ),
        "fsdp_version": choice_value(
            "torch FSDP 1 or FSDP2.", values_of(STACK_CHOICES["fsdp_version"]), kind="integer"
        ),
        "fp8_weight_cache": flag_value(
            "FP8 weights cast once per step (TE is_first_microbatch; stack megatron_te)."
        ),
        "fp8_param_gather": flag_value("Weights kept and all-gathered in FP8 (Megatron)."),
        "expandable_segments": flag_value(
            "Caching allocator with expandable_segments:True (default: the stack's)."
        ),
    },
)


_PARALLEL = Section(
    builds=ParallelConfig,
    description="The parallel plan: TP x CP x PP x DP, EP, schedule, ZeRO, DDP and FSDP knobs.",
    fields={
        "tp": positive_value("integer", "Tensor-parallel degree."),
        "pp": positive_value("integer", "Pipeline stages."),
        "dp": positive_value("integer", "Data-parallel replicas."),
        "cp": positive_value("integer", "Context-parallel degree."),
        "ep": positive_value("integer", "Expert-parallel degree (folded over tp x cp x dp)."),
        "etp": positive_value("integer", "Expert tensor-parallel degree."),
        "schedule": choice_value("Pipeline schedule.", values_of(ScheduleKind), fold_case=True),
        "virtual_stages": positive_value("integer", "Model chunks per stage (interleaved)."),
        "sequence_parallel": flag_value("Megatron sequence parallelism."),
        "zero": choice_value(
            "0 = DDP, 1, 2, 3 (= FSDP full shard).",
            values_of(ZERO_STAGES),
            kind="integer",
        ),
        "cp_algorithm": choice_value(
            "How CP ranks exchange K and V.", values_of(CPAlgorithm), fold_case=True
        ),
        "cp_load_balance": flag_value("Causal load balancing (2 x cp chunks)."),
        "order": choice_value(
            "Rank layout, fastest-varying first (Megatron order strings; default tp-cp-ep-dp-pp).",
            values_of(RankOrder),
        ),
        "ep_overlap": Either(
            options=(
                flag_value("true: a2a, false: none."),
                choice_value("Overlap mode.", values_of(EP_OVERLAP_MODES)),
            ),
            description="Overlap EP all-to-alls with the compute of a paired op (Megatron's "
            "--overlap-moe-expert-parallel-comm; DualPipe / DualPipeV).",
            rule="must be true, false, none, a2a, dualpipe or dualpipev; got {value!r}",
        ),
        "dispatcher": choice_value(
            "MoE token dispatcher (default: the stack's, else alltoall).", values_of(DISPATCHERS)
        ),
        "routing": choice_value("Routing model of the dispatch volumes.", values_of(ROUTINGS)),
        "routing_nodes": positive_value("integer", "M of node_limited routing (DeepSeek-V3: 4)."),
        "dispatch_sms": non_negative_value("integer", "SMs the dispatch kernels hold."),
        "tp_overlap": Either(
            options=(
                flag_value("true: the stack's (torchtitan: async_tp, else userbuffers)."),
                choice_value("Overlap kind.", values_of(TP_OVERLAP_MODES)),
            ),
            description="Overlap the sequence-parallel collectives with the GEMMs in chunks "
            "(Megatron --tp-comm-overlap userbuffers; torch AsyncTP).",
            rule="must be true, false, none, userbuffers or async_tp; got {value!r}",
        ),
        "pipeline_split": choice_value(
            "even (layers must divide) or balanced.", values_of(PIPELINE_SPLITS)
        ),
        "layers_per_stage": ListOf(
            items=non_negative_value(
                "integer", "Layers of one virtual stage (0 only for the first and the last)."
            ),
            min_items=1,
            description="Layers per virtual stage (pp x virtual_stages entries).",
        ),
        "account_for_embedding": flag_value("The split counts the embedding as a layer."),
        "account_for_loss": flag_value("The split counts the LM head and loss as a layer."),
        "ddp": Section(
            builds=DDPConfig,
            description="Gradient buckets (torch DDP).",
            fields={
                "bucket_mb": positive_value("number", "Bucket capacity in MiB."),
                "first_bucket_mb": positive_value("number", "First bucket in MiB."),
                "overlap": flag_value("Overlap with backward."),
                "gradient_as_bucket_view": flag_value("torch's gradient_as_bucket_view."),
            },
        ),
        "fsdp": Section(
            builds=FSDPConfig,
            description="ZeRO-3 / FSDP units.",
            fields={
                "prefetch": non_negative_value("integer", "Units all-gathered ahead."),
                "reshard_after_forward": flag_value("Reshard after forward."),
                "offload": flag_value("Offload to CPU memory."),
                "shard_group_size": positive_value(
                    "integer", "HSDP: shard inside groups of this size."
                ),
                "reduce_dtype": choice_value(
                    "Gradient reduction dtype.",
                    values_of(REDUCE_DTYPES),
                    fold_case=True,
                ),
                "fp8_all_gather": flag_value("All-gather FP8 weights."),
                "grad_sync": choice_value(
                    "ZeRO-3 gradients reduced every micro-batch or once per step.",
                    values_of(GRAD_SYNCS),
                ),
            },
        ),
    },
)


SCENARIO = Section(
    description="A collsim scenario: cluster, model, training and parallel plan "
    "(docs/scenarios.md).",
    fields={
        "name": text_value("Scenario name (default: the file's stem)."),
        "cluster": Section(
            required=True,
            description="The cluster to run on.",
            fields={
                "topology": text_value(
                    "A topology name (dgx_h100, ...) or a path to a topology file.", required=True
                ),
                "nodes": positive_value(
                    "integer", "Number of nodes (default: the topology file's)."
                ),
                "device": text_value(
                    "A device key or a device file that replaces the topology's device.",
                    json_choices=list_devices,
                ),
            },
        ),
        "model": _MODEL,
        "training": _TRAINING,
        "parallel": _PARALLEL,
        "reliability": RELIABILITY,
        "stragglers": STRAGGLERS,
    },
)
