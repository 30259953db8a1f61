"""Sizing a resolved plan: one resolution for a symbolic length, concrete slices per call.

A plan is resolved once at the maximum shape (``resolve(src, dst, (B, L_max, H))``); a
call with a shorter sequence sizes it: every region coordinate along a dim whose length
changed scales by ``new / old``. Even splits cut a dim at fractions of its length, so when
the new length is a multiple of ``length_multiple(plan, dim)`` every coordinate scales to an
integer and the sized plan is the plan ``resolve`` would give at the new shape (the finest
slices, owners and merges keep their order; only their sizes change)::

    resolved at (1, 8, 4): rank 0 sends [0:1,4:8,0:4] to rank 2
    sized to    (1, 6, 4): rank 0 sends [0:1,3:6,0:4] to rank 2

Collectives (all-reduce, all-gather, ...) and send-recv name groups and dims, not regions:
they are the same at every length. ``global_shape`` goes the other way, from a rank's local
tensor to the global shape it is a piece of (how a runtime finds the length of a call).

>>> from hspmd.annotation import parse_annotation as A
>>> from hspmd.comm.resolve import resolve
>>> plan = resolve(A("[0,1]{1:2}"), A("[2]{}"), (1, 8, 4))
>>> length_multiple(plan, 1)
2
>>> sized(plan, (1, 6, 4)) == resolve(A("[0,1]{1:2}"), A("[2]{}"), (1, 6, 4))
True
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence
from fractions import Fraction

from hspmd.annotation import Annotation, Region
from hspmd.comm.plan import BatchedSendRecv, CommPlan, SliceCollective, Step
from hspmd.errors import HspmdError

__all__ = ["SizingError", "global_shape", "length_multiple", "sized"]


class SizingError(HspmdError, ValueError):
    """A concrete shape that a plan resolved for another shape cannot be sized to."""


def _regions(step: Step) -> list[Region]:
    if isinstance(step, BatchedSendRecv):
        return [t.region for t in step.transfers]
    if isinstance(step, SliceCollective):
        return [r for s in step.slices for r in (s.region, *(reg for _, reg in s.owners))]
    return []


def _degree(annotation: Annotation, dim: int) -> int:
    """How many ways ``annotation`` cuts ``dim`` (subgroups times the deepest DS split)."""
    top = annotation.hsize if annotation.hdim == dim and not annotation.hsizes else 1
    inner = [math.prod(d for k, d in ds.entries if k == dim) for ds in annotation.states]
    return top * max(inner, default=1)


def length_multiple(plan: CommPlan, dim: int) -> int:
    """The smallest ``m`` such that ``plan`` can be sized to any multiple of ``m`` on ``dim``."""
    full = plan.shape[dim]
    out = 1
    for layout in plan.layouts:
        out = math.lcm(out, _degree(layout, dim))
    for step in plan.steps:
        for region in _regions(step):
            for coordinate in region[dim]:
                out = math.lcm(out, Fraction(coordinate, full).denominator)
    return out


def _scale_region(region: Region, factors: Sequence[Fraction | None]) -> Region:
    out = []
    for (lo, hi), factor in zip(region, factors, strict=True):
        if factor is not None:
            lo_f, hi_f = lo * factor, hi * factor
            if lo_f.denominator != 1 or hi_f.denominator != 1:
                raise ArithmeticError
            lo, hi = int(lo_f), int(hi_f)
        out.append((lo, hi))
    return tuple(out)


def _scale_step(step: Step, factors: Sequence[Fraction | None]) -> Step:
    if isinstance(step, BatchedSendRecv):
        transfers = tuple(
            dataclasses.replace(t, region=_scale_region(t.region, factors)) for t in step.transfers
        )
        return dataclasses.replace(step, transfers=transfers)
    if isinstance(step, SliceCollective):
        slices = tuple(
            dataclasses.replace(
                s,
                region=_scale_region(s.region, factors),
                owners=tuple((r, _scale_region(reg, factors)) for r, reg in s.owners),
            )
            for s in step.slices
        )
        return dataclasses.replace(step, slices=slices)
    return step


def sized(plan: CommPlan, shape: Sequence[int]) -> CommPlan:
    """``plan`` for a tensor of ``shape`` (same rank count; only lengths may change)."""
    shape = tuple(int(n) for n in shape)
    if shape == plan.shape:
        return plan
    if len(shape) != len(plan.shape):
        raise SizingError(
            f"cannot size a plan for shape {list(plan.shape)} to {list(shape)}: the number "
            "of dims differs; resolve the reshard for this shape instead"
        )
    factors = [
        None if new == old else Fraction(new, old)
        for new, old in zip(shape, plan.shape, strict=True)
    ]
    try:
        steps = tuple(_scale_step(step, factors) for step in plan.steps)
        for layout in plan.layouts:
            layout.check_shape(shape)
    except (ArithmeticError, ValueError):
        need = {d: length_multiple(plan, d) for d, f in enumerate(factors) if f is not None}
        raise SizingError(
            f"cannot size the reshard {plan.src} -> {plan.dst} from {list(plan.shape)} to "
            f"{list(shape)}: its slices need lengths that are multiples of {need} "
            "(dim: multiple); pad the sequence to such a length"
        ) from None
    return dataclasses.replace(plan, shape=shape, steps=steps)


def global_shape(plan: CommPlan, rank: int, local: Sequence[int]) -> tuple[int, ...]:
    """The global shape of which ``local`` is ``rank``'s piece of ``plan.src``, assuming
    the lengths scale as the plan's pieces do (``rank`` must hold a non-empty piece)."""
    piece = plan.src.piece(rank, plan.shape).shape
    out = []
    for dim, (want, got, full) in enumerate(zip(piece, local, plan.shape, strict=True)):
        if want == got:
            out.append(full)
            continue
        scaled = Fraction(full * got, want) if want else None
        if scaled is None or scaled.denominator != 1:
            raise SizingError(
                f"rank {rank}'s tensor of shape {list(local)} is no piece of {plan.src} at "
                f"any length near {list(plan.shape)} (dim {dim})"
            )
        out.append(int(scaled))
    return tuple(out)
