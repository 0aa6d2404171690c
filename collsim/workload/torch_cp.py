"""torch's experimental context parallelism for SDPA as one rank runs it: the SDPA calls of
one layer (one per KV chunk), the log-sum-exp merges and gradient accumulations around them,
and the bytes of the keys and values it exchanges (docs/derivations.md, "torch context
parallelism"; pytorch ``torch/distributed/tensor/experimental/_context_parallel/_attention.py``
at 09b101c, ``_templated_ring_attention`` and ``_templated_ring_attention_backward``).
"""

from __future__ import annotations

from dataclasses import dataclass

from collsim.core.errors import ConfigError
from collsim.core.vocab import OpKind
from collsim.workload.op_records import FLOPS_PER_ELEMENT, Gemm, Op

__all__ = [
    "CAST_BYTES",
    "TORCH_CP_ALGORITHMS",
    "SdpaCall",
    "is_torch_cp",
    "sdpa_calls",
    "busiest_rank",
    "merge_bytes",
    "merge_kernels",
    "accumulate_bytes",
    "accumulate_kernels",
    "buffer_bytes",
    "kv_elements",
    "torch_cp_attention_ops",
]

TORCH_CP_ALGORITHMS = ("torch_allgather", "torch_alltoall")
"""``parallel.cp_algorithm`` values of torch's context parallelism, named after its rotate
methods (``set_rotate_method("allgather" | "alltoall")``; ``_RotateMethod.ALL_GATHER`` is the
default of ``_ContextParallelOptions`` and of torchtitan's
``parallelism.context_parallel_rotate_method``)."""

CAST_BYTES = 4
"""fp32 bytes of the merged output and of the K / V gradient accumulators: torch merges and
accumulates in float32 (``_ContextParallelOptions.convert_to_f32 = True``)."""


def is_torch_cp(algorithm: str) -> bool:
    """True for a ``cp_algorithm`` that is torch's context parallelism."""
    return str(algorithm) in TORCH_CP_ALGORITHMS


@dataclass(frozen=True, slots=True)
class SdpaCall:
    """One SDPA call of one CP step on one rank: ``q_tokens`` queries against ``k_tokens``
    keys, with or without the causal mask; ``partial`` when only the second half of the
    queries takes part (the merge then updates half of the output)."""

    q_tokens: int
    k_tokens: int
    causal: bool
    partial: bool = False


def busiest_rank(cp: int, *, load_balance: bool = True) -> int:
    """The CP rank whose layer takes longest: every rank computes the same FLOPs under load
    balancing, and rank cp - 1 runs the full-query calls (its merges update the whole output,
    the partial ones of lower ranks half of it plus a copy); without load balancing rank
    cp - 1 is the only one that computes every KV chunk."""
    if cp < 1:
        raise ConfigError(f"must be >= 1, got {cp}", key_path="parallel.cp")
    return cp - 1


def sdpa_calls(
    local_tokens: int, cp: int, *, rank: int | None = None, load_balance: bool = True
) -> list[SdpaCall]:
    """The SDPA calls of one rank in one layer, in the order the loop runs them (forward and
    backward alike), for ``local_tokens`` = s / cp queries and keys on the rank.

    Step 0 attends the rank's own keys with the causal mask. Step i > 0 holds the KV block of
    rank ``(rank - i) % cp``. With load balancing (each rank holds chunks r and 2 cp - 1 - r
    of 2 cp, torch's head-tail ``_HeadTailLoadBalancer``) every step i > 0 is one unmasked
    call on half the work: the whole query against the first half of the keys when i <= rank,
    else the second half of the queries against all the keys (``partial``). Without it, a
    block from a lower rank is attended in full and one from a higher rank is skipped
    (``_is_causal_behavior``).

    Example:
        >>> [(c.q_tokens, c.k_tokens, c.causal) for c in sdpa_calls(8, 2)]
        [(8, 8, True), (8, 4, False)]
    """
    if cp < 1:
        raise ConfigError(f"must be >= 1, got {cp}", key_path="parallel.cp")
    r = busiest_rank(cp, load_balance=load_balance) if rank is None else rank
    if not 0 <= r < cp:
        raise ConfigError(f"must be in [0, {cp}), got {r}", key_path="rank")
    if load_balance and local_tokens % 2:
        raise ConfigError(
            f"the {local_tokens} tokens of a CP rank must split in two chunks",
            key_path="parallel.cp_load_balance",
        )
    half = local_tokens // 2
    calls = [SdpaCall(local_tokens, local_tokens, True)]
    for i in range(1, cp):
        if load_balance:
            if i <= r:
                calls.append(SdpaCall(local_tokens, half, False))
            else:
                calls.append(SdpaCall(half, local_tokens, False, partial=True))
        elif (r - i) % cp < r:
            calls.append(SdpaCall(local_tokens, local_tokens, False))
    return calls


