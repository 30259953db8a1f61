"""Gradient synchronization (Post) as resolved plans, one per bucket of parameters.

A parameter's gradient carries its annotation with the top tier partial (``hP``): each
pipeline holds a summand. Synchronizing is the reshard ``hP -> hD``, which resolution turns
into an all-reduce across pipelines (same TP degree) or a split-all-reduce (different TP
degrees: paper section 5.2). Parameters whose pieces are whole on every rank (duplicate
inside every stage: TP degree 1, or norm weights) and that share an annotation are
flattened into buckets of at most ``bucket_bytes`` (as DDP does; a parameter larger than
that is a bucket alone), filled from the last parameter back. Items come in reverse model
order (by their last parameter), the order in which backward finishes their gradients, so
that ``hspmd.train.overlap`` can issue each as soon as its gradients are final::

    >>> from hspmd.models.llama import get_config
    >>> from hspmd.plan.strategy import parse_strategy
    >>> items = grad_sync_plan(parse_strategy("2x1: R0:L0-3; 2x1: R1:L0-3"), get_config("llama-tiny"))
    >>> [(len(i.names), i.plan.kinds) for i in items]
    [(39, ('all-reduce',))]
    >>> small = grad_sync_plan(parse_strategy("2x1: R0:L0-3; 2x1: R1:L0-3"),
    ...                        get_config("llama-tiny"), bucket_bytes=1 << 18)
    >>> [len(i.names) for i in small], small[0].names[-1]
    ([12, 15, 12], 'head.weight')
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from dataclasses import dataclass

import torch

from hspmd.annotation import DUP, PARTIAL, Annotation
from hspmd.comm.plan import CommPlan
from hspmd.comm.resolve import resolve
from hspmd.models.spec import ModelSpec
from hspmd.plan.params import ParamSpec, parameter_annotations
from hspmd.plan.strategy import Strategy
from hspmd.train.config import TrainError

__all__ = [
    "BUCKET_BYTES",
    "SyncItem",
    "gathered",
    "gathered_fp32",
    "grad_sync_plan",
    "scatter_back",
]


@dataclass(frozen=True, slots=True)
class SyncItem:
    """Parameters synchronized by one plan; ``flat``: their gradients travel concatenated."""

    names: tuple[str, ...]
    plan: CommPlan
    flat: bool

    def __str__(self) -> str:
        what = f"{len(self.names)} params" if self.flat else self.names[0]
        return f"{what}: {' + '.join(self.plan.kinds) or 'nothing'} {self.plan.dst}"


def _whole(annotation: Annotation) -> bool:
    return all(all(d == DUP for d, _ in ds.entries) for ds in annotation.states)


BUCKET_BYTES = 4 << 20  # fp32 gradient bytes per flat bucket (DDP: 25 MiB, first 1 MiB)


def grad_sync_plan(
    strategy: Strategy, config: ModelSpec, *, bucket_bytes: int = BUCKET_BYTES
) -> tuple[SyncItem, ...]:
    """Every plan Post runs, in one order shared by all ranks (pure metadata)."""
    specs = parameter_annotations(strategy, config)
    position = {name: i for i, name in enumerate(specs)}
    buckets: dict[Annotation, list[ParamSpec]] = {}
    items = []
    for spec in specs.values():
        if spec.annotation.hsize == 1:
            continue  # one pipeline: every gradient is already whole where it lives
        if _whole(spec.annotation):
            buckets.setdefault(spec.annotation, []).append(spec)
            continue
        grad = dataclasses.replace(spec.annotation, hdim=PARTIAL, hsizes=None)
        items.append(SyncItem((spec.name,), resolve(grad, spec.annotation, spec.shape), False))
    for annotation, members in buckets.items():
        grad = dataclasses.replace(annotation, hdim=PARTIAL, hsizes=None)
        for chunk in _chunks(members, bucket_bytes):
            plan = resolve(grad, annotation, (sum(_numel(s.shape) for s in chunk),))
            items.append(SyncItem(tuple(s.name for s in chunk), plan, True))
    return tuple(sorted(items, key=lambda item: -max(position[n] for n in item.names)))


def _chunks(members: list[ParamSpec], bucket_bytes: int) -> list[list[ParamSpec]]:
    """``members`` cut into runs of at most ``bucket_bytes`` (fp32), from the last one back;
    each run keeps model order."""
    out: list[list[ParamSpec]] = []
    run: list[ParamSpec] = []
    size = 0
    for spec in reversed(members):
        nbytes = 4 * _numel(spec.shape)
        if run and size + nbytes > bucket_bytes:
            out.append(run[::-1])
            run, size = [], 0
        run.append(spec)
        size += nbytes
    if run:
        out.append(run[::-1])
    return out


def _numel(shape: tuple[int, ...]) -> int:
    n = 1
    for d in shape:
        n *= d
    return n


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
