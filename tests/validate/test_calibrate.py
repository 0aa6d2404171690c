"""Calibration and comparison, on synthetic measurements made by the simulator itself."""

from __future__ import annotations

import random
from pathlib import Path

import pytest
import yaml
from click.testing import CliRunner

from collsim.core.errors import ConfigError
from collsim.validate.check.compare import compare, summarize, topology_for
from collsim.validate.data.dataset import Measurements, read_measurements, write_measurements
from collsim.validate.fit.calibrate import calibrate, select_rows, write_topology
from collsim.validate.fit.numerics import (
    KNEE_ALPHA,
    f_critical,
    fit_hinge,
    fit_line,
    fit_two_regime,
)

# The "true" machine of the synthetic data: 2 ranks over loopback, gloo.
TRUE_LATENCY_US = 40.0
TRUE_BANDWIDTH_GBPS = 2.0
TRUE_OPS = {  # op: (overhead_us, efficiency)
    "all_reduce": (150.0, 0.40),
    "all_gather": (90.0, 0.70),
    "reduce_scatter": (160.0, 0.25),
    "broadcast": (60.0, 0.90),
    "send_recv": (50.0, 1.00),
}


def _true_topology(tmp_path: Path, n: int) -> Path:
    doc = {
        "name": "truth",
        "device": "cpu",
        "gpus_per_node": n,
        "intra_node": {
            "interconnect": "loopback",
            "bandwidth_gbps": TRUE_BANDWIDTH_GBPS,
            "latency_us": TRUE_LATENCY_US,
        },
        "collectives": {
            "library": "gloo",
            "algorithms": {op: "direct" if op == "send_recv" else "ring" for op in TRUE_OPS},
            "ops": {op: {"overhead_us": o, "efficiency": e} for op, (o, e) in TRUE_OPS.items()},
        },
    }
    path = tmp_path / "truth.yaml"
    path.write_text(yaml.safe_dump(doc))
    return path


def _synthetic(tmp_path: Path, n: int = 2, noise: float = 0.0, seed: int = 1) -> Measurements:
    from collsim.cluster.topology import load_topology
    from collsim.collectives import Group, cost

    topo = load_topology(_true_topology(tmp_path, n))
    rng = random.Random(seed)
    rows = []
    for op in TRUE_OPS:
        for exp in range(10, 25):  # 1 KiB .. 16 MiB
            size = 2**exp
            t = cost(op, size, Group.all(topo)).time_s * (1 + rng.uniform(-noise, noise))
            rows.append(
                dict(
                    op=op,
                    size_bytes=size,
                    count=size // 4,
                    type="float",
                    redop="sum",
                    root=-1,
                    time_us=t * 1e6,
                    min_us=t * 1e6,
                    p90_us=t * 1e6,
                    algbw_gbps=size / t / 1e9,
                    busbw_gbps=size / t / 1e9,
                    wrong=0,
                    world_size=n,
                    iters=5,
                )
            )
    meta = {
        "backend": "gloo",
        "world_size": n,
        "ranks_per_node": n,
        "kernels": {"reduce_scatter": ["gloo:all_reduce"]},
    }
    path = write_measurements(tmp_path / f"synthetic_n{n}.csv", rows, meta)
    return read_measurements(path)


def test_fit_line_exact_and_robust() -> None:
    sizes = [2.0**k for k in range(10, 20)]
    times = [50e-6 + s * 1e-9 for s in sizes]
    a, b, err = fit_line(sizes, times)
    assert a == pytest.approx(50e-6, rel=1e-6) and b == pytest.approx(1e-9, rel=1e-6)
    assert err < 1e-9
    times[3] *= 5.0  # one wild point (a burst of load)
    a, b, _ = fit_line(sizes, times)
    assert a == pytest.approx(50e-6, rel=0.02) and b == pytest.approx(1e-9, rel=0.02)
    with pytest.raises(ConfigError, match="at least 2"):
        fit_line([1.0], [1.0])


EVEN_SIZES = [4.0**k for k in range(5, 13)]  # 1 KiB .. 16 MiB, as a holdout calibrates


def _hinge_times(
    sizes: list[float], knee: float, a: float = 80e-6, b: float = 0.5e-9, c: float = 0.6e-9
) -> list[float]:
    return [a + b * s + c * max(0.0, s - knee) for s in sizes]


def test_fit_hinge_exact() -> None:
    knee = EVEN_SIZES[5]  # 1 MiB
    a, b, c, err = fit_hinge(EVEN_SIZES, _hinge_times(EVEN_SIZES, knee), knee)
    assert (a, b, c) == pytest.approx((80e-6, 0.5e-9, 0.6e-9), rel=1e-6)
    assert err < 1e-9
    with pytest.raises(ConfigError, match="at least 3"):
        fit_hinge([1.0, 2.0], [1.0, 2.0], 1.5)


