"""Lower bounds of a plan's step time and memory, cheap enough to order and prune a search.

The search (:mod:`collsim.study.search.loop`) estimates plans best-first by these floors and stops
when no floor left can beat the best kept; a bound that is not a bound would drop the best plan.
Every floor is read off the plan's step program (:mod:`collsim.study.search.program_floors`).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from collsim.parallel.config import ParallelConfig as Parallel
from collsim.parallel.pipeline import flow, get_schedule
from collsim.step.allocator import allocator_limit_bytes
from collsim.step.build import bytes_per
from collsim.study.search.program_floors import ProgramFloors
from collsim.workload.compute import ComputeModel
from collsim.workload.interference import overlap_slowdown

if TYPE_CHECKING:  # pragma: no cover
    from collsim.cluster.hardware import Device
    from collsim.cluster.topology import Topology
    from collsim.parallel.config import ParallelConfig, TrainingConfig
    from collsim.step.pricing import ClosedPricer
    from collsim.study.search.space import Candidate
    from collsim.workload.model import TransformerSpec


def memory_limit_bytes(device: Device) -> float:
    """The memory a plan's floor (:meth:`Bounds.memory_bytes`, allocated bytes) is held
    against, the limit of the fit verdict of ``collsim run``
    (:func:`collsim.step.assemble._memory_fit`): on a GPU what PyTorch's caching allocator can
    reserve (:func:`collsim.step.allocator.allocator_limit_bytes`: the capacity less the CUDA
    context and the NCCL buffers); a plan fits when its replay never runs out, and the
    allocated bytes never exceed the reserved, so a plan whose allocated floor exceeds this
    cannot fit. On a CPU device the verdict's usable capacity."""
    if device.generation == "cpu":
        return float(device.usable_memory_bytes)
    return allocator_limit_bytes(device)


