"""Resolution: exact step kinds per category of Figure 7, and exhaustive small pairs."""

from __future__ import annotations

import itertools

import numpy as np
import pytest

from hspmd.annotation import parse_annotation as A
from hspmd.comm.plan import (
    AllGather,
    AllReduce,
    AllToAll,
    BatchedSendRecv,
    CommPlan,
    Local,
    ReduceScatter,
    SendRecv,
    SplitAllGather,
    SplitAllReduce,
    SplitReduceScatter,
)
from hspmd.comm.resolve import resolve
from hspmd.comm.simulate import scatter, simulate
from hspmd.comm.top import _split_all_reduce
from hspmd.errors import AnnotationError

from .helpers import check

SHAPE = (8, 12)

KINDS = [
    # identity and DG changes
    ("[0,1,2,3]{0:2,D:2}", "[0,1,2,3]{0:2,D:2}", ("identity",)),
    ("[0,1]{0:2}", "[2,3]{0:2}", ("send-recv",)),
    ("[0,1]{P:2}", "[3,2]{P:2}", ("send-recv",)),
    ("h0: [0,1]{1:2} [2,3]{D:2}", "h0: [4,5]{1:2} [6,7]{D:2}", ("send-recv",)),
    # bottom-tier collectives, one per axis
    ("[0,1,2,3]{P:4}", "[0,1,2,3]{D:4}", ("all-reduce",)),
    ("[0,1,2,3]{P:4}", "[0,1,2,3]{0:4}", ("reduce-scatter",)),
    ("[0,1,2,3]{0:4}", "[0,1,2,3]{D:4}", ("all-gather",)),
    ("[0,1,2,3]{0:4}", "[0,1,2,3]{1:4}", ("all-to-all",)),
    ("[0,1,2,3]{D:4}", "[0,1,2,3]{1:4}", ("local",)),
    ("[0,1,2,3]{D:4}", "[0,1,2,3]{P:4}", ("local",)),
    ("[0,1,2,3]{0:4}", "[0,1,2,3]{P:4}", ("local",)),
    ("[0,1,2,3]{P:2,0:2}", "[0,1,2,3]{D:2,0:2}", ("all-reduce",)),
    ("[0,1,2,3]{P:2,0:2}", "[0,1,2,3]{1:2,0:2}", ("reduce-scatter",)),
    ("[0,1,2,3]{0:2,1:2}", "[0,1,2,3]{1:2,D:2}", ("all-gather", "all-to-all")),
    ("[0,1,2,3]{P:2,1:2}", "[0,1,2,3]{D:2,0:2}", ("all-reduce", "all-to-all")),
    ("[0,1,2,3]{D:2,P:2}", "[0,1,2,3]{P:2,D:2}", ("all-reduce", "local")),
    # subgroups take one step together
    ("h0: [0,1]{P:2} [2,3]{P:2}", "h0: [0,1]{D:2} [2,3]{D:2}", ("all-reduce",)),
    ("hD: [0,1]{0:2} [2,3,4,5]{1:4}", "hD: [0,1]{D:2} [2,3,4,5]{D:4}", ("all-gather",) * 2),
    ("h0: [0,1]{0:2} [2,3]{0:2}", "h0: [0,1]{D:2} [3,2]{0:2}", ("all-gather", "send-recv")),
    # degrees that refine to a common list: collectives on the finer axes
    ("[0,1,2,3]{0:4}", "[0,1,2,3]{0:2,D:2}", ("all-gather",)),  # gather the inner half
    ("[0,1,2,3]{D:4}", "[0,1,2,3]{D:2,1:2}", ("local",)),
    ("[0,1,2,3]{1:2,0:2}", "[0,1,2,3]{1:4}", ("all-to-all",)),  # context parallel q/k/v
    ("[0,1,2,3]{1:4}", "[0,1,2,3]{1:2,0:2}", ("all-to-all",)),  # and back
    ("[0,1,2,3]{D:2,0:2}", "[0,1,2,3]{D:4}", ("all-gather",)),
    ("[0,1,2,3]{0:2,P:2}", "[0,1,2,3]{0:4}", ("reduce-scatter",)),
    # BSR where no collective applies
    ("[0,1,2,3]{0:4}", "[0,1,2,3]{D:2,0:2}", ("bsr",)),  # the outer half: not contiguous
    ("[0,1]{0:2}", "[0,1,2,3]{1:4}", ("bsr",)),
    ("[0,1,2,3]{P:2,0:2}", "[4,5]{1:2}", ("all-reduce", "bsr")),
    ("[0,1,2,3]{0:4}", "[4,5,6,7]{P:2,D:2}", ("bsr", "local")),
    ("[0,1,2,3]{0:2,1:2}", "[0,1,2,3]{1:2,0:2}", ("bsr",)),
    # top tier: only hdim changes
    ("h0: [0,1]{1:2} [2,3]{1:2}", "hD: [0,1]{1:2} [2,3]{1:2}", ("all-gather",)),
    ("h0(2,6): [0,1]{1:2} [2,3]{1:2}", "hD: [0,1]{1:2} [2,3]{1:2}", ("split-all-gather",)),
    ("hP: [0,1]{1:2} [2,3,4,5]{1:4}", "hD: [0,1]{1:2} [2,3,4,5]{1:4}", ("split-all-reduce",)),
    ("hP: [0,1]{1:2} [2,3]{1:2}", "hD: [0,1]{1:2} [2,3]{1:2}", ("all-reduce",)),
    ("hP: [0,1]{0:2} [2,3]{1:2}", "h0: [0,1]{0:2} [2,3]{1:2}", ("split-reduce-scatter",)),
    ("hD: [0,1]{0:2} [2,3]{1:2}", "hP: [0,1]{0:2} [2,3]{1:2}", ("local",)),
    ("hD: [0,1]{1:2} [2,3]{D:2}", "h0: [0,1]{1:2} [2,3]{D:2}", ("local",)),
    ("h0: [0,1]{1:2} [2,3]{D:2}", "hP: [0,1]{1:2} [2,3]{D:2}", ("local",)),
    ("h0: [0,1]{0:2} [2,3]{0:2}", "h1: [0,1]{0:2} [2,3]{0:2}", ("bsr",)),
    ("h0(6,2): [0,1]{1:2} [2]{}", "hD: [0,1]{1:2} [2]{}", ("split-all-gather",)),
    # Figure 10: align the DS union first, then the split collective
    (
        "h0: [0,1]{P:2} [2,3]{1:2}",
        "hD: [0,1]{1:2} [2,3]{1:2}",
        ("reduce-scatter", "all-gather"),
    ),
    (
        "hP: [0,1]{0:2} [2,3]{D:2}",
        "hD: [0,1]{1:2} [2,3]{1:2}",
        ("all-to-all", "local", "all-reduce"),  # aligned subgroups: a plain all-reduce
    ),
    # hsize changes and everything else: BSR after reducing partials
    ("[0,1,2,3]{P:2,0:2}", "h0: [0,1]{D:2} [2,3]{1:2}", ("all-reduce", "bsr")),
    ("hP: [0,1]{0:2} [2,3]{1:2}", "[4,5]{1:2}", ("split-all-reduce", "bsr")),
    ("hP: [0,1]{P:2} [2,3]{1:2}", "[4,5]{P:2}", ("all-reduce", "split-all-reduce", "bsr", "local")),
    ("h0: [0]{} [1]{}", "h0(2,6): [0]{} [1]{}", ("bsr",)),
    ("[0,1]{D:2}", "hD: [0]{} [1]{}", ("local",)),
]


