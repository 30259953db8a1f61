"""The op coverage table of docs/models.md is the one the code generates."""

from __future__ import annotations

from pathlib import Path

import torch

from hspmd.deduce.coverage import coverage, coverage_markdown, pointwise_ops
from hspmd.deduce.rules import lookup

DOC = Path(__file__).parents[2] / "docs" / "models.md"


def test_the_docs_table_is_generated_from_the_code() -> None:
    text = DOC.read_text()
    begin, end = "<!-- coverage:begin -->\n", "\n<!-- coverage:end -->"
    table = text[text.index(begin) + len(begin) : text.index(end)]
    assert table == coverage_markdown(), (
        "paste `python -m hspmd.deduce.coverage` between the markers"
    )


def test_every_listed_op_has_its_rule_and_pointwise_ops_theirs() -> None:
    for row in coverage():
        packet, _, overload = row.op.removeprefix("aten.").partition(".")
        assert lookup(getattr(getattr(torch.ops.aten, packet), overload)) is not None
    assert "aten.gelu.default" in pointwise_ops() and "aten.where.self" in pointwise_ops()
    assert lookup(torch.ops.aten.cumsum.default) is None  # the fallback's
