"""The schema of scenario, topology and device files: one description, two uses.

:data:`SCENARIO`, :data:`TOPOLOGY` and :data:`DEVICE` describe every key of the three file
kinds (type, range, choices, whether it is required, what it means). From that description:

- :func:`check` validates a parsed document and returns **every** error at once, each located
  ``file:line: key.path: message`` with the same words the readers use; the loaders call it
  first (:func:`collsim.scenario.load_scenario`, :func:`collsim.topology.load_topology`),
  before any other work, and raise :class:`~collsim.errors.ConfigErrors` when there is more
  than one;
- :func:`json_schema` writes a JSON Schema (draft 2020-12) for editors and CI
  (``collsim schema scenario > scenario.schema.json``).

The schema is closed: a key it does not list is an error (with ``did you mean`` where a known
key is close). Choices are read from the constants and enums the readers use
(:mod:`collsim.parallel.config`, :mod:`collsim.workload.model`, :mod:`collsim.topology`, ...),
lazily, so that importing this module stays cheap.

Rules between keys (``hidden`` divisible by ``heads``, ``tp x pp x dp`` = GPUs, a knee's
efficiency below its op's, ``peak_tflops.bf16`` present) stay in the readers, which run after
the schema has passed. A key added to a reader must be added here too:
``tests/robust/test_schema.py`` compares the keys each reader knows with this schema both
ways (every key the readers read is listed here; an example of every key listed here is read
without an unknown-key error).

Where the readers are lenient the JSON Schema is strict: choices the readers lower-case
(``dtype: BF16``, ``preset: GPT3-175B``) are listed in lower case, and devices by their
catalogue keys or a ``*.yaml`` path (the readers also accept a device's full name);
:func:`check` lets those through to the readers. Where JSON Schema is lenient, :func:`check`
is not: ``2.0`` is a JSON Schema integer, not a collsim one.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from collsim.errors import ConfigError
from collsim.yamlio import YamlDoc, type_name, unknown_key_message, with_hint

__all__ = [
    "Value",
    "ListOf",
    "Either",
    "Anything",
    "Section",
    "Spec",
    "SCENARIO",
    "TOPOLOGY",
    "DEVICE",
    "SCHEMAS",
    "check",
    "json_schema",
    "raise_errors",
    "choices_of",
]

KeyPath = tuple[str | int, ...]
Choices = tuple[Any, ...] | Callable[[], Sequence[Any]]
"""Allowed values: a tuple, or a function that returns them (read from a reader's module)."""


@dataclass(frozen=True, kw_only=True)
class Value:
    """One scalar key."""

    kind: str
    """``integer``, ``number``, ``string`` or ``boolean`` (JSON Schema type names); a number
    key takes integers too, as the readers do."""
    description: str = ""
    required: bool = False
    nullable: bool = True
    """``key: null`` counts as absent (the reader's default); False where the reader
    refuses ``null``."""
    minimum: float | None = None
    exclusive_minimum: float | None = None
    maximum: float | None = None
    enum: Choices | None = None
    """Allowed values, checked here and listed in the JSON Schema."""
    fold_case: bool = False
    """Compare strings in lower case (the reader lower-cases them); the JSON Schema lists the
    lower-case spellings."""
    json_choices: Callable[[], Sequence[str]] | None = None
    """Values listed in the JSON Schema only, beside any ``*.yaml`` path (devices: the reader
    also takes a full name and checks it with its own message)."""
    rule: str | None = None
    """The message of a failed range or choice, ``{value}`` / ``{value!r}`` / ``{choices}``
    filled in, when it is not the generic one."""


@dataclass(frozen=True, kw_only=True)
class ListOf:
    """A list whose items share one schema."""

    items: Spec | None
    """Schema of every item; None: items of any kind (a reader checks them)."""
    description: str = ""
    required: bool = False
    nullable: bool = True
    min_items: int = 0
    unique: bool = False
    item_rule: str | None = None
    """The message of a bad item (``{item!r}``) when it is not ``item N: <the item's error>``."""
    min_rule: str = "must have at least {min_items} item(s)"
    unique_rule: str = "names an entry twice: {value}"


@dataclass(frozen=True, kw_only=True)
class Either:
    """A key that takes one of several shapes (a number or ``auto``, a key or a mapping)."""

    options: tuple[Spec, ...]
    description: str = ""
    required: bool = False
    nullable: bool = True
    rule: str
    """The message of a value that has none of the options' types (``{value!r}``)."""


@dataclass(frozen=True, kw_only=True)
class Anything:
    """Free content the reader keeps as it is (``measured.notes``)."""

    description: str = ""
    required: bool = False
    nullable: bool = True


@dataclass(frozen=True, kw_only=True)
class Section:
    """A mapping of named keys (``fields``), or of free keys that share one schema (``values``)."""

    fields: dict[str, Spec] = field(default_factory=dict)
    description: str = ""
    required: bool = False
    nullable: bool = True
    values: Spec | None = None
    """Schema of every value, for a mapping keyed by ``keys`` (ops -> algorithm, ...)."""
    keys: Choices | None = None
    """The keys a ``values`` mapping may have; None: any key."""
    key_rule: str = "unknown key; must be one of {choices}"
    """The message for a key not in ``keys`` (``{key!r}``, ``{choices}``)."""
    one_of_required: tuple[tuple[str, ...], ...] = ()
    """Alternatives of required keys (the model: a ``preset``, an ``hf_config`` or its shape)."""
    missing_rule: str = "missing required key"
    exactly_one: tuple[str, ...] = ()
    """Keys of which exactly one must be given."""
    exactly_one_rule: str = ""


Spec = Value | ListOf | Either | Anything | Section


def choices_of(choices: Choices) -> tuple[Any, ...]:
    """The values of a :data:`Choices` (calls the function of a lazy one)."""
    return tuple(choices() if callable(choices) else choices)


# -- shorthands -----------------------------------------------------------------------------------


def _pos(kind: str, description: str, **kw: Any) -> Value:
    return Value(kind=kind, description=description, exclusive_minimum=0, **kw)


def _nonneg(kind: str, description: str, **kw: Any) -> Value:
    return Value(kind=kind, description=description, minimum=0, **kw)


def _flag(description: str, **kw: Any) -> Value:
    return Value(kind="boolean", description=description, **kw)


def _text(description: str, **kw: Any) -> Value:
    return Value(kind="string", description=description, **kw)


def _fraction(description: str, **kw: Any) -> Value:
    return Value(
        kind="number",
        description=description,
        exclusive_minimum=0,
        maximum=1,
        rule=kw.pop("rule", "must be in (0, 1], got {value}"),
        **kw,
    )


def _choice(description: str, choices: Choices, **kw: Any) -> Value:
    kind = kw.pop("kind", "string")
    return Value(kind=kind, description=description, enum=choices, **kw)


# -- choices, read from the readers' modules ------------------------------------------------------


def _enum_values(module: str, name: str) -> Callable[[], list[Any]]:
    """The values of ``module.name``: a StrEnum, a tuple, or a dict's keys."""

    def get() -> list[Any]:
        import importlib

        obj = getattr(importlib.import_module(module), name)
        if isinstance(obj, dict):
            return list(obj)
        return [getattr(v, "value", v) for v in obj]

    return get


def _stack_choices(key: str) -> Callable[[], list[Any]]:
    def get() -> list[Any]:
        from collsim.parallel.config import STACK_CHOICES

        return list(STACK_CHOICES[key])

    return get


def _presets() -> list[str]:
    from collsim.workload.model import preset_names

    return preset_names()


def _devices() -> list[str]:
    from collsim.hardware import list_devices

    return list_devices()


_CONFIG = "collsim.parallel.config"
_SPEC_MODULE = "collsim.workload.model"
_TOPO = "collsim.topology"
_TRANSPORTS = "collsim.transports"

# -- device (collsim.hardware.device_from_reader; collsim/data/devices/*.yaml) --------------------

_TFLOPS = Section(
    description="TFLOP/s by dtype key (bf16, fp16, fp32, tf32, fp8, fp4; bfloat16 ... aliases).",
    values=_pos("number", "TFLOP/s (dense).", nullable=False),
)

DEVICE = Section(
    description="A device (accelerator or CPU socket) in collsim's device schema "
    "(collsim.hardware; collsim/data/devices/*.yaml).",
    fields={
        "key": _text("Catalogue key (default: the file stem)."),
        "name": _text("Full name, e.g. H100 SXM.", required=True),
        "aliases": ListOf(items=_text("Another name."), description="Other names."),
        "description": _text("Free text."),
        "generation": _choice(
            "Picks the attention-kernel tables.", _enum_values("collsim.hardware", "GENERATIONS")
        ),
        "peak_tflops": Section(
            required=True,
            description="Dense peak TFLOP/s by dtype (bf16 required).",
            values=_TFLOPS.values,
        ),
        "mamf_tflops": Either(
            required=True,
            description="Measured best-shape matmul TFLOP/s: a bf16 figure, or by dtype.",
            options=(_pos("number", "bf16 TFLOP/s."), _TFLOPS),
            rule="must be a number or a mapping of dtype to TFLOP/s, got {value!r}",
        ),
        "sm_count": _pos("integer", "SMs / compute units / CPU cores."),
        "clocks": Section(
            description="Clocks in MHz.",
            fields={
                "boost_mhz": _pos("number", "The clock MAMF ran at."),
                "sustained_mhz": _pos("number", "The clock sustained in training."),
            },
        ),
        "power_w": _pos("number", "Power limit the device runs at, W."),
        "reference_power_w": _pos("number", "Power its MAMF was measured at, W."),
        "memory_gb": _pos("number", "Datasheet memory, GB (1e9 bytes).", required=True),
        "memory_bandwidth_tbps": _pos("number", "Memory bandwidth, TB/s.", required=True),
        "reported_memory_gib": _pos("number", "Capacity PyTorch / nvidia-smi report, GiB."),
        "reserve_gib": _nonneg("number", "Memory the framework cannot use, GiB."),
        "interference": Section(
            description="What a running collective takes from compute.",
            fields={"nccl_sms": _nonneg("integer", "SMs NCCL holds.")},
        ),
        "measured": Section(
            nullable=False,
            description="Kernel tables of a measured profile (collsim validate compute).",
            fields={
                "gemm": ListOf(items=None, description="[m, n, k, dtype, flops_per_s] rows."),
                "attention": ListOf(items=None, description="Attention kernel rows."),
                "bandwidth": ListOf(items=None, description="[bytes, bytes_per_s] rows."),
                "optimizer_bytes_per_s": Value(kind="number", description="Optimizer rate."),
                "launch_us": Value(kind="number", description="Kernel launch cost, us."),
                "host_us": Value(kind="number", description="Host cost per op, us."),
                "activation": ListOf(
                    items=None, description="[kind, elements, fwd_gelem_s, bwd_gelem_s] rows."
                ),
                "notes": Anything(description="Free notes."),
                "concurrent_slowdown": Value(
                    kind="number",
                    minimum=1,
                    rule="must be >= 1",
                    description="Slowdown of compute kernels beside other busy cores.",
                ),
                "concurrent_memory_slowdown": Value(
                    kind="number",
                    minimum=1,
                    rule="must be >= 1",
                    description="Slowdown of memory-bound kernels beside other busy cores.",
                ),
            },
        ),
    },
)

# -- scenario (collsim.scenario and the readers it calls) -----------------------------------------

_MODEL_SHAPE = ("layers", "hidden", "heads", "seq_len", "vocab")

_RELIABILITY = Section(
    description="Failure rates, restarts, spares, checkpoints and storage (collsim goodput).",
    fields={
        "duration_days": _pos("number", "Length of the run, days (default 30)."),
        "detection_s": _nonneg("number", "Failure to job declared dead, s."),
        "components": Section(
            required=True,
            description="Failure rate per component.",
            keys=_enum_values("collsim.study.goodput.config", "COMPONENTS"),
            key_rule="unknown component {key!r}; must be one of {choices}",
            values=Section(
                nullable=False,
                description="One failure source.",
                exactly_one=("mtbf_hours", "per_1000_node_days"),
                exactly_one_rule="give exactly one of mtbf_hours and per_1000_node_days",
                fields={
                    "mtbf_hours": _pos("number", "Mean time between failures per node, h."),
                    "per_1000_node_days": _nonneg("number", "Failures per 1,000 node-days."),
                    "nodes_affected": _pos("integer", "Nodes one event takes out."),
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
                "reschedule_s": _nonneg("number", "Re-allocating and relaunching, s."),
                "process_start_s": _nonneg("number", "Process start to first step, s."),
                "warmup_steps": _nonneg("integer", "Steps after a restart counted as lost."),
            },
        ),
        "spares": Section(
            description="The pool of spare nodes.",
            fields={
                "nodes": _nonneg("integer", "Spare nodes at the start (default: unlimited)."),
                "repair_hours": _pos("number", "A failed node returns after this long, h."),
            },
        ),
        "checkpoint": Section(
            description="How and how often the job saves its state.",
            fields={
                "interval_s": Either(
                    description="Training time between checkpoints, s, or auto (the optimum).",
                    options=(
                        _pos("number", "Seconds.", rule="must be > 0 or auto, got {value}"),
                        _choice(
                            "auto",
                            ("auto",),
                            rule="must be a number of seconds or auto, got {value!r}",
                        ),
                    ),
                    rule="must be a number of seconds or auto, got {value!r}",
                ),
                "sharded": _flag("Every rank writes its own shard."),
                "async": _flag("Snapshot to host memory, write in the background."),
                "snapshot_bandwidth_gbps": _pos("number", "Device-to-host copy per GPU, GB/s."),
            },
        ),
        "storage": Section(
            required=True,
            description="The shared storage checkpoints go to.",
            fields={
                "write_bandwidth_gbps": _pos("number", "Aggregate write, GB/s.", required=True),
                "read_bandwidth_gbps": _pos("number", "Aggregate read, GB/s (default: write)."),
                "per_rank_write_bandwidth_gbps": _pos("number", "One writer's bandwidth, GB/s."),
                "per_rank_read_bandwidth_gbps": _pos("number", "One reader's bandwidth, GB/s."),
            },
        ),
    },
)

_INDEX_RULE = "must be non-negative integers, got {item!r}"


def _indices(what: str, **kw: Any) -> ListOf:
    """A list of distinct rank or node indices (collsim.stragglers)."""
    return ListOf(
        items=_nonneg("integer", f"A {what}."),
        description=f"{what.capitalize()}s.",
        min_items=1,
        unique=True,
        min_rule="must name at least one",
        item_rule=_INDEX_RULE,
        **kw,
    )


_FACTOR_RULE = "must be in [0.001, 1] (1 = full speed), got {value}"


def _factor(description: str, **kw: Any) -> Value:
    """A straggler's share of full speed, in [0.001, 1] (collsim.stragglers.MIN_FACTOR)."""
    return Value(kind="number", description=description, minimum=0.001, maximum=1, **kw)


_STRAGGLERS = Section(
    description="Slow GPUs, nodes and links (collsim run, collsim sweep).",
    fields={
        "slow_gpu": Section(
            description="GPUs whose compute runs slower.",
            fields={
                "ranks": _indices("rank", required=True),
                "clock_factor": _factor("Share of full speed.", required=True, rule=_FACTOR_RULE),
            },
        ),
        "slow_node": Section(
            description="Nodes whose every GPU computes slower.",
            fields={
                "nodes": _indices("node", required=True),
                "clock_factor": _factor("Share of full speed.", required=True, rule=_FACTOR_RULE),
            },
        ),
        "slow_link": Section(
            description="Links at a share of their capacity: a port of named ranks, or links.",
            one_of_required=(("ranks",), ("links",)),
            missing_rule="name ranks (with a port) or links",
            fields={
                "bandwidth_factor": _factor(
                    "Share of the link's capacity left.", required=True, rule=_FACTOR_RULE
                ),
                "ranks": ListOf(
                    items=_nonneg("integer", "A rank."),
                    description="These ranks' port runs at the factor.",
                    unique=True,
                    item_rule=_INDEX_RULE,
                ),
                "port": _choice("nic or nvlink.", _enum_values("collsim.stragglers", "PORTS")),
                "links": ListOf(
                    items=_text("A link name (n1.nic3.tx, rail0.leaf1.up)."),
                    description="Links as the topology names them.",
                ),
            },
        ),
    },
)

_MODEL_INT_KEYS: dict[str, tuple[str, bool]] = {
    # scenario key -> (description, zero allowed); the keys of collsim.scenario.MODEL_KEYS
    "layers": ("Transformer layers.", False),
    "hidden": ("Hidden size (model width).", False),
    "heads": ("Attention heads.", False),
    "kv_heads": ("Key/value heads (grouped-query attention; default = heads).", False),
    "ffn_hidden": ("MLP inner size (default 4 x hidden without a preset).", False),
    "seq_len": ("Sequence length in tokens.", False),
    "vocab": ("Vocabulary size.", False),
    "head_dim": ("Head size when not hidden / heads.", False),
    "q_lora_rank": ("MLA query low-rank size.", False),
    "kv_lora_rank": ("MLA key/value low-rank size.", False),
    "qk_nope_head_dim": ("MLA query/key head size without rotary part.", False),
    "qk_rope_head_dim": ("MLA rotary part of the query/key head.", True),
    "v_head_dim": ("MLA value head size.", False),
    "sliding_window": ("Sliding-window attention span, tokens.", False),
    "experts": ("Routed experts per MoE layer (0 = dense).", True),
    "top_k": ("Experts each token is routed to.", False),
    "shared_experts": ("Shared experts per MoE layer.", True),
    "expert_ffn_hidden": ("Inner size of a routed expert.", False),
    "shared_expert_ffn_hidden": ("Inner size of a shared expert.", False),
    "first_k_dense": ("Leading dense layers before the MoE layers.", True),
}

_MODEL = Section(
    required=True,
    description="The transformer: a preset or an hf_config, and/or its shape.",
    one_of_required=(("preset",), ("hf_config",), _MODEL_SHAPE),
    missing_rule="missing required key (or give model.preset)",
    fields={
        "preset": _choice(
            "A model preset name.",
            _presets,
            fold_case=True,
            rule="unknown model preset {value!r}; valid presets: {choices}",
        ),
        "hf_config": _text("A Hugging Face config.json (relative to the scenario file)."),
        **{
            key: (_nonneg if zero else _pos)("integer", text)
            for key, (text, zero) in _MODEL_INT_KEYS.items()
        },
        "gated_mlp": _flag("SwiGLU-style MLP (three matrices)."),
        "norm": _choice("Normalisation.", _enum_values(_SPEC_MODULE, "_NORMS")),
        "bias": _flag("Linear layers carry biases."),
        "position_embedding": _choice("Positions.", _enum_values(_SPEC_MODULE, "_POSITIONS")),
        "tied_embeddings": _flag("The LM head shares the embedding matrix."),
        "dropout": _flag("Dropout layers present."),
        "flash_attention": _flag("Fused attention (no s x s scores kept)."),
        "qkv_bias": _flag("Bias on the q, k, v projections only."),
        "qk_norm": _flag("Norm on queries and keys."),
        "attention_sinks": _flag("Learned attention sinks per head."),
        "router": _choice("MoE router activation.", _enum_values(_SPEC_MODULE, "_ROUTERS")),
        "router_bias": _flag("The router linear carries a bias."),
        "load_imbalance": Value(
            kind="number",
            minimum=1,
            rule="must be >= 1 (busiest over mean), got {value}",
            description="Busiest expert's tokens over the mean.",
        ),
        "capacity_factor": _pos("number", "MoE capacity factor (null = dropless)."),
        "sliding_window_layers": Either(
            description="Layers with sliding-window attention: all, even, odd or a list.",
            options=(
                _choice(
                    "all, even or odd.",
                    _enum_values("collsim.scenario", "WINDOW_LAYER_CHOICES"),
                    fold_case=True,
                    rule="must be all, even, odd or a list of layer indices; got {value!r}",
                ),
                ListOf(
                    items=_nonneg("integer", "A layer index."),
                    description="Layer indices.",
                    item_rule="must list integer layer indices, got {item!r}",
                ),
            ),
            rule="must be all, even, odd or a list of layer indices; got {value!r}",
        ),
    },
)

_TRAINING = Section(
    required=True,
    description="Batch, precision, optimizer, recompute, framework stack.",
    fields={
        "global_batch": _pos(
            "integer", "Sequences per optimizer step, all replicas.", required=True
        ),
        "micro_batch": _pos("integer", "Sequences per micro-batch."),
        "dtype": _choice("Compute dtype.", _enum_values(_CONFIG, "Dtype"), fold_case=True),
        "optimizer": _choice("Optimizer.", _enum_values(_CONFIG, "Optimizer"), fold_case=True),
        "recompute": _choice(
            "Activation recomputation.", _enum_values(_CONFIG, "Recompute"), fold_case=True
        ),
        "fp8_recipe": _choice(
            "FP8 scaling recipe (with dtype: fp8).",
            _enum_values(_CONFIG, "FP8Recipe"),
            fold_case=True,
        ),
        "stack": _choice("Framework stack (sets the keys below).", _enum_values(_CONFIG, "STACKS")),
        "attention_kernel": _choice("Attention kernel.", _stack_choices("attention_kernel")),
        "execution": _choice("Host issue mode.", _stack_choices("execution")),
        "fused_kernels": _flag("Hand-fused norm / bias-dropout-add / softmax kernels."),
        "grad_reduce_dtype": _choice(
            "Dtype gradients are reduced in.", _stack_choices("grad_reduce_dtype")
        ),
        "grad_clip": _flag("Clip gradients by their global norm."),
        "optimizer_implementation": _choice(
            "fused or foreach.", _stack_choices("optimizer_implementation")
        ),
        "fsdp_version": _choice(
            "torch FSDP 1 or FSDP2.", _stack_choices("fsdp_version"), kind="integer"
        ),
    },
)

_PARALLEL = Section(
    description="The parallel plan: TP x CP x PP x DP, EP, schedule, ZeRO, DDP and FSDP knobs.",
    fields={
        "tp": _pos("integer", "Tensor-parallel degree."),
        "pp": _pos("integer", "Pipeline stages."),
        "dp": _pos("integer", "Data-parallel replicas."),
        "cp": _pos("integer", "Context-parallel degree."),
        "ep": _pos("integer", "Expert-parallel degree (folded over tp x cp x dp)."),
        "etp": _pos("integer", "Expert tensor-parallel degree."),
        "schedule": _choice(
            "Pipeline schedule.", _enum_values(_CONFIG, "ScheduleKind"), fold_case=True
        ),
        "virtual_stages": _pos("integer", "Model chunks per stage (interleaved)."),
        "sequence_parallel": _flag("Megatron sequence parallelism."),
        "zero": _choice(
            "0 = DDP, 1, 2, 3 (= FSDP full shard).",
            _enum_values(_CONFIG, "ZERO_STAGES"),
            kind="integer",
        ),
        "cp_algorithm": _choice(
            "How CP ranks exchange K and V.", _enum_values(_CONFIG, "CPAlgorithm"), fold_case=True
        ),
        "cp_load_balance": _flag("Causal load balancing (2 x cp chunks)."),
        "order": _choice(
            "Rank layout, fastest-varying first (Megatron order strings; default tp-cp-ep-dp-pp).",
            _enum_values("collsim.vocab", "RankOrder"),
        ),
        "ep_overlap": Either(
            options=(
                _flag("true: a2a, false: none."),
                _choice("Overlap mode.", _enum_values(_CONFIG, "EP_OVERLAP_MODES")),
            ),
            description="Overlap EP all-to-alls with the compute of a paired op (Megatron's "
            "--overlap-moe-expert-parallel-comm; DualPipe / DualPipeV).",
            rule="must be true, false, none, a2a, dualpipe or dualpipev; got {value!r}",
        ),
        "dispatcher": _choice(
            "MoE token dispatcher (default: the stack's, else alltoall).",
            _enum_values("collsim.parallel.dispatch", "DISPATCHERS"),
        ),
        "routing": _choice(
            "Routing model of the dispatch volumes.",
            _enum_values("collsim.parallel.dispatch", "ROUTINGS"),
        ),
        "routing_nodes": _pos("integer", "M of node_limited routing (DeepSeek-V3: 4)."),
        "dispatch_sms": _nonneg("integer", "SMs the dispatch kernels hold."),
        "pipeline_split": _choice(
            "even (layers must divide) or balanced.", _enum_values(_CONFIG, "PIPELINE_SPLITS")
        ),
        "layers_per_stage": ListOf(
            items=_pos("integer", "Layers of one virtual stage."),
            min_items=1,
            description="Layers per virtual stage (pp x virtual_stages entries).",
        ),
        "account_for_embedding": _flag("The split counts the embedding as a layer."),
        "account_for_loss": _flag("The split counts the LM head and loss as a layer."),
        "ddp": Section(
            description="Gradient buckets (torch DDP).",
            fields={
                "bucket_mb": _pos("number", "Bucket capacity in MiB."),
                "first_bucket_mb": _pos("number", "First bucket in MiB."),
                "overlap": _flag("Overlap with backward."),
                "gradient_as_bucket_view": _flag("torch's gradient_as_bucket_view."),
            },
        ),
        "fsdp": Section(
            description="ZeRO-3 / FSDP units.",
            fields={
                "prefetch": _nonneg("integer", "Units all-gathered ahead."),
                "reshard_after_forward": _flag("Reshard after forward."),
                "offload": _flag("Offload to CPU memory."),
                "shard_group_size": _pos("integer", "HSDP: shard inside groups of this size."),
                "reduce_dtype": _choice(
                    "Gradient reduction dtype.",
                    _enum_values(_CONFIG, "REDUCE_DTYPES"),
                    fold_case=True,
                ),
                "fp8_all_gather": _flag("All-gather FP8 weights."),
            },
        ),
    },
)

SCENARIO = Section(
    description="A collsim scenario: cluster, model, training and parallel plan "
    "(docs/scenarios.md).",
    fields={
        "name": _text("Scenario name (default: the file's stem)."),
        "cluster": Section(
            required=True,
            description="The cluster to run on.",
            fields={
                "topology": _text(
                    "A topology name (dgx_h100, ...) or a path to a topology file.", required=True
                ),
                "nodes": _pos("integer", "Number of nodes (default: the topology file's)."),
                "device": _text(
                    "A device key or a device file that replaces the topology's device.",
                    json_choices=_devices,
                ),
            },
        ),
        "model": _MODEL,
        "training": _TRAINING,
        "parallel": _PARALLEL,
        "reliability": _RELIABILITY,
        "stragglers": _STRAGGLERS,
    },
)

# -- topology (collsim.topology.parse_topology) ---------------------------------------------------


def _link(extra: dict[str, Spec]) -> dict[str, Spec]:
    return {
        **extra,
        "efficiency": _fraction("Achievable / line rate."),
        "latency_us": _nonneg("number", "Per-hop latency in microseconds."),
    }


_OPS = _enum_values(_TOPO, "_OP_NAMES")
_OP_RULE = "unknown op (choose from {choices})"


def _op_value(spec: Value) -> Value:
    # per-op values are read when their key is present: null is refused there
    return dataclasses.replace(spec, nullable=False)


TOPOLOGY = Section(
    description="A collsim topology: one node type and the fabric (docs/topologies.md).",
    fields={
        "name": _text("Topology name.", required=True),
        "description": _text("Free text."),
        "device": Either(
            required=True,
            description="A device key, a device file (*.yaml) or a device mapping.",
            options=(_text("A device key or file.", json_choices=_devices), DEVICE),
            rule="must be a device key, a device file or a device mapping, got {value!r}",
        ),
        "nodes": _pos("integer", "Default node count."),
        "gpus_per_node": _pos("integer", "Ranks per node.", required=True),
        "intra_node": Section(
            required=True,
            description="What connects the GPUs of a node.",
            fields=_link(
                {
                    "interconnect": _choice(
                        "NVSwitch, a PCIe switch, or the kernel's loopback.",
                        _enum_values(_TOPO, "Interconnect"),
                        required=True,
                    ),
                    "bandwidth_gbps": _pos(
                        "number", "Per-direction bandwidth per GPU, GB/s.", required=True
                    ),
                    "nvls": _flag("NVSwitch reduction (NVLS)."),
                }
            ),
        ),
        "nics": Section(
            nullable=False,
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
                "kind": _choice("Transport (sets defaults).", _enum_values(_TOPO, "FabricKind")),
                "rails": _flag("Rail-optimised."),
                "oversubscription": Value(
                    kind="number",
                    minimum=1,
                    rule="must be >= 1 (1 = non-blocking), got {value}",
                    description="Leaf uplink oversubscription.",
                ),
                "nodes_per_leaf": _pos("integer", "Nodes per leaf switch."),
                "latency_us": _nonneg("number", "Per leaf <-> spine direction, us."),
                "net_latency_us": _nonneg("number", "Per LL/LL128 network step, us."),
                "net_simple_latency_us": _nonneg("number", "Per Simple network step, us."),
                "ll128": _flag("NCCL runs LL128 across nodes."),
                "ll": _flag("NCCL runs LL across nodes."),
                "completion_us": _nonneg("number", "Per Simple network step beyond the flush, us."),
                "platform": _choice(
                    "EFA instance family.", _enum_values(_TRANSPORTS, "EFA_PLATFORMS")
                ),
                "tuner": _choice("Whose choice auto follows.", _enum_values(_TRANSPORTS, "TUNERS")),
                "sharp": _flag("CollNet / SHARP in-network reduction."),
            },
        ),
        "host": Section(
            description="Host memory link and CPU.",
            fields={
                "bandwidth_gbps": _pos("number", "Host <-> GPU bandwidth, GB/s."),
                "cpu_vendor": _choice("Host CPU vendor.", _enum_values(_TOPO, "CPU_VENDORS")),
            },
        ),
        "collectives": Section(
            description="Collective library settings.",
            fields={
                "library": _choice("Library.", _enum_values(_TOPO, "LIBRARIES")),
                "overhead_us": _nonneg("number", "Launch overhead per call, microseconds."),
                "nccl_version": _choice(
                    "NCCL release assumed.", _enum_values(_TRANSPORTS, "NCCL_RELEASES")
                ),
                "algorithms": Section(
                    description="Algorithm per op.",
                    keys=_OPS,
                    key_rule=_OP_RULE,
                    values=_choice(
                        "Algorithm.", _enum_values(_TOPO, "_ALGORITHM_NAMES"), nullable=False
                    ),
                ),
                "ops": Section(
                    description="Per-op calibration.",
                    keys=_OPS,
                    key_rule=_OP_RULE,
                    values=Section(
                        nullable=False,
                        fields={
                            "overhead_us": _op_value(_nonneg("number", "Overhead per call, us.")),
                            "efficiency": _op_value(_fraction("Achievable / modelled bandwidth.")),
                            "knee_bytes": _op_value(
                                _nonneg("number", "Size above which the knee holds.")
                            ),
                            "knee_efficiency": _op_value(_fraction("Efficiency above the knee.")),
                        },
                    ),
                ),
            },
        ),
    },
)

#: ``collsim schema KIND`` choices.
SCHEMAS: dict[str, Section] = {"scenario": SCENARIO, "topology": TOPOLOGY, "device": DEVICE}

# -- checking -------------------------------------------------------------------------------------

_TYPE_WORDS = {
    "integer": "an integer",
    "number": "a number",
    "string": "a string",
    "boolean": "true or false",
    "object": "a mapping",
    "array": "a list",
}


def _dotted(path: KeyPath) -> str:
    """``a.b[0].c``, as :mod:`collsim.yamlio` writes key paths."""
    parts: list[str] = []
    for part in path:
        if isinstance(part, int):
            parts.append(f"[{part}]")
        else:
            parts.append(("." if parts else "") + str(part))
    return "".join(parts)


def _json_type(spec: Spec) -> str | None:
    if isinstance(spec, Value):
        return spec.kind
    if isinstance(spec, ListOf):
        return "array"
    if isinstance(spec, Section):
        return "object"
    return None


def _has_type(value: Any, kind: str) -> bool:
    if kind == "boolean":
        return isinstance(value, bool)
    if kind == "string":
        return isinstance(value, str)
    if kind == "integer":
        return isinstance(value, int) and not isinstance(value, bool)
    if kind == "number":
        return isinstance(value, int | float) and not isinstance(value, bool)
    if kind == "object":
        return isinstance(value, dict)
    if kind == "array":
        return isinstance(value, list)
    return True


def _fmt(rule: str, **kw: Any) -> str:
    return rule.format(**kw)


def _value_error(value: Any, spec: Value) -> str | None:
    if not _has_type(value, spec.kind):
        return f"must be {_TYPE_WORDS[spec.kind]}, got {value!r}"
    if isinstance(value, float) and not math.isfinite(value):
        return f"must be a finite number, got {value!r}"
    if spec.enum is not None:
        allowed = choices_of(spec.enum)
        probe = value.strip().lower() if spec.fold_case and isinstance(value, str) else value
        if probe not in allowed:
            choices = ", ".join(map(str, allowed))
            if spec.rule:
                return _fmt(spec.rule, value=value, choices=choices)
            return f"must be one of {choices}; got {value!r}"
        return None
    low_ok = True
    generic = ""
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
        return _fmt(spec.rule, value=value) if spec.rule else generic
    return None


def check(doc: YamlDoc, schema: Section) -> list[ConfigError]:
    """Every schema error of ``doc``, in file order, each with its file, line and key path.

    Stays long: one walk of the document as a few nested functions (value, list, section)
    that share the error list and the document's line table.
    """
    errors: list[tuple[int, int, ConfigError]] = []

    def add(path: KeyPath, message: str, line: int | None = None) -> None:
        if line is None:
            line = doc.line_of(path) if path else doc.lines.get(())
        err = ConfigError(message, key_path=_dotted(path) or None, file=doc.file, line=line)
        errors.append((line or 0, len(errors), err))

    def walk(data: Any, spec: Spec, path: KeyPath) -> None:
        if data is None:
            if not spec.nullable:
                kind = _json_type(spec)
                words = _TYPE_WORDS[kind] if kind else "a value"
                add(path, f"must be {words}, got nothing")
            return
        if isinstance(spec, Anything):
            return
        if isinstance(spec, Value):
            problem = _value_error(data, spec)
            if problem:
                add(path, problem)
            return
        if isinstance(spec, Either):
            for option in spec.options:
                kind = _json_type(option)
                if kind is not None and _has_type(data, kind):
                    walk(data, option, path)
                    return
            add(path, _fmt(spec.rule, value=data))
            return
        if isinstance(spec, ListOf):
            walk_list(data, spec, path)
            return
        walk_section(data, spec, path)

    def walk_list(data: Any, spec: ListOf, path: KeyPath) -> None:
        if not isinstance(data, list):
            add(path, f"must be a list, got {type_name(data)}")
            return
        if len(data) < spec.min_items:
            add(path, _fmt(spec.min_rule, min_items=spec.min_items))
        if spec.items is not None:
            for i, item in enumerate(data):
                if spec.item_rule is not None:
                    sub = check_one(item, spec.items)
                    if sub:
                        add(path, _fmt(spec.item_rule, item=item))
                        return
                else:
                    walk(item, spec.items, path + (i,))
        if spec.unique:
            hashable = [repr(x) for x in data]
            if len(set(hashable)) != len(hashable):
                add(path, _fmt(spec.unique_rule, value=data))

    def walk_section(data: Any, spec: Section, path: KeyPath) -> None:
        if not isinstance(data, dict):
            add(path, f"must be a mapping, got {type_name(data)}")
            return
        if spec.values is not None:
            allowed = choices_of(spec.keys) if spec.keys is not None else None
            for key, value in data.items():
                if allowed is not None and key not in allowed:
                    choices = ", ".join(map(str, allowed))
                    message = _fmt(spec.key_rule, key=key, choices=choices)
                    add(path + (key,), with_hint(message, key, allowed))
                else:
                    walk(value, spec.values, path + (key,))
            return
        unknown: list[str] = []
        for key, value in data.items():
            if key not in spec.fields:
                unknown.append(key)
                continue
            walk(value, spec.fields[key], path + (key,))
        if spec.exactly_one and sum(data.get(k) is not None for k in spec.exactly_one) != 1:
            add(path, spec.exactly_one_rule)
        # Missing keys of one mapping are one error, naming the others; a misspelt key there
        # is what explains it, so it is named in the same line (and not reported again).
        found = ", ".join(f"{k!r} at line {doc.line_of(path + (k,))}" for k in unknown)
        hint = f"; unknown key(s) here: {found}" if unknown else ""
        at = doc.line_of(path + (unknown[0],)) if unknown else None
        missing = [k for k, sub in spec.fields.items() if sub.required and data.get(k) is None]
        if missing:
            also = f" (also missing: {', '.join(missing[1:])})" if missing[1:] else ""
            add(path + (missing[0],), _missing(spec.fields[missing[0]]) + also + hint, at)
        group_missing = []
        if spec.one_of_required and not any(
            all(data.get(k) is not None for k in group) for group in spec.one_of_required
        ):
            # the last alternative is the spelled-out one (the model's shape keys): name its
            # missing keys; a choice between single keys is an error of the mapping itself
            last = spec.one_of_required[-1]
            group_missing = [k for k in last if data.get(k) is None]
            tail = hint if not missing else ""
            if len(last) > 1:
                rest = group_missing[1:]
                also = f" (also missing: {', '.join(rest)})" if rest else ""
                add(path + (group_missing[0],), spec.missing_rule + also + tail, at)
            else:
                add(path, spec.missing_rule + tail, at)
        if not missing and not group_missing:
            for key in unknown:
                add(path + (key,), unknown_key_message(str(key), spec.fields))

    def check_one(data: Any, spec: Spec) -> bool:
        """Whether ``data`` has an error under ``spec`` (collected apart, then dropped)."""
        before = len(errors)
        walk(data, spec, ())
        bad = len(errors) > before
        del errors[before:]
        return bad

    walk(doc.data, schema, ())
    return [err for _, _, err in sorted(errors, key=lambda t: (t[0], t[1]))]


def _missing(spec: Spec) -> str:
    return "missing required section" if isinstance(spec, Section) else "missing required key"


def raise_errors(errors: list[ConfigError]) -> None:
    """Raise the one error, or all of them as :class:`~collsim.errors.ConfigErrors`."""
    from collsim.errors import ConfigErrors

    if len(errors) == 1:
        raise errors[0]
    if errors:
        raise ConfigErrors(errors)


# -- JSON Schema ----------------------------------------------------------------------------------

_PATH_PATTERN = r"\.ya?ml$"
"""A device or topology given as a file."""


def _nullable(out: dict[str, Any]) -> dict[str, Any]:
    """``out`` that also admits ``null`` (an optional key the readers treat as absent)."""
    if "type" in out and "anyOf" not in out:
        out["type"] = [out["type"], "null"]
        if "enum" in out:
            out["enum"] = [*out["enum"], None]
        return out
    return {"anyOf": [out, {"type": "null"}]}


def _json(spec: Spec, optional: bool = False) -> dict[str, Any]:
    out = _json_plain(spec)
    if optional and spec.nullable:
        return _nullable(out)
    return out


def _json_plain(spec: Spec) -> dict[str, Any]:
    out: dict[str, Any] = {}
    if isinstance(spec, Anything):
        if spec.description:
            out["description"] = spec.description
        return out
    if isinstance(spec, Either):
        out = {"anyOf": [_json(option) for option in spec.options]}
        if spec.description:
            out["description"] = spec.description
        return out
    if isinstance(spec, ListOf):
        out = {"type": "array"}
        if spec.description:
            out["description"] = spec.description
        if spec.items is not None:
            out["items"] = _json(spec.items)
        if spec.min_items:
            out["minItems"] = spec.min_items
        if spec.unique:
            out["uniqueItems"] = True
        return out
    if isinstance(spec, Value):
        out = {"type": spec.kind}
        if spec.description:
            out["description"] = spec.description
        if spec.enum is not None:
            out["enum"] = list(choices_of(spec.enum))
        if spec.json_choices is not None:
            out = {
                "description": spec.description,
                "anyOf": [
                    {"type": "string", "enum": list(spec.json_choices())},
                    {"type": "string", "pattern": _PATH_PATTERN},
                ],
            }
            return out
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
        if spec.keys is not None:
            out["propertyNames"] = {"enum": [str(k) for k in choices_of(spec.keys)]}
        out["additionalProperties"] = _json(spec.values)
        return out
    out["properties"] = {
        key: _json(sub, optional=not sub.required) for key, sub in spec.fields.items()
    }
    out["additionalProperties"] = False
    required = [key for key, sub in spec.fields.items() if sub.required]
    if required:
        out["required"] = required
    if spec.one_of_required:
        out["anyOf"] = [
            {"required": list(group), "properties": {k: {"not": {"type": "null"}} for k in group}}
            for group in spec.one_of_required
        ]
    if spec.exactly_one:
        out["oneOf"] = [
            {"required": [k], "properties": {k: {"not": {"type": "null"}}}}
            for k in spec.exactly_one
        ]
    return out


def json_schema(kind: str) -> dict[str, Any]:
    """The JSON Schema (draft 2020-12) of ``scenario``, ``topology`` or ``device`` files.

    Raises:
        ConfigError: an unknown kind.
    """
    if kind not in SCHEMAS:
        raise ConfigError(f"must be one of {', '.join(SCHEMAS)}; got {kind!r}", key_path="KIND")
    return {
        "$schema": "https://json-schema.org/draft/2020-12/schema",
        "$id": f"https://collsim.invalid/schema/{kind}.schema.json",
        "title": f"collsim {kind} file",
        **_json(SCHEMAS[kind]),
    }
