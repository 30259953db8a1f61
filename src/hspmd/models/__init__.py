"""Plain PyTorch models that know nothing of parallelism (only ``hspmd.reshard`` markers)."""

from hspmd.models.llama import (
    PRESETS,
    Llama,
    LlamaConfig,
    ModelConfigError,
    get_config,
    init_parameter,
    init_weights,
    parameter_shapes,
)

__all__ = [
    "PRESETS",
    "Llama",
    "LlamaConfig",
    "ModelConfigError",
    "get_config",
    "init_parameter",
    "init_weights",
    "parameter_shapes",
]
