"""The search space's MoE, CP, HSDP and dtype axes (etp, dispatcher, EP overlap, CP algorithm,
HSDP group, FP8): every plan of the grid kept or counted, the plans kept are those the plan
checks build, the floors of such plans stay below their estimates, and the options that set
them."""

from __future__ import annotations

import dataclasses
import itertools
import random
import subprocess
import sys
import warnings
from collections import Counter
from pathlib import Path

import pytest

from collsim.cluster.topology import load_topology
from collsim.core.errors import ConfigError
from collsim.parallel.config import FSDPConfig, ParallelConfig, TrainingConfig
from collsim.parallel.dispatch import ep_layout
from collsim.parallel.plan import build_plan
from collsim.play.walk import Estimator, estimate_step
from collsim.study.search import REASONS, SearchSpace, candidate, enumerate_plans, search_plans
from collsim.study.search.bounds import memory_limit_bytes
from collsim.study.search.space import Candidate, _Rules
from collsim.study.search.variants import VariantBounds
from collsim.study.space_file import read_space
from collsim.workload import TransformerSpec

REPO = Path(__file__).resolve().parents[1]
CLI = [sys.executable, "-c", "import sys; from collsim.cli import main; sys.exit(main())"]

MOE = TransformerSpec(
    name="small-moe",
    num_layers=4,
    hidden=1024,
    num_heads=16,
    num_kv_heads=4,
    ffn_hidden=4096,
    seq_len=2048,
    vocab=1000,
    num_experts=16,
    moe_top_k=4,
    moe_ffn_hidden=1024,
    first_k_dense=1,
    gated_mlp=True,
)

#: the data-parallel knobs at one value each, few micro-batches: the new axes vary
SPACE = SearchSpace(
    micro_batches=(1, 2),
    schedules=("1f1b", "interleaved"),
    virtual_stages=(2,),
    zero_stages=(1, 3),
    recomputes=("none", "full"),
    bucket_mbs=(25.0,),
    overlaps=(True,),
    bucket_views=(False,),
    prefetches=(1,),
    offloads=(False,),
    reshards=(True,),
    cps=(1, 2),
    eps=(1, 4, 16),
    etps=(1, 2),
    dispatchers=("alltoall", "deepep", "allgather"),
    ep_overlaps=(False, True),
    cp_algorithms=("ring", "all_gather"),
    shard_groups=(4, 16),
    fp8s=(False, True),
)


