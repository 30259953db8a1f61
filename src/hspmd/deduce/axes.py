"""Device axes: line up the DS of several tensors on one device group, axis by axis.

A DS entry of degree ``n`` can be read as several consecutive entries of the same dim whose
degrees multiply to ``n`` (the mixed-radix numbering is the same), so ``{D:4}`` and
``{0:2,D:2}`` line up on the axes ``(2, 2)``::

    >>> from hspmd.annotation import parse_ds
    >>> common_degrees((parse_ds("{D:4}"), parse_ds("{0:2,D:2}")))
    (2, 2)
    >>> axis_placements(parse_ds("{D:4}"), (2, 2)), axis_placements(parse_ds("{0:2,D:2}"), (2, 2))
    ((-1, -1), (0, -1))
    >>> str(merge_axes((1, -1), (2, 2)))
    '{1:2,D:2}'

``{0:2,1:3}`` and ``{1:3,0:2}`` have no common axes (device numberings that do not nest).
"""

from __future__ import annotations

import functools

from hspmd.annotation import DUP, PARTIAL, Annotation, DistributedStates
from hspmd.errors import AnnotationError

__all__ = ["axis_placements", "common_degrees", "merge_axes", "without_partial"]


class AxesError(ValueError):
    """DS that cannot be lined up or merged; callers add context."""


def _strides(ds: DistributedStates) -> set[int]:
    """Products of the trailing degrees: the device-position strides of each entry."""
    out, acc = set(), 1
    for _, degree in reversed(ds.entries):
        acc *= degree
        out.add(acc)
    return out


@functools.cache
def common_degrees(states: tuple[DistributedStates, ...]) -> tuple[int, ...]:
    """The coarsest axes (degrees, first = slowest) that every DS in ``states`` refines to."""
    cuts = sorted(set().union(*(_strides(ds) for ds in states)) - {1})
    for small, big in zip(cuts, cuts[1:], strict=False):
        if big % small:
            raise AxesError(
                f"DS {', '.join(map(str, states))} number the devices in ways that do not nest"
            )
    trailing = [1, *cuts]
    return tuple(reversed([b // a for a, b in zip(trailing, trailing[1:], strict=False)]))


@functools.cache
def axis_placements(ds: DistributedStates, degrees: tuple[int, ...]) -> tuple[int, ...]:
    """The placement of ``ds`` on each axis of ``degrees`` (which must refine it)."""
    out: list[int] = []
    entries = list(ds.entries)
    remaining = 1
    dim = DUP
    for degree in degrees:
        if remaining == 1:
            dim, remaining = entries.pop(0) if entries else (DUP, degree)
        assert remaining % degree == 0, (ds, degrees)
        remaining //= degree
        out.append(dim)
    return tuple(out)


@functools.cache
def merge_axes(placements: tuple[int, ...], degrees: tuple[int, ...]) -> DistributedStates:
    """Per-axis placements back to a DS, joining neighbours with the same placement."""
    entries: list[tuple[int, int]] = []
    for placement, degree in zip(placements, degrees, strict=True):
        if entries and entries[-1][0] == placement:
            entries[-1] = (placement, entries[-1][1] * degree)
        else:
            entries.append((placement, degree))
    try:
        return DistributedStates(tuple(entries))
    except AnnotationError as error:
        raise AxesError(
            f"axes {placements} of degrees {degrees} give {entries}, not a DS: {error}"
        ) from None


def _no_partial(ds: DistributedStates) -> DistributedStates:
    degrees = tuple(n for _, n in ds.entries)
    placements = tuple(DUP if d == PARTIAL else d for d, _ in ds.entries)
    return merge_axes(placements, degrees)


@functools.cache
def without_partial(annotation: Annotation) -> Annotation:
    """Every P (both tiers) replaced by D: the layout of a gradient of a partial tensor."""
    hdim = DUP if annotation.hdim == PARTIAL else annotation.hdim
    return Annotation(
        annotation.groups,
        tuple(_no_partial(ds) for ds in annotation.states),
        hdim=hdim,
        hsizes=annotation.hsizes,
    )


def all_duplicate(annotation: Annotation) -> Annotation:
    """Same device groups, every rank holding the whole tensor."""
    return Annotation(
        annotation.groups, tuple(DistributedStates(((DUP, len(g)),)) for g in annotation.groups)
    )
