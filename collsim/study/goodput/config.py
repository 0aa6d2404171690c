"""The ``reliability`` scenario section: failure rates, restart cost, spares, checkpointing.

Every quantity carries its unit; rates are per node of the job. The section is read by
:func:`read_reliability` from a :class:`collsim.core.yamlio.ConfigReader`
(``collsim.study.scenario`` calls
it; this module never sees YAML). Schema::

    reliability:
      duration_days: 54            # default length of the run (collsim goodput --days)
      detection_s: 300             # failure -> job declared dead
      components:                  # any of COMPONENTS; one rate each, per node of the job
        gpu: {per_1000_node_days: 3.97, replace_fraction: 0.68}
        host: {mtbf_hours: 500000}
        switch: {per_1000_node_days: 0.004, nodes_affected: 32}   # correlated: 32 nodes at once
        software: {per_1000_node_days: 1.0}                       # replace_fraction 0 by default
      restart: {reschedule_s: 300, process_start_s: 300, warmup_steps: 5}
      spares: {nodes: 64, repair_hours: 72}      # omit for an unlimited pool
      checkpoint:
        interval_s: auto           # or seconds of training between checkpoints
        sharded: true              # every rank writes its shard (false: one rank writes all)
        async: false               # true: the step stalls only for the device-to-host snapshot
        snapshot_bandwidth_gbps: 25   # per GPU, needed when async is true
      storage:
        write_bandwidth_gbps: 2000   # aggregate, GB/s (10**9 bytes/s)
        read_bandwidth_gbps: 2000    # default = write
        per_rank_write_bandwidth_gbps: 5   # one writer's cap (needed when sharded is false)
        per_rank_read_bandwidth_gbps: 5

Errors name the key path (``reliability.components.gpu.per_1000_node_days: must be >= 0``).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from collsim.core.errors import ConfigError
from collsim.core.yamlio import ConfigReader, non_negative, positive

__all__ = [
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
    """Build the section from a reader over the ``reliability`` mapping.

    Raises:
        ConfigError: an unknown key or component, a negative rate, both or neither of
            ``mtbf_hours`` and ``per_1000_node_days``, an interval that is not a number or
            ``auto``, ... each naming its key path.
    """
    duration = reader.get("duration_days", float, default=None, check=positive)
    detection = reader.get("detection_s", float, default=0.0, check=non_negative)
    components = _read_components(reader.section("components"))
    restart = _read_restart(reader.section("restart", default_empty=True))
    spares = _read_spares(reader.section("spares", default_empty=True))
    checkpoint = _read_checkpoint(reader.section("checkpoint", default_empty=True))
    storage = _read_storage(reader.section("storage"))
    reader.finish()
    return ReliabilityConfig(
        components=components,
        storage=storage,
        detection_s=detection,
        restart=restart,
        spares=spares,
        checkpoint=checkpoint,
        duration_days=duration,
    )


def _read_components(reader: ConfigReader) -> tuple[ComponentRate, ...]:
    out: list[ComponentRate] = []
    for name, _value in list(reader.items()):
        if name not in COMPONENTS:
            raise reader.error(
                f"unknown component {name!r}; must be one of {', '.join(COMPONENTS)}", name
            )
        sub = reader.section(name)
        mtbf = sub.get("mtbf_hours", float, default=None, check=positive)
        per_1000 = sub.get("per_1000_node_days", float, default=None, check=non_negative)
        if (mtbf is None) == (per_1000 is None):
            raise sub.error("give exactly one of mtbf_hours and per_1000_node_days")
        if mtbf is not None:
            per_1000 = 1000.0 * 24.0 / mtbf
        default_replace = 0.0 if name in _RESTART_IN_PLACE else 1.0
        kwargs: dict[str, Any] = {
            "nodes_affected": sub.get("nodes_affected", int, default=1, check=positive),
            "replace_fraction": sub.get("replace_fraction", float, default=default_replace),
        }
        sub.finish()
        out.append(ComponentRate(name=name, per_1000_node_days=float(per_1000), **kwargs))
    return tuple(out)


def _read_restart(reader: ConfigReader) -> RestartConfig:
    out = RestartConfig(
        reschedule_s=reader.get("reschedule_s", float, default=0.0, check=non_negative),
        process_start_s=reader.get("process_start_s", float, default=0.0, check=non_negative),
        warmup_steps=reader.get("warmup_steps", int, default=0, check=non_negative),
    )
    reader.finish()
    return out


def _read_spares(reader: ConfigReader) -> SparesConfig:
    nodes = reader.get("nodes", int, default=None, check=non_negative)
    repair = reader.get("repair_hours", float, default=None, check=positive)
    if nodes is not None and repair is None:
        raise reader.error("missing required key (needed when spares.nodes is set)", "repair_hours")
    reader.finish()
    return SparesConfig(nodes=nodes, repair_hours=repair if repair is not None else 0.0)


def _read_checkpoint(reader: ConfigReader) -> CheckpointConfig:
    raw = reader.get("interval_s", (str, float), default="auto")
    interval: float | None
    if isinstance(raw, str):
        if raw != "auto":
            raise reader.error(f"must be a number of seconds or auto, got {raw!r}", "interval_s")
        interval = None
    else:
        if raw <= 0:
            raise reader.error(f"must be > 0 or auto, got {raw}", "interval_s")
        interval = float(raw)
    out = CheckpointConfig(
        interval_s=interval,
        sharded=reader.get("sharded", bool, default=True),
        asynchronous=reader.get("async", bool, default=False),
        snapshot_bandwidth_gbps=reader.get(
            "snapshot_bandwidth_gbps", float, default=None, check=positive
        ),
    )
    reader.finish()
    return out


def _read_storage(reader: ConfigReader) -> StorageConfig:
    write = reader.get("write_bandwidth_gbps", float, check=positive)
    out = StorageConfig(
        write_bandwidth_gbps=write,
        read_bandwidth_gbps=reader.get("read_bandwidth_gbps", float, default=write, check=positive),
        per_rank_write_bandwidth_gbps=reader.get(
            "per_rank_write_bandwidth_gbps", float, default=None, check=positive
        ),
        per_rank_read_bandwidth_gbps=reader.get(
            "per_rank_read_bandwidth_gbps", float, default=None, check=positive
        ),
    )
    reader.finish()
    return out
