"""The Qwen3.5-MoE model: ModelConfig (architecture numbers), Qwen35MoE (PyTorch module), build_model."""

from qmoe.model.config import ModelConfig
from qmoe.model.qwen35_moe import (
    KERNEL_GROUPS,
    Qwen35MoE,
    active_weight_nbytes,
    build_model,
    fp8_parameters,
    fp8_weight_names,
    weight_nbytes,
)

__all__ = [
    "KERNEL_GROUPS",
    "ModelConfig",
    "Qwen35MoE",
    "active_weight_nbytes",
    "build_model",
    "fp8_parameters",
    "fp8_weight_names",
    "weight_nbytes",
]
