"""Scenario files: the YAML schema of ``collsim run`` and its strict loader.

A scenario names a cluster, a model, a training setup and a parallel plan. Keys carry their
unit where they have one; unknown keys are rejected with ``file:line: key.path``. Schema::

    name: gpt3-175b-3d
    cluster: {topology: dgx_a100, nodes: 128}   # a name in topologies/ or a path to a YAML file
      # device: h800 | path/profile.yaml  (optional: replaces the topology's device)
    model:
      preset: gpt3-175b        # optional; the keys below override it (all needed without a preset)
      layers: 96
      hidden: 12288
      heads: 96
      kv_heads: 96             # grouped-query attention; default = heads
      ffn_hidden: 49152        # default 4 x hidden without a preset
      gated_mlp: false         # SwiGLU-style MLP (three matrices)
      norm: layernorm          # layernorm | rmsnorm
      bias: true               # linear layers carry biases
      position_embedding: learned   # learned | rotary
      tied_embeddings: true    # LM head shares the embedding matrix
      dropout: true
      seq_len: 2048
      vocab: 51200
      # or hf_config: path/config.json (relative to the scenario file), keys above override it
      # attention variants: head_dim, qkv_bias, qk_norm, attention_sinks, flash_attention,
      #   q_lora_rank, kv_lora_rank, qk_nope_head_dim, qk_rope_head_dim, v_head_dim (MLA),
      #   sliding_window, sliding_window_layers: all | even | odd | [0, 2, ...]
      # mixture of experts: experts, top_k, shared_experts, expert_ffn_hidden,
      #   shared_expert_ffn_hidden, first_k_dense, capacity_factor (null = dropless),
      #   router: softmax | sigmoid, router_bias, load_imbalance
    training: {global_batch: 1536, micro_batch: 1, dtype: bf16, optimizer: adam, recompute: full}
      # fp8_recipe: tensorwise | delayed | blockwise | mxfp8 (with dtype: fp8)
      # stack: megatron_te | nemo_automodel | torchtitan | llm_foundry | fsdp | deepspeed
      #   (sets the keys below and the MoE dispatcher)
      # attention_kernel: flash2 | flash3 | cudnn | triton | eager
      # execution: eager | compiled | cuda_graphs; fused_kernels: true | false
      # grad_reduce_dtype: fp32 | bf16; grad_clip: true | false
      # optimizer_implementation: fused | foreach; fsdp_version: 1 | 2
      # (collsim.parallel.config.STACKS and TrainingConfig document the defaults)
    parallel:
      tp: 8
      pp: 8
      dp: 16
      schedule: 1f1b           # gpipe | 1f1b | interleaved | zb_h1 | dualpipev
      virtual_stages: 1        # model chunks per stage (interleaved only)
      sequence_parallel: false
      zero: 1                  # 0 = DDP, 1, 2, 3 (= FSDP full shard)
      ddp: {bucket_mb: 25, first_bucket_mb: 1, overlap: true, gradient_as_bucket_view: false}
      fsdp: {prefetch: 1, reshard_after_forward: true, offload: false,
             shard_group_size: null, reduce_dtype: null, fp8_all_gather: false}
      ep: 1                    # expert parallel (folded over tp x cp x dp), etp: 1;
                               # ep_overlap: false | true | a2a | dualpipe | dualpipev;
                               # dispatcher: alltoall | deepep | hybridep | allgather,
                               # routing: uniform | node_limited | balanced,
                               # routing_nodes: M, dispatch_sms
      cp: 1                    # context parallel; cp_algorithm: ring | all_gather,
                               # cp_load_balance: true (2 x cp chunks)
      pipeline_split: even     # even (layers must divide) | balanced (uneven when not)
      layers_per_stage: null   # [n, ...] per virtual stage; account_for_embedding,
                               # account_for_loss: balanced split counts them as a layer
      order: tp-cp-ep-dp-pp    # rank layout, fastest first (or tp-cp-ep-pp-dp: dp outermost)
    reliability: {...}         # optional: failure rates, restarts, checkpoints (collsim goodput)
    stragglers:                # optional: slow GPUs / nodes / links (collsim.stragglers)
      slow_gpu: {ranks: [5], clock_factor: 0.9}

``--set key.path=value`` overrides (the value is parsed as YAML) are applied to the document
before it is read, so they go through the same checks; their errors are located at ``--set``.

Example::

    scenario = load_scenario("scenarios/3d_175b.yaml", ["parallel.dp=8", "cluster.nodes=64"])
    scenario.parallel.world_size        # 512
"""