def kv_elements(
    *, micro_batch: int, tokens: int, heads: float, key_dim: int, value_dim: int
) -> float:
    """Elements of one rank's K and V for ``tokens`` tokens and ``heads`` heads."""
    return float(micro_batch * tokens * heads * (key_dim + value_dim))


def merge_bytes(
    step: int,
    call: SdpaCall,
    *,
    cp: int,
    out_elements: float,
    lse_elements: float,
    kv_elements_local: float,
    element_bytes: int,
) -> float:
    """HBM bytes of the forward work around SDPA call ``step`` (``_SDPAMerger.step`` and the
    loop of ``_templated_ring_attention``), eager, with O = ``out_elements`` and L =
    ``lse_elements`` on the rank and KV = ``kv_elements_local``::

        steps before the last: K, V concatenated to be sent on        KV 2e
        step 0:   out.to(fp32)                                        O (e + 4)
        step i:   block_out.to(fp32)                                  o (e + 4)
                  out - sigmoid(block_lse - lse) * (out - block_out)  o 32 + l 24
                  lse - logsigmoid(lse - block_lse)                   l 32
                  partial: torch.cat of the halves (out, lse)         O 8 + L 8
        last:     the merged output cast back (``results``)           O (4 + e)

    o, l the elements the call updates (O and L, or half of them when ``partial``); the lse
    comes from the kernel in fp32 (its ``.to`` is free)."""
    e = element_bytes
    total = kv_elements_local * 2 * e if step < cp - 1 else 0.0
    if step == 0:
        total += out_elements * (e + CAST_BYTES)
    else:
        share = 0.5 if call.partial else 1.0
        o, lse = out_elements * share, lse_elements * share
        total += o * (e + CAST_BYTES) + o * 32 + lse * 24 + lse * 32
        if call.partial:
            total += 8 * out_elements + 8 * lse_elements
    if step == cp - 1:
        total += out_elements * (CAST_BYTES + e)
    return total


def merge_kernels(step: int, call: SdpaCall, *, cp: int) -> int:
    """Eager kernels of :func:`merge_bytes`: the concatenation before the last step; one cast
    at step 0; a cast, five kernels for the output and three for the log-sum-exp at each
    later step, two copies when partial; the final cast."""
    n = 1 if step < cp - 1 else 0
    n += 1 if step == 0 else 9 + (2 if call.partial else 0)
    return n + (1 if step == cp - 1 else 0)


def accumulate_kernels(step: int, call: SdpaCall, *, cp: int, load_balance: bool = True) -> int:
    """Eager kernels of :func:`accumulate_bytes`: the K, V concatenation before the last step;
    at step 0 three zeroed accumulators and the dK, dV additions; later the additions (and the
    copy of the halves, one per tensor, when the call used half the keys); the fp32 dK, dV
    concatenation; the dQ addition (and its copy when partial); three casts at the last step."""
    n = 1 if step < cp - 1 else 0
    if step == 0:
        n += 3 + 2
    else:
        n += 4 if (load_balance and not call.partial) else 2
    n += 1 + (2 if call.partial else 1)
    return n + (3 if step == cp - 1 else 0)


def accumulate_bytes(
    step: int,
    call: SdpaCall,
    *,
    cp: int,
    q_elements: float,
    kv_elements_local: float,
    element_bytes: int,
    load_balance: bool = True,
) -> float:
    """HBM bytes of the backward work around SDPA backward call ``step``
    (``_templated_ring_attention_backward``), eager, with Q = ``q_elements`` and KV =
    ``kv_elements_local`` (the rank's K and V)::

        K, V concatenated to be sent on (steps before the last)        KV 2e
        step 0:  fp32 accumulators zeroed                             (Q + KV) 4
                 grad_key / grad_value += the call's dK, dV (16-bit)   KV (8 + e)
        step i:  the received dK, dV + this call's (half when the call
                 used half the keys), then torch.cat of the halves     kv (8 + e) + KV 8
        every:   dK, dV concatenated in fp32 to be sent on             KV 8
                 grad_query += dQ (half when ``partial``)               q (8 + e) [+ Q 8]
        last:    dQ and the received dK, dV cast to 16-bit             (Q + KV) (4 + e)
    """
    e = element_bytes
    q, kv = q_elements, kv_elements_local
    total = 0.0
    if step < cp - 1:
        total += kv * 2 * e
    if step == 0:
        total += (q + kv) * CAST_BYTES + kv * (8 + e)
    elif load_balance and not call.partial:
        total += kv / 2 * (8 + e) + kv * 8
    else:
        total += kv * (8 + e)
    total += kv * 8
    if call.partial:
        total += q / 2 * (8 + e) + q * 8
    else:
        total += q * (8 + e)
    if step == cp - 1:
        total += (q + kv) * (CAST_BYTES + e)
    return total


