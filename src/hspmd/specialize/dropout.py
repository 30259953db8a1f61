"""Dropout in an executable graph: each rank draws its piece of one device's mask.

A captured graph's ``aten.dropout(x, p, train)`` with p > 0 while training, and
``aten.scaled_dot_product_attention`` with ``dropout_p`` > 0, become calls of the modules
below, which draw the bits of the rank's block by position (``hspmd.randomness``): the
op number is the node's among the mask-drawing nodes of the whole captured graph (the
eager forward's call order), the block is the node's annotation piece on the rank, and
the rows and step come in as data, the executable's ``key`` input (so that a recomputed
layer, ``torch.utils.checkpoint``, keeps them with its other inputs)::

    dropout_1 = self.dropout_1(add_3, key)    # CounterDropout(p=0.1, op 1, block
                                              #   [0:2, 0:16, 0:32] of (2, 16, 32))

The block is resolved at the maximum length and scaled per call (``block_at``), as the
sequence length is symbolic. Attention dropout runs SDPA's math form
(``hspmd.randomness.attention``) on the rank's heads, its weights' block
``(batch, heads, Tq, Tk)`` taken from the output's piece and the whole key length.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.fx
from torch import nn

from hspmd.annotation import Piece
from hspmd.graph.capture import source_line
from hspmd.randomness import attention, block_at, dropout
from hspmd.specialize.cut import ExecutableError

__all__ = ["AtMax", "CounterAttention", "CounterDropout", "at_max", "counter_call"]

AtMax = tuple[tuple[int, ...], tuple[int, ...], tuple[int, ...]]
"""A local block at the maximum length: (global shape, start, size)."""


def at_max(piece: Piece | None, shape: tuple[int, ...]) -> AtMax:
    """The block of ``piece`` (None: the whole) of a tensor of global ``shape``."""
    if piece is None:
        return shape, (0,) * len(shape), shape
    return shape, tuple(start for start, _ in piece.region), piece.shape


def _need_key(key: torch.Tensor | None, what: str) -> torch.Tensor:
    if key is None:
        raise ExecutableError(
            f"{what} draws its mask by position: call the executable with "
            "key=hspmd.randomness.dropout_key(step, rows) (the training loop does)"
        )
    return key


class CounterDropout(nn.Module):
    """``aten.dropout(x, p, True)`` on the rank's block of ``x``, by position."""

    def __init__(
        self, *, p: float, seed: int, op: int, block: AtMax, inplace: bool = False
    ) -> None:
        super().__init__()
        self.p, self.seed, self.op, self.block, self.inplace = p, seed, op, block, inplace

    def forward(self, x: torch.Tensor, key: torch.Tensor | None) -> torch.Tensor:
        shape, start, size = self.block
        block = block_at(x.shape, global_shape=shape, start=start, size=size)
        return dropout(x, _need_key(key, f"dropout op {self.op}"), p=self.p, seed=self.seed,
                       op=self.op, block=block, inplace=self.inplace)  # fmt: skip

    def extra_repr(self) -> str:
        return f"p={self.p}, op {self.op}, block {_block_text(self.block)}"


class CounterAttention(nn.Module):
    """``aten.scaled_dot_product_attention`` with ``dropout_p``: the math form on the rank's
    heads, the attention weights' dropout by position (``block``: the weights')."""

    def __init__(
        self, *, p: float, seed: int, op: int, block: AtMax, is_causal: bool,
        scale: float | None, enable_gqa: bool,
    ) -> None:  # fmt: skip
        super().__init__()
        self.p, self.seed, self.op, self.block = p, seed, op, block
        self.is_causal, self.scale, self.enable_gqa = is_causal, scale, enable_gqa

    def forward(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None,
        key: torch.Tensor | None,
    ) -> torch.Tensor:  # fmt: skip
        shape, start, size = self.block
        local = (*q.shape[:-1], k.shape[-2])
        block = block_at(local, global_shape=shape, start=start, size=size)
        return attention(
            q, k, v, mask, self.p, self.is_causal, scale=self.scale, enable_gqa=self.enable_gqa,
            key=_need_key(key, f"attention dropout op {self.op}"), seed=self.seed, op=self.op,
            block=block,
        )  # fmt: skip

    def extra_repr(self) -> str:
        return f"dropout_p={self.p}, op {self.op}, weights block {_block_text(self.block)}"


