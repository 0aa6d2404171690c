"""The collective bench: sizes, factors, checking, tables, files, and a real 2-rank run."""

from __future__ import annotations

import time
from pathlib import Path

import pytest

from collsim.core.errors import ConfigError
from collsim.validate.data.dataset import format_table, read_measurements, write_measurements
from collsim.validate.measure.bench import (
    OPS,
    BenchConfig,
    bus_factor,
    element_count,
    sizes_between,
)


def test_sizes_between_like_nccl_tests() -> None:
    assert sizes_between("1K", "8K", 2) == [1024, 2048, 4096, 8192]
    assert sizes_between(8, 100, 4) == [8, 32]


@pytest.mark.parametrize(
    "lo, hi, factor, pattern",
    [
        ("8K", "1K", 2, "min <= max"),  # reversed range
        ("1K", "8K", 1, "factor"),  # factor 1 never ends
        ("1Q", "8K", 2, "not a size"),  # not a size
    ],
    ids=["reversed", "factor1", "garbage"],
)
def test_sizes_between_rejects(lo: str, hi: str, factor: int, pattern: str) -> None:
    with pytest.raises(ValueError, match=pattern):
        sizes_between(lo, hi, factor)


@pytest.mark.parametrize("n", [2, 3, 4, 8])
@pytest.mark.parametrize("op", OPS)
def test_bus_factor_matches_the_simulator(op: str, n: int) -> None:
    from collsim.collectives import CollectiveOp, busbw_factor

    assert bus_factor(op, n) == pytest.approx(busbw_factor(CollectiveOp(op), n))


def test_element_count_rounds_split_ops_to_world_size() -> None:
    assert element_count("all_gather", 1000, 3) == 249  # 250 floats -> 249 = 3 x 83
    assert element_count("all_reduce", 1000, 3) == 250


def test_config_rejects_unknown_op_and_bad_rounds() -> None:
    with pytest.raises(ValueError, match="unknown op"):
        BenchConfig(ops=("all_reduce", "allreduce"))
    with pytest.raises(ValueError, match="rounds"):
        BenchConfig(iters=2, rounds=3)


def _rows() -> list[dict]:
    return [
        dict(
            op="all_reduce",
            size_bytes=1024,
            count=256,
            type="float",
            redop="sum",
            root=-1,
            time_us=100.0,
            min_us=90.0,
            p90_us=120.0,
            algbw_gbps=0.01024,
            busbw_gbps=0.01024,
            wrong=0,
            world_size=2,
            iters=5,
        ),
        dict(
            op="broadcast",
            size_bytes=2048,
            count=512,
            type="float",
            redop="none",
            root=0,
            time_us=50.0,
            min_us=40.0,
            p90_us=60.0,
            algbw_gbps=0.04096,
            busbw_gbps=0.04096,
            wrong=3,
            world_size=2,
            iters=5,
        ),
    ]


@pytest.mark.parametrize("suffix", [".csv", ".json"])
def test_measurements_round_trip(tmp_path: Path, suffix: str) -> None:
    meta = {"backend": "gloo", "world_size": 2, "kernels": {"all_reduce": ["gloo:all_reduce"]}}
    path = write_measurements(tmp_path / f"m{suffix}", _rows(), meta)
    back = read_measurements(path)
    assert back.rows == _rows()
    assert back.metadata == meta and back.world_size == 2
    assert back.ops() == ["all_reduce", "broadcast"]


def test_read_measurements_names_the_bad_line(tmp_path: Path) -> None:
    path = tmp_path / "bad.csv"
    write_measurements(path, _rows(), {"backend": "gloo"})
    text = path.read_text().replace(",100,", ",fast,")
    path.write_text(text)
    with pytest.raises(ConfigError, match=r"bad.csv:5: time_us: not a number"):
        read_measurements(path)
    with pytest.raises(ConfigError, match="no such"):
        read_measurements(tmp_path / "missing.csv")


def test_table_is_nccl_tests_style() -> None:
    text = format_table(_rows(), {"backend": "gloo", "world_size": 2, "ranks_per_node": 2})
    assert "size(B) count(elements)   type  redop  root" in text
    assert "#wrong" in text and "# Avg bus bandwidth" in text
    assert "# Out of bounds values : 1 FAILED" in text  # the broadcast row had 3 wrong
    assert "load average" not in text
    text = format_table(
        _rows(),
        {
            "backend": "gloo",
            "world_size": 2,
            "ranks_per_node": 2,
            "load_average_start": [0.5, 0.7, 1.2],
            "load_average_end": [0.9, 0.8, 1.2],
            "duration_s": 61.0,
        },
    )
    assert (
        "# load average (1, 5, 15 min): [0.5, 0.7, 1.2] at the start, [0.9, 0.8, 1.2] at "
        "the end, 61.0 s" in text
    )


