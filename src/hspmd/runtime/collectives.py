"""Bottom-tier executors: collectives within the groups of a step, and the local step.

Each issues at most one collective on this rank's group. Process groups number their
members by global rank, so a group given in another order (a DG like ``[3,1]``) is served
by permuting chunks: member ``i`` of the plan's group still gets chunk ``i``.

    step            issued                      copies on this rank
    all-reduce      all_reduce                  one (none with donate / on intermediates)
    reduce-scatter  reduce_scatter_single       one when dim != 0 or the group is unsorted
    all-gather      all_gather_single           one when dim != 0 or the group is unsorted
    all-to-all      all_to_all_single           one each way unless dims are 0 and sorted
    local           nothing                     the kept slice
"""

from __future__ import annotations

import math
from collections.abc import Callable

import torch
import torch.distributed as dist

from hspmd.comm.plan import (
    AllGather,
    AllReduce,
    AllToAll,
    Local,
    ReduceScatter,
    intersect,
    local_box,
)
from hspmd.runtime.compat import all_gather_single, reduce_scatter_single
from hspmd.runtime.context import Issued, StepContext, finish, held, nbytes
from hspmd.runtime.world import World


def _order(group: tuple[int, ...]) -> tuple[list[int], bool]:
    """Positions in ``group`` of its members sorted by rank, and whether it is sorted."""
    ranked = sorted(group)
    return [group.index(r) for r in ranked], list(group) == ranked


def _my_group(groups: tuple[tuple[int, ...], ...], rank: int) -> tuple[int, ...]:
    return next(g for g in groups if rank in g)


def issue_all_reduce(step: AllReduce, x: torch.Tensor | None, ctx: StepContext) -> Issued:
    x = held(x, ctx)
    group = _my_group(step.groups, ctx.rank)
    out = x if ctx.owned and x.is_contiguous() else x.clone(memory_format=torch.contiguous_format)
    works = []
    if len(group) > 1:
        ctx.world.record("all_reduce", group=group, nbytes=nbytes(out))
        works.append(dist.all_reduce(out, group=ctx.world.group(group), async_op=True))
    return works, lambda: out


def all_reduce(step: AllReduce, x: torch.Tensor | None, ctx: StepContext) -> torch.Tensor | None:
    return finish(issue_all_reduce(step, x, ctx), ctx)


