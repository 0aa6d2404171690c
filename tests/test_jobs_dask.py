"""The Dask backend of searches and sweeps against a real ``distributed.LocalCluster`` (two
worker processes on loopback, ports chosen by the system): the same best plans as this
process alone, the same result when a worker is killed mid-search, and one line (exit 2, under
10 s) for a scheduler that cannot be reached or a port that answers in another protocol."""

from __future__ import annotations

import dataclasses
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

distributed = pytest.importorskip("distributed")

from collsim.cluster.topology import load_topology  # noqa: E402
from collsim.core.dask_client import check_scheduler  # noqa: E402
from collsim.core.errors import ConfigError, SimulationError  # noqa: E402
from collsim.core.jobs import MAX_TASK_ITEMS, Workers  # noqa: E402
from collsim.parallel.config import ParallelConfig, TrainingConfig  # noqa: E402
from collsim.study.search import SearchSpace, search_plans  # noqa: E402
from collsim.workload import TransformerSpec  # noqa: E402

REPO = Path(__file__).resolve().parents[1]
CLI = [sys.executable, "-c", "import sys; from collsim.cli import main; sys.exit(main())"]
TINY = TransformerSpec(
    name="tiny", num_layers=8, hidden=512, num_heads=8, ffn_hidden=2048, seq_len=256, vocab=4096
)
SPACE = SearchSpace(
    micro_batches=(1,),
    bucket_mbs=(25.0,),
    overlaps=(True,),
    bucket_views=(False,),
    prefetches=(1,),
    offloads=(False,),
    reshards=(True,),
)


def _local_cluster(workers: int, threads: int = 1):
    """A cluster of ``workers`` worker processes of ``threads`` threads each (one by default)
    on loopback, free ports."""
    return distributed.LocalCluster(
        n_workers=workers,
        threads_per_worker=threads,
        processes=True,
        host="127.0.0.1",
        scheduler_port=0,
        dashboard_address="127.0.0.1:0",
    )


@pytest.fixture(scope="module")
def cluster():
    with _local_cluster(2) as local:
        yield local


@pytest.fixture(scope="module")
def h100x16():
    return load_topology("dgx_h100", nodes=2)


def _key(result):
    return (
        [(r.candidate, r.estimate.step_time_s) for r in result.ranked[:10]],
        [(r.candidate, r.step_time_s, r.reason) for r in result.simulated],
    )


ARGS = dict(space=SPACE, top_k=3)


def _args(topology):
    return (topology, TINY, TrainingConfig(global_batch=64, micro_batch=1), ParallelConfig(dp=16))


def _square(ctx: int, item: int) -> int:
    return ctx * item * item


def _three() -> int:
    return 3


def test_workers_map_in_order_on_the_cluster(cluster) -> None:
    with Workers(1, _three, scheduler=cluster.scheduler_address) as workers:
        assert workers.jobs == 2
        assert workers.map(_square, range(50)) == [3 * i * i for i in range(50)]
        assert list(workers.imap(_square, range(7))) == [3 * i * i for i in range(7)]


def _feeder(count: int, sizes: list[int]):
    """A feed of ``range(count)`` that records the sizes it was asked for; tag: first item."""
    left = list(range(count))

    def feed(size: int):
        if not left:
            return None
        sizes.append(size)
        batch = [left.pop(0) for _ in range(min(size, len(left)))]
        return batch[0], batch

    return feed


@pytest.mark.parametrize("backend", ["inline", "pool", "dask"])
def test_stream_gives_the_batches_in_the_order_fed(cluster, backend: str) -> None:
    sizes: list[int] = []
    scheduler = cluster.scheduler_address if backend == "dask" else None
    jobs = 2 if backend == "pool" else 1
    # enough items for the sizes to reach the cap even when the first tasks' wall seconds
    # are stretched (a loaded machine deschedules the workers: a size grows by its measured
    # items per second, so a slow start takes more items to grow out of)
    count = 3000
    with Workers(jobs, _three, scheduler=scheduler) as workers:
        out = list(workers.stream(_square, _feeder(count, sizes)))
    assert [r for _, results in out for r in results] == [3 * i * i for i in range(count)]
    firsts = [tag for tag, _ in out]
    assert firsts == sorted(firsts) and firsts[0] == 0
    if backend == "inline":
        assert set(sizes) == {workers.batch_size}
    else:
        # one item per task until one has finished, then as many as its measured cost allows
        # (microseconds each here: the most a task takes)
        assert sizes[0] == 1 and max(sizes) == MAX_TASK_ITEMS, sizes


def _exit_on_seven(ctx: int, item: int) -> int:
    if item == 7:
        os._exit(1)  # the process dies as a killed one would
    return ctx * item


def test_a_pool_process_that_dies_mid_stream_is_an_error() -> None:
    with pytest.raises(SimulationError, match="worker process died"):
        with Workers(2, _three) as workers:
            list(workers.stream(_exit_on_seven, _feeder(50, [])))


def _built(path: str) -> int:
    """A context that records the worker process that built it."""
    with open(path, "a") as out:
        out.write(f"{os.getpid()}\n")
    return 3


def test_each_worker_builds_the_context_once(cluster, tmp_path: Path) -> None:
    # the factory goes to each worker once (a worker plugin), not with every batch
    path = tmp_path / "built.txt"
    with Workers(1, _built, (str(path),), scheduler=cluster.scheduler_address) as workers:
        for _ in range(3):
            assert workers.map(_square, range(40)) == [3 * i * i for i in range(40)]
    pids = path.read_text().split()
    assert len(pids) == len(set(pids)) == 2


def _counter() -> dict[str, int]:
    return {"now": 0, "most": 0}