from __future__ import annotations

import copy
import dataclasses
import os
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import yaml

from collsim.errors import ConfigError, ConfigErrors
from collsim.parallel.config import DDPConfig, FSDPConfig, ParallelConfig, TrainingConfig
from collsim.yamlio import ConfigReader, YamlDoc, load_yaml, non_negative, positive

if TYPE_CHECKING:
    from collsim.stragglers import StragglerConfig
    from collsim.study.goodput.config import ReliabilityConfig
    from collsim.topology import Topology
    from collsim.workload import TransformerSpec

__all__ = [
    "ClusterSpec",
    "Scenario",
    "load_scenario",
    "parse_override",
    "apply_overrides",
]

KeyPath = tuple[str, ...]

#: scenario key -> TransformerSpec field, for the ``model`` section.
MODEL_KEYS: dict[str, str] = {
    "layers": "num_layers",
    "hidden": "hidden",
    "heads": "num_heads",
    "kv_heads": "num_kv_heads",
    "ffn_hidden": "ffn_hidden",
    "seq_len": "seq_len",
    "vocab": "vocab",
    "head_dim": "head_size",
    "q_lora_rank": "q_lora_rank",
    "kv_lora_rank": "kv_lora_rank",
    "qk_nope_head_dim": "qk_nope_head_dim",
    "qk_rope_head_dim": "qk_rope_head_dim",
    "v_head_dim": "v_head_dim",
    "sliding_window": "sliding_window",
    "experts": "num_experts",
    "top_k": "moe_top_k",
    "shared_experts": "num_shared_experts",
    "expert_ffn_hidden": "moe_ffn_hidden",
    "shared_expert_ffn_hidden": "shared_expert_ffn_hidden",
    "first_k_dense": "first_k_dense",
}

#: MODEL_KEYS that may be 0 (the others must be > 0).
_ZERO_OK = ("qk_rope_head_dim", "shared_experts", "first_k_dense", "experts")

#: further TransformerSpec fields a scenario may set, with their YAML type.
MODEL_STYLE_KEYS: dict[str, type] = {
    "gated_mlp": bool,
    "norm": str,
    "bias": bool,
    "position_embedding": str,
    "tied_embeddings": bool,
    "dropout": bool,
    "flash_attention": bool,
    "qkv_bias": bool,
    "qk_norm": bool,
    "attention_sinks": bool,
    "router": str,
    "router_bias": bool,
    "load_imbalance": float,
}

_FIELD_TO_KEY = {attr: key for key, attr in MODEL_KEYS.items()}
_FIELD_TO_KEY["sliding_window_layers"] = "sliding_window_layers"
_FIELD_TO_KEY["capacity_factor"] = "capacity_factor"

#: ``model.sliding_window_layers`` words (or a list of layer indices).
WINDOW_LAYER_CHOICES = ("all", "even", "odd")

_REQUIRED_WITHOUT_PRESET = ("layers", "hidden", "heads", "seq_len", "vocab")

#: ``training`` keys of the framework stack (see ``collsim.parallel.config.STACKS``).
TRAINING_STACK_KEYS: dict[str, type] = {
    "stack": str,
    "attention_kernel": str,
    "execution": str,
    "fused_kernels": bool,
    "grad_reduce_dtype": str,
    "grad_clip": bool,
    "optimizer_implementation": str,
    "fsdp_version": int,
}


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
        """Build the topology (imports the topology layer on first use)."""
        from collsim.topology import load_topology

        topology = load_topology(self.topology, nodes=self.nodes)
        if self.device is not None:
            from collsim.hardware import get_device

            try:
                topology.device = get_device(self.device)
            except ConfigError as exc:
                if exc.file is not None:
                    raise
                raise ConfigError(exc.message, key_path="cluster.device") from None
        return topology


