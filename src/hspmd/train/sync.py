"""Gradient synchronization's tensors: what Post's plans (``hspmd.specialize.sync_plans``) run on.

The plans themselves are pure metadata and live in ``hspmd.specialize.sync_plans`` (the
simulator prices them too); ``SyncItem``, ``grad_sync_plan`` and ``BUCKET_BYTES`` are
re-exported here for the trainer's modules.
"""

from __future__ import annotations

from collections.abc import Mapping

import torch

from hspmd.specialize.sync_plans import BUCKET_BYTES, SyncItem, grad_sync_plan
from hspmd.train.config import TrainError

__all__ = [
    "BUCKET_BYTES",
    "SyncItem",
    "gathered",
    "gathered_fp32",
    "grad_of",
    "grad_sync_plan",
    "scatter_back",
]


def gathered(item: SyncItem, grads: list[torch.Tensor]) -> torch.Tensor:
    """The tensor ``item``'s plan reduces: the gradients concatenated when ``flat``."""
    return torch.cat([g.reshape(-1) for g in grads]) if item.flat else grads[0]


def gathered_fp32(item: SyncItem, params: Mapping[str, torch.Tensor]) -> torch.Tensor:
    """``item``'s gradients of ``params`` in fp32, concatenated when ``flat``: what a Post
    whose masters are fp32 syncs."""
    return gathered(item, [grad_of(params[n], n).float() for n in item.names])


def scatter_back(out: torch.Tensor, grads: list[torch.Tensor]) -> None:
    """Copy a synchronized (flat) result back into the gradients it came from."""
    offset = 0
    for g in grads:
        g.copy_(out[offset : offset + g.numel()].view_as(g))
        offset += g.numel()


def grad_of(param: torch.Tensor, name: str) -> torch.Tensor:
    """``param``'s gradient after the backward pass; every local parameter must have one."""
    if param.grad is None:
        raise TrainError(
            f"parameter {name} got no gradient in the backward pass: every parameter of a "
            "stage must take part in its loss (remove or freeze unused parameters)"
        )
    return param.grad
