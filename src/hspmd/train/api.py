"""The Python API: ``hspmd.fit(model, strategy=..., ...)``, which the CLI mirrors.

``model`` is a preset name (``"llama-tiny"``), a factory's source (``"my_model.py:make"``,
``"package.module:make"``) or the factory itself (a module-level function: processes
rebuild the model from its module, or from the file of ``__main__``). Keyword arguments
are ``TrainConfig``'s fields; ``model_kwargs`` go to the factory::

    import hspmd

    def make():
        return MyModel(width=64)

    if __name__ == "__main__":          # the ranks are spawned processes
        result = hspmd.fit(make, strategy="2x1: R0-1:L0-1; 2x1: R2:L0-1", steps=10)
        print(result.losses)

``reference=True`` trains the plain module on this process instead (same data).
"""

from __future__ import annotations

import sys
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

from hspmd.train.config import TrainConfig, TrainError
from hspmd.train.reference import TrainResult, run_reference
from hspmd.train.trainer import train as train_config

__all__ = ["fit", "model_source"]


def model_source(model: str | Callable[..., Any]) -> str:
    """The text form of ``model`` that every process can load (module docstring)."""
    if isinstance(model, str):
        return model
    name = getattr(model, "__qualname__", "")
    module = getattr(model, "__module__", None)
    if not callable(model) or not name.isidentifier():
        raise TrainError(
            f"model {model!r}: give a preset name, 'FILE.py:FUNCTION', or a module-level "
            "function that returns the nn.Module (not a lambda or a nested function)"
        )
    if module == "__main__":
        path = getattr(sys.modules["__main__"], "__file__", None)
        if path is None:
            raise TrainError(
                f"model {name}: defined in an interactive session, which worker processes "
                "cannot import; put it in a file and pass 'FILE.py:FUNCTION'"
            )
        return f"{Path(path).resolve()}:{name}"
    return f"{module}:{name}"


def fit(
    model: str | Callable[..., Any] = "llama-tiny",
    *,
    model_kwargs: Mapping[str, Any] | None = None,
    reference: bool = False,
    **config: Any,
) -> TrainResult:
    """Train ``model`` as ``TrainConfig(**config)`` says; see the module docstring."""
    items = tuple(sorted((model_kwargs or {}).items()))
    run = TrainConfig(model=model_source(model), model_overrides=items, **config)
    return run_reference(run) if reference else train_config(run)
