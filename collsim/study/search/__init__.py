"""Plan search: enumerate parallel plans for a model on N GPUs, rank them, re-simulate the best.

``collsim search SCENARIO --gpus N`` keeps the scenario's model, cluster type, global batch
and optimizer, and varies the plan: tp, pp, dp, micro-batch size, pipeline schedule and
virtual stages, ZeRO stage, activation recompute and sequence parallelism, and where the space
asks cp, ep, etp, the MoE dispatcher and its overlap, the CP algorithm, the HSDP group and FP8
(their rules: :data:`REASONS`).

1. :func:`enumerate_plans` walks the grid and drops plans that cannot be built, counting why
   (``tp_heads``: heads or ffn not divisible by tp; ``tp_node``: tp larger than a node;
   ``pp_layers``: layers not divisible by pp x v; ``batch``: global batch not divisible by
   dp x micro-batch; ``interleaved_m``: Megatron's interleaving needs m divisible by pp;
   ``zero_pp``: ZeRO-2/3 with pipeline parallelism where the space leaves them out;
   ``zero2_pp``: ZeRO-2 with pipeline parallelism unless the space asks for it, since no stack
   runs it: DeepSpeed's pipeline engine refuses stage 2, Megatron-Core has no ZeRO-2).
2. Plans whose memory floor exceeds the GPU are dropped (``memory_bound``); the others are
   estimated by the closed form (:mod:`collsim.play.walk`) best-first by a floor on their step
   time, until no floor left can beat the best kept (``bound``); estimated plans whose memory
   exceeds the GPU's are counted as ``memory``. ``jobs`` processes estimate in parallel.
3. The best ``top_k`` by estimate are simulated with the discrete-event engine, which has the
   last word on step time and memory (a simulated plan that does not fit is ``memory (DES)``).

Nothing here prints; a callback reports progress.
"""

from __future__ import annotations

from collsim.study.search.frame import known_from_frame, search_frame
from collsim.study.search.loop import (
    DEFAULT_TOLERANCE_PCT,
    MINOR_KNOBS,
    Ranked,
    SearchResult,
    collapse,
    search_plans,
    shape_of,
)
from collsim.study.search.space import REASONS, Candidate, SearchSpace, enumerate_plans

__all__ = [
    "DEFAULT_TOLERANCE_PCT",
    "REASONS",
    "SearchSpace",
    "Candidate",
    "Ranked",
    "SearchResult",
    "enumerate_plans",
    "search_plans",
    "search_frame",
    "collapse",
    "shape_of",
    "MINOR_KNOBS",
    "known_from_frame",
]