@pytest.mark.parametrize(("src", "dst", "kinds"), KINDS, ids=[f"{a} -> {b}" for a, b, _ in KINDS])
def test_step_kinds(src: str, dst: str, kinds: tuple[str, ...]) -> None:
    plan = check(src, dst, SHAPE)
    assert plan.kinds == kinds, str(plan)


def test_all_gather_is_one_collective_over_the_group() -> None:
    plan = resolve(A("[0,1,2,3]{0:4}"), A("[0,1,2,3]{D:4}"), SHAPE)
    assert plan.steps == (AllGather(((0, 1, 2, 3),), dim=0),)


def test_axis_groups_follow_the_device_order() -> None:
    plan = resolve(A("[0,1,2,3]{P:2,0:2}"), A("[0,1,2,3]{D:2,0:2}"), SHAPE)
    assert plan.steps == (AllReduce(((0, 2), (1, 3))),)
    plan = resolve(A("[0,1,2,3]{P:2,0:2}"), A("[0,1,2,3]{1:2,0:2}"), SHAPE)
    assert plan.steps == (ReduceScatter(((0, 2), (1, 3)), dim=1),)
    plan = resolve(A("[0,1,2,3]{0:4}"), A("[0,1,2,3]{1:4}"), SHAPE)
    assert plan.steps == (AllToAll(((0, 1, 2, 3),), split_dim=1, concat_dim=0),)


