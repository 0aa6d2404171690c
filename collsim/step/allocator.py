"""The caching allocator replayed over one rank's step: the memory PyTorch's allocator
(:mod:`collsim.step.caching_allocator`) reserves beside what is allocated, as
``torch.cuda.max_memory_reserved`` reports it, and whether the step fits. Each free of the
step program is paired with the allocations it releases, and torch's cuBLAS workspaces and
the LM head's logits are added to the program's tensors; which stack launches torch with
``expandable_segments:True``; what the allocator may hold on a device. The pairing rules, the
added tensors with their sources and what the replay still misses are in docs/memory.md.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Any

import numpy as np

from collsim.cluster.hardware import CUDA_CONTEXT_BYTES, NCCL_BUFFER_BYTES
from collsim.step.caching_allocator import AllocatorOOM, Block, CachingAllocator
from collsim.step.memory import numbered_patterns
from collsim.step.replay_events import pattern_digest, recording_digest, replay_events
from collsim.step.replay_period import MICROBATCH_AT, Steady, find_period
from collsim.workload.op_records import activation_element_bytes
from collsim.workload.ops import head_ops

if TYPE_CHECKING:
    from collsim.step.shapes import ShapeCache

__all__ = [
    "CUBLAS_HANDLES_PER_RANK",
    "CUBLAS_WORKSPACE_BYTES_BY_GENERATION",
    "CUBLAS_WORKSPACE_BYTES_DEFAULT",
    "NEAR_LIMIT_SHARE",
    "REPLAYS_KEPT",
    "EXPANDABLE_SEGMENTS_BY_STACK",
    "ReservedMemory",
    "activation_tensors",
    "allocator_limit_bytes",
    "cublas_workspaces",
    "expandable_segments_of",
    "logits_bytes",
    "replay_ledger",
    "replay_ranks",
    "reserved_memory",
]

EXPANDABLE_SEGMENTS_BY_STACK: dict[str | None, bool] = {
    # Megatron-Bridge's H100 performance recipes set PYTORCH_CUDA_ALLOC_CONF=
    # expandable_segments:True (src/megatron/bridge/perf_recipes/{llama,qwen,deepseek,gpt_oss}/
    # h100/*.py at 067f987); Megatron-LM's MoE README tells MoE runs to export it
    # (megatron/core/transformer/moe/README.md at d98e8a6)
    "megatron_te": True,
    # NeMo Automodel's benchmark recipes set it in their env (examples/llm_benchmark/
    # {deepseek/deepseek_v3_torch,gpt_oss/gptoss_120b_te_deepep,qwen/qwen3_moe_30b_te_fp8}.yaml
    # at 36044ad)
    "nemo_automodel": True,
    # torchtitan's run_train.sh launches torchrun with PYTORCH_ALLOC_CONF=
    # "expandable_segments:True" (run_train.sh at b5bcd76)
    "torchtitan": True,
    # the others launch torch with its default (expandable_segments:False): no stack source
    # found that sets it
    "llm_foundry": False,
    "fsdp": False,
    "deepspeed": False,
    None: False,
}
"""The allocator setting each stack launches torch with (``training.expandable_segments``
overrides it)."""


def expandable_segments_of(stack: str | None, explicit: bool | None = None) -> bool:
    """``training.expandable_segments``: the explicit value, else the stack's
    (:data:`EXPANDABLE_SEGMENTS_BY_STACK`), else torch's default (False)."""
    if explicit is not None:
        return bool(explicit)
    return EXPANDABLE_SEGMENTS_BY_STACK.get(stack, False)


@dataclass(frozen=True, slots=True)
class ReservedMemory:
    """The allocator's replay of one rank's step."""

    rank: int
    peak_reserved_bytes: float
    peak_allocated_bytes: float
    """Peak of the allocated block sizes (requests rounded to 512 B, unsplit remainders)."""
    num_alloc_retries: int
    """Requests that released the cached segments and retried (``num_alloc_retries``)."""
    oom: bool
    """A request failed after the retry: the step does not fit."""
    unmatched_bytes: float
    """Freed bytes the replay could not pair with a live allocation (0 on every shipped
    scenario; a check on the pairing rules)."""


