"""Rules for layers of common user models: layer_norm, rms_norm, convolutions, pad,
dropout, masked_fill.

``layer_norm(x, normalized_shape, weight, bias)`` normalizes over the last
``len(normalized_shape)`` dims, so on one axis::

    x       weight, bias   out
    S(d)    D              S(d)     d a leading dim (batch, sequence)
    D       D              D
    P or S(normalized)     error    the statistics need every summand / element

``conv1d`` / ``conv2d(x[N, C, ...], w[O, C, ...], b[O])``: the batch may be split (weights
duplicate); channels and spatial dims are not (a halo exchange is not a reshard)::

    x       w, b    out
    S(0)    D       S(0)
    D       D       D

``rms_norm`` is ``layer_norm`` without the bias. ``dropout`` with ``p=0`` (or not
training) is the identity; with ``p > 0`` in a graph traced at the Python level each rank
would draw its own mask, so it is refused (a captured graph's ``aten.dropout`` is drawn by
position and takes any layout: ``hspmd.deduce.aten.dropout``). ``masked_fill(x, mask, value)``: a pointwise op in x (partial refused), the mask
broadcast like any input.

``pad(x, pad)``: a split or partial dim passes when it is not padded (zero padding is
linear, so a partial input stays partial).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from hspmd.deduce.pointwise import broadcast_split
from hspmd.deduce.rules import DUP, PARTIAL, OpCall, RuleError, placements_text, register
from hspmd.fused_ops import rms_norm


def _pointwise_split(call: OpCall, placements: tuple[int, ...]) -> int:
    split = broadcast_split(call, placements)
    return DUP if split is None else split


@register(F.layer_norm, torch.layer_norm, F.rms_norm, torch.rms_norm, rms_norm)
def layer_norm(call: OpCall, placements: tuple[int, ...]) -> int:
    x, *affine = placements
    normalized = call.arg(1, "normalized_shape")
    count = 1 if isinstance(normalized, int) else len(normalized)
    first_normalized = call.inputs[0].ndim - count
    if any(p != DUP for p in affine):
        raise RuleError(
            f"layer_norm with weight/bias {placements_text(tuple(affine))}",
            "make the norm's weight and bias replicate",
        )
    if x == PARTIAL or x >= first_normalized:
        raise RuleError(
            f"layer_norm of an input {placements_text((x,))} over its last {count} dim(s): "
            "the mean and variance need the whole, summed row",
            "reshard the input to duplicate (or split a leading dim) first",
        )
    return x


@register(F.conv1d, torch.conv1d, F.conv2d, torch.conv2d)
def convolution(call: OpCall, placements: tuple[int, ...]) -> int:
    x, *weights = placements
    if any(p != DUP for p in weights) or x not in (DUP, 0):
        raise RuleError(
            f"convolution of input {placements_text((x,))} with weights "
            f"{placements_text(tuple(weights))}: only the batch (dim 0) may be split",
            "keep convolution weights replicate (no TP rule) and split only the batch",
        )
    return x


@register(F.pad)
def pad(call: OpCall, placements: tuple[int, ...]) -> int:
    (x,) = placements
    sizes = call.arg(1, "pad")
    padded = {call.inputs[0].ndim - 1 - i // 2 for i, n in enumerate(sizes) if n}
    if x >= 0 and x in padded:
        raise RuleError(
            f"pad of dim {x}, which is split", "pad a dim that is not split, or gather it first"
        )
    if x == PARTIAL and (call.arg(2, "mode", "constant") != "constant" or call.arg(3, "value", 0)):
        raise RuleError(
            "pad of a partial input with a nonzero or non-constant fill",
            "reshard the input to duplicate first",
        )
    return x


@register(F.dropout, torch.dropout, "dropout")
def dropout(call: OpCall, placements: tuple[int, ...]) -> int:
    if call.arg(1, "p", 0.5) and call.arg(2, "training", True):
        raise RuleError(
            f"dropout with p={call.arg(1, 'p', 0.5)} while training: each rank would drop "
            "other elements than one device does",
            "set the dropout probability to 0 (nn.Dropout(0.0))",
        )
    return placements[0]


@register("masked_fill", torch.masked_fill)
def masked_fill(call: OpCall, placements: tuple[int, ...]) -> int:
    if PARTIAL in placements:
        raise RuleError(
            f"masked_fill of {placements_text(placements)}: a partial sum cannot be filled",
            "reshard the input to duplicate (all-reduce) first",
        )
    return _pointwise_split(call, placements)
