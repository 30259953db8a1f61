"""Resolution of a reshard: ``resolve(src, dst, shape) -> CommPlan`` (paper Figure 7).

Which branch a pair takes, first match wins::

    src == dst                                   identity (no steps)
    same hsize, hdim and part sizes              bottom tier, per subgroup (bottom.py)
    same hsize and DG union, hdim differs        bottom steps to the dst DS (Figure 10),
                                                 then one top-tier step (top.py): a plain
                                                 collective where the subgroups' pieces
                                                 line up, else a split collective
    anything else                                reduce partials (all-reduce, then
                                                 split-all-reduce for hP), BSR over the
                                                 finest slices, zero non-first summands

Collectives are preferred wherever they apply; BSR is the fallback. Examples::

    >>> from hspmd.annotation import parse_annotation as A
    >>> resolve(A("[0,1,2,3]{0:4}"), A("[0,1,2,3]{D:4}"), (8, 4)).kinds
    ('all-gather',)
    >>> resolve(A("h0: [0,1]{1:2} [2,3]{1:2}"), A("hD: [0,1]{1:2} [2,3]{1:2}"), (8, 12)).kinds
    ('all-gather',)
    >>> resolve(A("h0(2,6): [0,1]{1:2} [2,3]{1:2}"), A("hD: [0,1]{1:2} [2,3]{1:2}"), (8, 12)).kinds
    ('split-all-gather',)
    >>> resolve(A("[0,1,2,3]{P:2,0:2}"), A("h0: [0,1]{D:2} [2,3]{1:2}"), (8, 12)).kinds
    ('all-reduce', 'bsr')

Plans are cached on their (frozen) inputs; ``topology`` steers BSR's choice of senders.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence

from hspmd.annotation import DUP, PARTIAL, Annotation
from hspmd.comm.axes import Axes, axes_of, layout
from hspmd.comm.bottom import merge_moves, subgroup_moves
from hspmd.comm.bsr import BsrTable, bsr_step, schedule
from hspmd.comm.plan import AllReduce, CommPlan, Local, Step
from hspmd.comm.slices import part_regions
from hspmd.comm.top import top_step
from hspmd.comm.topology import Topology
from hspmd.errors import AnnotationError

Steps = tuple[list[Step], list[Annotation]]


def resolve(
    src: Annotation, dst: Annotation, shape: Sequence[int], *, topology: Topology | None = None
) -> CommPlan:
    """The per-rank communication plan taking a tensor of ``shape`` from ``src`` to ``dst``.

    Raises AnnotationError if either annotation does not fit ``shape``.
    """
    return _resolve(src, dst, tuple(int(n) for n in shape), topology)


@functools.cache
def _resolve(
    src: Annotation, dst: Annotation, shape: tuple[int, ...], topology: Topology | None
) -> CommPlan:
    src_parts, dst_parts = part_regions(src, shape), part_regions(dst, shape)
    if src == dst:
        return CommPlan(src, dst, shape, ())
    if _same_pieces(src, dst, shape):
        return CommPlan(src, dst, shape, (Local(tuple(sorted(dst.ranks))),), (src, dst))
    found: Steps | None = None
    if src.hsize == dst.hsize and src.hdim == dst.hdim and src_parts == dst_parts:
        found = _bottom(src, dst, shape, topology)
    elif src.hsize == dst.hsize and src.groups == dst.groups:
        found = _top(src, dst, shape, topology)
    steps, layouts = found or _general(src, dst, shape, topology)
    if not steps:  # equivalent layouts written differently
        steps, layouts = [Local(tuple(sorted(dst.ranks)))], [dst]
    _check_final(layouts[-1], dst, shape)
    return CommPlan(src, dst, shape, tuple(steps), (src, *layouts[:-1], dst))


def _same_pieces(a: Annotation, b: Annotation, shape: tuple[int, ...]) -> bool:
    if PARTIAL in (a.hdim, b.hdim):  # every piece a summand (hsize > 1): not the same
        return False
    pa, pb = a.pieces(shape), b.pieces(shape)
    no_partial = all(not p.partial for p in pa.values()) and all(not p.partial for p in pb.values())
    return no_partial and pa == pb


def _check_final(last: Annotation, dst: Annotation, shape: tuple[int, ...]) -> None:
    got = {r: p.region for r, p in last.pieces(shape).items()}
    want = {r: p.region for r, p in dst.pieces(shape).items()}
    assert got == want, f"resolution ended on {last}, not {dst}"


def _bottom(
    src: Annotation, dst: Annotation, shape: tuple[int, ...], topology: Topology | None
) -> Steps:
    return _subgroup_steps(src, axes_of(dst), shape, topology)


def _subgroup_steps(
    src: Annotation, targets: Sequence[Axes], shape: tuple[int, ...], topology: Topology | None
) -> Steps:
    """Each subgroup of ``src`` moved to its ``targets`` axes, src's top tier kept."""
    parts = part_regions(src, shape)
    moves = [
        subgroup_moves(a, b, part=p, shape=shape)
        for a, b, p in zip(axes_of(src), targets, parts, strict=True)
    ]
    return merge_moves(
        moves,
        axes_of(src),
        make_layout=lambda state: layout(state, hdim=src.hdim, hsizes=src.hsizes),
        parts=parts,
        shape=shape,
        topology=topology,
    )