def torch_cp_attention_ops(
    *,
    micro_batch: int,
    local_tokens: int,
    cp: int,
    heads: int,
    key_dim: int,
    value_dim: int,
    element_bytes: int,
    load_balance: bool = True,
) -> list[Op]:
    """The core-attention ops of one layer on the busiest CP rank under torch's context
    parallelism: per step a fused-attention op (``flash_attention`` at step 0, causal;
    ``cp_attention`` after it, one SDPA call each on its own KV chunk, unmasked) followed by
    its ``cp_lse_merge`` (forward: :func:`merge_bytes`; backward: :func:`accumulate_bytes`).

    K and V carry all ``heads`` query heads of the rank: torchtitan repeats the KV heads
    before SDPA (``repeat_kv``, torchtitan/models/llama3/model/model.py at 018740b), so the
    chunks torch exchanges and attends have that many heads."""
    b, e = micro_batch, element_bytes
    calls = sdpa_calls(local_tokens, cp, load_balance=load_balance)
    q_el = float(b * local_tokens * heads * key_dim)
    out_el = float(b * local_tokens * heads * value_dim)
    lse_el = float(b * local_tokens * heads)
    kv = kv_elements(
        micro_batch=b, tokens=local_tokens, heads=heads, key_dim=key_dim, value_dim=value_dim
    )
    ops: list[Op] = []
    for i, call in enumerate(calls):
        keys = call.k_tokens * (0.5 if call.causal else 1.0)
        flops = 2.0 * b * heads * call.q_tokens * keys * (key_dim + value_dim)
        q = float(b * call.q_tokens * heads * key_dim)
        k = float(b * call.k_tokens * heads * key_dim)
        v = float(b * call.k_tokens * heads * value_dim)
        o = float(b * call.q_tokens * heads * value_dim)
        lse = 4.0 * b * heads * call.q_tokens
        saved: dict[str, float] = {}
        if i == 0:  # the op's inputs and output statistics, kept once for the whole loop
            saved = {
                "q": e * q_el,
                "k": e * kv * key_dim / (key_dim + value_dim),
                "v": e * kv * value_dim / (key_dim + value_dim),
                "flash_attention.lse": 4.0 * lse_el,
            }
        ops.append(
            Op(
                name="flash_attention" if i == 0 else "cp_attention",
                kind=OpKind.FUSED_ATTENTION,
                flops=flops,
                size_bytes=e * (q + k + v + o) + lse,
                backward_flops=2.5 * flops,
                backward_bytes=e * (2 * q + 2 * k + 2 * v + 2 * o) + lse,
                gemms=(Gemm(call.q_tokens, call.k_tokens, key_dim, b * heads),),
                saved=saved,
                causal=call.causal,
            )
        )
        fwd = merge_bytes(
            i,
            call,
            cp=cp,
            out_elements=out_el,
            lse_elements=lse_el,
            kv_elements_local=kv,
            element_bytes=e,
        )
        bwd = accumulate_bytes(
            i,
            call,
            cp=cp,
            q_elements=q_el,
            kv_elements_local=kv,
            element_bytes=e,
            load_balance=load_balance,
        )
        merged = call.q_tokens * b * heads * value_dim
        ops.append(
            Op(
                name="cp_lse_merge",
                kind=OpKind.ELEMENTWISE,
                flops=FLOPS_PER_ELEMENT["add"] * 4 * merged if i else 0.0,
                size_bytes=fwd,
                backward_flops=FLOPS_PER_ELEMENT["add"] * (q_el + kv),
                backward_bytes=bwd,
                kernels=merge_kernels(i, call, cp=cp),
                backward_kernels=accumulate_kernels(i, call, cp=cp, load_balance=load_balance),
            )
        )
    return ops


