"""``--model hf:DIR``: a Hugging Face causal LM from a local directory, read as data.

``DIR/config.json`` gives the architecture (``transformers.AutoConfig``; a ``model_type``
transformers knows: no ``trust_remote_code``, nothing downloaded), built by
``AutoModelForCausalLM.from_config`` in fp32 (hspmd's masters; ``--dtype`` sets the compute
dtype). ``--config JSON`` overrides config fields (``{"num_hidden_layers": 2}``). Weights,
when the directory has them, come from its safetensors files (``hspmd.models.weights``),
each rank reading only its slices; without them, the model's own initialization from the
seed (``hspmd.models.replay``).

>>> hf_directory("hf:/models/llama"), hf_directory("model.py:make")
(PosixPath('/models/llama'), None)
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from hspmd.models.spec import ModelSpecError

__all__ = ["HF_PREFIX", "build_hf", "hf_config", "hf_directory", "hf_source"]

HF_PREFIX = "hf:"
CONFIG = "config.json"


def hf_directory(source: str) -> Path | None:
    """The directory of an ``hf:DIR`` source; None for any other source."""
    return Path(source[len(HF_PREFIX) :]) if source.startswith(HF_PREFIX) else None


def hf_source(text: str) -> str:
    """``hf:DIR`` with DIR absolute and checked (the CLI's edge): every process, on any
    node, reads the same directory."""
    directory = Path(text[len(HF_PREFIX) :]).expanduser()
    if not (directory / CONFIG).is_file():
        raise ModelSpecError(
            f"--model {text}: no {directory / CONFIG}: give a folder with a Hugging Face "
            "config.json (and safetensors weights), as save_pretrained writes"
        )
    return f"{HF_PREFIX}{directory.resolve()}"


def hf_config(directory: Path, overrides: Mapping[str, Any] | None = None) -> dict[str, Any]:
    """``config.json`` as written, with ``overrides`` (``--config``) applied."""
    path = directory / CONFIG
    try:
        data = json.loads(path.read_text())
    except (OSError, json.JSONDecodeError) as error:
        raise ModelSpecError(f"--model hf:{directory}: cannot read {path}: {error}") from None
    if not isinstance(data, dict):
        raise ModelSpecError(f"--model hf:{directory}: {path} is not a JSON object")
    return {**data, **dict(overrides or {})}


def build_hf(directory: Path, **overrides: Any) -> Any:
    """The causal LM of ``directory``'s config (on the current device: the caller records
    it on meta), in fp32."""
    import torch
    import transformers

    data = hf_config(directory, overrides)
    model_type = data.get("model_type")
    try:
        config = transformers.AutoConfig.from_pretrained(
            str(directory), local_files_only=True, trust_remote_code=False, **overrides
        )
        return transformers.AutoModelForCausalLM.from_config(
            config, trust_remote_code=False, dtype=torch.float32
        )
    except (ValueError, KeyError, OSError) as error:
        first = str(error).strip().splitlines()[0] if str(error).strip() else repr(error)
        raise ModelSpecError(
            f"--model hf:{directory}: transformers cannot build model_type {model_type!r} as a "
            f"causal LM: {first} (hspmd runs no code from the folder: trust_remote_code is off)"
        ) from None
