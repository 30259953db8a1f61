"""Plain PyTorch models that know nothing of parallelism (only ``hspmd.reshard`` markers).

The configuration (``hspmd.models.config``) is importable without torch; the modules and
initializers load ``hspmd.models.llama`` (and torch) on first use.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from hspmd.models.config import PRESETS, LlamaConfig, ModelConfigError, get_config, parameter_shapes
from hspmd.models.spec import ModelSpec

if TYPE_CHECKING:
    from hspmd.models.llama import Llama, init_parameter, init_weights

__all__ = [
    "PRESETS",
    "Llama",
    "LlamaConfig",
    "ModelConfigError",
    "get_config",
    "get_model",
    "init_parameter",
    "init_weights",
    "parameter_shapes",
]

_TORCH_NAMES = ("Llama", "init_parameter", "init_weights")


def get_model(name: str, **kwargs: object) -> ModelSpec:
    """A preset (``kwargs`` override its fields) or any nn.Module's factory,
    ``FILE.py:FUNCTION`` / ``package.module:FUNCTION`` (``kwargs`` are its arguments)."""
    if ":" in name:
        from hspmd.models.module import load_model

        return load_model(name, kwargs)
    return get_config(name, **kwargs)


def __getattr__(name: str) -> object:
    # Lazy, so that planning code reading a config does not import torch.
    if name in _TORCH_NAMES:
        from hspmd.models import llama

        return getattr(llama, name)
    raise AttributeError(f"module 'hspmd.models' has no attribute {name!r}")
