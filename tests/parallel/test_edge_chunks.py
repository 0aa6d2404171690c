"""Pipelines whose first chunk holds only the embedding and whose last chunk holds only the
head and loss (Llama 3 405B on PP 16 x V 8; Megatron-LM's account-for-embedding and
account-for-loss split): both fidelities run them alike, the empty chunks keep their own
work, and a middle chunk without a layer is refused in one line."""

from __future__ import annotations

import dataclasses
import warnings
from pathlib import Path

import pytest
from click.testing import CliRunner

from collsim.cli import cli
from collsim.cluster.topology import load_topology
from collsim.core.errors import CollsimWarning, ConfigError
from collsim.parallel.config import ParallelConfig, TrainingConfig
from collsim.play.engine import simulate_step
from collsim.play.walk import estimate_step
from collsim.step.build import build_schedule
from collsim.workload.memory import balanced_chunk_layers
from collsim.workload.model import TransformerSpec

TINY = TransformerSpec(
    name="tiny", num_layers=6, hidden=512, num_heads=8, ffn_hidden=2048, seq_len=256, vocab=4096
)
TRAINING = TrainingConfig(global_batch=16, micro_batch=1)
# pp 2 x v 2 = 4 parts: the embedding alone, 3 layers, 3 layers, the head and loss alone
EXPLICIT = ParallelConfig(
    tp=2, pp=2, dp=4, schedule="interleaved", virtual_stages=2, layers_per_stage=(0, 3, 3, 0)
)
# 2 layers + embedding + loss = 4 parts of one layer each
BALANCED = ParallelConfig(
    tp=2,
    pp=2,
    dp=4,
    schedule="interleaved",
    virtual_stages=2,
    account_for_embedding=True,
    account_for_loss=True,
)
TWO_LAYERS = TransformerSpec(
    name="tiny2", num_layers=2, hidden=512, num_heads=8, ffn_hidden=2048, seq_len=256, vocab=4096
)


@pytest.fixture(scope="module")
def h100x16():  # type: ignore[no-untyped-def]
    return load_topology("dgx_h100", nodes=2)


def test_balanced_split_empties_only_the_edge_chunks() -> None:
    # 126 layers on 16 x 8 chunks, the embedding and the loss counted as a layer each
    llama = balanced_chunk_layers(126, 128, first_offset=1.0, last_offset=1.0)
    assert llama[0] == llama[-1] == 0
    assert llama[1:-1] == [1] * 126
    assert balanced_chunk_layers(2, 4, first_offset=1.0, last_offset=1.0) == [0, 1, 1, 0]
    # only the loss counted: the last chunk may be empty, the first may not
    assert balanced_chunk_layers(3, 4, last_offset=1.0) == [1, 1, 1, 0]
    with pytest.raises(ConfigError, match="pp x virtual_stages"):
        balanced_chunk_layers(2, 4, last_offset=1.0)


@pytest.mark.parametrize(
    ("spec", "parallel", "first", "last"),
    [(TINY, EXPLICIT, [], []), (TWO_LAYERS, BALANCED, [], [])],
)
def test_edge_chunks_hold_their_own_ops(h100x16, spec, parallel, first, last) -> None:  # type: ignore[no-untyped-def]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", CollsimWarning)
        schedule = build_schedule(h100x16, spec, TRAINING, parallel)
    emb = schedule.stages[0].chunks[0]
    head = schedule.stages[1].chunks[1]
    assert list(emb.layers) == first and list(head.layers) == last
    # hand count: the embedding chunk runs the lookup and, with tp 2, one collective on its
    # output forward, its backward scatter backward; the head chunk its one head segment
    # each way; neither runs a layer segment
    assert [s.key for s in emb.forward] == ["embedding"]
    assert [s.key for s in emb.backward] == ["embedding"]
    assert [s.key for s in head.forward] == ["head"]
    assert [s.key for s in head.backward] == ["head"]
    (emb_f,) = emb.forward
    ops = [st.op for st in emb_f.steps]
    assert ops == ["", "reduce_scatter" if parallel.sequence_parallel else "all_reduce"]
    assert emb_f.compute_s > 0 and head.forward[0].compute_s > 0
    assert emb.backward[0].compute_s > 0 and head.backward[0].compute_s > 0
    # their parameters stay on them (the embedding table; the head, as it is untied)
    assert emb.tensors and head.tensors
    # every micro-batch still passes through them: 8 forward + 8 backward ops per chunk
    for stage, chunk in ((0, 0), (1, 1)):
        ops_of = [op for op in schedule.pipeline[stage] if op.chunk == chunk]
        assert len(ops_of) == 2 * schedule.plan.num_microbatches


