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

import functools
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from hspmd.annotation import Annotation
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
from hspmd.runtime.p2p import Exchange, Received


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


Box = tuple[slice, ...]


@dataclass(frozen=True, slots=True)
class _ReduceMoves:
    """One rank's part in a split-reduce-scatter: the regions it sends (peer, box of its
    piece), and per slice it roots, the box in its result, the region's shape and the
    contributors in rank order (their own part: the box of this rank's piece, else None:
    received)."""

    sends: tuple[tuple[int, Box], ...]
    roots: tuple[tuple[Box, tuple[int, ...], tuple[tuple[int, Box | None], ...]], ...]


@functools.cache
def _reduce_moves(
    step: SplitReduceScatter, before: Annotation, after: Annotation, shape: tuple[int, ...],
    rank: int,
) -> _ReduceMoves:  # fmt: skip
    """``queue_split_reduce_scatter``'s moves on ``rank``: pure metadata, made once per
    plan (a ZeRO bucket issues the same ones every backward)."""
    old = before.piece(rank, shape)
    new = after.piece(rank, shape) if rank in after else None
    sends = tuple(
        (s.root, local_box(old, s.region))
        for s in step.slices
        if s.root != rank and rank in s.ranks and rank not in s.zero
    )
    roots = []
    for s in (s for s in step.slices if s.root == rank):
        parts = tuple(
            (r, local_box(old, s.region) if r == rank else None) for r in s.ranks if r not in s.zero
        )
        box = local_box(new, s.region) if new is not None else ()
        roots.append((box, region_shape(s.region), parts))
    return _ReduceMoves(sends, tuple(roots))


def queue_split_reduce_scatter(
    step: SplitReduceScatter, x: torch.Tensor | None, ctx: StepContext, exchange: Exchange
) -> Callable[[], torch.Tensor | None]:
    """``issue_split_reduce_scatter``'s sends and receives queued on ``exchange`` (one batch
    for many steps); the returned function gives the result once the batch is done."""
    rank, x = ctx.rank, held(x, ctx)
    moves = _reduce_moves(step, ctx.before, ctx.after, ctx.shape, rank)
    for root, box in moves.sends:
        exchange.send(root, [x[box]])
    received: list[list[torch.Tensor | Received]] = []
    for _, shape, parts in moves.roots:  # others' parts: views of each peer's one buffer
        received.append([x[mine] if mine is not None else exchange.recv_new(r, shape, ctx.like)
                         for r, mine in parts])  # fmt: skip

    def then() -> torch.Tensor | None:
        if rank not in ctx.after:
            return None
        out = torch.empty(ctx.new().shape, **ctx.like)
        for (box, _, _), parts in zip(moves.roots, received, strict=True):
            values = [p if isinstance(p, torch.Tensor) else _value(p) for p in parts]
            view = out[box]  # summed in the slice's rank order, as on every root
            if not values:
                view.zero_()
            elif len(values) == 1:
                view.copy_(values[0])
            else:
                torch.add(values[0], values[1], out=view)
                for value in values[2:]:
                    view.add_(value)
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


@dataclass(frozen=True, slots=True)
class _GatherMoves:
    """One rank's part in a split-all-gather: its own regions (box in the result, box of
    its piece), the regions it sends (peer, box of its piece) and receives (peer, box in
    the result), each in plan order."""

    own: tuple[tuple[Box, Box], ...]
    sends: tuple[tuple[int, Box], ...]
    recvs: tuple[tuple[int, Box], ...]


@functools.cache
def _gather_moves(
    step: SplitAllGather, before: Annotation, after: Annotation, shape: tuple[int, ...],
    rank: int,
) -> _GatherMoves:  # fmt: skip
    """``queue_split_all_gather``'s moves on ``rank`` (pure metadata, made once per plan)."""
    new = after.piece(rank, shape) if rank in after else None
    old = before.piece(rank, shape) if rank in before else None
    own, sends, recvs = [], [], []
    for s in step.slices:
        if rank not in s.ranks and all(owner != rank for owner, _ in s.owners):
            continue
        for owner, region in s.owners:
            for r in s.ranks:
                if owner == rank and r == rank:
                    assert new is not None and old is not None
                    own.append((local_box(new, region), local_box(old, region)))
                elif owner == rank:
                    assert old is not None
                    sends.append((r, local_box(old, region)))
                elif r == rank:
                    assert new is not None
                    recvs.append((owner, local_box(new, region)))
    return _GatherMoves(tuple(own), tuple(sends), tuple(recvs))


def queue_split_all_gather(
    step: SplitAllGather, x: torch.Tensor | None, ctx: StepContext, exchange: Exchange,
    *, out: torch.Tensor | None = None,
) -> torch.Tensor | None:  # fmt: skip
    """``split_all_gather``'s sends and receives queued on ``exchange``; the result (filled
    once the batch is done) is ``out`` where given (ZeRO-3 gathers into a parameter's
    storage), else a new tensor."""
    moves = _gather_moves(step, ctx.before, ctx.after, ctx.shape, ctx.rank)
    if out is None and ctx.rank in ctx.after:
        out = torch.empty(ctx.new().shape, **ctx.like)
    for out_box, box in moves.own:
        assert out is not None
        out[out_box] = held(x, ctx)[box]
    for peer, box in moves.sends:
        exchange.send(peer, [held(x, ctx)[box]])
    for peer, out_box in moves.recvs:
        assert out is not None
        exchange.recv(peer, [out[out_box]])
    return out


def _value(received: Received) -> torch.Tensor:
    assert received.value is not None, "read before its batch was issued"
    return received.value
