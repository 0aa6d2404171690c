"""Every rank simulated against one representative per stage, on MoE / CP / HSDP plans: with
every call in closed form the two play the same step; at the layer fidelity the all-ranks DES
moves each data-parallel call once per group (not once per dp stream of its members)."""

from __future__ import annotations

import warnings

import pytest

from collsim.cluster.topology import load_topology
from collsim.core.errors import CollsimWarning
from collsim.parallel.config import FSDPConfig, ParallelConfig, TrainingConfig
from collsim.play.engine import simulate_step
from collsim.workload import get_preset

PLANS = [
    dict(tp=2, cp=2, dp=2, ep=4, sequence_parallel=True, zero=1),
    dict(pp=2, dp=4, ep=4, zero=3, fsdp=FSDPConfig(shard_group_size=2)),
    dict(cp=4, dp=2, ep=2, zero=0),
    dict(cp=2, pp=2, dp=2, ep=2, zero=1),  # pipeline messages between same-cp ranks
]


@pytest.mark.parametrize("par", PLANS)
def test_all_ranks_play_the_representative_step(par: dict) -> None:
    spec = get_preset("qwen3-30b-a3b", num_layers=2, seq_len=1024)
    topo = load_topology("dgx_h100", nodes=1)
    training = TrainingConfig(global_batch=8, micro_batch=1)
    parallel = ParallelConfig(**par)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", CollsimWarning)
        rep = simulate_step(topo, spec, training, parallel, fidelity="fused")
        every = simulate_step(topo, spec, training, parallel, fidelity="fused", all_ranks=True)
        layer = simulate_step(topo, spec, training, parallel, fidelity="layer", all_ranks=True)
    assert every.step_time_s == pytest.approx(rep.step_time_s, rel=1e-9)
    assert every.breakdown_s == pytest.approx(rep.breakdown_s, rel=1e-9, abs=1e-12)
    # one node, nothing shared beyond what the representative's peers share: the DES step is
    # not slowed by duplicated data-parallel calls (it stays within 3 % of the fused step;
    # moving each dp x cp call once per dp stream made it 1.5 times slower)
    assert layer.step_time_s < 1.05 * rep.step_time_s
