"""Random annotation pairs (hypothesis): every resolved plan is right in the simulator."""

from __future__ import annotations

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from hspmd.annotation import parse_annotation
from hspmd.comm.resolve import resolve

from .helpers import check_plan
from .strategies import annotations

SETTINGS = settings(
    max_examples=200, deadline=None, suppress_health_check=[HealthCheck.filter_too_much]
)


@SETTINGS
@given(st.data())
def test_random_pairs_2d(data: st.DataObject) -> None:
    shape = (8, 12)
    src = data.draw(annotations(shape), label="src")
    dst = data.draw(annotations(shape), label="dst")
    plan = resolve(src, dst, shape)
    check_plan(plan)
    assert parse_annotation(str(src)) == src


@settings(max_examples=80, deadline=None, suppress_health_check=[HealthCheck.filter_too_much])
@given(st.data())
def test_random_pairs_3d(data: st.DataObject) -> None:
    shape = (4, 8, 6)
    src = data.draw(annotations(shape), label="src")
    dst = data.draw(annotations(shape), label="dst")
    check_plan(resolve(src, dst, shape))


@settings(max_examples=80, deadline=None, suppress_health_check=[HealthCheck.filter_too_much])
@given(st.data())
def test_random_pairs_same_subgroups(data: st.DataObject) -> None:
    """Pairs sharing the DG union: the bottom and top tiers, not only BSR."""
    shape = (8, 12)
    src = data.draw(annotations(shape), label="src")
    other = data.draw(annotations(shape), label="other")
    hdim = data.draw(st.sampled_from([-1, -2, 0, 1]), label="hdim")
    states = tuple(
        other.states[i] if i < other.hsize and len(other.groups[i]) == len(g) else src.states[i]
        for i, g in enumerate(src.groups)
    )
    try:
        dst = type(src)(src.groups, states, hdim=hdim)
        dst.check_shape(shape)
    except ValueError:
        return
    check_plan(resolve(src, dst, shape))


def test_duplicate_union_with_partial_subgroup_and_dg_change() -> None:
    """hD over a partial subgroup whose DG shifts by one rank: the send-recv of the partial
    subgroup joins the other subgroup's BSR (rank 1 changes subgroup), and each summand must
    go position-wise (a BSR table by regions once sent rank 2's summand twice)."""
    shape = (8, 12)
    src = parse_annotation("hD: [0,1]{D:2} [2,3,4,5]{P:4}")
    dst = parse_annotation("hD: [0]{} [1,2,3,4]{P:4}")
    check_plan(resolve(src, dst, shape))
