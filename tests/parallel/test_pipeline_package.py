"""Pipeline schedules as data (collsim.parallel.pipeline): every op once, orders that cannot
deadlock under their own dependencies, DualPipeV's order equal to torch.distributed.pipelining's
``ScheduleDualPipeV``, ZB-H1 holding no more micro-batches than 1F1B's first stage."""

from __future__ import annotations

import pytest

from collsim.core.errors import ConfigError
from collsim.core.vocab import ScheduleKind
from collsim.parallel.pipeline import SCHEDULES, Phase, PipeOp, flow, get_schedule

F, B, I, W = Phase.FORWARD, Phase.BACKWARD, Phase.BACKWARD_INPUT, Phase.BACKWARD_WEIGHT
SHAPES = [(1, 2), (2, 4), (2, 5), (3, 6), (4, 8), (4, 9), (4, 16), (8, 16), (8, 24)]


def _orders(kind: str, p: int, m: int, v: int = 1) -> dict[int, list[PipeOp]]:
    sched = get_schedule(kind)
    v = sched.chunks(v)
    return {
        s: sched.order(num_stages=p, num_microbatches=m, stage=s, virtual_stages=v)
        for s in range(p)
    }


def _walk(kind: str, p: int, m: int, times: dict[Phase, float], v: int = 1) -> float:
    """The step of a pipeline with the given op times and free sends: each op after the op
    before it on its stage and after its input (its schedule's dependencies; a W after its I)."""
    sched = get_schedule(kind)
    v = sched.chunks(v)
    orders = _orders(kind, p, m, v)
    done: dict[tuple[int, Phase, int, int], float] = {}
    clock, at = [0.0] * p, [0] * p
    moved = True
    while moved:
        moved = False
        for s in range(p):
            while at[s] < len(orders[s]):
                op = orders[s][at[s]]
                src = sched.input_of(op, stage=s, num_stages=p, virtual_stages=v)
                if op.phase is W:
                    dep = (s, B, op.microbatch, op.chunk)
                elif src is not None:
                    dep = (src[0], flow(src[1].phase), src[1].microbatch, src[1].chunk)
                elif op.phase is not F:  # the last part's backward follows its forward
                    dep = (s, F, op.microbatch, op.chunk)
                else:
                    dep = None
                if dep is not None and dep not in done:
                    break
                clock[s] = max(clock[s], done[dep] if dep else 0.0) + times[op.phase]
                done[(s, flow(op.phase), op.microbatch, op.chunk)] = clock[s]
                at[s] += 1
                moved = True
    assert at == [len(orders[s]) for s in range(p)], f"{kind} p={p} m={m} deadlocks"
    return max(clock)


@pytest.mark.parametrize("kind", [k.value for k in SCHEDULES])
@pytest.mark.parametrize(("p", "m"), SHAPES, ids=str)
def test_every_op_once_and_no_deadlock(kind: str, p: int, m: int) -> None:
    v = 2 if kind == "interleaved" else 1
    if kind == "interleaved" and m % p:
        m *= p
    sched = get_schedule(kind)
    chunks = sched.chunks(v)
    for ops in _orders(kind, p, m, v).values():
        assert len(set(ops)) == len(ops)
        assert {(o.microbatch, o.chunk) for o in ops if o.phase is F} == {
            (i, c) for i in range(m) for c in range(chunks)
        }
        grads = [(o.microbatch, o.chunk) for o in ops if o.phase in (B, I)]
        assert sorted(grads) == sorted((i, c) for i in range(m) for c in range(chunks))
        for o in ops:  # every W after its own I, and only with an I
            if o.phase is W:
                assert ops.index(PipeOp(I, o.microbatch, o.chunk)) < ops.index(o)
        assert sum(o.phase is W for o in ops) == sum(o.phase is I for o in ops)
    unit = {F: 1.0, B: 2.0, I: 1.0, W: 1.0}
    _walk(kind, p, m, unit, v)