def test_two_regimes_found_where_there_are_two() -> None:
    knee = EVEN_SIZES[5]
    fit = fit_two_regime(EVEN_SIZES, _hinge_times(EVEN_SIZES, knee))
    assert fit.knee_bytes == knee
    assert fit.extra_seconds_per_byte == pytest.approx(0.6e-9, rel=1e-6)
    assert fit.median_abs_error < 1e-9 < fit.line_median_abs_error


@pytest.mark.parametrize("seed", range(5))
def test_no_knee_on_a_noisy_line(seed: int) -> None:
    """+-10 % noise on one line: the best knee does not pass the F-test."""
    rng = random.Random(seed)
    sizes = [2.0**k for k in range(10, 25)]
    times = [(80e-6 + 0.5e-9 * s) * (1 + rng.uniform(-0.1, 0.1)) for s in sizes]
    fit = fit_two_regime(sizes, times)
    assert fit.knee_bytes is None
    assert fit.median_abs_error == fit.line_median_abs_error > 0


def test_no_knee_on_an_exact_line() -> None:
    times = [80e-6 + 0.5e-9 * s for s in EVEN_SIZES]
    assert fit_two_regime(EVEN_SIZES, times).knee_bytes is None


def test_knee_alpha_is_the_gate() -> None:
    """A mild knee under noise: kept or not by the test's level alone, never by held-out sizes."""
    rng = random.Random(3)
    times = [
        t * (1 + rng.uniform(-0.05, 0.05))
        for t in _hinge_times(EVEN_SIZES, EVEN_SIZES[5], c=0.2e-9)
    ]
    assert fit_two_regime(EVEN_SIZES, times, alpha=1.0).knee_bytes is not None
    assert fit_two_regime(EVEN_SIZES, times, alpha=1e-12).knee_bytes is None
    assert 0 < KNEE_ALPHA < 1


def test_f_critical_closed_form() -> None:
    """F(2, d2) upper quantiles against printed tables (e.g. NIST/SEMATECH e-Handbook 1.3.6.7.3):
    F_0.95(2, 4) = 6.944, F_0.95(2, 10) = 4.103, F_0.99(2, 4) = 18.000."""
    assert f_critical(4, 0.05) == pytest.approx(6.944, abs=1e-3)
    assert f_critical(10, 0.05) == pytest.approx(4.103, abs=1e-3)
    assert f_critical(4, 0.01) == pytest.approx(18.0, abs=1e-3)
    with pytest.raises(ValueError):
        f_critical(0, 0.05)


def test_select_rows_every_other_power_of_two() -> None:
    rows = [{"op": "all_reduce", "size_bytes": 2**k} for k in range(10, 16)]
    rows.append({"op": "all_reduce", "size_bytes": 3 * 1024})  # not a power of two
    rows.append({"op": "all_gather", "size_bytes": 4095})  # 2^12 rounded down to n
    even = [r["size_bytes"] for r in select_rows(rows, "even")]
    odd = [r["size_bytes"] for r in select_rows(rows, "odd", min_bytes=4096)]
    assert even == [1024, 4096, 16384, 4095] and odd == [8192, 32768]
    with pytest.raises(ConfigError, match="subset"):
        select_rows(rows, "half")


@pytest.mark.parametrize("n", [2, 4])
def test_calibration_recovers_the_truth(tmp_path: Path, n: int) -> None:
    meas = _synthetic(tmp_path, n)
    cal = calibrate(meas, subset="even")
    # The fit names the same algorithm the simulator used and explains the data exactly.
    assert {op: f.algorithm for op, f in cal.ops.items()} == {
        op: "ring" if op not in ("send_recv",) else "direct" for op in TRUE_OPS
    }
    for fit in cal.ops.values():
        assert fit.fit_median_abs_error < 1e-6
    ratios = {op: f.efficiency / TRUE_OPS[op][1] for op, f in cal.ops.items()}
    # Only bandwidth x efficiency is identifiable per op: the ratios agree with each other.
    assert max(ratios.values()) == pytest.approx(min(ratios.values()), rel=1e-6)
    topo = topology_for(write_topology(cal, tmp_path / "fitted.yaml"), meas)
    points = compare(meas, topo, subset="odd")
    assert max(abs(p.error) for p in points) < 1e-6
    assert any("reduce_scatter: the backend ran gloo:all_reduce" in note for note in cal.notes)


def test_noisy_calibration_and_summary(tmp_path: Path) -> None:
    meas = _synthetic(tmp_path, 2, noise=0.05)
    cal = calibrate(meas, subset="even")
    topo = topology_for(write_topology(cal, tmp_path / "fitted.yaml"), meas)
    summary = {s.op: s for s in summarize(compare(meas, topo, subset="odd"))}
    assert summary["all"].count == 5 * 7  # 5 ops x 7 odd powers of two in 2^11..2^23
    assert 0 < summary["all"].median_abs_error < 0.05  # noise of +-5% cannot be fitted away
    assert summary["all"].max_abs_error >= summary["all"].p90_abs_error


