"""The rule registry: one dict from fx target to a per-axis rule.

A *placement* is what one device axis does to a tensor: ``d >= 0`` split dim ``d``,
``DUP`` (-1) duplicate, ``PARTIAL`` (-2) partial. Every entry of a subgroup's DS is one axis;
the top tier (``hdim``) is one more. A rule maps the placements of an op's tensor inputs
on one axis to the output's placement on that axis, so it is written once and applied to
every axis of every subgroup and to the top tier::

    >>> from hspmd.deduce import pointwise  # registers the pointwise family
    >>> rule = lookup("Tensor.silu")
    >>> call = OpCall("Tensor.silu", (TensorArg(0, (4, 8)),), {}, (TensorArg(0, (4, 8)),), (4, 8))
    >>> rule.fn(call, (1,))
    1

Rules are pure functions ``(call, placements) -> placement``; they raise ``RuleError`` with
a reason and a fix, which deduction turns into a ``DeductionError`` naming the node.
Targets are fx targets: functions (``torch.nn.functional.silu``, ``operator.add``) and
method names (``"silu"``, spelled ``Tensor.silu`` in messages).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch.fx

from hspmd.annotation import DUP, PARTIAL
from hspmd.errors import HspmdError

__all__ = [
    "DUP",
    "FAMILIES",
    "PARTIAL",
    "RULES",
    "DeductionError",
    "NoRuleError",
    "OpCall",
    "Rule",
    "RuleEntry",
    "RuleError",
    "TensorArg",
    "lookup",
    "placement_text",
    "register",
    "target_text",
]


class DeductionError(HspmdError, ValueError):
    """An op whose input annotations admit no output annotation (or no gradient one)."""


class NoRuleError(DeductionError):
    """An op that has no deduction rule."""


class RuleError(Exception):
    """Raised by a rule on one axis; deduction adds the node and the annotations."""

    def __init__(self, reason: str, fix: str) -> None:
        super().__init__(reason)
        self.reason, self.fix = reason, fix


@dataclass(frozen=True, slots=True)
class TensorArg:
    """A tensor argument of an op: ``index`` into the per-axis placements, global shape."""

    index: int
    shape: tuple[int, ...]

    @property
    def ndim(self) -> int:
        return len(self.shape)


@dataclass(frozen=True, slots=True)
class OpCall:
    """One op application: args with tensors as ``TensorArg`` and sizes as ints."""

    op: str
    args: tuple[Any, ...]
    kwargs: dict[str, Any]
    inputs: tuple[TensorArg, ...]
    out_shape: tuple[int, ...]

    def arg(self, position: int, name: str, default: Any = None) -> Any:
        """Argument by position or keyword."""
        if position < len(self.args):
            return self.args[position]
        return self.kwargs.get(name, default)


Rule = Callable[[OpCall, tuple[int, ...]], int]


@dataclass(frozen=True, slots=True)
class RuleEntry:
    """A rule and which positional args are data inputs (None: every tensor arg)."""

    fn: Rule
    inputs: tuple[int, ...] | None = None


RULES: dict[Any, RuleEntry] = {}
"""fx target -> rule; filled by the family modules when ``hspmd.deduce`` is imported."""

FAMILIES: list[Callable[[Any], RuleEntry | None]] = []
"""Rules found from what an op is rather than its name (``hspmd.deduce.aten``: torch's
pointwise tag); asked in order when ``RULES`` has no entry."""


def register(*targets: Any, inputs: Sequence[int] | None = None) -> Callable[[Rule], Rule]:
    """Decorator: register ``fn`` for every target (functions and method-name strings)."""

    def wrap(fn: Rule) -> Rule:
        entry = RuleEntry(fn, None if inputs is None else tuple(inputs))
        for target in dict.fromkeys(targets):  # aliases such as F.linear == _C._nn.linear
            assert target not in RULES, f"two rules for {target_text(target)}"
            RULES[target] = entry
        return fn

    return wrap


def lookup(target: Any) -> RuleEntry | None:
    """The rule of an fx target; ``"Tensor.silu"`` finds the method ``"silu"``."""
    if isinstance(target, str):
        target = target.removeprefix("Tensor.")
    found = RULES.get(target)
    for family in FAMILIES if found is None else ():
        found = family(target)
        if found is not None:
            break
    return found


def target_text(target: Any) -> str:
    """``operator.add`` -> ``_operator.add``; the method ``"view"`` -> ``Tensor.view``."""
    if isinstance(target, str):
        return f"Tensor.{target}"
    return torch.fx.node._get_qualified_name(target)


def placement_text(placement: int) -> str:
    """``1`` -> ``S(1)``, ``DUP`` -> ``D``, ``PARTIAL`` -> ``P``."""
    return {DUP: "D", PARTIAL: "P"}.get(placement, f"S({placement})")


def placements_text(placements: Sequence[int]) -> str:
    return "(" + ", ".join(placement_text(p) for p in placements) + ")"


def normalize_dim(dim: int, ndim: int) -> int:
    """``-1`` of a 3-D tensor -> ``2``."""
    return dim + ndim if dim < 0 else dim
