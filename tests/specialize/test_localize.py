"""Local op implementations: vocab-parallel embedding, view sizes, slices."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from hspmd.annotation import parse_annotation
from hspmd.specialize.localize import (
    LocalizeError,
    local_slice,
    local_view_sizes,
    vocab_parallel_embedding,
)


@pytest.mark.parametrize("tp", [1, 2, 4])
def test_vocab_parallel_embedding_sums_to_full(tp: int) -> None:
    generator = torch.Generator().manual_seed(0)
    weight = torch.randn(16, 8, generator=generator, requires_grad=True)
    tokens = torch.randint(0, 16, (3, 5), generator=generator)
    rows = 16 // tp
    parts = [weight[r * rows : (r + 1) * rows] for r in range(tp)]
    total = sum(vocab_parallel_embedding(tokens, p, r * rows) for r, p in enumerate(parts))
    expected = F.embedding(tokens, weight)
    torch.testing.assert_close(total, expected)
    # gradients reach only the rows a rank holds, and add up to the single-device gradient
    (total * torch.arange(8.0)).sum().backward()
    grad = weight.grad.clone()  # type: ignore[union-attr]
    weight.grad = None
    (expected * torch.arange(8.0)).sum().backward()
    torch.testing.assert_close(grad, weight.grad)


def test_local_view_sizes() -> None:
    assert local_view_sizes([-1, 4, 16], (8, 4, 16), (8, 2, 16)) == (-1, 2, 16)
    with pytest.raises(LocalizeError, match="differs from the global size"):
        local_view_sizes([2, 5], (2, 4), (2, 2))


def test_local_slice_follows_pieces() -> None:
    full = torch.arange(24.0).view(4, 6)
    ann = parse_annotation("hD: [0,1]{1:2} [2]{}")
    assert local_slice(full, ann.piece(1, (4, 6))).tolist() == full[:, 3:].tolist()
    assert local_slice(full, ann.piece(2, (4, 6))).shape == (4, 6)
    with pytest.raises(LocalizeError, match="partial"):
        local_slice(full, parse_annotation("[0,1]{P:2}").piece(0, (4, 6)))
