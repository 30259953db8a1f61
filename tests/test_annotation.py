"""Annotations: text round trips, JSON, pieces, and every validation error."""

from __future__ import annotations

from pathlib import Path

import pytest

from hspmd.annotation import (
    DUP,
    PARTIAL,
    Annotation,
    DeviceGroup,
    DistributedStates,
    parse_annotation,
    parse_ds,
)
from hspmd.errors import AnnotationError, HspmdError

TEXTS = [
    "[0]{}",
    "[0,1,2,3]{0:2,D:2}",
    "[3,1]{P:2}",
    "[0,1,2,3,4,5,6,7]{P:2,1:2,D:2}",
    "h0: [0,1,2,3]{0:2,D:2} [4,5]{D:2}",
    "h1(6,2): [0,1]{D:2} [2]{}",
    "hD: [0,1]{1:2} [2,3,4,5]{1:4}",
    "hP: [0]{} [1]{}",
]


@pytest.mark.parametrize("text", TEXTS)
def test_text_and_json_round_trip(text: str) -> None:
    annotation = parse_annotation(text)
    assert str(annotation) == text
    assert Annotation.from_json(annotation.to_json()) == annotation
    assert Annotation.from_json(text) == annotation


def test_ds_text() -> None:
    assert str(parse_ds("{0:2,D:2}")) == "{0:2,D:2}"
    assert parse_ds("{ 0 : 2 , d:1 }") == DistributedStates.of((0, 2))
    assert parse_ds("{-1:2,-2:2}") == DistributedStates.of((DUP, 2), (PARTIAL, 2))
    assert str(DistributedStates(())) == "{}"


def test_lenient_spellings() -> None:
    assert parse_annotation("hd: [0]{} [1]{}") == parse_annotation("hD: [0]{} [1]{}")
    assert parse_annotation(" h0 (2,6) : [0]{}  [1]{} ").hsizes == (2, 6)
    assert parse_annotation("h0: [0,1]{0:2}").hdim == DUP  # one subgroup: hdim is moot


def test_device_order_last_entry_fastest() -> None:
    pieces = parse_annotation("[0,1,2,3]{0:2,D:2}").pieces((4, 2))
    assert [pieces[r].region[0] for r in range(4)] == [(0, 2), (0, 2), (2, 4), (2, 4)]
    ds = DistributedStates.of((0, 2), (1, 3))
    assert ds.indices(4) == (1, 1) and ds.position((1, 1)) == 4


def test_pieces_two_tiers() -> None:
    pieces = parse_annotation("h0(6,2): [0,1]{1:2} [2]{}").pieces((8, 4))
    assert pieces[1].region == ((0, 6), (2, 4))
    assert pieces[2].region == ((6, 8), (0, 4))
    partial = parse_annotation("hP: [0,1]{P:2} [2]{}").pieces((4,))
    assert partial[1].partial == (0, 1) and partial[2].partial == (1,)


ERRORS = [
    ("[]{}", "empty device group"),
    ("[0,0]{D:2}", "rank listed twice"),
    ("[0,1]{0:4}", "degrees must multiply"),
    ("[0,1,2,3]{0:2,0:2}", "lists 0 twice"),
    ("[0,1]{D:2,D:1}", "lists D twice"),
    ("[0,1]{X:2}", "bad DS key"),
    ("[0,1]{0}", "bad DS entry"),
    ("[0,1]{0:x}", "bad DS entry"),
    ("[0,a]{D:2}", "bad ranks"),
    ("[0,1]", "cannot read"),
    ("[0]{} [1]{}", "no top tier"),
    ("h0: [0,1]{D:2} [1]{}", "subgroups must be disjoint"),
    ("hD(1,1): [0]{} [1]{}", "sizes only apply to a split hdim"),
    ("h0(1,2,3): [0]{} [1]{}", "must be 2 positive numbers"),
    ("h0(1,x): [0]{} [1]{}", "bad part sizes"),
    ("h0(0,4): [0]{} [1]{}", "must be 2 positive numbers"),
]


@pytest.mark.parametrize(("text", "message"), ERRORS)
def test_validation_errors(text: str, message: str) -> None:
    with pytest.raises(AnnotationError, match=message):
        parse_annotation(text)


SHAPE_ERRORS = [
    ("[0,1,2]{0:3}", (8, 4), "does not divide"),
    ("[0,1]{2:2}", (8, 4), "has 2 dims"),
    ("h0: [0]{} [1]{} [2]{}", (8, 4), "does not divide"),
    ("h2: [0]{} [1]{}", (8, 4), "out of range"),
    ("h0(3,4): [0]{} [1]{}", (8, 4), "add up to 7"),
    ("h0(6,2): [0,1,2,3]{0:4} [4]{}", (8, 4), "does not divide"),
]


@pytest.mark.parametrize(("text", "shape", "message"), SHAPE_ERRORS)
def test_shape_errors(text: str, shape: tuple[int, ...], message: str) -> None:
    annotation = parse_annotation(text)
    with pytest.raises(AnnotationError, match=message):
        annotation.check_shape(shape)


def test_constructor_errors() -> None:
    with pytest.raises(AnnotationError, match="no subgroup"):
        Annotation((), ())
    with pytest.raises(AnnotationError, match="give one DS each"):
        Annotation((DeviceGroup((0,)),), ())
    with pytest.raises(AnnotationError, match="negative rank"):
        DeviceGroup((-1,))
    with pytest.raises(AnnotationError, match="bad DS dim"):
        DistributedStates.of((-3, 2))
    with pytest.raises(AnnotationError, match="bad degree"):
        DistributedStates.of((0, 0))
    with pytest.raises(AnnotationError, match="bad hdim"):
        Annotation((DeviceGroup((0,)), DeviceGroup((1,))), (DistributedStates(()),) * 2, hdim=-5)
    with pytest.raises(AnnotationError, match="bad annotation JSON"):
        Annotation.from_json({"groups": [[0]]})
    with pytest.raises(AnnotationError, match="bad DS"):
        parse_ds("0:2")


def test_errors_are_typed() -> None:
    assert issubclass(AnnotationError, HspmdError) and issubclass(AnnotationError, ValueError)


def test_values_are_frozen_and_hashable() -> None:
    annotation = parse_annotation("h0: [0,1]{0:2} [2]{}")
    assert hash(annotation) == hash(parse_annotation(str(annotation)))
    with pytest.raises(AttributeError):
        annotation.hdim = 1  # type: ignore[misc]
    assert 2 in annotation and 5 not in annotation
    assert annotation.subgroup_of(2) == (1, 0)


def test_notation_doc_counts_summands_as_the_code_does() -> None:
    # Issue 17: docs/notation.md said 4 summands for this annotation; it has 3.
    text = (Path(__file__).parents[1] / "docs" / "notation.md").read_text()
    line = next(x for x in text.splitlines() if x.startswith("hP: [0,1]{P:2} [2,3]{D:2}"))
    summands = {p.partial for p in parse_annotation(line[:25]).pieces((8, 12)).values()}
    assert summands == {(0, 0), (0, 1), (1,)}
    assert f"{len(summands)} summands in all" in line
