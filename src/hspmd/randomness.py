"""Randomness as a function of position (DESIGN decision 17): counter-based dropout.

torch's dropout draws its mask from a generator: the bits depend on how much was drawn
before and on the shape of the tensor that draws them, so a rank holding half of a
tensor (TP, CP, sequence parallelism) or a pipeline holding part of the batch draws
other masks than one device does. Here each element's bit is a hash of where it is::

    keep = hash(seed, op, step, row, index) / 2^32 >= p          out = x * keep / (1 - p)

    seed    the run's seed (--seed)
    op      which mask-drawing call of the forward it is: the n-th dropout, or attention
            with dropout_p, with p > 0 (counted in the captured graph and in the eager
            forward alike: ``mask_ops``, ``positional_dropout``)
    step    the training step, 1, 2, ...: a redone, resumed or switched step draws the
            same masks
    row     the element's row of the step's batch: its coordinate along dim 0 (the
            batch, or the batch merged with the next dims, ``(B*T, H)``) mapped through
            the key's global row ids (a micro-batch's rows of the global batch;
            accumulation pass k's rows are ``k * global_batch + i``)
    index   its row-major index inside the row (the dims after the batch)

A ``key`` is data, an int64 tensor ``[step, row ids...]`` (``dropout_key``), so that a
recomputed layer (``torch.utils.checkpoint``) keeps it with its inputs. A ``Block`` (the
global shape and the start of a local tensor) gives the bits of any piece, so every piece
of a tensor holds the whole tensor's bits at its place, bit for bit::

    >>> key = dropout_key(3, range(4))                       # step 3, rows 0..3
    >>> whole = keep_mask(key, (4, 6, 8), p=0.5, seed=0, op=2)
    >>> piece = keep_mask(dropout_key(3, range(2, 4)), (2, 3, 8), p=0.5, seed=0, op=2,
    ...                   block=Block((2, 6, 8), (0, 3, 0)))  # rows 2, 3; positions 3..5
    >>> torch.equal(piece, whole[2:4, 3:6])
    True

The hash is Wellons' lowbias32 mixer on 32-bit values held in int64 tensors (each product
below 2^63: a multiplier of 2^31 or more is applied in two 16-bit halves), chained over
the fields: per row ``h = mix(...mix(mix(c ^ seed) ^ op)... ^ row)``, per element
``mix(mix(index) ^ h)``. Integer ops only, so CPU and GPU give the same bits.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import torch
import torch.fx
import torch.nn.functional as F
from torch.overrides import TorchFunctionMode

__all__ = [
    "Block",
    "attention",
    "block_at",
    "dropout",
    "dropout_key",
    "draws_mask",
    "keep_mask",
    "mask_ops",
    "positional_dropout",
    "seeded_random",
]

_M32 = 0xFFFFFFFF
_START = 0x243F6A88  # the chain's first value (pi's fraction): mix(0) == 0 would be a fixed point


def _mul32(x: Any, c: int) -> Any:
    """``x * c mod 2^32`` for ``x < 2^32``, no product reaching 2^63 (ints or tensors)."""
    if c < 1 << 31:
        return (x * c) & _M32
    high, low = c >> 16, c & 0xFFFF
    return (x * low + (((x * high) & 0xFFFF) << 16)) & _M32


def _mix(x: Any) -> Any:
    """lowbias32: a bijection of 32-bit values with strong avalanche (bias 0.17)."""
    x = x ^ (x >> 16)
    x = _mul32(x, 0x7FEB352D)
    x = x ^ (x >> 15)
    x = _mul32(x, 0x846CA68B)
    return x ^ (x >> 16)


def _absorb(h: Any, value: Any) -> Any:
    """``h`` with a 64-bit field mixed in, its low then its high half."""
    return _mix(_mix(h ^ (value & _M32)) ^ ((value >> 32) & _M32))


def dropout_key(step: int, rows: Sequence[int] | torch.Tensor) -> torch.Tensor:
    """The key of one forward: ``[step, row ids...]``, the rows' places in the step's batch.

    >>> dropout_key(2, range(4, 6)).tolist()
    [2, 4, 5]
    """
    ids = torch.as_tensor(list(rows) if isinstance(rows, range) else rows, dtype=torch.int64)
    return torch.cat([torch.tensor([step], dtype=torch.int64), ids.reshape(-1).cpu()])


@dataclass(frozen=True, slots=True)
class Block:
    """Where a local tensor sits in its global tensor: the global shape and the start of
    the local block on each dim (its size is the local tensor's)."""

    global_shape: tuple[int, ...]
    start: tuple[int, ...]


def block_at(
    shape: Sequence[int], *, global_shape: Sequence[int], start: Sequence[int], size: Sequence[int]
) -> Block:
    """The block of a local tensor of ``shape``, from its block at the maximum length
    (``global_shape``, ``start``, ``size``: an annotation's piece there). A dim the rank
    holds whole stays whole; a split dim scales with its local size (the sequence dim of
    a shorter call, as ``hspmd.specialize.executable.stage_shape`` scales it).

    >>> block_at((2, 4, 8), global_shape=(2, 16, 8), start=(0, 8, 0), size=(2, 8, 8))
    Block(global_shape=(2, 8, 8), start=(0, 4, 0))
    """
    dims = zip(shape, global_shape, start, size, strict=True)
    whole = [(n, 0) if n0 == g else (g * n // n0, s * n // n0) for n, g, s, n0 in dims]
    return Block(tuple(g for g, _ in whole), tuple(s for _, s in whole))


def _threshold(p: float) -> int:
    if not 0.0 <= p <= 1.0:
        raise ValueError(f"dropout probability has to be between 0 and 1, but got {p}")
    return min(1 << 32, math.ceil(p * (1 << 32)))


def keep_mask(
    key: torch.Tensor,
    shape: Sequence[int],
    *,
    p: float,
    seed: int,
    op: int,
    block: Block | None = None,
    device: torch.device | str | None = None,
) -> torch.Tensor:
    """The keep bits (bool, ``shape``) of block ``block`` (default: the whole tensor) of
    mask-drawing call ``op`` under ``key`` (module docstring)."""
    shape = tuple(shape)
    block = block or Block(shape, (0,) * len(shape))
    global_shape, start = block.global_shape, block.start
    rows = key[1:].to(device)
    if not shape or rows.numel() == 0 or global_shape[0] % rows.numel():
        raise ValueError(
            f"dropout on a tensor of shape {list(global_shape)} with {rows.numel()} batch "
            "rows: hspmd keys dropout masks by batch row, so the tensor's first dim must "
            "be the batch (or the batch merged with the next dims, (B*T, H))"
        )
    factor = global_shape[0] // rows.numel()  # dim 0 holds factor entries of each row
    inner = math.prod(global_shape[1:])
    first = torch.arange(start[0], start[0] + shape[0], dtype=torch.int64, device=device)
    prefix = _START
    for value in (seed, op):
        prefix = _absorb(prefix, value)
    h = torch.tensor(prefix, dtype=torch.int64, device=device)
    h = _absorb(_absorb(h, key[0].to(device)), rows)
    h = h[first // factor].view(-1, *(1,) * (len(shape) - 1))  # each element's row's hash
    index = _inner_index(shape[1:], global_shape[1:], start[1:], device)
    if factor > 1:  # the row's entries on dim 0 are part of the index
        offset = (first % factor) * inner
        index = index.unsqueeze(0) + offset.view(-1, *(1,) * (len(shape) - 1))
    element = _mix(index & _M32)
    if factor * inner > _M32:  # rows of 2^32 elements or more: the index's high half too
        element = _mix(element ^ (index >> 32))
    return _mix(element ^ h) >= _threshold(p)


def _inner_index(
    shape: Sequence[int], global_shape: Sequence[int], start: Sequence[int], device: Any
) -> torch.Tensor:
    """Row-major index of each element of a block of the dims after the batch."""
    index = torch.zeros((1,) * len(shape), dtype=torch.int64, device=device)
    stride = math.prod(global_shape)
    for d, (n, g, s) in enumerate(zip(shape, global_shape, start, strict=True)):
        stride //= g
        coords = torch.arange(s, s + n, dtype=torch.int64, device=device) * stride
        index = index + coords.view(*(1,) * d, n, *(1,) * (len(shape) - d - 1))
    return index


def dropout(
    x: torch.Tensor,
    key: torch.Tensor,
    *,
    p: float,
    seed: int,
    op: int,
    block: Block | None = None,
    inplace: bool = False,
) -> torch.Tensor:
    """``x`` times its keep bits over ``1 - p`` (``keep_mask``); differentiable in ``x``.

    >>> x = torch.ones(4, 10000)
    >>> y = dropout(x, dropout_key(1, range(4)), p=0.25, seed=0, op=0)
    >>> round(float((y == 0).float().mean()), 2), sorted(set(y.flatten().tolist()))
    (0.25, [0.0, 1.3333333730697632])
    """
    keep = keep_mask(key, x.shape, p=p, seed=seed, op=op, block=block, device=x.device)
    scale = keep.to(x.dtype).mul_(1.0 / (1.0 - p)) if p < 1.0 else keep.to(x.dtype)
    return x.mul_(scale) if inplace else x * scale


def attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    attn_mask: torch.Tensor | None = None,
    dropout_p: float = 0.0,
    is_causal: bool = False,
    *,
    scale: float | None = None,
    enable_gqa: bool = False,
    key: torch.Tensor,
    seed: int,
    op: int,
    block: Block | None = None,
) -> torch.Tensor:
    """``F.scaled_dot_product_attention`` in its math form, the dropout on the attention
    weights ``(..., heads, Tq, Tk)`` counter-based (``block``: theirs, default whole):
    ``softmax(q k^T scale + mask) -> dropout -> @ v``. A fused kernel draws its mask
    inside; this form materializes the weights (memory ``B heads Tq Tk``), which is what
    reproducing them under any layout costs.

    >>> q = torch.randn(2, 3, 5, 4)
    >>> out = attention(q, q, q, None, 0.0, True, key=dropout_key(1, range(2)), seed=0, op=0)
    >>> torch.allclose(out, F.scaled_dot_product_attention(q, q, q, is_causal=True), atol=1e-6)
    True
    """
    factor = 1.0 / math.sqrt(q.shape[-1]) if scale is None else scale
    if enable_gqa:
        k = k.repeat_interleave(q.shape[-3] // k.shape[-3], -3)
        v = v.repeat_interleave(q.shape[-3] // v.shape[-3], -3)
    scores = (q @ k.transpose(-2, -1)) * factor
    if is_causal:
        causal = torch.ones(q.shape[-2], k.shape[-2], dtype=torch.bool, device=q.device).tril()
        scores = scores.masked_fill(~causal, float("-inf"))
    if attn_mask is not None:
        if attn_mask.dtype == torch.bool:
            scores = scores.masked_fill(~attn_mask, float("-inf"))
        else:
            scores = scores + attn_mask
    weights = torch.ops.aten._safe_softmax.default(scores, -1)  # fully masked rows: 0
    if dropout_p > 0.0:
        weights = dropout(weights, key, p=dropout_p, seed=seed, op=op, block=block)
    return weights @ v


# -- which ops draw masks: the captured graph and the eager forward ----------------------------

_aten = torch.ops.aten
_GRAPH_DROPOUTS = (_aten.dropout.default, _aten.dropout_.default)


def draws_mask(node: torch.fx.Node) -> bool:
    """True if the captured-graph node draws a dropout mask: ``aten.dropout(x, p, train)``
    with p > 0 while training, or ``aten.scaled_dot_product_attention`` with
    ``dropout_p`` > 0."""
    if node.op != "call_function":
        return False
    if node.target in _GRAPH_DROPOUTS:
        p, train = _arg(node, 1, "p", 0.5), _arg(node, 2, "train", True)
        return bool(train) and float(p) > 0.0
    if node.target is _aten.scaled_dot_product_attention.default:
        return float(_arg(node, 4, "dropout_p", 0.0)) > 0.0
    return False


def seeded_random(node: torch.fx.Node) -> bool:
    """True if the node draws from torch's generator (``torch.Tag.nondeterministic_seeded``:
    ``rand_like``, ``bernoulli``, ``feature_dropout``...) and is not one ``draws_mask``
    covers: its numbers would differ between ranks and from one device's."""
    target = node.target
    if not isinstance(target, torch._ops.OpOverload) or draws_mask(node):
        return False
    if target in _GRAPH_DROPOUTS or target is _aten.scaled_dot_product_attention.default:
        return False  # p == 0 or not training: the identity
    return torch.Tag.nondeterministic_seeded in target.tags


def mask_ops(graph: torch.fx.Graph) -> dict[torch.fx.Node, int]:
    """Each mask-drawing node of a captured graph -> its ``op`` number (graph order, the
    order of the calls in the eager forward)."""
    return {node: i for i, node in enumerate(n for n in graph.nodes if draws_mask(n))}


def _arg(node: torch.fx.Node, position: int, name: str, default: Any) -> Any:
    return node.args[position] if len(node.args) > position else node.kwargs.get(name, default)


_DROPOUTS = (F.dropout, torch.dropout, torch.dropout_)
_DROPOUT_ARGS = ("input", "p", "training", "inplace")  # F.dropout's positional arguments
_VF_DROPOUT_ARGS = ("input", "p", "train")  # torch.dropout's
_SDPA_ARGS = ("query", "key", "value", "attn_mask", "dropout_p", "is_causal")


class _PositionalDropout(TorchFunctionMode):
    """Replaces each dropout and attention dropout of an eager forward by the counter-based
    one, numbering the calls that draw a mask."""

    def __init__(self, key: torch.Tensor, seed: int) -> None:
        super().__init__()
        self.key, self.seed, self.count = key, seed, 0

    def _next(self) -> int:
        self.count += 1
        return self.count - 1

    def __torch_function__(
        self,
        func: Callable[..., Any],
        types: Any,
        args: tuple[Any, ...] = (),
        kwargs: Mapping[str, Any] | None = None,
    ) -> Any:
        kwargs = kwargs or {}
        if func in _DROPOUTS:
            names = _DROPOUT_ARGS if func is F.dropout else _VF_DROPOUT_ARGS
            bound = dict(zip(names, args, strict=False)) | dict(kwargs)
            p = float(bound.get("p", 0.5))
            training = bound.get("training", bound.get("train", True))
            inplace = bool(bound.get("inplace", func is torch.dropout_))
            if training and p > 0.0:
                return dropout(bound["input"], self.key, p=p, seed=self.seed, op=self._next(),
                               inplace=inplace)  # fmt: skip
        elif func is F.scaled_dot_product_attention:
            bound = dict(zip(_SDPA_ARGS, args, strict=False)) | dict(kwargs)
            if float(bound.get("dropout_p", 0.0)) > 0.0:
                q, k, v = bound.pop("query"), bound.pop("key"), bound.pop("value")
                return attention(q, k, v, **bound, key=self.key, seed=self.seed, op=self._next())
        return func(*args, **kwargs)


@contextmanager
def positional_dropout(*, seed: int, step: int, rows: Sequence[int]) -> Iterator[None]:
    """Within it, an eager forward's ``F.dropout``/``nn.Dropout``/``torch.dropout`` and
    ``F.scaled_dot_product_attention(dropout_p=...)`` draw their masks by position (the
    reference run: ``rows`` are the batch's global rows, the calls numbered in order).

    >>> x = torch.ones(2, 8)
    >>> with positional_dropout(seed=0, step=1, rows=range(2)):
    ...     y = torch.nn.Dropout(0.5)(x)
    >>> torch.equal(y, dropout(x, dropout_key(1, range(2)), p=0.5, seed=0, op=0))
    True
    """
    with _PositionalDropout(dropout_key(step, rows), seed):
        yield
