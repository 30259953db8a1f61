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

``start_plan`` is the asynchronous form: earlier steps run as in ``run_plan``, the plan's
last step is only issued when it is an all-reduce, reduce-scatter, split-all-reduce or
split-reduce-scatter (``ASYNC_KINDS``), and ``.wait()`` on the handle gives what ``run_plan`` would::

    started = start_plan(plan, grad, world, donate=True)   # returns at once
    ...                                                     # compute meanwhile
    out = started.wait()
"""

from __future__ import annotations

from collections.abc import Callable
from contextlib import nullcontext
from dataclasses import dataclass
from typing import Any

import torch

from hspmd.comm.plan import ASYNC_KINDS as PLAN_ASYNC_KINDS
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
    startable,
)
from hspmd.errors import HspmdError
from hspmd.runtime import collectives, slices
from hspmd.runtime.context import Issued, StepContext
from hspmd.runtime.trace import COMM, comm_span
from hspmd.runtime.world import World

__all__ = ["ASYNC_KINDS", "ExecuteError", "Started", "run_plan", "start_plan", "startable"]


class ExecuteError(HspmdError, ValueError):
    """A local tensor that does not fit the plan on this rank."""


@dataclass(eq=False, slots=True)
class Started:
    """A plan whose last step is in flight; ``wait()`` gives this rank's result."""

    works: list[Any]
    then: Callable[[], torch.Tensor | None]
    world: World
    keep: bool  # this rank holds a piece of plan.dst
    kind: str = ""  # the step in flight (traced waits are named after it)

    def wait(self) -> torch.Tensor | None:
        if self.works:
            rec = getattr(self.world, "tracer", None)
            if rec is None:
                self.world.wait(self.works)
            else:
                with rec.span(f"wait {self.kind}", cat="wait", tid=COMM):
                    self.world.wait(self.works)
        out = self.then()
        return out if self.keep else None


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
    return start_plan(plan, local, world, dtype=dtype, donate=donate).wait()


def start_plan(
    plan: CommPlan,
    local: torch.Tensor | None,
    world: World,
    *,
    dtype: torch.dtype | None = None,
    donate: bool = False,
) -> Started:
    """``run_plan`` with the last step left in flight where it is of ``ASYNC_KINDS``.

    Returns without blocking when every earlier step is local (``startable(plan)``). Until
    ``wait()``, ``local`` (with ``donate``) and the result belong to the operation.
    """
    rank = world.rank
    state = _check_input(plan, local, rank)
    like = {
        "dtype": local.dtype if local is not None else dtype,
        "device": local.device if local is not None else world.device,
    }
    owned = donate
    last = len(plan.steps) - 1
    for index, (before, step, after) in enumerate(
        zip(plan.layouts[:-1], plan.steps, plan.layouts[1:], strict=True)
    ):
        if rank in _participants(step):
            if like["dtype"] is None:
                raise ExecuteError(
                    f"rank {rank} receives data in {step.kind} but holds nothing: pass an "
                    "empty placeholder of the right dtype, or dtype="
                )
            ctx = StepContext(world, before, after, plan.shape, like, owned=owned)
            span = _untraced if isinstance(step, Local) else comm_span(world, step.kind)
            if index == last and type(step) in _ISSUERS:
                with span:
                    works, then = _ISSUERS[type(step)](step, state, ctx)
                return Started(works, then, world, rank in plan.dst, step.kind)
            with span:
                result = _EXECUTORS[type(step)](step, state, ctx)
            owned = owned or result is not state  # intermediates are ours to overwrite
            state = result
        elif rank not in after:
            state = None
    done = state
    return Started([], lambda: done, world, rank in plan.dst)


_untraced = nullcontext()


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

_ISSUERS: dict[type[Step], Callable[[Any, torch.Tensor | None, StepContext], Issued]] = {
    AllReduce: collectives.issue_all_reduce,
    ReduceScatter: collectives.issue_reduce_scatter,
    SplitAllReduce: slices.issue_split_all_reduce,
    SplitReduceScatter: slices.issue_split_reduce_scatter,
}

ASYNC_KINDS = frozenset(step.kind for step in _ISSUERS)
# ``startable`` (hspmd.comm.plan, torch-free: the simulator asks it too) names the same kinds
assert ASYNC_KINDS == PLAN_ASYNC_KINDS, "hspmd.comm.plan.ASYNC_KINDS lists the issuers' kinds"
