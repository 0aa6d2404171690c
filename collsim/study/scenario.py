"""Scenario files: the YAML schema of ``collsim run`` and its strict loader.

Derivations, measurements and sources: docs/derivations.md, ``collsim.study.scenario``.
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, TypeVar

from collsim.cluster.hardware import get_device, list_devices
from collsim.cluster.topology import load_topology
from collsim.core.errors import ConfigError
from collsim.core.schema import (
    Either,
    ListOf,
    Section,
    Value,
    check,
    choice_value,
    flag_value,
    non_negative_value,
    positive_value,
    raise_errors,
    read_described,
    text_value,
    values_of,
)
from collsim.core.vocab import Optimizer, RankOrder
from collsim.core.yamlio import ConfigReader, YamlDoc, load_yaml
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
from collsim.step.stragglers import STRAGGLERS, read_stragglers
from collsim.study.goodput.config import RELIABILITY, read_reliability
from collsim.study.overrides import Override, apply_overrides, locate, parse_override
from collsim.workload import TransformerSpec, get_preset
from collsim.workload.hf_config import spec_from_hf_config
from collsim.workload.model import _NORMS, _POSITIONS, _ROUTERS, preset_names

if TYPE_CHECKING:
    from collsim.cluster.topology import Topology
    from collsim.step.stragglers import StragglerConfig
    from collsim.study.goodput.config import ReliabilityConfig
    from collsim.workload import TransformerSpec

__all__ = [
    "SCENARIO",
    "ClusterSpec",
    "Scenario",
    "load_scenario",
    "parse_override",
    "apply_overrides",
]

KeyPath = tuple[str, ...]
T = TypeVar("T")

#: ``model.sliding_window_layers`` words (or a list of layer indices).
WINDOW_LAYER_CHOICES = ("all", "even", "odd")


@dataclass(frozen=True, slots=True, kw_only=True)
class ClusterSpec:
    """The ``cluster`` section."""

    topology: str
    """A topology name in ``topologies/`` (``dgx_a100``) or a path to a topology YAML file."""
    nodes: int | None = None
    """Number of nodes; None keeps the topology file's own count."""
    device: str | None = None
    """A device key or a device file (a measured profile from ``collsim validate compute``)
    that replaces the topology's device; None keeps it."""

    def load(self) -> Topology:
        """Build the topology, with the device ``device`` names in place of the file's."""
        device = None
        if self.device is not None:
            try:
                device = get_device(self.device)
            except ConfigError as exc:
                if exc.file is not None:
                    raise
                raise ConfigError(exc.message, key_path="cluster.device") from None
        return load_topology(self.topology, nodes=self.nodes, device=device)


@dataclass(frozen=True, kw_only=True)
class Scenario:
    """A loaded scenario: each section built into its own config object."""

    name: str
    cluster: ClusterSpec
    model: TransformerSpec
    training: TrainingConfig
    parallel: ParallelConfig
    reliability: ReliabilityConfig | None = None
    """The optional ``reliability`` section (``collsim goodput``)."""
    stragglers: StragglerConfig | None = None
    """The optional ``stragglers`` section (slow GPUs, nodes, links; ``collsim run``)."""
    source: Path | None = None
    """The scenario file (None when built from a string)."""
    doc: YamlDoc | None = field(default=None, repr=False, compare=False)
    overrides: tuple[Override, ...] = field(default=(), repr=False, compare=False)

    def locate(self, error: ConfigError) -> ConfigError:
        """Add the file and line (or the ``--set`` it came from) to an error raised later.

        Errors raised when the plan is built against the topology (``parallel.tp``: heads not
        divisible, ...) carry a key path but no file; this points them at the scenario.
        """
        if self.doc is None:
            return error
        return locate(error, self.doc, self.overrides)


# -- loading -----------------------------------------------------------------------------------


