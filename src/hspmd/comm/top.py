"""Top-tier resolution: only hdim changes, over the same subgroups with the same DS union.

Works on the finest slices of the before and after layouts (Figure 9)::

    before -> after   step                  per slice
    hP -> hD          split-all-reduce      sum over one holder per subgroup, all holders get it
                      (all-reduces where equal pieces pair up, one rank per subgroup)
    hP -> h{k}        split-reduce-scatter  sum over one holder per subgroup into each needer
    h{k} -> hD        split-all-gather      every needer gets the slice from one owner
    hD -> h{k}        local slice           (only if each new piece lies in the old one)
    hD -> hP          local                 subgroup 0 keeps, the others hold zeros
    h{k} -> hP        local zero-pad        (only if each old piece lies in the new one)

``top_step`` returns None where none applies (h{k} -> h{j}, or a local cut that would need
data from another rank); the resolver then uses BSR. Example: ``h0: [0,1]{1:2} [2,3]{1:2}``
to ``hD: [0,1]{1:2} [2,3]{1:2}`` on shape (8, 12) is one split-all-gather whose slices are
``[0:8,0:6] over [0,2]`` (owners 0: rows 0:4, 2: rows 4:8) and ``[0:8,6:12] over [1,3]``.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Sequence

from hspmd.annotation import DUP, PARTIAL, Annotation, Region
from hspmd.comm.plan import (
    AllGather,
    AllReduce,
    Local,
    ReduceScatter,
    SliceReduce,
    SplitAllGather,
    SplitAllReduce,
    SplitReduceScatter,
    Step,
)
from hspmd.comm.slices import contains, holders_table, merge_boxes


def _regions(layout: Annotation, shape: Sequence[int]) -> dict[int, Region]:
    return {r: p.region for r, p in layout.pieces(shape).items()}


def top_step(before: Annotation, after: Annotation, shape: Sequence[int]) -> Step | None:
    """The one step from ``before`` to ``after`` (same subgroups, hdim differs), or None."""
    old, new = _regions(before, shape), _regions(after, shape)
    h1, h2 = before.hdim, after.hdim
    if h1 == PARTIAL and h2 == DUP:
        return _as_all_reduce(before, old) or _split_all_reduce(before, old, shape)
    if h1 == PARTIAL and h2 >= 0:
        return _as_reduce_scatter(before, h2, old, new) or _split_reduce_scatter(
            before, old, new, shape
        )
    if h1 >= 0 and h2 == DUP:
        return _as_all_gather(after, h1, old, new) or _split_all_gather(old, new, shape)
    if h1 == DUP and h2 == PARTIAL:
        first = before.groups[0].ranks
        zero = tuple(sorted(r for r in old if r not in first))
        return Local(tuple(sorted(first)), zero)
    if h1 == DUP and h2 >= 0 and all(contains(old[r], new[r]) for r in new):
        return Local(tuple(sorted(new)))
    if h1 >= 0 and h2 == PARTIAL and all(contains(new[r], old[r]) for r in new):
        return Local(tuple(sorted(new)))
    return None


class _Representatives:
    """One holder per subgroup of ``layout``: ``prefer`` where it is a holder, else the
    lowest rank. The choice per holders tuple is kept, by the tuple's identity
    (``holders_table`` shares one tuple per holder set): the finest slices of one tensor
    have few distinct holder sets (one per TP position), so a split collective over 1024
    replicas asks 8192 times for 8 sets of 1024 ranks."""

    def __init__(self, layout: Annotation) -> None:
        self.layout = layout
        # by id(holders): (holders, subgroup -> representative, representatives sorted)
        self._chosen: dict[int, tuple[tuple[int, ...], dict[int, int], tuple[int, ...]]] = {}
        self._into: dict[tuple[int, int], tuple[tuple[int, ...], tuple[int, ...]]] = {}

    def _default(self, holders: tuple[int, ...]) -> tuple[dict[int, int], tuple[int, ...]]:
        found = self._chosen.get(id(holders))
        if found is None:
            chosen: dict[int, int] = {}
            for rank in sorted(holders):
                chosen.setdefault(self.layout.subgroup_of(rank)[0], rank)
            found = self._chosen[id(holders)] = (holders, chosen, tuple(sorted(chosen.values())))
        return found[1], found[2]

    def __call__(self, holders: tuple[int, ...], prefer: int = -1) -> set[int]:
        chosen, _ = self._default(holders)
        if prefer in holders:
            chosen = {**chosen, self.layout.subgroup_of(prefer)[0]: prefer}
        return set(chosen.values())

    def summed_into(
        self, holders: tuple[int, ...], root: int
    ) -> tuple[tuple[int, ...], tuple[int, ...]]:
        """``(ranks, zero)`` of a slice of ``holders`` summed into ``root``: the
        representatives with ``root`` for its own subgroup, and ``root`` itself where it
        holds nothing. Where ``root`` is its subgroup's usual representative (every root of
        a TP-split weight), every root shares one ``ranks`` tuple: a split collective over
        1024 replicas keeps 8 tuples of 1024 ranks, not 8192."""
        chosen, plain = self._default(holders)
        if chosen.get(self.layout.subgroup_of(root)[0]) == root:  # so root holds it
            return plain, ()
        key = (id(holders), root)
        if key not in self._into:
            summed = self(holders, prefer=root)
            zero = () if root in summed else (root,)
            self._into[key] = (tuple(sorted(summed | {root})), zero)
        return self._into[key]


def _slices(keyed: dict[tuple, list[Region]]) -> list[tuple[Region, tuple]]:
    """Merge the boxes of each key; sorted ``(box, key)`` pairs."""
    return sorted((box, key) for key, boxes in keyed.items() for box in merge_boxes(boxes))


def _split_all_reduce(
    before: Annotation, regions: dict[int, Region], shape: Sequence[int]
) -> SplitAllReduce:
    keyed: dict[tuple, list[Region]] = defaultdict(list)
    representatives = _Representatives(before)
    for box, holders, _ in holders_table(regions, regions, shape):
        summed = representatives(holders)
        keyed[(holders, tuple(r for r in holders if r not in summed))].append(box)
    return SplitAllReduce(
        tuple(SliceReduce(box, ranks, zero) for box, (ranks, zero) in _slices(keyed))
    )


def _as_all_reduce(before: Annotation, regions: dict[int, Region]) -> AllReduce | None:
    """Plain all-reduces over disjoint groups, where the summands' pieces line up.

    Ranks of one subgroup with the same region hold the same copy of its summand. Where
    every region is held by the same number of ranks in each subgroup, pairing those
    ranks position by position gives groups of one rank per subgroup, all holding one
    region: an all-reduce per group, no zeroed copies. Two pipelines with the same TP
    degree (the paper's cross-pipeline AR), or a norm weight duplicated in both stages::

        hP: [0,1]{D:2} [2,3]{D:2} -> hD: ...    all-reduce over [0,2] and [1,3]
        hP: [0,1]{1:2} [2,3,4,5]{1:4}            None (split-all-reduce)
    """
    paired = _paired(before, regions)
    if paired is None:
        return None
    return AllReduce(tuple(sorted(tuple(sorted(g)) for gs in paired.values() for g in gs)))


def _paired(
    before: Annotation, regions: dict[int, Region]
) -> dict[Region, list[tuple[int, ...]]] | None:
    """Per summand region, its holders paired position by position across the subgroups
    (each group in subgroup order); None where a region has more holders in one subgroup
    than in another."""
    by_region: dict[Region, list[list[int]]] = {}
    for index, group in enumerate(before.groups):
        for rank in sorted(group.ranks):
            holders = by_region.get(regions[rank])
            if holders is None:  # not setdefault: its default costs hsize lists per rank
                holders = by_region[regions[rank]] = [[] for _ in before.groups]
            holders[index].append(rank)
    if any(len({len(ranks) for ranks in holders}) != 1 for holders in by_region.values()):
        return None
    return {region: list(zip(*holders, strict=True)) for region, holders in by_region.items()}


def _as_reduce_scatter(
    before: Annotation, dim: int, old: dict[int, Region], new: dict[int, Region]
) -> ReduceScatter | None:
    """Plain reduce-scatters over disjoint groups, where the pieces line up (``_lined_up``).
    ZeRO's gradient reduce over identical replicas is this: one collective per TP position,
    not a message per replica pair (a split collective over 1024 replicas would list 8192
    slices of 1024 ranks)::

        hP: [0,1]{1:2} [2,3]{1:2} -> h0: ...       reduce-scatter over [0,2] and [1,3]
        hP: [0,1]{1:2} [2,3,4,5]{1:4}               None (split-reduce-scatter)
    """
    groups = _lined_up(before, dim, old, new)
    return None if groups is None else ReduceScatter(groups, dim=dim)


def _as_all_gather(
    after: Annotation, dim: int, old: dict[int, Region], new: dict[int, Region]
) -> AllGather | None:
    """Plain all-gathers over disjoint groups, where the pieces line up: the reverse of
    ``_as_reduce_scatter``. ZeRO's parameter gather from its shards::

        h0: [0,1]{1:2} [2,3]{1:2} -> hD: ...       all-gather over [0,2] and [1,3]
    """
    groups = _lined_up(after, dim, new, old)
    return None if groups is None else AllGather(groups, dim=dim)


def _lined_up(
    layout: Annotation, dim: int, whole: dict[int, Region], cut: dict[int, Region]
) -> tuple[tuple[int, ...], ...] | None:
    """Groups of ranks, one per subgroup of ``layout``, whose ``cut`` pieces are their
    common ``whole`` region cut evenly along ``dim`` (the piece of member ``i`` is part
    ``i``, members in subgroup order); None unless every rank of ``cut`` is in one.

    As in ``_as_all_reduce``, the holders of each region are paired position by position
    across the subgroups."""
    parts = len(layout.groups)
    paired = _paired(layout, whole)
    if paired is None:
        return None
    groups: list[tuple[int, ...]] = []
    for region, pairs in paired.items():
        lo, hi = region[dim]
        if (hi - lo) % parts:
            return None
        size = (hi - lo) // parts
        for group in pairs:
            for i, rank in enumerate(group):
                part = (lo + i * size, lo + (i + 1) * size)
                if cut.get(rank) != (*region[:dim], part, *region[dim + 1 :]):
                    return None
            groups.append(group)
    if sum(len(g) for g in groups) != len(cut):
        return None
    return tuple(sorted(groups))


def _split_reduce_scatter(
    before: Annotation, old: dict[int, Region], new: dict[int, Region], shape: Sequence[int]
) -> SplitReduceScatter:
    keyed: dict[tuple, list[Region]] = defaultdict(list)
    representatives = _Representatives(before)
    for box, owners, needers in holders_table(old, new, shape):
        for root in needers:
            ranks, zero = representatives.summed_into(owners, root)
            keyed[(ranks, zero, root)].append(box)
    return SplitReduceScatter(
        tuple(
            SliceReduce(box, ranks, zero, root=root) for box, (ranks, zero, root) in _slices(keyed)
        )
    )


def _split_all_gather(
    old: dict[int, Region], new: dict[int, Region], shape: Sequence[int]
) -> SplitAllGather:
    rows = holders_table(old, new, shape)
    # keyed by the needers tuple's identity (``holders_table`` shares one per set: hashing
    # a tuple of 16,384 ranks per row was most of the time at scale)
    keyed: dict[int, list[Region]] = defaultdict(list)
    needers_of: dict[int, tuple[int, ...]] = {}
    owner_of: dict[Region, int] = {}
    for box, owners, needers in rows:
        if len(owners) > 1:
            inside = set(needers).intersection(owners)
            owner_of[box] = min(inside or owners)
        else:
            owner_of[box] = owners[0]
        keyed[id(needers)].append(box)
        needers_of[id(needers)] = needers
    slices = []
    merged = sorted((box, key) for key, boxes in keyed.items() for box in merge_boxes(boxes))
    for box, key in merged:  # the boxes of different needers are disjoint: sorted by box
        by_owner: dict[int, list[Region]] = defaultdict(list)
        for row_box in keyed[key]:
            if contains(box, row_box):
                by_owner[owner_of[row_box]].append(row_box)
        needers = needers_of[key]
        sources = tuple(
            (owner, part) for owner in sorted(by_owner) for part in merge_boxes(by_owner[owner])
        )
        slices.append(SliceReduce(box, needers, owners=sources))
    return SplitAllGather(tuple(slices))
