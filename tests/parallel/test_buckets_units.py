"""DDP buckets against torch's own assignment; parameter counts; FSDP units and prefetch."""

from __future__ import annotations

import pytest

from collsim.parallel.buckets import (
    CutBuckets,
    bucket_cuts,
    build_buckets,
    cut_buckets,
    grad_ready_fraction,
    packed_tensors,
)
from collsim.parallel.fsdp import build_units, issue_schedule
from collsim.parallel.params import ParamTensor, chunk_tensors
from collsim.workload.memory import parameters_per_rank
from collsim.workload.presets import get_preset

GPT = get_preset("gpt3-125m")


@pytest.mark.torch
@pytest.mark.parametrize("bucket_mb", [1, 5, 25])
def test_buckets_match_torch_reducer(bucket_mb: float) -> None:
    import torch
    import torch.distributed as dist

    tensors = chunk_tensors(GPT, range(GPT.num_layers), tp=1, first=True, last=True, pp=1)
    ours = build_buckets(tensors, bucket_mb=bucket_mb, grad_bytes=2)
    # torch DDP passes the parameters in reverse order with limits [1 MiB, bucket_cap]
    rev = list(reversed(tensors))
    fake = [torch.empty(int(t.numel), dtype=torch.bfloat16, device="meta") for t in rev]
    groups, _ = dist._compute_bucket_assignment_by_size(
        fake, [dist._DEFAULT_FIRST_BUCKET_BYTES, int(bucket_mb * 2**20)]
    )
    theirs = [tuple(rev[i].name for i in g) for g in groups]
    assert [b.tensors for b in ours] == theirs
    assert len(ours) > 2


def test_first_bucket_is_small_and_ready_points_move_backward() -> None:
    tensors = chunk_tensors(GPT, range(GPT.num_layers), tp=1, first=True, last=True, pp=1)
    buckets = build_buckets(tensors, bucket_mb=25, grad_bytes=2)
    assert buckets[0].tensors[0] == "head.final_norm"  # last registered, first reduced
    assert buckets[0].size_bytes < buckets[1].size_bytes
    assert sum(b.numel for b in buckets) == sum(t.numel for t in tensors)
    order = ["head"] + list(range(GPT.num_layers - 1, -1, -1)) + ["embedding"]
    points = [(order.index(b.ready_segment), b.ready_fraction) for b in buckets]
    assert points == sorted(points)
    assert buckets[-1].ready_segment == "embedding"


def test_grad_ready_fraction_follows_reverse_order() -> None:
    ts = [ParamTensor("a", 1, 0), ParamTensor("b", 3, 0)]
    assert grad_ready_fraction(ts) == {"b": 0.75, "a": 1.0}


@pytest.mark.parametrize(
    "name, tp, pp",
    [("gpt3-125m", 1, 1), ("gpt3-1.3b", 4, 2), ("llama2-7b", 2, 4), ("megatron-39.1b", 8, 2)],
)
def test_tensors_sum_to_parameters_per_rank(name: str, tp: int, pp: int) -> None:
    spec = get_preset(name)
    per = spec.num_layers // pp
    for stage in range(pp):
        ts = chunk_tensors(
            spec,
            range(stage * per, (stage + 1) * per),
            tp=tp,
            first=stage == 0,
            last=stage == pp - 1,
            pp=pp,
        )
        assert sum(t.numel for t in ts) == parameters_per_rank(spec, tp=tp, pp=pp, stage=stage)


def test_units_and_prefetch() -> None:
    tensors = chunk_tensors(GPT, range(3), tp=1, first=True, last=False, pp=2)
    units = build_units(tensors)
    assert [u.segment for u in units] == ["embedding", 0, 1, 2]
    assert sum(u.numel for u in units) == sum(t.numel for t in tensors)
    assert issue_schedule(4, 2) == [[0, 1, 2], [3], [], []]
    assert issue_schedule(2, 5) == [[0, 1], []]


def test_cut_buckets_are_made_when_first_read_and_equal_their_list() -> None:
    """``CutBuckets`` holds the pieces of a chunk's buckets: its count without making them,
    then the same buckets as ``cut_buckets`` of each piece, equal to their list."""
    ts = [ParamTensor(f"w{i}", 2**19 * (i + 1), i) for i in range(6)]
    dense = packed_tensors(ts, expert=None)
    cuts = bucket_cuts(dense.numels, bucket_mb=2, first_bucket_mb=1, grad_bytes=2)
    lazy = CutBuckets([(dense, cuts, None)])
    assert len(lazy) == len(cuts) and lazy._made is None  # counted, not made
    made = cut_buckets(dense, cuts, expert=None)
    assert lazy == made and list(lazy) == made and lazy[-1] == made[-1]
    assert lazy == build_buckets(ts, bucket_mb=2, first_bucket_mb=1)
    assert lazy != made[:-1] and bool(CutBuckets([])) is False
