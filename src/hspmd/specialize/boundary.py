"""Pipeline boundaries: the resolved plans between adjacent stages (run by the runtime).

A stage boundary is the ``layers.{i}.input`` marker whose input lives on the previous
stage. Inside a pipeline the residual stream is duplicate over each stage's ranks, so
resolution gives a send-recv (same TP degree: rank j sends to rank j) or a BSR (different
degrees: each receiver gets the whole tensor from one owner)::

    "4x1: R0-1:L0-1 R2-3:L2-3"   layers.2.input  forward send-recv (0->2, 1->3)
    "4x1: R0-1:L0-1 R2:L2-3"     layers.2.input  forward bsr (0->2), backward bsr (2->0, 2->1)

The plans are those of the rank's own pipeline (one subgroup, micro-batch shape): each
pipeline runs its micro-batches on its own schedule. In 1F1B neighbouring stages send to
each other at the same moment, so the runtime's ``send`` (``hspmd.runtime.boundary``)
only issues ``isend`` (wait on the returned works later) while ``recv`` blocks::

    plans = boundary_plans(strategy, config, rank, (micro_batch, seq_len, hidden))
    x = recv(plans.incoming.forward, world)              # F, not stage 0
    works += send(plans.outgoing.forward, out, world)    # F, not the last stage
    grad = recv(plans.outgoing.backward, world)          # B, not the last stage
    works += send(plans.incoming.backward, x.grad, world)  # B, not stage 0
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from dataclasses import dataclass

from hspmd.comm.plan import CommPlan
from hspmd.comm.resolve import resolve
from hspmd.comm.sizing import sized
from hspmd.errors import HspmdError
from hspmd.models.spec import ModelSpec
from hspmd.plan.schema import activation_annotations
from hspmd.plan.strategy import Strategy, StrategyOptions
from hspmd.specialize.cut import locate

__all__ = [
    "Boundary",
    "BoundaryError",
    "BoundaryPlans",
    "boundary_plans",
    "sized_boundaries",
]


class BoundaryError(HspmdError, ValueError):
    """A boundary plan that is not a point-to-point transfer between two stages (raised
    when the runtime runs it)."""


@dataclass(frozen=True, slots=True)
class Boundary:
    """The ``name`` marker between two stages: activation forward, gradient backward."""

    name: str
    forward: CommPlan
    backward: CommPlan

    def __str__(self) -> str:
        fwd, bwd = "+".join(self.forward.kinds), "+".join(self.backward.kinds)
        return (
            f"{self.name}: {self.forward.src} -> {self.forward.dst} forward {fwd}, backward {bwd}"
        )


@dataclass(frozen=True, slots=True)
class BoundaryPlans:
    """The boundaries before (``incoming``, None on stage 0) and after a rank's stage."""

    incoming: Boundary | None
    outgoing: Boundary | None


def boundary_plans(
    strategy: Strategy,
    config: ModelSpec,
    rank: int,
    micro_batch_shape: Sequence[int],
    *,
    options: StrategyOptions | None = None,
) -> BoundaryPlans:
    """The forward and backward plans of ``rank``'s incoming and outgoing boundary.

    ``micro_batch_shape`` is the activation's ``(micro_batch_size, seq_len, hidden)``.
    Forward ``resolve(prev stage's residual, this stage's)``; backward the reverse (the
    gradient of a duplicate residual is duplicate: every TP rank holds all of it).

    >>> from hspmd.models.llama import get_config
    >>> from hspmd.plan.strategy import parse_strategy
    >>> plans = boundary_plans(parse_strategy("4x1: R0-1:L0-1 R2:L2-3"),
    ...     get_config("llama-tiny"), 2, (1, 16, 64))
    >>> print(plans.incoming)
    layers.2.input: [0,1]{D:2} -> [2]{} forward bsr, backward bsr
    >>> plans.outgoing is None
    True
    """
    p, s = locate(strategy, rank)
    pipeline = strategy.pipelines[p]
    shape = tuple(micro_batch_shape)
    acts = activation_annotations(Strategy((pipeline,)), config, seq_len=shape[1], options=options)

    def between(stage: int) -> Boundary:
        """The boundary entering ``pipeline.stages[stage]``."""
        layer = pipeline.stages[stage].first_layer
        src = acts[f"layers.{layer - 1}.input"].annotation  # the previous stage's residual
        dst = acts[f"layers.{layer}.input"].annotation
        name = f"layers.{layer}.input"
        return Boundary(name, resolve(src, dst, shape), resolve(dst, src, shape))

    last = len(pipeline.stages) - 1
    return BoundaryPlans(between(s) if s > 0 else None, between(s + 1) if s < last else None)


@functools.lru_cache(maxsize=256)
def sized_boundaries(plans: BoundaryPlans, shape: tuple[int, ...]) -> BoundaryPlans:
    """``plans`` (resolved at the maximum length) for a micro-batch activation of ``shape``
    (``hspmd.comm.sizing``): a shorter sequence moves shorter slices."""

    def one(boundary: Boundary | None) -> Boundary | None:
        if boundary is None:
            return None
        return Boundary(
            boundary.name, sized(boundary.forward, shape), sized(boundary.backward, shape)
        )

    return BoundaryPlans(one(plans.incoming), one(plans.outgoing))
