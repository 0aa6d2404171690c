"""The schema of scenario and topology files: one description, two uses.

:data:`SCENARIO` and :data:`TOPOLOGY` describe every key of the two file kinds (type, range,
choices, whether it is required, what it means). From that one description:

- :func:`check` validates a parsed document and returns **every** error at once, each located
  ``file:line: key.path: message`` with the same words the loaders use; the loaders call it first
  (:func:`collsim.scenario.load_scenario`, :func:`collsim.topology.load_topology`) and raise
  :class:`~collsim.errors.ConfigErrors` when there is more than one;
- :func:`json_schema` writes a JSON Schema (draft 2020-12) for editors and CI
  (``collsim schema scenario > scenario.schema.json``).

Rules between keys (``hidden`` divisible by ``heads``, ``tp x pp x dp`` = GPUs, a knee's
efficiency below its op's) stay in the loaders, which run after the schema has passed.
A key added to a loader must be added here too: ``tests/robust/test_schema.py`` compares the
keys each loader knows with this schema.

Where the loaders are lenient the schema is strict: enum values are written in lower case
(the loaders also accept ``BF16``), and presets and devices are listed by their keys (the
loaders also accept a device's full name).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from collsim.errors import ConfigError
from collsim.yamlio import YamlDoc

__all__ = ["Value", "Section", "SCENARIO", "TOPOLOGY", "SCHEMAS", "check", "json_schema"]

KeyPath = tuple[str | int, ...]


@dataclass(frozen=True, kw_only=True)
class Value:
    """One scalar key."""

    kind: str
    """``integer``, ``number``, ``string`` or ``boolean`` (JSON Schema type names)."""
    description: str = ""
    required: bool = False
    minimum: float | None = None
    exclusive_minimum: float | None = None
    maximum: float | None = None
    enum: tuple[Any, ...] | None = None
    """Allowed values (strings compared in lower case, as the loaders do)."""
    choices: Callable[[], list[str]] | None = None
    """Allowed values listed in the JSON Schema only (presets, devices: the loaders check
    these themselves, with their own messages)."""
    rule: str | None = None
    """The message of a range rule when it is not the generic one."""


@dataclass(frozen=True, kw_only=True)
class Section:
    """A mapping of named keys, or (``values``) of free keys that all share one schema."""

    fields: dict[str, Value | Section] = field(default_factory=dict)
    description: str = ""
    required: bool = False
    values: Value | Section | None = None
    """Schema of every value, for a mapping keyed by ``keys`` (ops -> algorithm, ...)."""
    keys: tuple[str, ...] = ()
    key_rule: str = ""
    """The message for a key not in ``keys``."""
    one_of_required: tuple[tuple[str, ...], ...] = ()
    """Alternatives of required keys (the model: a ``preset`` or all of its shape keys)."""
    missing_rule: str = "missing required key"


def _pos(kind: str, description: str, **kw: Any) -> Value:
    return Value(kind=kind, description=description, exclusive_minimum=0, **kw)


def _nonneg(kind: str, description: str, **kw: Any) -> Value:
    return Value(kind=kind, description=description, minimum=0, **kw)


def _fraction(description: str) -> Value:
    return Value(
        kind="number",
        description=description,
        exclusive_minimum=0,
        maximum=1,
        rule="must be in (0, 1], got {value}",
    )


def _presets() -> list[str]:
    from collsim.workload import preset_names

    return preset_names()


def _devices() -> list[str]:
    from collsim.hardware import list_devices

    return list_devices()


# -- scenario ------------------------------------------------------------------------------------

_MODEL_SHAPE = ("layers", "hidden", "heads", "seq_len", "vocab")

SCENARIO = Section(
    description="A collsim scenario: cluster, model, training and parallel plan "
    "(docs/scenarios.md).",
    fields={
        "name": Value(kind="string", description="Scenario name (default: the file's stem)."),
        "cluster": Section(
            required=True,
            description="The cluster to run on.",
            fields={
                "topology": Value(
                    kind="string",
                    required=True,
                    description="A topology name (dgx_h100, ...) or a path to a topology file.",
                ),
                "nodes": _pos("integer", "Number of nodes (default: the topology file's)."),
            },
        ),
        "model": Section(
            required=True,
            description="The transformer: a preset, and/or its shape.",
            one_of_required=(("preset",), _MODEL_SHAPE),
            missing_rule="missing required key (or give model.preset)",
            fields={
                "preset": Value(
                    kind="string", description="A model preset name.", choices=_presets
                ),
                "layers": _pos("integer", "Transformer layers."),
                "hidden": _pos("integer", "Hidden size (model width)."),
                "heads": _pos("integer", "Attention heads."),
                "kv_heads": _pos("integer", "Key/value heads (grouped-query attention)."),
                "ffn_hidden": _pos("integer", "MLP inner size (default 4 x hidden)."),
                "seq_len": _pos("integer", "Sequence length in tokens."),
                "vocab": _pos("integer", "Vocabulary size."),
                "gated_mlp": Value(kind="boolean", description="SwiGLU-style MLP."),
                "norm": Value(
                    kind="string", enum=("layernorm", "rmsnorm"), description="Normalisation."
                ),
                "bias": Value(kind="boolean", description="Linear layers carry biases."),
                "position_embedding": Value(
                    kind="string", enum=("learned", "rotary"), description="Positions."
                ),
                "tied_embeddings": Value(
                    kind="boolean", description="The LM head shares the embedding matrix."
                ),
                "dropout": Value(kind="boolean", description="Dropout layers present."),
            },
        ),
        "training": Section(
            required=True,
            description="Batch, precision, optimizer, recompute.",
            fields={
                "global_batch": _pos(
                    "integer", "Sequences per optimizer step, all replicas.", required=True
                ),
                "micro_batch": _pos("integer", "Sequences per micro-batch."),
                "dtype": Value(
                    kind="string", enum=("bf16", "fp16", "fp32", "fp8"), description="Dtype."
                ),
                "optimizer": Value(kind="string", enum=("adam", "sgd"), description="Optimizer."),
                "recompute": Value(
                    kind="string",
                    enum=("none", "selective", "full"),
                    description="Activation recomputation.",
                ),
            },
        ),
        "parallel": Section(
            description="The parallel plan: TP x PP x DP, schedule, ZeRO, DDP and FSDP knobs.",
            fields={
                "tp": _pos("integer", "Tensor-parallel degree."),
                "pp": _pos("integer", "Pipeline stages."),
                "dp": _pos("integer", "Data-parallel replicas."),
                "schedule": Value(
                    kind="string",
                    enum=("gpipe", "1f1b", "interleaved"),
                    description="Pipeline schedule.",
                ),
                "virtual_stages": _pos("integer", "Model chunks per stage (interleaved)."),
                "sequence_parallel": Value(kind="boolean", description="Megatron SP."),
                "zero": Value(
                    kind="integer",
                    enum=(0, 1, 2, 3),
                    description="0 = DDP, 1, 2, 3 (= FSDP full shard).",
                ),
                "ddp": Section(
                    description="Gradient buckets (torch DDP).",
                    fields={
                        "bucket_mb": _pos("number", "Bucket capacity in MiB."),
                        "first_bucket_mb": _pos("number", "First bucket in MiB."),
                        "overlap": Value(kind="boolean", description="Overlap with backward."),
                        "gradient_as_bucket_view": Value(
                            kind="boolean", description="torch's gradient_as_bucket_view."
                        ),
                    },
                ),
                "fsdp": Section(
                    description="ZeRO-3 / FSDP units.",
                    fields={
                        "prefetch": _nonneg("integer", "Units all-gathered ahead."),
                        "reshard_after_forward": Value(kind="boolean", description="Reshard."),
                        "offload": Value(kind="boolean", description="Offload to CPU memory."),
                    },
                ),
            },
        ),
    },
)

# -- topology ------------------------------------------------------------------------------------

_OPS = ("all_reduce", "reduce_scatter", "all_gather", "broadcast", "reduce", "all_to_all",
        "send_recv")  # fmt: skip
_ALGORITHMS = ("auto", "ring", "tree", "halving_doubling", "direct", "hierarchical", "nvls")
_OP_RULE = "unknown op (choose from " + ", ".join(_OPS) + ")"


def _link(extra: dict[str, Value | Section]) -> dict[str, Value | Section]:
    return {
        **extra,
        "efficiency": _fraction("Achievable / line rate."),
        "latency_us": _nonneg("number", "Per-hop latency in microseconds."),
    }


TOPOLOGY = Section(
    description="A collsim topology: one node type and the fabric (docs/topologies.md).",
    fields={
        "name": Value(kind="string", required=True, description="Topology name."),
        "description": Value(kind="string", description="Free text."),
        # device: a catalogue key, a device file, or a device mapping inline (the topology
        # reader checks it; open here)
        "nodes": _pos("integer", "Default node count."),
        "gpus_per_node": _pos("integer", "Ranks per node.", required=True),
        "intra_node": Section(
            required=True,
            description="What connects the GPUs of a node.",
            fields=_link(
                {
                    "interconnect": Value(
                        kind="string",
                        required=True,
                        enum=("nvswitch", "pcie_switch", "loopback"),
                        description="NVSwitch, a PCIe switch, or the kernel's loopback.",
                    ),
                    "bandwidth_gbps": _pos(
                        "number", "Per-direction bandwidth per GPU, GB/s.", required=True
                    ),
                    "nvls": Value(kind="boolean", description="NVSwitch reduction (NVLS)."),
                }
            ),
        ),
        "nics": Section(
            description="Network interfaces of a node (needed for more than one node).",
            fields=_link(
                {
                    "count": _pos("integer", "NICs per node.", required=True),
                    "rate_gbit": _pos("number", "Line rate per NIC, Gb/s.", required=True),
                }
            ),
        ),
        "fabric": Section(
            description="The network between nodes.",
            fields={
                "kind": Value(kind="string", enum=("fat_tree",), description="Fabric kind."),
                "rails": Value(kind="boolean", description="Rail-optimised."),
                "oversubscription": Value(
                    kind="number",
                    minimum=1,
                    rule="must be >= 1 (1 = non-blocking), got {value}",
                    description="Leaf uplink oversubscription.",
                ),
                "nodes_per_leaf": _pos("integer", "Nodes per leaf switch."),
                "latency_us": _nonneg("number", "Per-hop latency in microseconds."),
            },
        ),
        "host": Section(
            description="Host memory link.",
            fields={"bandwidth_gbps": _pos("number", "Host <-> GPU bandwidth, GB/s.")},
        ),
        "collectives": Section(
            description="Collective library settings.",
            fields={
                "library": Value(kind="string", enum=("nccl", "gloo"), description="Library."),
                "overhead_us": _nonneg("number", "Launch overhead per call, microseconds."),
                "algorithms": Section(
                    description="Algorithm per op.",
                    keys=_OPS,
                    key_rule=_OP_RULE,
                    values=Value(kind="string", enum=_ALGORITHMS, description="Algorithm."),
                ),
                "ops": Section(
                    description="Per-op calibration.",
                    keys=_OPS,
                    key_rule=_OP_RULE,
                    values=Section(
                        fields={
                            "overhead_us": _nonneg("number", "Overhead per call, us."),
                            "efficiency": _fraction("Achievable / modelled bandwidth."),
                            "knee_bytes": _nonneg("number", "Size above which the knee holds."),
                            "knee_efficiency": _fraction("Efficiency above the knee."),
                        }
                    ),
                ),
            },
        ),
    },
)

#: ``collsim schema KIND`` choices.
SCHEMAS: dict[str, Section] = {"scenario": SCENARIO, "topology": TOPOLOGY}

# -- checking ------------------------------------------------------------------------------------

_TYPE_WORDS = {
    "integer": "an integer",
    "number": "a number",
    "string": "a string",
    "boolean": "true or false",
}


def _dotted(path: KeyPath) -> str:
    return ".".join(str(p) for p in path)


def _type_error(value: Any, kind: str) -> str | None:
    if kind == "boolean":
        ok = isinstance(value, bool)
    elif kind == "string":
        ok = isinstance(value, str)
    elif kind == "integer":
        ok = isinstance(value, int) and not isinstance(value, bool)
    else:
        ok = isinstance(value, int | float) and not isinstance(value, bool)
    if not ok:
        return f"must be {_TYPE_WORDS[kind]}, got {value!r}"
    if isinstance(value, float) and not math.isfinite(value):
        return f"must be a finite number, got {value!r}"
    return None


def _value_error(value: Any, spec: Value) -> str | None:
    problem = _type_error(value, spec.kind)
    if problem:
        return problem
    if spec.enum is not None and not OPEN:
        probe = value.lower() if isinstance(value, str) else value
        if probe not in spec.enum:
            return f"must be one of {', '.join(map(str, spec.enum))}; got {value!r}"
    low_ok = True
    if spec.exclusive_minimum is not None and not value > spec.exclusive_minimum:
        low_ok = False
        generic = f"must be > {spec.exclusive_minimum:g}, got {value}"
    elif spec.minimum is not None and not value >= spec.minimum:
        low_ok = False
        generic = f"must be >= {spec.minimum:g}, got {value}"
    high_ok = spec.maximum is None or value <= spec.maximum
    if not high_ok:
        generic = f"must be <= {spec.maximum:g}, got {value}"
    if not (low_ok and high_ok):
        return spec.rule.format(value=value) if spec.rule else generic
    return None


OPEN = True
"""The readers (``collsim.scenario``, ``collsim.topology``) are the authority on which keys and
values exist: sections here list the keys documented so far and are checked for types and
ranges only (NaN, infinities, negative sizes, wrong types: every such error of a file at
once); unknown keys, missing keys and enumerations are left to the readers, which name the
key and the choices. The JSON Schema is open the same way (additional properties allowed)."""


def check(doc: YamlDoc, schema: Section) -> list[ConfigError]:
    """Every schema error of ``doc``, in file order, each with its file, line and key path."""
    errors: list[tuple[int, int, ConfigError]] = []

    def add(path: KeyPath, message: str, line: int | None = None) -> None:
        if line is None:
            line = doc.line_of(path) if path else doc.lines.get(())
        err = ConfigError(message, key_path=_dotted(path) or None, file=doc.file, line=line)
        errors.append((line or 0, len(errors), err))

    def walk(data: Any, spec: Value | Section, path: KeyPath) -> None:
        if isinstance(spec, Value):
            problem = _value_error(data, spec)
            if problem:
                add(path, problem)
            return
        if not isinstance(data, dict):
            add(path, f"must be a mapping, got {_kind_of(data)}")
            return
        if spec.values is not None:
            for key, value in data.items():
                if key not in spec.keys:
                    if not OPEN:
                        add(path + (key,), spec.key_rule)
                elif value is not None or isinstance(spec.values, Value):
                    walk(value, spec.values, path + (key,))
            return
        unknown: list[str] = []
        for key, value in data.items():
            if key not in spec.fields:
                unknown.append(key)
                continue
            sub = spec.fields[key]
            if value is not None:
                walk(value, sub, path + (key,))
        missing = [k for k, sub in spec.fields.items() if sub.required and data.get(k) is None]
        rule = _missing(spec.fields[missing[0]]) if missing else ""
        if spec.one_of_required and not any(
            all(data.get(k) is not None for k in group) for group in spec.one_of_required
        ):
            missing += [k for k in spec.one_of_required[-1] if data.get(k) is None]
            rule = rule or spec.missing_rule
        if OPEN:
            return
        if missing:
            # Missing keys of one mapping are one error, naming the others; a misspelt key
            # there is what explains it, so it is named in the same line.
            also = f" (also missing: {', '.join(missing[1:])})" if missing[1:] else ""
            found = ", ".join(f"{k!r} at line {doc.line_of(path + (k,))}" for k in unknown)
            hint = f"; unknown key(s) here: {found}" if unknown else ""
            at = doc.line_of(path + (unknown[0],)) if unknown else None
            add(path + (missing[0],), rule + also + hint, at)
        else:
            known = ", ".join(sorted(spec.fields))
            for key in unknown:
                add(path + (key,), f"unknown key (known keys here: {known})")

    walk(doc.data, schema, ())
    return [err for _, _, err in sorted(errors, key=lambda t: (t[0], t[1]))]


def _missing(spec: Value | Section) -> str:
    return "missing required section" if isinstance(spec, Section) else "missing required key"


def _kind_of(value: Any) -> str:
    return {
        list: "a list",
        str: "a string",
        bool: "a boolean",
        int: "an integer",
        float: "a number",
        type(None): "nothing",
    }.get(type(value), type(value).__name__)


def raise_errors(errors: list[ConfigError]) -> None:
    """Raise the one error, or all of them as :class:`~collsim.errors.ConfigErrors`."""
    from collsim.errors import ConfigErrors

    if len(errors) == 1:
        raise errors[0]
    if errors:
        raise ConfigErrors(errors)


# -- JSON Schema ---------------------------------------------------------------------------------


def _json(spec: Value | Section) -> dict[str, Any]:
    if isinstance(spec, Value):
        out: dict[str, Any] = {"type": spec.kind}
        if spec.description:
            out["description"] = spec.description
        if spec.enum is not None and not OPEN:
            out["enum"] = list(spec.enum)
        if spec.choices is not None and not OPEN:
            out["enum"] = list(spec.choices())
        if spec.exclusive_minimum is not None:
            out["exclusiveMinimum"] = spec.exclusive_minimum
        if spec.minimum is not None:
            out["minimum"] = spec.minimum
        if spec.maximum is not None:
            out["maximum"] = spec.maximum
        return out
    out = {"type": "object"}
    if spec.description:
        out["description"] = spec.description
    if spec.values is not None:
        out["propertyNames"] = {"enum": list(spec.keys)}
        out["additionalProperties"] = _json(spec.values)
        return out
    out["properties"] = {key: _json(sub) for key, sub in spec.fields.items()}
    out["additionalProperties"] = OPEN
    required = [key for key, sub in spec.fields.items() if sub.required]
    if required and not OPEN:
        out["required"] = required
    if spec.one_of_required and not OPEN:
        out["anyOf"] = [{"required": list(group)} for group in spec.one_of_required]
    return out


def json_schema(kind: str) -> dict[str, Any]:
    """The JSON Schema (draft 2020-12) of ``scenario`` or ``topology`` files.

    Raises:
        ConfigError: an unknown kind.
    """
    if kind not in SCHEMAS:
        raise ConfigError(f"must be one of {', '.join(SCHEMAS)}; got {kind!r}", key_path="KIND")
    out = {
        "$schema": "https://json-schema.org/draft/2020-12/schema",
        "$id": f"https://collsim.invalid/schema/{kind}.schema.json",
        "title": f"collsim {kind} file",
        **_json(SCHEMAS[kind]),
    }
    return out
