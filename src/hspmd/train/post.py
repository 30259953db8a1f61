"""Post: gradient synchronization and the optimizer step, in three variants.

=============  =============================================================================
variant        Post on one rank
=============  =============================================================================
plain fp32     grads synced by the resolved hP -> hD plans (hspmd.train.sync); Adam on the
               local parameters
bf16           compute parameters are bf16, fp32 masters have the parameters' annotation:
               grads cast to fp32, synced, Adam on the masters, masters cast into the
               compute parameters (the Pre cast of the paper, done at the end of Post)
ZeRO-1         masters and Adam states sharded over the pipelines (hspmd.train.zero)
=============  =============================================================================

Every variant issues its gradient plans through a ``GradOverlap`` (``hspmd.train.overlap``):
``arm()`` before the step's last backward starts them as gradients become final;
``finish_sync()`` issues the rest and waits: then ``grads()`` are final (the step's
gradient clipping, ``hspmd.train.clip``, scales them in place, counting the ``owned``
ones); ``apply()`` steps AdamW (``hspmd.train.optim``) and brings the compute weights up
to date. ``step()`` is the two without clipping. Without ``arm()`` the plans all run in
``finish_sync()``. Post owns every gradient sync of the step, the in-stage one of
gradients still partial after backward (sequence-parallel norm weights: ``stage_sync``)
included.

>>> import torch
>>> from hspmd.train.config import AdamConfig
>>> p = torch.ones(2, dtype=torch.bfloat16, requires_grad=True)
>>> class OneRank: rank = 0
>>> post = MixedPost({"w": p}, (), adam=AdamConfig(lr=0.5), world=OneRank())
>>> p.grad = torch.tensor([1.0, -1.0], dtype=torch.bfloat16); post.step()
>>> p.tolist(), post.masters["w"].dtype
([0.5, 1.5], torch.float32)
"""

from __future__ import annotations

from typing import Any, Protocol

import torch

from hspmd.specialize.grad_sync import StageGradSync
from hspmd.switch.live import TrainState
from hspmd.train.config import AdamConfig
from hspmd.train.optim import Adam
from hspmd.train.overlap import GradOverlap
from hspmd.train.sync import SyncItem, gathered, gathered_fp32, grad_of, scatter_back

__all__ = ["MixedPost", "PlainPost", "Post", "load_adam", "adam_states"]


class Post(Protocol):
    """A step's Post, split in two: ``finish_sync`` (communication; optimizer states
    untouched, so that a failure during the sync leaves a step that can be redone exactly)
    then ``apply`` (the optimizer; ZeRO-1's and the home layout's weight gathers)."""

    @property
    def owned(self) -> frozenset[str]:
        """The names of ``grads()`` this rank counts in the global norm."""
        ...

    def arm(self) -> None:
        """The next backward is the step's last: overlap the gradient sync with it."""
        ...

    def step(self) -> None:
        """``finish_sync`` then ``apply`` (no clipping)."""
        ...

    def finish_sync(self) -> None: ...

    def grads(self) -> dict[str, torch.Tensor]:
        """The gradients the optimizer steps on, by name (final after ``finish_sync``)."""
        ...

    def apply(self) -> None: ...

    def zero_grad(self) -> None: ...

    def state(self) -> TrainState:
        """name -> (fp32 master, exp_avg, exp_avg_sq): this rank's pieces (switch, save)."""
        ...

    def load_state(
        self, state: TrainState, *, steps: int, compute: dict[str, torch.Tensor] | None = None
    ) -> None:
        """Take over moved or loaded state; the compute weights follow from the masters
        (``compute``: ZeRO-1's whole pieces, when they came with the state)."""
        ...


def adam_states(adam: Adam, names: list[str]) -> TrainState:
    return {
        n: (p, m, v)
        for n, p, m, v in zip(names, adam.params, adam.exp_avg, adam.exp_avg_sq, strict=True)
    }


@torch.no_grad()
def load_adam(adam: Adam, names: list[str], state: TrainState, steps: int) -> None:
    for n, p, m, v in zip(names, adam.params, adam.exp_avg, adam.exp_avg_sq, strict=True):
        master, exp_avg, exp_avg_sq = state[n]
        p.copy_(master)
        m.copy_(exp_avg)
        v.copy_(exp_avg_sq)
    adam.steps = steps


