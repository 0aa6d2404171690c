"""Pipeline schedules: every op once, dependencies respected, in-flight micro-batches bounded."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from collsim.parallel.pipeline import Phase, PipeOp, input_of, stage_schedule

F, B = Phase.FORWARD, Phase.BACKWARD


def _in_flight_max(ops: list[PipeOp]) -> int:
    live = peak = 0
    for op in ops:
        live += 1 if op.phase is F else -1
        peak = max(peak, live)
    return peak


def test_1f1b_order_matches_narayanan_fig4() -> None:
    # p = 4, m = 8, stage 0: 3 warm-up forwards, then 1F1B, then drain (Narayanan 2021 Fig. 4)
    ops = stage_schedule("1f1b", num_stages=4, num_microbatches=8, stage=0)
    text = " ".join(f"{o.phase.value}{o.microbatch}" for o in ops)
    assert text == "F0 F1 F2 F3 B0 F4 B1 F5 B2 F6 B3 F7 B4 B5 B6 B7"
    last = stage_schedule("1f1b", num_stages=4, num_microbatches=8, stage=3)
    assert " ".join(f"{o.phase.value}{o.microbatch}" for o in last[:4]) == "F0 B0 F1 B1"


def test_gpipe_is_all_forward_then_all_backward() -> None:
    ops = stage_schedule("gpipe", num_stages=4, num_microbatches=5, stage=2)
    assert [o.phase for o in ops] == [F] * 5 + [B] * 5
    assert _in_flight_max(ops) == 5


def test_interleaved_order_matches_megatron() -> None:
    # p = 2, v = 2, m = 4, stage 0: warm-up (p - 1) * 2 + (v - 1) * p = 4 forwards:
    # mb 0, 1 of chunk 0, then mb 0, 1 of chunk 1 (groups of p micro-batches per chunk)
    ops = stage_schedule("interleaved", num_stages=2, num_microbatches=4, stage=0, virtual_stages=2)
    text = " ".join(f"{o.phase.value}{o.microbatch}.{o.chunk}" for o in ops)
    assert text == (
        "F0.0 F1.0 F0.1 F1.1 F2.0 B0.1 F3.0 B1.1 F2.1 B0.0 F3.1 B1.0 B2.1 B3.1 B2.0 B3.0"
    )


@settings(max_examples=60, deadline=None)
@given(
    p=st.integers(1, 6),
    k=st.integers(1, 4),
    v=st.integers(1, 3),
    kind=st.sampled_from(["gpipe", "1f1b", "interleaved"]),
)
def test_every_op_once_and_bounded_in_flight(p: int, k: int, v: int, kind: str) -> None:
    m = p * k
    v = v if kind == "interleaved" else 1
    for s in range(p):
        ops = stage_schedule(kind, num_stages=p, num_microbatches=m, stage=s, virtual_stages=v)
        assert sorted((o.phase.value, o.microbatch, o.chunk) for o in ops) == sorted(
            (ph, i, c) for ph in "FB" for i in range(m) for c in range(v)
        )
        seen = set()
        for o in ops:  # a backward follows its own forward on the same stage
            if o.phase is B:
                assert (o.microbatch, o.chunk) in seen
            else:
                seen.add((o.microbatch, o.chunk))
        if kind == "1f1b":
            assert _in_flight_max(ops) == min(p - s, m)
        if kind == "gpipe":
            assert _in_flight_max(ops) == m


def test_inputs_cross_stages_and_chunks() -> None:
    assert input_of(PipeOp(F, 3, 0), stage=0, num_stages=4, virtual_stages=2) is None
    assert input_of(PipeOp(F, 3, 1), stage=0, num_stages=4, virtual_stages=2) == (
        3,
        PipeOp(F, 3, 0),
    )
    assert input_of(PipeOp(B, 3, 0), stage=3, num_stages=4, virtual_stages=2) == (
        0,
        PipeOp(B, 3, 1),
    )
    assert input_of(PipeOp(B, 3, 1), stage=3, num_stages=4, virtual_stages=2) is None
    assert input_of(PipeOp(B, 2, 0), stage=1, num_stages=4, virtual_stages=1) == (
        2,
        PipeOp(B, 2, 0),
    )


@pytest.mark.parametrize("p, v", [(1, 1), (1, 3), (2, 1), (4, 1), (4, 2), (3, 3)])
def test_output_of_is_the_dual_of_input_of(p: int, v: int) -> None:
    """Every op's output goes to the op that reads it, and to no other: output_of(op on s) =
    (s2, op2) exactly when input_of(op2 on s2) = (s, op)."""
    from collsim.parallel.pipeline import output_of

    ops = [PipeOp(ph, mb, c) for ph in (F, B) for mb in range(2) for c in range(v)]
    reads = {
        (s, op): input_of(op, stage=s, num_stages=p, virtual_stages=v)
        for s in range(p)
        for op in ops
    }
    feeds = {
        (s, op): output_of(op, stage=s, num_stages=p, virtual_stages=v)
        for s in range(p)
        for op in ops
    }
    assert {(s, op): dest for (s, op), dest in feeds.items() if dest is not None} == {
        src: (s, op) for (s, op), src in reads.items() if src is not None
    }
