"""Hypothesis strategies: valid random annotations over at most 8 ranks for a given shape."""

from __future__ import annotations

from collections.abc import Sequence

from hypothesis import assume
from hypothesis import strategies as st

from hspmd.annotation import DUP, PARTIAL, Annotation, DeviceGroup, DistributedStates
from hspmd.errors import AnnotationError

FACTORIZATIONS = {1: [()], 2: [(2,)], 4: [(4,), (2, 2)], 8: [(8,), (2, 4), (4, 2), (2, 2, 2)]}


@st.composite
def distributed_states(draw: st.DrawFn, size: int, ndim: int) -> DistributedStates:
    degrees = draw(st.sampled_from(FACTORIZATIONS[size]))
    dims = draw(
        st.lists(
            st.sampled_from([DUP, PARTIAL, *range(ndim)]),
            min_size=len(degrees),
            max_size=len(degrees),
            unique=True,
        )
    )
    return DistributedStates(tuple(zip(dims, degrees, strict=True)))


@st.composite
def _hsizes(draw: st.DrawFn, length: int, count: int) -> tuple[int, ...] | None:
    if draw(st.booleans()):
        return None
    cuts = draw(st.lists(st.integers(1, length - 1), min_size=count - 1, max_size=count - 1))
    points = [0, *sorted(set(cuts)), length]
    assume(len(points) == count + 1)
    return tuple(b - a for a, b in zip(points, points[1:], strict=False))


@st.composite
def annotations(draw: st.DrawFn, shape: Sequence[int], max_ranks: int = 8) -> Annotation:
    """A valid annotation of ``shape`` over ranks ``0..max_ranks-1``."""
    order = draw(st.permutations(range(max_ranks)))
    hsize = draw(st.integers(1, 3))
    sizes = draw(
        st.lists(st.sampled_from([1, 2, 4]), min_size=hsize, max_size=hsize).filter(
            lambda s: sum(s) <= max_ranks
        )
    )
    groups, start = [], 0
    for size in sizes:
        groups.append(DeviceGroup(tuple(order[start : start + size])))
        start += size
    states = [draw(distributed_states(len(g), len(shape))) for g in groups]
    hdim = draw(st.sampled_from([DUP, PARTIAL, *range(len(shape))]))
    hsizes = draw(_hsizes(shape[hdim], hsize)) if hdim >= 0 and hsize > 1 else None
    try:
        annotation = Annotation(tuple(groups), tuple(states), hdim=hdim, hsizes=hsizes)
        annotation.check_shape(shape)
    except AnnotationError:
        assume(False)
    return annotation
