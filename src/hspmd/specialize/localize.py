"""Local pieces of single-device ops: what a rank computes on its own slices.

- ``vocab_parallel_embedding``: the embedding of a rank that holds rows
  ``[vocab_start, vocab_start + rows)`` of the table. Tokens outside the range give zero
  rows, so the sum over the stage's ranks (the ``embed`` marker's all-reduce) is the full
  embedding::

      tokens      3   9   1        rank 0 holds rows 0-4, rank 1 rows 5-9
      rank 0      e3  0   e1
      rank 1      0   e9  0        sum = e3 e9 e1

- ``local_view_sizes``: the constant ints of a view/reshape/expand written for the global
  shape, replaced by the local sizes (``view(B, T, 32, 16)`` -> ``view(B, T, 16, 16)`` on a
  rank holding half the heads); traced sizes (``x.shape[0]``) and ``-1`` are kept.
- ``local_slice``: a rank's piece of a global tensor (plan-independent init, DESIGN 5).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
import torch.nn.functional as F

from hspmd.annotation import Piece
from hspmd.errors import HspmdError

__all__ = ["local_slice", "local_view_sizes", "vocab_parallel_embedding"]


class LocalizeError(HspmdError, ValueError):
    """A view whose constant sizes do not match the global shape it is specialized for."""


def vocab_parallel_embedding(
    tokens: torch.Tensor, weight: torch.Tensor, vocab_start: int
) -> torch.Tensor:
    """Rows of ``weight`` (this rank's part of the table) for tokens in range; zeros else.

    >>> w = torch.arange(4.0).view(2, 2)          # rows 5 and 6 of a larger table
    >>> vocab_parallel_embedding(torch.tensor([5, 0, 6]), w, 5).tolist()
    [[0.0, 1.0], [0.0, 0.0], [2.0, 3.0]]
    """
    local = tokens - vocab_start
    inside = (local >= 0) & (local < weight.shape[0])
    rows = F.embedding(torch.where(inside, local, torch.zeros_like(local)), weight)
    return rows * inside.unsqueeze(-1).to(rows.dtype)


def local_view_sizes(
    sizes: Sequence[Any], global_shape: Sequence[int], local_shape: Sequence[int]
) -> tuple[Any, ...]:
    """Rewrite the int entries of a view's ``sizes`` from global to local.

    >>> local_view_sizes(["B", "T", 32, 16], (2, 8, 32, 16), (2, 8, 16, 16))
    ('B', 'T', 16, 16)
    """
    if len(sizes) != len(global_shape) or len(global_shape) != len(local_shape):
        raise LocalizeError(
            f"view sizes {list(sizes)} do not match global shape {list(global_shape)} / local "
            f"shape {list(local_shape)}: one size per dim is needed"
        )
    out = []
    for dim, (size, full, local) in enumerate(zip(sizes, global_shape, local_shape, strict=True)):
        if isinstance(size, int) and size != -1:
            if size != full:
                raise LocalizeError(
                    f"view size {size} at dim {dim} differs from the global size {full} "
                    f"(sizes {list(sizes)}, global shape {list(global_shape)})"
                )
            size = local
        out.append(size)
    return tuple(out)


def local_slice(full: torch.Tensor, piece: Piece) -> torch.Tensor:
    """``full[piece.region]`` as a contiguous tensor (partial pieces are not slices)."""
    if piece.partial:
        raise LocalizeError(f"piece {piece} is a partial summand, not a slice of the full value")
    index = tuple(slice(start, stop) for start, stop in piece.region)
    return full[index].contiguous()
