"""The launcher cannot hang: failures end the run, name the rank and leave no process behind."""

from __future__ import annotations

import os
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from collsim.validate.measure.launch import RankFailure, free_port, in_torchrun, spawn_ranks

pytestmark = pytest.mark.torch

sys.path.insert(0, str(Path(__file__).parent))
import helpers_ranks  # noqa: E402


def _pids(pid_dir: Path) -> list[int]:
    return [int(p.read_text()) for p in sorted(pid_dir.glob("rank*.pid"))]


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    # A zombie still answers kill(0); it is dead for our purpose only once reaped.
    status = Path(f"/proc/{pid}/status")
    return status.exists() and "zombie" not in status.read_text()


def test_two_ranks_sum(tmp_path: Path) -> None:
    assert spawn_ranks(helpers_ranks.sum_of_ranks, 2, args=(str(tmp_path), 0.5), timeout_s=60) == [
        2.0,
        2.0,
    ]  # (0 + .5) + (1 + .5)


@pytest.mark.parametrize(
    "fn, reason, pattern",
    [
        (helpers_ranks.rank1_raises, "error", r"rank 1 raised: ValueError: boom on purpose"),
        (helpers_ranks.rank1_killed, "died", r"rank 1 was killed by signal 9"),
    ],
    ids=["raises", "killed"],
)
def test_failing_rank_ends_run_and_is_named(tmp_path: Path, fn, reason: str, pattern: str) -> None:
    start = time.monotonic()
    with pytest.raises(RankFailure, match=pattern) as info:
        spawn_ranks(fn, 2, args=(str(tmp_path),), timeout_s=60)
    # The watchdog reacts at once; it does not wait for the 60 s collective timeout.
    assert time.monotonic() - start < 30
    assert info.value.ranks == (1,) and info.value.reason == reason
    pids = _pids(tmp_path)
    assert len(pids) == 2 and not any(_alive(p) for p in pids)


def test_hanging_rank_times_out(tmp_path: Path) -> None:
    start = time.monotonic()
    with pytest.raises(RankFailure, match=r"did not finish within the 8 s timeout") as info:
        spawn_ranks(helpers_ranks.rank1_hangs, 2, args=(str(tmp_path),), timeout_s=8)
    assert time.monotonic() - start < 20
    assert 1 in info.value.ranks and info.value.reason == "timeout"
    assert not any(_alive(p) for p in _pids(tmp_path))


def test_two_benches_at_once_do_not_collide() -> None:
    """Each run has its own FileStore (no fixed port): two benches at once both succeed."""
    from collsim.validate.measure.bench import BenchConfig, run_bench

    config = BenchConfig(
        ops=("all_reduce",), sizes_bytes=(4096,), iters=2, warmup=1, probe_backend=False
    )
    results: dict[int, object] = {}

    def run(k: int) -> None:
        try:
            results[k] = run_bench(config, world_size=2, timeout_s=90)[0]
        except Exception as exc:  # noqa: BLE001 - reported by the assert below
            results[k] = exc

    threads = [threading.Thread(target=run, args=(k,)) for k in (1, 2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    assert all(not isinstance(r, Exception) for r in results.values()), results
    assert [r.points[0].wrong for r in results.values()] == [0, 0]


def test_free_port_is_bindable() -> None:
    import socket

    port = free_port()
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", port))


def test_bad_arguments() -> None:
    with pytest.raises(ValueError, match="world_size"):
        spawn_ranks(helpers_ranks.sum_of_ranks, 0)


def test_torchrun_env_detected(monkeypatch: pytest.MonkeyPatch) -> None:
    for key in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"):
        monkeypatch.delenv(key, raising=False)
    assert not in_torchrun()
    for key, value in (
        ("RANK", "0"),
        ("WORLD_SIZE", "2"),
        ("MASTER_ADDR", "127.0.0.1"),
        ("MASTER_PORT", "1"),
    ):
        monkeypatch.setenv(key, value)
    assert in_torchrun()


def test_bench_under_torchrun(tmp_path: Path) -> None:
    """The same bench command runs under torchrun (env:// rendezvous), rank 0 writes the CSV."""
    out = tmp_path / "m.csv"
    collsim = Path(sys.executable).with_name("collsim")
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        "--nproc-per-node",
        "2",
        str(collsim),
        "validate",
        "bench",
        "--ops",
        "all_reduce",
        "-b",
        "4K",
        "-e",
        "4K",
        "--iters",
        "3",
        "--warmup",
        "1",
        "--timeout",
        "60",
        "-o",
        str(out),
    ]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-2000:]
    text = out.read_text()
    assert '# launcher: "torchrun"' in text and "# world_size: 2" in text
    assert "# load_average_start: [" in text and "# load_average_end: [" in text
    assert '# scheduling: "SCHED_OTHER"' in text  # read back from the kernel
    assert "# cpu_steal_share: " in text
    assert proc.stdout.count("# Avg bus bandwidth") == 1  # only rank 0 prints