@pytest.mark.torch
def test_wrong_results_are_counted() -> None:
    """The check can fail: a zeroed output is wrong everywhere."""
    import torch

    from collsim.validate.measure.bench_ops import _OpCase

    case = _OpCase(torch, None, "all_reduce", 64, rank=0, n=2, device="cpu", root=0)
    case.fill_check()
    assert case.count_wrong() == 64  # the input alone is not the sum over 2 ranks
    case.out.copy_(case.inp * 0 + torch.arange(64) % 5 * 2 + 3)  # sum of rank+1+(i%5), 2 ranks
    assert case.count_wrong() == 0


def _reference_expected(torch, op: str, count: int, rank: int, n: int, root: int):
    """Every op's expected output made whole, as one formula per op (the check before blocks)."""
    from collsim.validate.measure.bench_ops import _values

    chunk = count // n if op in ("all_gather", "reduce_scatter", "all_to_all") else count
    match op:
        case "all_reduce":
            return sum(_values(torch, q, 0, count, "cpu") for q in range(n))
        case "broadcast":
            return _values(torch, root, 0, count, "cpu")
        case "all_gather":
            return torch.cat([_values(torch, q, q * chunk, chunk, "cpu") for q in range(n)])
        case "reduce_scatter":
            return sum(_values(torch, q, rank * chunk, chunk, "cpu") for q in range(n))
        case "all_to_all":
            return torch.cat([_values(torch, q, rank * chunk, chunk, "cpu") for q in range(n)])
    return _values(torch, (rank - 1) % n, 0, count, "cpu")


