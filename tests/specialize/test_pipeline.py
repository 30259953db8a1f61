"""Pipeline construction from hand-written forward plans."""

from __future__ import annotations

import pytest

from hspmd.annotation import parse_annotation
from hspmd.comm.plan import (
    AllGather,
    AllReduce,
    BatchedSendRecv,
    CommPlan,
    SendRecv,
    SliceReduce,
    SplitAllReduce,
    Step,
    Transfer,
)
from hspmd.errors import StrategyError
from hspmd.specialize.pipeline import PipelineLayout, check_pipelines, construct_pipelines

SHAPE = (4, 8, 16)


def plan(src: str, dst: str, *steps: Step) -> CommPlan:
    return CommPlan(parse_annotation(src), parse_annotation(dst), SHAPE, tuple(steps))


def tp2_pp2() -> list[tuple[str, CommPlan]]:
    return [
        ("embed", plan("[0,1]{P:2}", "[0,1]{D:2}", AllReduce(((0, 1),)))),
        ("layers.1.input", plan("[0,1]{D:2}", "[2,3]{D:2}", SendRecv(((0, 2), (1, 3))))),
        ("logits", plan("[2,3]{2:2}", "[2,3]{D:2}", AllGather(((2, 3),), dim=2))),
    ]


def test_tp2_pp2() -> None:
    layout = construct_pipelines(tp2_pp2())
    assert layout.pipelines == (((0, 1), (2, 3)),)
    assert layout.locate(3) == (0, 1)
    assert str(layout) == "pipeline 0: [0,1] -> [2,3]"
    check_pipelines(layout, [[[0, 1], [2, 3]]])


def test_two_pipelines_with_bsr_between_different_tp_degrees() -> None:
    bsr = BatchedSendRecv(
        (
            Transfer(2, 4, ((0, 2), (0, 8), (0, 16))),
            Transfer(3, 4, ((2, 4), (0, 8), (0, 16))),
        )
    )
    plans = [
        *tp2_pp2(),
        ("embed", plan("[5,6]{P:2}", "[5,6]{D:2}", AllReduce(((5, 6),)))),
        ("layers.1.input", plan("[5,6]{D:2}", "[7]{}", SendRecv(((5, 7),)))),
        ("layers.2.input", plan("[2,3]{0:2}", "[4]{}", bsr)),
    ]
    layout = construct_pipelines(plans, ranks=range(9))
    assert layout.pipelines == (((0, 1), (2, 3), (4,)), ((5, 6), (7,)), ((8,),))
    assert layout.short() == "[0,1] -> [2,3] -> [4] ; [5,6] -> [7] ; [8]"


def test_transfer_inside_a_stage_merges() -> None:
    # a BSR between ranks that hold both the input and the output stays inside the stage
    bsr = BatchedSendRecv((Transfer(0, 1, ((0, 2), (0, 8), (0, 16))),))
    layout = construct_pipelines([("x", plan("[0,1]{0:2}", "[0,1]{1:2}", bsr))])
    assert layout.pipelines == (((0, 1),),)


def test_mismatch_with_strategy_is_a_clear_error() -> None:
    layout = construct_pipelines(tp2_pp2())
    with pytest.raises(StrategyError, match=r"found:    \[0,1\] -> \[2,3\]"):
        check_pipelines(layout, PipelineLayout((((0, 1),), ((2, 3),))))


def test_split_collective_in_forward_is_refused() -> None:
    step = SplitAllReduce((SliceReduce(((0, 4), (0, 8), (0, 16)), (0, 1)),))
    with pytest.raises(StrategyError, match="only gradient sync"):
        construct_pipelines([("x", plan("hP: [0]{} [1]{}", "hD: [0]{} [1]{}", step))])


def test_branching_is_refused() -> None:
    plans = [
        ("a", plan("[0]{}", "[1]{}", SendRecv(((0, 1),)))),
        ("b", plan("[0]{}", "[2]{}", SendRecv(((0, 2),)))),
    ]
    with pytest.raises(StrategyError, match="followed by several stages"):
        construct_pipelines(plans)
