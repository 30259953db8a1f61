"""Pipeline boundaries: the resolved plans between adjacent stages, run without blocking sends.

A stage boundary is the ``layers.{i}.input`` marker whose input lives on the previous
stage. Inside a pipeline the residual stream is duplicate over each stage's ranks, so
resolution gives a send-recv (same TP degree: rank j sends to rank j) or a BSR (different
degrees: each receiver gets the whole tensor from one owner)::

    "4x1: R0-1:L0-1 R2-3:L2-3"   layers.2.input  forward send-recv (0->2, 1->3)
    "4x1: R0-1:L0-1 R2:L2-3"     layers.2.input  forward bsr (0->2), backward bsr (2->0, 2->1)

The plans are those of the rank's own pipeline (one subgroup, micro-batch shape): each
pipeline runs its micro-batches on its own schedule. In 1F1B neighbouring stages send to
each other at the same moment, so ``send`` only issues ``isend`` (wait on the returned
works later) while ``recv`` blocks::

    plans = boundary_plans(strategy, config, rank, (micro_batch, seq_len, hidden))
    x = recv(plans.incoming.forward, world)              # F, not stage 0
    works += send(plans.outgoing.forward, out, world)    # F, not the last stage
    grad = recv(plans.outgoing.backward, world)          # B, not the last stage
    works += send(plans.incoming.backward, x.grad, world)  # B, not stage 0
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from hspmd.annotation import Region
from hspmd.comm.plan import BatchedSendRecv, CommPlan, SendRecv, local_box
from hspmd.comm.resolve import resolve
from hspmd.errors import HspmdError
from hspmd.models.llama import LlamaConfig
from hspmd.plan.schema import activation_annotations
from hspmd.plan.strategy import Strategy, StrategyOptions
from hspmd.runtime.world import World

__all__ = [
    "Boundary",
    "BoundaryError",
    "BoundaryPlans",
    "Pending",
    "boundary_plans",
    "recv",
    "send",
]


class BoundaryError(HspmdError, ValueError):
    """A boundary plan that is not a point-to-point transfer between two stages."""


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
    config: LlamaConfig,
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
    from hspmd.specialize.executable import locate

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

    def wait(self) -> None:
        self.work.wait()


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
    for peer in sorted(by_peer):
        parts = by_peer[peer]
        if len(parts) == 1:
            buffer = parts[0].contiguous()
        else:
            buffer = torch.cat([t.reshape(-1) for t in parts])
        world.record("send", group=(rank, peer), nbytes=buffer.numel() * buffer.element_size())
        pending.append(Pending(dist.isend(buffer, peer), buffer))
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
    for peer in sorted(by_peer):
        views = [out[local_box(piece, region)] for region in by_peer[peer]]
        if len(views) == 1 and views[0].is_contiguous():
            buffer = views[0]
        else:
            buffer = torch.empty(sum(v.numel() for v in views), dtype=dtype, device=out.device)
        world.record("recv", group=(peer, rank), nbytes=buffer.numel() * buffer.element_size())
        dist.recv(buffer, peer)
        if buffer is not views[0]:
            offset = 0
            for view in views:
                view.copy_(buffer[offset : offset + view.numel()].view(view.shape))
                offset += view.numel()
    return out