def _block_text(block: AtMax) -> str:
    shape, start, size = block
    spans = ", ".join(f"{s}:{s + n}" for s, n in zip(start, size, strict=True))
    return f"[{spans}] of {shape}"


_SDPA = torch.ops.aten.scaled_dot_product_attention.default
_SDPA_ARGS = ("q", "k", "v", "attn_mask", "dropout_p", "is_causal")


def counter_call(
    node: torch.fx.Node,
    graph: torch.fx.Graph,
    *,
    shape_of: Callable[[str], tuple[int, ...]],
    piece: Piece | None,
    seed: int,
    op: int,
) -> tuple[nn.Module, tuple[Any, ...]]:
    """The module that draws mask-drawing node ``node``'s bits on the rank's ``piece`` of
    its output (None: whole), and its arguments (nodes of ``graph``, the captured graph
    whose global shapes ``shape_of`` gives; the caller appends the key)."""
    x = node.args[0]
    assert isinstance(x, torch.fx.Node)
    _check_batch_first(node, x, graph)
    block = at_max(piece, shape_of(node.name))
    if node.target is not _SDPA:
        p = node.args[1] if len(node.args) > 1 else node.kwargs.get("p", 0.5)
        inplace = node.target is torch.ops.aten.dropout_.default
        return CounterDropout(p=float(p), seed=seed, op=op, block=block, inplace=inplace), (x,)  # type: ignore[arg-type]
    options = dict(zip(_SDPA_ARGS, node.args, strict=False)) | dict(node.kwargs)
    k = options["k"]
    assert isinstance(k, torch.fx.Node)
    length = shape_of(k.name)[-2]  # the weights (..., heads, Tq, Tk): Tk whole
    (*shape, _), (*start, _), (*size, _) = block
    module = CounterAttention(
        p=float(options["dropout_p"]), seed=seed, op=op,  # type: ignore[arg-type]
        block=((*shape, length), (*start, 0), (*size, length)),
        is_causal=bool(options.get("is_causal", False)), scale=options.get("scale"),  # type: ignore[arg-type]
        enable_gqa=bool(options.get("enable_gqa", False)),
    )  # fmt: skip
    return module, (options["q"], k, options["v"], options.get("attn_mask"))


def _check_batch_first(node: torch.fx.Node, x: torch.fx.Node, graph: torch.fx.Graph) -> None:
    """Refuse a mask-drawing node whose tensor ``x`` (in the captured graph, with symbolic
    sizes) does not have the batch as its first dim: masks are keyed by batch row."""
    batch = _batch_symbols(graph)
    value = x.meta.get("val")
    if not batch or not isinstance(value, torch.Tensor):
        return  # no symbolic sizes recorded (a graph traced at the Python level)
    sizes = [_symbols(size) for size in value.shape]
    if sizes and sizes[0] & batch and not any(s & batch for s in sizes[1:]):
        return
    where = source_line(node)
    raise ExecutableError(
        f"{node.name} ({node.target}){f' at {where}' if where else ''} drops elements of a "
        f"tensor of shape {list(value.shape)} whose first dim is not the batch: hspmd keys "
        "dropout masks by batch row; apply dropout before moving the batch dim"
    )


def _symbols(size: object) -> set[object]:
    expr = getattr(getattr(size, "node", None), "expr", None)
    return set(getattr(expr, "free_symbols", ()))


def _batch_symbols(graph: torch.fx.Graph) -> set[object]:
    found: set[object] = set()
    for node in graph.nodes:
        value = node.meta.get("val") if node.op == "placeholder" else None
        if isinstance(value, torch.Tensor) and value.dim() == 2:  # tokens and targets (B, T)
            found |= _symbols(value.shape[0])
    return found