def load_scenario(path: str | Path, overrides: Sequence[str] = ()) -> Scenario:
    """Read a scenario file, apply ``--set`` overrides, and build each section.

    Args:
        path: the scenario YAML file.
        overrides: ``key.path=value`` strings, applied in order.

    Returns:
        The scenario, with its model spec, training and parallel configs.

    Raises:
        ConfigError: a missing file, a YAML syntax error, an unknown key, a wrong type or a bad
            value, located as ``file:line: key.path: message`` (or ``--set key=value: ...``);
            :class:`~collsim.core.errors.ConfigErrors` with every such error of the file when there
            is more than one (:func:`collsim.core.schema.check`).
    """
    doc = load_yaml(path)
    return scenario_from_doc(doc, overrides, source=Path(path))


def scenario_from_doc(
    doc: YamlDoc, overrides: Sequence[str] = (), *, source: Path | None = None
) -> Scenario:
    """Build a scenario from a parsed document (see :func:`load_scenario`)."""
    parsed = tuple(parse_override(text) for text in overrides)
    if not isinstance(doc.data, dict):
        raise ConfigError("a scenario must be a mapping of sections", file=doc.file, line=1)
    data = apply_overrides(doc.data, parsed)
    view = YamlDoc(data=data, file=doc.file, lines=doc.lines)
    raise_errors([locate(e, view, parsed) for e in check(view, SCENARIO)])  # all at once
    try:
        return _read(view, parsed, source)
    except ConfigError as exc:
        raise locate(exc, view, parsed) from None


def _read(doc: YamlDoc, overrides: tuple[Override, ...], source: Path | None) -> Scenario:
    root = ConfigReader(doc.data, doc=doc)
    default_name = source.stem if source is not None else "scenario"
    name = root.get("name", str, default=default_name)
    cluster = _read_cluster(root.section("cluster"), source)
    model = _read_model(root.section("model"), name, source)
    training = _read_training(root.section("training"))
    parallel = _read_parallel(root.section("parallel", default_empty=True))
    reliability = _read_optional(root, "reliability", read_reliability)
    stragglers = _read_optional(root, "stragglers", read_stragglers)
    root.finish()
    kernel = training.attention_kernel
    if kernel is not None and (kernel != "eager") != model.flash_attention:
        # the attention kernel decides activation memory: fused kernels keep no s x s scores
        model = dataclasses.replace(model, flash_attention=kernel != "eager")
    return Scenario(
        name=name,
        cluster=cluster,
        model=model,
        training=training,
        parallel=parallel,
        reliability=reliability,
        stragglers=stragglers,
        source=source,
        doc=doc,
        overrides=overrides,
    )


def _read_optional(root: ConfigReader, key: str, read: Callable[[ConfigReader], T]) -> T | None:
    """An optional section (``reliability``, ``stragglers``) built by its module's reader."""
    if root.get(key, dict, default=None) is None:
        return None
    return read(root.section(key))


def _read_cluster(reader: ConfigReader, source: Path | None) -> ClusterSpec:
    kwargs = read_described(reader, _section(SCENARIO, "cluster"))
    reader.finish()
    for key in ("topology", "device"):  # files are found beside the scenario first
        if key in kwargs:
            kwargs[key] = _resolve_topology(kwargs[key], source)
    return ClusterSpec(**kwargs)


def _resolve_topology(spec: str, source: Path | None) -> str:
    """A path-looking topology is taken relative to the scenario file when it exists there."""
    looks_like_path = spec.endswith((".yaml", ".yml")) or os.sep in spec or "/" in spec
    if not looks_like_path or os.path.isabs(spec) or source is None:
        return spec
    beside = source.parent / spec
    return str(beside) if beside.exists() else spec


