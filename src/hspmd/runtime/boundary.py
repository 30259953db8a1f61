"""Run pipeline boundaries (``hspmd.specialize.boundary``): sends that do not block, receives
that do.

In 1F1B neighbouring stages send to each other at the same moment, so ``send`` only
issues ``isend`` (one packed buffer per peer; wait on the returned ``Pending`` later)
while ``recv`` blocks::

    plans = boundary_plans(strategy, config, rank, (micro_batch, seq_len, hidden))
    x = recv(plans.incoming.forward, world)              # F, not stage 0
    works += send(plans.outgoing.forward, out, world)    # F, not the last stage
    grad = recv(plans.outgoing.backward, world)          # B, not the last stage
    works += send(plans.incoming.backward, x.grad, world)  # B, not stage 0
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import partial
from typing import Any

import torch
import torch.distributed as dist

from hspmd.annotation import Piece, Region
from hspmd.comm.plan import BatchedSendRecv, CommPlan, SendRecv, local_box
from hspmd.runtime.trace import comm_span
from hspmd.runtime.world import World
from hspmd.specialize.boundary import BoundaryError

__all__ = ["Pending", "recv", "send"]


def _transfers(plan: CommPlan) -> list[tuple[int, int, Region]]:
    """``(src, dst, global region)`` of a one-step send-recv or BSR plan."""
    if len(plan.steps) != 1 or not isinstance(plan.steps[0], SendRecv | BatchedSendRecv):
        raise BoundaryError(
            f"boundary plan {plan.src} -> {plan.dst} is {'+'.join(plan.kinds)}: a stage "
            "boundary must resolve to one send-recv or BSR step (disjoint stages)"
        )
    step = plan.steps[0]
    if isinstance(step, BatchedSendRecv):
        out = [(t.src, t.dst, t.region) for t in step.transfers]
    else:
        out = [(a, b, plan.dst.piece(b, plan.shape).region) for a, b in step.pairs]
    if any(a == b for a, b, _ in out):
        raise BoundaryError(f"boundary plan {plan.src} -> {plan.dst} keeps data on a rank")
    return out


@dataclass(frozen=True, slots=True)
class Pending:
    """An issued ``isend`` and the buffer it reads (kept alive until ``wait``)."""

    work: Any
    buffer: torch.Tensor
    world: World

    def wait(self) -> None:
        self.world.wait([self.work])


def send(plan: CommPlan, x: torch.Tensor, world: World) -> list[Pending]:
    """Issue this rank's sends of ``plan`` (one packed ``isend`` per peer); wait later."""
    rank = world.rank
    if rank not in plan.src:
        return []
    piece = plan.src.piece(rank, plan.shape)
    by_peer: dict[int, list[torch.Tensor]] = {}
    for src, dst, region in _transfers(plan):
        if src == rank:
            by_peer.setdefault(dst, []).append(x[local_box(piece, region)])
    pending = []
    with comm_span(world, "send"):  # the issue only: isend returns at once
        for peer in sorted(by_peer):
            parts = by_peer[peer]
            if len(parts) == 1:
                buffer = parts[0].contiguous()
            else:
                buffer = torch.cat([t.reshape(-1) for t in parts])
            nbytes = buffer.numel() * buffer.element_size()
            world.record("send", group=(rank, peer), nbytes=nbytes)
            # through post: gloo raises at once on a dead peer (the waiter's path then)
            (work,) = world.post(partial(_isend, buffer, peer))
            pending.append(Pending(work, buffer, world))
    return pending


def recv(plan: CommPlan, world: World, *, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """This rank's piece of ``plan.dst``, received from the ranks that hold it (blocking)."""
    rank = world.rank
    if rank not in plan.dst:
        raise BoundaryError(f"rank {rank} receives nothing in {plan.src} -> {plan.dst}")
    piece = plan.dst.piece(rank, plan.shape)
    out = torch.empty(piece.shape, dtype=dtype, device=world.device)
    by_peer: dict[int, list[Region]] = {}
    for src, dst, region in _transfers(plan):
        if dst == rank:
            by_peer.setdefault(src, []).append(region)
    with comm_span(world, "recv"):  # until the data is in
        _recv_into(out, piece, by_peer, world, dtype=dtype)
    return out


def _recv_into(
    out: torch.Tensor, piece: Piece, by_peer: dict[int, list[Region]], world: World, *,
    dtype: torch.dtype,
) -> None:  # fmt: skip
    rank = world.rank
    for peer in sorted(by_peer):
        views = [out[local_box(piece, region)] for region in by_peer[peer]]
        if len(views) == 1 and views[0].is_contiguous():
            buffer = views[0]
        else:
            buffer = torch.empty(sum(v.numel() for v in views), dtype=dtype, device=out.device)
        world.record("recv", group=(peer, rank), nbytes=buffer.numel() * buffer.element_size())
        world.wait(world.post(partial(_irecv, buffer, peer)))  # the waiter notices dead peers
        if buffer is not views[0]:
            offset = 0
            for view in views:
                view.copy_(buffer[offset : offset + view.numel()].view(view.shape))
                offset += view.numel()


def _isend(buffer: torch.Tensor, peer: int) -> list[Any]:
    return [dist.isend(buffer, peer)]


def _irecv(buffer: torch.Tensor, peer: int) -> list[Any]:
    return [dist.irecv(buffer, peer)]
