"""Segments are timed by their layer's kind (``spec.layer_kinds()``): DeepSeek-V3's dense-first
layers, GPT-OSS's alternating full and sliding-window attention."""

from __future__ import annotations

import warnings

import pytest

from collsim.cluster.topology import load_topology
from collsim.core.errors import CollsimWarning
from collsim.parallel.config import ParallelConfig, TrainingConfig
from collsim.step.build import build_schedule
from collsim.workload import get_preset


def _layer_compute(preset: str, **model) -> dict[int, float]:  # type: ignore[no-untyped-def]
    spec = get_preset(preset, **model)
    topo = load_topology("dgx_h100", nodes=1)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", CollsimWarning)
        schedule = build_schedule(
            topo, spec, TrainingConfig(global_batch=8, micro_batch=1), ParallelConfig(dp=8)
        )
    (chunk,) = schedule.stages[0].chunks
    return {seg.key: seg.compute_s for seg in chunk.forward if isinstance(seg.key, int)}


def test_dense_first_layers_are_timed_as_dense() -> None:
    t = _layer_compute("deepseek-v3", num_layers=5, seq_len=1024)  # layers 0-2 dense
    assert t[0] == t[1] == t[2] and t[3] == t[4]
    assert t[0] != t[3]


def test_window_layers_are_timed_as_windowed() -> None:
    t = _layer_compute("gpt-oss-120b", num_layers=4, seq_len=8192, sliding_window_layers=(0, 2))
    assert t[0] == t[2] and t[1] == t[3]
    assert t[0] < t[1]  # 128 keys per query against 8 K


@pytest.mark.parametrize(
    ("recompute", "parallel"),
    [
        (  # paired forms of the MoE layers (EP overlap), one layer per chunk
            "selective",
            ParallelConfig(
                dp=2,
                tp=2,
                pp=2,
                ep=2,
                sequence_parallel=True,
                ep_overlap=True,
                schedule="interleaved",
                virtual_stages=3,
            ),
        ),
        # the recomputed forward before the backward, three layers per stage
        ("full", ParallelConfig(dp=2, tp=2, pp=2, ep=2, sequence_parallel=True)),
    ],
    ids=["ep-overlap", "full-recompute"],
)
def test_a_layer_kinds_segments_are_made_once_and_each_layer_has_its_own(
    recompute: str, parallel: ParallelConfig
) -> None:
    # build_stage makes a layer kind's segments once per plan: every layer gets its own
    # segments (its key, the same fields) over the kind's step lists, as if made for it alone
    from dataclasses import fields

    from collsim.parallel.plan import build_plan
    from collsim.step.layer_passes import layer_segments

    spec = get_preset("deepseek-v3", num_layers=6, seq_len=1024)  # layers 0-2 dense, 3-5 MoE
    topo = load_topology("dgx_h100", nodes=1)
    training = TrainingConfig(global_batch=16, micro_batch=1, recompute=recompute)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", CollsimWarning)
        schedule = build_schedule(topo, spec, training, parallel)
        plan = build_plan(topo, spec, training, parallel)
    by_key = {}
    for stage in schedule.stages.values():
        for chunk in stage.chunks:
            pairs = [*zip(chunk.forward, chunk.paired_forward or chunk.forward)]
            pairs += [*zip(chunk.backward, chunk.paired_backward or chunk.backward)]
            for seg, paired in pairs:
                if isinstance(seg.key, int):
                    by_key.setdefault(seg.key, []).append((seg, paired))
    assert sorted(by_key) == list(range(6))
    names = [f.name for f in fields(by_key[0][0][0])]
    for index, segs in by_key.items():
        (f, pf), (b, _) = segs
        blk, comms = _block(schedule, spec, index), _comms(plan, spec, index)
        own = layer_segments(plan, index, blk, comms, 2)
        for got, want in zip((f, b), own[:2]):
            assert got.key == index
            for name in names:
                if name != "framework_s":  # FSDP / framework work added per segment later
                    assert getattr(got, name) == getattr(want, name), (index, name)
        first = 0 if index < 3 else 3  # the first layer of its kind
        (f0, pf0), (b0, _) = by_key[first]
        if index != first:  # the kind's step lists, in segments of the layer's own
            assert f is not f0 and b is not b0 and pf is not pf0
            assert f.steps is f0.steps and b.steps is b0.steps
    # one layer's segment changed does not change another's
    (f3, _), _ = by_key[3]
    (f4, _), _ = by_key[4]
    before = f4.framework_s
    f3.framework_s += 1.0
    assert f4.framework_s == before


def _block(schedule, spec, index):  # type: ignore[no-untyped-def]
    from collsim.step.build import _layer_lookup

    layer, layer_of = _layer_lookup(spec, schedule.layers or {0: schedule.layer})
    return layer if layer_of is None else layer_of(index)


def _comms(plan, spec, index):  # type: ignore[no-untyped-def]
    from collsim.step.build import _comms_lookup

    comms_of = _comms_lookup(plan, spec)
    return comms_of(index) if comms_of is not None else []
