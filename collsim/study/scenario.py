"""Scenario files: the YAML schema of ``collsim run`` and its strict loader.

Derivations, measurements and sources: docs/derivations.md, ``collsim.study.scenario``.
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

from collsim.cluster.hardware import get_device, list_devices
from collsim.cluster.topology import load_topology
from collsim.core.errors import ConfigError, ConfigErrors
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
from collsim.core.yamlio import ConfigReader, YamlDoc, load_yaml, non_negative, positive
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
from collsim.step.stragglers import STRAGGLERS, read_stragglers
from collsim.study.goodput.config import COMPONENTS, read_reliability
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

#: The ``model`` section's integer keys: scenario key -> (TransformerSpec field, description,
#: whether 0 is allowed). The reader and the description (:data:`SCENARIO`) both follow it.
MODEL_SHAPE_KEYS: dict[str, tuple[str, str, bool]] = {
    "layers": ("num_layers", "Transformer layers.", False),
    "hidden": ("hidden", "Hidden size (model width).", False),
    "heads": ("num_heads", "Attention heads.", False),
    "kv_heads": (
        "num_kv_heads",
        "Key/value heads (grouped-query attention; default = heads).",
        False,
    ),
    "ffn_hidden": ("ffn_hidden", "MLP inner size (default 4 x hidden without a preset).", False),
    "seq_len": ("seq_len", "Sequence length in tokens.", False),
    "vocab": ("vocab", "Vocabulary size.", False),
    "head_dim": ("head_size", "Head size when not hidden / heads.", False),
    "q_lora_rank": ("q_lora_rank", "MLA query low-rank size.", False),
    "kv_lora_rank": ("kv_lora_rank", "MLA key/value low-rank size.", False),
    "qk_nope_head_dim": ("qk_nope_head_dim", "MLA query/key head size without rotary part.", False),
    "qk_rope_head_dim": ("qk_rope_head_dim", "MLA rotary part of the query/key head.", True),
    "v_head_dim": ("v_head_dim", "MLA value head size.", False),
    "sliding_window": ("sliding_window", "Sliding-window attention span, tokens.", False),
    "experts": ("num_experts", "Routed experts per MoE layer (0 = dense).", True),
    "top_k": ("moe_top_k", "Experts each token is routed to.", False),
    "shared_experts": ("num_shared_experts", "Shared experts per MoE layer.", True),
    "expert_ffn_hidden": ("moe_ffn_hidden", "Inner size of a routed expert.", False),
    "shared_expert_ffn_hidden": (
        "shared_expert_ffn_hidden",
        "Inner size of a shared expert.",
        False,
    ),
    "first_k_dense": ("first_k_dense", "Leading dense layers before the MoE layers.", True),
}

#: scenario key -> TransformerSpec field, for the ``model`` section's integer keys.
MODEL_KEYS: dict[str, str] = {key: field for key, (field, _, _) in MODEL_SHAPE_KEYS.items()}

_FIELD_TO_KEY = {attr: key for key, attr in MODEL_KEYS.items()}
_FIELD_TO_KEY["sliding_window_layers"] = "sliding_window_layers"
_FIELD_TO_KEY["capacity_factor"] = "capacity_factor"

#: ``model.sliding_window_layers`` words (or a list of layer indices).
WINDOW_LAYER_CHOICES = ("all", "even", "odd")

_REQUIRED_WITHOUT_PRESET = ("layers", "hidden", "heads", "seq_len", "vocab")


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

    return read_reliability(root.section("reliability"))


def _read_stragglers(root: ConfigReader) -> StragglerConfig | None:
    """The optional ``stragglers`` section, read by
    :func:`collsim.step.stragglers.read_stragglers`."""
    if root.get("stragglers", dict, default=None) is None:
        return None

    return read_stragglers(root.section("stragglers"))


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
    for key, (attr, _, zero_ok) in MODEL_SHAPE_KEYS.items():
        check = non_negative if zero_ok else positive
        value = reader.get(key, int, default=None, check=check)
        if value is not None:
            values[attr] = value
        elif base is None and key in _REQUIRED_WITHOUT_PRESET:
            raise reader.error("missing required key (or give model.preset)", key)
    # the other scalar keys the description lists are TransformerSpec fields of the same name
    style = {k: v for k, v in _MODEL.fields.items() if k not in _MODEL_NOT_STYLE}
    values.update(read_described(reader, Section(fields=style)))
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
    kwargs = read_described(reader, _TRAINING)
    reader.finish()
    return TrainingConfig(**kwargs)


def _read_parallel(reader: ConfigReader) -> ParallelConfig:
    kwargs = read_described(reader, _PARALLEL)
    ep_overlap = reader.get("ep_overlap", (bool, str), default=None)
    if ep_overlap is not None:
        kwargs["ep_overlap"] = ep_overlap
    ddp = reader.section("ddp", default_empty=True)
    ddp_kwargs = read_described(ddp, _section(_PARALLEL, "ddp"))
    ddp.finish()
    fsdp = reader.section("fsdp", default_empty=True)
    fsdp_kwargs = read_described(fsdp, _section(_PARALLEL, "fsdp"))
    fsdp.finish()
    kwargs["ddp"] = DDPConfig(**ddp_kwargs)
    kwargs["fsdp"] = FSDPConfig(**fsdp_kwargs)
    reader.finish()
    return ParallelConfig(**kwargs)


def _section(parent: Section, key: str) -> Section:
    spec = parent.fields[key]
    assert isinstance(spec, Section)
    return spec


# -- scenario (collsim.study.scenario and the readers it calls) ------------------------------------

_MODEL_SHAPE = ("layers", "hidden", "heads", "seq_len", "vocab")

_RELIABILITY = Section(
    description="Failure rates, restarts, spares, checkpoints and storage (collsim goodput).",
    fields={
        "duration_days": positive_value("number", "Length of the run, days (default 30)."),
        "detection_s": non_negative_value("number", "Failure to job declared dead, s."),
        "components": Section(
            required=True,
            description="Failure rate per component.",
            keys=values_of(COMPONENTS),
            key_rule="unknown component {key!r}; must be one of {choices}",
            values=Section(
                nullable=False,
                description="One failure source.",
                exactly_one=("mtbf_hours", "per_1000_node_days"),
                exactly_one_rule="give exactly one of mtbf_hours and per_1000_node_days",
                fields={
                    "mtbf_hours": positive_value(
                        "number", "Mean time between failures per node, h."
                    ),
                    "per_1000_node_days": non_negative_value(
                        "number", "Failures per 1,000 node-days."
                    ),
                    "nodes_affected": positive_value("integer", "Nodes one event takes out."),
                    "replace_fraction": Value(
                        kind="number",
                        minimum=0,
                        maximum=1,
                        rule="must be in 0..1, got {value}",
                        description="Share of events whose nodes are swapped for spares.",
                    ),
                },
            ),
        ),
        "restart": Section(
            description="What a restart costs beside loading the checkpoint.",
            fields={
                "reschedule_s": non_negative_value("number", "Re-allocating and relaunching, s."),
                "process_start_s": non_negative_value("number", "Process start to first step, s."),
                "warmup_steps": non_negative_value(
                    "integer", "Steps after a restart counted as lost."
                ),
            },
        ),
        "spares": Section(
            description="The pool of spare nodes.",
            fields={
                "nodes": non_negative_value(
                    "integer", "Spare nodes at the start (default: unlimited)."
                ),
                "repair_hours": positive_value(
                    "number", "A failed node returns after this long, h."
                ),
            },
        ),
        "checkpoint": Section(
            description="How and how often the job saves its state.",
            fields={
                "interval_s": Either(
                    description="Training time between checkpoints, s, or auto (the optimum).",
                    options=(
                        positive_value(
                            "number", "Seconds.", rule="must be > 0 or auto, got {value}"
                        ),
                        choice_value(
                            "auto",
                            ("auto",),
                            rule="must be a number of seconds or auto, got {value!r}",
                        ),
                    ),
                    rule="must be a number of seconds or auto, got {value!r}",
                ),
                "sharded": flag_value("Every rank writes its own shard."),
                "async": flag_value("Snapshot to host memory, write in the background."),
                "snapshot_bandwidth_gbps": positive_value(
                    "number", "Device-to-host copy per GPU, GB/s."
                ),
            },
        ),
        "storage": Section(
            required=True,
            description="The shared storage checkpoints go to.",
            fields={
                "write_bandwidth_gbps": positive_value(
                    "number", "Aggregate write, GB/s.", required=True
                ),
                "read_bandwidth_gbps": positive_value(
                    "number", "Aggregate read, GB/s (default: write)."
                ),
                "per_rank_write_bandwidth_gbps": positive_value(
                    "number", "One writer's bandwidth, GB/s."
                ),
                "per_rank_read_bandwidth_gbps": positive_value(
                    "number", "One reader's bandwidth, GB/s."
                ),
            },
        ),
    },
)

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
        **{
            key: (non_negative_value if zero else positive_value)("integer", text)
            for key, (_, text, zero) in MODEL_SHAPE_KEYS.items()
        },
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

_MODEL_NOT_STYLE = {"preset", "hf_config", "capacity_factor", *MODEL_SHAPE_KEYS}
"""``model`` keys read on their own (the rest are TransformerSpec flags and choices)."""

_TRAINING = Section(
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
    },
)

_PARALLEL = Section(
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
            description="Gradient buckets (torch DDP).",
            fields={
                "bucket_mb": positive_value("number", "Bucket capacity in MiB."),
                "first_bucket_mb": positive_value("number", "First bucket in MiB."),
                "overlap": flag_value("Overlap with backward."),
                "gradient_as_bucket_view": flag_value("torch's gradient_as_bucket_view."),
            },
        ),
        "fsdp": Section(
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
        "reliability": _RELIABILITY,
        "stragglers": STRAGGLERS,
    },
)
