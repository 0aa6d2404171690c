"""Scenario files: the strict loader of ``collsim run``'s YAML, which checks a file against
:data:`SCENARIO` (:mod:`collsim.study.scenario_keys`) and reads each section into its config.

Derivations, measurements and sources: docs/derivations.md, ``collsim.study.scenario``.
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, TypeVar

from collsim.cluster.hardware import get_device
from collsim.cluster.topology import load_topology
from collsim.core.errors import ConfigError
from collsim.core.schema import (
    Section,
    check,
    raise_errors,
    read_described,
)
from collsim.core.yamlio import ConfigReader, YamlDoc, load_yaml
from collsim.parallel.config import (
    DDPConfig,
    FSDPConfig,
    ParallelConfig,
    TrainingConfig,
)
from collsim.step.stragglers import read_stragglers
from collsim.study.goodput.config import read_reliability
from collsim.study.overrides import Override, apply_overrides, locate, parse_override
from collsim.study.scenario_keys import (  # SCENARIO is also this module's
    _FIELD_TO_KEY,
    _MODEL,
    _PARALLEL,
    _TRAINING,
    SCENARIO,
)
from collsim.workload import TransformerSpec, get_preset
from collsim.workload.hf_config import spec_from_hf_config

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
