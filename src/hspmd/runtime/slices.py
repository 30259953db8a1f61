"""Executors of the point-to-point steps and the top-tier split collectives.

    step                  issued on this rank
    send-recv             one batch: the whole tensor to / from each peer
    bsr                   one batch: one packed buffer per peer pair, in transfer order
    split-all-reduce      one all_reduce per distinct rank set: in place when it is one
                          contiguous slice of an unchanged piece, else its slices packed
    split-reduce-scatter  one batch: contributors send each slice to its root, which sums
                          in the slice's rank order (the same order on every root)
    split-all-gather      one batch: each owner sends its region to every rank of the slice

Uneven top-tier parts never meet an unequal-size gloo all_gather: regions move point to
point, or are reduced per rank set with equal sizes on every member.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist

from hspmd.comm.plan import (
    BatchedSendRecv,
    SendRecv,
    SliceReduce,
    SplitAllGather,
    SplitAllReduce,
    SplitReduceScatter,
    local_box,
    volume,
)
from hspmd.runtime.context import Issued, StepContext, finish, held, nbytes, region_shape
from hspmd.runtime.p2p import Exchange


def send_recv(step: SendRecv, x: torch.Tensor | None, ctx: StepContext) -> torch.Tensor | None:
    exchange = Exchange(ctx.world)
    out = None
    for src, dst in step.pairs:
        if src == dst == ctx.rank:
            out = held(x, ctx).clone()
        elif src == ctx.rank:
            exchange.send(dst, [held(x, ctx)])
        elif dst == ctx.rank:
            out = torch.empty(ctx.new().shape, **ctx.like)
            exchange.recv(src, [out])
    exchange.run()
    if out is None and ctx.rank in ctx.after:
        return x
    return out


def bsr(step: BatchedSendRecv, x: torch.Tensor | None, ctx: StepContext) -> torch.Tensor | None:
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


def _send_only(mine: list[Any], x: torch.Tensor | None, ctx: StepContext) -> None:
    exchange = Exchange(ctx.world)
    x, old = held(x, ctx), ctx.old()
    for t in mine:
        exchange.send(t.dst, [x[local_box(old, t.region)]])
    exchange.run()


def split_all_reduce(
    step: SplitAllReduce, x: torch.Tensor | None, ctx: StepContext
) -> torch.Tensor | None:
    return finish(issue_split_all_reduce(step, x, ctx), ctx)


def issue_split_all_reduce(
    step: SplitAllReduce, x: torch.Tensor | None, ctx: StepContext
) -> Issued:
    """One all_reduce per distinct rank set; the slices of a set are packed in plan order.

    A set with one slice that is a contiguous block of this rank's (unchanged) piece is
    reduced in place in the output, without packing.
    """
    x = held(x, ctx)
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
            ctx.world.record("all_reduce", group=ranks, nbytes=nbytes(flat))
            pending.append(dist.all_reduce(flat, group=ctx.world.group(ranks), async_op=True))

    def then() -> torch.Tensor:
        for ranks, flat in packed.items():
            offset = 0
            for s in by_set[ranks]:
                size = volume(s.region)
                out[local_box(new, s.region)] = flat[offset : offset + size].view(
                    region_shape(s.region)
                )
                offset += size
        return out

    return pending, then


def _reduce_buffer(
    slices: list[SliceReduce], x: torch.Tensor, out: torch.Tensor, ctx: StepContext
) -> torch.Tensor | None:
    """The packed contribution of ``slices``, or None to reduce in place in ``out``."""
    rank, old, new = ctx.rank, ctx.old(), ctx.new()
    if len(slices) == 1 and old.region == new.region:
        view = out[local_box(new, slices[0].region)]
        if view.is_contiguous():
            if rank in slices[0].zero:
                view.zero_()
            return None
    flat = torch.empty(sum(volume(s.region) for s in slices), **ctx.like)
    offset = 0
    for s in slices:
        segment = flat[offset : offset + volume(s.region)].view(region_shape(s.region))
        if rank in s.zero:
            segment.zero_()
        else:
            segment.copy_(x[local_box(old, s.region)])
        offset += volume(s.region)
    return flat


def split_reduce_scatter(
    step: SplitReduceScatter, x: torch.Tensor | None, ctx: StepContext
) -> torch.Tensor | None:
    return finish(issue_split_reduce_scatter(step, x, ctx), ctx)


def issue_split_reduce_scatter(
    step: SplitReduceScatter, x: torch.Tensor | None, ctx: StepContext
) -> Issued:
    """Contributors send each slice to its root, which sums in the slice's rank order."""
    exchange = Exchange(ctx.world)
    then = queue_split_reduce_scatter(step, x, ctx, exchange)
    works, unpack = exchange.start()

    def done() -> torch.Tensor | None:
        unpack()
        return then()

    return works, done


def queue_split_reduce_scatter(
    step: SplitReduceScatter, x: torch.Tensor | None, ctx: StepContext, exchange: Exchange
) -> Callable[[], torch.Tensor | None]:
    """``issue_split_reduce_scatter``'s sends and receives queued on ``exchange`` (one batch
    for many steps); the returned function gives the result once the batch is done."""
    rank = ctx.rank
    x, old = held(x, ctx), ctx.old()
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
                parts[r] = torch.empty(region_shape(s.region), **ctx.like)
                exchange.recv(r, [parts[r]])
        received.append(parts)

    def then() -> torch.Tensor | None:
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

    return then


def split_all_gather(
    step: SplitAllGather, x: torch.Tensor | None, ctx: StepContext
) -> torch.Tensor | None:
    """Every owner region goes to every rank of its slice (a local copy for itself)."""
    exchange = Exchange(ctx.world)
    out = queue_split_all_gather(step, x, ctx, exchange)
    exchange.run()
    return out


def queue_split_all_gather(
    step: SplitAllGather, x: torch.Tensor | None, ctx: StepContext, exchange: Exchange,
    *, out: torch.Tensor | None = None,
) -> torch.Tensor | None:  # fmt: skip
    """``split_all_gather``'s sends and receives queued on ``exchange``; the result (filled
    once the batch is done) is ``out`` where given (ZeRO-3 gathers into a parameter's
    storage), else a new tensor."""
    rank = ctx.rank
    new = ctx.new() if rank in ctx.after else None
    old = ctx.old() if rank in ctx.before else None
    if out is None and new is not None:
        out = torch.empty(new.shape, **ctx.like)
    for s in step.slices:
        if rank not in s.ranks and all(owner != rank for owner, _ in s.owners):
            continue
        for owner, region in s.owners:
            for r in s.ranks:
                if owner == rank and r == rank:
                    assert out is not None and new is not None and old is not None
                    out[local_box(new, region)] = held(x, ctx)[local_box(old, region)]
                elif owner == rank:
                    assert old is not None
                    exchange.send(r, [held(x, ctx)[local_box(old, region)]])
                elif r == rank:
                    assert out is not None and new is not None
                    exchange.recv(owner, [out[local_box(new, region)]])
    return out
