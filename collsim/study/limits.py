"""Resource bounds decided from the plan, before any topology is built or any event runs.

Derivations, measurements and sources: docs/derivations.md, ``collsim.study.limits``.
"""

from __future__ import annotations

from dataclasses import dataclass, fields
from typing import TYPE_CHECKING, Any

from collsim.cluster.topology import read_topology_file
from collsim.core.errors import ConfigError, LimitError

if TYPE_CHECKING:
    from collsim.study.scenario import Scenario

__all__ = ["Limits", "Needs", "estimate_needs", "check_scenario", "check_ranks"]

KIB = 1024
MIB = 1024 * KIB
GIB = 1024 * MIB

#: Memory of the process before the first event: interpreter, numpy, simpy, the scenario
#: (peak RSS of an 8-GPU run of scenarios/ddp_gpt3_1.3b.yaml: 35 MiB; rounded up).
BASE_MEMORY_BYTES = 64 * MIB
#: Per rank of the topology: links, paths and index arrays (65,536 vs 1,024 ranks of
#: scenarios/3d_175b.yaml: 175 vs 35 MiB peak RSS, 2.2 KiB per rank; rounded up).
MEMORY_PER_RANK_BYTES = int(2.5 * KIB)
#: Per estimated event: SimPy events, ledger entries and timeline samples (0.5-1.8 KiB per
#: measured event in the runs named in docs/derivations.md; the estimate counts more events
#: than run, so 2 KiB per estimated event is above every one of them).
MEMORY_PER_EVENT_BYTES = 2 * KIB


#: Events per (stage, micro-batch), and per layer of a stage and micro-batch: a grid of 324 plans
#: (pp 1/2/8, gpipe/1f1b/interleaved, m 1/8/200, 8/64 layers, tp 1/8, ZeRO 0/1/3) counted at
#: most 17.5 per micro-batch and stage (pp 8, 1 layer per stage) and 8.1 per layer and
#: micro-batch with ZeRO-3 (pp 1, 64 layers, m 200); ``tests/robust/test_limits.py`` checks the
#: bound on a sample of that grid.
EVENTS_PER_MICROBATCH = 20
#: Per layer of a stage and micro-batch with experts or context parallelism (a dispatch or a
#: ring attention per layer and micro-batch); dense plans other than ZeRO-3 have none.
EVENTS_PER_LAYER = 2
#: Per layer of a stage, once per step and class (gradient buckets, ZeRO shards, the optimizer
#: of each layer): at most 8.4 in the all-ranks grid of docs/derivations.md (ZeRO-1).
EVENTS_PER_LAYER_STEP = 10
EVENTS_PER_LAYER_FSDP = 10

#: Event-equivalents per ((micro-batches + 1) x layers**2) of the engine's per-layer scans, with
#: ZeRO-3/FSDP units and with DDP/ZeRO-1/2 buckets (measurements in docs/derivations.md).
SCAN_WORK_FSDP = 0.25
SCAN_WORK_DDP = 0.01
#: Event-equivalents of setting up one rank (fitted to the set-up of 65,536-131,072 GPU plans,
#: docs/derivations.md).
RANK_WORK = 5


@dataclass(frozen=True, slots=True, kw_only=True)
class Limits:
    """What one simulated step may need. Each field has a ``--max-...`` option of the same name.

    The defaults admit 65,536 GPUs (the 3d_175b plan at 8,192 nodes, 96 micro-batches per
    replica, estimates 11,520 events) and keep a run under about 8 GiB and a few minutes.
    """

    max_gpus: int = 262_144
    """Ranks of the cluster (nodes x GPUs per node); 4 x the 65,536 GPUs of the largest plan
    collsim is benchmarked on."""
    max_layers: int = 10_000
    """Model layers; the engine's cost grows faster than linearly in layers (the runs are in
    docs/derivations.md, ``collsim.study.limits``). The largest published dense models have under
    200."""
    max_microbatches: int = 1_000_000
    """Micro-batches per data-parallel replica in one step."""
    max_events: int = 4_000_000
    """Estimated simulation work in events (``work`` in docs/derivations.md); the engine
    plays about 100,000 events per second."""
    max_memory_gib: float = 8.0
    """Estimated memory of the simulation process, in GiB (2**30 bytes)."""

    def __post_init__(self) -> None:
        for f in fields(self):
            value = getattr(self, f.name)
            if not value > 0 or value != value or value == float("inf"):
                raise ConfigError(
                    f"must be a finite number > 0, got {value}", key_path=option(f.name)
                )