@dataclass(frozen=True, slots=True)
class _Override:
    text: str
    """``key.path=value`` as typed."""
    path: KeyPath
    value: Any


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
    overrides: tuple[_Override, ...] = field(default=(), repr=False, compare=False)

    def locate(self, error: ConfigError) -> ConfigError:
        """Add the file and line (or the ``--set`` it came from) to an error raised later.

        Errors raised when the plan is built against the topology (``parallel.tp``: heads not
        divisible, ...) carry a key path but no file; this points them at the scenario.
        """
        if self.doc is None:
            return error
        return _locate(error, self.doc, self.overrides)


# -- overrides ---------------------------------------------------------------------------------


def parse_override(text: str) -> _Override:
    """Parse one ``--set key.path=value``; the value is read as a YAML scalar or flow value.

    Raises:
        ConfigError: no ``=``, an empty key, or a value that is not valid YAML.
    """
    where = f"--set {text}"
    key, sep, raw = text.partition("=")
    key = key.strip()
    if not sep or not key:
        raise ConfigError("expected KEY.PATH=VALUE, e.g. parallel.tp=4", file=where)
    parts = tuple(p.strip() for p in key.split("."))
    if any(not p for p in parts):
        raise ConfigError("empty part in key path", key_path=key, file=where)
    try:
        value = yaml.safe_load(raw) if raw.strip() else None
    except yaml.YAMLError as exc:
        problem = getattr(exc, "problem", None) or "invalid YAML"
        raise ConfigError(
            f"cannot parse value {raw!r}: {problem}", key_path=key, file=where
        ) from None
    if value is None:
        raise ConfigError("missing value (use KEY.PATH=VALUE)", key_path=key, file=where)
    return _Override(text=text, path=parts, value=value)


def apply_overrides(data: dict[str, Any], overrides: Sequence[_Override]) -> dict[str, Any]:
    """A deep copy of ``data`` with each override written at its key path.

    Missing intermediate sections are created (``--set parallel.ddp.overlap=false`` works without
    a ``ddp`` section); keys nobody knows are rejected later by the reader, at ``--set``.

    Raises:
        ConfigError: an override walks into a value that is not a mapping.
    """
    out = copy.deepcopy(data)
    for override in overrides:
        node: Any = out
        for i, part in enumerate(override.path[:-1]):
            child = node.get(part)
            if child is None:
                child = node[part] = {}
            if not isinstance(child, dict):
                raise ConfigError(
                    f"{'.'.join(override.path[: i + 1])} is not a section",
                    key_path=".".join(override.path),
                    file=f"--set {override.text}",
                )
            node = child
        node[override.path[-1]] = override.value
    return out


# -- locating errors ---------------------------------------------------------------------------


def _split(key_path: str | None) -> KeyPath:
    return tuple(key_path.split(".")) if key_path else ()


def _locate(error: ConfigError, doc: YamlDoc, overrides: Sequence[_Override]) -> ConfigError:
    if isinstance(error, ConfigErrors):
        return ConfigErrors([_locate(e, doc, overrides) for e in error.errors])
    path = _split(error.key_path)
    # The last override that set the key (or a section above it) wins. An error in a
    # section the file does not have belongs to the override that created the section.
    for override in reversed(overrides):
        n = len(override.path)
        created = any(
            path[:k] == override.path[:k] and path[:k] not in doc.lines
            for k in range(1, min(len(path), n) + 1)
        )
        if path[:n] == override.path or created:
            return error.at(key_path=error.key_path, file=f"--set {override.text}", line=None)
    if error.file is not None and error.file != doc.file:
        return error
    line = doc.line_of(path) if path else None
    return error.at(
        key_path=error.key_path,
        file=doc.file,
        line=error.line if error.line is not None else line,
    )


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
            :class:`~collsim.errors.ConfigErrors` with every such error of the file when there
            is more than one (:func:`collsim.schema.check`).
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
    from collsim.schema import SCENARIO, check, raise_errors

    raise_errors([_locate(e, view, parsed) for e in check(view, SCENARIO)])  # all at once
    try:
        return _read(view, parsed, source)
    except ConfigError as exc:
        raise _locate(exc, view, parsed) from None


