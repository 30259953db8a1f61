"""Run a CommPlan on this rank with torch.distributed; same results as ``comm.simulate``.

``run_plan(plan, local, world)`` walks the plan's steps; at each step this rank's tensor is
its piece of ``plan.layouts[i]``. A rank that holds nothing passes ``None`` (or an empty
placeholder) and gets ``None`` back where it holds nothing at the end::

    world.prepare([plan])                 # every rank, once: creates the subgroups
    out = run_plan(plan, local, world)    # every rank named by the plan

How each step kind runs (one collective per group, or one ``batch_isend_irecv``):

    step                  issued on this rank
    send-recv             one batch: the whole tensor to / from each peer
    all-reduce            all_reduce on the group (in place on a copy)
    reduce-scatter        reduce_scatter_single (dim moved to the front when not 0)
    all-gather            all_gather_single, stacked, then laid out along ``dim``
    all-to-all            all_to_all_single on chunks stacked along a new front dim
    local                 nothing
    split-all-reduce      one all_reduce per distinct rank set, its slices packed flat
    split-reduce-scatter  one batch: each contributor sends its slices to the slice root
    split-all-gather      one batch: each owner sends its region to the slice's ranks
    bsr                   one batch: one packed buffer per peer pair, in transfer order

Groups given in a non-sorted order (a DG like ``[3,1]``) are handled by permuting chunks:
process groups always number their members in sorted global-rank order.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from hspmd.annotation import Annotation, Piece
from hspmd.comm.plan import (
    AllGather,
    AllReduce,
    AllToAll,
    BatchedSendRecv,
    CommPlan,
    Local,
    ReduceScatter,
    SendRecv,
    SliceReduce,
    SplitAllGather,
    SplitAllReduce,
    SplitReduceScatter,
    Step,
    intersect,
    local_box,
)
from hspmd.errors import HspmdError
from hspmd.runtime.p2p import Exchange
from hspmd.runtime.world import World


class ExecuteError(HspmdError, ValueError):
    """A local tensor that does not fit the plan on this rank."""


@dataclass(frozen=True, slots=True)
class _Ctx:
    """What an executor needs besides the step and the tensor."""

    world: World
    before: Annotation
    after: Annotation
    shape: tuple[int, ...]
    like: dict[str, Any]  # dtype and device of new tensors
    owned: bool  # the executor may overwrite the incoming tensor (and return it)

    @property
    def rank(self) -> int:
        return self.world.rank

    def old(self, rank: int | None = None) -> Piece:
        return self.before.piece(self.rank if rank is None else rank, self.shape)

    def new(self, rank: int | None = None) -> Piece:
        return self.after.piece(self.rank if rank is None else rank, self.shape)


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
            ctx = _Ctx(world, before, after, plan.shape, like, owned)
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


def _held(x: torch.Tensor | None, ctx: _Ctx) -> torch.Tensor:
    assert x is not None, f"rank {ctx.rank} has no tensor for a step it sends from"
    return x


def _nbytes(tensor: torch.Tensor) -> int:
    return tensor.numel() * tensor.element_size()


def _order(group: tuple[int, ...]) -> tuple[list[int], bool]:
    """Positions in ``group`` of its members sorted by rank, and whether it is sorted."""
    ranked = sorted(group)
    return [group.index(r) for r in ranked], list(group) == ranked


def _my_group(groups: tuple[tuple[int, ...], ...], rank: int) -> tuple[int, ...]:
    return next(g for g in groups if rank in g)


# -- bottom tier: collectives within groups -------------------------------------------------


def _all_reduce(step: AllReduce, x: torch.Tensor | None, ctx: _Ctx) -> torch.Tensor:
    x = _held(x, ctx)
    group = _my_group(step.groups, ctx.rank)
    out = x if ctx.owned and x.is_contiguous() else x.clone(memory_format=torch.contiguous_format)
    if len(group) > 1:
        ctx.world.record("all_reduce", group=group, nbytes=_nbytes(out))
        ctx.world.wait([dist.all_reduce(out, group=ctx.world.group(group), async_op=True)])
    return out


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


def _reduce_scatter(step: ReduceScatter, x: torch.Tensor | None, ctx: _Ctx) -> torch.Tensor:
    x = _held(x, ctx)
    group = _my_group(step.groups, ctx.rank)
    if len(group) == 1:
        return x.clone()
    order, _ = _order(group)
    source = _stacked(x, step.dim, len(group), order)
    out = torch.empty(source.shape[1:], **ctx.like)
    ctx.world.record("reduce_scatter", group=group, nbytes=_nbytes(source))
    flat = source.view(-1, *source.shape[2:])
    work = dist.reduce_scatter_single(out, flat, group=ctx.world.group(group), async_op=True)
    ctx.world.wait([work])
    return out


def _all_gather(step: AllGather, x: torch.Tensor | None, ctx: _Ctx) -> torch.Tensor:
    x = _held(x, ctx)
    group = _my_group(step.groups, ctx.rank)
    if len(group) == 1:
        return x.clone()
    order, is_sorted = _order(group)
    source = x.contiguous()
    flat = torch.empty((len(group) * x.shape[0], *x.shape[1:]), **ctx.like)
    ctx.world.record("all_gather", group=group, nbytes=_nbytes(source))
    ctx.world.wait(
        [dist.all_gather_single(flat, source, group=ctx.world.group(group), async_op=True)]
    )
    stacked = flat.view(len(group), *x.shape)
    inverse = None if is_sorted else [sorted(group).index(r) for r in group]
    if step.dim == 0 and inverse is None:
        return stacked.view(-1, *x.shape[1:])
    return _unstacked(stacked, step.dim, inverse)


def _all_to_all(step: AllToAll, x: torch.Tensor | None, ctx: _Ctx) -> torch.Tensor:
    x = _held(x, ctx)
    group = _my_group(step.groups, ctx.rank)
    if len(group) == 1:
        return x.clone()
    order, is_sorted = _order(group)
    source = _stacked(x, step.split_dim, len(group), order)
    received = torch.empty_like(source)
    ctx.world.record("all_to_all", group=group, nbytes=_nbytes(source))
    work = dist.all_to_all_single(received, source, group=ctx.world.group(group), async_op=True)
    ctx.world.wait([work])
    inverse = None if is_sorted else [sorted(group).index(r) for r in group]
    return _unstacked(received, step.concat_dim, inverse).contiguous()


def _local(step: Local, x: torch.Tensor | None, ctx: _Ctx) -> torch.Tensor:
    new = ctx.new()
    if ctx.rank in step.zero:
        return torch.zeros(new.shape, **ctx.like)
    x, old = _held(x, ctx), ctx.old()
    common = intersect(old.region, new.region)
    if common == new.region:
        return x[local_box(old, common)].clone(memory_format=torch.contiguous_format)
    out = torch.zeros(new.shape, **ctx.like)
    if common is not None:
        out[local_box(new, common)] = x[local_box(old, common)]
    return out


# -- point to point ---------------------------------------------------------------------------


def _send_recv(step: SendRecv, x: torch.Tensor | None, ctx: _Ctx) -> torch.Tensor | None:
    exchange = Exchange(ctx.world)
    out = None
    for src, dst in step.pairs:
        if src == dst == ctx.rank:
            out = _held(x, ctx).clone()
        elif src == ctx.rank:
            exchange.send(dst, [_held(x, ctx)])
        elif dst == ctx.rank:
            out = torch.empty(ctx.new().shape, **ctx.like)
            exchange.recv(src, [out])
    exchange.run()
    if out is None and ctx.rank in ctx.after:
        return x
    return out


def _bsr(step: BatchedSendRecv, x: torch.Tensor | None, ctx: _Ctx) -> torch.Tensor | None:
    rank = ctx.rank
    mine = [t for t in step.transfers if rank in (t.src, t.dst)]
    if not any(t.dst == rank for t in mine):
        _send_only(mine, x, ctx)
        return None
    new = ctx.new()
    out = torch.empty(new.shape, **ctx.like)
    exchange = Exchange(ctx.world)
    old = ctx.old() if rank in ctx.before else None
    for t in mine:
        if t.src == t.dst:
            assert old is not None and x is not None
            out[local_box(new, t.region)] = x[local_box(old, t.region)]
        elif t.src == rank:
            assert old is not None and x is not None
            exchange.send(t.dst, [x[local_box(old, t.region)]])
        else:
            exchange.recv(t.src, [out[local_box(new, t.region)]])
    exchange.run()
    return out


def _send_only(mine: list[Any], x: torch.Tensor | None, ctx: _Ctx) -> None:
    exchange = Exchange(ctx.world)
    x, old = _held(x, ctx), ctx.old()
    for t in mine:
        exchange.send(t.dst, [x[local_box(old, t.region)]])
    exchange.run()


# -- top tier: split collectives --------------------------------------------------------------


def _split_all_reduce(step: SplitAllReduce, x: torch.Tensor | None, ctx: _Ctx) -> torch.Tensor:
    """One all_reduce per distinct rank set; the slices of a set are packed in plan order.

    A set with one slice that is a contiguous block of this rank's (unchanged) piece is
    reduced in place in the output, without packing.
    """
    x = _held(x, ctx)
    rank, new = ctx.rank, ctx.new()
    out = x if ctx.owned and x.is_contiguous() else x.clone(memory_format=torch.contiguous_format)
    by_set: dict[tuple[int, ...], list[SliceReduce]] = {}
    for s in step.slices:
        if rank in s.ranks:
            by_set.setdefault(tuple(sorted(s.ranks)), []).append(s)
    packed, pending = {}, []
    for ranks in sorted(by_set):
        flat = _reduce_buffer(by_set[ranks], x, out, ctx)
        if flat is None:
            view = out[local_box(new, by_set[ranks][0].region)]
            flat = view.view(-1)
        else:
            packed[ranks] = flat
        if len(ranks) > 1:
            ctx.world.record("all_reduce", group=ranks, nbytes=_nbytes(flat))
            pending.append(dist.all_reduce(flat, group=ctx.world.group(ranks), async_op=True))
    ctx.world.wait(pending)
    for ranks, flat in packed.items():
        offset = 0
        for s in by_set[ranks]:
            size = _volume(s.region)
            out[local_box(new, s.region)] = flat[offset : offset + size].view(_shape(s.region))
            offset += size
    return out


def _reduce_buffer(
    slices: list[SliceReduce], x: torch.Tensor, out: torch.Tensor, ctx: _Ctx
) -> torch.Tensor | None:
    """The packed contribution of ``slices``, or None to reduce in place in ``out``."""
    rank, old, new = ctx.rank, ctx.old(), ctx.new()
    if len(slices) == 1 and old.region == new.region:
        view = out[local_box(new, slices[0].region)]
        if view.is_contiguous():
            if rank in slices[0].zero:
                view.zero_()
            return None
    flat = torch.empty(sum(_volume(s.region) for s in slices), **ctx.like)
    offset = 0
    for s in slices:
        segment = flat[offset : offset + _volume(s.region)].view(_shape(s.region))
        if rank in s.zero:
            segment.zero_()
        else:
            segment.copy_(x[local_box(old, s.region)])
        offset += _volume(s.region)
    return flat


def _split_reduce_scatter(
    step: SplitReduceScatter, x: torch.Tensor | None, ctx: _Ctx
) -> torch.Tensor | None:
    """Contributors send each slice to its root, which sums in the slice's rank order."""
    rank = ctx.rank
    x, old = _held(x, ctx), ctx.old()
    exchange = Exchange(ctx.world)
    roots = [s for s in step.slices if s.root == rank]
    received: list[dict[int, torch.Tensor]] = []
    for s in step.slices:
        if s.root != rank and rank in s.ranks and rank not in s.zero:
            exchange.send(s.root, [x[local_box(old, s.region)]])
    for s in roots:
        parts = {}
        for r in s.ranks:
            if r in s.zero:
                continue
            if r == rank:
                parts[r] = x[local_box(old, s.region)]
            else:
                parts[r] = torch.empty(_shape(s.region), **ctx.like)
                exchange.recv(r, [parts[r]])
        received.append(parts)
    exchange.run()
    if rank not in ctx.after:
        return None
    new = ctx.new()
    out = torch.empty(new.shape, **ctx.like)
    for s, parts in zip(roots, received, strict=True):
        box = local_box(new, s.region)
        values = [parts[r] for r in s.ranks if r in parts]
        if not values:
            out[box] = 0
            continue
        out[box] = values[0]
        for value in values[1:]:
            out[box] += value
    return out


