"""Gather again in backward: what autograd keeps of an all-gather's output is its input.

Under sequence parallelism a stage all-gathers the norm's output (split over the sequence
within the TP group) before the column-parallel matmuls, and each matmul keeps its input
for the weight gradient: the whole gathered rows, ``tp`` times the shard. Megatron-LM
keeps the shard and all-gathers it again in backward; so does this module, for every
marker whose forward plan is a single all-gather among exactly the ranks that hold its
input and its output (the stage's TP group: every member runs the same graph, so every
member gathers again, in the same order).

``Regather`` is a context manager for one forward: while it is active the reshard runner
``note``\\ s each such output, and autograd's saved-tensor hooks save a tensor that views a
noted output's storage as a handle (the input shard, and the view's size, stride and
offset). In backward the first unpack of a handle gathers the shard again (the same
all-gather: the same bits) and the later unpacks of the same output reuse it; the
gathered tensor is dropped after the last one. Layers run under activation
checkpointing keep their own hooks (the innermost wins) and are not affected.

    regather = Regather(world)
    with regather:
        loss = exe(tokens, targets)
    loss.backward()          # each gathered input is all-gathered again when needed
"""

from __future__ import annotations

import weakref
from dataclasses import KW_ONLY, dataclass, field
from typing import Any

import torch

from hspmd.comm.plan import AllGather, CommPlan
from hspmd.runtime.execute import run_plan
from hspmd.runtime.world import World

__all__ = ["Regather", "regatherable"]


def regatherable(plan: CommPlan, rank: int) -> bool:
    """Whether ``plan`` is one all-gather among exactly the ranks holding its input and
    its output, ``rank`` among them."""
    if len(plan.steps) != 1 or not isinstance(plan.steps[0], AllGather):
        return False
    ranks = plan.steps[0].ranks
    return rank in ranks and set(plan.src.ranks) == set(plan.dst.ranks) == set(ranks)


@dataclass(eq=False, slots=True)
class _Source:
    """One noted all-gather: its input shard, its plan, and the gathered tensor while
    unpacks of it remain (``pending``: handles not yet unpacked)."""

    shard: torch.Tensor
    version: int
    plan: CommPlan
    world: World
    _: KW_ONLY
    pending: int = 0
    full: torch.Tensor | None = None

    def gather(self) -> torch.Tensor:
        if self.shard._version != self.version:
            raise RuntimeError(
                "an all-gather's input was modified in place after the forward: its "
                "output cannot be gathered again for backward"
            )
        if self.full is None:
            out = run_plan(self.plan, self.shard, self.world, dtype=self.shard.dtype)
            assert out is not None
            self.full = out
        full = self.full
        self.pending -= 1
        if self.pending <= 0:
            self.full = None  # the last unpack: the gathered tensor goes with its user
        return full


@dataclass(eq=False, slots=True)
class _Handle:
    """What autograd keeps for one saved view of a noted output: its source and the
    view's geometry on the gathered storage."""

    source: _Source
    size: tuple[int, ...]
    stride: tuple[int, ...]
    offset: int


@dataclass(eq=False)
class Regather:
    """Saved-tensor hooks that keep noted all-gather outputs as their inputs (module
    docstring). ``saved`` counts the bytes not kept, for tests and traces."""

    world: World
    saved: int = 0
    _noted: dict[int, tuple[weakref.ref[torch.UntypedStorage], _Source]] = field(
        default_factory=dict
    )
    _hooks: Any = None

    @property
    def active(self) -> bool:
        return self._hooks is not None

    def note(self, shard: torch.Tensor, out: torch.Tensor, plan: CommPlan) -> None:
        """``out`` is ``plan``'s all-gather of ``shard``, ``plan`` ``regatherable`` (the
        caller checks it once per marker); a no-op unless active."""
        if not self.active or out.numel() == 0:
            return
        storage = out.untyped_storage()
        source = _Source(shard.detach(), shard._version, plan, self.world)
        self._noted[storage.data_ptr()] = (weakref.ref(storage), source)

    def _pack(self, t: torch.Tensor) -> Any:
        if not self._noted or t.numel() == 0:
            return t
        storage = t.untyped_storage()
        entry = self._noted.get(storage.data_ptr())
        if entry is None or entry[0]() is not storage:
            return t
        source = entry[1]
        source.pending += 1
        self.saved += t.numel() * t.element_size()
        return _Handle(source, tuple(t.size()), tuple(t.stride()), int(t.storage_offset()))

    @staticmethod
    def _unpack(saved: Any) -> torch.Tensor:
        if not isinstance(saved, _Handle):
            return saved
        full = saved.source.gather()
        return full.as_strided(saved.size, saved.stride, saved.offset)

    def __enter__(self) -> Regather:
        self._hooks = torch.autograd.graph.saved_tensors_hooks(self._pack, self._unpack)
        self._hooks.__enter__()
        return self

    def __exit__(self, *exc: object) -> None:
        hooks, self._hooks = self._hooks, None
        self._noted.clear()
        hooks.__exit__(*exc)
