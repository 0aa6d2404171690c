"""Calibration against published measurements (/work/shared/reference).

The topology files carry line rates and efficiencies with their sources (NCCL's per-link NVLink
figures, single-NIC RDMA efficiency), the collectives NCCL's latencies and protocol factors;
these tests check the predictions against the published figures. One constant is in-sample:
the NVLS loop handshake was fitted to the very DGX H100 sweep three tests here judge, so those
check the fit, not a prediction (they say so where they run).
"""

from __future__ import annotations

import csv
import statistics
from pathlib import Path

import pytest

from collsim.collectives import Group, cost
from tests.collectives.helpers import topo

DATA = Path(__file__).resolve().parents[1] / "data"
SWEEP = DATA / "nccl_allreduce_dgx_h100_8gpu.csv"  # copy of reference/, source in its header
LARGE = 16 << 30  # "large messages": the H200 figures are at 16 GiB


def sweep_errors() -> list[tuple[int, float, float, str]]:
    """(size, measured busbw GB/s, predicted busbw GB/s, algorithm) for 1 MiB..16 GiB."""
    group = Group.all(topo("dgx_h100"))
    rows = []
    with SWEEP.open() as fh:
        for row in csv.DictReader(line for line in fh if not line.startswith("#")):
            size = int(row["size_bytes"])
            if size < 1 << 20:
                continue
            predicted = cost("all_reduce", size, group)
            rows.append(
                (size, float(row["busbw_GBps"]), predicted.busbw_bps / 1e9, predicted.label)
            )
    return rows


def format_sweep(rows: list[tuple[int, float, float, str]]) -> str:
    lines = [f"{'size':>12} {'measured':>9} {'predicted':>9} {'error':>7}  algorithm"]
    for size, measured, predicted, label in rows:
        lines.append(
            f"{size:>12} {measured:>9.1f} {predicted:>9.1f} "
            f"{predicted / measured - 1:>+7.1%}  {label}"
        )
    return "\n".join(lines)


# In-sample: collsim.collectives.nvls.LOOP_STEP_S (11.8 us) was fitted to this very sweep
# (2 MiB to 16 GiB), so the three sweep tests below check the fit, not a prediction; the
# headline and OCI figures further down are out of sample.


def test_dgx_h100_allreduce_sweep_median_error() -> None:
    """In-sample (the NVLS loop handshake was fitted to this sweep)."""
    rows = sweep_errors()
    assert len(rows) == 15  # 1 MiB .. 16 GiB by powers of two
    errors = [abs(p / m - 1) for _, m, p, _ in rows]
    median = statistics.median(errors)
    assert median <= 0.10, f"median |busbw error| {median:.1%}\n{format_sweep(rows)}"


def test_dgx_h100_allreduce_sweep_from_1mib_within_15_percent_median_5() -> None:
    # Issue 12, must show 1: every size from 1 MiB within 15 % on busbw, median <= 5 %.
    rows = sweep_errors()
    errors = [abs(p / m - 1) for _, m, p, _ in rows]
    assert max(errors) <= 0.15, format_sweep(rows)
    assert statistics.median(errors) <= 0.05, format_sweep(rows)


def test_dgx_h100_allreduce_whole_sweep_on_time_median_8_percent() -> None:
    # Issue 12, must show 1: the whole sweep from 8 B judged on time, median <= 8 %.
    group = Group.all(topo("dgx_h100"))
    errors = []
    with SWEEP.open() as fh:
        for row in csv.DictReader(line for line in fh if not line.startswith("#")):
            predicted = cost("all_reduce", int(row["size_bytes"]), group).time_s * 1e6
            errors.append(abs(predicted / float(row["time_us"]) - 1))
    assert len(errors) == 32  # 8 B .. 16 GiB
    assert statistics.median(errors) <= 0.08, sorted(errors)


# Headline nccl-tests busbw figures (reference/README.md, GTC24 S62129 / GTC25 S72583).
HEADLINES = [
    # id, topology, nodes, op, algorithm, published GB/s
    ("a100-8gpu", "dgx_a100", 1, "all_reduce", "auto", 232),
    ("h100-8gpu-ring", "dgx_h100", 1, "all_reduce", "ring", 370),
    ("h100-8gpu-nvls", "dgx_h100", 1, "all_reduce", "nvls", 480),
    ("b200-8gpu-ring", "dgx_b200", 1, "all_reduce", "ring", 700),
    ("h200-8gpu-all_gather", "dgx_h200", 1, "all_gather", "auto", 361),
    ("h200-8gpu-reduce_scatter", "dgx_h200", 1, "reduce_scatter", "auto", 363),
    ("a100-4nodes", "dgx_a100", 4, "all_reduce", "auto", 192),
    ("h100-4nodes", "dgx_h100", 4, "all_reduce", "auto", 370),
    # "with SHARP 480": in-network reduction across nodes (fabric.sharp), NVLS + CollNet
    ("h100-4nodes-sharp", "dgx_h100+sharp", 4, "all_reduce", "auto", 480),
    # also in the README's list: PCIe Gen4 8 GPUs, and NVLink5 SHARP (NVLS on B200; the model
    # applies NCCL's Hopper NVLS efficiency 0.85, the only one in the reference set)
    ("pcie-gen4-8gpu", "pcie_8gpu", 1, "all_reduce", "auto", 24),
    ("b200-8gpu-nvls", "dgx_b200", 1, "all_reduce", "nvls", 850),
]


def headline_predictions() -> list[tuple[str, float, float, str]]:
    """(id, published, predicted busbw GB/s, algorithm) for every headline figure."""
    out = []
    for ident, name, nodes, op, algorithm, published in HEADLINES:
        result = cost(op, LARGE, Group.all(topo(name, nodes)), algorithm)
        out.append((ident, float(published), result.busbw_bps / 1e9, result.label))
    return out


@pytest.mark.parametrize("index", range(len(HEADLINES)), ids=[h[0] for h in HEADLINES])
def test_headline_busbw_within_ten_percent(index: int) -> None:
    ident, published, predicted, label = headline_predictions()[index]
    assert predicted == pytest.approx(published, rel=0.10), (ident, predicted, label)


def test_auto_uses_nvls_for_large_all_reduce_on_h100_and_ring_on_a100() -> None:
    assert cost("all_reduce", LARGE, Group.all(topo("dgx_h100"))).label == "nvls/simple"
    assert cost("all_reduce", LARGE, Group.all(topo("dgx_a100"))).label == "ring/simple"


@pytest.mark.parametrize(
    ("nodes", "published"), [(1, 232.20), (2, 191.76)], ids=["1node", "2nodes"]
)
def test_oci_a100_roce_10gib_within_ten_percent(nodes: int, published: float) -> None:
    # OCI BM.GPU4.8, 10 GiB all_reduce, NCCL 2.26.5 (reference/README.md): the roce fabric
    # kind's defaults, nothing fitted (predicted 239.8 and 191.6 GB/s).
    result = cost("all_reduce", 10 << 30, Group.all(topo("oci_bm_gpu4_8", nodes)))
    assert result.busbw_bps / 1e9 == pytest.approx(published, rel=0.10), result.label