def _family(label: Any) -> Any:
    """What a free is paired by: the label, with the FSDP reshard paired to its gather."""
    if isinstance(label, str):
        if label.startswith(("reshard", "gathered ")):
            return "gathered"
        return label
    return None


def replay_ledger(
    rank: int,
    events: Sequence[Any],
    *,
    expandable_segments: bool,
    limit_bytes: float | None = None,
    tensors: Mapping[int, tuple[int, ...]] | None = None,
    workspaces: Sequence[int] = (),
    logits: int = 0,
    skip_repeats: bool = True,
) -> ReservedMemory:
    """Replay one rank's sorted memory events (:meth:`MemoryLedger.sorted_events`, or the
    same as columns: :func:`collsim.step.replay_events.replay_events`) through a
    :class:`CachingAllocator` on one stream.

    Each allocation event is one block, but an activation event whose bytes are a layer's
    kept or rebuilt activations (``tensors``: :func:`activation_tensors`) is its tensors, one
    block each, freed together (newest first). A free is paired with the live blocks it releases:
    a labelled activation free (``("free", key, micro-batch, chunk)``) with the ``act`` and
    ``recompute`` blocks of the same key; an FSDP reshard with the oldest gathered unit of
    its size; other frees with the oldest live block of their category, label and size;
    unlabelled ones (the closed form's activation frees under ZeRO-3) with the newest of their
    size, else the newest blocks of their category until the bytes are covered. A labelled
    free sorted before its allocation at the same instant cancels it. With ``limit_bytes``
    the replay stops at the first request that does not fit after the retry (``oom``).

    Besides the step program's tensors: ``workspaces`` (:func:`cublas_workspaces`), allocated
    before the first activation and kept; and where the rank holds the LM head, ``logits``
    bytes (:func:`logits_bytes`) allocated before the head's kept activations and freed after
    them in forward, and allocated before they are freed and freed after in backward.

    An activation event whose free is the next event (a layer's rebuilt activations under
    recompute, freed at the end of the layer's backward) leaves the cache as it was when
    cached blocks hold it: it only raises the allocated peak
    (:meth:`CachingAllocator.cached_fit`), and its blocks are not made.

    With ``skip_repeats`` the periods of a pipeline's steady state that leave the allocator and
    the live allocations as they found them are replayed once, not every time
    (:mod:`collsim.step.replay_period`): the same answer.
    """
    alloc = CachingAllocator(
        expandable_segments=expandable_segments,
        limit_bytes=None if limit_bytes is None else int(limit_bytes),
    )
    split = tensors or {}
    pairs = _Pairing(alloc)
    malloc = alloc.malloc
    oom = False
    n = len(events)
    period = find_period(events) if skip_repeats else None
    steady = Steady(events, period) if period is not None else None
    i = 0
    while i < n:
        if steady is not None and i >= steady.due and not steady.done:  # a period boundary
            i = steady.jump(i, alloc, pairs, bool(workspaces))
            if i >= n:
                break
        ev = events[i]
        i += 1
        category, delta, label = ev[1], ev[2], ev[3]
        if delta < 0:
            if logits and type(label) is tuple and label[1] == "head":
                try:
                    transient = malloc(logits)
                except AllocatorOOM:
                    oom = True
                    break
                pairs.free(category, label, int(round(-delta)))
                alloc.free(transient)
                continue
            pairs.free(category, label, int(round(-delta)))
            continue
        size = int(round(delta))
        if pairs.early and pairs.cancels(category, label, size):
            continue
        if category == "activations":
            if workspaces:
                try:
                    kept = [malloc(part) for part in workspaces]
                except AllocatorOOM:
                    oom = True
                    break
                pairs.add("workspace", "cublas", sum(workspaces), kept)
                workspaces = ()
            parts = split.get(size, (size,))
            if logits and type(label) is tuple and label[1] == "head":
                try:
                    transient = malloc(logits)
                    pairs.add(category, label, size, [malloc(part) for part in parts])
                except AllocatorOOM:
                    oom = True
                    break
                alloc.free(transient)
                continue
            if i < n and _freed_next(ev, events[i]):
                held = alloc.cached_fit(parts)
                if held is not None:  # held, then freed with its key's blocks by events[i]
                    alloc.hold(held)
                    pairs.free_key(category, events[i][3], int(round(-events[i][2])), size)
                    i += 1
                    continue
        else:
            parts = (size,)
        try:
            blocks = [malloc(part) for part in parts]
        except AllocatorOOM:
            oom = True
            break
        pairs.add(category, label, size, blocks)
    st = alloc.stats
    return ReservedMemory(
        rank=rank,
        peak_reserved_bytes=float(st.peak_reserved_bytes),
        peak_allocated_bytes=float(st.peak_allocated_bytes),
        num_alloc_retries=st.num_alloc_retries,
        oom=oom,
        unmatched_bytes=float(pairs.unmatched_bytes()),
    )