def _split_all_gather(
    step: SplitAllGather, x: torch.Tensor | None, ctx: _Ctx
) -> torch.Tensor | None:
    """Every owner region goes to every rank of its slice (a local copy for itself)."""
    rank = ctx.rank
    exchange = Exchange(ctx.world)
    new = ctx.new() if rank in ctx.after else None
    old = ctx.old() if rank in ctx.before else None
    out = None if new is None else torch.empty(new.shape, **ctx.like)
    for s in step.slices:
        if rank not in s.ranks and all(owner != rank for owner, _ in s.owners):
            continue
        for owner, region in s.owners:
            for r in s.ranks:
                if owner == rank and r == rank:
                    assert out is not None and new is not None and old is not None
                    out[local_box(new, region)] = _held(x, ctx)[local_box(old, region)]
                elif owner == rank:
                    assert old is not None
                    exchange.send(r, [_held(x, ctx)[local_box(old, region)]])
                elif r == rank:
                    assert out is not None and new is not None
                    exchange.recv(owner, [out[local_box(new, region)]])
    exchange.run()
    return out


def _shape(region: tuple[tuple[int, int], ...]) -> tuple[int, ...]:
    return tuple(b - a for a, b in region)


def _volume(region: tuple[tuple[int, int], ...]) -> int:
    out = 1
    for a, b in region:
        out *= b - a
    return out


Executor = Callable[[Any, torch.Tensor | None, _Ctx], torch.Tensor | None]

_EXECUTORS: dict[type[Step], Executor] = {
    AllReduce: _all_reduce,
    ReduceScatter: _reduce_scatter,
    AllGather: _all_gather,
    AllToAll: _all_to_all,
    SendRecv: _send_recv,
    Local: _local,
    SplitAllReduce: _split_all_reduce,
    SplitReduceScatter: _split_reduce_scatter,
    SplitAllGather: _split_all_gather,
    BatchedSendRecv: _bsr,
}
