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

``training_masks`` is how hspmd captures any Hugging Face model's training step (below).
"""

from __future__ import annotations

import json
from collections.abc import Iterator, Mapping
from contextlib import ExitStack, contextmanager
from pathlib import Path
from typing import Any

from hspmd.models.spec import ModelSpecError

__all__ = ["HF_PREFIX", "build_hf", "hf_config", "hf_directory", "hf_source", "training_masks"]

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


@contextmanager
def _replaced(owner: Any, name: str, value: Any) -> Iterator[None]:
    """``owner.name = value`` within; nothing if ``owner`` has no ``name`` (another version)."""
    if not hasattr(owner, name):
        yield
        return
    before = getattr(owner, name)
    setattr(owner, name, value)
    try:
        yield
    finally:
        setattr(owner, name, before)


@contextmanager
def training_masks(*, causal_skip: bool) -> Iterator[None]:
    """Within it, a Hugging Face model's masks are built for a training step as its eager
    forward builds them, also under ``torch.export`` (hspmd's capture).

    transformers decides two things from values it cannot read while exporting, and then
    builds a ``(B, 1, T, T)`` mask for every batch: SDPA then runs with the mask (the fused
    kernel computes the blocks above the diagonal too) and GQA copies k and v to every head
    (``repeat_kv``), up to 1.13x the eager step (``benchmarks/models.py``):

    - ``find_packed_sequence_indices`` reads ``position_ids`` for packed rows. hspmd keeps
      packed documents apart itself (``hspmd.graph.documents``: per-document causal
      attention from ``segments``) and gives the model restarting ``position_ids`` only for
      the positions, so here it finds none, as eager does for one sequence per row;
    - ``causal_skip``: ``_ignore_causal_mask_sdpa`` refuses to rely on SDPA's
      ``is_causal`` under export, because an exported inference graph may later run one
      query against a cache. A training step has no cache and ``q_length == kv_length``,
      so eager's decision holds: no padding mask, ``is_causal=True``, GQA inside SDPA. A
      sliding window longer than some lengths the model takes makes that decision depend on
      the length; the capture then says so (``LengthRangeError``) and is taken again
      without ``causal_skip``.
    """
    try:
        import transformers.masking_utils as masking
    except ImportError:
        yield
        return
    with ExitStack() as stack:
        stack.enter_context(_replaced(masking, "find_packed_sequence_indices", lambda _: None))
        if causal_skip:
            stack.enter_context(_replaced(masking, "is_torchdynamo_exporting", lambda: False))
        stack.enter_context(_portable_experts())
        yield


@contextmanager
def _portable_experts() -> Iterator[None]:
    """Within it, a mixture-of-experts layer that asks for transformers' default
    ``grouped_mm`` runs ``batched_mm``: the same sums, none of its device branches.

    ``grouped_mm`` counts the tokens per expert with ``histc`` on ints unless
    ``device.type in ("cpu", "mps")``; hspmd captures on meta, so the graph kept the ints,
    which the CPU's ``histc`` refuses at run time. ``batched_mm`` gathers each token's
    experts' weights and runs one ``bmm``: no device test, no data-dependent sizes.
    (Mixtral, Qwen2-MoE, OLMoE and every family on ``use_experts_implementation``.)"""
    try:
        from transformers.integrations import moe
    except ImportError:
        yield
        return
    grouped = getattr(moe, "grouped_mm_experts_forward", None)
    batched = getattr(moe, "batched_mm_experts_forward", None)
    interface = getattr(moe, "ALL_EXPERTS_FUNCTIONS", None)
    if grouped is None or batched is None or interface is None:
        yield  # another version of transformers
        return
    chosen = type(interface).get_interface

    def portable(self: Any, implementation: str, default: Any) -> Any:
        found = chosen(self, implementation, default)
        return batched if found is grouped else found

    with _replaced(type(interface), "get_interface", portable):
        yield
