"""The parallel plan: TP x CP x PP x DP (+ EP) sizes, rank mapping, pipeline schedules, DDP
buckets, FSDP, and the EP / CP / HSDP / FP8 volumes.

- :mod:`~collsim.parallel.config`: the ``training`` and ``parallel`` sections (frozen dataclasses).
- :mod:`~collsim.parallel.plan`: ``build_plan`` checks a plan and maps ranks (TP inside a node,
  then CP, then PP, DP outermost; experts folded over tp x cp x dp).
- :mod:`~collsim.parallel.pipeline`: pipeline schedules as data (GPipe, 1F1B, interleaved,
  ZB-H1, DualPipeV).
- :mod:`~collsim.parallel.params`: a rank's parameter tensors per model chunk.
- :mod:`~collsim.parallel.buckets`: torch DDP gradient buckets.
- :mod:`~collsim.parallel.fsdp`: FSDP / ZeRO-3 units and prefetch order.
- :mod:`~collsim.parallel.moe`: expert-parallel dispatch and combine volumes.
- :mod:`~collsim.parallel.dispatch`: dispatchers, routing models, distinct nodes and GPUs per token.
- :mod:`~collsim.parallel.context`: ring attention and all-gather-KV volumes.
- :mod:`~collsim.parallel.sharding`: HSDP reduce-scatter + all-reduce, FSDP all-gather, FP8 copies.
- :mod:`~collsim.parallel.layer_comms`: where the EP and CP collectives sit in a layer.
- :mod:`~collsim.parallel.states`: model-state bytes of a rank of a plan (MoE, HSDP, FP8).
"""

from __future__ import annotations

from collsim.core.vocab import Dtype, Optimizer, ParallelAxis, ScheduleKind
from collsim.parallel.buckets import Bucket, build_buckets
from collsim.parallel.config import DDPConfig, FSDPConfig, ParallelConfig, Recompute, TrainingConfig
from collsim.parallel.fsdp import FSDPUnit, build_units, issue_schedule
from collsim.parallel.params import ParamTensor, chunk_tensors
from collsim.parallel.pipeline import Phase, PipeOp, input_of, stage_schedule
from collsim.parallel.plan import Plan, RankCoords, build_plan

__all__ = [
    "Dtype",
    "Optimizer",
    "Recompute",
    "ScheduleKind",
    "TrainingConfig",
    "DDPConfig",
    "FSDPConfig",
    "ParallelConfig",
    "ParallelAxis",
    "RankCoords",
    "Plan",
    "build_plan",
    "Phase",
    "PipeOp",
    "stage_schedule",
    "input_of",
    "ParamTensor",
    "chunk_tensors",
    "Bucket",
    "build_buckets",
    "FSDPUnit",
    "build_units",
    "issue_schedule",
]
