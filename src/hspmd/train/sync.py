"""Gradient synchronization (Post) as resolved plans, one per bucket of parameters.

A parameter's gradient carries its annotation with the top tier partial (``hP``): each
pipeline holds a summand. Synchronizing is the reshard ``hP -> hD``, which resolution turns
into an all-reduce across pipelines (same TP degree) or a split-all-reduce (different TP
degrees: paper section 5.2). Parameters whose pieces are whole on every rank (duplicate
inside every stage: TP degree 1, or norm weights) and that share an annotation are
flattened into one bucket, so the stage's whole gradient travels in one all-reduce::

    >>> from hspmd.models.llama import get_config
    >>> from hspmd.plan.strategy import parse_strategy
    >>> items = grad_sync_plan(parse_strategy("2x1: R0:L0-3; 2x1: R1:L0-3"), get_config("llama-tiny"))
    >>> [(len(i.names), i.plan.kinds) for i in items]
    [(39, ('all-reduce',))]
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch

from hspmd.annotation import DUP, PARTIAL, Annotation
from hspmd.comm.plan import CommPlan
from hspmd.comm.resolve import resolve
from hspmd.models.llama import LlamaConfig
from hspmd.plan.params import ParamSpec, parameter_annotations
from hspmd.plan.strategy import Strategy
from hspmd.runtime.execute import run_plan
from hspmd.runtime.world import World

__all__ = ["SyncItem", "grad_sync_plan", "run_grad_sync"]


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


def grad_sync_plan(strategy: Strategy, config: LlamaConfig) -> tuple[SyncItem, ...]:
    """Every plan Post runs, in one order shared by all ranks (pure metadata)."""
    specs = parameter_annotations(strategy, config)
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
        numel = sum(_numel(s.shape) for s in members)
        grad = dataclasses.replace(annotation, hdim=PARTIAL, hsizes=None)
        plan = resolve(grad, annotation, (numel,))
        items.append(SyncItem(tuple(s.name for s in members), plan, True))
    return tuple(items)


def _numel(shape: tuple[int, ...]) -> int:
    n = 1
    for d in shape:
        n *= d
    return n


@torch.no_grad()
def run_grad_sync(
    items: tuple[SyncItem, ...], params: dict[str, torch.Tensor], world: World
) -> None:
    """Replace each local gradient by its synchronized value (in place)."""
    for item in items:
        if world.rank not in item.plan.src:
            continue
        grads = [_grad(params[n]) for n in item.names]
        local = torch.cat([g.reshape(-1) for g in grads]) if item.flat else grads[0]
        out = run_plan(item.plan, local, world)
        assert out is not None
        offset = 0
        for g in grads:
            g.copy_(out[offset : offset + g.numel()].view_as(g))
            offset += g.numel()


def _grad(param: torch.Tensor) -> torch.Tensor:
    assert param.grad is not None, "every local parameter gets a gradient in B"
    return param.grad
