"""Views: reshape-like ops map split dims through factor groups; transposes permute them.

``view``/``reshape``/``flatten``/``unflatten``/``squeeze``/``unsqueeze`` are all read from
the input and output shapes. Dims of size > 1 are grouped where their products agree;
a split moves to the first output dim of its group, and must have been on the first input
dim of the group (otherwise local pieces are not contiguous)::

    (B, T, nh*hd) -> (B, T, nh, hd)   groups [B]->[B] [T]->[T] [nh*hd]->[nh, hd]
    S(2)          -> S(2)             the heads dim: nh must divide by the degree
    (B, T, H)     -> (B*T, H)         S(0) -> S(0); S(1) -> error (T is not leading)

Divisibility (and top-tier part sizes, which scale with the group) is checked on the
output annotation by the caller.
"""

from __future__ import annotations

import operator

import torch

from hspmd.deduce.rules import DUP, OpCall, RuleError, normalize_dim, register

RESHAPES = (
    "view", "reshape", torch.reshape, "flatten", torch.flatten, "unflatten", torch.unflatten,
    "squeeze", torch.squeeze, "unsqueeze", torch.unsqueeze,
)  # fmt: skip


def factor_groups(src: tuple[int, ...], dst: tuple[int, ...]) -> list[tuple[list[int], list[int]]]:
    """Groups of dims (size > 1) with equal products: ``(2, 6) -> (2, 2, 3)`` gives
    ``[([0], [0]), ([1], [1, 2])]``."""
    a = [i for i, n in enumerate(src) if n != 1]
    b = [j for j, n in enumerate(dst) if n != 1]
    groups: list[tuple[list[int], list[int]]] = []
    i = j = 0
    while i < len(a) and j < len(b):
        gi, gj = [a[i]], [b[j]]
        pa, pb = src[a[i]], dst[b[j]]
        i, j = i + 1, j + 1
        while pa != pb:
            if pa < pb:
                gi.append(a[i])
                pa *= src[a[i]]
                i += 1
            else:
                gj.append(b[j])
                pb *= dst[b[j]]
                j += 1
        groups.append((gi, gj))
    return groups


@register(*RESHAPES)
def reshape(call: OpCall, placements: tuple[int, ...]) -> int:
    (p,) = placements
    if p < 0:
        return p
    (x,) = call.inputs
    for src_dims, dst_dims in factor_groups(x.shape, call.out_shape):
        if p in src_dims:
            if p != src_dims[0]:
                raise RuleError(
                    f"split dim {p} of {list(x.shape)} is not the leading dim of its group "
                    f"{src_dims} -> {dst_dims} in the view to {list(call.out_shape)}",
                    f"split dim {src_dims[0]} instead, or reshard before the view",
                )
            return dst_dims[0]
    raise AssertionError(f"dim {p} of {x.shape} is split but has size 1")


@register("transpose", torch.transpose, "swapaxes")
def transpose(call: OpCall, placements: tuple[int, ...]) -> int:
    (p,) = placements
    ndim = len(call.out_shape)
    a, b = (normalize_dim(call.arg(i, n), ndim) for i, n in ((1, "dim0"), (2, "dim1")))
    return {a: b, b: a}.get(p, p)


@register("permute", torch.permute)
def permute(call: OpCall, placements: tuple[int, ...]) -> int:
    (p,) = placements
    dims = call.args[1:] if call.op == "Tensor.permute" else call.arg(1, "dims")
    if len(dims) == 1 and isinstance(dims[0], list | tuple):
        dims = dims[0]
    order = [normalize_dim(d, len(call.out_shape)) for d in dims]
    return order.index(p) if p >= 0 else p


def _index_map(shape: tuple[int, ...], index: object) -> dict[int, int | None]:
    """Input dim -> output dim (None: removed by an int index, or cut by a slice)."""
    items = list(index) if isinstance(index, tuple) else [index]
    explicit = sum(1 for i in items if i is not None and i is not Ellipsis)
    out: dict[int, int | None] = {}
    dim = new = 0
    for item in items:
        if item is Ellipsis:
            for _ in range(len(shape) - explicit):
                out[dim], dim, new = new, dim + 1, new + 1
        elif item is None:
            new += 1
        elif isinstance(item, int):
            out[dim], dim = None, dim + 1
        elif isinstance(item, slice):
            full = slice(*item.indices(shape[dim])) == slice(0, shape[dim], 1)
            out[dim], dim, new = (new if full else None), dim + 1, new + 1
        else:
            raise RuleError(
                f"tensor indexing with {type(item).__name__} has no rule",
                "index with ints, slices, None and ... only",
            )
    for rest in range(dim, len(shape)):
        out[rest], new = new, new + 1
    return out


@register(operator.getitem)
def getitem(call: OpCall, placements: tuple[int, ...]) -> int:
    """``x[..., a:b]``: split dims must be kept whole."""
    (p,) = placements
    if p < 0:
        return p
    (x,) = call.inputs
    target = _index_map(x.shape, call.args[1]).get(p)
    if target is None:
        raise RuleError(
            f"index {call.args[1]!r} cuts or removes split dim {p} of {list(x.shape)}",
            "index a dim that is not split, or reshard to gather this dim first",
        )
    return target


@register("narrow", torch.narrow)
def narrow(call: OpCall, placements: tuple[int, ...]) -> int:
    (p,) = placements
    (x,) = call.inputs
    dim = normalize_dim(call.arg(1, "dim"), x.ndim)
    if p == dim and call.out_shape[dim] != x.shape[dim]:
        raise RuleError(
            f"narrow cuts split dim {dim} of {list(x.shape)}",
            "narrow a dim that is not split, or reshard to gather it first",
        )
    return p


@register("repeat_interleave", torch.repeat_interleave)
def repeat_interleave(call: OpCall, placements: tuple[int, ...]) -> int:
    """Repeating each block element keeps contiguous blocks: a split dim stays split."""
    (p,) = placements
    dim = call.arg(2, "dim")
    if dim is None and p != DUP:
        raise RuleError(
            "repeat_interleave without dim flattens a sharded tensor",
            "pass dim=, or reshard to duplicate first",
        )
    return p