@pytest.mark.parametrize(
    ("spec", "parallel"),
    [
        (TINY, EXPLICIT),
        (TWO_LAYERS, BALANCED),
        (TINY, dataclasses.replace(EXPLICIT, zero=3)),
        (TINY, dataclasses.replace(EXPLICIT, zero=1)),
    ],
)
def test_both_fidelities_agree_on_edge_chunks(h100x16, spec, parallel) -> None:  # type: ignore[no-untyped-def]
    # the event engine with closed-form collectives against the walk; the flow-level
    # ("layer") engine may differ where a DP bucket and a pipeline all-gather share NVLink
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", CollsimWarning)
        closed = estimate_step(h100x16, spec, TRAINING, parallel)
        engine = simulate_step(h100x16, spec, TRAINING, parallel, fidelity="fused")
    assert engine.step_time_s == pytest.approx(closed.step_time_s, rel=1e-9)
    assert engine.memory_peak_bytes == pytest.approx(closed.memory_peak_bytes, rel=1e-9)
    assert closed.step_time_s > 0
    # the empty chunks still send and receive: per micro-batch a stage sends 2 activations
    # forward and 1 gradient backward (stage 0: parts 0 and 2 forward, part 2 backward;
    # stage 1: part 1 forward, parts 1 and 3 backward), 4 micro-batches
    for result in (closed, engine):
        (p2p,) = [c for c in result.collectives if c.op == "send_recv"]
        assert p2p.count == 3 * 4


def test_empty_edge_chunks_move_the_step(h100x16) -> None:  # type: ignore[no-untyped-def]
    # the same 6 layers as (1, 2, 2, 1): emptying the edges puts 3 layers on the two middle
    # chunks instead, and the step changes (the edge chunks' work is not dropped either way)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", CollsimWarning)
        edge = estimate_step(h100x16, TINY, TRAINING, EXPLICIT)
        spread = estimate_step(
            h100x16,
            TINY,
            TRAINING,
            ParallelConfig(
                tp=2,
                pp=2,
                dp=4,
                schedule="interleaved",
                virtual_stages=2,
                layers_per_stage=(1, 2, 2, 1),
            ),
        )
    assert edge.step_time_s != spread.step_time_s


@pytest.mark.parametrize("layers", [(3, 0, 3, 0), (0, 3, 0, 3), (0, 0, 0, 0)])
def test_an_empty_middle_chunk_is_refused(layers: tuple[int, ...]) -> None:
    with pytest.raises(ConfigError, match="only the first part"):
        ParallelConfig(pp=2, virtual_stages=2, schedule="interleaved", layers_per_stage=layers)


def test_cli_refuses_an_empty_middle_chunk_in_one_line() -> None:
    scenario = Path(__file__).resolve().parents[2] / "scenarios" / "pipeline_13b_interleaved.yaml"
    res = CliRunner().invoke(
        cli,
        [
            "run",
            str(scenario),
            "--fidelity",
            "closed",
            "--set",
            "parallel.layers_per_stage=[5,0,5,5,5,5,5,10]",
        ],
    )
    errors = [line for line in res.stderr.splitlines() if not line.startswith("warning: ")]
    assert res.exit_code == 2 and len(errors) == 1, res.output
    assert "parallel.layers_per_stage" in errors[0] and "part 1" in errors[0]


