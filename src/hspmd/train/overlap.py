"""Gradient synchronization overlapped with the step's last backward, as DDP does.

Post's plans (``hspmd.train.sync`` items, or ZeRO-1's reduce plans) are the same; only
when they are issued changes. A parameter's gradient is final after the last micro-batch's
backward has accumulated it, so during that backward (``arm()``) a post-accumulate-grad
hook counts each item's missing gradients and, as items complete, issues them with
``start_plan`` in the items' static order (reverse model order: the order backward
finishes them). An item that completes before an earlier one waits for it, so every rank
of a group issues the group's collectives in the same order whatever order its hooks fire
in. ``finish()`` issues what is left (in the same order), waits for everything and returns
each item's result; without ``arm()`` it is the synchronous Post::

    step      F0 B0 F1 B1 ......... (arm) B3 ........................ finish  Adam
    issued                              item 0 | item 1 | item 2 ...  rest, wait

Items stay for ``finish`` when their plan would block inside a hook (``startable`` is
false: point-to-point steps such as ZeRO-1's split-reduce-scatter). Gradients still partial
inside the stage after backward (``stage_sync``: sequence-parallel norm weights, summed over
the TP group, ``hspmd.specialize.grad_sync``) are synced here too, each item's just before
the item is issued: the stage's flat bucket is cut to the item's names
(``cut_stage_sync``), so an item of norm weights starts during backward like any other.
Every TP rank of a stage holds the same items in the same static order and its hooks fire
at the same point of the same backward, so the in-stage all-reduces meet in order. The
names no item holds (one pipeline: no item at all) are synced in ``finish``.

>>> import torch
>>> from hspmd.comm.plan import CommPlan
>>> from hspmd.annotation import parse_annotation as A
>>> w = torch.ones(2, requires_grad=True)
>>> item = SyncItem(("w",), CommPlan(A("[0]{}"), A("[0]{}"), (2,), ()), False)
>>> class OneRank: rank = 0
>>> overlap = GradOverlap([item], {"w": w}, OneRank(), local=lambda i: w.grad)
>>> overlap.arm(); (w * 3).sum().backward(); overlap.issued
1
>>> [t.tolist() for t in overlap.finish()]
[[3.0, 3.0]]
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from typing import Any

import torch

from hspmd.comm.resolve import resolve
from hspmd.runtime.executable import run_stage_grad_sync
from hspmd.runtime.execute import Started, start_plan, startable
from hspmd.runtime.trace import span_on
from hspmd.specialize.grad_sync import StageGradSync
from hspmd.train.sync import SyncItem

__all__ = ["GradOverlap", "cut_stage_sync"]


def cut_stage_sync(
    stage: Sequence[StageGradSync],
    groups: Sequence[Sequence[str]],
    shape: Callable[[str], tuple[int, ...]],
) -> tuple[list[tuple[StageGradSync, ...]], tuple[StageGradSync, ...]]:
    """The in-stage syncs of each group of names, and those of the names in no group.

    A flat bucket (whole pieces, one plan over the concatenation) is cut to a group's
    names and planned again for their size; a split parameter's plan has one name and is
    kept. A cut of one name is planned on that parameter's ``shape`` (a whole piece's is the
    global one), as ``run_stage_grad_sync`` runs it unflattened. Both keep ``stage``'s order.

    >>> from hspmd.annotation import parse_annotation as A
    >>> bucket = StageGradSync(("n0", "n1", "n2"), resolve(A("[0,1]{P:2}"), A("[0,1]{D:2}"), (12,)))
    >>> per, rest = cut_stage_sync([bucket], [["n2", "n1"], ["n0"]], shape=lambda n: (2, 2))
    >>> [[(s.names, s.plan.shape) for s in syncs] for syncs in per]
    [[(('n1', 'n2'), (8,))], [(('n0',), (2, 2))]]
    >>> rest
    ()
    """

    def part(sync: StageGradSync, names: Sequence[str]) -> StageGradSync:
        if tuple(names) == sync.names:
            return sync
        size = shape(names[0]) if len(names) == 1 else (sum(math.prod(shape(n)) for n in names),)
        return StageGradSync(tuple(names), resolve(sync.plan.src, sync.plan.dst, size))

    member = {name: g for g, names in enumerate(groups) for name in names}
    per: list[list[StageGradSync]] = [[] for _ in groups]
    rest: list[StageGradSync] = []
    for sync in stage:
        cuts: dict[int | None, list[str]] = {}
        for name in sync.names:
            cuts.setdefault(member.get(name), []).append(name)
        for g, names in cuts.items():
            (rest if g is None else per[g]).append(part(sync, names))
    return [tuple(p) for p in per], tuple(rest)


class GradOverlap:
    """This rank's gradient plans, issued during the last backward once ``arm()``-ed.

    ``items``: every rank's items in the static order (the ones this rank is not a source
    of are dropped here); ``local(item)``: the tensor its plan starts from, read when it
    is issued; ``donate``: that tensor is the plan's to overwrite; ``stage_sync``: the
    stage's in-stage syncs of partial gradients (``Executable.grad_sync``), run before
    the items that hold them (module docstring).
    """

    def __init__(
        self, items: Sequence[SyncItem], params: dict[str, torch.Tensor], world: Any, *,
        local: Callable[[SyncItem], torch.Tensor], donate: bool = False,
        stage_sync: Sequence[StageGradSync] = (),
    ) -> None:  # fmt: skip
        self.items = [item for item in items if world.rank in item.plan.src]
        self.params, self.world, self.local, self.donate = params, world, local, donate
        self.early = [startable(i.plan) for i in self.items]
        self.pre, self.rest = cut_stage_sync(
            stage_sync, [i.names for i in self.items], lambda n: tuple(params[n].shape)
        )
        self.owner = {name: index for index, i in enumerate(self.items) for name in i.names}
        self.armed = False
        self._reset()
        for name in self.owner:
            params[name].register_post_accumulate_grad_hook(self._hook_for(name))

    def _reset(self) -> None:
        self.missing = [len(item.names) for item in self.items]
        self.started: list[Started] = []
        self.armed = False

    @property
    def issued(self) -> int:
        return len(self.started)

    def arm(self) -> None:
        """The next backward is the step's last: issue items as their gradients finish."""
        self.armed = True

    def _hook_for(self, name: str) -> Callable[[torch.Tensor], None]:
        def hook(_param: torch.Tensor) -> None:
            if self.armed:
                self.missing[self.owner[name]] -= 1
                self._issue_ready()

        return hook

    def _issue_ready(self) -> None:
        """Issue items in static order while the next one is complete and may start."""
        while self.issued < len(self.items):
            index = self.issued
            if self.missing[index] > 0 or not self.early[index]:
                return
            self._start(index)

    def _start(self, index: int) -> None:
        item = self.items[index]
        with torch.no_grad():
            if self.pre[index]:  # its partial gradients, summed inside the stage first
                run_stage_grad_sync(self.pre[index], self.params, self.world)
            started = start_plan(item.plan, self.local(item), self.world, donate=self.donate)
        self.started.append(started)

    def finish(self) -> list[torch.Tensor]:
        """Issue the items not issued yet, sync the partial gradients no item holds, wait
        for all; each item's result, in order."""
        with span_on(self.world, "grad sync", cat="sync"):
            for index in range(self.issued, len(self.items)):
                self._start(index)
            with torch.no_grad():
                if self.rest:
                    run_stage_grad_sync(self.rest, self.params, self.world)
                outs = [started.wait() for started in self.started]
        self._reset()
        assert all(out is not None for out in outs), "every source of a grad plan keeps a piece"
        return [out for out in outs if out is not None]

    def results(self) -> list[tuple[SyncItem, torch.Tensor]]:
        """``finish()`` paired with the items."""
        return list(zip(self.items, self.finish(), strict=True))