def _top(
    src: Annotation, dst: Annotation, shape: tuple[int, ...], topology: Topology | None
) -> Steps | None:
    aligned = None if _already_aligned(src, dst) else [a.without_partial() for a in axes_of(dst)]
    try:
        first, second = (src, dst) if aligned is None else _aligned_layouts(src, dst, aligned)
        first.check_shape(shape)
        second.check_shape(shape)
    except AnnotationError:
        return None
    top = top_step(first, second, shape)
    if top is None:
        return None
    steps, layouts = ([], []) if aligned is None else _subgroup_steps(src, aligned, shape, topology)
    steps.append(top)
    layouts.append(second)
    _zero_partials(steps, layouts, dst, start=src)
    return steps, layouts


def _already_aligned(src: Annotation, dst: Annotation) -> bool:
    """Whether src's subgroups are dst's with ``P`` read as ``D`` already: then no bottom
    step comes first and the layouts around the top step are src and dst themselves (no
    new annotation of thousands of subgroups, whose pieces would be worked out again). A DS
    lists each dim once, so without ``P`` a subgroup is what ``layout`` would make of it."""
    return (
        not any(d == PARTIAL for states in dst.states for d, _ in states.entries)
        and src.states == dst.states
        and (src.hdim >= 0 or src.hsizes is None)
    )


def _aligned_layouts(
    src: Annotation, dst: Annotation, aligned: Sequence[Axes]
) -> tuple[Annotation, Annotation]:
    """``dst``'s subgroups with ``P`` read as ``D`` (``aligned``), under src's top tier and
    under dst's (dst itself where it has no ``P``: ``_already_aligned``)."""
    if any(d == PARTIAL for states in dst.states for d, _ in states.entries):
        return (
            layout(aligned, hdim=src.hdim, hsizes=src.hsizes),
            layout(aligned, hdim=dst.hdim, hsizes=dst.hsizes),
        )
    return layout(aligned, hdim=src.hdim, hsizes=src.hsizes), dst


def _general(
    src: Annotation, dst: Annotation, shape: tuple[int, ...], topology: Topology | None
) -> Steps:
    steps: list[Step] = []
    layouts: list[Annotation] = []
    axes: list[Axes] = []
    groups: list[tuple[int, ...]] = []
    for sub in axes_of(src):
        for axis, (dim, _) in enumerate(sub.entries):
            if dim == PARTIAL:
                groups.extend(sub.groups(axis))
                sub = sub.replace(axis, DUP)
        axes.append(sub)
    current = src
    if groups:
        current = layout(axes, hdim=src.hdim, hsizes=src.hsizes)
        steps.append(AllReduce(tuple(groups)))
        layouts.append(current)
    if current.hdim == PARTIAL:
        reduced = layout(axes, hdim=DUP, hsizes=None)
        step = top_step(current, reduced, shape)
        assert step is not None
        steps.append(step)
        layouts.append(reduced)
        current = reduced
    target = _without_partial(dst)
    if not _same_pieces(current, target, shape) or set(current.ranks) != set(target.ranks):
        table = BsrTable.between(current, target, shape)
        steps.append(
            bsr_step(
                schedule([table], topology=topology), before=current, after=target, shape=shape
            )
        )
        layouts.append(target)
    _zero_partials(steps, layouts, dst, start=src)
    return steps, layouts


def _without_partial(annotation: Annotation) -> Annotation:
    hdim = DUP if annotation.hdim == PARTIAL else annotation.hdim
    axes = [a.without_partial() for a in axes_of(annotation)]
    return layout(axes, hdim=hdim, hsizes=annotation.hsizes)


def _zero_partials(
    steps: list[Step], layouts: list[Annotation], dst: Annotation, *, start: Annotation
) -> None:
    """End on ``dst``: a local step zeroes the non-first summands of its partial axes (merged
    into a preceding local step)."""
    zero = {r for a in axes_of(dst) for r in a.partial_zeros()}
    if dst.hdim == PARTIAL and (layouts[-1] if layouts else start).hdim != PARTIAL:
        zero.update(r for g in dst.groups[1:] for r in g.ranks)
    if not zero:
        if layouts:
            layouts[-1] = dst
        return
    if steps and isinstance(steps[-1], Local):
        zero.update(steps[-1].zero)
        steps.pop()
        layouts.pop()
    keep = tuple(r for r in sorted(dst.ranks) if r not in zero)
    steps.append(Local(keep, tuple(sorted(zero))))
    layouts.append(dst)
