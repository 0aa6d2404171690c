"""Segments are timed by their layer's kind (``spec.layer_kinds()``): DeepSeek-V3's dense-first
layers, GPT-OSS's alternating full and sliding-window attention."""

from __future__ import annotations

import warnings

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
