"""Many plans started as one batch: ZeRO's bucketed gradient reduces and layer gathers.

A plan whose only step is a split-reduce-scatter or a split-all-gather (point-to-point
slices, ``hspmd.runtime.slices``: what resolution gives between the replicas of a parameter,
even or uneven parts) is queued on one shared ``Exchange``, so a bucket of ``k`` plans costs
one ``batch_isend_irecv`` with one packed buffer per peer instead of ``k``. Plans whose only
step is a reduce-scatter or an all-gather (ZeRO's reduce and gather over identical replicas)
are packed per group into one collective, as FSDP2 packs a module's gradients and gathers
its parameters. Any other plan (another collective, several steps, an identity) is started
on its own (``start_plan``), in the same order on every rank::

    started = start_plans(plans, {0: g0, 1: g1}, world, tag=ZERO_REDUCE)
    ...                                  # compute meanwhile
    outs = started.wait()                # {0: shard of g0, 1: shard of g1}

``outs``: where given, a split-all-gather fills that tensor in place (a ZeRO-3 parameter's
storage) instead of a new one. ``tag`` keeps concurrent streams between the same two ranks
apart (``Exchange``).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from hspmd.comm.plan import AllGather, CommPlan, ReduceScatter, SplitAllGather, SplitReduceScatter
from hspmd.runtime.collectives import (
    issue_packed_all_gather,
    issue_packed_reduce_scatter,
)
from hspmd.runtime.context import StepContext
from hspmd.runtime.execute import Started, start_plan
from hspmd.runtime.p2p import Exchange
from hspmd.runtime.slices import queue_split_all_gather, queue_split_reduce_scatter
from hspmd.runtime.trace import comm_span
from hspmd.runtime.world import World

__all__ = ["ZERO_GATHER", "ZERO_REDUCE", "StartedPlans", "batchable", "start_plans"]

ZERO_REDUCE = 1  # the p2p tag of ZeRO's gradient reduces
ZERO_GATHER = 2  # the p2p tag of ZeRO-3's parameter gathers


def batchable(plan: CommPlan) -> bool:
    """Whether ``plan`` joins a shared batch: its one step is a split-reduce-scatter or a
    split-all-gather."""
    return len(plan.steps) == 1 and isinstance(plan.steps[0], SplitReduceScatter | SplitAllGather)


@dataclass(eq=False, slots=True)
class StartedPlans:
    """Plans in flight; ``wait()`` gives each one's result on this rank, by index."""

    world: World
    works: list[Any]
    unpack: Callable[[], None]
    batched: dict[int, Callable[[], torch.Tensor | None]] = field(default_factory=dict)
    alone: dict[int, Started] = field(default_factory=dict)

    def wait(self) -> dict[int, torch.Tensor]:
        self.world.wait(self.works)
        self.unpack()
        out = {}
        for index, then in self.batched.items():
            value = then()
            if value is not None:
                out[index] = value
        for index, started in self.alone.items():
            value = started.wait()
            if value is not None:
                out[index] = value
        return out


def start_plans(
    plans: Sequence[CommPlan], local: Mapping[int, torch.Tensor], world: World, *,
    tag: int, outs: Mapping[int, torch.Tensor] | None = None, dtype: torch.dtype | None = None,
    kind: str = "batched",
) -> StartedPlans:  # fmt: skip
    """Start every plan of ``plans`` this rank takes part in (``local[i]``: its piece of
    plan ``i``'s source, absent where it holds none; ``dtype``: of what it receives then;
    ``kind``: the batch's name in traces)."""
    rank, outs = world.rank, outs or {}
    exchange = Exchange(world, tag=tag)
    started = StartedPlans(world, [], lambda: None)
    packs: dict[tuple, list[tuple[int, Any, torch.Tensor]]] = {}
    for index, plan in enumerate(plans):
        if rank not in plan.src and rank not in plan.dst:
            continue
        x = local.get(index)
        group = _packable(plan, rank)
        if group is not None and x is not None:
            step = plan.steps[0]
            packs.setdefault((type(step), group, x.dtype), []).append((index, step, x))
            continue
        if not batchable(plan):
            started.alone[index] = start_plan(plan, x, world, dtype=dtype)
            continue
        like = {
            "dtype": x.dtype if x is not None else dtype,
            "device": x.device if x is not None else world.device,
        }
        ctx = StepContext(world, plan.src, plan.dst, plan.shape, like, owned=False)
        step = plan.steps[0]
        if isinstance(step, SplitReduceScatter):
            started.batched[index] = queue_split_reduce_scatter(step, x, ctx, exchange)
        else:
            assert isinstance(step, SplitAllGather)
            out = queue_split_all_gather(step, x, ctx, exchange, out=outs.get(index))
            started.batched[index] = _const(out)
    with comm_span(world, kind):
        started.works, started.unpack = exchange.start()
        for (kind, group, _), items in packs.items():
            indices = [index for index, _, _ in items]
            steps, xs = [s for _, s, _ in items], [x for _, _, x in items]
            if kind is ReduceScatter:
                works, then = issue_packed_reduce_scatter(steps, xs, group, world)
            else:
                into = [outs.get(index) for index in indices]
                works, then = issue_packed_all_gather(steps, xs, group, world, into)
            started.works += works
            results = _Once(then)
            for i, index in enumerate(indices):
                started.batched[index] = results.getter(i)
    return started


def _packable(plan: CommPlan, rank: int) -> tuple[int, ...] | None:
    """This rank's group where ``plan`` is one reduce-scatter or all-gather over more than
    one rank."""
    if len(plan.steps) != 1 or not isinstance(plan.steps[0], ReduceScatter | AllGather):
        return None
    group = next(g for g in plan.steps[0].groups if rank in g)
    return group if len(group) > 1 else None


@dataclass(eq=False, slots=True)
class _Once:
    """A packed collective's tensors, made once, on first use."""

    make: Callable[[], list[torch.Tensor]]
    made: list[torch.Tensor] | None = None

    def getter(self, i: int) -> Callable[[], torch.Tensor]:
        def get() -> torch.Tensor:
            if self.made is None:
                self.made = self.make()
            return self.made[i]

        return get


def _const(value: torch.Tensor | None) -> Callable[[], torch.Tensor | None]:
    return lambda: value