@pytest.mark.torch
@pytest.mark.parametrize(
    "op", ["all_reduce", "broadcast", "all_gather", "reduce_scatter", "all_to_all", "send_recv"]
)
def test_blocked_check_matches_the_whole_formula(monkeypatch, op: str) -> None:
    """The check made block by block (7 elements a block here, so blocks cut across the
    ranks' chunks) finds the whole expected output right and one changed element wrong; the
    buffers of a smaller size are views of the largest size's two buffers."""
    import torch

    from collsim.validate.measure import bench_ops
    from collsim.validate.measure.bench_ops import _Buffers, _OpCase

    monkeypatch.setattr(bench_ops, "_CHECK_BLOCK", 7)
    n, rank, count = 3, 1, 60
    buffers = _Buffers(torch, 120, "cpu")
    dist = torch.distributed  # only looked up: no call is made
    case = _OpCase(torch, dist, op, count, rank=rank, n=n, device="cpu", root=2, buffers=buffers)
    assert case.inp.data_ptr() == buffers.send.data_ptr()
    case.fill_check()
    own = _reference_expected(torch, "broadcast", count, rank, n, rank)
    first = rank * (count // n) if op == "all_gather" else 0
    assert torch.equal(case.inp, own[first : first + case.inp.numel()])
    case.out.copy_(_reference_expected(torch, op, count, rank, n, 2))
    assert case.count_wrong() == 0
    case.out[case.out.numel() - 1] += 1
    assert case.count_wrong() == 1


@pytest.mark.torch
@pytest.mark.parametrize("op", ["all_gather", "reduce_scatter"])
def test_in_place_layout_and_check(monkeypatch, op: str) -> None:
    """In place (gloo's all_gather and reduce_scatter): one buffer, the rank's chunk of it is
    all_gather's input and reduce_scatter's output, as in nccl-tests' in-place columns; the
    check still finds the expected output right and a changed element wrong."""
    import torch

    from collsim.validate.measure import bench_ops
    from collsim.validate.measure.bench_ops import _Buffers, _OpCase

    monkeypatch.setattr(bench_ops, "_CHECK_BLOCK", 7)
    n, rank, count = 3, 2, 60
    chunk = count // n
    buffers = _Buffers.for_op(torch, op, 120, n, "cpu", in_place=True)
    one = buffers.recv if op == "all_gather" else buffers.send
    assert one.numel() == 120 and (buffers.send.numel() + buffers.recv.numel()) == 120
    dist = torch.distributed  # only looked up: no call is made
    case = _OpCase(torch, dist, op, count, rank, n, "cpu", 0, buffers, in_place=True)
    whole, part = (case.out, case.inp) if op == "all_gather" else (case.inp, case.out)
    assert whole.data_ptr() == one.data_ptr() and whole.numel() == count
    assert part.data_ptr() == one.data_ptr() + rank * chunk * 4 and part.numel() == chunk
    case.fill_check()
    if op == "all_gather":  # the input is the rank's own chunk of its data
        own = _reference_expected(torch, "broadcast", count, rank, n, rank)
        assert torch.equal(case.inp, own[rank * chunk : (rank + 1) * chunk])
    case.out.copy_(_reference_expected(torch, op, count, rank, n, 0))
    assert case.count_wrong() == 0
    case.out[0] -= 1
    assert case.count_wrong() == 1


def test_in_place_ops_only_on_gloo() -> None:
    from collsim.validate.measure.bench_ops import in_place_ops

    assert in_place_ops("gloo") == ("all_gather", "reduce_scatter")
    assert in_place_ops("gloo", ("all_reduce", "reduce_scatter")) == ("reduce_scatter",)
    assert in_place_ops("nccl") == ()


def _plain_then_bench(ctx, size_bytes: int, iters: int, config: BenchConfig) -> dict:
    """A plain torch.distributed all_reduce loop (no checks, no profiler, no bookkeeping) run
    half before and half after the bench, in the same processes. The loop's figure is the median
    of all its iterations (slowest rank), as the bench's is a median. Bracketing the bench puts
    both under the same drift of the shared cores: one loop run only before the bench once
    measured 3.4 x the bench's time in CI, with the start-up of the processes still in it; one
    stall in a mean of a few iterations once made it look 12 x slower."""
    import torch
    import torch.distributed as dist

    from collsim.validate.measure.bench import bench_rank

    x = torch.zeros(size_bytes // 4)
    for _ in range(2):
        dist.all_reduce(x)

    def plain_loop(count: int) -> torch.Tensor:
        # the same timing rule as the bench (a barrier, then one timed call; slowest rank), so
        # that the two differ only by the bench's own machinery: back-to-back calls without a
        # barrier let the two ranks drift apart on two shared cores (4.4 x in a CI run)
        times = torch.zeros(count, dtype=torch.float64)
        for i in range(count):
            dist.barrier()
            start = time.perf_counter()
            dist.all_reduce(x)
            times[i] = time.perf_counter() - start
        dist.all_reduce(times, op=dist.ReduceOp.MAX)
        return times

    before = plain_loop(iters - iters // 2)
    bench = bench_rank(ctx, config)
    after = plain_loop(iters // 2)
    times = torch.cat([before, after])
    return {"plain_s": float(times.median().item()), "bench": bench}


@pytest.fixture(scope="module")
def two_rank_bench() -> dict:
    from collsim.validate.measure.launch import realtime_problem, spawn_ranks

    # Under SCHED_RR where the host allows it: the scheduling noise that makes single timings
    # on two shared cores swing by 2-5x is then gone (validate/README.md).
    config = BenchConfig(ops=OPS, sizes_bytes=(4096, 1 << 20), iters=6, warmup=2)
    return spawn_ranks(
        _plain_then_bench,
        2,
        args=(1 << 20, 21, config),
        timeout_s=180,
        realtime=realtime_problem() is None,
    )[0]


@pytest.mark.torch
def test_bench_two_ranks_all_ops_correct(two_rank_bench: dict) -> None:
    out = two_rank_bench["bench"]
    points = out["points"]
    assert [(p.op, p.size_bytes) for p in points] == [
        (op, size) for op in OPS for size in (4096, 1 << 20)
    ]
    assert all(p.wrong == 0 and p.time_us > 0 and p.iters == 6 for p in points)
    # What gloo really runs, seen by the profiler (torch 2.13): reduce_scatter is an all_reduce.
    assert out["kernels"]["reduce_scatter"] == ["gloo:all_reduce"]
    assert out["kernels"]["all_to_all"] == ["gloo:all_to_all"]
    assert out["overhead"]["noop_us"] < out["overhead"]["all_reduce_4B_us"]
    assert out["torch_version"].startswith("2.")


@pytest.mark.torch
def test_bench_busbw_close_to_a_plain_loop(two_rank_bench: dict) -> None:
    """The bench's own overhead: its all_reduce time vs a plain loop at 1 MiB, 2 ranks."""
    point = next(
        p
        for p in two_rank_bench["bench"]["points"]
        if p.op == "all_reduce" and p.size_bytes == 1 << 20
    )
    ratio = two_rank_bench["plain_s"] / (point.time_us * 1e-6)
    # Same op, same size: the bench may not report a very different bandwidth. Loose bounds:
    # two cores shared with other work make single timings swing by 2x.
    assert 0.33 < ratio < 3.0, ratio


def test_steal_share() -> None:
    from collsim.validate.measure.bench import _cpu_jiffies, steal_share

    assert steal_share((10, 1000), (40, 2000)) == 0.03
    assert steal_share(None, (40, 2000)) is None
    assert steal_share((10, 1000), (10, 1000)) is None
    now = _cpu_jiffies()
    if now is not None:  # Linux: steal <= total
        assert 0 <= now[0] <= now[1]
