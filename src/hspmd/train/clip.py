"""Gradient clipping by the global norm, exactly the single-device norm under any strategy.

After Post's gradient sync (``finish_sync``) every rank holds final gradients of its
pieces: the local parameters' (fp32), the fp32 masters' (bf16), the state shards'
(ZeRO-1) or the home shards' (``--switch-mode weights``). Pieces repeat: every pipeline
holds a whole replica, and duplicated entries of a stage (TP-duplicated norm weights, TP
degree 1) hold the same region on several ranks. Each distinct piece is counted once, by
its *owner*: the lowest rank holding it, and where the subgroups are duplicates only the
first subgroup counts (it holds everything); this is the rule by which a checkpoint
writes each piece once (``hspmd.checkpoint.store.writers``). Within one subgroup pieces
are equal or disjoint, so a rank owns its whole piece of a parameter or none of it::

    strategy "2x1: R0-1:L0-1 R2:L2-3; 1x2: R3:L0-3"   (pipeline 0: TP 2 then TP 1)
    wq of layer 0   [0,1]{0:2} in pipeline 0, [3]{} in pipeline 1  -> owners 0, 1
    norm of layer 0 [0,1]{D:2} in pipeline 0, [3]{} in pipeline 1  -> owner 0
    wq of layer 3   [2]{} in pipeline 0, [3]{} in pipeline 1       -> owner 2

Each rank sums the squares of the gradients it owns (norms per tensor in fp32, as torch,
summed in fp64), one all-reduce over the world sums the ranks' (idle ranks give 0), and
every rank scales all its gradients by ``min(max_norm / (norm + 1e-6), 1)``, as
``torch.nn.utils.clip_grad_norm_`` does; the optimizer then steps on the clipped
gradients. The all-reduce goes through ``World.wait``: elastic runs watch it for failures
(it runs in the step's sync phase, before the commit). The training loop's loss sum rides
in the same all-reduce (``carry``), so clipping adds no collective to a step.

>>> from hspmd.models.llama import get_config
>>> from hspmd.plan.params import parameter_annotations
>>> from hspmd.plan.strategy import parse_strategy
>>> specs = parameter_annotations(parse_strategy("2x1: R0-1:L0-1 R2:L2-3; 1x2: R3:L0-3"),
...                               get_config("llama-tiny"))
>>> [sorted(n for n in owned_names(specs, r) if n.startswith("layers.0.")) == [] for r in range(4)]
[False, False, True, True]
>>> "layers.0.attn_norm.weight" in owned_names(specs, 1), "head.weight" in owned_names(specs, 2)
(False, True)
"""

from __future__ import annotations

import functools
from collections.abc import Mapping
from typing import Protocol

import torch
import torch.distributed as dist

from hspmd.annotation import Annotation
from hspmd.checkpoint.store import writers
from hspmd.plan.params import ParamSpec
from hspmd.runtime.world import World

__all__ = ["Clippable", "clip_gradients", "owned_names", "square_sum"]

EPS = 1e-6  # torch.nn.utils.clip_grad_norm_'s


class Clippable(Protocol):
    """What clipping needs of a Post: its final gradients, and which of them it owns."""

    @property
    def owned(self) -> frozenset[str]: ...

    def grads(self) -> dict[str, torch.Tensor]:
        """The gradients the optimizer steps on (after ``finish_sync``), by name."""
        ...


@functools.cache
def _owners(annotation: Annotation, shape: tuple[int, ...]) -> frozenset[int]:
    return frozenset(writers(annotation, shape))


def owned_names(specs: Mapping[str, ParamSpec], rank: int) -> frozenset[str]:
    """The names whose piece ``rank`` counts in the global norm (module docstring)."""
    return frozenset(n for n, s in specs.items() if rank in _owners(s.annotation, s.shape))


def square_sum(post: Clippable | None, device: torch.device) -> torch.Tensor:
    """The sum of squares of the gradients ``post`` owns (fp64, 0 without a Post)."""
    grads = post.grads() if post is not None else {}
    norms = [
        torch.linalg.vector_norm(g, dtype=torch.float32)
        for name, g in grads.items()
        if post is not None and name in post.owned
    ]
    if not norms:
        return torch.zeros((), dtype=torch.float64, device=device)
    return torch.stack(norms).double().square().sum().to(device)


@torch.no_grad()
def clip_gradients(
    post: Clippable | None, world: World, *, max_norm: float, carry: torch.Tensor | None = None
) -> torch.Tensor:
    """Clip ``post``'s gradients to the global norm ``max_norm``, on every rank of the world
    (``post`` None on ranks idle under the strategy); returns the norm before clipping (a
    0-dim fp32 tensor on the world's device: reading it waits for the device).

    ``carry``: a 1-element fp64 tensor on the world's device summed over the world by the
    same all-reduce, in place (the training loop's loss: one collective for both)."""
    square = square_sum(post, world.device).reshape(1)
    both = square if carry is None else torch.cat([square, carry])
    world.record("all_reduce", group=tuple(range(world.world_size)), nbytes=both.nbytes)
    world.wait([dist.all_reduce(both, async_op=True)])
    if carry is not None:
        carry.copy_(both[1:])
    total = both[0].sqrt().float()
    coef = torch.clamp(max_norm / (total + EPS), max=1.0)
    if post is not None:
        for grad in post.grads().values():
            grad.mul_(coef.to(grad.device))
    return total
