"""Gradient sync inside a stage: deduced parameter gradients that are partial on the TP ranks.

Deduction gives every parameter's gradient annotation (``ag.param_grads``) under the plan
of the rank's pipeline. Where it differs from the parameter's own annotation, the stage's
ranks hold summands of the gradient and must reshard it before the optimizer. Under
sequence parallelism that is every norm weight: its activations are split on the
sequence, so each TP rank sees the gradient of its own tokens only::

    layers.0.attn_norm.weight   grad [0,1]{P:2}  param [0,1]{D:2}   -> all-reduce

Parameters with the same (gradient, parameter) annotations whose pieces are whole travel
flattened in one plan (one all-reduce for all of a stage's norm weights). These plans
are per pipeline; the gradient sync across pipelines (``hspmd.train.sync``, ``hP -> hD``)
runs after them on the stage-synchronized gradients, which together compose the plan
``resolve(deduced grad with hP, parameter annotation)``. The runtime runs them
(``hspmd.runtime.executable.run_stage_grad_sync``).

>>> from hspmd.annotation import parse_annotation
>>> grad, param = parse_annotation("[0,1]{P:2}"), parse_annotation("[0,1]{D:2}")
>>> plans = stage_grad_sync({"a": (grad, param, (4,)), "b": (grad, param, (4,))})
>>> [(item.names, item.plan.kinds) for item in plans]
[(('a', 'b'), ('all-reduce',))]
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass

from hspmd.annotation import DUP, Annotation
from hspmd.comm.plan import CommPlan
from hspmd.comm.resolve import resolve

__all__ = ["StageGradSync", "stage_grad_sync"]


@dataclass(frozen=True, slots=True)
class StageGradSync:
    """Gradients of ``names`` resharded by ``plan`` (concatenated when ``flat``)."""

    names: tuple[str, ...]
    plan: CommPlan

    def __str__(self) -> str:
        return f"{', '.join(self.names)}: {'+'.join(self.plan.kinds)} {self.plan.src} -> {self.plan.dst}"


def _whole(annotation: Annotation) -> bool:
    return all(all(d == DUP for d, _ in ds.entries) for ds in annotation.states)


def stage_grad_sync(
    params: Mapping[str, tuple[Annotation, Annotation, tuple[int, ...]]],
) -> tuple[StageGradSync, ...]:
    """Plans for ``name -> (deduced grad annotation, param annotation, global shape)``.

    Parameters whose gradient already has their annotation need nothing; the others are
    bucketed (whole pieces) or planned one by one (split pieces), in ``params`` order.
    """
    buckets: dict[tuple[Annotation, Annotation], list[tuple[str, int]]] = {}
    items = []
    for name, (grad, param, shape) in params.items():
        if grad == param:
            continue
        if _whole(param):
            buckets.setdefault((grad, param), []).append((name, math.prod(shape)))
        else:
            items.append(StageGradSync((name,), resolve(grad, param, shape)))
    for (grad, param), members in buckets.items():
        numel = sum(n for _, n in members)
        plan = resolve(grad, param, (numel,))
        items.append(StageGradSync(tuple(name for name, _ in members), plan))
    return tuple(items)
