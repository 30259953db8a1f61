"""The torch side of a ``ModelSpec``: its captured graph, initial values and plain module.

One function per need, for both kinds of model: the Llama presets (``LlamaConfig``:
``hspmd.models.llama``) and user modules (``ModuleModel``: ``hspmd.models.module``).

>>> from hspmd.models.config import get_config
>>> initial_parameter(get_config("llama-tiny"), "norm.weight", seed=0)[:2]
tensor([1., 1.])
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Iterable

import torch
import torch.fx
from torch import nn

from hspmd.graph.export import SEGMENTS_INPUT, TOKEN_INPUTS, capture_step
from hspmd.graph.portable import Sent, captured_cache, receive, sending
from hspmd.models.config import LlamaConfig
from hspmd.models.module import params_before_first_block
from hspmd.models.spec import ModelSpec, ModelSpecError, ModuleModel

__all__ = [
    "Sent", "check_weights", "constant", "initial_parameter", "initial_piece", "model_graph", "params_before_first_block",
    "plain_model", "receive_graphs", "sent_graphs", "step_loss",
]  # fmt: skip


@captured_cache(maxsize=None)  # a launcher sends its workers these (hspmd.graph.portable)
def _llama_graph(config: LlamaConfig) -> torch.fx.GraphModule:
    from hspmd.models.llama import Llama

    with torch.device("meta"):
        module = Llama(config)
    # the same capture as every user model's (its own markers; packed documents' ids)
    return capture_step(module, call=_llama_step, inputs=(*TOKEN_INPUTS, SEGMENTS_INPUT))


def _llama_step(
    module: nn.Module, tokens: torch.Tensor, targets: torch.Tensor, segments: torch.Tensor
) -> torch.Tensor:
    return module(tokens, targets, segments)


def model_graph(model: ModelSpec) -> torch.fx.GraphModule:
    """The defined graph on the meta device, markers included. Shared by every caller:
    read it, never change it in place (docs/decisions.md, "Shared caches")."""
    if isinstance(model, LlamaConfig):
        return _llama_graph(model)
    from hspmd.models.module import model_graph as module_graph

    return module_graph(_module(model))


def sent_graphs(models: Callable[[], Iterable[ModelSpec]]) -> Sent:
    """The captures that ``models()`` (which reads a run's models) and their graphs need,
    as data that a launcher sends its workers: ``receive_graphs`` there, and no rank
    captures the model again (``hspmd.graph.portable``)."""
    with sending() as reading:
        for model in models():
            model_graph(model)
    return reading.sent()


def receive_graphs(sent: Sent) -> None:
    """In a worker, before it reads the run's models: take the launcher's captures."""
    receive(sent)


def initial_parameter(model: ModelSpec, name: str, *, seed: int) -> torch.Tensor:
    """The initial fp32 value of parameter ``name`` at its global shape (plan-free)."""
    if isinstance(model, LlamaConfig):
        from hspmd.models.llama import init_parameter

        return init_parameter(name, model, seed=seed)
    return initial_piece(model, name, seed=seed, region=None)


def initial_piece(
    model: ModelSpec, name: str, *, seed: int, region: tuple[tuple[int, int], ...] | None
) -> torch.Tensor:
    """``initial_parameter(model, name)[region]`` (a ``Piece``'s region), computed or read
    alone where the model allows: a user module's slice never needs the whole parameter
    (``hspmd.models.initial``); a Llama preset's parameter is drawn whole, then sliced."""
    if isinstance(model, LlamaConfig):
        from hspmd.models.llama import init_parameter

        whole = init_parameter(name, model, seed=seed)
        return whole if region is None else whole[tuple(slice(a, b) for a, b in region)].clone()
    from hspmd.models.initial import initial_value

    module = _module(model)
    if name not in module.parameter_shapes():
        raise ModelSpecError(f"{model.name} has no parameter {name!r}")
    return initial_value(module, name, seed=seed, region=region).float()


def constant(model: ModelSpec, target: str, *, seed: int) -> torch.Tensor:
    """A buffer the graph reads (``get_attr`` of no parameter), e.g. the RoPE tables."""
    if isinstance(model, LlamaConfig):
        cos, sin = _rope_tables(model)
        tables = {"rope_cos": cos, "rope_sin": sin}
        if target in tables:
            return tables[target].clone()  # the cached pair stays unchanged
    else:
        from hspmd.models.initial import initial_value, recording

        found = recording(_module(model))
        buffers = dict(found.module.named_buffers()) if found else None
        if buffers is None or target in buffers:
            try:
                return initial_value(_module(model), target, seed=seed)
            except ModelSpecError:
                pass
    raise ModelSpecError(
        f"{model.name}: the graph reads {target!r}, which is neither a parameter nor a "
        "buffer of the module: register tensors the forward reads as buffers"
    )


@functools.lru_cache(maxsize=4)
def _rope_tables(config: LlamaConfig) -> tuple[torch.Tensor, torch.Tensor]:
    """Both RoPE tables, computed once for the two buffers a graph reads."""
    from hspmd.models.llama import rope_tables

    return rope_tables(config)


def plain_model(model: ModelSpec, *, seed: int) -> nn.Module:
    """The whole model on the CPU, initialized as ``initial_parameter`` (reference runs)."""
    if isinstance(model, LlamaConfig):
        from hspmd.models.llama import Llama, init_weights

        return init_weights(Llama(model), seed)
    from hspmd.models.initial import plain_module

    return plain_module(_module(model), seed)


def check_weights(model: ModelSpec) -> None:
    """An ``hf:DIR`` model's safetensors files hold every parameter at its shape and are
    whole (headers only: one line before launch); nothing for other models."""
    if isinstance(model, ModuleModel):
        from hspmd.models.initial import weight_files

        weight_files(model)


def step_loss(model: ModelSpec, module: nn.Module, *inputs: torch.Tensor) -> torch.Tensor:
    """The loss of one step of ``plain_model(model)`` on ``(tokens, targets)`` (with packed
    documents ``(tokens, targets, segments)``; or a dataset's fields, in ``model.batch``
    order), called the way the model is called (``hspmd.models.calling``: positional,
    Hugging Face, or the items' fields)."""
    if isinstance(model, ModuleModel):
        from hspmd.models.calling import call_fields, eager_step

        if model.batch:
            named = dict(zip((f.name for f in model.batch), inputs, strict=True))
            return call_fields(module, model.structure, named)
        tokens, targets, *segments = inputs
        return eager_step(module, tokens, targets, model.convention, *segments)  # type: ignore[arg-type]
    return module(*inputs)


def _module(model: ModelSpec) -> ModuleModel:
    if not isinstance(model, ModuleModel):
        raise ModelSpecError(f"unknown kind of model: {type(model).__name__}")
    return model