def test_partial_zeros_and_send_recv_pairs() -> None:
    plan = resolve(A("[0,1,2,3]{D:4}"), A("[0,1,2,3]{P:4}"), SHAPE)
    assert plan.steps == (Local((0,), (1, 2, 3)),)
    plan = resolve(A("[0,1]{0:2}"), A("[1,2]{0:2}"), SHAPE)
    assert plan.steps == (SendRecv(((0, 1), (1, 2))),)


def test_split_all_reduce_pairs_ranks_holding_the_same_columns() -> None:
    plan = resolve(A("hP: [0,1]{1:2} [2,3,4,5]{1:4}"), A("hD: [0,1]{1:2} [2,3,4,5]{1:4}"), (4, 8))
    (step,) = plan.steps
    assert isinstance(step, SplitAllReduce)
    assert [(s.region, s.ranks) for s in step.slices] == [
        (((0, 4), (0, 2)), (0, 2)),
        (((0, 4), (2, 4)), (0, 3)),
        (((0, 4), (4, 6)), (1, 4)),
        (((0, 4), (6, 8)), (1, 5)),
    ]


def test_split_all_reduce_counts_each_subgroup_once() -> None:
    plan = check("hP: [0,1]{D:2} [2,3]{1:2}", "hD: [0,1]{D:2} [2,3]{1:2}", SHAPE)
    (step,) = plan.steps
    assert isinstance(step, SplitAllReduce)
    assert all(len(s.ranks) - len(s.zero) == 2 for s in step.slices)


EQUAL_PIECE_SYNCS = [
    # issue 17, bug 2: a norm weight duplicated inside both stages
    ("hP: [0,1]{D:2} [2,3]{D:2}", "hD: [0,1]{D:2} [2,3]{D:2}", (8,), ((0, 2), (1, 3))),
    # three pipelines, each stage holding the weight twice
    (
        "hP: [0,1]{D:2} [2,3]{D:2} [4,5]{D:2}",
        "hD: [0,1]{D:2} [2,3]{D:2} [4,5]{D:2}",
        (8,),
        ((0, 2, 4), (1, 3, 5)),
    ),
    # mixed split and duplicate, in a different device order in each stage
    (
        "hP: [0,1,2,3]{0:2,D:2} [4,5,6,7]{D:2,0:2}",
        "hD: [0,1,2,3]{0:2,D:2} [4,5,6,7]{D:2,0:2}",
        (8, 4),
        ((0, 4), (1, 6), (2, 5), (3, 7)),
    ),
]


@pytest.mark.parametrize(
    ("src", "dst", "shape", "groups"), EQUAL_PIECE_SYNCS, ids=[a for a, *_ in EQUAL_PIECE_SYNCS]
)
def test_sync_of_equal_pieces_is_all_reduces_over_disjoint_groups(
    src: str, dst: str, shape: tuple[int, ...], groups: tuple[tuple[int, ...], ...]
) -> None:
    """Ranks holding the same piece of each summand pair up: one all-reduce per group,
    no split-all-reduce over every rank with zeroed copies."""
    plan = check(src, dst, shape)
    assert plan.steps == (AllReduce(groups),), str(plan)


@pytest.mark.parametrize(("src", "dst", "shape", "groups"), EQUAL_PIECE_SYNCS[:2])
def test_equal_piece_all_reduces_match_the_split_all_reduce_bitwise(
    src: str, dst: str, shape: tuple[int, ...], groups: tuple[tuple[int, ...], ...]
) -> None:
    """Simulated, the all-reduces give every rank exactly what one split-all-reduce over
    one holder per subgroup gives (same summands, same order)."""
    plan = resolve(A(src), A(dst), shape)
    regions = {r: p.region for r, p in plan.src.pieces(shape).items()}
    split = CommPlan(plan.src, plan.dst, shape, (_split_all_reduce(plan.src, regions, shape),))
    rng = np.random.default_rng(0)
    locals_ = scatter(plan.src, rng.standard_normal(shape), rng=rng)
    ours, theirs = simulate(plan, locals_), simulate(split, locals_)
    for rank in plan.dst.ranks:
        assert np.array_equal(ours[rank], theirs[rank]), rank


