"""A calibrated knee (``collectives.ops.<op>.knee_bytes`` / ``knee_efficiency``): the closed
form and the DES give the same time, below and above the knee, and calibration finds it."""

from __future__ import annotations

import random
from pathlib import Path

import pytest
import simpy
import yaml

from collsim.core.errors import ConfigError

KNEE_BYTES = 2**20


def _topology(tmp_path: Path, n: int = 2, **broadcast: float) -> Path:
    doc = {
        "name": "knee",
        "device": "cpu",
        "gpus_per_node": n,
        "intra_node": {"interconnect": "loopback", "bandwidth_gbps": 2.0, "latency_us": 40.0},
        "collectives": {
            "library": "gloo",
            "algorithms": {"broadcast": "ring"},
            "ops": {"broadcast": {"overhead_us": 100.0, "efficiency": 0.8, **broadcast}},
        },
    }
    path = tmp_path / f"knee_{len(broadcast)}_{n}.yaml"
    path.write_text(yaml.safe_dump(doc))
    return path


def _des_time_s(topo, op: str, size_bytes: float) -> float:
    from collsim.cluster.network import FlowNetwork
    from collsim.collectives import Group, simulate

    env = simpy.Environment()
    proc = simulate(env, FlowNetwork(env, topo), op, size_bytes, Group.all(topo))
    env.run()
    return float(proc.value.time_s)


@pytest.mark.parametrize("n", [2, 4])
def test_knee_closed_form_and_des(tmp_path: Path, n: int) -> None:
    from collsim.cluster.topology import load_topology
    from collsim.collectives import Group, cost

    plain = load_topology(_topology(tmp_path, n))
    knee = load_topology(_topology(tmp_path, n, knee_bytes=KNEE_BYTES, knee_efficiency=0.4))
    gp, gk = Group.all(plain), Group.all(knee)
    per_byte = (
        cost("broadcast", 2 * KNEE_BYTES, gp).time_s - cost("broadcast", KNEE_BYTES, gp).time_s
    ) / KNEE_BYTES
    for size in (1024, KNEE_BYTES // 2, KNEE_BYTES, 3 * KNEE_BYTES, 16 * KNEE_BYTES):
        base = cost("broadcast", size, gp).time_s
        with_knee = cost("broadcast", size, gk).time_s
        # Above the knee each byte costs 0.8 / 0.4 = 2x: the extra is (size - K) x per_byte.
        expected = base + max(0, size - KNEE_BYTES) * per_byte
        assert with_knee == pytest.approx(expected, rel=1e-12)
        assert _des_time_s(knee, "broadcast", size) == pytest.approx(with_knee, rel=1e-9)
        # Other ops are untouched.
        assert cost("all_reduce", size, gk).time_s == cost("all_reduce", size, gp).time_s


@pytest.mark.parametrize(
    "keys, pattern",
    [
        ({"knee_bytes": KNEE_BYTES}, "knee_efficiency"),
        ({"knee_efficiency": 0.4}, "knee_bytes"),
        ({"knee_bytes": KNEE_BYTES, "knee_efficiency": 0.9}, "knee_efficiency"),
        ({"knee_bytes": -1, "knee_efficiency": 0.4}, "knee_bytes"),
    ],
)
def test_knee_keys_checked(tmp_path: Path, keys: dict, pattern: str) -> None:
    from collsim.cluster.topology import load_topology

    with pytest.raises(ConfigError, match=pattern):
        load_topology(_topology(tmp_path, **keys))


def test_calibration_finds_the_knee_and_predicts_the_held_out_sizes(tmp_path: Path) -> None:
    from collsim.cluster.topology import load_topology
    from collsim.collectives import Group, cost
    from collsim.validate.check.compare import compare, summarize, topology_for
    from collsim.validate.data.dataset import read_measurements, write_measurements
    from collsim.validate.fit.calibrate import calibrate, write_topology

    truth = load_topology(_topology(tmp_path, knee_bytes=KNEE_BYTES, knee_efficiency=0.4))
    rows = []
    for op in ("all_reduce", "broadcast"):
        for exp in range(10, 25):
            size = 2**exp
            t = cost(op, size, Group.all(truth)).time_s
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
                    algbw_gbps=0.0,
                    busbw_gbps=0.0,
                    wrong=0,
                    world_size=2,
                    iters=5,
                )
            )
    path = write_measurements(
        tmp_path / "m.csv", rows, {"backend": "gloo", "world_size": 2, "ranks_per_node": 2}
    )
    meas = read_measurements(path)
    cal = calibrate(meas, subset="even")
    assert cal.ops["broadcast"].knee_bytes == pytest.approx(KNEE_BYTES, rel=1e-9)
    assert cal.ops["all_reduce"].knee_bytes is None
    eff = cal.ops["broadcast"]
    assert eff.knee_efficiency == pytest.approx(eff.efficiency * 0.4 / 0.8, rel=1e-6)
    fitted = topology_for(write_topology(cal, tmp_path / "fitted.yaml"), meas)
    assert summarize(compare(meas, fitted, subset="odd"))[-1].max_abs_error < 1e-6
    no_knee = topology_for(
        write_topology(calibrate(meas, subset="even", knees=False), tmp_path / "line.yaml"), meas
    )
    worst_line = summarize(compare(meas, no_knee, subset="odd", ops=("broadcast",)))[0]
    assert worst_line.max_abs_error > 0.05  # one line cannot follow the knee