class Bounds(ProgramFloors):
    """Floors of a candidate read off its step program, each kept per the knobs it depends on.

    :meth:`memory_bytes`: the model states every rank holds for the whole step and the
    activations its schedule holds at once. :meth:`step_s`: per stage, the compute stream's own
    work (its chunks' layers, embedding and head, every micro-batch), the data-parallel calls
    and their interference, the optimizer step; :meth:`refined_s` walks the schedule's op
    order with that work (communication, bubble and waits only add).
    """

    def __init__(
        self,
        topology: Topology,
        spec: TransformerSpec,
        training: TrainingConfig,
        parallel: ParallelConfig | None = None,
    ):
        base = parallel if parallel is not None else Parallel()
        self.base = base
        self.topology = topology
        self.spec = spec
        self.training = training
        self.per = bytes_per(training)
        self._optimizer_model: ComputeModel | None = None
        self._pricer: ClosedPricer | None = None
        self._acts: dict[tuple[Any, ...], float] = {}
        self._step: dict[tuple[Any, ...], float] = {}
        self._refined: dict[tuple[Any, ...], float] = {}
        self._pipes: dict[tuple[Any, ...], list[float]] = {}
        self._init_program()

    def memory_bytes(self, c: Candidate) -> float:
        """A lower bound on the peak (:meth:`_program_floor`): the model states plus the
        activations held at once. Transient buffers and gathered ZeRO-3 units only add."""
        key: tuple[Any, ...] = (c.tp, c.pp, c.dp, c.micro_batch, c.schedule, c.zero)
        key += (c.recompute, c.sequence_parallel, c.offload, c.reshard, c.cp, c.ep)
        key += (c.virtual_stages,)
        hit = self._acts.get(key)
        if hit is None:
            hit = self._acts[key] = self._program_floor(c)
        return hit

    def _step_key(self, c: Candidate) -> tuple[Any, ...]:
        key: tuple[Any, ...] = (c.tp, c.pp, c.dp, c.micro_batch, c.schedule, c.virtual_stages)
        key += (c.zero, c.recompute, c.sequence_parallel, c.overlap, c.reshard, c.offload)
        return key + (c.cp, c.ep)

    def step_s(self, c: Candidate) -> float:
        """A lower bound on the step (seconds): the largest :meth:`stage_bounds`."""
        key = self._step_key(c)
        hit = self._step.get(key)
        if hit is None:
            hit = self._step[key] = max(self.stage_bounds(c)) * (1 - 1e-9)
        return hit

    def refined_s(self, c: Candidate) -> float:
        """A tighter lower bound (seconds): :meth:`stage_bounds` with the compute stream's
        end taken from a walk of the pipeline schedule itself (:meth:`_pipeline_ends`)."""
        key = self._step_key(c)
        hit = self._refined.get(key)
        if hit is None:
            stream = self._pipeline_ends(c)
            hit = self._refined[key] = max(self.stage_bounds(c, stream)) * (1 - 1e-9)
        return hit

    def _pipeline_ends(self, c: Candidate) -> list[float]:
        """When the first and the last stage finish their last op, walking the schedule's op
        order (:meth:`collsim.parallel.pipeline.PipelineSchedule.order`) with each op's own work
        (:meth:`collsim.study.search.parts.Layout.op_work`), each op starting after the op
        before it on its stage and after the op whose output it reads
        (:meth:`~collsim.parallel.pipeline.PipelineSchedule.input_of`); sends take no time.
        Both fidelities run these ops in this order with these dependencies and more work, so
        they end later. Zeros when no plan builds."""

        p = c.pp
        v = c.virtual_stages
        m = self.training.global_batch // (c.micro_batch * c.dp)
        layout = self._layout(c)
        if layout is None:
            return [0.0] * len(sorted({0, p - 1}))
        key = (id(layout), m)
        hit = self._pipes.get(key)
        if hit is not None:
            return hit
        pipeline = get_schedule(c.schedule)
        durations = layout.op_work()
        orders = [
            pipeline.order(num_stages=p, num_microbatches=m, stage=s, virtual_stages=v)
            for s in range(p)
        ]
        # each op's end by (direction, micro-batch, chunk); its source and its own direction
        # worked out once per (phase, chunk) of a stage: the micro-batch passes through
        done: list[dict[tuple[Any, int, int], float]] = [{} for _ in range(p)]
        links: list[dict[tuple[Any, int], tuple[Any, tuple[int, Any, int] | None]]] = [
            {} for _ in range(p)
        ]
        clock = [0.0] * p
        at = [0] * p
        remaining = sum(len(o) for o in orders)
        while remaining:
            moved = 0
            for s in range(p):
                order, mine, shapes = orders[s], done[s], links[s]
                i, now = at[s], clock[s]
                while i < len(order):
                    op = order[i]
                    shape = (op.phase, op.chunk)
                    link = shapes.get(shape)
                    if link is None:
                        found = pipeline.input_of(op, stage=s, num_stages=p, virtual_stages=v)
                        source = (
                            None if found is None else (found[0], found[1].phase, found[1].chunk)
                        )
                        link = shapes[shape] = (flow(op.phase), source)
                    direction, source = link
                    if source is not None:
                        ready = done[source[0]].get((source[1], op.microbatch, source[2]))
                        if ready is None:
                            break
                        now = max(now, ready)
                    now += durations[(s, op.phase, op.chunk)]
                    mine[(direction, op.microbatch, op.chunk)] = now
                    i += 1
                moved += i - at[s]
                at[s], clock[s] = i, now
            if not moved:  # pragma: no cover - every schedule here is deadlock free
                raise RuntimeError(f"pipeline walk stalled for {c.label}")
            remaining -= moved
        hit = self._pipes[key] = [clock[s] for s in sorted({0, p - 1})]
        return hit

    def stage_bounds(self, c: Candidate, stream: list[float] | None = None) -> list[float]:
        """Per stage (the first and the last), a floor on when its rank ends the step.

        The rank's compute stream runs its work one piece after another (:meth:`_compute`),
        and its data-parallel calls one after another (:meth:`_program_dp`); without overlap
        the last gradient reduction starts after the last backward. After the walk both
        fidelities add the interference of the overlapped data-parallel calls,
        ``min(dp link, compute) x (1 - 1/factor)`` (:meth:`StepSchedule.interference_s`),
        whose factor is at least its SM term ``(1 - m) / (1 - f_sm) + m`` (the HBM term only
        adds, :func:`collsim.workload.interference.overlap_slowdown`), then the optimizer
        step and ZeRO-1/2's all-gathers of the updated parameters. Without overlap every
        reduction waits for the end of the rank's whole backward (``launch_deferred``)."""
        floor, busy, share, opts = self._compute(c)
        stream = (
            floor if stream is None else [max(a, b) for a, b in zip(floor, stream, strict=True)]
        )
        before, after, _ = self._program_dp(c)
        serial = c.zero < 3 and not c.overlap
        interferes = c.dp > 1 and (c.zero == 3 or c.overlap)
        factor = 1.0
        busbw = self._busbw_floor(c) if interferes else 0.0
        if busbw > 0:
            # a bus bandwidth no higher than the walk's (its highest data-parallel call's)
            factor = overlap_slowdown(self.topology.device, busbw_bps=busbw,
                                      memory_bound_share=share)  # fmt: skip
        elif interferes:
            # the SM term alone: busbw -> 0+ leaves f_hbm -> 0 (formula above)
            device = self.topology.device
            sms = int(getattr(device, "sm_count", None) or 108)
            f_sm = min(0.9, max(0.0, getattr(device, "nccl_sms", 16) / sms))
            factor = (1.0 - share) / (1.0 - f_sm) + share
        out = []
        for i in range(len(stream)):
            walk = stream[i] + before[i] if serial else max(stream[i], before[i])
            interference = min(before[i], busy[i]) * (1.0 - 1.0 / factor) if interferes else 0.0
            out.append(walk + interference + opts[i] + after[i])
        return out

    def _compute(self, c: Candidate) -> tuple[list[float], list[float], float, list[float]]:
        """Per stage (first, last): the compute stream's own work (:meth:`Layout.stage_work`
        of every micro-batch and the stack's own work, :meth:`_framework_floor`; for the last
        stage the fill and the drain of the stages before it), the compute seconds alone, the
        memory-bound share the program's interference takes, and the optimizer step over the
        parameters the stage's rank updates (with offload the step runs on the host, slower
        than this GPU floor). Zeros when no plan builds."""
        stages = sorted({0, c.pp - 1})
        layout = self._layout(c)
        if layout is None:
            zeros = [0.0] * len(stages)
            return zeros, zeros, 0.0, zeros
        m = self.training.global_batch // (c.micro_batch * c.dp)
        parts = layout.parts
        emb, head = parts.embedding, parts.head
        last = c.pp - 1

        def busy(s: int) -> float:
            out = layout.compute_s[s]
            for part in layout.part_of[s]:
                out += emb.forward_s + emb.backward_s if part == 0 else 0.0
                out += head.forward_s + head.backward_s if part == layout.last_part else 0.0
            return m * out

        f0, b0 = layout.stage_work(0)
        f_last, b_last = layout.stage_work(last)
        fill = drain = 0.0
        chained = all(row[0] == r for r, row in enumerate(layout.part_of))
        splits = get_schedule(c.schedule).splits_backward
        if chained and not splits and layout.last_part in layout.part_of[last]:
            # the last stage starts when the first micro-batch's first chunk has crossed the
            # stages before it (fill), and stage 0 ends after the last micro-batch's last
            # backward chunk (chunk 0) has crossed them back (drain); with split backward ops
            # or a V the walk of the schedule (:meth:`_pipeline_ends`) adds them
            for r in range(last):
                first = layout.part_of[r][0] == 0
                fill += layout.forward_s[r][0] + (emb.forward_s if first else 0.0)
                drain += layout.backward_s[r][0] + (emb.backward_s if first else 0.0)
        # the stack's own work (FSDP copies, gradient casts, the per-step part) runs on the
        # same stream
        fw = self._framework_floor(c)
        stream = [max(m * (f0 + b0) + fw[0], fill + m * (f_last + b_last) + fw[-1] + drain)]
        if last:
            stream.append(fill + m * (f_last + b_last) + fw[-1])
        model = self._optimizer_model
        if model is None:
            model = self._optimizer_model = ComputeModel(
                self.topology.device, str(self.training.dtype)
            )
        optimizer = str(self.training.optimizer)
        implementation = str(self.training.optimizer_implementation)
        opts = [
            model.optimizer_time_s(n, optimizer, implementation) for n in self._program_dp(c)[2]
        ]
        return stream, [busy(s) for s in stages], parts.memory_bound_share, opts