def test_calibration_rejects_wrong_results(tmp_path: Path) -> None:
    meas = _synthetic(tmp_path)
    meas.rows[0]["wrong"] = 7
    with pytest.raises(ConfigError, match="wrong results"):
        calibrate(meas)


def test_compare_rejects_mismatched_world_size(tmp_path: Path) -> None:
    meas = _synthetic(tmp_path, 2)
    from collsim.cluster.topology import load_topology

    with pytest.raises(ConfigError, match="has 4 ranks"):
        compare(meas, load_topology("localhost", gpus_per_node=4))


def test_cli_calibrate_compare_holdout(tmp_path: Path) -> None:
    from collsim.cli.validate import validate

    meas = _synthetic(tmp_path, 2, noise=0.02)
    runner = CliRunner()
    out = tmp_path / "topologies" / "mine.yaml"
    # no command creates a folder it was not given (issue 15): -o needs an existing folder
    res = runner.invoke(validate, ["calibrate", meas.path, "-o", str(out), "--subset", "even"])
    assert res.exit_code != 0 and not out.parent.exists()
    out.parent.mkdir()
    res = runner.invoke(validate, ["calibrate", meas.path, "-o", str(out), "--subset", "even"])
    assert res.exit_code == 0, res.output
    assert "reduce_scatter" in res.output and out.exists()
    plot = tmp_path / "cmp.png"
    res = runner.invoke(
        validate,
        [
            "compare",
            meas.path,
            "--topology",
            str(out),
            "--subset",
            "odd",
            "--plot",
            str(plot),
            "--json",
            str(tmp_path / "c.json"),
        ],
    )
    assert res.exit_code == 0, res.output
    assert plot.stat().st_size > 1000 and "median|err|" in res.output
    res = runner.invoke(validate, ["holdout", meas.path, "--out-dir", str(tmp_path / "ho")])
    assert res.exit_code == 0, res.output
    assert res.output.count("PASS") == 3  # all_reduce, all_gather, broadcast
    res = runner.invoke(validate, ["holdout", meas.path, "--target", "0.0001"])
    assert res.exit_code == 1 and "median |error| above" in res.output


def _with_held_out_off(meas: Measurements, path: Path, factor: float) -> str:
    """all_reduce of ``meas``, its held-out sizes (odd powers of two >= 256 KiB) ``factor`` x."""
    rows = []
    for r in meas.rows:
        if r["op"] != "all_reduce":
            continue
        row = dict(r)
        size = int(row["size_bytes"])
        if size >= 2**18 and (size.bit_length() - 1) % 2 == 1:
            row["time_us"] = float(row["time_us"]) * factor
        rows.append(row)
    return str(write_measurements(path, rows, dict(meas.metadata)))


def test_holdout_across_runs_judges_the_typical_run(tmp_path: Path) -> None:
    from collsim.cli.validate import validate

    meas = _synthetic(tmp_path, 2, noise=0.01)
    files = [
        _with_held_out_off(meas, tmp_path / f"{name}.csv", factor)
        for name, factor in (("a", 1.0), ("b", 1.02), ("c", 1.5))
    ]
    runner = CliRunner()
    # every file on its own: the one bad run fails the check
    res = runner.invoke(validate, ["holdout", *files])
    assert res.exit_code == 1 and "c all_reduce" in res.output
    assert "# across runs" in res.output  # 3 files of one world size: shown
    row = next(line for line in res.output.splitlines() if line.split()[:2] == ["2", "all_reduce"])
    assert row.split()[2] == "3" and "2/3" in row  # 3 runs, 2 within 10 %
    assert not row.rstrip().endswith(("PASS", "FAIL"))  # no verdict without --across-runs
    # the typical run (the median of the three) passes
    res = runner.invoke(validate, ["holdout", *files, "--across-runs"])
    assert res.exit_code == 0, res.output
    row = next(line for line in res.output.splitlines() if line.split()[:2] == ["2", "all_reduce"])
    assert row.rstrip().endswith("PASS")


def test_across_runs_median_and_passing() -> None:
    from collsim.validate.check.compare import OpSummary, across_runs

    def run(n: int, err: float) -> tuple[int, list[OpSummary]]:
        return n, [OpSummary("broadcast", 3, err, err, err), OpSummary("all", 3, err, err, err)]

    runs = across_runs([run(2, 0.05), run(4, 0.30), run(2, 0.12), run(2, 0.11)])
    assert [(r.world_size, r.op, r.run_errors) for r in runs] == [
        (2, "broadcast", (0.05, 0.12, 0.11)),
        (4, "broadcast", (0.30,)),
    ]
    assert runs[0].median == pytest.approx(0.11) and runs[0].worst == 0.12
    assert runs[0].passing(0.10) == 1 and runs[1].passing(0.10) == 0
