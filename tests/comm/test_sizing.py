"""Sizing resolved plans to shorter sequences (``hspmd.comm.sizing``): random pairs resolved
once at the maximum length, sized to every multiple of their length multiple, equal the
plan resolved at that length and right in the simulator."""

from __future__ import annotations

import pytest
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st

from hspmd.annotation import parse_annotation as A
from hspmd.comm.resolve import resolve
from hspmd.comm.sizing import SizingError, global_shape, length_multiple, sized

from .helpers import check_plan
from .strategies import annotations

SHAPE = (4, 24, 6)  # (B, L_max, H): dim 1 is the symbolic length


@settings(max_examples=120, deadline=None, suppress_health_check=[HealthCheck.filter_too_much])
@given(st.data())
def test_random_pairs_sized_to_every_length(data: st.DataObject) -> None:
    src = data.draw(annotations(SHAPE), label="src")
    dst = data.draw(annotations(SHAPE), label="dst")
    assume(not (src.hdim == 1 and src.hsizes) and not (dst.hdim == 1 and dst.hsizes))
    plan = resolve(src, dst, SHAPE)
    multiple = length_multiple(plan, 1)
    assert SHAPE[1] % multiple == 0
    for length in range(multiple, SHAPE[1], multiple):
        shape = (SHAPE[0], length, SHAPE[2])
        small = sized(plan, shape)
        check_plan(small)
        assert small.kinds == plan.kinds
        assert small == resolve(src, dst, shape)


def test_length_multiple_and_refusal() -> None:
    plan = resolve(A("[0,1,2,3]{1:4}"), A("[0,1,2,3]{D:4}"), (2, 16, 4))  # SP all-gather
    assert length_multiple(plan, 1) == 4
    assert sized(plan, (2, 8, 4)).shape == (2, 8, 4)
    with pytest.raises(SizingError, match=r"multiples of \{1: 4\}"):
        sized(plan, (2, 6, 4))


def test_bsr_regions_scale() -> None:
    plan = resolve(A("[0,1]{1:2}"), A("[2,3]{D:2}"), (1, 8, 4))
    small = sized(plan, (1, 4, 4))
    assert small == resolve(A("[0,1]{1:2}"), A("[2,3]{D:2}"), (1, 4, 4))
    regions = {t.region for step in small.steps for t in getattr(step, "transfers", ())}
    assert ((0, 1), (0, 2), (0, 4)) in regions


def test_global_shape_from_a_local_piece() -> None:
    plan = resolve(A("[0,1]{1:2}"), A("[0,1]{D:2}"), (2, 16, 4))
    assert global_shape(plan, 1, (2, 8, 4)) == (2, 16, 4)
    assert global_shape(plan, 1, (2, 3, 4)) == (2, 6, 4)