def test_placement_is_a_bijection_and_the_v_returns() -> None:
    for kind, sched in SCHEDULES.items():
        for p in (1, 2, 4):
            v = sched.chunks(3)
            parts = {sched.part_of(s, c, p, v) for s in range(p) for c in range(v)}
            assert parts == set(range(p * v)), kind
            for k in range(p * v):
                assert sched.part_of(*sched.where(k, p, v), p, v) == k
    dv = get_schedule("dualpipev")
    # stage s holds parts s and 2p - 1 - s: the first stage the embedding and the head
    assert [dv.part_of(s, c, 4, 2) for s in range(4) for c in (0, 1)] == [0, 7, 1, 6, 2, 5, 3, 4]
    # the turn of the V is on the last stage: its forward of part p - 1 feeds its own part p
    assert dv.output_of(PipeOp(F, 3, 0), stage=3, num_stages=4, virtual_stages=2) == (
        3,
        PipeOp(F, 3, 1),
    )
    assert dv.input_of(PipeOp(I, 5, 1), stage=0, num_stages=4, virtual_stages=2) is None
    assert dv.input_of(PipeOp(B, 5, 0), stage=0, num_stages=4, virtual_stages=2) == (
        1,
        PipeOp(B, 5, 0),
    )


@pytest.mark.torch
def test_dualpipev_order_is_torch_schedule_dualpipev() -> None:
    # the real torch.distributed.pipelining (the validate extra), its op order unchanged
    schedules = pytest.importorskip("torch.distributed.pipelining.schedules")
    ref = object.__new__(schedules.ScheduleDualPipeV)  # only its op-order method is used
    sched = get_schedule("dualpipev")
    for p, m in [(1, 2), (2, 4), (2, 7), (4, 8), (4, 13), (8, 16), (8, 20)]:
        ref.pp_group_size, ref._n_microbatches = p, m
        for r in range(p):
            theirs = []
            for action in ref._calculate_single_rank_operations(r):
                for a in action.sub_actions or (action,):
                    theirs.append((a.computation_type.value, a.microbatch_index, a.stage_index))
            ours = [
                (o.phase.value, o.microbatch, sched.part_of(r, o.chunk, p, 2))
                for o in sched.order(num_stages=p, num_microbatches=m, stage=r, virtual_stages=2)
            ]
            assert ours == theirs, (p, m, r)


def test_dualpipev_needs_two_micro_batches_per_stage() -> None:
    with pytest.raises(ConfigError, match="2 x pp = 8"):
        get_schedule("dualpipev").check(num_stages=4, num_microbatches=7, virtual_stages=2)
    get_schedule("dualpipev").check(num_stages=4, num_microbatches=8, virtual_stages=2)


@pytest.mark.parametrize(("p", "m"), [(4, 8), (4, 4), (8, 16), (3, 7), (2, 9)], ids=str)
def test_zb_h1_holds_at_most_p_micro_batches_on_every_stage(p: int, m: int) -> None:
    # the paper's section 2.1: every stage has as many in flight (forward run, W not) as the
    # first stage of 1F1B, p (at most m)
    for s, ops in _orders("zb_h1", p, m).items():
        held = peak = 0
        for o in ops:
            held += 1 if o.phase is F else -1 if o.phase is W else 0
            peak = max(peak, held)
        assert peak == min(p, m), s


@pytest.mark.parametrize(("p", "m"), [(4, 8), (4, 4), (8, 16), (3, 7)], ids=str)
@pytest.mark.parametrize(("t_f", "t_i", "t_w"), [(2.0, 3.0, 2.0), (1.0, 1.0, 1.0), (3.0, 2.0, 1.0)])
def test_zb_h1_bubble_is_the_papers(p: int, m: int, t_f: float, t_i: float, t_w: float) -> None:
    # Qi et al. 2024, section 2.1 / Table: 1F1B's bubble is (p - 1)(T_F + T_B + T_W), ZB-H1's
    # (p - 1)(T_F + T_B - T_W) (T_B their input-gradient time; here T_W <= T_F)
    full = {F: t_f, B: t_i + t_w, I: t_i, W: t_w}
    ideal = m * (t_f + t_i + t_w)
    assert _walk("1f1b", p, m, full) == ideal + (p - 1) * (t_f + t_i + t_w)
    assert _walk("zb_h1", p, m, full) == ideal + (p - 1) * (t_f + t_i - t_w)


def test_every_schedule_kind_has_a_module() -> None:
    assert set(SCHEDULES) == set(ScheduleKind)
