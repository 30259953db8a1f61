"""Pointwise ops with broadcasting, by how they treat partial sums.

On one axis, inputs are aligned from the right (broadcasting). A split dim passes to the
output when every other input is split on the same dim or duplicate and broadcast there
(size 1 or absent), e.g. the RMSNorm weight ``(H,)`` times activations split on seq::

    inputs          output    why
    S(1), D         S(1)      D input has no dim 1 of size > 1 after alignment
    D, D            D
    P, D  (mul)     P         linear in the partial operand
    P, P  (add)     P         a sum of partial sums
    P, D  (add)     error     D would be added once per summand
    P     (silu)    error     not linear

Families: ``LINEAR_UNARY`` (P passes), ``NONLINEAR`` (no P), ``ADDITIVE`` (P only when all
inputs are P, scalars count as D), ``MULTIPLICATIVE`` (exactly one P, the rest D) and
``DIVISION`` (P only in the numerator).
"""

from __future__ import annotations

import operator

import torch
import torch.nn.functional as F

from hspmd.deduce.rules import DUP, PARTIAL, OpCall, RuleError, placements_text, register
from hspmd.fused_ops import swiglu

LINEAR_UNARY = (
    operator.neg, torch.neg, "neg", "float", "half", "bfloat16", "double", "contiguous",
    "clone", torch.clone, "expand", "expand_as",
)  # fmt: skip
LINEAR_FIRST_ONLY = ("type_as", "to")  # data is the first arg; the rest give dtype/device
NONLINEAR = (
    torch.rsqrt, "rsqrt", torch.sqrt, "sqrt", torch.exp, "exp", torch.log, "log", torch.abs,
    "abs", torch.pow, operator.pow, "pow", torch.sigmoid, "sigmoid", torch.tanh, "tanh",
    F.silu, "silu", F.gelu, F.relu, torch.relu, "relu", torch.square, "square",
    torch.reciprocal, "reciprocal", torch.maximum, torch.minimum, swiglu,
)  # fmt: skip
ADDITIVE = (operator.add, torch.add, "add", operator.sub, torch.sub, "sub")
MULTIPLICATIVE = (operator.mul, torch.mul, "mul")
DIVISION = (operator.truediv, torch.div, "div")


def broadcast_split(call: OpCall, placements: tuple[int, ...]) -> int | None:
    """The output dim split on this axis (None if no input is split); checks broadcasting."""
    ndim = len(call.out_shape)
    split = {p + ndim - x.ndim for x, p in zip(call.inputs, placements, strict=True) if p >= 0}
    if not split:
        return None
    if len(split) > 1:
        raise RuleError(
            f"inputs {placements_text(placements)} are split on different output dims "
            f"{sorted(split)} on one device axis",
            "reshard one input to the other's layout",
        )
    (dim,) = split
    for x, p in zip(call.inputs, placements, strict=True):
        own = dim - (ndim - x.ndim)
        if p == PARTIAL:
            raise RuleError(
                f"input {x.index} is partial while another input is split on dim {dim}",
                f"reshard input {x.index} to split dim {own} the same way (reduce-scatter)",
            )
        if p == DUP and own >= 0 and x.shape[own] != 1:
            raise RuleError(
                f"input {x.index} is duplicate but spans dim {dim} (size {x.shape[own]}) "
                "that another input splits",
                f"reshard input {x.index} to split dim {own} the same way",
            )
    return dim


def _pointwise(call: OpCall, placements: tuple[int, ...], *, partial: str) -> int:
    split = broadcast_split(call, placements)
    if split is not None:
        return split
    if PARTIAL not in placements:
        return DUP
    scalars = sum(isinstance(a, int | float) for a in call.args)
    num_partial = placements.count(PARTIAL)
    allowed = {
        "linear": True,
        "none": False,
        "all": num_partial == len(placements) and scalars == 0,
        "one": num_partial == 1,
        "first": num_partial == 1 and placements[0] == PARTIAL and call.args[0] is call.inputs[0],
    }[partial]
    if not allowed:
        raise RuleError(
            f"{call.op} is not linear in a partial input the way {placements_text(placements)} "
            "needs (partial sums would be combined wrongly)",
            "reshard the partial input to duplicate (all-reduce) first",
        )
    return PARTIAL


@register(*LINEAR_UNARY)
def linear_unary(call: OpCall, placements: tuple[int, ...]) -> int:
    return _pointwise(call, placements, partial="linear")


@register(*LINEAR_FIRST_ONLY, inputs=(0,))
def linear_first_only(call: OpCall, placements: tuple[int, ...]) -> int:
    return _pointwise(call, placements, partial="linear")


@register(*NONLINEAR)
def nonlinear(call: OpCall, placements: tuple[int, ...]) -> int:
    return _pointwise(call, placements, partial="none")


@register(*ADDITIVE)
def additive(call: OpCall, placements: tuple[int, ...]) -> int:
    return _pointwise(call, placements, partial="all")


@register(*MULTIPLICATIVE)
def multiplicative(call: OpCall, placements: tuple[int, ...]) -> int:
    return _pointwise(call, placements, partial="one")


@register(*DIVISION)
def division(call: OpCall, placements: tuple[int, ...]) -> int:
    return _pointwise(call, placements, partial="first")
