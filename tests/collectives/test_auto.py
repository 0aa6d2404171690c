"""auto selection, the closed form's properties, and errors for impossible requests."""

from __future__ import annotations

from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from collsim.cluster.topology import parse_topology
from collsim.collectives import (
    Algorithm,
    CollectiveOp,
    Group,
    cost,
    phases_for,
    supported,
    tuner,
)
from collsim.core.errors import ConfigError
from collsim.core.yamlio import parse_yaml_text
from tests.collectives.helpers import topo

SIZES = st.integers(min_value=1, max_value=1 << 34)


@settings(max_examples=60, deadline=None)
@given(
    size=SIZES,
    op=st.sampled_from(["all_reduce", "all_gather", "reduce_scatter", "broadcast"]),
    nodes=st.sampled_from([1, 2, 4]),
)
def test_auto_follows_nccls_tuner(size: int, op: str, nodes: int) -> None:
    # NCCL picks by its own cost model (tuning.cc), not by collsim's: auto reports that pick,
    # and the time is collsim's for it. (Until issue 12 auto took collsim's cheapest option.)
    group = Group.all(topo("dgx_h100", nodes))
    picked = tuner.pick(CollectiveOp(op), size, group)
    assert picked is not None
    result = cost(op, size, group)
    assert (result.algorithm, result.protocol) == picked
    forced = cost(op, size, group, picked[0], picked[1])
    assert result.time_s == pytest.approx(forced.time_s, rel=1e-12)


@settings(max_examples=40, deadline=None)
@given(size=SIZES, op=st.sampled_from(["all_reduce", "all_gather", "reduce_scatter"]))
def test_auto_is_the_cheapest_option_under_gloo(size: int, op: str) -> None:
    group = Group.all(topo("localhost", 1, 4))
    best = cost(op, size, group)
    for algorithm in supported(CollectiveOp(op)):
        try:
            other = cost(op, size, group, algorithm)
        except ConfigError:
            continue  # not on this group (nvls, pat, collnet)
        assert best.time_s <= other.time_s * (1 + 1e-12)


@settings(max_examples=40, deadline=None)
@given(a=SIZES, b=SIZES, op=st.sampled_from([o.value for o in CollectiveOp]))
def test_time_never_decreases_with_size(a: int, b: int, op: str) -> None:
    # For every (algorithm, protocol) on its own. auto follows NCCL's tuner, whose choice is
    # made on NCCL's model, so auto's time may dip where the tuner switches (as NCCL's does);
    # under gloo auto is the cheapest option and never decreases either.
    group = Group.all(topo("dgx_a100", 2))
    small, large = sorted((a, b))
    for algorithm in supported(CollectiveOp(op)):
        try:
            protocols = [t.protocol for t in phases_for(CollectiveOp(op), group, algorithm).timings]
        except ConfigError:
            continue
        for protocol in protocols:
            low = cost(op, small, group, algorithm, protocol).time_s
            # equal times computed along different float paths may differ in the last bit
            assert low <= cost(op, large, group, algorithm, protocol).time_s * (1 + 1e-12)
    gloo = Group.all(topo("localhost", 1, 4))
    assert cost(op, small, gloo).time_s <= cost(op, large, gloo).time_s


@settings(max_examples=40, deadline=None)
@given(size=SIZES)
def test_ring_all_reduce_moves_reduce_scatter_plus_all_gather(size: int) -> None:
    # Same bytes, so the bandwidth terms add up; latencies differ only by NCCL's base.
    group = Group.all(topo("dgx_h100", 2))
    ar = cost("all_reduce", size, group, "ring", "simple")
    rs = cost("reduce_scatter", size, group, "ring", "simple")
    ag = cost("all_gather", size, group, "ring", "simple")
    base = 8.4e-6  # NCCL Ring Simple base latency, paid once per call
    assert ar.time_s == pytest.approx(rs.time_s + ag.time_s - base, rel=1e-9)


def test_auto_reports_its_choice_by_size() -> None:
    group = Group.all(topo("dgx_h100"))
    assert cost("all_reduce", 1 << 10, group).label == "ring/ll"
    assert cost("all_reduce", 1 << 30, group).label == "nvls/simple"
    assert cost("all_to_all", 1 << 20, group).algorithm is Algorithm.DIRECT


def test_busbw_factors_follow_nccl_tests() -> None:
    group = Group.all(topo("dgx_h100"))
    ar = cost("all_reduce", 1 << 30, group, "ring")
    assert ar.busbw_bps == pytest.approx(ar.algbw_bps * 2 * 7 / 8)
    assert ar.algbw_bps == pytest.approx((1 << 30) / ar.time_s)
    ag = cost("all_gather", 1 << 30, group)
    assert ag.busbw_bps == pytest.approx(ag.algbw_bps * 7 / 8)
    bc = cost("broadcast", 1 << 30, group)
    assert bc.busbw_bps == pytest.approx(bc.algbw_bps)