def _grads(tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    return {n: t.grad for n, t in tensors.items() if t.grad is not None}


class PlainPost:
    """fp32: sync the local gradients, then Adam on the local parameters. ``owned``: the
    names this rank counts in the global gradient norm (None: all, one rank)."""

    def __init__(
        self, params: dict[str, torch.Tensor], sync: tuple[SyncItem, ...], *,
        adam: AdamConfig, world: Any, stage_sync: tuple[StageGradSync, ...] = (),
        owned: frozenset[str] | None = None,
    ) -> None:  # fmt: skip
        self.params, self.sync, self.world = params, sync, world
        self.owned = frozenset(params) if owned is None else owned
        self.adam = Adam(list(params.values()), adam, names=list(params))
        self.overlap = GradOverlap(
            sync, params, world, local=self._local, donate=True, stage_sync=stage_sync
        )

    def _local(self, item: SyncItem) -> torch.Tensor:
        return gathered(item, [grad_of(self.params[n], n) for n in item.names])

    def arm(self) -> None:
        self.overlap.arm()

    @torch.no_grad()
    def step(self) -> None:
        self.finish_sync()
        self.apply()

    @torch.no_grad()
    def finish_sync(self) -> None:
        """The gradient sync only: the optimizer states stay untouched (elastic runs redo a
        step whose sync failed)."""
        for item, out in self.overlap.results():
            scatter_back(out, [grad_of(self.params[n], n) for n in item.names])

    def grads(self) -> dict[str, torch.Tensor]:
        return _grads(self.params)

    @torch.no_grad()
    def apply(self) -> None:
        """Adam on the synced gradients (after ``finish_sync``; no communication)."""
        self.adam.step()

    def zero_grad(self) -> None:
        self.adam.zero_grad()

    def state(self) -> TrainState:
        return adam_states(self.adam, list(self.params))

    def load_state(
        self, state: TrainState, *, steps: int, compute: dict[str, torch.Tensor] | None = None
    ) -> None:
        load_adam(self.adam, list(self.params), state, steps)


class MasterAdam:
    """What the Posts with fp32 masters share: compute ``params``, ``masters``, Adam on them."""

    params: dict[str, torch.Tensor]
    masters: dict[str, torch.Tensor]
    adam: Adam
    owned: frozenset[str]

    @torch.no_grad()
    def step(self) -> None:
        self.finish_sync()
        self.apply()

    def finish_sync(self) -> None:
        raise NotImplementedError

    def apply(self) -> None:
        raise NotImplementedError

    def grads(self) -> dict[str, torch.Tensor]:
        return _grads(self.masters)

    def zero_grad(self) -> None:
        for param in self.params.values():
            param.grad = None

    def state(self) -> TrainState:
        return adam_states(self.adam, list(self.masters))


class MixedPost(MasterAdam):
    """bf16 compute parameters with fp32 masters of the same annotation (``owned``: as
    ``PlainPost``'s)."""

    def __init__(
        self, params: dict[str, torch.Tensor], sync: tuple[SyncItem, ...], *,
        adam: AdamConfig, world: Any, stage_sync: tuple[StageGradSync, ...] = (),
        owned: frozenset[str] | None = None,
    ) -> None:  # fmt: skip
        self.params, self.sync, self.world = params, sync, world
        self.owned = frozenset(params) if owned is None else owned
        self.masters = {n: p.detach().float().clone() for n, p in params.items()}
        self.adam = Adam(list(self.masters.values()), adam, names=list(self.masters))
        self.overlap = GradOverlap(
            sync, params, world, local=self._local, donate=True, stage_sync=stage_sync
        )

    def _local(self, item: SyncItem) -> torch.Tensor:
        """The fp32 gradients of ``item``: synced in fp32, as the masters' gradients."""
        return gathered_fp32(item, self.params)

    def arm(self) -> None:
        self.overlap.arm()

    @torch.no_grad()
    def finish_sync(self) -> None:
        """The gradient sync into the masters' gradients; masters and moments untouched."""
        synced = self.overlap.results()
        for name, param in self.params.items():
            self.masters[name].grad = grad_of(param, name).float()
        for item, out in synced:
            scatter_back(out, [grad_of(self.masters[n], n) for n in item.names])

    @torch.no_grad()
    def apply(self) -> None:
        """Adam on the masters, then the compute weights (no communication)."""
        self.adam.step()
        for name, param in self.params.items():
            param.copy_(self.masters[name])

    @torch.no_grad()
    def load_state(
        self, state: TrainState, *, steps: int, compute: dict[str, torch.Tensor] | None = None
    ) -> None:
        load_adam(self.adam, list(self.masters), state, steps)
        for name, param in self.params.items():
            param.copy_(self.masters[name])
