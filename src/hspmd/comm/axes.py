"""A subgroup as the resolver sees it: its ranks in DG order and one entry per DS axis.

Unlike ``DistributedStates``, ``Axes`` may list duplicate (``D``) or partial (``P``) on several
axes: that is what an all-reduce of ``{P:2,0:2,D:2}`` leaves (``{D:2,0:2,D:2}``), or a zero-pad
of ``{0:2,P:2}`` towards ``{P:2,0:2}`` (``{P:2,P:2}``). ``subgroup()`` turns it back into a valid
(DG, DS) pair that gives every rank the same piece, by moving such axes last (merged per kind)
and reordering the DG to match::

    >>> Axes((0, 1, 2, 3, 4, 5, 6, 7), ((-1, 2), (0, 2), (-1, 2))).subgroup()
    (DeviceGroup(ranks=(0, 1, 4, 5, 2, 3, 6, 7)), DistributedStates(entries=((0, 2), (-1, 4))))

Axis groups are the collective groups of one DS entry: ranks whose other indices agree,
in index order along the axis (``{0:2,1:2}`` on ``[0,1,2,3]``: axis 0 -> (0,2),(1,3)).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from hspmd.annotation import DUP, PARTIAL, Annotation, DeviceGroup, DistributedStates, Region

Group = tuple[int, ...]


@dataclass(frozen=True, slots=True)
class Axes:
    ranks: tuple[int, ...]
    entries: tuple[tuple[int, int], ...]

    @staticmethod
    def of(group: DeviceGroup, ds: DistributedStates) -> Axes:
        return Axes(group.ranks, ds.entries)

    @property
    def degrees(self) -> tuple[int, ...]:
        return tuple(n for _, n in self.entries)

    def dims(self) -> tuple[int, ...]:
        return tuple(d for d, _ in self.entries)

    def replace(self, axis: int, dim: int) -> Axes:
        entries = list(self.entries)
        entries[axis] = (dim, entries[axis][1])
        return Axes(self.ranks, tuple(entries))

    def without_partial(self) -> Axes:
        return Axes(self.ranks, tuple((DUP if d == PARTIAL else d, n) for d, n in self.entries))

    def _grid(self) -> np.ndarray:
        return np.arange(len(self.ranks)).reshape(self.degrees or (1,))

    def groups(self, axis: int) -> tuple[Group, ...]:
        """The collective groups along ``axis`` (see the module docstring)."""
        rows = np.moveaxis(self._grid(), axis, -1).reshape(-1, self.entries[axis][1])
        return tuple(tuple(self.ranks[p] for p in row) for row in rows)

    def nonzero_on(self, axis: int) -> tuple[int, ...]:
        """Ranks whose index along ``axis`` is not 0 (they hold zeros after D -> P)."""
        grid = np.moveaxis(self._grid(), axis, 0)[1:]
        return tuple(sorted(self.ranks[p] for p in grid.reshape(-1)))

    def partial_zeros(self) -> tuple[int, ...]:
        """Ranks that hold zeros when a full value is made partial along the P axes."""
        out: set[int] = set()
        for axis, (dim, _) in enumerate(self.entries):
            if dim == PARTIAL:
                out.update(self.nonzero_on(axis))
        return tuple(sorted(out))

    def regions(self, part: Region) -> dict[int, Region]:
        """The region each rank holds when the subgroup covers ``part``."""
        out = {}
        for position, rank in enumerate(self.ranks):
            region = list(part)
            for (dim, degree), index in zip(
                self.entries, _indices(position, self.degrees), strict=True
            ):
                if dim >= 0:
                    start, stop = region[dim]
                    step = (stop - start) // degree
                    region[dim] = (start + index * step, start + (index + 1) * step)
            out[rank] = tuple(region)
        return out

    def merged_splits(self) -> Axes:
        """Adjacent axes splitting the same dim as one: ``(0,2),(0,3)`` is ``(0,6)`` (the
        outer axis cuts first, so the blocks are numbered as by one axis)."""
        entries: list[tuple[int, int]] = []
        for dim, degree in self.entries:
            if entries and dim >= 0 and entries[-1][0] == dim:
                entries[-1] = (dim, entries[-1][1] * degree)
            else:
                entries.append((dim, degree))
        return Axes(self.ranks, tuple(entries))

    def refined(self, degrees: Sequence[int]) -> Axes:
        """The same layout on finer axes: each entry cut into consecutive entries of the
        same dim whose degrees multiply to it (``degrees`` must refine ``self.degrees``)."""
        entries, queue = [], list(degrees)
        for dim, degree in self.entries:
            left = degree
            while left > 1:
                part = queue.pop(0)
                entries.append((dim, part))
                left //= part
        return Axes(self.ranks, tuple(entries))

    def subgroup(self) -> tuple[DeviceGroup, DistributedStates]:
        """A valid (DG, DS): adjacent axes splitting one dim merge, several D axes merge
        into one, and so do several P axes."""
        pairs = zip(self.entries, self.entries[1:], strict=False)
        if any(a[0] >= 0 and a[0] == b[0] for a, b in pairs):
            return self.merged_splits().subgroup()
        merged_kinds = [k for k in (PARTIAL, DUP) if self.dims().count(k) > 1]
        if not merged_kinds:
            return DeviceGroup(self.ranks), DistributedStates(self.entries)
        merged = [[a for a, (d, _) in enumerate(self.entries) if d == k] for k in merged_kinds]
        keep = [a for a in range(len(self.entries)) if not any(a in m for m in merged)]

        def key(position: int) -> tuple[int, ...]:
            index = _indices(position, self.degrees)
            out = [index[a] for a in keep]
            for axes in merged:
                flat = 0
                for a in axes:
                    flat = flat * self.entries[a][1] + index[a]
                out.append(flat)
            return tuple(out)

        order = sorted(range(len(self.ranks)), key=key)
        entries = tuple(self.entries[a] for a in keep) + tuple(
            (kind, math.prod(self.entries[a][1] for a in axes))
            for kind, axes in zip(merged_kinds, merged, strict=True)
        )
        return DeviceGroup(tuple(self.ranks[p] for p in order)), DistributedStates(entries)


def _indices(position: int, degrees: tuple[int, ...]) -> tuple[int, ...]:
    out = []
    for degree in reversed(degrees):
        out.append(position % degree)
        position //= degree
    return tuple(reversed(out))


def common_refinement(a: Sequence[int], b: Sequence[int]) -> tuple[int, ...] | None:
    """The coarsest degree list refining both ``a`` and ``b`` (each entry of either a
    product of consecutive entries of it), or None: ``(2, 2)`` and ``(4,)`` give ``(2, 2)``;
    ``(2, 3)`` and ``(3, 2)`` none.

    >>> common_refinement((2, 2), (4,)), common_refinement((2, 3), (3, 2))
    ((2, 2), None)
    """
    x, y, out = [n for n in a if n > 1], [n for n in b if n > 1], []
    while x and y:
        m, n = x[0], y[0]
        step = min(m, n)
        if max(m, n) % step:
            return None
        out.append(step)
        x = [m // step, *x[1:]] if m > step else x[1:]
        y = [n // step, *y[1:]] if n > step else y[1:]
    return tuple(out) if not x and not y else None


def axes_of(annotation: Annotation) -> list[Axes]:
    return [Axes.of(g, s) for g, s in zip(annotation.groups, annotation.states, strict=True)]


def layout(axes: Sequence[Axes], *, hdim: int, hsizes: tuple[int, ...] | None) -> Annotation:
    """The annotation of a list of subgroups (raises AnnotationError if they overlap)."""
    pairs = [a.subgroup() for a in axes]
    return Annotation(
        tuple(g for g, _ in pairs),
        tuple(s for _, s in pairs),
        hdim=hdim,
        hsizes=hsizes if hdim >= 0 else None,
    )