def option(name: str) -> str:
    """The command-line option of a limit field: ``max_events`` -> ``--max-events``."""
    return "--" + name.replace("_", "-")


@dataclass(frozen=True, slots=True)
class Needs:
    """What a plan's step is estimated to need (see docs/derivations.md)."""

    gpus: int
    layers: int
    microbatches: int
    events: int
    work: int
    """Events plus the engine's per-layer scans, in event-equivalents."""
    memory_bytes: int


def estimate_needs(
    *,
    gpus: int,
    layers: int,
    microbatches: int,
    tp: int,
    pp: int,
    dp: int,
    virtual_stages: int = 1,
    all_ranks: bool = False,
    zero: int = 0,
    per_layer_exchanges: bool = True,
) -> Needs:
    """Upper bounds of events and memory from the plan's counts (formula in docs/derivations.md).

    ``per_layer_exchanges``: the plan exchanges data per layer and micro-batch beyond
    ZeRO-3 (experts, context parallelism); False for a dense plan."""
    classes = pp * max(1, virtual_stages) * (tp * dp if all_ranks else 1)
    per_stage = -(-layers // max(1, pp))
    if zero == 3:
        per_layer = EVENTS_PER_LAYER_FSDP
    else:
        per_layer = EVENTS_PER_LAYER if per_layer_exchanges else 0
    per_class = microbatches * (EVENTS_PER_MICROBATCH + per_layer * per_stage)
    events = classes * (per_class + EVENTS_PER_LAYER_STEP * per_stage) + 16 * layers
    scans = (SCAN_WORK_FSDP if zero == 3 else SCAN_WORK_DDP) * (microbatches + 1) * layers**2
    memory = BASE_MEMORY_BYTES + MEMORY_PER_RANK_BYTES * gpus + MEMORY_PER_EVENT_BYTES * events
    return Needs(
        gpus=gpus,
        layers=layers,
        microbatches=microbatches,
        events=events,
        work=events + int(scans) + RANK_WORK * gpus,
        memory_bytes=memory,
    )


def check_ranks(
    gpus: int,
    limits: Limits | None = None,
    *,
    key_path: str = "cluster.nodes",
    option: str | None = "--max-gpus",
) -> None:
    """Refuse a cluster of more than ``limits.max_gpus`` ranks before it is built.

    Args:
        option: the option of the command that raises the limit (None: it has none).

    Raises:
        LimitError: too many ranks; the message names ``option``.
    """
    lim = limits or Limits()
    if gpus > lim.max_gpus:
        how = f", or raise the limit with {option}" if option else ""
        raise LimitError(
            f"the cluster has {gpus:,} GPUs, more than the limit of {lim.max_gpus:,}; use "
            f"fewer nodes{how}",
            key_path=key_path,
        )


def check_scenario(
    scenario: Scenario, limits: Limits | None = None, *, all_ranks: bool = False
) -> Needs:
    """Check a loaded scenario against ``limits`` before its topology is built.

    Reads only the topology file's ``nodes`` and ``gpus_per_node`` (not the links), checks that
    the plan's sizes multiply out (the same rules as ``collsim.parallel.plan.build_plan``,
    here before any topology exists), then estimates what the step needs.

    Returns:
        The estimate.

    Raises:
        ConfigError: the batch does not split into micro-batches, or tp x pp x dp is not the
            cluster's GPU count (located in the scenario file).
        LimitError: a figure beyond its limit; the message says which option raises it.
    """
    lim = limits or Limits()
    par = scenario.parallel
    shape = _cluster_shape(scenario)
    gpus = shape[0] * shape[1] if shape is not None else None
    if gpus is not None:
        try:
            check_ranks(gpus, lim)
        except LimitError as exc:
            raise scenario.locate(exc) from None
    if shape is not None and par.world_size != shape[0] * shape[1]:
        raise scenario.locate(
            ConfigError(
                f"tp x pp x dp = {par.tp} x {par.pp} x {par.dp} = {par.world_size} must equal "
                f"the GPUs of the cluster (cluster.nodes x gpus per node = {shape[0]} x "
                f"{shape[1]} = {shape[0] * shape[1]})",
                key_path="parallel",
            )
        )
    return check_plan(scenario, lim, gpus=gpus, all_ranks=all_ranks)


def check_plan(
    scenario: Scenario, limits: Limits | None = None, *, gpus: int | None, all_ranks: bool = False
) -> Needs:
    """The plan's own figures against ``limits``: layers, micro-batches, events and memory
    (``gpus``: the cluster's ranks, None for tp x pp x dp). Used as is where the cluster is
    already built (each point of a sweep).

    Raises:
        ConfigError: the batch does not split into micro-batches.
        LimitError: a figure beyond its limit; the message says which option raises it.
    """
    lim = limits or Limits()
    par, train, spec = scenario.parallel, scenario.training, scenario.model
    if spec.num_layers > lim.max_layers:
        raise scenario.locate(
            LimitError(
                f"{spec.num_layers:,} layers is more than the limit of {lim.max_layers:,}; use "
                f"fewer layers, or raise the limit with --max-layers",
                key_path="model.layers",
            )
        )
    per_replica = train.micro_batch * par.dp
    if train.global_batch % per_replica:
        raise scenario.locate(
            ConfigError(
                f"global batch ({train.global_batch}) must be divisible by micro_batch x dp = "
                f"{train.micro_batch} x {par.dp}",
                key_path="training.global_batch",
            )
        )
    m = train.global_batch // per_replica
    if m > lim.max_microbatches:
        raise scenario.locate(
            LimitError(
                f"{m:,} micro-batches per replica (global_batch / (micro_batch x dp) = "
                f"{train.global_batch} / ({train.micro_batch} x {par.dp})) is more than the "
                f"limit of {lim.max_microbatches:,}; lower training.global_batch or raise "
                f"training.micro_batch, or raise the limit with --max-microbatches",
                key_path="training.global_batch",
            )
        )
    needs = estimate_needs(
        gpus=gpus if gpus is not None else par.world_size,
        layers=spec.num_layers,
        microbatches=m,
        tp=par.tp,
        pp=par.pp,
        dp=par.dp,
        virtual_stages=par.virtual_stages,
        all_ranks=all_ranks,
        zero=par.zero,
        per_layer_exchanges=spec.num_experts > 0 or par.cp > 1,
    )
    hint = "fewer micro-batches (training.global_batch) or layers" + (
        ", or drop --all-ranks" if all_ranks else ""
    )
    if needs.work > lim.max_events:
        raise scenario.locate(
            LimitError(
                f"the step needs about {needs.work:,} simulation events, more than the limit "
                f"of {lim.max_events:,}; use {hint}, or raise the limit with --max-events",
                key_path="training.global_batch",
            )
        )
    if needs.memory_bytes > lim.max_memory_gib * GIB:
        raise scenario.locate(
            LimitError(
                f"the simulation needs about {needs.memory_bytes / GIB:.1f} GiB of memory, more "
                f"than the limit of {lim.max_memory_gib:g} GiB; use fewer GPUs or {hint}, or "
                f"raise the limit with --max-memory-gib",
                key_path="training.global_batch",
            )
        )
    return needs


def _cluster_shape(scenario: Scenario) -> tuple[int, int] | None:
    """(nodes, gpus_per_node) from the topology file's header, or None if it cannot be read
    (the topology loader then reports the problem with its line)."""

    try:
        data: Any = read_topology_file(scenario.cluster.topology).data
    except ConfigError:
        return None
    if not isinstance(data, dict):
        return None
    nodes = scenario.cluster.nodes if scenario.cluster.nodes is not None else data.get("nodes", 1)
    per_node = data.get("gpus_per_node")
    if not isinstance(nodes, int) or not isinstance(per_node, int) or isinstance(per_node, bool):
        return None
    if nodes <= 0 or per_node <= 0:
        return None
    return nodes, per_node
