"""The seven llm-foundry rows (tests/workload/data/training_calibration.csv, copied from
reference/training_calibration.csv) as scenarios/published/<id>.yaml."""

from __future__ import annotations

import csv
from pathlib import Path

import pytest

from collsim.play.engine import simulate_step
from collsim.study.scenario import load_scenario

ROOT = Path(__file__).resolve().parents[2]
DATA = Path(__file__).parent / "data" / "training_calibration.csv"
with DATA.open() as _f:
    ROWS = list(csv.DictReader(line for line in _f if not line.startswith("#")))


@pytest.mark.parametrize("row", ROWS, ids=[r["id"] for r in ROWS])
def test_published_scenario_matches_its_row(row: dict[str, str]) -> None:
    sc = load_scenario(ROOT / "scenarios" / "published" / f"{row['id']}.yaml")
    spec = sc.model
    assert (spec.num_layers, spec.hidden, spec.num_heads, spec.seq_len, spec.vocab) == tuple(
        int(row[k]) for k in ("layers", "hidden", "heads", "seq_len", "vocab")
    )
    assert sc.training.micro_batch == int(row["micro_batch"])
    assert sc.training.global_batch == int(row["global_batch"])
    assert str(sc.training.recompute) == row["recompute"]
    # llm-foundry: triton flash attention, fp32 gradient reduction (FSDP mixed precision DEFAULT)
    assert sc.training.attention_kernel == "triton" and spec.flash_attention
    assert sc.training.grad_reduce_dtype == "fp32" and sc.training.fused_kernels is False


def test_published_rows_are_no_longer_far_too_optimistic() -> None:
    # the roofline model was +43 % on average on such runs (issue figures); collsim run as it
    # stands, without framework costs and interference, must stay below +20 % on every row
    errors = []
    for row in ROWS:
        sc = load_scenario(ROOT / "scenarios" / "published" / f"{row['id']}.yaml")
        r = simulate_step(sc.cluster.load(), sc.model, sc.training, sc.parallel)
        assert r.fits
        tok = sc.training.global_batch * sc.model.seq_len / r.step_time_s / sc.parallel.world_size
        errors.append(tok / float(row["published_tokens_per_s_per_gpu"]) - 1)
    assert all(-0.12 < e < 0.25 for e in errors), errors
    assert sum(errors) / len(errors) < 0.20
