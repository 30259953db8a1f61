"""Run a CommPlan on this rank with torch.distributed; same results as ``comm.simulate``.

``run_plan(plan, local, world)`` walks the plan's steps; at each step this rank's tensor is
its piece of ``plan.layouts[i]``. A rank that holds nothing passes ``None`` (or an empty
placeholder) and gets ``None`` back where it holds nothing at the end::

    world.prepare([plan])                 # every rank, once: creates the subgroups
    out = run_plan(plan, local, world)    # every rank named by the plan

Executors, one per step kind: ``collectives.py`` (all-reduce, reduce-scatter, all-gather,
all-to-all, local: at most one collective on this rank's group) and ``slices.py``
(send-recv, BSR and the split collectives: one ``batch_isend_irecv``, or one all-reduce per
rank set). Every operation is issued with ``async_op`` and waited through ``World.wait``.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from hspmd.comm.plan import (
    AllGather,
    AllReduce,
    AllToAll,
    BatchedSendRecv,
    CommPlan,
    Local,
    ReduceScatter,
    SendRecv,
    SplitAllGather,
    SplitAllReduce,
    SplitReduceScatter,
    Step,
)
from hspmd.errors import HspmdError
from hspmd.runtime import collectives, slices
from hspmd.runtime.context import StepContext
from hspmd.runtime.world import World


class ExecuteError(HspmdError, ValueError):
    """A local tensor that does not fit the plan on this rank."""


def run_plan(
    plan: CommPlan,
    local: torch.Tensor | None,
    world: World,
    *,
    dtype: torch.dtype | None = None,
    donate: bool = False,
) -> torch.Tensor | None:
    """This rank's tensor after ``plan`` (``None`` where it holds nothing at the end).

    A rank that holds nothing at the start passes ``None`` or an empty placeholder; if it
    receives data it needs the dtype, from the placeholder or ``dtype``. A rank untouched by
    every step gets ``local`` itself back; otherwise the result is a new tensor and ``local``
    is not modified, unless ``donate=True``: then the caller gives ``local`` up, and
    reductions (all-reduce, split-all-reduce) run in place on it, saving a copy.
    """
    rank = world.rank
    state = _check_input(plan, local, rank)
    like = {
        "dtype": local.dtype if local is not None else dtype,
        "device": local.device if local is not None else world.device,
    }
    owned = donate
    for before, step, after in zip(plan.layouts[:-1], plan.steps, plan.layouts[1:], strict=True):
        if rank in _participants(step):
            if like["dtype"] is None:
                raise ExecuteError(
                    f"rank {rank} receives data in {step.kind} but holds nothing: pass an "
                    "empty placeholder of the right dtype, or dtype="
                )
            ctx = StepContext(world, before, after, plan.shape, like, owned)
            result = _EXECUTORS[type(step)](step, state, ctx)
            owned = owned or result is not state  # intermediates are ours to overwrite
            state = result
        elif rank not in after:
            state = None
    return state if rank in plan.dst else None


def _participants(step: Step) -> frozenset[int]:
    """Ranks that issue something in ``step`` (owners of a split-all-gather included)."""
    if isinstance(step, SplitAllGather):
        return step.ranks | {owner for s in step.slices for owner, _ in s.owners}
    return step.ranks


def _check_input(plan: CommPlan, local: torch.Tensor | None, rank: int) -> torch.Tensor | None:
    if rank not in plan.src:
        if local is not None and local.numel():
            raise ExecuteError(
                f"rank {rank} holds no piece of {plan.src} but passed a tensor of shape "
                f"{list(local.shape)}: pass None or an empty placeholder"
            )
        return None
    want = plan.src.piece(rank, plan.shape).shape
    if local is None or tuple(local.shape) != want:
        got = None if local is None else list(local.shape)
        raise ExecuteError(
            f"rank {rank} must pass its piece of {plan.src} for shape {list(plan.shape)}: "
            f"expected shape {list(want)}, got {got}"
        )
    return local


Executor = Callable[[Any, torch.Tensor | None, StepContext], torch.Tensor | None]

_EXECUTORS: dict[type[Step], Executor] = {
    AllReduce: collectives.all_reduce,
    ReduceScatter: collectives.reduce_scatter,
    AllGather: collectives.all_gather,
    AllToAll: collectives.all_to_all,
    Local: collectives.local,
    SendRecv: slices.send_recv,
    BatchedSendRecv: slices.bsr,
    SplitAllReduce: slices.split_all_reduce,
    SplitReduceScatter: slices.split_reduce_scatter,
    SplitAllGather: slices.split_all_gather,
}