def _most_at_once(ctx: dict[str, int], item: int) -> int:
    """How many items of the context have run at once so far (this one included)."""
    ctx["now"] += 1
    ctx["most"] = max(ctx["most"], ctx["now"])
    time.sleep(0.002)  # (releases the GIL: another thread's batch would run now)
    ctx["now"] -= 1
    return ctx["most"]


def test_a_worker_with_two_threads_runs_one_batch_of_a_context_at_a_time() -> None:
    # a worker started with several threads (Dask's default is one per core) shares one
    # context (a search's estimator and its caches) between them: its batches take turns
    with _local_cluster(1, threads=2) as two_threads:
        with Workers(1, _counter, scheduler=two_threads.scheduler_address) as workers:
            assert workers.jobs == 2  # two batches sent at once
            most = workers.map(_most_at_once, range(400))
    assert max(most) == 1


@pytest.fixture(scope="module")
def local(h100x16):
    return search_plans(*_args(h100x16), **ARGS, jobs=1)


def test_the_cluster_finds_the_same_best_plans(cluster, h100x16, local) -> None:
    remote = search_plans(*_args(h100x16), **ARGS, scheduler=cluster.scheduler_address)
    assert remote.stopped is None
    assert _key(remote) == _key(local)


@pytest.mark.slow
def test_a_worker_killed_mid_search_changes_nothing(cluster, h100x16, local) -> None:
    client = distributed.Client(cluster.scheduler_address, timeout="10s", set_as_default=False)
    try:
        pids = client.run(os.getpid)
        killed: list[int] = []

        def progress(phase: str, n: int) -> None:
            if phase == "estimate" and not killed:
                victim = next(iter(pids.values()))
                os.kill(victim, signal.SIGKILL)
                killed.append(victim)

        remote = search_plans(
            *_args(h100x16), **ARGS, scheduler=cluster.scheduler_address, progress=progress
        )
        assert killed
        client.wait_for_workers(2, timeout=60)
        assert killed[0] not in client.run(os.getpid).values()  # a new worker took its place
    finally:
        client.close()
    assert remote.stopped is None
    assert _key(remote) == _key(local)


@pytest.mark.parametrize(
    "args",
    [
        ["search", "scenarios/ddp_gpt3_1.3b.yaml", "--gpus", "16"],
        ["sweep", "scenarios/ddp_gpt3_1.3b.yaml", "--gpus", "8,16"],
    ],
)
def test_an_unreachable_scheduler_is_one_line_within_10_s(args: list[str]) -> None:
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    started = time.monotonic()
    done = subprocess.run(
        CLI + [*args, "--scheduler", "tcp://127.0.0.1:1"],
        cwd=REPO,
        env=env,
        capture_output=True,
        timeout=60,
    )
    elapsed_s = time.monotonic() - started
    lines = done.stderr.decode().strip().splitlines()
    assert done.returncode == 2, done.stderr.decode()
    assert len(lines) == 1 and "--scheduler" in lines[0] and "127.0.0.1:1" in lines[0]
    assert elapsed_s < 10.0


def test_a_port_that_answers_in_another_protocol_is_no_scheduler() -> None:
    # a web server (a scheduler's dashboard, say) on a free loopback port: it answers each
    # connection with an HTTP error, which Dask would read as the length of a frame
    server = socket.create_server(("127.0.0.1", 0))
    server.settimeout(20)
    port = server.getsockname()[1]

    def answer() -> None:
        for _ in range(2):  # the probe's connection, then the client's
            try:
                conn, _ = server.accept()
            except OSError:
                return
            with conn:
                conn.sendall(b"HTTP/1.1 400 Bad Request\r\nContent-Length: 0\r\n\r\n")
                time.sleep(0.5)

    thread = threading.Thread(target=answer, daemon=True)
    thread.start()
    started = time.monotonic()
    try:
        with pytest.raises(ConfigError) as info:
            check_scheduler(f"tcp://127.0.0.1:{port}")
    finally:
        server.close()
        thread.join(timeout=20)
    assert time.monotonic() - started < 10.0
    assert info.value.key_path == "--scheduler"
    assert f"127.0.0.1:{port}" in str(info.value)
    assert "answers, but not as a Dask scheduler" in str(info.value), str(info.value)


@pytest.mark.slow
def test_a_lost_scheduler_stops_the_search_with_what_it_has(h100x16) -> None:
    local = _local_cluster(1)
    seen: list[int] = []

    def progress(phase: str, n: int) -> None:
        seen.append(n)
        if len(seen) == 3:
            local.close(timeout=20)

    space = dataclasses.replace(SPACE, micro_batches=(1, 2, 4))
    try:
        result = search_plans(
            *_args(h100x16),
            space=space,
            top_k=3,
            scheduler=local.scheduler_address,
            progress=progress,
        )
    finally:
        local.close(timeout=20)
    assert result.stopped is not None and "scheduler" in result.stopped
    assert len(result.ranked) >= 1 and result.simulated == []


def test_a_sweep_on_the_cluster_gives_the_same_points(cluster) -> None:
    from collsim.study.sweep import build_points, parse_gpus, parse_set, run_sweep

    scenario = REPO / "scenarios" / "ddp_gpt3_1.3b.yaml"
    points = build_points(gpus=parse_gpus("8,16"), sets=[parse_set("parallel.zero=0,3")])
    local = run_sweep(scenario, points, jobs=1)
    remote = run_sweep(scenario, points, scheduler=cluster.scheduler_address)
    assert [(o.point, o.reason, o.result.step_time_s if o.result else None) for o in remote] == [
        (o.point, o.reason, o.result.step_time_s if o.result else None) for o in local
    ]
