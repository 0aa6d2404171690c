"""``--space FILE.yaml`` (any axis of the search space, each value checked) and the collapse
of alike plans into one row (``--tolerance``)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from collsim.core.errors import ConfigError
from collsim.parallel.config import ParallelConfig
from collsim.step.result import StepResult
from collsim.study.search import Candidate, Ranked, SearchSpace, collapse, enumerate_plans
from collsim.study.space_file import read_space
from collsim.workload import TransformerSpec

REPO = Path(__file__).resolve().parents[1]
TINY = TransformerSpec(
    name="tiny", num_layers=8, hidden=512, num_heads=8, ffn_hidden=2048, seq_len=256, vocab=4096
)


def test_a_space_file_restricts_and_extends_axes(tmp_path: Path) -> None:
    path = tmp_path / "space.yaml"
    path.write_text(
        "micro_batches: [1, 3]\ntps: [2]\npps: [1, 2]\nschedules: [1f1b]\n"
        "bucket_mbs: [25, 50]\nzero_stages: [0]\nmax_tp: 8\n"
    )
    space = read_space(path)
    assert space.micro_batches == (1, 3) and space.bucket_mbs == (25.0, 50.0)
    assert space.max_tp == 8 and space.recomputes == SearchSpace().recomputes
    plans = list(enumerate_plans(TINY, 16, 8, 48, space, base=ParallelConfig(dp=16)))
    assert plans and {p.tp for p in plans} == {2} and {p.pp for p in plans} <= {1, 2}
    assert {p.micro_batch for p in plans} == {1, 3}
    assert {p.bucket_mb for p in plans if p.dp > 1} == {25.0, 50.0}


@pytest.mark.parametrize(
    ("text", "key", "rule"),
    [
        ("micro_batches: [0]\n", "micro_batches", ">= 1"),
        ("zero_stages: [4]\n", "zero_stages", "0-3"),
        ("schedules: [zigzag]\n", "schedules", "one of"),
        ("bucket_mbs: [.nan]\n", "bucket_mbs", "finite"),
        ("tps: []\n", "tps", "non-empty"),
        ("tps: [2, 2]\n", "tps", "repeat"),
        ("overlaps: [yes please]\n", "overlaps", "true or false"),
        ("warp_speed: [9]\n", "warp_speed", "not an axis"),
        ("max_tp: 8.5\n", "max_tp", "integer"),
    ],
)
def test_a_bad_space_file_names_file_line_key_and_rule(
    tmp_path: Path, text: str, key: str, rule: str
) -> None:
    path = tmp_path / "space.yaml"
    path.write_text("# a space\n" + text)
    with pytest.raises(ConfigError) as info:
        read_space(path)
    message = str(info.value)
    assert str(path) in message and ":2:" in message and key in message and rule in message


def test_the_cli_refuses_a_bad_space_file_in_one_line(tmp_path: Path) -> None:
    path = tmp_path / "space.yaml"
    path.write_text("micro_batches: [-1]\n")
    cli = [sys.executable, "-c", "import sys; from collsim.cli import main; sys.exit(main())"]
    done = subprocess.run(
        cli + ["search", "scenarios/ddp_gpt3_1.3b.yaml", "--space", str(path)],
        cwd=REPO,
        env={"PYTHONPATH": str(REPO), "PATH": "/usr/bin:/bin"},
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 2
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1 and "micro_batches" in lines[0] and "-1" in lines[0]


def _ranked(time_s: float, **knobs: object) -> Ranked:
    base: dict[str, object] = dict(
        tp=2, pp=1, dp=8, micro_batch=1, schedule="1f1b", virtual_stages=1, zero=1,
        recompute="none", sequence_parallel=False,
    )  # fmt: skip
    base.update(knobs)
    estimate = StepResult(
        step_time_s=time_s, tokens_per_s=0.0, model_tflops_per_gpu=0.0,
        hardware_tflops_per_gpu=0.0, mfu=0.0, hfu=0.0, breakdown_s={},
        memory_peak_bytes=0.0, memory_bytes={}, memory_capacity_bytes=1.0, fits=True,
    )  # fmt: skip
    return Ranked(Candidate(**base), estimate)  # type: ignore[arg-type]


def test_alike_plans_collapse_into_one_row_and_other_shapes_stay() -> None:
    ranked = [
        _ranked(1.000, bucket_mb=400.0),
        _ranked(1.001, bucket_mb=100.0),
        _ranked(1.004, bucket_mb=25.0, overlap=False),
        _ranked(1.004, tp=4, dp=4),  # another shape, as fast: its own row
        _ranked(1.010, bucket_mb=10.0),  # 1 % slower than its row's best: a row of its own
    ]
    rows = collapse(ranked, 0.005)
    assert [r.estimate.step_time_s for r in rows] == [1.000, 1.004, 1.010]
    assert [a.candidate.bucket_mb for a in rows[0].alike] == [100.0, 25.0]
    assert rows[1].candidate.tp == 4 and rows[1].alike == []
    assert collapse(ranked, 0.0) == ranked and all(r.alike == [] for r in ranked)


def test_the_cli_tolerance_default_is_the_search_default() -> None:
    # the option's default is written out (the search package is not imported at start-up)
    from collsim.cli.search import search as command
    from collsim.study.search import DEFAULT_TOLERANCE_PCT

    option = next(p for p in command.params if p.name == "tolerance_pct")
    assert option.default == DEFAULT_TOLERANCE_PCT
