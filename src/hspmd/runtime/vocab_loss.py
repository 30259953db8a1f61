"""The vocab-parallel cross-entropy as an autograd Function (``hspmd.specialize.loss``).

Each rank of ``shard.group`` holds logits ``(N, rows)``: classes
``[vocab_start, vocab_start + rows)`` of every token. Forward: three all-reduces of ``N``
numbers (MAX of the local maxima, SUM of the local sums of exponentials, SUM of the
target logit, taken where the target falls in the local slice); every rank gets the same
loss, equal to ``F.cross_entropy`` of the gathered logits. Backward is local::

    grad logits = (softmax slice - one_hot(target) slice) * grad / (tokens not ignored)

    loss = vocab_parallel_cross_entropy(logits, targets, shard, world=world)
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

from hspmd.runtime.world import World
from hspmd.specialize.loss import VocabShard

__all__ = ["vocab_parallel_cross_entropy"]


def _all_reduce(x: torch.Tensor, op: Any, shard: VocabShard, world: World) -> torch.Tensor:
    world.record("all_reduce", group=shard.group, nbytes=x.numel() * x.element_size())
    work = dist.all_reduce(x, op=op, group=world.group(shard.group), async_op=True)
    world.wait([work])
    return x


def vocab_parallel_cross_entropy(
    logits: torch.Tensor, targets: torch.Tensor, shard: VocabShard, *, world: World
) -> torch.Tensor:
    """``F.cross_entropy`` of the logits split over ``shard.group`` (see the module doc)."""
    out = _VocabParallelCrossEntropy.apply(logits, targets, shard, world)
    assert isinstance(out, torch.Tensor)
    return out


class _VocabParallelCrossEntropy(torch.autograd.Function):
    @staticmethod
    def forward(
        ctx: Any, logits: torch.Tensor, targets: torch.Tensor, shard: VocabShard, world: World
    ) -> torch.Tensor:
        assert logits.dim() == 2 and targets.dim() == 1, (logits.shape, targets.shape)
        high = _all_reduce(logits.max(dim=1).values, dist.ReduceOp.MAX, shard, world)
        shifted = logits - high.unsqueeze(1)
        exp = shifted.exp()
        total = _all_reduce(exp.sum(dim=1), dist.ReduceOp.SUM, shard, world)
        local = targets - shard.vocab_start
        valid = targets != shard.ignore_index
        inside = valid & (local >= 0) & (local < logits.shape[1])
        index = torch.where(inside, local, torch.zeros_like(local)).unsqueeze(1)
        picked = shifted.gather(1, index).squeeze(1) * inside
        picked = _all_reduce(picked, dist.ReduceOp.SUM, shard, world)
        per_token = (total.log() - picked) * valid
        count = valid.sum()
        ctx.save_for_backward(exp.div_(total.unsqueeze(1)), index, inside, valid, count)
        ctx.shard = shard
        if shard.reduction == "none":
            return per_token
        if shard.reduction == "sum":
            return per_token.sum()
        return per_token.sum() / count

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None, None, None]:
        softmax, index, inside, valid, count = ctx.saved_tensors
        out = softmax.scatter_add(1, index, -inside.to(softmax.dtype).unsqueeze(1))
        # reduction "none": one grad per token; "sum": one grad; "mean": over the count
        scale = (grad if ctx.shard.reduction != "mean" else grad / count) * valid
        return out.mul_(scale.unsqueeze(1)), None, None, None