def _ring_elements(step: int, cp: int, kv: float, *, gather: bool) -> float:
    """K, V elements the exchange holds beside the rank's own at ``step``: all-gather, the
    gathered buffer of all cp blocks (``_AllGatherRotater._aggregated_buffer``, kept until
    the loop returns) and at step 0 the concatenated local block handed to it; all-to-all,
    the block attended (received at the step before), the concatenation sent on and the
    block being received (``_AllToAllRotater``, ``ft_c.permute_tensor``)."""
    if gather:
        return cp * kv + (kv if step == 0 else 0.0)
    held = kv if step > 0 else 0.0
    return held + (2 * kv if step < cp - 1 else 0.0)


def buffer_bytes(
    *,
    micro_batch: int,
    local_tokens: int,
    cp: int,
    heads: int,
    key_dim: int,
    value_dim: int,
    element_bytes: int,
    algorithm: str,
    load_balance: bool = True,
    rank: int | None = None,
) -> tuple[float, float]:
    """Peak bytes the attention of one layer holds on CP rank ``rank`` (None: the busiest,
    :func:`busiest_rank`) beyond its inputs
    and kept outputs, in forward and in backward (eager, ``convert_to_f32``; the largest over
    the loop's steps of the sums below; docs/memory.md, "torch context parallelism").

    None of it outlives the call: autograd saves the rank's own Q, K, V, the merged output
    and log-sum-exp (the inputs and outputs of the aten SDPA op that the ring implements),
    and backward exchanges K and V again. With E the element bytes, KV the rank's K and V
    elements, O, L, Q its output, log-sum-exp and query elements, o, l, q, kv those of the
    step's call::

        forward step i:   ring(i) E + SDPA out o E + lse l 4 + merge
          merge, step 0:  the fp32 copy of the output                    O 4
          merge, i > 0:   merged O, L in fp32 (O + L) 4, fp32 block out o 4,
                          out - block_out times the weight, the new out   o 8
                          (partial: the merged output concatenated anew   + O 4)
        backward step i:  ring(i) E + fp32 dQ accumulator Q 4 + the call's dq, dk, dv
                          (q + kv) E + fp32 dK, dV: the received (or zeroed) accumulator
                          and the concatenation sent on, KV 8, and when the call used half
                          the keys the accumulator rebuilt by ``torch.cat`` (+ KV 4);
                          partial: the dQ accumulator rebuilt by ``torch.cat`` (+ Q 4)

    ring(i) is :func:`_ring_elements` (all-gather: cp KV, K and V of every head, as
    torchtitan's ``repeat_kv`` hands them to SDPA)."""
    if algorithm not in TORCH_CP_ALGORITHMS:
        raise ConfigError(
            f"must be one of {', '.join(TORCH_CP_ALGORITHMS)}, got {algorithm!r}",
            key_path="parallel.cp_algorithm",
        )
    e, f, b = element_bytes, CAST_BYTES, micro_batch
    gather = algorithm == "torch_allgather"
    calls = sdpa_calls(local_tokens, cp, rank=rank, load_balance=load_balance)
    kv_all = kv_elements(
        micro_batch=b, tokens=local_tokens, heads=heads, key_dim=key_dim, value_dim=value_dim
    )
    q_all = float(b * local_tokens * heads * key_dim)
    o_all = float(b * local_tokens * heads * value_dim)
    l_all = float(b * local_tokens * heads)
    forward, backward = 0.0, 0.0
    for i, call in enumerate(calls):
        ring = _ring_elements(i, cp, kv_all, gather=gather) * e
        o = float(b * call.q_tokens * heads * value_dim)
        lse = float(b * call.q_tokens * heads)
        if i == 0:
            merge = o_all * f
        else:
            merge = (o_all + l_all) * f + o * f + o * 2 * f
            if call.partial:
                merge += o_all * f
        forward = max(forward, ring + o * e + lse * f + merge)
        q = float(b * call.q_tokens * heads * key_dim)
        kv = kv_elements(
            micro_batch=b, tokens=call.k_tokens, heads=heads, key_dim=key_dim, value_dim=value_dim
        )
        halves = i > 0 and load_balance and not call.partial
        dkv = kv_all * 2 * f + (kv_all * f if halves else 0.0)
        dq = q_all * f * (2 if call.partial else 1)
        backward = max(backward, ring + dq + (q + kv) * e + dkv)
    return forward, backward
