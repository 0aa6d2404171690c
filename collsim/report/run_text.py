"""The text of ``collsim run`` beside the report table: what was simulated (model, cluster, plan,
batch) and what the stragglers cost."""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from collsim.cluster.topology import Topology
    from collsim.step.result import StepResult
    from collsim.study.scenario import Scenario

__all__ = ["describe_scenario", "straggler_lines"]


def describe_scenario(
    scenario: Scenario, topology: Topology, result: StepResult
) -> list[tuple[str, str]]:
    """Label/text lines that say what was simulated: model, cluster, plan, batch (the
    micro-batches per replica as the plan counted them)."""
    spec, train, par = scenario.model, scenario.training, scenario.parallel
    params_b = spec.num_parameters() / 1e9
    kv = f" ({spec.kv_heads} kv)" if spec.kv_heads != spec.num_heads else ""
    model = (
        f"{spec.name}: {params_b:.2f} B params, {spec.num_layers} layers, hidden "
        f"{spec.hidden}, {spec.num_heads} heads{kv}, seq {spec.seq_len}"
    )
    device = getattr(getattr(topology, "device", None), "name", "GPU")
    gpus = topology.num_ranks
    cluster = (
        f"{topology.num_nodes} x {topology.gpus_per_node} {device} = {gpus} GPUs ({topology.name})"
    )
    plan = f"tp {par.tp} x pp {par.pp} x dp {par.dp}"
    if par.pp > 1:
        plan += f", {par.schedule}"
        if par.virtual_stages > 1:
            plan += f" (virtual stages {par.virtual_stages})"
    if par.sequence_parallel:
        plan += ", sequence parallel"
    if par.zero == 0:
        plan += f", DDP buckets {par.ddp.bucket_mb:g} MiB, overlap {_on(par.ddp.overlap)}"
        if par.ddp.gradient_as_bucket_view:
            plan += ", gradients as bucket views"
    elif par.zero in (1, 2):
        plan += f", ZeRO-{par.zero}, buckets {par.ddp.bucket_mb:g} MiB"
    else:
        plan += (
            f", ZeRO-3/FSDP, prefetch {par.fsdp.prefetch}, reshard "
            f"{_on(par.fsdp.reshard_after_forward)}, offload {_on(par.fsdp.offload)}"
        )
    micro = result.num_microbatches
    batch = (
        f"global {train.global_batch} = dp {par.dp} x {micro} micro-batches x "
        f"{train.micro_batch}; {train.dtype}, {train.optimizer}, recompute "
        f"{train.recompute}"
    )
    return [("model", model), ("cluster", cluster), ("plan", plan), ("batch", batch)]


def _on(flag: bool) -> str:
    return "on" if flag else "off"


def straggler_lines(result: StepResult) -> list[str]:
    """The report lines of a straggler step: its cost against the step without stragglers,
    and the rendezvous that waited longest (:attr:`StepResult.stragglers`; none without it)."""
    st = result.stragglers
    if st is None:
        return []
    # the slowest first (the one a user slowed on purpose among jittered ones), four of each
    clocks = sorted(st.clock_factors.items(), key=lambda kv: (kv[1], str(kv[0])))
    links = sorted(st.degraded_links.items(), key=lambda kv: (kv[1], str(kv[0])))
    what = [f"rank {r} at {f:g}x clock" for r, f in clocks[:4]]
    what += [f"... {len(clocks) - 4} more ranks"] if len(clocks) > 4 else []
    what += [f"{name} at {f:g}x bandwidth" for name, f in links[:4]]
    what += [f"... {len(links) - 4} more links"] if len(links) > 4 else []
    lines = [
        f"stragglers: {', '.join(what)}",
        f"  step {st.step_time_s * 1e3:.2f} ms vs {st.baseline_step_time_s * 1e3:.2f} ms "
        f"without stragglers: {st.slowdown:.4f}x (+{st.extra_s * 1e3:.2f} ms); "
        f"critical rank {st.critical_rank}",
    ]
    if st.tp_paced_ranks:
        lines.append(
            f"  TP groups at their slowest member's pace: ranks {_ranks(st.tp_paced_ranks)}"
        )
    for wait in st.waits[:3]:
        waiting = ", ".join(f"{r} {w * 1e3:.2f} ms" for r, w in sorted(wait["waits_s"].items()))
        lines.append(
            f"  {wait['axis']} group {_ranks(wait['group'])}: {wait['call']!r} waited "
            f"{wait['wait_s'] * 1e3:.2f} ms for rank {wait['waited_for']} (waiting: {waiting})"
        )
    if result.fidelity == "closed":
        lines.append("  closed form: the slowed pipeline's critical path (waits: use the DES)")
    return lines


def _ranks(ranks: Sequence[int]) -> str:
    shown = ", ".join(str(r) for r in list(ranks)[:8])
    return f"[{shown}{', ...' if len(ranks) > 8 else ''}]"
