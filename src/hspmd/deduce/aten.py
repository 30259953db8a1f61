"""Rules over ATen ops: the ops a captured graph holds (``hspmd.graph.export``).

The opset is closed: every op is a ``torch.ops.aten`` overload, and torch says what it is.

- **Pointwise ops come from torch's own tags** (``torch.Tag.pointwise``), not from a list:
  ``add``/``sub`` take partial sums only from every operand, ``mul`` from one, ``div``
  from its numerator; every other pointwise op (``gelu``, ``where``, ``pow``...) refuses a
  partial input, which is always correct.
- **The families** reuse the rules written once for the torch functions of the same
  arguments (views, matmul by einsum, norms, softmax, reductions, attention, loss); ops
  whose arguments differ get a small adapter (``embedding(weight, ids)``, ``addmm``,
  ``cross_entropy_loss``'s enum reduction, ``slice``, ``select``, ``stack``).
- **Ops made only from sizes and buffers** (``arange``, HF's causal masks) are constants,
  as before; ``*_like``/``new_*`` fills take their input's layout, not its values.

>>> from hspmd.deduce.rules import lookup
>>> lookup(torch.ops.aten.gelu.default).fn.__name__, lookup(torch.ops.aten.mul.Tensor).fn.__name__
('nonlinear', 'multiplicative')
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any

import torch

from hspmd.deduce import contract, layers, misc, pointwise, reduce, views
from hspmd.deduce.rules import (
    DUP,
    FAMILIES,
    PARTIAL,
    OpCall,
    RuleEntry,
    RuleError,
    normalize_dim,
    placements_text,
    register,
)

aten = torch.ops.aten

__all__ = ["pointwise_family"]

# -- the families, reused ------------------------------------------------------------------------

register(aten.linear.default)(contract.linear)
register(aten.mm.default)(contract.mm)
register(aten.bmm.default)(contract.bmm)
register(aten.matmul.default)(contract.matmul)
register(
    aten.view.default, aten.reshape.default, aten._unsafe_view.default, aten.unsqueeze.default,
    aten.squeeze.dim, aten.squeeze.dims, aten.squeeze.default, aten.flatten.using_ints,
    aten.unflatten.int, aten.view_as.default, aten.reshape_as.default,
)(views.reshape)  # fmt: skip
register(aten.transpose.int, aten.swapaxes.default)(views.transpose)
register(aten.permute.default)(views.permute)
register(aten.narrow.default)(views.narrow)
register(aten.repeat_interleave.self_int)(views.repeat_interleave)
register(aten.pad.default)(layers.pad)
register(aten.conv1d.default, aten.conv2d.default)(layers.convolution)
register(aten.einsum.default)(contract.einsum)
register(aten.cat.default)(misc.cat)
register(aten.layer_norm.default, aten.rms_norm.default)(layers.layer_norm)
register(aten.masked_fill.Scalar, aten.masked_fill.Tensor)(layers.masked_fill)
register(aten.softmax.int, aten._softmax.default, aten.log_softmax.int, aten._log_softmax.default)(
    reduce.softmax
)
register(aten.sum.dim_IntList, aten.sum.default)(reduce.sum_)
register(aten.mean.dim, aten.mean.default)(reduce.mean)
register(
    aten.clone.default, aten.contiguous.default, aten.alias.default, aten.expand.default,
    aten.lift_fresh_copy.default, aten.detach.default,
)(pointwise.linear_unary)  # fmt: skip
register(
    aten.to.dtype, aten.to.dtype_layout, aten.to.device, aten._to_copy.default,
    aten.type_as.default, inputs=(0,),
)(pointwise.linear_first_only)  # fmt: skip


@register(aten.t.default)
def t(call: OpCall, placements: tuple[int, ...]) -> int:
    (p,) = placements
    return {0: 1, 1: 0}.get(p, p) if call.inputs[0].ndim == 2 else p


@register(aten.addmm.default)
def addmm(call: OpCall, placements: tuple[int, ...]) -> int:
    """``addmm(bias, x, w) = bias + x @ w`` (HF's Conv1D): ``mk,kn->mn`` plus the bias."""
    bias, *operands = placements
    mm_call = dataclasses.replace(call, inputs=call.inputs[1:])
    out = contract.mm(mm_call, tuple(operands))
    if (out, bias) in ((DUP, DUP), (1, call.inputs[0].ndim - 1)):
        return out
    if out == 0 and bias == DUP and call.inputs[0].ndim == 1:
        return out  # rows split, a (n,) bias broadcast over them
    raise RuleError(
        f"addmm output {placements_text((out,))} cannot take a bias that is "
        f"{placements_text((bias,))} on the same axis",
        "split the bias like the output's columns, or keep the weight replicate",
    )


@register(aten.embedding.default, inputs=(0, 1))
def embedding(call: OpCall, placements: tuple[int, ...]) -> int:
    """``aten.embedding(weight, ids)``: ``F.embedding``'s rule with its arguments swapped."""
    weight, ids = placements
    swapped = dataclasses.replace(call, inputs=(call.inputs[1], call.inputs[0]))
    return misc.embedding(swapped, (ids, weight))


_REDUCTIONS = {0: "none", 1: "mean", 2: "sum"}


@register(aten.cross_entropy_loss.default, inputs=(0, 1))
def cross_entropy_loss(call: OpCall, placements: tuple[int, ...]) -> int:
    """``cross_entropy_loss(x, t, weight, reduction: 0/1/2, ignore_index, label_smoothing)``."""
    kwargs = {
        "weight": call.arg(2, "weight"),
        "reduction": _REDUCTIONS[int(call.arg(3, "reduction", 1))],
        "ignore_index": call.arg(4, "ignore_index", -100),
        "label_smoothing": call.arg(5, "label_smoothing", 0.0),
    }
    return misc.cross_entropy(dataclasses.replace(call, kwargs=kwargs), placements)


@register(aten.dropout.default, aten.dropout_.default)
def dropout(call: OpCall, placements: tuple[int, ...]) -> int:
    """Any layout: the executable draws each element's mask bit from its global position
    (``hspmd.randomness``), so every piece holds one device's bits; a partial sum stays
    partial (the same mask on every summand)."""
    return placements[0]


@register(aten.scaled_dot_product_attention.default)
def attention(call: OpCall, placements: tuple[int, ...]) -> int:
    """SDPA on q, k, v (as ``F.scaled_dot_product_attention``); a mask the graph computes
    from sizes (HF's causal mask) is a constant, broadcast over the split heads dim. With
    ``dropout_p`` the executable runs its math form, the dropout on the attention weights
    drawn by position (``hspmd.randomness.attention``)."""
    qkv = dataclasses.replace(call, inputs=call.inputs[:3])
    out = misc.attention(qkv, placements[:3])
    for mask, p in zip(call.inputs[3:], placements[3:], strict=True):
        if p != DUP:
            raise RuleError(f"attention mask {placements_text((p,))}", "make the mask duplicate")
        own = out - (call.inputs[0].ndim - mask.ndim)
        if out >= 0 and own >= 0 and mask.shape[own] != 1:
            raise RuleError(
                f"attention mask of shape {list(mask.shape)} spans dim {out}, which q, k, v split",
                "split the heads dim (the mask broadcasts over it)",
            )
    return out


def _dim_kept(call: OpCall, p: int, dim: int, what: str) -> None:
    if p == dim and call.out_shape[dim] != call.inputs[0].shape[dim]:
        raise RuleError(
            f"{what} cuts split dim {dim} of {list(call.inputs[0].shape)}",
            f"{what} a dim that is not split, or reshard to gather it first",
        )


@register(aten.slice.Tensor)
def slice_(call: OpCall, placements: tuple[int, ...]) -> int:
    (p,) = placements
    dim = normalize_dim(call.arg(1, "dim", 0), call.inputs[0].ndim)
    _dim_kept(call, p, dim, "slice")
    return p


@register(aten.select.int)
def select(call: OpCall, placements: tuple[int, ...]) -> int:
    (p,) = placements
    dim = normalize_dim(call.arg(1, "dim"), call.inputs[0].ndim)
    if p == dim:
        raise RuleError(
            f"select removes split dim {dim} of {list(call.inputs[0].shape)}",
            "select along a dim that is not split, or reshard to gather it first",
        )
    return p - 1 if p > dim else p


@register(aten.stack.default)
def stack(call: OpCall, placements: tuple[int, ...]) -> int:
    dim = normalize_dim(call.arg(1, "dim", 0), len(call.out_shape))
    if len(set(placements)) != 1:
        raise RuleError(
            f"stack of inputs {placements_text(placements)}: they must match",
            "reshard the inputs to one layout first",
        )
    p = placements[0]
    return p + 1 if p >= dim else p


@register(
    aten.zeros_like.default, aten.ones_like.default, aten.empty_like.default,
    aten.full_like.default, inputs=(0,),
)  # fmt: skip
def like(call: OpCall, placements: tuple[int, ...]) -> int:
    """A fill shaped like its input: split like it; duplicate where the input was partial."""
    (p,) = placements
    return DUP if p == PARTIAL else p


@register(
    aten.new_zeros.default, aten.new_ones.default, aten.new_empty.default,
    aten.new_full.default, inputs=(0,),
)  # fmt: skip
def new_fill(call: OpCall, placements: tuple[int, ...]) -> int:
    """``x.new_ones(size)``: a tensor of the given (global) size, the same on every rank."""
    return DUP


# -- pointwise ops by tag -------------------------------------------------------------------------

_FAMILY = {
    "add": pointwise.additive, "sub": pointwise.additive, "rsub": pointwise.additive,
    "mul": pointwise.multiplicative, "div": pointwise.division,
    "neg": pointwise.linear_unary, "positive": pointwise.linear_unary,
}  # fmt: skip


@functools.cache
def pointwise_family(op: Any) -> RuleEntry | None:
    """The rule of a pointwise ATen overload (``torch.Tag.pointwise``), by its name."""
    if not isinstance(op, torch._ops.OpOverload) or torch.Tag.pointwise not in op.tags:
        return None
    name = op.overloadpacket.__name__.removesuffix("_")
    return RuleEntry(_FAMILY.get(name, pointwise.nonlinear))


FAMILIES.append(pointwise_family)
