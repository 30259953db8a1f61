"""The vocab-parallel cross-entropy of an executable graph, as data.

Where deduction leaves the logits split on the class dim inside a stage (the ``logits``
marker's ``{2:t}``, flattened to ``(N, V)`` split on dim 1), every TP rank holds a
contiguous slice ``[vocab_start, vocab_start + rows)`` of each token's logits. The loss is
computed without gathering them (Megatron's vocab-parallel cross-entropy)::

    m  = all-reduce MAX  (max of the local slice)            per token
    s  = all-reduce SUM  (sum of exp(logits - m), local)     per token
    zt = all-reduce SUM  (logits[target] - m where the target is local, else 0)
    loss = mean over tokens (not ignore_index) of log(s) - zt

Every rank of the group ends with the same loss (deduced duplicate); the gradient of its
logits slice is ``softmax - one_hot(target)`` restricted to the slice, times the loss
gradient over the token count. ``VocabShard`` holds what a rank needs (plain data);
``VocabParallelLoss`` is the graph's module, whose ``runner`` the runtime sets
(``hspmd.runtime.executable.bind_executable``, the autograd Function in
``hspmd.runtime.vocab_loss``)::

    >>> VocabShard(group=(2, 3), vocab_start=128, vocab_size=256)
    VocabShard(group=(2, 3), vocab_start=128, vocab_size=256, ignore_index=-100, reduction='mean')
    >>> print(VocabShard(group=(2, 3), vocab_start=128, vocab_size=256))
    vocab-parallel cross-entropy over [2, 3] (classes from 128 of 256): forward 3 all-reduce
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from hspmd.annotation import Annotation
from hspmd.comm.axes import Axes
from hspmd.errors import HspmdError

__all__ = [
    "CROSS_ENTROPY",
    "LossRunner",
    "VocabParallelLoss",
    "VocabShard",
    "vocab_loss_groups",
    "vocab_shard",
]


class VocabLossError(HspmdError, ValueError):
    """A cross-entropy whose split logits no vocab-parallel loss can handle."""


@dataclass(frozen=True, slots=True)
class VocabShard:
    """One rank's part of a vocab-parallel cross-entropy over the ranks ``group``."""

    group: tuple[int, ...]
    vocab_start: int
    vocab_size: int  # the global class count
    ignore_index: int = -100
    reduction: str = "mean"

    def __str__(self) -> str:
        return (
            f"vocab-parallel cross-entropy over {list(self.group)} (classes from "
            f"{self.vocab_start} of {self.vocab_size}): forward 3 all-reduce"
        )


CROSS_ENTROPY = (F.cross_entropy, torch.ops.aten.cross_entropy_loss.default)
"""The call targets of a cross-entropy in a captured graph (the vocab-parallel loss's sites)."""

LossRunner = Callable[[torch.Tensor, torch.Tensor, VocabShard], torch.Tensor]


class VocabParallelLoss(nn.Module):
    """``cross_entropy(logits, targets)`` on this rank's class slice; ``runner`` runs it
    (set by the runtime; None raises)."""

    def __init__(self, shard: VocabShard, *, runner: LossRunner | None = None) -> None:
        super().__init__()
        self.shard, self.runner = shard, runner

    def forward(self, logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        if self.runner is None:
            raise VocabLossError(
                f"{self.shard} communicates: bind the executable to a world first: "
                "hspmd.runtime.executable.bind_executable(exe, world)"
            )
        return self.runner(logits, targets, self.shard)

    def extra_repr(self) -> str:
        return str(self.shard)


def vocab_shard(
    logits: Annotation, shape: tuple[int, ...], rank: int, *, ignore_index: int, reduction: str
) -> VocabShard | None:
    """``rank``'s shard of logits annotated ``logits`` (global ``shape``, classes on dim 1);
    None where the rank holds every class (plain ``F.cross_entropy`` does).

    The group is the ranks holding the same tokens: their pieces differ on dim 1 only.
    """
    mine = logits.piece(rank, shape)
    if mine.shape[1] == shape[1]:
        return None
    if len(shape) != 2:
        raise VocabLossError(
            f"cross_entropy logits {list(shape)} split on the class dim: the vocab-parallel "
            "loss takes (tokens, classes); flatten the extra dims into the tokens first"
        )
    return VocabShard(
        group=_class_group(logits, shape, rank, class_dim=1),
        vocab_start=mine.region[1][0],
        vocab_size=shape[1],
        ignore_index=ignore_index,
        reduction=reduction,
    )


def vocab_loss_groups(
    logits: Annotation, shape: tuple[int, ...], *, class_dim: int
) -> dict[tuple[int, ...], int]:
    """Every group of ranks that runs one vocab-parallel loss over logits annotated
    ``logits`` (global ``shape``, classes on ``class_dim``), with the tokens each of its
    ranks holds: what its three all-reduces carry (module docstring). Empty where every
    rank holds all the classes. The groups are ``vocab_shard``'s::

        >>> from hspmd.annotation import parse_annotation
        >>> vocab_loss_groups(parse_annotation("[0,1,2,3]{D:2,1:2}"), (8, 64), class_dim=1)
        {(0, 1): 8, (2, 3): 8}
    """
    groups: dict[tuple[int, ...], int] = {}
    for rank, piece in logits.pieces(shape).items():
        if piece.shape[class_dim] == shape[class_dim]:
            continue
        group = _class_group(logits, shape, rank, class_dim=class_dim)
        tokens = math.prod(n for d, n in enumerate(piece.shape) if d != class_dim)
        groups.setdefault(group, tokens)
    return groups


def _class_group(
    logits: Annotation, shape: tuple[int, ...], rank: int, *, class_dim: int
) -> tuple[int, ...]:
    """The ranks holding ``rank``'s tokens whose class slices tile the classes once
    (VocabLossError where they do not)."""
    mine = logits.piece(rank, shape)
    others = {r: logits.piece(r, shape) for r in _class_axis_group(logits, rank, class_dim)}
    same_tokens = [
        r
        for r, p in others.items()
        if all(p.region[d] == mine.region[d] for d in range(len(shape)) if d != class_dim)
    ]
    rows = sorted(others[r].region[class_dim] for r in same_tokens)
    tiled = rows[0][0] == 0 and rows[-1][1] == shape[class_dim]
    tiled = tiled and all(a[1] == b[0] for a, b in zip(rows, rows[1:], strict=False))
    if mine.partial or not tiled:
        raise VocabLossError(
            f"cross_entropy logits annotated {logits} {list(shape)}: rank {rank}'s group "
            f"{sorted(same_tokens)} does not tile the classes once ({rows}); split the class "
            "dim over one axis of the stage, or reshard the logits to duplicate"
        )
    return tuple(sorted(same_tokens))


def _class_axis_group(logits: Annotation, rank: int, class_dim: int) -> tuple[int, ...]:
    """The ranks of ``rank``'s subgroup that differ from it on the axis splitting the class
    dim only: copies on other axes (the CP axis of a context-parallel stage, whose
    sequence is gathered before the head) each run their own loss. All of the subgroup's
    ranks where no single axis splits dim 1 (the check that follows then refuses)."""
    sub = next(s for s, g in enumerate(logits.groups) if rank in g.ranks)
    ranks, entries = logits.groups[sub].ranks, logits.states[sub].entries
    axes = [a for a, (dim, _) in enumerate(entries) if dim == class_dim]
    if len(axes) != 1:
        return ranks
    return next(g for g in Axes(ranks, entries).groups(axes[0]) if rank in g)
