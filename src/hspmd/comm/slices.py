"""Geometry of resolution: subgroup parts, finest slices, the owner/needer table, box merging.

The *finest slices* of a set of regions are the boxes cut by every start and stop of every
region along every dim. Each finest slice lies wholly inside or wholly outside each region,
so "who holds it" is a set of ranks::

    regions  rank 0: rows 0:4     rank 1: rows 4:8     rank 2: rows 0:8
    cuts     0, 4, 8
    slices   rows 0:4 held by {0, 2};  rows 4:8 held by {1, 2}

``holders_table`` computes that for two sets of pieces at once (owners in the source
layout, needers in the destination layout) with one bitmask per interval and dim, so it
stays fast for hundreds of tensors.
"""

from __future__ import annotations

import bisect
import itertools
from collections import defaultdict
from collections.abc import Iterable, Mapping, Sequence

from hspmd.annotation import Annotation, Region

SliceRow = tuple[Region, tuple[int, ...], tuple[int, ...]]
"""One row of a holders table: ``(slice, owners, needers)``."""


def full_region(shape: Sequence[int]) -> Region:
    return tuple((0, n) for n in shape)


def part_regions(annotation: Annotation, shape: Sequence[int]) -> tuple[Region, ...]:
    """The region each subgroup covers (the top tier), e.g. ``h0: [0]{} [1]{}`` on ``(8,)``
    gives ``(((0, 4),), ((4, 8),))``. Raises AnnotationError where the annotation does not fit.
    """
    annotation.check_shape(shape)
    full = full_region(shape)
    if annotation.hdim < 0:
        return (full,) * annotation.hsize
    dim, length = annotation.hdim, shape[annotation.hdim]
    sizes = annotation.hsizes or (length // annotation.hsize,) * annotation.hsize
    out, start = [], 0
    for size in sizes:
        out.append(full[:dim] + ((start, start + size),) + full[dim + 1 :])
        start += size
    return tuple(out)


def contains(outer: Region, inner: Region) -> bool:
    return all(a0 <= b0 and b1 <= a1 for (a0, a1), (b0, b1) in zip(outer, inner, strict=True))


def _intervals(regions: Iterable[Region], shape: Sequence[int]) -> list[list[tuple[int, int]]]:
    cuts: list[set[int]] = [{0, n} for n in shape]
    for region in regions:
        for dim, (start, stop) in enumerate(region):
            cuts[dim].update((start, stop))
    return [list(itertools.pairwise(sorted(c))) for c in cuts]


def _masks(intervals: list[list[tuple[int, int]]], regions: Sequence[Region]) -> list[list[int]]:
    """``masks[dim][i]``: bit ``j`` set when ``regions[j]`` covers interval ``i`` of ``dim``."""
    out = []
    for dim, spans in enumerate(intervals):
        starts = [a for a, _ in spans]
        masks = [0] * len(spans)
        for j, region in enumerate(regions):
            lo, hi = region[dim]
            for i in range(bisect.bisect_left(starts, lo), bisect.bisect_left(starts, hi)):
                masks[i] |= 1 << j
        out.append(masks)
    return out


def _by_region(pieces: Mapping[int, Region]) -> tuple[list[Region], list[tuple[int, ...]]]:
    groups: dict[Region, list[int]] = defaultdict(list)
    for rank, region in pieces.items():
        groups[region].append(rank)
    regions = list(groups)
    return regions, [tuple(sorted(groups[r])) for r in regions]


def _ranks_of(mask: int, ranks: list[tuple[int, ...]]) -> tuple[int, ...]:
    out: list[int] = []
    while mask:
        low = mask & -mask
        out.extend(ranks[low.bit_length() - 1])
        mask ^= low
    return tuple(sorted(out))


def holders_table(
    owners: Mapping[int, Region], needers: Mapping[int, Region], shape: Sequence[int]
) -> list[SliceRow]:
    """Every finest slice that some needer needs, with its owners and needers (sorted ranks).

    >>> holders_table({0: ((0, 4),), 1: ((4, 8),)}, {2: ((0, 8),)}, (8,))
    [(((0, 4),), (0,), (2,)), (((4, 8),), (1,), (2,))]
    """
    src_regions, src_ranks = _by_region(owners)
    dst_regions, dst_ranks = _by_region(needers)
    intervals = _intervals(itertools.chain(src_regions, dst_regions), shape)
    src_masks, dst_masks = _masks(intervals, src_regions), _masks(intervals, dst_regions)
    rows: list[SliceRow] = []
    # one tuple per distinct holder set, shared by its rows: a split collective over 1024
    # replicas has 8192 rows but 8 owner sets of 1024 ranks (callers key on the objects)
    owned: dict[int, tuple[int, ...]] = {}
    needed: dict[int, tuple[int, ...]] = {}
    for index in itertools.product(*(range(len(spans)) for spans in intervals)):
        need = -1
        own = -1
        for dim, i in enumerate(index):
            need &= dst_masks[dim][i]
            own &= src_masks[dim][i]
        if need <= 0:
            continue
        box = tuple(intervals[dim][i] for dim, i in enumerate(index))
        own = max(own, 0)
        if own not in owned:
            owned[own] = _ranks_of(own, src_ranks)
        if need not in needed:
            needed[need] = _ranks_of(need, dst_ranks)
        rows.append((box, owned[own], needed[need]))
    return rows


def merge_boxes(boxes: Iterable[Region]) -> list[Region]:
    """Merge disjoint boxes that are adjacent along one dim and equal along the others.

    >>> merge_boxes([((0, 2), (0, 4)), ((2, 4), (0, 4)), ((4, 6), (0, 2))])
    [((0, 4), (0, 4)), ((4, 6), (0, 2))]
    """
    out = sorted(boxes)
    if len(out) < 2:
        return out
    for _ in range(2):
        for dim in reversed(range(len(out[0]))):
            out = _merge_along(out, dim)
    return sorted(out)


def _merge_along(boxes: list[Region], dim: int) -> list[Region]:
    lines: dict[Region, list[tuple[int, int]]] = defaultdict(list)
    for box in boxes:
        lines[box[:dim] + box[dim + 1 :]].append(box[dim])
    out: list[Region] = []
    for rest, spans in lines.items():
        spans.sort()
        merged = [spans[0]]
        for start, stop in spans[1:]:
            if start == merged[-1][1]:
                merged[-1] = (merged[-1][0], stop)
            else:
                merged.append((start, stop))
        out.extend(rest[:dim] + (span,) + rest[dim:] for span in merged)
    return out