def _stacked(x: torch.Tensor, dim: int, parts: int, order: list[int]) -> torch.Tensor:
    """``x`` cut into ``parts`` chunks along ``dim``, stacked on a new dim 0 in ``order``."""
    shape = x.shape
    split = x.reshape(*shape[:dim], parts, shape[dim] // parts, *shape[dim + 1 :])
    stacked = split.movedim(dim, 0)
    if order != list(range(parts)):
        stacked = stacked[order]
    return stacked.contiguous()


def _unstacked(stacked: torch.Tensor, dim: int, order: list[int] | None) -> torch.Tensor:
    """Inverse layout: chunks on dim 0 (in ``order``) concatenated along ``dim``."""
    if order is not None:
        stacked = stacked[order]
    moved = stacked.movedim(0, dim)
    shape = moved.shape
    return moved.reshape(*shape[:dim], shape[dim] * shape[dim + 1], *shape[dim + 2 :])


def issue_reduce_scatter(step: ReduceScatter, x: torch.Tensor | None, ctx: StepContext) -> Issued:
    x = held(x, ctx)
    group = _my_group(step.groups, ctx.rank)
    if len(group) == 1:
        copy = x.clone()
        return [], lambda: copy
    order, _ = _order(group)
    source = _stacked(x, step.dim, len(group), order)
    out = torch.empty(source.shape[1:], **ctx.like)
    ctx.world.record("reduce_scatter", group=group, nbytes=nbytes(source))
    flat = source.view(-1, *source.shape[2:])
    work = reduce_scatter_single(out, flat, group=ctx.world.group(group), async_op=True)
    return [work], lambda: out


def reduce_scatter(
    step: ReduceScatter, x: torch.Tensor | None, ctx: StepContext
) -> torch.Tensor | None:
    return finish(issue_reduce_scatter(step, x, ctx), ctx)


def issue_packed_reduce_scatter(
    steps: list[ReduceScatter], xs: list[torch.Tensor], group: tuple[int, ...], world: World
) -> tuple[list, Callable[[], list[torch.Tensor]]]:
    """One reduce-scatter over ``group`` for many tensors, as FSDP2 does: each tensor cut
    into its group's chunks (``step.dim``) and the chunks of member ``i`` laid side by side
    in row ``i`` of one buffer, so a bucket costs one collective, not one per tensor. Gives
    the issued collective and what gives this rank's chunk of each tensor once it is done
    (views of one flat result)."""
    order, _ = _order(group)
    parts = len(group)
    sources = [_stacked(x, s.dim, parts, order) for s, x in zip(steps, xs, strict=True)]
    flat = torch.cat([s.reshape(parts, -1) for s in sources], dim=1)
    out = flat.new_empty(flat.shape[1])
    world.record("reduce_scatter", group=group, nbytes=nbytes(flat))
    work = reduce_scatter_single(out, flat.view(-1), group=world.group(group), async_op=True)
    shapes = [s.shape[1:] for s in sources]
    sizes = [math.prod(shape) for shape in shapes]
    return [work], lambda: [p.view(sh) for p, sh in zip(out.split(sizes), shapes, strict=True)]


def issue_packed_all_gather(
    steps: list[AllGather], xs: list[torch.Tensor], group: tuple[int, ...], world: World,
    outs: list[torch.Tensor | None],
) -> tuple[list, Callable[[], list[torch.Tensor]]]:  # fmt: skip
    """One all-gather over ``group`` for many tensors, as FSDP2 gathers a module: this
    rank's chunks side by side in one buffer, gathered into one row per member, each
    tensor's chunks then copied once into its place (``outs[i]`` where given: a ZeRO-3
    parameter's storage, else a new tensor). Gives the issued collective and what gives
    the gathered tensors once it is done."""
    parts = len(group)
    flat = torch.cat([x.reshape(-1) for x in xs])
    rows = flat.new_empty(parts, flat.numel())
    world.record("all_gather", group=group, nbytes=nbytes(flat))
    work = all_gather_single(rows.view(-1), flat, group=world.group(group), async_op=True)
    ranked = sorted(group)
    member_rows = [ranked.index(r) for r in group]  # row of member i: by rank in the group

    def then() -> list[torch.Tensor]:
        got, offset = [], 0
        ordered = rows if member_rows == list(range(parts)) else rows[member_rows]
        for step, x, out in zip(steps, xs, outs, strict=True):
            chunks = ordered[:, offset : offset + x.numel()].unflatten(1, x.shape)
            offset += x.numel()
            shape = list(x.shape)
            shape[step.dim] *= parts
            dest = out if out is not None else x.new_empty(shape)
            dest.unflatten(step.dim, (parts, x.shape[step.dim])).movedim(step.dim, 0).copy_(chunks)
            got.append(dest)
        return got

    return [work], then


def all_gather(step: AllGather, x: torch.Tensor | None, ctx: StepContext) -> torch.Tensor:
    x = held(x, ctx)
    group = _my_group(step.groups, ctx.rank)
    if len(group) == 1:
        return x.clone()
    order, is_sorted = _order(group)
    source = x.contiguous()
    flat = torch.empty((len(group) * x.shape[0], *x.shape[1:]), **ctx.like)
    ctx.world.record("all_gather", group=group, nbytes=nbytes(source))
    ctx.world.wait([all_gather_single(flat, source, group=ctx.world.group(group), async_op=True)])
    stacked = flat.view(len(group), *x.shape)
    inverse = None if is_sorted else [sorted(group).index(r) for r in group]
    if step.dim == 0 and inverse is None:
        return stacked.view(-1, *x.shape[1:])
    return _unstacked(stacked, step.dim, inverse)


def all_to_all(step: AllToAll, x: torch.Tensor | None, ctx: StepContext) -> torch.Tensor:
    x = held(x, ctx)
    group = _my_group(step.groups, ctx.rank)
    if len(group) == 1:
        return x.clone()
    order, is_sorted = _order(group)
    source = _stacked(x, step.split_dim, len(group), order)
    received = torch.empty_like(source)
    ctx.world.record("all_to_all", group=group, nbytes=nbytes(source))
    work = dist.all_to_all_single(received, source, group=ctx.world.group(group), async_op=True)
    ctx.world.wait([work])
    inverse = None if is_sorted else [sorted(group).index(r) for r in group]
    return _unstacked(received, step.concat_dim, inverse).contiguous()


def local(step: Local, x: torch.Tensor | None, ctx: StepContext) -> torch.Tensor:
    new = ctx.new()
    if ctx.rank in step.zero:
        return torch.zeros(new.shape, **ctx.like)
    x, old = held(x, ctx), ctx.old()
    common = intersect(old.region, new.region)
    if common == new.region:
        return x[local_box(old, common)].clone(memory_format=torch.contiguous_format)
    out = torch.zeros(new.shape, **ctx.like)
    if common is not None:
        out[local_box(new, common)] = x[local_box(old, common)]
    return out