def _read(doc: YamlDoc, overrides: tuple[_Override, ...], source: Path | None) -> Scenario:
    root = ConfigReader(doc.data, doc=doc)
    default_name = source.stem if source is not None else "scenario"
    name = root.get("name", str, default=default_name)
    cluster = _read_cluster(root.section("cluster"), source)
    model = _read_model(root.section("model"), name, source)
    training = _read_training(root.section("training"))
    parallel = _read_parallel(root.section("parallel", default_empty=True))
    reliability = _read_reliability(root)
    stragglers = _read_stragglers(root)
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


def _read_reliability(root: ConfigReader) -> ReliabilityConfig | None:
    """The optional ``reliability`` section (:func:`collsim.study.goodput.read_reliability`)."""
    if root.get("reliability", dict, default=None) is None:
        return None
    from collsim.study.goodput.config import read_reliability

    return read_reliability(root.section("reliability"))


def _read_stragglers(root: ConfigReader) -> StragglerConfig | None:
    """The optional ``stragglers`` section, read by :func:`collsim.stragglers.read_stragglers`."""
    if root.get("stragglers", dict, default=None) is None:
        return None
    from collsim.stragglers import read_stragglers

    return read_stragglers(root.section("stragglers"))


def _read_cluster(reader: ConfigReader, source: Path | None) -> ClusterSpec:
    topology = reader.get("topology", str)
    nodes = reader.get("nodes", int, default=None, check=positive)
    device = reader.get("device", str, default=None)
    reader.finish()
    if device is not None:
        device = _resolve_topology(device, source)
    return ClusterSpec(topology=_resolve_topology(topology, source), nodes=nodes, device=device)


def _resolve_topology(spec: str, source: Path | None) -> str:
    """A path-looking topology is taken relative to the scenario file when it exists there."""
    looks_like_path = spec.endswith((".yaml", ".yml")) or os.sep in spec or "/" in spec
    if not looks_like_path or os.path.isabs(spec) or source is None:
        return spec
    beside = source.parent / spec
    return str(beside) if beside.exists() else spec


def _window_layers(reader: ConfigReader, values: dict[str, Any], base: Any) -> None:
    """``sliding_window_layers``: all | even | odd | a list of layer indices."""
    raw = reader.get("sliding_window_layers", (str, list), default=None)
    if raw is None:
        return
    layers = values.get("num_layers", base.num_layers if base is not None else 0)
    if isinstance(raw, str):
        choice = raw.lower()
        if choice == "all":
            values["sliding_window_layers"] = None
        elif choice in ("even", "odd"):
            values["sliding_window_layers"] = tuple(range(0 if choice == "even" else 1, layers, 2))
        else:
            raise reader.error(
                f"must be all, even, odd or a list of layer indices; got {raw!r}",
                "sliding_window_layers",
            )
        return
    if not all(isinstance(i, int) and not isinstance(i, bool) for i in raw):
        raise reader.error(f"must list integer layer indices, got {raw!r}", "sliding_window_layers")
    values["sliding_window_layers"] = tuple(raw)


def _read_hf_base(reader: ConfigReader, source: Path | None) -> Any:
    from collsim.workload.hf_config import spec_from_hf_config

    path = reader.get("hf_config", str, default=None)
    if path is None:
        return None
    p = Path(path)
    if not p.is_absolute() and source is not None and (source.parent / p).exists():
        p = source.parent / p
    seq = reader.data.get("seq_len") if isinstance(reader.data.get("seq_len"), int) else None
    return spec_from_hf_config(p, seq_len=seq)


