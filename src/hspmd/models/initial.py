"""Initial values of a user module's parameters, one slice at a time (DESIGN 5 and 16).

``initial_value(model, name, seed=..., region=...)`` is a function of the model, the name,
the seed and the box only (never of the plan), and reads or computes nothing else:

    source                                       value of ``name`` (``region`` of it)
    ``hf:DIR`` with safetensors weights          the files' slice (``hspmd.models.weights``)
    any factory (and ``hf:DIR`` without them)    the factory's own initialization, recorded
                                                 on meta and replayed for that slice
                                                 (``hspmd.models.record``, ``.replay``)
    a factory whose init cannot be replayed      the factory run on the CPU after
    (writes through ``out=``, data-dependent)    ``torch.manual_seed(seed)`` (whole, once per
                                                 process: the old way, kept as the fallback)

``plain_module`` (the reference run) takes every value from the same function, so every
strategy starts from the reference's weights.

>>> from hspmd.models.module import load_model
>>> model = load_model("hspmd.models.examples:gpt2", {"num_layers": 2})
>>> whole = initial_value(model, "layers.0.attn.q.weight", seed=0)
>>> part = initial_value(model, "layers.0.attn.q.weight", seed=0, region=((8, 16), (0, 32)))
>>> bool((part == whole[8:16]).all())
True
"""

from __future__ import annotations

import functools
from typing import Any

import torch
from torch import nn

from hspmd.models.hf import hf_directory
from hspmd.models.module import FactoryError, build_module
from hspmd.models.record import Recording, record
from hspmd.models.replay import Region, Replay, ReplayError
from hspmd.models.spec import ModelSpecError, ModuleModel
from hspmd.models.weights import WeightFiles

__all__ = ["initial_value", "plain_module", "recording", "weight_files"]


def _factory(model: ModuleModel) -> Any:
    return lambda: build_module(model.source, dict(model.kwargs))


@functools.lru_cache(maxsize=4)
def recording(model: ModuleModel) -> Recording | None:
    """The factory's initialization as data (None: it cannot run on meta here)."""
    try:
        return record(_factory(model))
    except FactoryError:  # data-dependent code in the factory (``.item()``): the fallback
        return None
    except ModelSpecError:
        raise
    except Exception:  # data-dependent code in the factory (``.item()``): the fallback
        return None


@functools.lru_cache(maxsize=4)
def _replay(model: ModuleModel, seed: int) -> Replay | None:
    found = recording(model)
    return None if found is None else Replay(found, seed=seed)


@functools.lru_cache(maxsize=4)
def weight_files(model: ModuleModel) -> WeightFiles | None:
    """The pretrained weights of an ``hf:DIR`` model, checked against its parameters."""
    directory = hf_directory(model.source)
    if directory is None:
        return None
    files = WeightFiles.find(directory)
    if files is not None:
        found = recording(model)
        files.check(model.parameter_shapes(), found.aliases() if found else {})
    return files


def initial_value(
    model: ModuleModel, name: str, *, seed: int, region: Region | None = None
) -> torch.Tensor:
    """Parameter or buffer ``name``'s initial value, or its box ``region`` (a new tensor,
    in the dtype the module makes it; module docstring)."""
    files = weight_files(model)
    if files is not None:
        found = recording(model)
        stored = files.name_of(name, found.aliases() if found else {})
        if stored is not None:
            return files.read(stored, region)
    replay = _replay(model, seed)
    if replay is not None and name in replay.rec.refs:
        try:
            return replay.value(name, region)
        except ReplayError:
            pass
    state = _cpu_state(model, seed)
    if name not in state:
        raise ModelSpecError(f"{model.name} has no parameter or buffer {name!r}")
    whole = state[name]
    return (whole if region is None else whole[tuple(slice(a, b) for a, b in region)]).clone()


@functools.lru_cache(maxsize=1)
def _cpu_state(model: ModuleModel, seed: int) -> dict[str, torch.Tensor]:
    """The fallback: the module built on the CPU after ``torch.manual_seed(seed)``."""
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        with torch.device("cpu"):
            module = build_module(model.source, dict(model.kwargs))
    state: dict[str, torch.Tensor] = dict(module.named_parameters(remove_duplicate=False))
    state |= dict(module.named_buffers(remove_duplicate=False))
    return {name: t.detach() for name, t in state.items()}


@torch.no_grad()
def plain_module(model: ModuleModel, seed: int) -> nn.Module:
    """The module itself on the CPU, every value from ``initial_value`` (the reference)."""
    found = record(_factory(model)) if recording(model) is not None else None
    if found is None:  # the factory cannot run on meta: build it on the CPU, then set
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(seed)
            module = build_module(model.source, dict(model.kwargs))
        _set_all(module, model, seed, None)
        return module
    _set_all(found.module, model, seed, Replay(found, seed=seed))
    return found.module


def _set_all(module: nn.Module, model: ModuleModel, seed: int, replay: Replay | None) -> None:
    """Give every parameter, buffer (and meta tensor attribute) its initial value."""
    names: dict[int, str] = {}
    for name, tensor in [
        *module.named_parameters(remove_duplicate=False),
        *module.named_buffers(remove_duplicate=False),
    ]:
        names.setdefault(id(tensor), name)
    done: dict[int, torch.Tensor] = {}
    for path, sub in module.named_modules():
        for key, param in list(sub._parameters.items()):
            if param is not None and id(param) not in done:
                value = initial_value(model, names[id(param)], seed=seed)
                done[id(param)] = nn.Parameter(value, requires_grad=param.requires_grad)
            if param is not None:
                sub._parameters[key] = done[id(param)]
        for key, buffer in list(sub._buffers.items()):
            if buffer is not None:
                if id(buffer) not in done:
                    done[id(buffer)] = initial_value(model, names[id(buffer)], seed=seed)
                sub._buffers[key] = done[id(buffer)]
        if replay is not None:
            for key, ref in replay.rec.attributes.get(path, {}).items():
                if isinstance(getattr(sub, key, None), torch.Tensor):
                    setattr(sub, key, replay.tensor(ref).clone())
