"""Step-level validation: a tiny GPT measured on 2 gloo ranks and simulated."""

from __future__ import annotations

import pytest

from collsim.validate.measure.step_model import StepConfig, model_spec


def test_model_spec_matches_the_torch_model_size() -> None:
    torch = pytest.importorskip("torch")
    from collsim.validate.measure.step_model import build_gpt

    cfg = StepConfig(num_layers=2, hidden=64, ffn_hidden=256, vocab=128, seq_len=16)
    model = build_gpt(torch, cfg)
    assert sum(p.numel() for p in model.parameters()) == model_spec(cfg).num_parameters()


def test_bad_mode() -> None:
    with pytest.raises(ValueError, match="unknown mode"):
        StepConfig(modes=("zero2",))


@pytest.mark.torch
def test_step_measured_and_simulated(tmp_path) -> None:
    from collsim.cluster.topology import load_topology
    from collsim.play.engine.step import BLOCK_OVERRIDE_KEYS
    from collsim.validate.check.step import simulate_modes
    from collsim.validate.measure.step import run_step

    cfg = StepConfig(
        num_layers=2, hidden=64, ffn_hidden=256, vocab=256, seq_len=16, iters=2, warmup=1
    )
    report, _ = run_step(cfg, world_size=2, timeout_s=120)
    # the harness runs whole backwards (no split-backward schedule), so the weight-gradient
    # parts of the split schedules are not timed apart
    split_only = {"layer.wgrad", "head.wgrad"}
    assert set(report["profile"]) == set(BLOCK_OVERRIDE_KEYS) - {"layer.recompute"} - split_only
    assert all(v > 0 for v in report["profile"].values())
    modes = report["modes"]
    assert set(modes) == {"ddp_b1", "ddp_b25", "fsdp"}
    assert all(len(m["times_s"]) == 2 and m["median_s"] > 0 for m in modes.values())
    # ~0.11 M parameters = 0.44 MB of fp32 gradients: one bucket either way, as torch builds it.
    assert isinstance(modes["ddp_b1"]["buckets"], int)  # obtained, not "unknown"
    assert modes["ddp_b1"]["buckets"] >= modes["ddp_b25"]["buckets"] >= 1
    # The whole step without communication is timed like the modes, and sets the scale.
    assert report["local_step_s"] >= report["local_step_min_s"] > 0
    assert report["compute_scale"] == pytest.approx(
        report["local_step_s"] / report["profile_sum_s"], rel=1e-12
    )
    topo = load_topology("localhost", gpus_per_node=2)
    sim = simulate_modes(report, topo)
    raw = simulate_modes(report, topo, scale_compute=False)
    for mode in modes:
        # The simulated step is at least the (scaled) compute; communication adds to it.
        assert sim[mode].step_time_s >= report["local_step_s"] * 0.999
        assert raw[mode].step_time_s >= report["profile_sum_s"] * 0.999
        assert sim[mode].num_collectives >= 1
        # Scaling multiplies the compute and optimizer parts by compute_scale exactly.
        for part in ("compute", "optimizer"):
            assert sim[mode].breakdown_s[part] == pytest.approx(
                raw[mode].breakdown_s[part] * report["compute_scale"], rel=1e-9
            )


@pytest.mark.parametrize(
    "report, busy",
    [
        ({"backend": "gloo", "world_size": 2, "cpu_count": 2, "threads_per_rank": 1}, True),
        ({"backend": "gloo", "world_size": 2, "cpu_count": 8, "threads_per_rank": 1}, False),
        (
            {
                "backend": "gloo",
                "world_size": 4,
                "local_world_size": 2,
                "cpu_count": 4,
                "threads_per_rank": 2,
            },
            True,
        ),  # 2 ranks x 2 threads
        ({"backend": "nccl", "world_size": 8, "cpu_count": 2, "threads_per_rank": 1}, False),
    ],
    ids=["2-on-2", "2-on-8", "2x2-on-4", "gpu"],
)
def test_cores_busy(report: dict, busy: bool) -> None:
    from collsim.validate.check.step import cores_busy

    assert cores_busy(report) is busy


@pytest.mark.torch
def test_ddp_bucket_count_follows_the_cap() -> None:
    """torch 2.13 gives the count: 3 MiB of gradients are 1 bucket at 25 MB, >= 3 at 1 MB."""
    import sys
    from pathlib import Path

    from collsim.validate.measure.launch import spawn_ranks

    sys.path.insert(0, str(Path(__file__).parent))
    import helpers_ranks

    big, small = spawn_ranks(helpers_ranks.ddp_buckets, 1, args=((25.0, 1.0),), timeout_s=60)[0]
    assert big == 1
    assert small is not None and small >= 3


def test_ddp_bucket_count_without_the_private_accessor() -> None:
    from types import SimpleNamespace

    from collsim.validate.measure.step import ddp_bucket_count

    assert ddp_bucket_count(SimpleNamespace())[0] is None
    count, reason = ddp_bucket_count(SimpleNamespace(reducer=SimpleNamespace()))
    assert count is None and "_get_zeros_like_grad_buckets" in reason
    fake = SimpleNamespace(reducer=SimpleNamespace(_get_zeros_like_grad_buckets=lambda: [1, 2]))
    assert ddp_bucket_count(fake) == (2, "")


def test_the_model_starts_from_gpt2_initialisation() -> None:
    """The measured model starts as GPT-2 does: first loss ~ ln(vocab), not PyTorch's module
    defaults (embeddings N(0, 1): logits of std sqrt(hidden) through the tied head, a first
    loss of ~170 and subnormal softmax terms whose x86 microcode assists made the step's time
    depend on how far training had gone)."""
    import math

    torch = pytest.importorskip("torch")
    from collsim.validate.measure.step_model import GPT2_INIT_STD, build_gpt, rank_batch

    cfg = StepConfig()
    torch.manual_seed(0)
    model = build_gpt(torch, cfg)
    idx, targets = rank_batch(torch, cfg, 0)
    with torch.no_grad():
        loss = float(model(idx, targets))
    assert abs(loss - math.log(cfg.vocab)) < 0.1, loss
    params = {name: p.detach() for name, p in model.named_parameters()}
    assert float(params["tok.weight"].std()) == pytest.approx(GPT2_INIT_STD, rel=0.05)
    residual = GPT2_INIT_STD / math.sqrt(2 * cfg.num_layers)
    assert float(params["blocks.0.fc2.weight"].std()) == pytest.approx(residual, rel=0.05)
    assert float(params["blocks.0.qkv.bias"].abs().max()) == 0.0
    assert float(params["blocks.0.ln1.weight"].min()) == 1.0  # LayerNorms keep (1, 0)
