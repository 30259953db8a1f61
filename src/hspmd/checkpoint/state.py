"""A rank's training state in a checkpoint: parameters and Adam states, any strategy.

Tensor keys in the shards and manifest are ``param/<name>``, ``exp_avg/<name>`` and
``exp_avg_sq/<name>``; Adam's step count, the training step and the data position are in the
manifest. ``param_specs`` is ``hspmd.plan.params.parameter_annotations(strategy, config)``;
``optimizer_specs`` (the fp32 masters' and Adam states' annotations, e.g.
``state_annotations(..., zero1=True)``) defaults to it. A save is two calls::

    save_rank_state(DIR, step=..., rank=r, params=..., exp_avg=..., exp_avg_sq=...,
                    param_specs=specs)                       # every rank of the strategy
    barrier
    commit_rank_states(DIR, step=..., model=..., strategy=..., param_specs=specs,
                       adam_step=..., data_position=...)     # one process, after the barrier

and a resume one: ``load_rank_state(DIR, rank=r, param_specs=new_specs)`` on every rank,
under any strategy.

    >>> import tempfile, torch
    >>> from hspmd.models import get_config
    >>> from hspmd.plan.params import parameter_annotations
    >>> from hspmd.plan.strategy import parse_strategy
    >>> config = get_config("llama-tiny", num_layers=1)
    >>> one = parameter_annotations(parse_strategy("1x1: R0:L0-0"), config)
    >>> params = {n: torch.ones(s.shape) for n, s in one.items()}
    >>> zeros = {n: torch.zeros(s.shape) for n, s in one.items()}
    >>> folder = tempfile.mkdtemp()
    >>> _ = save_rank_state(folder, step=3, rank=0, params=params, exp_avg=zeros,
    ...                     exp_avg_sq=zeros, param_specs=one)
    >>> _ = commit_rank_states(folder, step=3, model="llama-tiny", strategy="1x1: R0:L0-0",
    ...                        param_specs=one, adam_step=3, data_position=3)
    >>> two = parameter_annotations(parse_strategy("1x1: R0-1:L0-0"), config)
    >>> state = load_rank_state(folder, rank=1, param_specs=two, model="llama-tiny")
    >>> state.step, state.adam_step, tuple(state.params["layers.0.attn.wq.weight"].shape)
    (3, 3, (32, 64))
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from hspmd.checkpoint.store import (
    CheckpointError,
    commit,
    latest,
    load,
    read_manifest,
    staging_dir,
    write_shard,
)
from hspmd.plan.identity import ModelIdentity
from hspmd.plan.params import ParamSpec

__all__ = ["RankState", "commit_rank_states", "load_rank_state", "save_rank_state", "state_specs"]

KINDS = ("param", "exp_avg", "exp_avg_sq")


@dataclass(frozen=True, slots=True)
class RankState:
    """What ``load_rank_state`` gives one rank: its local tensors by parameter name."""

    params: dict[str, torch.Tensor]
    exp_avg: dict[str, torch.Tensor]
    exp_avg_sq: dict[str, torch.Tensor]
    adam_step: int
    step: int
    data_position: Any


def state_specs(
    param_specs: Mapping[str, ParamSpec], optimizer_specs: Mapping[str, ParamSpec] | None = None
) -> dict[str, ParamSpec]:
    """Specs keyed ``param/<name>``, ``exp_avg/<name>``, ``exp_avg_sq/<name>``."""
    optimizer_specs = optimizer_specs or param_specs
    out = {}
    for kind in KINDS:
        source = param_specs if kind == "param" else optimizer_specs
        for name, spec in source.items():
            out[f"{kind}/{name}"] = ParamSpec(f"{kind}/{name}", spec.shape, spec.annotation)
    return out


def save_rank_state(
    directory: str | Path,
    *,
    step: int,
    rank: int,
    params: Mapping[str, torch.Tensor],
    exp_avg: Mapping[str, torch.Tensor],
    exp_avg_sq: Mapping[str, torch.Tensor],
    param_specs: Mapping[str, ParamSpec],
    optimizer_specs: Mapping[str, ParamSpec] | None = None,
) -> Path:
    """Write this rank's shard of step ``step`` (not yet a checkpoint: see ``commit_rank_states``).

    ``params`` maps each parameter this rank holds to its local tensor (the fp32 master under
    mixed precision); ``exp_avg`` / ``exp_avg_sq`` the Adam moments of the same names.
    """
    tensors: dict[str, torch.Tensor] = {}
    for kind, source in zip(KINDS, (params, exp_avg, exp_avg_sq), strict=True):
        tensors.update({f"{kind}/{name}": t for name, t in source.items()})
    specs = state_specs(param_specs, optimizer_specs)
    return write_shard(staging_dir(directory, step), rank=rank, specs=specs, tensors=tensors)


def commit_rank_states(
    directory: str | Path,
    *,
    step: int,
    model: str,
    strategy: str,
    param_specs: Mapping[str, ParamSpec],
    optimizer_specs: Mapping[str, ParamSpec] | None = None,
    adam_step: int,
    data_position: Any,
    keep: int = 1,
    run: Mapping[str, Any] | None = None,
    identity: ModelIdentity | None = None,
    model_config: Mapping[str, Any] | None = None,
) -> Path:
    """Turn the shards every rank wrote for ``step`` into a complete checkpoint (one process);
    ``run`` records what made the data stream (see ``Manifest.run``), ``identity`` the
    model's structure (``hspmd.plan.identity``; a resume checks it), ``model_config`` a
    Hugging Face model's config (``hspmd export --format hf`` writes it back)."""
    specs = state_specs(param_specs, optimizer_specs)
    return commit(
        directory, step=step, model=model, strategy=strategy, specs=specs,
        data_position=data_position, adam_step=adam_step, keep=keep, run=run, identity=identity,
        model_config=model_config,
    )  # fmt: skip


def load_rank_state(
    directory: str | Path,
    *,
    rank: int,
    param_specs: Mapping[str, ParamSpec],
    optimizer_specs: Mapping[str, ParamSpec] | None = None,
    model: str | None = None,
) -> RankState:
    """This rank's parameters and Adam states under the new specs, from the newest complete
    checkpoint in ``directory``; empty dicts on a rank that holds nothing. ``model`` is
    compared only with a checkpoint that records no identity (one that does was checked by
    structure before launch: ``hspmd.train.identity``)."""
    checkpoint = latest(directory)
    manifest = read_manifest(checkpoint)
    specs = state_specs(param_specs, optimizer_specs)
    if model is not None and manifest.identity is None and manifest.model != model:
        raise CheckpointError(
            f"checkpoint {checkpoint} holds model {manifest.model!r}, not {model!r}: "
            "resume with the same model"
        )
    tensors = load(checkpoint, specs, rank)
    by_kind: dict[str, dict[str, torch.Tensor]] = {kind: {} for kind in KINDS}
    for key, tensor in tensors.items():
        kind, name = key.split("/", 1)
        by_kind[kind][name] = tensor
    return RankState(
        params=by_kind["param"],
        exp_avg=by_kind["exp_avg"],
        exp_avg_sq=by_kind["exp_avg_sq"],
        adam_step=manifest.adam_step,
        step=manifest.step,
        data_position=manifest.data_position,
    )