def _freed_next(ev: Any, nxt: Any) -> bool:
    """Whether ``nxt`` is the labelled free of the activation allocation ``ev``."""
    free = nxt[3]
    if nxt[2] >= 0 or type(free) is not tuple or free[0] != "free":
        return False
    label = ev[3]
    return (
        type(label) is tuple
        and label[0] in ("act", "recompute")
        and nxt[1] == ev[1]
        and free[1:] == label[1:]
    )


class _Pairing:
    """The live allocations of a replay and which of them a free releases (the rules of
    :func:`replay_ledger`). One handle per event: [its blocks, live, bytes, its blocks'
    addresses once :meth:`state` asked] (a block object is reused once freed, a handle is
    not; an allocated block keeps its address)."""

    def __init__(self, alloc: CachingAllocator) -> None:
        self.alloc = alloc
        self.by_key: dict[tuple[Any, ...], list[list[Any]]] = {}
        self.by_size: dict[tuple[str, Any, int], deque[list[Any]]] = {}
        self.stacks: dict[str, list[list[Any]]] = {}
        self.pending: dict[tuple[str, Any, int], int] = {}
        """Frees sorted before their allocation (both at one instant: frees sort first)."""
        self.early = 0
        """How many of those wait for their allocation."""
        self.unmatched = 0

    def add(self, category: str, label: Any, size: int, blocks: list[Block]) -> None:
        handle = [blocks, True, size, None]
        if type(label) is tuple:
            if label and label[0] in ("act", "recompute"):
                key = (category, *label[1:])
                same = self.by_key.get(key)
                if same is None:
                    self.by_key[key] = [handle]
                else:
                    same.append(handle)
            family = None
        else:
            family = _family(label)
        by_size = (category, family, size)
        queue = self.by_size.get(by_size)
        if queue is None:
            self.by_size[by_size] = deque((handle,))
        else:
            queue.append(handle)
        stack = self.stacks.get(category)
        if stack is None:
            self.stacks[category] = [handle]
        else:
            stack.append(handle)

    def free_key(self, category: str, label: Any, size: int, held: int = 0) -> None:
        """A labelled activation free: every live block of its key, and ``held`` bytes of
        an allocation held without blocks."""
        freed = held
        for handle in self.by_key.pop((category, *label[1:]), ()):
            if handle[1]:
                freed += self.release(handle)
        if size > freed:
            self.unmatched += size - freed

    def cancels(self, category: str, label: Any, size: int) -> bool:
        """An allocation whose free came first at the same instant: neither happens."""
        early = (category, _family(label), size)
        if self.pending.get(early):
            self.pending[early] -= 1
            self.early -= 1
            return True
        return False

    def release(self, handle: list[Any]) -> int:
        handle[1] = False
        free = self.alloc.free
        for block in reversed(handle[0]):
            free(block)
        return int(handle[2])

    def state(self, less: int) -> tuple[Any, ...]:
        """The live allocations as later frees will find them, with the activation keys'
        micro-batches ``less``: each category's live handles in order (their blocks'
        addresses), each size queue's and each key's (their first block's address), the
        frees waiting for their allocation and the unmatched bytes. Dead handles are dropped
        from the lists on the way (the pairing skips them anyway)."""
        stacks = {
            category: tuple([h[3] or _addresses(h) for h in live])
            for category, handles in self.stacks.items()
            if (live := _live(handles))
        }
        by_size = {
            key: tuple([h[0][0].addr if h[0] else -1 for h in live])
            for key, handles in self.by_size.items()
            if (live := _live(handles))
        }
        by_key = {
            _moved(key, -less): tuple([h[0][0].addr if h[0] else -1 for h in live])
            for key, handles in self.by_key.items()
            if (live := _live(handles))
        }
        return stacks, by_size, by_key, dict(self.pending), self.early, self.unmatched

    def relabel(self, by: int) -> None:
        """Move the activation keys ``by`` micro-batches on."""
        self.by_key = {_moved(key, by): handles for key, handles in self.by_key.items()}

    def unmatched_bytes(self) -> int:
        return self.unmatched + sum(size * n for (_, _, size), n in self.pending.items())

    def free(self, category: str, label: Any, size: int) -> None:
        if type(label) is tuple and label and label[0] == "free":
            self.free_key(category, label, size)
            return
        family = _family(label)
        queue = self.by_size.get((category, family, size))
        if family:  # labelled: the oldest (gathered units, buckets, messages)
            while queue and not queue[0][1]:
                queue.popleft()
            if queue:
                self.release(queue.popleft())
            else:
                key = (category, family, size)
                self.pending[key] = self.pending.get(key, 0) + 1
                self.early += 1
            return
        # unlabelled activations: the newest of that size (backward runs the layers in
        # reverse), else the newest live block (the rebuilt part), then the newest of the
        # rest's size (the kept part)
        while queue and not queue[-1][1]:
            queue.pop()
        if queue:
            self.release(queue.pop())
            return
        left = size
        stack = self.stacks.get(category, [])
        while left > 0 and stack:
            handle = stack.pop()
            if not handle[1]:
                continue
            left -= self.release(handle)
            rest = self.by_size.get((category, family, left))
            while rest and not rest[-1][1]:
                rest.pop()
            if rest:
                self.release(rest.pop())
                left = 0
        self.unmatched += max(0, left)


