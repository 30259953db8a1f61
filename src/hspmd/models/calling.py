"""How a training step calls a user's model, and where its loss is in what it returns.

Two conventions, told apart by the module itself (``convention_of``):

    convention   call                                                  loss
    positional   module(tokens, targets)                               the output, or the one
                                                                       scalar of a tuple
                                                                       (nanoGPT: (logits, loss)),
                                                                       or output["loss"]
    hf           module(input_ids=tokens, labels=targets,              output.loss
                        shift_labels=targets, use_cache=False)

A model trained on a user's dataset (``--dataset``) is called with the items' fields: a
tuple's positionally (``module(input0, input1)``), a dict's by keyword
(``module(image=.., label=..)``), one tensor alone; it returns the loss as above
(``call_fields``).

hspmd's batches hold ``targets`` already shifted (the next token of each position), so a
Hugging Face causal LM gets them as ``shift_labels``: its loss is then the mean over every
position, the same loss as a positional model's.

Packed documents (``--tokens-per-step``) add ``segments``, each position's document id
(B, T). A Hugging Face model gets ``position_ids`` restarting at each document
(``hspmd.attention.document_positions``); a positional model whose forward takes a
``segments`` or ``position_ids`` argument gets it by that name; any other forward gets
nothing more. Attention is kept inside each document by hspmd, not by the model: its causal
SDPA calls run per document (``hspmd.graph.documents``).

>>> import torch
>>> loss_of((torch.ones(2, 3), torch.tensor(0.5)))
tensor(0.5000)
"""

from __future__ import annotations

import inspect
from collections.abc import Callable, Mapping, Sequence
from typing import Any, Literal

import torch
from torch import nn

from hspmd.attention import document_positions, documents_apart
from hspmd.models.spec import ModelSpecError

__all__ = [
    "Convention", "call_fields", "call_step", "check_fields", "convention_of",
    "document_arguments", "eager_step", "fields_call", "loss_of", "step_call",
]  # fmt: skip

Convention = Literal["positional", "hf"]


def convention_of(module: nn.Module) -> Convention:
    """``hf`` for a Hugging Face model whose forward takes ``input_ids`` and ``labels``."""
    try:
        params = inspect.signature(module.forward).parameters
    except (TypeError, ValueError):
        return "positional"
    hf = hasattr(module, "config") and "input_ids" in params and "labels" in params
    return "hf" if hf else "positional"


def loss_of(out: Any) -> torch.Tensor:
    """The scalar loss in a forward's output (module docstring)."""
    if isinstance(out, torch.Tensor):
        if out.dim() != 0:
            raise ModelSpecError(
                f"the forward returned a tensor of shape {list(out.shape)}, not a scalar "
                "loss: return the mean loss of the batch (or a tuple holding it)"
            )
        return out
    loss = None
    if isinstance(out, Mapping) or hasattr(out, "loss"):
        loss = (
            out["loss"]
            if isinstance(out, Mapping) and "loss" in out
            else getattr(out, "loss", None)
        )
    elif isinstance(out, list | tuple):
        scalars = [v for v in out if isinstance(v, torch.Tensor) and v.dim() == 0]
        loss = scalars[0] if len(scalars) == 1 else None
    if not isinstance(loss, torch.Tensor) or loss.dim() != 0:
        raise ModelSpecError(
            f"the forward returned {type(out).__name__} with no single scalar loss in it: "
            "return the loss, a tuple with exactly one scalar (logits, loss), or an object "
            "with .loss"
        )
    return loss


def document_arguments(module: nn.Module, convention: Convention) -> tuple[str, ...]:
    """The packed documents' arguments a step passes ``module``'s forward by name
    (module docstring): ``("position_ids",)`` for Hugging Face, those of ``segments`` and
    ``position_ids`` a positional forward takes, else ``()``."""
    if convention == "hf":
        return ("position_ids",)
    try:
        params = inspect.signature(module.forward).parameters
    except (TypeError, ValueError):
        return ()
    return tuple(name for name in ("segments", "position_ids") if name in params)


def _documents(
    module: nn.Module, convention: Convention, segments: torch.Tensor | None
) -> dict[str, torch.Tensor]:
    if segments is None:
        return {}
    by_name = {"segments": lambda: segments, "position_ids": lambda: document_positions(segments)}
    return {name: by_name[name]() for name in document_arguments(module, convention)}


def call_step(
    module: nn.Module, tokens: torch.Tensor, targets: torch.Tensor, convention: Convention,
    segments: torch.Tensor | None = None,
) -> torch.Tensor:  # fmt: skip
    """One training step's loss of ``module`` on ``(tokens, targets)``; ``segments``: the
    document ids of packed rows (module docstring)."""
    extra = _documents(module, convention, segments)
    if convention == "hf":
        out = module(
            input_ids=tokens, labels=targets, shift_labels=targets, use_cache=False, **extra
        )
    else:
        out = module(tokens, targets, **extra)
    return loss_of(out)


def eager_step(
    module: nn.Module, tokens: torch.Tensor, targets: torch.Tensor, convention: Convention,
    segments: torch.Tensor | None = None,
) -> torch.Tensor:  # fmt: skip
    """``call_step`` run eagerly (the reference): with ``segments``, the forward's causal
    SDPA calls attend inside each document (``hspmd.attention.documents_apart``), as the
    captured graph's do."""
    with documents_apart(segments):
        return call_step(module, tokens, targets, convention, segments)


def step_call(convention: Convention) -> Any:
    """``call_step`` with the convention bound: ``(module, tokens, targets[, segments]) ->
    loss``."""

    def call(
        module: nn.Module, tokens: torch.Tensor, targets: torch.Tensor,
        segments: torch.Tensor | None = None,
    ) -> torch.Tensor:  # fmt: skip
        return call_step(module, tokens, targets, convention, segments)

    return call


def _arguments(structure: str, named: Mapping[str, Any]) -> tuple[tuple[Any, ...], dict[str, Any]]:
    """The forward's positional and keyword arguments for a dataset's fields ``named``."""
    if structure == "dict":
        return (), dict(named)
    if structure == "tuple":
        return tuple(named[f"input{k}"] for k in range(len(named))), {}
    return (named["input"],), {}


def call_fields(
    module: nn.Module, structure: str, named: Mapping[str, torch.Tensor]
) -> torch.Tensor:
    """One step's loss of ``module`` on a dataset's batch: fields by name (module docstring)."""
    args, kwargs = _arguments(structure, named)
    return loss_of(module(*args, **kwargs))


def fields_call(structure: str, names: Sequence[str]) -> Callable[..., torch.Tensor]:
    """``call_fields`` as a step call: ``(module, *fields in names' order) -> loss``."""

    def call(module: nn.Module, *inputs: torch.Tensor) -> torch.Tensor:
        return call_fields(module, structure, dict(zip(names, inputs, strict=True)))

    return call


def check_fields(module: nn.Module, structure: str, names: Sequence[str], source: str) -> None:
    """One line if the forward cannot take the fields ``names`` as ``structure`` passes them."""
    try:
        signature = inspect.signature(module.forward)
    except (TypeError, ValueError):
        return
    args, kwargs = _arguments(structure, dict.fromkeys(names))
    try:
        signature.bind(*args, **kwargs)
    except TypeError as error:
        how = "as keywords" if structure == "dict" else "positionally"
        raise ModelSpecError(
            f"{source}: {type(module).__name__}.forward{signature} does not take the dataset's "
            f"fields {', '.join(names)} {how} ({error}): make the forward take them, or change "
            "the items (a dict's keys are the forward's keywords, a tuple's its arguments)"
        ) from None