def _brute(spec: TransformerSpec, gpus: int, space: SearchSpace) -> int:
    """Every combination of every knob, buildable or not (independent of enumerate_plans)."""
    per_plan = len(space.dp_variants()) * len(space.recomputes) * len(space.micro_batches)
    extras = 1
    for axis in (
        space.dispatchers,
        space.ep_overlaps,
        space.cp_algorithms,
        space.shard_groups,
        space.fp8s,
    ):
        extras *= len(axis or (None,))
    total = 0
    for cp, _, _ in itertools.product(space.cps or (1,), space.eps or (1,), space.etps or (1,)):
        n = gpus // cp
        for tp in [d for d in range(1, n + 1) if n % d == 0]:
            for pp in [d for d in range(1, n // tp + 1) if (n // tp) % d == 0]:
                scheds = 1 if pp == 1 else len(space.schedules)  # one v for interleaved
                sps = 2 if tp > 1 else 1
                total += per_plan * scheds * sps * extras
    return total


def test_every_plan_of_the_new_axes_is_kept_or_counted() -> None:
    rejected: Counter[str] = Counter()
    training = TrainingConfig(global_batch=64, micro_batch=1, dtype="bf16")
    plans = list(
        enumerate_plans(
            MOE, 16, 8, 64, SPACE, rejected, base=ParallelConfig(dp=16), training=training
        )
    )
    assert len(plans) + sum(rejected.values()) == _brute(MOE, 16, SPACE)
    assert len(set(plans)) == len(plans)
    assert set(rejected) <= set(REASONS)
    for reason in ("ep_fold", "ep_sp", "ep_overlap", "hsdp_dp", "same_plan"):
        assert rejected[reason] > 0, reason
    assert {p.etp for p in plans} == {1, 2} and {p.dtype for p in plans} == {"bf16", "fp8"}
    assert {p.dispatcher for p in plans if p.ep > 1} == {"alltoall", "deepep", "allgather"}
    assert {p.dispatcher for p in plans if p.ep == 1} == {None}
    assert not any(p.ep_overlap for p in plans if p.ep == 1 or p.dispatcher == "allgather")
    assert {p.cp_algorithm for p in plans if p.cp == 1} == {"ring"}
    assert {p.cp_algorithm for p in plans if p.cp > 1} == {"ring", "all_gather"}
    assert {p.shard_group for p in plans} == {None, 4}  # 16 = dp is no HSDP group
    assert len({p.label for p in plans}) == len(plans)  # a label names one plan


def _builds(topology, spec, training, parallel, c: Candidate) -> bool:
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            build_plan(topology, spec, *c.configs(training, parallel))
    except ConfigError:
        return False
    return True


def test_the_plans_kept_are_those_that_build() -> None:
    # every combination of the knobs, built one by one (build_plan and check_dispatch are the
    # judges): the grid keeps exactly those that build, each once
    topology = load_topology("dgx_h100", nodes=2)
    training = TrainingConfig(global_batch=64, micro_batch=1, dtype="bf16", stack="megatron_te")
    base = ParallelConfig(dp=16)
    space = dataclasses.replace(
        SPACE, micro_batches=(1,), zero_stages=(1,), cps=(1,), shard_groups=None
    )
    kept = set(enumerate_plans(MOE, 16, 8, 64, space, base=base, training=training))
    built: set[Candidate] = set()
    for tp, pp, ep, etp, sched, sp, rc, d, o, f in itertools.product(
        (1, 2, 4),
        (1, 2),
        (1, 4, 16),
        (1, 2),
        ("1f1b", "interleaved"),
        (False, True),
        ("none", "full"),
        ("alltoall", "deepep", "allgather"),
        (False, True),
        (False, True),
    ):
        if (pp == 1 and sched != "1f1b") or (tp == 1 and sp):
            continue
        c = Candidate(
            tp=tp,
            pp=pp,
            dp=16 // (tp * pp),
            micro_batch=1,
            schedule=sched,
            virtual_stages=2 if sched == "interleaved" else 1,
            zero=1,
            recompute=rc,
            sequence_parallel=sp,
            ep=ep,
            etp=etp,
            dispatcher=d if ep > 1 else None,
            ep_overlap=o and ep > 1,
            dtype="fp8" if f else "bf16",
        )
        if _builds(topology, MOE, training, base, c):
            built.add(c)
    assert {c for c in kept if c.tp <= 4 and c.pp <= 2} == built


def test_the_ep_nodes_of_the_rules_are_those_of_the_plan() -> None:
    topology = load_topology("dgx_h100", nodes=8)
    training = TrainingConfig(global_batch=64, micro_batch=1)
    for order in ("tp-cp-ep-dp-pp", "tp-cp-ep-pp-dp"):
        base = ParallelConfig(dp=64, order=order)
        rules = _Rules(MOE, 8, base, [], stack=None, fp8_capable=True)
        for tp, pp, ep, etp in itertools.product((1, 2), (1, 2, 4), (2, 4, 16), (1, 2)):
            dp = 64 // (tp * pp)
            if (tp * dp) % (ep * etp):
                continue
            parallel = dataclasses.replace(
                base, tp=tp, pp=pp, dp=dp, ep=ep, etp=etp, sequence_parallel=tp > 1
            )
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")  # dp outermost: EP groups stride over stages
                plan = build_plan(topology, MOE, training, parallel)
            assert rules.ep_nodes(tp, 1, pp, dp, ep, etp) == ep_layout(plan)[0]


def test_fp8_is_tried_only_where_the_device_has_it() -> None:
    rejected: Counter[str] = Counter()
    space = dataclasses.replace(SPACE, eps=(1,), etps=(1,), cps=(1,), fp8s=(True, False))
    plans = list(
        enumerate_plans(
            MOE, 16, 8, 64, space, rejected, base=ParallelConfig(dp=16), fp8_capable=False
        )
    )
    assert plans and {p.dtype for p in plans} == {"bf16"} and rejected["fp8_device"] > 0


def test_floors_of_the_new_axes_stay_below_the_estimate() -> None:
    # plans of each new knob (etp, dispatcher, EP overlap, HSDP group, FP8, offload, kept
    # gathers): the memory and step floors the search prunes with never exceed the estimate
    topology = load_topology("dgx_h100", nodes=2)
    training = TrainingConfig(global_batch=64, micro_batch=1, dtype="bf16")
    base = ParallelConfig(dp=16)
    space = dataclasses.replace(
        SPACE,
        cps=(1,),
        offloads=(False, True),
        reshards=(True, False),
        zero_stages=(1, 3),
    )
    plans = list(enumerate_plans(MOE, 16, 8, 64, space, base=base, training=training))
    bounds = VariantBounds(topology, MOE, training, base)
    estimator = Estimator(topology, MOE)
    checked: Counter[str] = Counter()
    for plan in random.Random(0).sample(plans, 80):
        try:
            est = estimator.estimate(*plan.configs(training, base))
        except ConfigError:
            continue
        assert bounds.step_s(plan) <= bounds.refined_s(plan) <= est.step_time_s, plan.label
        assert bounds.memory_bytes(plan) <= est.memory_peak_bytes, plan.label
        for knob, on in (
            ("etp", plan.etp > 1),
            ("overlap", plan.ep_overlap),
            ("hsdp", plan.shard_group is not None),
            ("fp8", plan.dtype == "fp8"),
            ("offload", plan.offload),
        ):
            checked[knob] += on
    assert all(checked[k] > 0 for k in ("etp", "overlap", "hsdp", "fp8", "offload")), checked


@pytest.mark.parametrize(
    ("text", "key", "rule"),
    [
        ("dispatchers: [pigeon]\n", "dispatchers", "one of"),
        ("cp_algorithms: [a2a]\n", "cp_algorithms", "one of"),
        ("etps: [0]\n", "etps", ">= 1"),
        ("fp8s: [maybe]\n", "fp8s", "true or false"),
    ],
)
def test_a_space_file_checks_the_new_axes(tmp_path: Path, text: str, key: str, rule: str) -> None:
    path = tmp_path / "space.yaml"
    path.write_text(text)
    with pytest.raises(ConfigError) as info:
        read_space(path)
    assert info.value.key_path == key and rule in str(info.value)


def test_a_space_file_sets_the_new_axes(tmp_path: Path) -> None:
    path = tmp_path / "space.yaml"
    path.write_text(
        "etps: [1, 2]\ndispatchers: [alltoall, deepep]\nep_overlaps: [false, true]\n"
        "cp_algorithms: [all_gather]\nshard_groups: [8]\nfp8s: [true]\n"
    )
    space = read_space(path)
    assert space.etps == (1, 2) and space.dispatchers == ("alltoall", "deepep")
    assert space.ep_overlaps == (False, True) and space.cp_algorithms == ("all_gather",)
    assert space.shard_groups == (8,) and space.fp8s == (True,)


@pytest.mark.parametrize(
    ("option", "value", "needle"),
    [
        ("--dispatcher", "alltoall,pigeon", "--dispatcher"),
        ("--fp8", "yes", "--fp8"),
        ("--etp", "1,x", "--etp"),
        ("--cp-algorithm", "a2a", "--cp-algorithm"),
        ("--hsdp", "0", "--hsdp"),
    ],
)
def test_a_bad_axis_option_is_one_line(option: str, value: str, needle: str) -> None:
    done = subprocess.run(
        CLI + ["search", "scenarios/ddp_gpt3_1.3b.yaml", "--gpus", "16", option, value],
        cwd=REPO,
        env={"PYTHONPATH": str(REPO), "PATH": "/usr/bin:/bin"},
        capture_output=True,
        timeout=120,
    )
    lines = done.stderr.decode().strip().splitlines()
    assert done.returncode == 2 and len(lines) == 1 and needle in lines[0], lines


def test_the_axis_options_reach_the_space() -> None:
    from collsim.cli.search import _space_options

    kwargs = _space_options(
        {
            "--etp": "1,2",
            "--dispatcher": "deepep,hybridep",
            "--ep-overlap": "on,off",
            "--cp-algorithm": "ring,all_gather",
            "--hsdp": "8",
            "--fp8": "off",
            "--tp": "1,2",
            "--pp": "4",
        }
    )
    assert kwargs == {
        "etps": (1, 2),
        "dispatchers": ("deepep", "hybridep"),
        "ep_overlaps": (True, False),
        "cp_algorithms": ("ring", "all_gather"),
        "shard_groups": (8,),
        "fp8s": (False,),
        "tps": (1, 2),
        "pps": (4,),
    }


DENSE = TransformerSpec(
    name="small-dense",
    num_layers=8,
    hidden=1024,
    num_heads=16,
    num_kv_heads=4,
    ffn_hidden=4096,
    seq_len=2048,
    vocab=1000,
    gated_mlp=True,
)

#: per plan kind: the model, the training dtype and stack, and the axes that make the kind
KINDS: dict[str, tuple[TransformerSpec, str, str | None, dict[str, object]]] = {
    "moe": (
        MOE,
        "bf16",
        "megatron_te",
        dict(
            eps=(2, 4, 8, 16),
            etps=(1, 2),
            dispatchers=("alltoall", "deepep", "hybridep", "allgather"),
            ep_overlaps=(False, True),
            zero_stages=(0, 1, 2, 3),
        ),
    ),
    "cp": (
        DENSE,
        "bf16",
        None,
        dict(cps=(2, 4), cp_algorithms=("ring", "all_gather"), zero_stages=(0, 1, 2, 3)),
    ),
    "fp8": (
        MOE,
        "fp8",
        "megatron_te",
        dict(eps=(1, 4), fp8s=(True,), zero_stages=(0, 1, 2, 3), cps=(1, 2)),
    ),
    "zero3": (
        MOE,
        "bf16",
        None,
        dict(
            eps=(1, 4),
            zero_stages=(3,),
            prefetches=(0, 1, 2),
            offloads=(False, True),
            reshards=(True, False),
        ),
    ),
    "dense": (
        DENSE,
        "bf16",
        None,
        dict(
            schedules=("gpipe", "1f1b", "interleaved", "zb_h1", "dualpipev"),
            zero_stages=(0, 1, 2, 3),
            tps=(1, 2, 4),
            pps=(1, 2, 4),
            overlaps=(True, False),
            bucket_mbs=(10.0, 400.0),
        ),
    ),
    "fsdp": (
        DENSE,
        "bf16",
        None,
        dict(
            zero_stages=(3,),
            prefetches=(0, 1, 2),
            offloads=(False, True),
            reshards=(True, False),
            shard_groups=(4, 16),
            tps=(1, 2),
        ),
    ),
    "schedules": (
        DENSE,
        "bf16",
        None,
        dict(
            schedules=("gpipe", "1f1b", "interleaved", "zb_h1", "dualpipev"),
            pps=(2, 4),
            zero_stages=(0, 1, 3),
            micro_batches=(1,),
        ),
    ),
}


@pytest.mark.parametrize("kind", sorted(KINDS))
def test_random_plans_of_each_kind_keep_their_floors_below_the_estimate(kind: str) -> None:
    # random plans of one kind (MoE, CP, FP8, ZeRO-3, dense DDP / ZeRO-1-3 / TP / SP / PP,
    # FSDP / HSDP with offload and resharding, pipeline schedules), each estimated:
    # the memory floor never above the estimate's peak, the step floors never above its step
    spec, dtype, stack, axes = KINDS[kind]
    topology = load_topology("dgx_h100", nodes=2)
    training = TrainingConfig(global_batch=64, micro_batch=1, dtype=dtype, stack=stack)
    base = ParallelConfig(dp=16)
    space = SearchSpace(
        micro_batches=axes.get("micro_batches", (1, 2)),  # type: ignore[arg-type]
        schedules=axes.get("schedules", ("1f1b", "interleaved")),  # type: ignore[arg-type]
        virtual_stages=(2,),
        recomputes=("none", "selective", "full"),
        bucket_mbs=axes.get("bucket_mbs", (25.0,)),  # type: ignore[arg-type]
        bucket_views=(False,),
        **{k: v for k, v in axes.items() if k not in ("micro_batches", "schedules", "bucket_mbs")},  # type: ignore[arg-type]
    )
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        plans = list(enumerate_plans(spec, 16, 8, 64, space, base=base, training=training))
        bounds = VariantBounds(topology, spec, training, base)
        estimator = Estimator(topology, spec)
        checked = tight_step = tight_memory = 0
        for plan in random.Random(kind).sample(plans, min(40, len(plans))):
            try:
                est = estimator.estimate(*plan.configs(training, base))
            except ConfigError:
                continue
            step, refined = bounds.step_s(plan), bounds.refined_s(plan)
            assert step <= refined <= est.step_time_s, plan.label
            memory = bounds.memory_bytes(plan)
            assert memory <= est.memory_peak_bytes, plan.label
            checked += 1
            tight_step += refined >= 0.8 * est.step_time_s
            tight_memory += memory >= 0.8 * est.memory_peak_bytes
    assert checked >= 25, checked
    # not vacuous: a quarter of the floors at least within 20 % of what they bound
    assert tight_step >= checked // 4, (tight_step, checked)
    assert tight_memory >= checked // 4, (tight_memory, checked)


def test_pruning_fp8_expert_plans_returns_the_best_ten_of_estimating_all() -> None:
    # FP8 MoE plans under megatron_te with every ZeRO stage (ZeRO-3 gathers, kept parameters,
    # offload) and EP over 1 to 8: branch and bound on the program-read floors against
    # estimating every plan: the same ten best, in the same order, with the same estimates
    topology = load_topology("dgx_h100", nodes=2)
    training = TrainingConfig(global_batch=32, micro_batch=1, dtype="fp8", stack="megatron_te")
    base = ParallelConfig(dp=16)
    space = SearchSpace(
        micro_batches=(1, 2),
        schedules=("1f1b",),
        zero_stages=(0, 1, 3),
        recomputes=("none", "full"),
        bucket_mbs=(25.0,),
        bucket_views=(False,),
        prefetches=(1,),
        eps=(1, 2, 8),
        dispatchers=("alltoall", "hybridep"),
        tps=(1, 2),
        pps=(1, 2),
    )
    args = (topology, MOE, training, base)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        pruned = search_plans(*args, space=space, top_k=0, prune_keep=10)
        full = search_plans(*args, space=space, top_k=0, prune_keep=0)
    assert full.estimated == full.buildable >= 150
    assert {r.candidate.zero for r in full.ranked} == {0, 1, 3}
    assert pruned.estimated < full.estimated
    best = [(r.candidate, r.estimate.step_time_s) for r in full.ranked[:10]]
    assert [(r.candidate, r.estimate.step_time_s) for r in pruned.ranked[:10]] == best


WIDE = TransformerSpec(
    name="wide-dense",
    num_layers=8,
    hidden=8192,
    num_heads=64,
    num_kv_heads=8,
    ffn_hidden=28672,
    seq_len=2048,
    vocab=32000,
    gated_mlp=True,
)


def test_pruning_dense_plans_returns_the_best_ten_of_estimating_all() -> None:
    # a dense model too large for DDP on 16 GPUs: DDP, ZeRO-1/2/3 with offload and
    # resharding, TP with and without SP, PP under every schedule, recompute; branch and bound
    # on the program-read floors (the memory floor pruning many) against estimating every plan
    topology = load_topology("dgx_h100", nodes=2)
    training = TrainingConfig(global_batch=32, micro_batch=1, dtype="bf16")
    base = ParallelConfig(dp=16)
    space = SearchSpace(
        micro_batches=(1, 2),
        schedules=("gpipe", "1f1b", "interleaved", "zb_h1", "dualpipev"),
        virtual_stages=(2,),
        zero_stages=(0, 1, 2, 3),
        recomputes=("none", "full"),
        bucket_mbs=(25.0,),
        bucket_views=(False,),
        prefetches=(1,),
        offloads=(False, True),
        tps=(1, 4),
        pps=(1, 2, 4),
    )
    args = (topology, WIDE, training, base)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        pruned = search_plans(*args, space=space, top_k=0, prune_keep=10)
        full = search_plans(*args, space=space, top_k=0, prune_keep=0)
    assert full.estimated == full.buildable >= 300
    assert pruned.rejected["memory_bound"] > 0 and pruned.rejected["bound"] > 0
    assert pruned.estimated < full.estimated / 3
    fits = {r.candidate for r in full.ranked}
    assert {c.schedule for c in fits if c.pp > 1} >= {"1f1b", "interleaved", "zb_h1", "dualpipev"}
    assert {c.zero for c in fits} == {0, 1, 2, 3}
    best = [(r.candidate, r.estimate.step_time_s) for r in full.ranked[:10]]
    assert [(r.candidate, r.estimate.step_time_s) for r in pruned.ranked[:10]] == best


def test_no_plan_the_fit_verdict_keeps_is_pruned_by_the_memory_floor() -> None:
    # the plans near the GPU's limit, each run as `collsim run --fidelity closed` runs it
    # (the caching allocator replayed): a plan that fits there has its memory floor within
    # the limit the search prunes against; some fit with more allocated than the older rule
    # (allocated against the capacity less a 3 % share) allowed
    topology = load_topology("dgx_h100", nodes=2)
    device = topology.device
    training = TrainingConfig(global_batch=32, micro_batch=1, dtype="bf16")
    base = ParallelConfig(dp=16)
    space = SearchSpace(
        micro_batches=(1, 2),
        schedules=("1f1b", "interleaved"),
        virtual_stages=(2,),
        zero_stages=(0, 1, 2, 3),
        recomputes=("none", "selective", "full"),
        bucket_mbs=(25.0,),
        bucket_views=(False,),
        prefetches=(1,),
        offloads=(False,),
        tps=(1, 2, 4),
        pps=(1, 2, 4),
    )
    limit = memory_limit_bytes(device)
    assert device.usable_memory_bytes < limit < device.reported_capacity_bytes
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        plans = list(enumerate_plans(WIDE, 16, 8, 32, space, base=base, training=training))
        bounds = VariantBounds(topology, WIDE, training, base)
        near = [p for p in plans if 0.85 * limit < bounds.memory_bytes(p) < 1.15 * limit]
        fits = over_old = refused = 0
        estimator = Estimator(topology, WIDE)
        for plan in near:
            result = estimate_step(topology, WIDE, *plan.configs(training, base))
            floor = bounds.memory_bytes(plan)
            # the search's own estimate (no memory timeline) gives the run's verdict
            assert estimator.estimate(*plan.configs(training, base)).fits == result.fits
            if result.fits:
                fits += 1
                assert floor <= limit, plan.label
                over_old += floor > device.usable_memory_bytes
            else:
                refused += 1
    assert fits >= 5 and refused > 0, (fits, refused)
    assert over_old > 0


def test_a_plans_sections_are_those_made_for_it_alone() -> None:
    """``Candidate.configs`` keeps the sections it makes by the knobs that replace their fields:
    every plan's sections, made in the search's order, equal those made with nothing kept (a
    knob missing from the keys would hand a plan the sections of another)."""
    training = TrainingConfig(global_batch=64, micro_batch=1, dtype="bf16")
    base = ParallelConfig(dp=16, fsdp=FSDPConfig(fp8_all_gather=True))  # (FP8 plans' only)
    space = dataclasses.replace(
        SPACE,
        cps=(1,),
        eps=(1, 4),
        etps=(1,),
        dispatchers=("alltoall",),
        ep_overlaps=(False,),
        cp_algorithms=("ring",),
        zero_stages=(0, 1, 2, 3),
        bucket_mbs=(25.0, 100.0),
        overlaps=(True, False),
        bucket_views=(False, True),
        prefetches=(1, 2),
        offloads=(False, True),
        reshards=(True, False),
    )
    plans = list(enumerate_plans(MOE, 16, 8, 64, space, base=base, training=training))
    sample = random.Random(3).sample(plans, 400)
    assert {(c.zero, c.dtype, c.bucket_view, c.offload) for c in sample} >= {
        (0, "bf16", True, False),
        (3, "fp8", False, True),
    }
    made = [c.configs(training, base) for c in sample]
    for c, sections in zip(sample, made, strict=True):
        candidate._CONFIGS.clear()
        assert c.configs(training, base) == sections, c.label