def _addresses(handle: list[Any]) -> tuple[int, ...]:
    """A live handle's blocks' addresses, kept in the handle."""
    addresses = tuple([b.addr for b in handle[0]])
    handle[3] = addresses
    return addresses


def _live(handles: Any) -> list[Any]:
    """The live handles of ``handles`` in order; the dead ones are dropped from it."""
    live = [h for h in handles if h[1]]
    if len(live) < len(handles):
        handles.clear()
        handles.extend(live)
    return live


def _moved(key: tuple[Any, ...], by: int) -> tuple[Any, ...]:
    """A pairing key ``(category, layer, micro-batch, chunk)`` with its micro-batch ``by``
    on (other keys as they are)."""
    mb = key[MICROBATCH_AT]
    if type(mb) is int:
        return (key[0], key[1], mb + by, key[3])
    return key


def replay_ranks(
    ledgers: Mapping[int, Any],
    *,
    expandable_segments: bool,
    limit_bytes: float | None,
    tensors: Mapping[int, tuple[int, ...]] | None = None,
    workspaces: Sequence[int] = (),
    logits: int = 0,
    memo: ShapeCache | None = None,
) -> dict[int, ReservedMemory]:
    """:func:`replay_ledger` of every rank's ledger (:class:`MemoryLedger`); a search's shape
    cache (``memo``) keeps the most recent replays by their events and inputs
    (:func:`_replay_kept`)."""
    inputs: dict[str, Any] = {
        "expandable_segments": expandable_segments,
        "limit_bytes": limit_bytes,
        "tensors": tensors or {},
        "workspaces": workspaces,
        "logits": logits,
    }
    return {rank: _replay_kept(rank, ledger, inputs, memo) for rank, ledger in ledgers.items()}


