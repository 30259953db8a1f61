"""Causal attention over packed documents: the one attention op the model calls.

A packed row holds several documents back to back; ``segments`` (B, T) gives each
position its document's id (ids of one row are contiguous runs). A position attends to the
earlier positions of its own document only (block-diagonal causal attention)::

    segments  0 0 0 1 1 2        attends to (x)
    pos 0     x . . . . .
    pos 2     x x x . . .
    pos 4     . . . x x .
    pos 5     . . . . . x

``segments=None`` is one document per row: plain causal SDPA. ``causal_attention`` runs
causal SDPA on each document's slice (``document_attention``), which measured fastest on
CPU (``benchmarks/packed_attention.py``, docs/decisions.md "Packed attention");
``masked_attention`` (SDPA with the block-diagonal mask) is the same function, kept as the
benchmark's baseline and a test oracle. For deduction (``hspmd.deduce.misc``) it is
attention like SDPA: ``segments`` is data every rank holds whole, as are the RoPE tables.

A model that calls ``F.scaled_dot_product_attention(q, k, v, is_causal=True)`` without a
mask (nanoGPT, Hugging Face models captured by hspmd) keeps documents apart with no edit:
its captured graph's causal SDPA calls become ``causal_attention`` (``hspmd.graph.documents``)
and its reference run makes the same substitution in eager (``documents_apart``).
``document_positions`` gives each position its place in its own document (a Hugging Face
model's ``position_ids`` for packed rows).

>>> q = torch.randn(1, 2, 6, 4)
>>> segments = torch.tensor([[0, 0, 0, 1, 1, 2]])
>>> torch.allclose(causal_attention(q, q, q, segments), masked_attention(q, q, q, segments),
...                atol=1e-6)
True
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager
from typing import Any

import torch
import torch.nn.functional as F
from torch.overrides import TorchFunctionMode

from hspmd.markers import is_capturing, record_as

__all__ = [
    "causal_attention", "document_positions", "document_spans", "documents_apart",
    "masked_attention", "plain_causal",
]  # fmt: skip


def document_spans(segments: torch.Tensor) -> list[list[tuple[int, int]]]:
    """Per row, the ``(start, stop)`` of each run of equal ids.

    >>> document_spans(torch.tensor([[0, 0, 1], [5, 5, 5]]))
    [[(0, 2), (2, 3)], [(0, 3)]]
    """
    length = segments.shape[1]
    changes = (segments[:, 1:] != segments[:, :-1]).nonzero().tolist()
    cuts: list[list[int]] = [[0] for _ in range(segments.shape[0])]
    for row, position in changes:
        cuts[row].append(position + 1)
    return [list(zip(c, [*c[1:], length], strict=True)) for c in cuts]


def causal_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    segments: torch.Tensor | None = None,
    *,
    scale: float | None = None,
    enable_gqa: bool = False,
) -> torch.Tensor:
    """``(B, heads, T, hd)`` attention of each position to its document's earlier ones
    (``scale`` and ``enable_gqa`` as SDPA's). At capture: one node
    ``hspmd::causal_attention`` (``hspmd.markers.record_as``)."""
    if is_capturing():
        return _attention_op(q, k, v, segments, scale, enable_gqa)

    def sdpa(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        return F.scaled_dot_product_attention(
            q, k, v, is_causal=True, scale=scale, enable_gqa=enable_gqa
        )

    if segments is None or q.device.type == "meta":  # meta: shape propagation
        return sdpa(q, k, v)
    rows = []
    # split, not slicing: its backward is one cat, where the backward of each slice would
    # write a zero-filled gradient of the whole input; 4-D pieces keep SDPA's fused kernel
    for spans, qr, kr, vr in zip(
        document_spans(segments), q.split(1), k.split(1), v.split(1), strict=True
    ):
        sizes = [stop - start for start, stop in spans]
        parts = [
            sdpa(qd, kd, vd)
            for qd, kd, vd in zip(
                qr.split(sizes, dim=2), kr.split(sizes, dim=2), vr.split(sizes, dim=2), strict=True
            )
        ]  # each (1, heads, n, hd)
        rows.append(parts[0] if len(parts) == 1 else torch.cat(parts, dim=2))
    return rows[0] if len(rows) == 1 else torch.cat(rows)


@torch.library.custom_op("hspmd::causal_attention", mutates_args=())
def _attention_op(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, segments: torch.Tensor | None,
    scale: float | None, enable_gqa: bool,
) -> torch.Tensor:  # fmt: skip
    """``causal_attention`` as one node of a captured graph (capture only)."""
    return causal_attention(q, k, v, segments, scale=scale, enable_gqa=enable_gqa)


@_attention_op.register_fake
def _(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, segments: torch.Tensor | None,
    scale: float | None, enable_gqa: bool,
) -> torch.Tensor:  # fmt: skip
    return q.new_empty((*q.shape[:-1], v.shape[-1]))


def block_causal_mask(segments: torch.Tensor) -> torch.Tensor:
    """``(B, 1, T, T)`` bool: True where a position may attend (same document, not later)."""
    same = segments[:, :, None] == segments[:, None, :]
    length = segments.shape[1]
    causal = torch.ones(length, length, dtype=torch.bool, device=segments.device).tril()
    return (same & causal)[:, None]


def masked_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    segments: torch.Tensor,
    *,
    enable_gqa: bool = False,
) -> torch.Tensor:
    """``causal_attention`` as one SDPA with the block-diagonal causal mask."""
    mask = block_causal_mask(segments)
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=enable_gqa)


def document_positions(segments: torch.Tensor) -> torch.Tensor:
    """``(B, T)`` int64: each position's index inside its document (a run of equal ids).

    Single-output ops only, so that a captured graph holds it with symbolic ``T``: a run's
    start is the count of positions in the runs before it (``scatter_add`` per run, then an
    exclusive ``cumsum``).

    >>> document_positions(torch.tensor([[0, 0, 0, 1, 1, 2], [4, 4, 4, 4, 4, 4]])).tolist()
    [[0, 1, 2, 0, 1, 0], [0, 1, 2, 3, 4, 5]]
    """
    first = torch.ones_like(segments[:, :1], dtype=torch.bool)
    starts = torch.cat([first, segments[:, 1:] != segments[:, :-1]], dim=1)
    run = starts.long().cumsum(dim=1) - 1  # (B, T): 0, 1, 2.. per run
    sizes = torch.zeros_like(run).scatter_add(1, run, torch.ones_like(run))
    before = sizes.cumsum(dim=1) - sizes  # positions before run r
    index = torch.ones_like(run).cumsum(dim=1) - 1
    return index - before.gather(1, run)


_SDPA_ARGS = ("query", "key", "value", "attn_mask", "dropout_p", "is_causal", "scale")


def plain_causal(bound: Mapping[str, Any]) -> bool:
    """True for SDPA's arguments (by name) of causal attention with no mask and no dropout:
    the calls that ``causal_attention`` may replace for packed documents."""
    return (
        bound.get("attn_mask") is None
        and bool(bound.get("is_causal", False))
        and float(bound.get("dropout_p", 0.0)) == 0.0
    )


class _DocumentsApart(TorchFunctionMode):
    def __init__(self, segments: torch.Tensor) -> None:
        super().__init__()
        self.segments = segments

    def __torch_function__(
        self,
        func: Callable[..., Any],
        types: Any,
        args: tuple[Any, ...] = (),
        kwargs: Mapping[str, Any] | None = None,
    ) -> Any:
        kwargs = kwargs or {}
        if func is F.scaled_dot_product_attention:
            bound = dict(zip(_SDPA_ARGS, args, strict=False)) | dict(kwargs)
            if plain_causal(bound):
                return causal_attention(
                    bound["query"], bound["key"], bound["value"], self.segments,
                    scale=bound.get("scale"), enable_gqa=bool(bound.get("enable_gqa", False)),
                )  # fmt: skip
        return func(*args, **kwargs)


@contextmanager
def documents_apart(segments: torch.Tensor | None) -> Iterator[None]:
    """Within it, an eager forward's causal SDPA calls without a mask attend inside each
    document of ``segments`` only (``causal_attention``); ``None``: nothing changes.

    >>> q = torch.randn(1, 2, 6, 4)
    >>> segments = torch.tensor([[0, 0, 0, 1, 1, 2]])
    >>> with documents_apart(segments):
    ...     y = F.scaled_dot_product_attention(q, q, q, is_causal=True)
    >>> torch.allclose(y, masked_attention(q, q, q, segments), atol=1e-6)
    True
    """
    if segments is None:
        yield
        return
    with _DocumentsApart(segments):
        yield


record_as(torch.ops.hspmd.causal_attention.default, causal_attention)
