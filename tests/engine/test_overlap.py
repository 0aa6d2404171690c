"""Communication overlap: DDP buckets behind backward, FSDP prefetch.

DDP (torch reducer): each bucket's all-reduce starts when its last gradient is produced and
the dp stream is free. What stays exposed is what the last buckets cannot hide behind the rest
of backward; an independent calculation from the bucket ready times and the closed-form
all-reduce times must give the engine's dp_exposed.
"""

from __future__ import annotations

import pytest

from collsim.collectives import Group, cost
from collsim.parallel.buckets import build_buckets
from collsim.parallel.config import DDPConfig, FSDPConfig, ParallelConfig, TrainingConfig
from collsim.parallel.params import chunk_tensors, layer_tensors
from collsim.play.engine import simulate_step

from .conftest import topology

TIMES = {
    "layer.forward": 1e-3,
    "layer.backward": 2e-3,
    "layer.recompute": 0.0,
    "embedding.forward": 0.2e-3,
    "embedding.backward": 0.3e-3,
    "head.forward": 0.5e-3,
    "head.backward": 1e-3,
    "optimizer": 1e-3,
}


def _ddp(spec, overlap: bool, m: int = 2, bucket_mb: float = 4):
    topo = topology(nodes=2)
    return simulate_step(
        topo,
        spec,
        TrainingConfig(global_batch=16 * m, micro_batch=1),
        ParallelConfig(dp=16, zero=0, ddp=DDPConfig(bucket_mb=bucket_mb, overlap=overlap)),
        op_time_overrides=TIMES,
    )


def _independent_exposed(spec, m: int, bucket_mb: float, overlap: bool) -> float:
    """FIFO of bucket all-reduces from their ready times in the last backward."""
    topo = topology(nodes=2)
    L = spec.num_layers
    fwd = TIMES["embedding.forward"] + L * TIMES["layer.forward"] + TIMES["head.forward"]
    bwd = TIMES["head.backward"] + L * TIMES["layer.backward"] + TIMES["embedding.backward"]
    t0 = m * fwd + (m - 1) * bwd  # pp = 1: F0 B0 F1 B1 ...
    seg_start = {"head": t0}
    seg_len = {"head": TIMES["head.backward"], "embedding": TIMES["embedding.backward"]}
    t = t0 + TIMES["head.backward"]
    for layer in range(L - 1, -1, -1):
        seg_start[layer], seg_len[layer] = t, TIMES["layer.backward"]
        t += TIMES["layer.backward"]
    seg_start["embedding"] = t
    backward_end = t + TIMES["embedding.backward"]
    tensors = chunk_tensors(spec, range(L), tp=1, first=True, last=True, pp=1)
    group = Group(topo, tuple(range(16)))
    free = 0.0
    for b in build_buckets(tensors, bucket_mb=bucket_mb, grad_bytes=2):
        ready = seg_start[b.ready_segment] + b.ready_fraction * seg_len[b.ready_segment]
        if not overlap:
            ready = backward_end
        free = max(ready, free) + cost("all_reduce", int(b.size_bytes), group).time_s
    return max(0.0, free - backward_end)


@pytest.mark.parametrize("overlap", [True, False])
def test_ddp_exposed_time_matches_bucket_fifo(small_spec, overlap: bool) -> None:
    r = _ddp(small_spec, overlap)
    want = _independent_exposed(small_spec, 2, 4, overlap)
    assert want > 0
    assert r.breakdown_s["dp_exposed"] == pytest.approx(want, rel=1e-9)


def test_overlap_hides_most_of_the_all_reduce(small_spec) -> None:
    on, off = _ddp(small_spec, True), _ddp(small_spec, False)
    assert on.breakdown_s["dp_exposed"] < 0.5 * off.breakdown_s["dp_exposed"]
    assert on.step_time_s < off.step_time_s
    # gradient accumulation (no_sync): only the last micro-batch's backward all-reduces,
    # so the all-reduce count does not grow with the micro-batch count
    calls = {
        m: sum(c.count for c in _ddp(small_spec, True, m=m).collectives if c.op == "all_reduce")
        for m in (1, 3)
    }
    assert calls[1] == calls[3] > 1


def test_fsdp_prefetch_faster_and_one_unit_higher(small_spec) -> None:
    topo = topology(nodes=2)
    tr = TrainingConfig(global_batch=32, micro_batch=2)

    def run(prefetch: int):
        return simulate_step(
            topo, small_spec, tr, ParallelConfig(dp=16, zero=3, fsdp=FSDPConfig(prefetch=prefetch))
        )

    lazy, eager = run(0), run(1)
    assert eager.step_time_s < lazy.step_time_s
    assert eager.breakdown_s["dp_exposed"] < lazy.breakdown_s["dp_exposed"]
    unit = sum(t.numel for t in layer_tensors(small_spec, 0, 1)) * 2  # one bf16 layer
    assert eager.memory_peak_bytes - lazy.memory_peak_bytes == pytest.approx(unit, rel=1e-9)
    # ZeRO-3 collectives per step: gathers in forward and backward, reduce-scatters
    ops = {c.op for c in eager.collectives if c.axis == "dp"}
    assert ops == {"all_gather", "reduce_scatter"}


def test_zero_stages_traffic(small_spec) -> None:
    topo = topology(nodes=2)
    tr = TrainingConfig(global_batch=48, micro_batch=1)  # 3 micro-batches

    def dp_ops(zero: int) -> dict[str, int]:
        r = simulate_step(topo, small_spec, tr, ParallelConfig(dp=16, zero=zero))
        out: dict[str, int] = {}
        for c in r.collectives:
            out[c.op] = out.get(c.op, 0) + c.count
        return out

    z1, z2 = dp_ops(1), dp_ops(2)
    # ZeRO-1 reduce-scatters once per step, ZeRO-2 in every micro-batch; both gather params
    assert z2["reduce_scatter"] == 3 * z1["reduce_scatter"]
    assert z1["all_gather"] == z2["all_gather"] == z1["reduce_scatter"]