def allocator_limit_bytes(device: Any) -> float:
    """What the caching allocator can reserve on ``device`` (a
    :class:`~collsim.cluster.hardware.Device`): the reported capacity less the memory outside
    the allocator, the device file's ``reserve_gib`` or else the CUDA context and NCCL buffers
    (:data:`~collsim.cluster.hardware.CUDA_CONTEXT_BYTES`,
    :data:`~collsim.cluster.hardware.NCCL_BUFFER_BYTES`). The fragmentation share of
    :attr:`~collsim.cluster.hardware.Device.memory_reserve_bytes` is left out: the replay
    finds the fragmentation itself."""
    outside = device.reserve_bytes
    if outside is None:
        outside = CUDA_CONTEXT_BYTES + NCCL_BUFFER_BYTES
    return max(0.0, float(device.reported_capacity_bytes) - float(outside))


NEAR_LIMIT_SHARE = 0.8
"""Besides the rank with the highest allocated peak, the replay runs the ranks whose allocated
peak is at least this share of what the allocator can hold: those whose fit could turn on
fragmentation. A choice of collsim (the replay's cost grows with the ranks it runs), not
a figure of PyTorch's."""


MIB = 1 << 20

CUBLAS_WORKSPACE_BYTES_BY_GENERATION: dict[str, int] = {
    # parseChosenWorkspaceSize: 4096 KiB x 8 = 32 MiB when the device is compute capability 9.0
    "hopper": 4096 * 1024 * 8,
    # ROCm: 128 MiB on gfx94x / gfx95x (MI300X is gfx942)
    "cdna3": 128 * MIB,
}
"""The cuBLAS workspace torch gives each (handle, stream) by default, by device generation
(aten/src/ATen/cuda/CublasHandlePool.cpp, pytorch/pytorch at 26a3905,
``parseChosenWorkspaceSize``); other CUDA devices (Ampere, Blackwell) take
:data:`CUBLAS_WORKSPACE_BYTES_DEFAULT`."""
CUBLAS_WORKSPACE_BYTES_DEFAULT = 4096 * 1024 * 2 + 16 * 1024 * 8
"""``:4096:2:16:8``: 2 x 4 MiB + 8 x 16 KiB, torch's default workspace off compute capability
9.0 (same file)."""
CUBLAS_HANDLES_PER_RANK = 2
"""cuBLAS handles that run a rank's GEMMs: one per thread (a thread-local pool window,
``getCurrentCUDABlasHandle``, same file), and the step runs its forward on the main thread
and its backward on the autograd engine's thread of the device (torch/csrc/autograd/engine.cpp,
one worker thread per device). Each gets a workspace on the compute stream."""


def cublas_workspaces(device: Any) -> tuple[int, ...]:
    """The cuBLAS workspaces a rank on ``device`` (a
    :class:`~collsim.cluster.hardware.Device`) allocates through the caching allocator at its
    first GEMMs and keeps (``setWorkspaceForHandle`` keeps them in a map until
    ``clearCublasWorkspaces``): :data:`CUBLAS_HANDLES_PER_RANK` of the generation's size."""
    size = CUBLAS_WORKSPACE_BYTES_BY_GENERATION.get(
        str(device.generation), CUBLAS_WORKSPACE_BYTES_DEFAULT
    )
    return (size,) * CUBLAS_HANDLES_PER_RANK


def logits_bytes(schedule: Any) -> int:
    """Bytes of one micro-batch's logits in the activation dtype on a rank that holds the LM
    head (``schedule``: a :class:`collsim.step.build.StepSchedule`): the head GEMM's output,
    alive while the loss makes its fp32 copy (Megatron-LM
    megatron/core/tensor_parallel/cross_entropy.py at 00611e6,
    ``calculate_logits_max``: ``vocab_parallel_logits.float()``), and the logits' gradient,
    cast back to that dtype while the fp32 gradient (the saved softmax, updated in place)
    lives. Tokens x vocab / tp x element bytes, from the head's op list
    (:func:`collsim.workload.ops.head_ops`: the fp32 softmax it keeps is 4 bytes a logit); 0
    when activations are fp32 (the loss works on the logits themselves)."""
    plan = schedule.plan
    tr = plan.training
    ops = head_ops(
        plan.spec,
        micro_batch=tr.micro_batch,
        tp=plan.tp,
        sequence_parallel=plan.parallel.sequence_parallel,
        dtype=str(tr.dtype),
        cp=plan.cp,
    )
    element_bytes = activation_element_bytes(str(tr.dtype))
    if element_bytes >= 4:
        return 0  # fp32 logits: .float() is the tensor itself, and no cast in backward
    fp32 = sum(op.saved.get("loss.softmax_fp32", 0.0) for op in ops)
    return int(round(fp32 / 4 * element_bytes))


