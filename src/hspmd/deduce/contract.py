"""Contractions, all derived from einsum strings.

``linear`` is ``"...k,nk->...n"``, ``matmul`` ``"...mk,...kn->...mn"`` (batch dims broadcast),
``bmm`` ``"bmk,bkn->bmn"``, ``mm`` ``"mk,kn->mn"``, and ``torch.einsum`` takes its own
string. On one axis (letters of split dims)::

    x        W        out      case
    D        S(n)     S(-1)    column-parallel linear: n is kept
    S(k)     S(k)     P        row-parallel linear: k is contracted
    S(m)     D        S(m)     batch/sequence split: m is kept, W does not have it
    P        D        P        linear in each operand
    S(m)     S(n)     error    two letters split on one axis
    D        S(k)     error    x would need a slice of k

A duplicate operand may sit on a split letter only where its size is 1 (broadcast batch).
"""

from __future__ import annotations

import dataclasses
import operator
import string

import torch

from hspmd.deduce.rules import DUP, PARTIAL, OpCall, RuleError, placements_text, register

_BATCH = string.ascii_uppercase  # letters for ellipsis dims (the written ones are lowercase)


def expand_ellipsis(spec: str, ndims: list[int]) -> tuple[list[str], str]:
    """``"...k,nk->...n"`` with ndims [3, 2] -> (["ABk", "nk"], "ABn"); batch dims right-aligned."""
    lhs, out = spec.replace(" ", "").split("->")
    operands = lhs.split(",")
    widths = [n - len(op.replace("...", "")) for op, n in zip(operands, ndims, strict=True)]
    batch = max([w for op, w in zip(operands, widths, strict=True) if "..." in op], default=0)
    letters = _BATCH[:batch]
    expanded = [
        op.replace("...", letters[batch - w :]) if "..." in op else op
        for op, w in zip(operands, widths, strict=True)
    ]
    return expanded, out.replace("...", letters)


def einsum_axis(operands: list[str], out: str, call: OpCall, placements: tuple[int, ...]) -> int:
    """The output placement of ``operands -> out`` on one axis."""
    if PARTIAL in placements:
        if placements.count(PARTIAL) == 1 and all(p in (DUP, PARTIAL) for p in placements):
            return PARTIAL
        raise RuleError(
            f"{call.op} with inputs {placements_text(placements)}: a contraction is linear "
            "in one partial operand only when the others are duplicate",
            "reshard the partial operand to duplicate (all-reduce) first",
        )
    letters = {ops[p] for ops, p in zip(operands, placements, strict=True) if p >= 0}
    if not letters:
        return DUP
    if len(letters) > 1:
        raise RuleError(
            f"{call.op} with inputs {placements_text(placements)} splits letters "
            f"{sorted(letters)} of {','.join(operands)}->{out} on one device axis",
            "reshard one operand so that a single letter is split on this axis",
        )
    (letter,) = letters
    for ops, x, p in zip(operands, call.inputs, placements, strict=True):
        if p == DUP and letter in ops and x.shape[ops.index(letter)] != 1:
            raise RuleError(
                f"{call.op}: input {x.index} is duplicate on letter {letter!r} of "
                f"{','.join(operands)}->{out}, which another input splits",
                f"reshard input {x.index} to split dim {ops.index(letter)} too",
            )
    return out.index(letter) if letter in out else PARTIAL


def _einsum_rule(spec: str, call: OpCall, placements: tuple[int, ...]) -> int:
    operands, out = expand_ellipsis(spec, [x.ndim for x in call.inputs])
    return einsum_axis(operands, out, call, placements)


@register(torch._C._nn.linear, torch.nn.functional.linear)
def linear(call: OpCall, placements: tuple[int, ...]) -> int:
    """``F.linear(x, W, b)``: ``...k,nk->...n``, then the bias is added like ``add``."""
    has_bias = len(call.inputs) == 3
    weights = dataclasses.replace(call, inputs=call.inputs[:2])
    out = _einsum_rule("...k,nk->...n", weights, placements[:2])
    if not has_bias:
        return out
    bias = placements[2]
    last = len(call.out_shape) - 1
    if (out, bias) in ((DUP, DUP), (last, 0)) or (bias == DUP and 0 <= out < last):
        return out  # a duplicate bias broadcasts over the leading (batch, sequence) dims
    raise RuleError(
        f"linear output {placements_text((out,))} cannot take a bias that is "
        f"{placements_text((bias,))} on the same axis",
        "split the bias like the output dim, or add the bias after the reshard",
    )


def matmul_spec(nda: int, ndb: int) -> str:
    """Einsum string of ``matmul`` for operand ranks (1-D operands as torch treats them)."""
    a = "k" if nda == 1 else "...mk"
    b = "k" if ndb == 1 else "...kn"
    out = ("...m" if nda > 1 else "...") + ("n" if ndb > 1 else "")
    return f"{a},{b}->{out}"


@register(torch.matmul, operator.matmul, "matmul")
def matmul(call: OpCall, placements: tuple[int, ...]) -> int:
    a, b = call.inputs
    return _einsum_rule(matmul_spec(a.ndim, b.ndim), call, placements)


@register(torch.bmm, "bmm")
def bmm(call: OpCall, placements: tuple[int, ...]) -> int:
    return _einsum_rule("bmk,bkn->bmn", call, placements)


@register(torch.mm, "mm")
def mm(call: OpCall, placements: tuple[int, ...]) -> int:
    return _einsum_rule("mk,kn->mn", call, placements)


@register(torch.einsum)
def einsum(call: OpCall, placements: tuple[int, ...]) -> int:
    spec = call.args[0]
    if not isinstance(spec, str) or "->" not in spec:
        raise RuleError(
            f"einsum {spec!r} has no explicit output", "write the output letters: 'ij,jk->ik'"
        )
    return _einsum_rule(spec, call, placements)
