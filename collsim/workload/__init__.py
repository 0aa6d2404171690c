"""Workload: model specs and presets, per-op FLOPs and bytes, compute times, memory formulas.

- :mod:`~collsim.workload.model`: TransformerSpec; :mod:`~collsim.workload.presets`: PRESETS,
  get_preset.
- :mod:`~collsim.workload.ops`: the ops of a layer / embedding / head on one TP rank.
- :mod:`~collsim.workload.op_costs`: OpCostModel, a roofline per op;
  :mod:`~collsim.workload.compute`: ComputeModel, its sums over whole blocks.
- :mod:`~collsim.workload.flops`: training FLOPs per step (Narayanan 2021), MFU, HFU.
- :mod:`~collsim.workload.memory`: ZeRO model states, parameters per rank, activations.
"""

from __future__ import annotations

from collsim.core.vocab import RecomputeMode
from collsim.workload.compute import ComputeModel, LayerTimes
from collsim.workload.flops import (
    hardware_flops_per_step,
    hfu,
    mfu,
    model_flops_per_step,
    model_tflops_per_gpu,
    narayanan_hardware_flops,
    narayanan_model_flops,
)
from collsim.workload.memory import (
    ModelStateBytes,
    activation_bytes_per_layer,
    korthikanti_activation_bytes,
    model_state_bytes,
    parameters_per_rank,
)
from collsim.workload.model import TransformerSpec
from collsim.workload.op_costs import OpCost, shape_efficiency
from collsim.workload.presets import PRESETS, get_preset, preset_names

__all__ = [
    "TransformerSpec",
    "PRESETS",
    "get_preset",
    "preset_names",
    "ComputeModel",
    "LayerTimes",
    "OpCost",
    "shape_efficiency",
    "RecomputeMode",
    "model_flops_per_step",
    "hardware_flops_per_step",
    "narayanan_model_flops",
    "narayanan_hardware_flops",
    "model_tflops_per_gpu",
    "mfu",
    "hfu",
    "ModelStateBytes",
    "model_state_bytes",
    "parameters_per_rank",
    "activation_bytes_per_layer",
    "korthikanti_activation_bytes",
]