def reserved_memory(
    ledgers: Mapping[int, Any],
    *,
    expandable_segments: bool,
    limit_bytes: float | None,
    allocated_peaks: Mapping[int, float],
    schedule: Any = None,
    memo: ShapeCache | None = None,
) -> tuple[float, dict[str, Any]]:
    """The highest peak reserved over the replayed ranks of ``ledgers`` (rank ->
    :class:`MemoryLedger`): the rank with the highest of ``allocated_peaks`` and those within
    :data:`NEAR_LIMIT_SHARE` of ``limit_bytes``; and the facts of the replay
    (:attr:`collsim.step.result.StepResult.allocator`). With the step's ``schedule``, layer
    activations are allocated tensor by tensor, with the cuBLAS workspaces of the step's
    device and the LM head's logits (:func:`replay_ledger`); ``memo``: as
    :func:`replay_ranks`."""
    tensors = activation_tensors(schedule) if schedule is not None else {}
    workspaces = cublas_workspaces(schedule.plan.topology.device) if schedule is not None else ()
    logits = logits_bytes(schedule) if schedule is not None else 0
    top_rank = max(allocated_peaks, key=lambda r: (allocated_peaks[r], -r))
    near = NEAR_LIMIT_SHARE * limit_bytes if limit_bytes is not None else float("inf")
    chosen = {
        r: ledger
        for r, ledger in ledgers.items()
        if r == top_rank or allocated_peaks.get(r, 0.0) >= near
    }
    runs = replay_ranks(
        chosen,
        expandable_segments=expandable_segments,
        limit_bytes=limit_bytes,
        tensors=tensors,
        workspaces=workspaces,
        logits=logits,
        memo=memo,
    )
    top = max(runs.values(), key=lambda r: (r.oom, r.peak_reserved_bytes, -r.rank))
    return top.peak_reserved_bytes, {
        "expandable_segments": expandable_segments,
        "limit_bytes": limit_bytes,
        "rank": top.rank,
        "alloc_retries": top.num_alloc_retries,
        "oom": any(r.oom for r in runs.values()),
        "unmatched_bytes": max(r.unmatched_bytes for r in runs.values()),
        "reserved_bytes_by_rank": {r: run.peak_reserved_bytes for r, run in runs.items()},
        "activation_tensors": {size: len(parts) for size, parts in tensors.items()},
        "cublas_workspace_bytes": sum(workspaces),
        "logits_bytes": logits,
    }


REPLAYS_KEPT = 16
"""Allocator replays a search's shape cache keeps (the most recent; :func:`_replay_kept`)."""


RECORDINGS_KEPT = 8
"""Recordings whose digest a search's shape cache keeps with a copy of their rows
(:func:`_digest_kept`, the most recent)."""


def _digest_kept(rank: int, ledger: Any, memo: ShapeCache) -> bytes | None:
    """:func:`recording_digest` of a rank's ledger, taken from the last ledger of the rank
    with the same counts of events and placements when it recorded the same rows (equal
    single events and placed rows as tuples, each pattern by its content digest: what the
    allocator's replay reads, the same; comparing rows costs a small part of hashing their
    columns). Plans that differ in a knob which changes no memory event (selective
    recompute where it stores nothing more) record the same rows one after another."""
    rows = ledger.rows()
    if rows is None:
        return recording_digest(ledger)
    events, placed, blocks = rows
    kinds, which = numbered_patterns(placed)
    numbers = which.tolist()
    at = [(start, q, mb, c, before) for (start, _, mb, c, before), q in zip(placed, numbers)]
    patterns = [pattern_digest(p) for p in kinds]

    def make() -> tuple[list[Any], list[Any], list[bytes], list[Any], bytes | None]:
        return list(events), at, patterns, list(blocks), recording_digest(ledger)

    kept = memo.recent(
        "digested recordings",
        (rank, len(events), len(placed), tuple(len(b.times) for b in blocks)),
        make,
        RECORDINGS_KEPT,
        valid=lambda held: (
            held[1] == at
            and held[2] == patterns
            and _same_blocks(held[3], blocks)
            and held[0] == events
        ),
    )
    return kept[4]


