"""Model-state memory of one rank of a checked plan (MoE, CP, HSDP, FP8 included).

Derivations, measurements and sources: docs/derivations.md, ``collsim.parallel.states``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from collsim.core.vocab import ParallelAxis
from collsim.parallel.sharding import fp8_weight_bytes
from collsim.workload.fp8 import fp8_param_gather_of
from collsim.workload.memory import ModelStateBytes, moe_model_state_bytes, stage_parameter_split

if TYPE_CHECKING:
    from collsim.parallel.config import TrainingConfig
    from collsim.parallel.plan import Plan

__all__ = ["RankStates", "fp8_parameters", "optimizer_state_bytes", "rank_model_states"]


def optimizer_state_bytes(training: TrainingConfig) -> float | None:
    """Optimizer bytes per parameter when the parameters have no fp32 master copy, else None
    (the ZeRO table's K). NeMo Automodel's benchmark recipes build the model with
    ``NeMoAutoModelForCausalLM.from_config`` and no ``torch_dtype``, which builds it in bf16
    (``torch_dtype = ... else torch.bfloat16``, nemo_automodel/_transformers/auto_model.py at
    36044ad) and train it with ``torch.optim.Adam``, whose moments take the parameter dtype:
    2 x 2 bytes for Adam (2 for SGD's momentum) beside the bf16 parameter and gradient."""
    if training.stack != "nemo_automodel" or str(training.dtype) == "fp32":
        return None
    return 4.0 if str(training.optimizer) == "adam" else 2.0


def fp8_parameters(plan: Plan) -> bool:
    """Are the GEMM weights kept in FP8 (no 16-bit copy)? With the distributed optimizer (zero 1
    or 2), what :func:`collsim.workload.fp8.fp8_param_gather_of` decides for
    ``training.fp8_param_gather`` (the explicit value, else True for an FP8 plan of the
    ``megatron_te`` stack: every FP8 preset of Megatron-Bridge sets
    ``fp8_param_gather = True`` (src/megatron/bridge/training/mixed_precision.py,
    ``bf16_with_fp8_current_scaling_mixed`` and the delayed-scaling presets, at 0013c9a)).
    With zero 3 the gathered copies are transients of the FSDP units instead
    (``parallel.fsdp.fp8_all_gather``).

    The GEMM weights are then TE ``Float8Tensor`` parameters and no 16-bit copy of them is
    kept: Megatron-Core's ``DistributedDataParallel`` gives them a ``torch.uint8`` parameter
    buffer (megatron/core/distributed/distributed_data_parallel.py at 293e104) and the fp32
    master shard lives in the distributed optimizer; the FP8 data and its transpose (1 + 1
    bytes) take the place of the 16-bit weight (2 bytes)."""
    training = plan.training
    if plan.parallel.zero not in (1, 2):
        return False
    return fp8_param_gather_of(
        training.stack,
        training.fp8_param_gather,
        fp8=str(training.dtype) == "fp8",
        zero=plan.parallel.zero,
    )


@dataclass(frozen=True, slots=True)
class RankStates:
    """Model-state bytes of one rank (see the module docstring).

    Attributes:
        dense_params: non-expert parameters on the rank (unsharded).
        expert_params: routed-expert parameters on the rank (unsharded).
        shard_group: N, the ranks the non-expert states are sharded over.
        expert_shard_group: N_e, the same for the routed experts.
        states: parameters, gradients and optimizer states.
        fp8_copy_bytes: FP8 weight copies and their scales (with FP8 parameters: the scales
            only, the FP8 weight and transpose having replaced the 16-bit weight).
        kept_gathered_bytes: gathered parameters kept from forward to backward.
    """

    dense_params: float
    expert_params: float
    shard_group: int
    expert_shard_group: float
    states: ModelStateBytes
    fp8_copy_bytes: float
    kept_gathered_bytes: float

    @property
    def total(self) -> float:
        return self.states.total + self.fp8_copy_bytes + self.kept_gathered_bytes


def rank_model_states(plan: Plan, stage: int = 0) -> RankStates:
    """Model-state bytes of a rank of ``stage`` (formulas in the module docstring)."""
    spec, par, training = plan.spec, plan.parallel, plan.training
    dense, experts = stage_parameter_split(
        spec,
        tp=plan.tp,
        pp=plan.pp,
        stage=stage,
        ep=plan.ep,
        etp=plan.etp,
        stage_layers=plan.stage_layers(stage),
    )
    n, n_e = _shard_groups(plan, stage)
    fp32 = str(training.dtype) == "fp32"
    states = moe_model_state_bytes(
        dense,
        experts,
        zero=par.zero,
        dp_cp=n,
        edp=n_e,
        optimizer=str(training.optimizer),
        mixed_precision=not fp32,
        optimizer_bytes=optimizer_state_bytes(training),
    )
    fp8 = str(training.dtype) == "fp8"
    copies = 0.0
    if fp8 and par.zero < 3:
        recipe = str(training.fp8_recipe) if training.fp8_recipe is not None else "tensorwise"
        gemm_weights = (
            dense + experts - spec.vocab * spec.hidden / plan.tp * _embeddings(plan, stage)
        )
        layers = len(plan.stage_layers(stage))
        copies = fp8_weight_bytes(gemm_weights, recipe, num_tensors=max(1, 4 * layers))
        if fp8_parameters(plan):
            copies -= 2.0 * gemm_weights  # the 16-bit GEMM weights are not kept
    kept = 0.0
    if par.zero == 3 and not par.fsdp.reshard_after_forward:
        e_w = 1.0 if par.fsdp.fp8_all_gather else 2.0
        kept = (dense + experts) * e_w - states.parameters
    return RankStates(
        dense_params=dense,
        expert_params=experts,
        shard_group=n,
        expert_shard_group=n_e,
        states=states,
        fp8_copy_bytes=copies,
        kept_gathered_bytes=max(0.0, kept),
    )


def _shard_groups(plan: Plan, stage: int) -> tuple[int, int]:
    """(N, N_e): the non-expert and expert shard group sizes of the first rank of ``stage``."""

    rank = plan.stage_ranks(stage)[0]
    sharding = plan.group_of(rank, ParallelAxis.DP_SHARD)
    if plan.cp == 1:  # each rank's CP group is the rank itself
        shard = set(sharding)
    else:
        shard = {r for d in sharding for r in plan.group_of(d, ParallelAxis.CP)}
    edp = set(plan.group_of(rank, ParallelAxis.EDP))
    return len(shard), len(shard & edp)


def _embeddings(plan: Plan, stage: int) -> int:
    """Vocab-sized matrices on the stage that are not FP8 GEMM weights (the input embedding is
    a lookup; TE keeps the LM head in bf16 as well)."""
    spec = plan.spec
    count = 1 if stage == 0 else 0
    head = plan.head_stage
    if stage == head and (not spec.tied_embeddings or head != 0):
        count += 1
    return count
