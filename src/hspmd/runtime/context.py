"""What a step executor gets besides the step and the tensor, and small shared helpers."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import KW_ONLY, dataclass
from typing import Any

import torch

from hspmd.annotation import Annotation, Piece, Region
from hspmd.runtime.world import World


@dataclass(frozen=True, slots=True)
class StepContext:
    """This rank, the layouts before and after the step, and how to make new tensors."""

    world: World
    before: Annotation
    after: Annotation
    shape: tuple[int, ...]
    like: dict[str, Any]  # dtype and device of new tensors
    _: KW_ONLY
    owned: bool  # the executor may overwrite the incoming tensor (and return it)

    @property
    def rank(self) -> int:
        return self.world.rank

    def old(self, rank: int | None = None) -> Piece:
        return self.before.piece(self.rank if rank is None else rank, self.shape)

    def new(self, rank: int | None = None) -> Piece:
        return self.after.piece(self.rank if rank is None else rank, self.shape)


# An issued step: the operations in flight, and what gives the step's result once they are
# done (unpacking, layout). ``finish`` waits and applies it; ``start_plan`` defers both.
Issued = tuple[list[Any], Callable[[], torch.Tensor | None]]


def finish(issued: Issued, ctx: StepContext) -> torch.Tensor | None:
    """Wait for an issued step's operations and return its result."""
    works, then = issued
    ctx.world.wait(works)
    return then()


def held(x: torch.Tensor | None, ctx: StepContext) -> torch.Tensor:
    """``x``, which a rank that sends in this step must have."""
    assert x is not None, f"rank {ctx.rank} has no tensor for a step it sends from"
    return x


def nbytes(tensor: torch.Tensor) -> int:
    return tensor.numel() * tensor.element_size()


def region_shape(region: Region) -> tuple[int, ...]:
    return tuple(b - a for a, b in region)