def _read_model(
    reader: ConfigReader, scenario_name: str, source: Path | None = None
) -> TransformerSpec:
    from collsim.workload import TransformerSpec, get_preset

    preset_name = reader.get("preset", str, default=None)
    base = None
    if preset_name is not None:
        if reader.has("hf_config"):
            raise reader.error("give model.preset or model.hf_config, not both", "hf_config")
        try:
            base = get_preset(preset_name)
        except ConfigError as exc:
            raise reader.error(exc.message, "preset") from None
    else:
        base = _read_hf_base(reader, source)
    values: dict[str, Any] = {}
    for key, attr in MODEL_KEYS.items():
        check = non_negative if key in _ZERO_OK else positive
        value = reader.get(key, int, default=None, check=check)
        if value is not None:
            values[attr] = value
        elif base is None and key in _REQUIRED_WITHOUT_PRESET:
            raise reader.error("missing required key (or give model.preset)", key)
    for key, kind in MODEL_STYLE_KEYS.items():
        value = reader.get(key, kind, default=None)
        if value is not None:
            values[key] = value
    if reader.has("capacity_factor"):
        values["capacity_factor"] = reader.get(
            "capacity_factor", float, default=None, check=positive
        )
    _window_layers(reader, values, base)
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
    kwargs: dict[str, Any] = {"global_batch": reader.get("global_batch", int)}
    _copy_optional(
        reader,
        kwargs,
        {
            "micro_batch": int,
            "dtype": str,
            "optimizer": str,
            "recompute": str,
            "fp8_recipe": str,
            **TRAINING_STACK_KEYS,
        },
    )
    reader.finish()
    return TrainingConfig(**kwargs)


def _read_parallel(reader: ConfigReader) -> ParallelConfig:
    kwargs: dict[str, Any] = {}
    _copy_optional(
        reader,
        kwargs,
        {
            "tp": int,
            "pp": int,
            "dp": int,
            "schedule": str,
            "virtual_stages": int,
            "sequence_parallel": bool,
            "zero": int,
            "ep": int,
            "etp": int,
            "cp": int,
            "cp_algorithm": str,
            "cp_load_balance": bool,
            "pipeline_split": str,
            "account_for_embedding": bool,
            "account_for_loss": bool,
            "order": str,
            "ep_overlap": (bool, str),
            "dispatcher": str,
            "routing": str,
            "routing_nodes": int,
            "dispatch_sms": int,
        },
    )
    split = reader.get("layers_per_stage", list, default=None)
    if split is not None:
        kwargs["layers_per_stage"] = tuple(split)
    ddp = reader.section("ddp", default_empty=True)
    ddp_kwargs: dict[str, Any] = {}
    _copy_optional(
        ddp,
        ddp_kwargs,
        {
            "bucket_mb": float,
            "first_bucket_mb": float,
            "overlap": bool,
            "gradient_as_bucket_view": bool,
        },
    )
    ddp.finish()
    fsdp = reader.section("fsdp", default_empty=True)
    fsdp_kwargs: dict[str, Any] = {}
    _copy_optional(
        fsdp,
        fsdp_kwargs,
        {
            "prefetch": int,
            "reshard_after_forward": bool,
            "offload": bool,
            "shard_group_size": int,
            "reduce_dtype": str,
            "fp8_all_gather": bool,
        },
    )
    fsdp.finish()
    kwargs["ddp"] = DDPConfig(**ddp_kwargs)
    kwargs["fsdp"] = FSDPConfig(**fsdp_kwargs)
    reader.finish()
    return ParallelConfig(**kwargs)


def _copy_optional(
    reader: ConfigReader, out: dict[str, Any], kinds: dict[str, type | tuple[type, ...]]
) -> None:
    """Copy the keys that are present; the dataclass defaults apply to the others."""
    for key, kind in kinds.items():
        value = reader.get(key, kind, default=None)
        if value is not None:
            out[key] = value
