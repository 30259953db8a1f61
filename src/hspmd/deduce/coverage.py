"""The op coverage of deduction over ATen ops, as a table (docs/models.md is generated
from it and a test keeps the two equal).

Every op a captured graph holds falls in one of three rows: a rule registered for the op
(``hspmd.deduce.aten``), a pointwise rule from torch's own tag, or the always-correct
fallback (inputs gathered to duplicate, the op computed whole: ``hspmd.deduce.fallback``).

>>> row = next(r for r in coverage() if r.op == "aten.linear.default")
>>> row.rule
'linear'
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from hspmd.deduce import aten as _aten  # noqa: F401  (registers the ATen rules)
from hspmd.deduce.rules import RULES

__all__ = ["CoverageRow", "coverage", "coverage_markdown", "pointwise_ops"]


@dataclass(frozen=True, slots=True)
class CoverageRow:
    """One ATen overload with a registered rule: its name and the rule's."""

    op: str
    rule: str


def coverage() -> tuple[CoverageRow, ...]:
    """Every ATen overload with a registered rule, sorted by name."""
    rows = [
        CoverageRow(f"aten.{op.__name__}", entry.fn.__name__.strip("_"))
        for op, entry in RULES.items()
        if isinstance(op, torch._ops.OpOverload) and op.namespace == "aten"
    ]
    return tuple(sorted(rows, key=lambda r: r.op))


def pointwise_ops() -> tuple[str, ...]:
    """The ATen overloads torch tags pointwise (each takes a rule by family)."""
    found = []
    for name in dir(torch.ops.aten):
        packet = getattr(torch.ops.aten, name, None)
        if not isinstance(packet, torch._ops.OpOverloadPacket):
            continue
        for overload in packet.overloads():
            op = getattr(packet, overload)
            if torch.Tag.pointwise in op.tags:
                found.append(f"aten.{op.__name__}")
    return tuple(sorted(found))


def coverage_markdown() -> str:
    """The table of docs/models.md ("Op coverage")."""
    by_rule: dict[str, list[str]] = {}
    for row in coverage():
        by_rule.setdefault(row.rule, []).append(f"`{row.op.removeprefix('aten.')}`")
    lines = ["| rule | ATen ops (`torch.ops.aten.*`) |", "| --- | --- |"]
    lines += [f"| {rule} | {', '.join(ops)} |" for rule, ops in sorted(by_rule.items())]
    lines.append(
        "| pointwise, by torch's tag | every overload tagged `torch.Tag.pointwise` (over 500 in "
        "torch 2.13): `add`/`sub` take partial sums from every operand, `mul` from one, "
        "`div` from its numerator, the rest none |"
    )
    lines.append(
        "| fallback | every other op, and any op whose rule refuses its inputs' layouts: the "
        "inputs are gathered to duplicate within their groups, the op runs whole |"
    )
    return "\n".join(lines)


if __name__ == "__main__":  # python -m hspmd.deduce.coverage: the table for docs/models.md
    print(coverage_markdown())
