"""The ``reliability`` scenario section: failure rates, restart cost, spares, checkpointing.

Derivations, measurements and sources: docs/derivations.md, ``collsim.study.goodput.config``.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from collsim.core.errors import ConfigError
from collsim.core.schema import (
    Either,
    Section,
    Value,
    choice_value,
    flag_value,
    non_negative_value,
    positive_value,
    read_described,
    values_of,
)
from collsim.core.yamlio import ConfigReader

__all__ = [
    "RELIABILITY",
    "COMPONENTS",
    "SECONDS_PER_DAY",
    "ComponentRate",
    "RestartConfig",
    "SparesConfig",
    "CheckpointConfig",
    "StorageConfig",
    "ReliabilityConfig",
    "read_reliability",
]

SECONDS_PER_DAY = 86_400.0

#: Failure sources a scenario may rate. ``host`` covers the node itself (CPU, memory, board,
#: power supply); ``switch`` and ``cable`` the fabric; ``power`` a power or cooling domain.
COMPONENTS = ("gpu", "hbm", "host", "nic", "switch", "cable", "software", "power")

#: Components whose failures are fixed by restarting on the same nodes unless told otherwise.
_RESTART_IN_PLACE = ("software",)

_PREFIX = "reliability"


def _err(message: str, key: str) -> ConfigError:
    return ConfigError(message, key_path=f"{_PREFIX}.{key}")


def _check_non_negative(value: float | None, key: str) -> None:
    if value is not None and value < 0:
        raise _err(f"must be >= 0, got {value}", key)


@dataclass(frozen=True, slots=True, kw_only=True)
class ComponentRate:
    """One failure source: how often it strikes one node, and what one event takes down."""

    name: str
    """One of :data:`COMPONENTS`."""
    per_1000_node_days: float
    """Failures per 1,000 node-days (an MTBF of M hours is 24,000 / M)."""
    nodes_affected: int = 1
    """Nodes one event takes out at once (a leaf switch: the nodes under it)."""
    replace_fraction: float = 1.0
    """Share of events whose nodes must be swapped for spares (the rest restart in place)."""

    def __post_init__(self) -> None:
        key = f"components.{self.name}"
        if self.name not in COMPONENTS:
            raise _err(f"unknown component; must be one of {', '.join(COMPONENTS)}", key)
        _check_non_negative(self.per_1000_node_days, f"{key}.per_1000_node_days")
        if self.nodes_affected < 1:
            raise _err(f"must be >= 1, got {self.nodes_affected}", f"{key}.nodes_affected")
        if not 0.0 <= self.replace_fraction <= 1.0:
            raise _err(f"must be in 0..1, got {self.replace_fraction}", f"{key}.replace_fraction")

    @property
    def rate_per_node_s(self) -> float:
        """Events per node per second."""
        return self.per_1000_node_days / 1000.0 / SECONDS_PER_DAY


@dataclass(frozen=True, slots=True, kw_only=True)
class RestartConfig:
    """What a restart costs beside loading the checkpoint (that is computed from the plan)."""

    reschedule_s: float = 0.0
    """Re-allocating nodes and relaunching the job in the scheduler."""
    process_start_s: float = 0.0
    """Process start to first step: imports, communicator set-up, data-loader start."""
    warmup_steps: int = 0
    """Steps after a restart whose time counts as lost (caches, compilation, clock ramp)."""

    def __post_init__(self) -> None:
        _check_non_negative(self.reschedule_s, "restart.reschedule_s")
        _check_non_negative(self.process_start_s, "restart.process_start_s")
        if self.warmup_steps < 0:
            raise _err(f"must be >= 0, got {self.warmup_steps}", "restart.warmup_steps")


@dataclass(frozen=True, slots=True, kw_only=True)
class SparesConfig:
    """The pool of spare nodes that replaces failed ones."""

    nodes: int | None = None
    """Spare nodes at the start; None: never runs out."""
    repair_hours: float = 0.0
    """A failed node returns to the pool this long after it failed."""

    def __post_init__(self) -> None:
        if self.nodes is not None and self.nodes < 0:
            raise _err(f"must be >= 0, got {self.nodes}", "spares.nodes")
        _check_non_negative(self.repair_hours, "spares.repair_hours")
        if self.nodes is not None and self.repair_hours <= 0:
            raise _err(
                f"must be > 0 when spares.nodes is set, got {self.repair_hours}",
                "spares.repair_hours",
            )


@dataclass(frozen=True, slots=True, kw_only=True)
class CheckpointConfig:
    """How and how often the job saves its model state."""

    interval_s: float | None = None
    """Training time between two checkpoints; None (``auto``): the optimum of the closed form."""
    sharded: bool = True
    """Every rank writes its own shard in parallel; False: one rank writes the whole state."""
    asynchronous: bool = False
    """Training resumes after a device-to-host snapshot and the write runs in the background
    (the checkpoint counts only once written); False: training waits for the write."""
    snapshot_bandwidth_gbps: float | None = None
    """Device-to-host copy bandwidth per GPU, GB/s (asynchronous checkpoints only)."""

    def __post_init__(self) -> None:
        if self.interval_s is not None and self.interval_s <= 0:
            raise _err(f"must be > 0 or auto, got {self.interval_s}", "checkpoint.interval_s")
        if self.snapshot_bandwidth_gbps is not None and self.snapshot_bandwidth_gbps <= 0:
            raise _err(
                f"must be > 0, got {self.snapshot_bandwidth_gbps}",
                "checkpoint.snapshot_bandwidth_gbps",
            )
        if self.asynchronous and self.snapshot_bandwidth_gbps is None:
            raise _err(
                "missing required key (asynchronous checkpoints stall for the snapshot copy)",
                "checkpoint.snapshot_bandwidth_gbps",
            )


@dataclass(frozen=True, slots=True, kw_only=True)
class StorageConfig:
    """The shared storage checkpoints go to; writers share its aggregate bandwidth."""

    write_bandwidth_gbps: float
    """Aggregate sustained write bandwidth, GB/s (10**9 bytes/s)."""
    read_bandwidth_gbps: float
    """Aggregate sustained read bandwidth, GB/s."""
    per_rank_write_bandwidth_gbps: float | None = None
    """What one writer can push, GB/s; None: only the aggregate limits."""
    per_rank_read_bandwidth_gbps: float | None = None
    """What one reader can pull, GB/s; None: only the aggregate limits."""

    def __post_init__(self) -> None:
        for key in ("write_bandwidth_gbps", "read_bandwidth_gbps"):
            value = getattr(self, key)
            if value <= 0:
                raise _err(f"must be > 0, got {value}", f"storage.{key}")
        for key in ("per_rank_write_bandwidth_gbps", "per_rank_read_bandwidth_gbps"):
            value = getattr(self, key)
            if value is not None and value <= 0:
                raise _err(f"must be > 0, got {value}", f"storage.{key}")


@dataclass(frozen=True, slots=True, kw_only=True)
class ReliabilityConfig:
    """The ``reliability`` section of a scenario."""

    components: tuple[ComponentRate, ...]
    storage: StorageConfig
    detection_s: float = 0.0
    """From the failure to the job being declared dead (health check, collective timeout)."""
    restart: RestartConfig = field(default_factory=RestartConfig)
    spares: SparesConfig = field(default_factory=SparesConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    duration_days: float | None = None
    """Length of the run; ``collsim goodput --days`` overrides it (30 days when neither)."""

    def __post_init__(self) -> None:
        if not self.components:
            raise _err("give at least one failure rate", "components")
        names = [c.name for c in self.components]
        for name in names:
            if names.count(name) > 1:
                raise _err("component rated twice", f"components.{name}")
        _check_non_negative(self.detection_s, "detection_s")
        if self.duration_days is not None and self.duration_days <= 0:
            raise _err(f"must be > 0, got {self.duration_days}", "duration_days")
        if not self.checkpoint.sharded and self.storage.per_rank_write_bandwidth_gbps is None:
            raise _err(
                "missing required key (one writer's bandwidth bounds an unsharded checkpoint)",
                "storage.per_rank_write_bandwidth_gbps",
            )

    def failure_rate_per_s(self, num_nodes: int) -> float:
        """Events per second striking a job on ``num_nodes`` nodes (all components)."""
        return num_nodes * sum(c.rate_per_node_s for c in self.components)


# -- reading ---------------------------------------------------------------------------------


def read_reliability(reader: ConfigReader) -> ReliabilityConfig:
    """Build the section from a reader over the ``reliability`` mapping, key by key as
    :data:`RELIABILITY` describes them; absent keys take the configs' defaults.

    Raises:
        ConfigError: an unknown key or component, a negative rate, both or neither of
            ``mtbf_hours`` and ``per_1000_node_days``, an interval that is not a number or
            ``auto``, ... each naming its key path.
    """
    values = read_described(reader, RELIABILITY)
    components = _read_components(reader.section("components"))
    parts = {key: _read_part(reader, key) for key in ("restart", "spares", "checkpoint", "storage")}
    reader.finish()
    return ReliabilityConfig(components=components, **parts, **values)


def _read_components(reader: ConfigReader) -> tuple[ComponentRate, ...]:
    out: list[ComponentRate] = []
    spec = _part("components")
    for name, _value in list(reader.items()):
        if name not in COMPONENTS:
            raise reader.error(
                f"unknown component {name!r}; must be one of {', '.join(COMPONENTS)}", name
            )
        sub = reader.section(name)
        assert isinstance(spec.values, Section)
        values = read_described(sub, spec.values)
        if ("mtbf_hours" in values) == ("per_1000_node_days" in values):
            raise sub.error("give exactly one of mtbf_hours and per_1000_node_days")
        mtbf = values.pop("mtbf_hours", None)
        if mtbf is not None:
            values["per_1000_node_days"] = 1000.0 * 24.0 / mtbf
        values.setdefault("replace_fraction", 0.0 if name in _RESTART_IN_PLACE else 1.0)
        sub.finish()
        out.append(ComponentRate(name=name, **values))
    return tuple(out)


def _read_part(root: ConfigReader, key: str) -> Any:
    """One of the sections restart, spares, checkpoint and storage, with its rules."""
    spec = _part(key)
    reader = root.section(key, default_empty=not spec.required)
    values = read_described(reader, spec)
    if key == "spares" and "nodes" in values and "repair_hours" not in values:
        raise reader.error("missing required key (needed when spares.nodes is set)", "repair_hours")
    if key == "storage":
        values.setdefault("read_bandwidth_gbps", values["write_bandwidth_gbps"])
    reader.finish()
    return _PARTS[key](**values)


_PARTS: dict[str, type[Any]] = {
    "restart": RestartConfig,
    "spares": SparesConfig,
    "checkpoint": CheckpointConfig,
    "storage": StorageConfig,
}


def _part(key: str) -> Section:
    spec = RELIABILITY.fields[key]
    assert isinstance(spec, Section)
    return spec


def _seconds_or_auto(value: float | str) -> float | None:
    """``checkpoint.interval_s``: seconds, or None for ``auto`` (the closed form's optimum)."""
    return None if value == "auto" else float(value)


RELIABILITY = Section(
    builds=ReliabilityConfig,
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
            builds=RestartConfig,
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
            builds=CheckpointConfig,
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
                    convert=_seconds_or_auto,
                ),
                "sharded": flag_value("Every rank writes its own shard."),
                "async": flag_value(
                    "Snapshot to host memory, write in the background.", field="asynchronous"
                ),
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
