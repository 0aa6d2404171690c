"""The measured step's model and configuration: :class:`StepConfig` (the model, the batch, how
long to time, the modes), the collsim spec of the small GPT that ``collsim validate step`` times
(:func:`model_spec`) and the same model in torch (:func:`build_gpt`, initialised as GPT-2 is),
and each rank's batch (:func:`rank_batch`); :mod:`collsim.validate.measure.step` times it.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

from collsim.workload.model import TransformerSpec

__all__ = [
    "StepConfig",
    "model_spec",
    "build_gpt",
    "init_like_gpt2",
    "rank_batch",
    "GPT2_INIT_STD",
    "MODES",
    "LOCAL",
    "STRAGGLER_SUFFIX",
    "EXTRA_SUFFIX",
]

#: The name of the no-communication step timed beside the modes.
LOCAL = "local"


#: Suffix of a mode timed with one rank slowed on purpose (``ddp_b25+straggler``).
STRAGGLER_SUFFIX = "+straggler"


#: Column of the slowed rank's extra seconds in a straggler mode (``ddp_b25+straggler.extra``).
EXTRA_SUFFIX = ".extra"


#: Modes of a measured step: DDP with a bucket size in MB, or the FSDP sketch.
MODES = ("ddp_b1", "ddp_b25", "fsdp")


@dataclass(frozen=True, slots=True, kw_only=True)
class StepConfig:
    """The model, the batch and how long to time."""

    num_layers: int = 4
    hidden: int = 256
    num_heads: int = 4
    ffn_hidden: int = 1024
    seq_len: int = 32
    vocab: int = 1024
    micro_batch: int = 2
    """Sequences per rank per step."""
    iters: int = 10
    warmup: int = 3
    modes: tuple[str, ...] = MODES
    lr: float = 1e-3
    seed: int = 0
    straggler_rank: int | None = None
    """A rank slowed on purpose in the ``<ddp mode>+straggler`` modes (None: none timed)."""
    straggler_repeat: int = 2
    """The slowed rank runs its compute this many times (clock factor 1 / repeat)."""
    straggler_delay_s: float = 0.0
    """If > 0: the slowed rank instead spins on the wall clock for this long before its step
    (a busy loop of known duration, whatever share of the cores it gets)."""
    progress_path: str | None = None
    """Each rank appends its per-iteration timings to ``<path>.rank<r>.jsonl`` as taken."""
    profile_dir: str | None = None
    """After the timed iterations, each rank traces ``trace_steps`` more steps of every mode
    with the torch profiler (CPU activities, input shapes) into
    ``<dir>/n<world size>_<mode>_rank<r>.json.gz``
    (:func:`collsim.validate.measure.step_trace.trace_modes`)."""
    trace_steps: int = 3

    def __post_init__(self) -> None:
        for mode in self.modes:
            if mode != "fsdp" and not (mode.startswith("ddp_b") and mode[5:].isdigit()):
                raise ValueError(f"unknown mode {mode!r}: ddp_b<MB> or fsdp")
        if self.straggler_rank is not None and self.straggler_rank < 0:
            raise ValueError(f"straggler_rank must be >= 0, got {self.straggler_rank}")
        if self.straggler_delay_s < 0:
            raise ValueError(f"straggler_delay_s must be >= 0, got {self.straggler_delay_s}")
        if self.straggler_repeat < 2:
            raise ValueError(f"straggler_repeat must be >= 2, got {self.straggler_repeat}")
        if self.trace_steps < 1:
            raise ValueError(f"trace_steps must be >= 1, got {self.trace_steps}")

    @property
    def straggler_modes(self) -> tuple[str, ...]:
        """The modes timed with the straggler (every DDP mode, when a rank is named)."""
        if self.straggler_rank is None:
            return ()
        return tuple(m + STRAGGLER_SUFFIX for m in self.modes if m.startswith("ddp"))


def model_spec(cfg: StepConfig) -> Any:
    """The collsim spec of the measured model."""

    return TransformerSpec(
        name="validate-gpt",
        num_layers=cfg.num_layers,
        hidden=cfg.hidden,
        num_heads=cfg.num_heads,
        ffn_hidden=cfg.ffn_hidden,
        seq_len=cfg.seq_len,
        vocab=cfg.vocab,
        dropout=False,
    )


def build_gpt(torch: Any, cfg: StepConfig) -> Any:
    """The torch model of :func:`model_spec` (parameters registered in collsim's order)."""
    nn = torch.nn
    # torch is passed in (imported lazily, so collsim loads without it): its Module is Any
    module: Any = nn.Module
    F = torch.nn.functional
    h, heads = cfg.hidden, cfg.num_heads

    class Block(module):  # type: ignore[misc]  # subclassing Any (see above)
        def __init__(self) -> None:
            super().__init__()
            self.ln1 = nn.LayerNorm(h)
            self.qkv = nn.Linear(h, 3 * h)
            self.proj = nn.Linear(h, h)
            self.ln2 = nn.LayerNorm(h)
            self.fc1 = nn.Linear(h, cfg.ffn_hidden)
            self.fc2 = nn.Linear(cfg.ffn_hidden, h)

        def forward(self, x: Any) -> Any:
            b, s, _ = x.shape
            q, k, v = self.qkv(self.ln1(x)).split(h, dim=2)
            q, k, v = (t.view(b, s, heads, h // heads).transpose(1, 2) for t in (q, k, v))
            att = F.scaled_dot_product_attention(q, k, v, is_causal=True)
            x = x + self.proj(att.transpose(1, 2).reshape(b, s, h))
            return x + self.fc2(F.gelu(self.fc1(self.ln2(x))))

    class GPT(module):  # type: ignore[misc]  # subclassing Any (see above)
        def __init__(self) -> None:
            super().__init__()
            self.tok = nn.Embedding(cfg.vocab, h)
            self.pos = nn.Embedding(cfg.seq_len, h)
            self.blocks = nn.ModuleList(Block() for _ in range(cfg.num_layers))
            self.ln_f = nn.LayerNorm(h)
            init_like_gpt2(torch, self, cfg.num_layers)

        def embed(self, idx: Any) -> Any:
            return self.tok(idx) + self.pos(torch.arange(idx.shape[1], device=idx.device))

        def head_loss(self, x: Any, targets: Any) -> Any:
            logits = self.ln_f(x) @ self.tok.weight.t()  # tied LM head
            return F.cross_entropy(logits.reshape(-1, cfg.vocab), targets.reshape(-1))

        def forward(self, idx: Any, targets: Any) -> Any:
            x = self.embed(idx)
            for block in self.blocks:
                x = block(x)
            return self.head_loss(x, targets)

    return GPT()


#: Standard deviation of GPT-2's initial weights (Radford et al. 2019, as in nanoGPT's
#: ``_init_weights`` and Megatron-LM's ``--init-method-std`` default).
GPT2_INIT_STD = 0.02


def init_like_gpt2(torch: Any, model: Any, num_layers: int) -> None:
    """GPT-2's initialisation: linear and embedding weights N(0, 0.02), biases zero, the
    projections that end on the residual stream (attention output, MLP down) N(0, 0.02 /
    sqrt(2 x layers)); LayerNorms keep (1, 0).

    With PyTorch's module defaults instead (embeddings N(0, 1)), the tied LM head gives logits
    of standard deviation sqrt(hidden) = 16 at hidden 256: the first loss is ~168 where
    ln(vocab) = 6.9 is expected, and the softmax's exponentials underflow to subnormal floats.
    An x86 core takes a microcode assist for each subnormal operand or result, so the step's
    time then depends on how far training has gone (the step times with and without are in
    docs/derivations.md, measurements, and validate/README.md). No real training starts
    there, and neither the compute model nor a GPU sees that effect.
    """
    residual = GPT2_INIT_STD / math.sqrt(2 * num_layers)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith(".bias"):
                param.zero_()
            elif name.endswith(("proj.weight", "fc2.weight")):
                param.normal_(0.0, residual)
            elif name.endswith(".weight") and param.dim() == 2:
                param.normal_(0.0, GPT2_INIT_STD)


def rank_batch(torch: Any, cfg: StepConfig, rank: int, device: str = "cpu") -> tuple[Any, Any]:
    gen = torch.Generator().manual_seed(cfg.seed * 7919 + rank)
    idx = torch.randint(cfg.vocab, (cfg.micro_batch, cfg.seq_len), generator=gen)
    return idx.to(device), torch.roll(idx, -1, dims=1).to(device)
