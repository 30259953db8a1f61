"""A reshard as an autograd Function: forward runs one plan, backward runs another.

The backward plan is resolved statically, ahead of time (DESIGN.md decision 3): it takes the
gradient from the annotation the output's gradient has to the one the input's gradient must
have. For ``[0,1]{0:2} -> [0,1]{D:2}`` (an all-gather) the output gradient of the duplicated
result is usually partial, and the backward is a reduce-scatter::

    forward = CommPlan(split, dup, shape, (AllGather(((0, 1),), dim=0),))
    backward = CommPlan(partial, split, shape, (ReduceScatter(((0, 1),), dim=0),))
    y = reshard(x, forward, backward, world)      # y.backward(g) runs `backward` on g

Ranks that hold nothing before (or after) pass (and get) an empty placeholder that requires
grad, so that every rank named by the backward plan runs it: every such rank must call
backward through its output (``y.sum().backward()`` on a placeholder works), or the others
wait for it until the process-group timeout.
"""

from __future__ import annotations

from typing import Any

import torch

from hspmd.comm.plan import CommPlan
from hspmd.errors import ResolutionError
from hspmd.runtime.execute import run_plan
from hspmd.runtime.world import World


def placeholder(
    *, dtype: torch.dtype = torch.float32, device: torch.device | None = None
) -> torch.Tensor:
    """The empty tensor a rank passes where it holds no piece (requires grad)."""
    return torch.empty(0, dtype=dtype, device=device, requires_grad=True)


def reshard(
    x: torch.Tensor | None,
    forward: CommPlan,
    backward: CommPlan,
    world: World,
    *,
    dtype: torch.dtype | None = None,
) -> torch.Tensor:
    """``forward`` applied to ``x`` on this rank, with ``backward`` as its gradient.

    ``x=None`` (this rank holds no input) stands for ``placeholder(dtype=dtype)``; ``dtype``
    defaults to torch's default dtype and must be the dtype the other ranks send.
    """
    check_pair(forward, backward)
    if x is None:
        x = placeholder(dtype=dtype or torch.get_default_dtype(), device=world.device)
    out = _Reshard.apply(x, forward, backward, world)
    assert isinstance(out, torch.Tensor)
    return out


def check_pair(forward: CommPlan, backward: CommPlan) -> None:
    """Raise unless ``backward`` maps the output's pieces back onto the input's pieces."""
    shape = forward.shape

    def shapes(plan_side: Any) -> dict[int, tuple[int, ...]]:
        return {r: p.shape for r, p in plan_side.pieces(shape).items()}

    if (
        backward.shape != shape
        or shapes(backward.src) != shapes(forward.dst)
        or shapes(backward.dst) != shapes(forward.src)
    ):
        raise ResolutionError(
            f"backward plan {backward.src} -> {backward.dst} {list(backward.shape)} does not "
            f"mirror forward {forward.src} -> {forward.dst} {list(shape)}: the backward must "
            "go from the output's gradient pieces to the input's pieces"
        )


class _Reshard(torch.autograd.Function):
    @staticmethod
    def forward(
        ctx: Any, x: torch.Tensor, forward: CommPlan, backward: CommPlan, world: World
    ) -> torch.Tensor:
        ctx.backward_plan, ctx.world = backward, world
        ctx.input_like = (x.dtype, x.device, world.rank in forward.src)
        local = x if world.rank in forward.src else None
        out = run_plan(forward, local, world, dtype=x.dtype)
        if out is None:
            return x.new_empty(0)
        return out.view_as(out) if out is x else out

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor | None, None, None, None]:
        plan, world = ctx.backward_plan, ctx.world
        dtype, device, holds_input = ctx.input_like
        local = grad.contiguous() if world.rank in plan.src else None
        out = run_plan(plan, local, world, dtype=dtype)
        if not holds_input:
            return torch.zeros(0, dtype=dtype, device=device), None, None, None
        assert out is not None, f"rank {world.rank}: backward plan gave no gradient"
        return out, None, None, None