@pytest.mark.parametrize("name", ["cp_llama3_405b_h100_16384", "cp_llama3_405b_h100_16384_8k"])
def test_llama3_plans_put_the_embedding_and_the_loss_alone(name: str) -> None:
    from collsim.parallel.plan import build_plan
    from collsim.study.job import scenario_topology
    from collsim.study.scenario import load_scenario

    root = Path(__file__).resolve().parents[2]
    scenario = load_scenario(root / "scenarios" / "published" / f"{name}.yaml")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", CollsimWarning)
        plan = build_plan(
            scenario_topology(scenario), scenario.model, scenario.training, scenario.parallel
        )
    assert (plan.pp, plan.virtual_stages) == (16, 8)
    assert list(plan.chunk_layers(0, 0)) == [] and list(plan.chunk_layers(15, 7)) == []
    assert [len(plan.stage_layers(s)) for s in range(16)] == [7] + [8] * 14 + [7]


def test_search_offers_the_edge_chunk_split() -> None:
    from collsim.study.search.space import enumerate_plans

    # 6 layers + the embedding + the loss = 8 chunks on pp 2 x v 4, which build_plan takes;
    # without the account-for flags 6 layers do not divide 8 chunks
    flags = ParallelConfig(account_for_embedding=True, account_for_loss=True)
    kept = {
        (c.pp, c.schedule, c.virtual_stages)
        for c in enumerate_plans(TINY, 16, 8, 16, base=flags, training=TRAINING)
    }
    plain = {
        (c.pp, c.schedule, c.virtual_stages)
        for c in enumerate_plans(TINY, 16, 8, 16, training=TRAINING)
    }
    assert (2, "interleaved", 4) in kept
    assert (2, "interleaved", 4) not in plain


def test_search_bounds_hold_for_edge_chunk_plans(h100x16) -> None:  # type: ignore[no-untyped-def]
    # branch and bound against estimating every plan: the floors stay below the walk's
    # figures when the embedding's and the loss's chunks hold no layer
    from collsim.study.search.candidate import SearchSpace
    from collsim.study.search.loop import search_plans

    training = TrainingConfig(global_batch=64, micro_batch=1)
    space = SearchSpace(
        bucket_mbs=(25.0,),
        overlaps=(True,),
        bucket_views=(False,),
        prefetches=(1,),
        offloads=(False,),
        reshards=(True,),
    )
    base = ParallelConfig(dp=16, account_for_embedding=True, account_for_loss=True)
    args = (h100x16, TINY, training, base)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", CollsimWarning)
        pruned = search_plans(*args, space=space, top_k=0, prune_keep=10)
        full = search_plans(*args, space=space, top_k=0, prune_keep=0)
    edge = [r for r in full.ranked if (r.candidate.pp * r.candidate.virtual_stages) == 8]
    assert edge  # plans with an embedding-only and a loss-only chunk were estimated
    best = [(r.candidate, r.estimate.step_time_s) for r in full.ranked[:10]]
    assert [(r.candidate, r.estimate.step_time_s) for r in pruned.ranked[:10]] == best


def test_a_split_balanced_with_the_embedding_and_loss_is_not_uneven(h100x16) -> None:  # type: ignore[no-untyped-def]
    from collsim.parallel.describe import describe_mapping
    from collsim.parallel.plan import build_plan

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always", CollsimWarning)
        plan = build_plan(h100x16, TWO_LAYERS, TRAINING, BALANCED)  # 0, 1, 1, 0 + the two
    assert not [w for w in caught if "uneven" in str(w.message)]
    # a chunk of one layer reads as that layer, an empty one as none
    assert "stage 0: layers none, 1;" in describe_mapping(plan)
    assert "stage 1: layers 0, none;" in describe_mapping(plan)
    # the same counts without the embedding and loss counted are uneven
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always", CollsimWarning)
        build_plan(
            h100x16, TINY, TRAINING, dataclasses.replace(EXPLICIT, layers_per_stage=(1, 2, 2, 1))
        )
    assert [w for w in caught if "uneven pipeline split: [1, 2, 2, 1]" in str(w.message)]
