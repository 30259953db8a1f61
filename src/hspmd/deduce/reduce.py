"""Reductions and normalizations over dims.

``sum``/``mean`` (one dim, several, or all; ``keepdim``)::

    placement           sum       mean
    split, kept dim     moved     moved (dims after removed ones shift)
    split, reduced dim  P         error (a local mean is not a summand of the global mean)
    P                   P         P (both are linear)

``softmax``/``log_softmax`` work on a dim that is not split and do not take P.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from hspmd.deduce.rules import PARTIAL, OpCall, RuleError, normalize_dim, register


def reduced_dims(call: OpCall) -> tuple[set[int], bool]:
    """The reduced dims (normalized) and ``keepdim``."""
    (x,) = call.inputs
    dim = call.arg(1, "dim")
    keepdim = bool(call.arg(2, "keepdim", False))
    if dim is None:
        return set(range(x.ndim)), keepdim
    dims = [dim] if isinstance(dim, int) else list(dim)
    return {normalize_dim(d, x.ndim) for d in dims}, keepdim


def _reduce(call: OpCall, placements: tuple[int, ...], *, mean: bool) -> int:
    (p,) = placements
    if p < 0:
        return p
    dims, keepdim = reduced_dims(call)
    if p in dims:
        if mean:
            raise RuleError(
                f"{call.op} over dim {p}, which is split",
                "sum and divide by the global size, or reshard to gather the dim first",
            )
        return PARTIAL
    return p if keepdim else p - sum(1 for d in dims if d < p)


@register("sum", torch.sum)
def sum_(call: OpCall, placements: tuple[int, ...]) -> int:
    return _reduce(call, placements, mean=False)


@register("mean", torch.mean)
def mean(call: OpCall, placements: tuple[int, ...]) -> int:
    return _reduce(call, placements, mean=True)


@register(F.softmax, torch.softmax, "softmax", F.log_softmax, torch.log_softmax, "log_softmax")
def softmax(call: OpCall, placements: tuple[int, ...]) -> int:
    (p,) = placements
    (x,) = call.inputs
    dim = normalize_dim(call.arg(1, "dim"), x.ndim)
    if p in (PARTIAL, dim):
        what = "partial input" if p == PARTIAL else f"split dim {dim}"
        raise RuleError(
            f"{call.op} over dim {dim} with a {what}",
            "reshard the input to duplicate on that dim first",
        )
    return p
