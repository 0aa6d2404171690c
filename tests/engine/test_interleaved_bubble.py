"""Why the interleaved bubble exceeds (p - 1)/(v m): the decomposition of docs/pipelines.md.

With communication priced at zero and uniform chunks, the first stage of an interleaved plan
idles (p - 1)/(v m) of its compute (Narayanan et al. SC'21, section 2.2.2). The LM head and loss
(``head.forward`` + ``head.backward`` = h per micro-batch) sit on the last chunk of the last
stage only: that stage paces the steady state, and the first stage idles m h more, whatever v is.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from collsim.parallel.config import ParallelConfig, TrainingConfig
from collsim.parallel.plan import build_plan
from collsim.play.engine import simulate_step
from collsim.play.walk import estimate_step
from collsim.step.blocks import block_times
from collsim.study.scenario import load_scenario

from .conftest import topology

SCENARIO = Path(__file__).parents[2] / "scenarios" / "pipeline_13b_interleaved.yaml"
LAYER_F, LAYER_B = 1e-3, 2e-3
HEAD_F, HEAD_B = 0.5e-3, 1e-3


def _times(head_f: float, head_b: float) -> dict[str, float]:
    return {
        "layer.forward": LAYER_F,
        "layer.backward": LAYER_B,
        "layer.recompute": 0.0,
        "embedding.forward": 0.0,
        "embedding.backward": 0.0,
        "head.forward": head_f,
        "head.backward": head_b,
        "optimizer": 0.0,
    }


SHAPES = [(4, 8, 1), (4, 8, 2), (4, 12, 2), (2, 8, 4), (4, 16, 4), (2, 8, 8)]


@pytest.mark.parametrize("play", [estimate_step, simulate_step], ids=["closed", "engine"])
@pytest.mark.parametrize("p, m, v", SHAPES, ids=str)
@pytest.mark.parametrize("head", [False, True], ids=["uniform", "head"])
def test_bubble_is_textbook_plus_head_work(small_spec, play, p: int, m: int, v: int, head: bool):
    dp = 8 // p
    h_f, h_b = (HEAD_F, HEAD_B) if head else (0.0, 0.0)
    r = play(
        topology(),
        small_spec,
        TrainingConfig(global_batch=m * dp, micro_batch=1),
        ParallelConfig(tp=1, pp=p, dp=dp, schedule="interleaved", virtual_stages=v),
        op_time_overrides=_times(h_f, h_b),
        zero_communication=True,
    )
    stage_compute_s = m * (small_spec.num_layers // p) * (LAYER_F + LAYER_B)
    assert r.details["critical_rank"] == 0
    assert r.breakdown_s["compute"] == pytest.approx(stage_compute_s, rel=1e-9)
    textbook_s = (p - 1) / (v * m) * stage_compute_s
    assert r.breakdown_s["bubble"] == pytest.approx(textbook_s + m * (h_f + h_b), rel=1e-9)


@pytest.mark.parametrize("v", [2, 5])
def test_head_term_adds_linearly_with_communication(v: int) -> None:
    """On the shipped 13B TP x PP plan, network priced, the last stage's head work still adds
    m x its seconds to stage 0's bubble and to the step: taking the head's weight gradient out
    of every micro-batch (what ``defer_embedding_wgrad_compute`` moves to the flush) gives
    back exactly m w."""
    sc = load_scenario(SCENARIO, [f"parallel.virtual_stages={v}"])
    topo = sc.cluster.load()
    plan = build_plan(topo, sc.model, sc.training, sc.parallel)
    _, _, head, _ = block_times(plan, topo.device, {})
    full, deferred = (
        estimate_step(
            topo,
            sc.model,
            sc.training,
            sc.parallel,
            op_time_overrides={"head.backward": backward_s},
        )
        for backward_s in (head.backward_s, head.backward_s - head.wgrad_s)
    )
    m = full.details["num_microbatches"]
    assert head.wgrad_s > 0
    assert full.breakdown_s["pp_exposed"] > 0 and full.breakdown_s["tp_exposed"] > 0
    gain_s = m * head.wgrad_s
    assert full.breakdown_s["bubble"] - deferred.breakdown_s["bubble"] == pytest.approx(
        gain_s, rel=1e-9
    )
    assert full.step_time_s - deferred.step_time_s == pytest.approx(gain_s, rel=1e-9)