def _same_blocks(held: list[Any], blocks: list[Any]) -> bool:
    """Whether two ledgers' blocks of single events (:class:`~collsim.step.memory.EventBlock`)
    record the same events at the same places (blocks are held, never written: the same
    object is the same block)."""
    return len(held) == len(blocks) and all(
        a is b
        or (
            a.at == b.at
            and a.labels == b.labels
            and np.array_equal(a.times, b.times)
            and np.array_equal(a.deltas, b.deltas)
            and np.array_equal(a.categories, b.categories)
            and np.array_equal(a.label_of, b.label_of)
        )
        for a, b in zip(held, blocks, strict=True)
    )


def _replay_kept(
    rank: int, ledger: Any, inputs: dict[str, Any], memo: ShapeCache | None
) -> ReservedMemory:
    """:func:`replay_ledger` of a rank's ledger; with a search's shape cache, kept by the
    digest of what the ledger recorded (:func:`recording_digest`) and the replay's inputs:
    plans that differ only in their gradient buckets or overlap record the same events and
    replay them once, and a plan whose replay is kept does not sort its events. Events
    :func:`replay_events` keeps as a sorted list are replayed each time."""
    digest = None if memo is None else _digest_kept(rank, ledger, memo)
    if memo is None or digest is None:
        return replay_ledger(rank, replay_events(ledger), **inputs)
    tensors = inputs["tensors"]
    key = (
        digest,
        inputs["expandable_segments"],
        inputs["limit_bytes"],
        tuple(sorted(tensors.items())) if tensors else (),
        tuple(inputs["workspaces"]),
        inputs["logits"],
    )
    run = memo.recent(
        "allocator replays",
        key,
        lambda: replay_ledger(rank, replay_events(ledger), **inputs),
        REPLAYS_KEPT,
    )
    return run if run.rank == rank else replace(run, rank=rank)


def activation_tensors(schedule: Any) -> dict[int, tuple[int, ...]]:
    """Bytes of a layer kind's kept (and rebuilt) activations -> the bytes of each of their
    tensors, from the layer's op list (:attr:`collsim.workload.compute.LayerTimes.
    kept_tensor_bytes`) of the step program's compute model (``schedule``: a
    :class:`collsim.step.build.StepSchedule`). Where the step keeps fewer bytes than the op
    list (FP8 linears keep 1-byte inputs) the tensors are scaled to the step's bytes."""
    plan = schedule.plan
    spec, tr = plan.spec, plan.training
    # the layer kinds as the step program prices them (collsim.step.build._blocks)
    variant = spec.is_moe or spec.is_mla or spec.sliding_window is not None or plan.cp > 1
    blocks = schedule.layers if schedule.layers else {0: schedule.layer}
    out: dict[int, tuple[int, ...]] = {}
    for rep, block in blocks.items():
        kinds: dict[str, Any] = (
            {"layer": rep, "ep": plan.ep, "etp": plan.etp, "cp": plan.cp} if variant else {}
        )
        times = schedule.compute.layer_times(
            spec,
            micro_batch=tr.micro_batch,
            tp=plan.tp,
            sequence_parallel=plan.parallel.sequence_parallel,
            recompute=str(tr.recompute),
            **kinds,
        )
        for total, parts in (
            (block.stored_bytes, times.kept_tensor_bytes),
            (block.transient_bytes, times.rebuilt_tensor_bytes),
        ):
            size = int(round(total))
            if size > 0 and len(parts) > 1:
                out[size] = _scaled(parts, size)
    return out


def _scaled(parts: tuple[float, ...], total: int) -> tuple[int, ...]:
    """``parts`` scaled to add up to ``total`` bytes exactly (the last one takes the
    rounding), zero-byte tensors left out."""
    whole = float(sum(parts))
    if whole <= 0:
        return (total,)
    sizes = [int(p * total / whole) for p in parts]
    sizes[-1] += total - sum(sizes)
    return tuple(s for s in sizes if s > 0)