def test_ring_large_message_busbw_is_the_link_capacity() -> None:
    # 8 GPUs on NVSwitch: busbw -> 450 GB/s x 0.824 as the size grows.
    group = Group.all(topo("dgx_h100"))
    assert cost("all_reduce", 1 << 40, group, "ring").busbw_bps == pytest.approx(
        450e9 * 0.824, rel=1e-3
    )


def test_topology_can_pin_the_algorithm() -> None:
    text = (
        Path(topo("dgx_h100").source)
        .read_text()
        .replace("  library: nccl", "  library: nccl\n  algorithms: {all_reduce: tree}")
    )
    pinned = parse_topology(parse_yaml_text(text, "pinned.yaml"))
    assert cost("all_reduce", 1 << 30, Group.all(pinned)).algorithm is Algorithm.TREE


def test_overhead_is_added_once() -> None:
    text = Path(topo("dgx_h100").source).read_text().replace("overhead_us: 0.0", "overhead_us: 7.0")
    slow = parse_topology(parse_yaml_text(text, "slow.yaml"))
    base = cost("all_reduce", 1 << 20, Group.all(topo("dgx_h100")), "ring", "ll")
    more = cost("all_reduce", 1 << 20, Group.all(slow), "ring", "ll")
    assert more.time_s - base.time_s == pytest.approx(7e-6)


def test_single_rank_costs_only_overhead() -> None:
    result = cost("all_reduce", 1 << 20, Group(topo("dgx_h100"), (3,)))
    assert result.time_s == 0.0 and result.busbw_bps == 0.0


@pytest.mark.parametrize(
    ("op", "algorithm", "ranks", "message"),
    [
        ("all_to_all", "ring", range(8), "ring does not implement all_to_all"),
        ("reduce_scatter", "tree", range(8), "tree implements all_reduce only"),
        ("all_reduce", "halving_doubling", range(6), "needs a power-of-two group, got 6"),
        ("all_reduce", "nvls", range(16), "nvls runs inside one node.*fabric.sharp"),
        ("broadcast", "nvls", range(8), "nvls does not implement broadcast"),
        ("all_reduce", "hierarchical", (0, 1, 8), "same number of ranks on every node"),
        ("all_reduce", "magic", range(8), "unknown algorithm 'magic'; choose from auto, ring"),
        ("allreduce", "auto", range(8), "unknown op 'allreduce'"),
    ],
    ids=[
        "ring-a2a",
        "tree-rs",
        "hd-6",
        "nvls-2nodes",
        "nvls-bcast",
        "hier-uneven",
        "bad-algorithm",
        "bad-op",
    ],
)
def test_impossible_requests_are_config_errors(op: str, algorithm: str, ranks, message: str):
    group = Group(topo("dgx_h100", 2), tuple(ranks))
    with pytest.raises(ConfigError, match=message):
        cost(op, 1 << 20, group, algorithm)


def test_nvls_needs_a_switch_that_reduces() -> None:
    with pytest.raises(ConfigError, match="no in-switch reduction"):
        cost("all_reduce", 1 << 20, Group.all(topo("dgx_a100")), "nvls")


def test_groups_hash_by_topology_and_ranks() -> None:
    t = topo("dgx_h100")
    assert Group(t, (0, 1)) == Group(t, [0, 1]) and len({Group(t, (0, 1)), Group(t, (0, 1))}) == 1
    with pytest.raises(ConfigError, match="repeat"):
        Group(t, (0, 0))
    with pytest.raises(ConfigError, match="rank 9 not in topology"):
        Group(t, (0, 9))


def test_every_op_has_an_algorithm() -> None:
    assert all(supported(op) for op in CollectiveOp)


@pytest.mark.parametrize("num_ranks", [2, 4, 8])
def test_nvls_loop_sizes_follow_nccls_chunk_rule(num_ranks: int) -> None:
    from collsim.collectives.nvls import chunk_bytes, loop_bytes_for

    group = Group(topo("dgx_h100"), tuple(range(num_ranks)))
    fast = loop_bytes_for(CollectiveOp.ALL_REDUCE, group)
    ops = 16 * num_ranks
    # chunk 16 KiB below 2 x ops x 32 KiB, 32 KiB below 8 x ops x 64 KiB, 64 KiB below
    # 64 x ops x 128 KiB, else 128 KiB (NCCL enqueue.cc)
    for size, chunk in [
        (1, 16384),
        (2 * ops * 32768 - 1, 16384),
        (2 * ops * 32768, 32768),
        (8 * ops * 65536, 65536),
        (64 * ops * 131072 - 1, 65536),
        (64 * ops * 131072, 131072),
        (1 << 40, 131072),
    ]:
        assert chunk_bytes(size, num_ranks) == chunk
        assert fast(size) == ops * chunk


def test_fast_cost_records_equal_constructed_ones() -> None:
    import dataclasses

    from collsim.collectives import CollectiveCost

    got = cost("all_reduce", 1 << 20, Group.all(topo("dgx_h100")))
    same = CollectiveCost(**{f.name: getattr(got, f.name) for f in dataclasses.fields(got)})
    assert got == same and hash(got) == hash(same)
    with pytest.raises(dataclasses.FrozenInstanceError):
        got.time_s = 0.0  # type: ignore[misc]