def test_split_all_gather_owners() -> None:
    """Uneven shares (ZeRO's ``--zero-shares``): the pieces do not line up, point to point."""
    plan = resolve(A("h0(2,6): [0,1]{1:2} [2,3]{1:2}"), A("hD: [0,1]{1:2} [2,3]{1:2}"), SHAPE)
    (step,) = plan.steps
    assert isinstance(step, SplitAllGather)
    first = step.slices[0]
    assert first.region == ((0, 8), (0, 6)) and first.ranks == (0, 2)
    assert first.owners == ((0, ((0, 2), (0, 6))), (2, ((2, 8), (0, 6))))


@pytest.mark.parametrize(
    ("src", "dst", "groups"),
    [
        ("hP: [0,1]{1:2} [2,3]{1:2}", "h0: [0,1]{1:2} [2,3]{1:2}", ((0, 2), (1, 3))),
        # subgroup order, not rank order: rank 2 gets the first rows
        ("hP: [2,3]{1:2} [0,1]{1:2}", "h0: [2,3]{1:2} [0,1]{1:2}", ((2, 0), (3, 1))),
        ("hP: [0,1]{D:2} [2,3]{D:2} [4,5]{D:2}", "h1: [0,1]{D:2} [2,3]{D:2} [4,5]{D:2}",
         ((0, 2, 4), (1, 3, 5))),
    ],
)  # fmt: skip
def test_reduce_scatter_where_pieces_line_up(
    src: str, dst: str, groups: tuple[tuple[int, ...], ...]
) -> None:
    """ZeRO's reduce over identical replicas: one reduce-scatter per TP position."""
    plan = check(src, dst, (8, 12))
    (step,) = plan.steps
    assert isinstance(step, ReduceScatter) and step.groups == groups


@pytest.mark.parametrize(
    ("src", "dst", "groups"),
    [
        ("h0: [0,1]{1:2} [2,3]{1:2}", "hD: [0,1]{1:2} [2,3]{1:2}", ((0, 2), (1, 3))),
        ("h0: [2,3]{1:2} [0,1]{1:2}", "hD: [2,3]{1:2} [0,1]{1:2}", ((2, 0), (3, 1))),
        ("h1: [0,1]{D:2} [2,3]{D:2} [4,5]{D:2}", "hD: [0,1]{D:2} [2,3]{D:2} [4,5]{D:2}",
         ((0, 2, 4), (1, 3, 5))),
    ],
)  # fmt: skip
def test_all_gather_where_pieces_line_up(
    src: str, dst: str, groups: tuple[tuple[int, ...], ...]
) -> None:
    """ZeRO's gather from even shards: one all-gather per TP position."""
    plan = check(src, dst, (8, 12))
    (step,) = plan.steps
    assert isinstance(step, AllGather) and step.groups == groups


def test_split_reduce_scatter_roots() -> None:
    """Replicas of different TP: the pieces do not line up, point to point."""
    plan = resolve(A("hP: [0,1]{1:2} [2]{}"), A("h0: [0,1]{1:2} [2]{}"), SHAPE)
    (step,) = plan.steps
    assert isinstance(step, SplitReduceScatter)
    assert {(s.ranks, s.root) for s in step.slices} == {
        ((0, 2), 0),
        ((1, 2), 1),
        ((0, 2), 2),
        ((1, 2), 2),
    }


def test_bsr_prefers_local_copies() -> None:
    plan = resolve(A("[0,1]{0:2}"), A("[0,1,2,3]{0:4}"), SHAPE)
    (step,) = plan.steps
    assert isinstance(step, BatchedSendRecv)
    assert {(t.src, t.dst) for t in step.transfers} == {(0, 0), (0, 1), (1, 2), (1, 3)}


def test_layouts_are_valid_annotations() -> None:
    plan = check("[0,1,2,3,4,5,6,7]{P:2,0:2,D:2}", "[4,5,6,7]{1:4}", SHAPE)
    assert plan.layouts[0] == plan.src and plan.layouts[-1] == plan.dst
    assert str(plan.layouts[1]) == "[0,1,4,5,2,3,6,7]{0:2,D:4}"


def test_annotation_that_does_not_fit_the_shape() -> None:
    with pytest.raises(AnnotationError, match="does not divide"):
        resolve(A("[0,1,2]{0:3}"), A("[0]{}"), SHAPE)