def _read_model(
    reader: ConfigReader, scenario_name: str, source: Path | None = None
) -> TransformerSpec:
    values = read_described(reader, _MODEL)
    preset_name = values.pop("preset", None)
    hf_config = values.pop("hf_config", None)
    window = values.pop("sliding_window_layers", None)
    base = None
    if preset_name is not None:
        if hf_config is not None:
            raise reader.error("give model.preset or model.hf_config, not both", "hf_config")
        try:
            base = get_preset(preset_name)
        except ConfigError as exc:
            raise reader.error(exc.message, "preset") from None
    elif hf_config is not None:
        path = Path(hf_config)
        if not path.is_absolute() and source is not None and (source.parent / path).exists():
            path = source.parent / path
        base = spec_from_hf_config(path, seq_len=values.get("seq_len"))
    if reader.has("capacity_factor") and reader.data["capacity_factor"] is None:
        values["capacity_factor"] = None  # null: dropless, whatever the preset says
    if isinstance(window, str):  # all | even | odd (else a tuple of layer indices)
        layers = values.get("num_layers", base.num_layers if base is not None else 0)
        choice = window.lower()
        first = 0 if choice == "even" else 1
        window = None if choice == "all" else tuple(range(first, layers, 2))
    if reader.has("sliding_window_layers") and reader.data["sliding_window_layers"] is not None:
        values["sliding_window_layers"] = window
    reader.finish()
    _moe_keys_need_experts(reader, values, base)

    heads = values.get("num_heads", base.num_heads if base is not None else 0)
    hidden = values.get("hidden", base.hidden if base is not None else 0)
    kv_heads = values.get("num_kv_heads", base.num_kv_heads if base is not None else None)
    explicit_dim = values.get("head_size", base.head_size if base is not None else None)
    mla = values.get("kv_lora_rank", base.kv_lora_rank if base is not None else None)
    if explicit_dim is None and mla is None and hidden % heads:
        raise reader.error(f"hidden ({hidden}) must be divisible by heads ({heads})", "heads")
    if kv_heads is not None and heads % kv_heads:
        raise reader.error(
            f"heads ({heads}) must be divisible by kv_heads ({kv_heads})", "kv_heads"
        )
    try:
        if base is None:
            values.setdefault("ffn_hidden", 4 * values["hidden"])
            return TransformerSpec(name=scenario_name, **values)
        if not values:
            return base
        return dataclasses.replace(base, name=f"{base.name} (modified)", **values)
    except ConfigError as exc:
        # The spec names its fields (model.num_heads); the scenario calls them model.heads.
        field_name = (exc.key_path or "").removeprefix("model.")
        key = _FIELD_TO_KEY.get(field_name, field_name)
        raise reader.error(exc.message, key or None) from None


#: The model keys that describe experts: set on a dense model they would change nothing.
_MOE_KEYS = (
    "top_k",
    "shared_experts",
    "expert_ffn_hidden",
    "shared_expert_ffn_hidden",
    "first_k_dense",
    "capacity_factor",
    "router",
    "router_bias",
    "load_imbalance",
)


def _moe_keys_need_experts(
    reader: ConfigReader, values: dict[str, Any], base: TransformerSpec | None
) -> None:
    """A mixture-of-experts key given for a dense model (``experts`` 0 or unset, and a dense
    preset) is an error: the model has no router for it to change."""
    experts = values.get("num_experts", base.num_experts if base is not None else 0)
    if experts:
        return
    for key in _MOE_KEYS:
        if reader.has(key) and reader.data[key] is not None:
            raise reader.error(
                "only for a mixture-of-experts model: this model is dense (set model.experts "
                "to give it experts)",
                key,
            )


def _read_training(reader: ConfigReader) -> TrainingConfig:
    kwargs = read_described(reader, _TRAINING)
    reader.finish()
    return TrainingConfig(**kwargs)


def _read_parallel(reader: ConfigReader) -> ParallelConfig:
    kwargs = read_described(reader, _PARALLEL)
    for key, build in (("ddp", DDPConfig), ("fsdp", FSDPConfig)):
        sec = reader.section(key, default_empty=True)
        kwargs[key] = build(**read_described(sec, _section(_PARALLEL, key)))
        sec.finish()
    reader.finish()
    return ParallelConfig(**kwargs)


def _section(parent: Section, key: str) -> Section:
    spec = parent.fields[key]
    assert isinstance(spec, Section)
    return spec


# -- scenario (collsim.study.scenario and the readers it calls) ------------------------------------

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
            items=positive_value("integer", "Layers of one virtual stage."),
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