def _rows(topo, op: str, exps: range) -> list[dict]:
    from collsim.collectives import Group, cost

    rows = []
    for exp in exps:
        size = 2**exp
        t = cost(op, size, Group.all(topo)).time_s
        rows.append(
            dict(
                op=op,
                size_bytes=size,
                count=size // 4,
                type="float",
                redop="none",
                root=0,
                time_us=t * 1e6,
                min_us=t * 1e6,
                p90_us=t * 1e6,
                algbw_gbps=0.0,
                busbw_gbps=0.0,
                wrong=0,
                world_size=2,
                iters=5,
            )
        )
    return rows


def test_a_knee_between_the_fitted_sizes_is_found(tmp_path: Path) -> None:
    """The knee is a fitted size, not one of the measured ones: a breakpoint at 1.5 MiB, between
    the fitted 1 MiB and 4 MiB, is placed within one grid step and the held-out 2 MiB and
    8 MiB points are predicted; pinned to a fitted size it could not be."""
    from collsim.cluster.topology import load_topology
    from collsim.validate.check.compare import compare, summarize, topology_for
    from collsim.validate.data.dataset import read_measurements, write_measurements
    from collsim.validate.fit.calibrate import calibrate, write_topology
    from collsim.validate.fit.numerics import KNEE_GRID_PER_OCTAVE

    knee = 1.5 * 2**20
    truth = load_topology(_topology(tmp_path, knee_bytes=knee, knee_efficiency=0.4))
    meas = read_measurements(
        write_measurements(
            tmp_path / "m.csv",
            _rows(truth, "broadcast", range(10, 25)),
            {"backend": "gloo", "world_size": 2, "ranks_per_node": 2},
        )
    )
    fit = calibrate(meas, subset="even").ops["broadcast"]
    step = 2 ** (1 / KNEE_GRID_PER_OCTAVE)
    assert knee / step <= fit.knee_bytes <= knee * step
    fitted = topology_for(
        write_topology(calibrate(meas, subset="even"), tmp_path / "fitted.yaml"), meas
    )
    assert summarize(compare(meas, fitted, subset="odd"))[-1].max_abs_error < 0.01


def test_knee_candidates() -> None:
    from collsim.validate.fit.numerics import knee_candidates

    sizes = [2.0**e for e in range(10, 25, 2)]  # 1K, 4K, ..., 16M
    grid = knee_candidates(sizes, per_octave=4)
    assert grid[0] == 2**14 and grid[-1] < 2**22  # 3 sizes at or below, 2 above
    assert all(b / a == pytest.approx(2**0.25) for a, b in zip(grid, grid[1:]))
    assert knee_candidates(sizes[:4]) == []


def test_noise_alone_gets_no_knee(tmp_path: Path) -> None:
    from collsim.cluster.topology import load_topology
    from collsim.collectives import Group, cost
    from collsim.validate.data.dataset import read_measurements, write_measurements
    from collsim.validate.fit.calibrate import calibrate

    plain = load_topology(_topology(tmp_path))
    rng = random.Random(7)
    rows = []
    for exp in range(10, 25):
        size = 2**exp
        t = cost("broadcast", size, Group.all(plain)).time_s * (1 + rng.uniform(-0.08, 0.08))
        rows.append(
            dict(
                op="broadcast",
                size_bytes=size,
                count=size // 4,
                type="float",
                redop="none",
                root=0,
                time_us=t * 1e6,
                min_us=t * 1e6,
                p90_us=t * 1e6,
                algbw_gbps=0.0,
                busbw_gbps=0.0,
                wrong=0,
                world_size=2,
                iters=5,
            )
        )
    meas = read_measurements(
        write_measurements(
            tmp_path / "m.csv", rows, {"backend": "gloo", "world_size": 2, "ranks_per_node": 2}
        )
    )
    for subset in ("all", "even"):
        assert calibrate(meas, subset=subset).ops["broadcast"].knee_bytes is None