def test_resolve_is_cached() -> None:
    a, b = A("[0,1]{0:2}"), A("[2,3]{1:2}")
    assert resolve(a, b, [8, 12]) is resolve(a, b, (8, 12))


CATALOG_2D = [
    "[0]{}",
    "[5]{}",
    "[0,1,2,3]{0:4}",
    "[0,1,2,3]{D:4}",
    "[0,1,2,3]{P:4}",
    "[0,1,2,3]{0:2,1:2}",
    "[0,1,2,3]{1:2,0:2}",
    "[0,1,2,3]{P:2,0:2}",
    "[0,1,2,3]{D:2,P:2}",
    "[4,5,6,7]{0:2,D:2}",
    "[3,2,1,0]{1:4}",
    "[0,1,2,3,4,5,6,7]{0:2,1:2,D:2}",
    "h0: [0,1]{1:2} [2,3]{1:2}",
    "hD: [0,1]{1:2} [2,3]{1:2}",
    "hP: [0,1]{1:2} [2,3]{1:2}",
    "h1: [0,1]{0:2} [2,3]{D:2}",
    "h0(6,2): [0,1]{1:2} [2]{}",
    "hP: [0,1]{1:2} [2,3,4,5]{1:4}",
    "hD: [0,1]{1:2} [2,3,4,5]{1:4}",
    "h0: [0,1]{P:2} [2,3,4,5]{1:2,D:2}",
    "hD: [4,5]{0:2} [6]{} [7]{}",
    "h1(4,8): [0,1]{D:2} [2,3,4,5]{1:4}",
]

CATALOG_3D = [
    "[0]{}",
    "[0,1,2,3]{2:4}",
    "[0,1,2,3]{0:2,2:2}",
    "[0,1,2,3]{P:2,1:2}",
    "[4,5,6,7]{D:2,0:2}",
    "h2: [0,1]{0:2} [2,3]{1:2}",
    "hP: [0,1]{2:2} [2,3,4,5]{1:2,0:2}",
    "hD: [0,1]{2:2} [2,3,4,5]{1:2,0:2}",
    "h1(2,4): [0,1]{P:2} [6,7]{2:2}",
]


@pytest.mark.parametrize("src", CATALOG_2D)
def test_every_pair_2d(src: str) -> None:
    for dst in CATALOG_2D:
        check(src, dst, SHAPE)


def test_every_pair_3d() -> None:
    for src, dst in itertools.product(CATALOG_3D, repeat=2):
        check(src, dst, (4, 6, 4))


@pytest.mark.parametrize(
    ("src", "dst"),
    [
        ("[0,1,2,3]{0:2,P:2}", "[0,1,2,3]{P:2,0:2}"),
        ("[0,1,2,3]{P:2,0:2}", "[0,1,2,3]{0:2,P:2}"),
        ("[0,1,2,3]{1:2,P:2}", "[0,1,2,3]{P:2,1:2}"),
        ("[0,1,2,3]{P:2,1:2}", "[0,1,2,3]{1:2,P:2}"),
    ],
)
def test_partial_moving_between_axes(src: str, dst: str) -> None:
    # The intermediate {P:2,P:2} is partial over four devices (found by the runtime tests).
    plan = check(src, dst, (8, 12))
    assert "bsr" not in plan.kinds


@pytest.mark.parametrize(
    ("src", "dst", "kinds"),
    [
        ("hD: [0]{} [1]{}", "[0]{}", ("local",)),  # rank 1 drops its copy, rank 0 keeps its own
        ("hD: [2,1]{D:2} [3,0]{D:2}", "[0]{}", ("local",)),
        ("hP: [0,1]{D:2} [3]{} [2]{}", "hD: [0]{} [1,2]{0:2}", ("split-all-reduce", "local")),
        ("[2,1]{D:2}", "hP: [2,1]{D:2} [0]{}", ("bsr", "local")),  # rank 2 sends, rank 1 idle
        ("hP: [3,0]{0:2} [2,1]{D:2}", "[2,0]{D:2}", ("split-all-reduce", "bsr")),
    ],
)
def test_bsr_leaves_out_what_moves_nothing(src: str, dst: str, kinds: tuple[str, ...]) -> None:
    # Issue 17: BSR steps printed `copy=1 send_to=[] recv_from=[]` for ranks (or whole steps)
    # that only copied their own piece; check() now refuses such steps (check_bsr_moves).
    plan = check(src, dst, SHAPE)
    assert plan.kinds == kinds