def test_ranks_die_with_a_killed_parent(tmp_path: Path) -> None:
    """A parent killed outright (no cleanup possible) still leaves no rank behind."""
    code = (
        "import sys; sys.path.insert(0, %r)\n"
        "import helpers_ranks\n"
        "from collsim.validate.measure.launch import spawn_ranks\n"
        "if __name__ == '__main__':\n"
        "    spawn_ranks(helpers_ranks.both_sleep, 2, args=(%r,), timeout_s=600)\n"
        % (str(Path(__file__).parent), str(tmp_path))
    )
    script = tmp_path / "parent.py"
    script.write_text(code)
    parent = subprocess.Popen([sys.executable, str(script)])
    deadline = time.monotonic() + 60
    while len(_pids(tmp_path)) < 2 and time.monotonic() < deadline:
        time.sleep(0.2)
    pids = _pids(tmp_path)
    assert len(pids) == 2
    parent.kill()
    parent.wait(10)
    deadline = time.monotonic() + 10
    while any(_alive(p) for p in pids) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert not any(_alive(p) for p in pids)


def test_realtime_ranks_run_under_sched_rr() -> None:
    """``realtime=True``: every rank and the threads it starts run under SCHED_RR; the probe and
    the run leave the launching process's own policy as it was."""
    from collsim.validate.measure.launch import (
        REALTIME_PRIORITY,
        current_scheduling,
        realtime_problem,
    )

    before = current_scheduling()
    problem = realtime_problem()
    assert current_scheduling() == before
    if problem is not None:
        assert "SCHED_RR" in problem
        pytest.skip(problem)
    rr = f"SCHED_RR priority {REALTIME_PRIORITY}"
    assert spawn_ranks(helpers_ranks.scheduling, 2, realtime=True, timeout_s=60) == [(rr, rr)] * 2
    plain = spawn_ranks(helpers_ranks.scheduling, 2, timeout_s=60)
    assert all("SCHED_RR" not in policy for pair in plain for policy in pair)
    assert current_scheduling() == before


def test_realtime_refused_is_one_line(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """Where the host refuses SCHED_RR, ``--realtime`` is a usage error (exit 2) naming why."""
    import collsim.validate.measure.launch as launch
    from collsim.cli import main

    monkeypatch.setattr(
        launch,
        "realtime_problem",
        lambda: (
            "cannot run ranks under SCHED_RR priority 10: Operation not permitted; it needs root"
        ),
    )
    with pytest.raises(SystemExit) as exc:
        main(["validate", "bench", "--realtime"])
    out, err = capsys.readouterr()
    assert exc.value.code == 2
    lines = [line for line in (out + err).splitlines() if line.strip()]
    assert len(lines) == 1 and "--realtime" in lines[0] and "not permitted" in lines[0]


def test_the_parent_checks_the_backend_without_loading_torch() -> None:
    """Before local ranks are spawned, the backend is checked in a forked child: the parent,
    which only watches the ranks, never imports torch (its memory stays out of a bench's
    peak); a backend the installed torch lacks is still refused there with one line."""
    repo = Path(__file__).resolve().parents[2]
    code = (
        "import sys\n"
        "from collsim.core.errors import ConfigError\n"
        "from collsim.validate.measure.launch import check_backend\n"
        "check_backend('gloo', 2)\n"
        "assert 'torch' not in sys.modules, 'the parent imported torch'\n"
        "try:\n"
        "    check_backend('nccl', 2)\n"
        "except ConfigError as exc:\n"
        "    print('refused:', exc)\n"
        "assert 'torch' not in sys.modules\n"
    )
    env = dict(os.environ, PYTHONPATH=str(repo))
    out = subprocess.run(
        [sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=600
    )
    assert out.returncode == 0, out.stderr
    torch = pytest.importorskip("torch")
    if not torch.cuda.is_available():  # a CPU-only build has no nccl: refused, naming it
        assert "refused: --backend: " in out.stdout and "no nccl backend" in out.stdout
