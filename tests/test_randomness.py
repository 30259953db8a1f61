"""Counter-based dropout masks (hspmd.randomness): a function of position only."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from hspmd.randomness import (
    Block,
    _mix,
    attention,
    block_at,
    dropout,
    dropout_key,
    keep_mask,
    positional_dropout,
)


def _lowbias32(x: int) -> int:
    """Wellons' lowbias32 in Python's unbounded ints: the reference for the int64 form."""
    x ^= x >> 16
    x = (x * 0x7FEB352D) & 0xFFFFFFFF
    x ^= x >> 15
    x = (x * 0x846CA68B) & 0xFFFFFFFF
    return x ^ (x >> 16)


def test_the_int64_mixer_is_lowbias32_without_overflow() -> None:
    values = [
        0,
        1,
        2,
        0x7FFFFFFF,
        0x80000000,
        0xFFFFFFFF,
        *torch.randint(0, 2**32, (200,)).tolist(),
    ]
    got = _mix(torch.tensor(values, dtype=torch.int64)).tolist()
    assert got == [_lowbias32(v) for v in values]
    assert _mix(0x12345678) == _lowbias32(0x12345678)  # the same code on Python ints


def test_the_mask_is_deterministic_and_changes_with_every_field() -> None:
    key = dropout_key(5, range(3))
    base = keep_mask(key, (3, 16, 32), p=0.5, seed=1, op=2)
    assert torch.equal(base, keep_mask(dropout_key(5, range(3)), (3, 16, 32), p=0.5, seed=1, op=2))
    others = [
        keep_mask(key, (3, 16, 32), p=0.5, seed=2, op=2),
        keep_mask(key, (3, 16, 32), p=0.5, seed=1, op=3),
        keep_mask(dropout_key(6, range(3)), (3, 16, 32), p=0.5, seed=1, op=2),
        keep_mask(dropout_key(5, range(1, 4)), (3, 16, 32), p=0.5, seed=1, op=2),
    ]
    for other in others:  # independent bits: about half of them agree
        assert 0.4 < float((other == base).float().mean()) < 0.6


@pytest.mark.parametrize("p", [0.05, 0.1, 0.5, 0.9])
def test_the_keep_rate_is_one_minus_p(p: float) -> None:
    n = 64 * 128 * 32
    keep = keep_mask(dropout_key(1, range(64)), (64, 128, 32), p=p, seed=0, op=0)
    sigma = math.sqrt(p * (1 - p) / n)
    assert abs(float(keep.float().mean()) - (1 - p)) < 5 * sigma


def test_bits_of_neighbours_and_rows_are_uncorrelated() -> None:
    keep = keep_mask(dropout_key(1, range(32)), (32, 64, 64), p=0.5, seed=0, op=0).float()
    x = keep * 2 - 1  # +-1: products average 0 for independent bits
    limit = 5 / math.sqrt(x.numel())
    assert abs(float((x[:, :, 1:] * x[:, :, :-1]).mean())) < limit  # along the hidden dim
    assert abs(float((x[:, 1:] * x[:, :-1]).mean())) < limit  # along the sequence
    assert abs(float((x[1:] * x[:-1]).mean())) < limit  # between rows


def test_p_zero_keeps_everything_and_p_one_drops_everything() -> None:
    key, x = dropout_key(1, range(2)), torch.randn(2, 5)
    assert torch.equal(dropout(x, key, p=0.0, seed=0, op=0), x)
    assert torch.equal(dropout(x, key, p=1.0, seed=0, op=0), torch.zeros(2, 5))
    with pytest.raises(ValueError, match="between 0 and 1"):
        dropout(x, key, p=1.5, seed=0, op=0)


def test_a_block_holds_the_slice_of_the_whole_mask() -> None:
    shape = (6, 10, 4, 7)
    whole = keep_mask(dropout_key(2, range(100, 106)), shape, p=0.3, seed=9, op=4)
    generator = torch.Generator().manual_seed(0)
    for _ in range(20):
        start, stop = [], []
        for n in shape:
            a, b = sorted(torch.randint(0, n + 1, (2,), generator=generator).tolist())
            start.append(a)
            stop.append(max(b, a + 1) if a < n else n)
        start = [min(a, n - 1) for a, n in zip(start, shape, strict=True)]
        size = [b - a for a, b in zip(start, stop, strict=True)]
        rows = range(100 + start[0], 100 + start[0] + size[0])  # the micro-batch's rows
        local = Block((size[0], *shape[1:]), (0, *start[1:]))
        piece = keep_mask(dropout_key(2, rows), size, p=0.3, seed=9, op=4, block=local)
        want = whole[tuple(slice(a, a + n) for a, n in zip(start, size, strict=True))]
        assert torch.equal(piece, want)


def test_a_batch_merged_with_the_sequence_is_keyed_by_its_rows() -> None:
    """(B*T, H) holds the same bits as (B, T, H): a model may flatten before dropout."""
    key = dropout_key(1, range(10, 14))
    flat = keep_mask(key, (4 * 6, 8), p=0.5, seed=0, op=0)
    assert torch.equal(flat.view(4, 6, 8), keep_mask(key, (4, 6, 8), p=0.5, seed=0, op=0))
    block = Block((2 * 6, 8), (3, 0))  # rows 11, 12 of the batch; entries 3..8 of their 12
    piece = keep_mask(dropout_key(1, [11, 12]), (6, 8), p=0.5, seed=0, op=0, block=block)
    assert torch.equal(piece, flat[6 + 3 : 6 + 9])


def test_a_shorter_call_scales_a_split_sequence_block() -> None:
    whole = keep_mask(dropout_key(1, range(2)), (2, 8, 4), p=0.5, seed=0, op=0)  # T = 8 now
    at_max = {"global_shape": (2, 16, 4), "start": (0, 8, 0), "size": (2, 8, 4)}  # 2nd half
    block = block_at((2, 4, 4), **at_max)
    assert block == Block((2, 8, 4), (0, 4, 0))
    piece = keep_mask(dropout_key(1, range(2)), (2, 4, 4), p=0.5, seed=0, op=0, block=block)
    assert torch.equal(piece, whole[:, 4:])


def test_rows_past_two_to_the_32_are_distinct() -> None:
    low = keep_mask(dropout_key(1, [7]), (1, 4096), p=0.5, seed=0, op=0)
    high = keep_mask(dropout_key(1, [7 + 2**32]), (1, 4096), p=0.5, seed=0, op=0)
    assert 0.4 < float((low == high).float().mean()) < 0.6


def test_a_tensor_without_the_batch_first_is_refused() -> None:
    with pytest.raises(ValueError, match="first dim must be the batch"):
        keep_mask(dropout_key(1, range(4)), (6, 3), p=0.5, seed=0, op=0)


def test_the_gradient_is_the_mask_over_one_minus_p() -> None:
    x = torch.randn(3, 5, requires_grad=True)
    key = dropout_key(1, range(3))
    dropout(x, key, p=0.2, seed=0, op=0).sum().backward()
    keep = keep_mask(key, (3, 5), p=0.2, seed=0, op=0)
    torch.testing.assert_close(x.grad, keep.float() / 0.8)


def test_attention_without_dropout_is_sdpa() -> None:
    key = dropout_key(1, range(2))
    q, k, v = (torch.randn(2, 4, 5, 8) for _ in range(3))
    kv = (torch.randn(2, 2, 5, 8), torch.randn(2, 2, 5, 8))
    bool_mask = torch.rand(2, 1, 5, 5) > 0.3
    bool_mask[..., 0] = True  # no row fully masked
    float_mask = torch.randn(2, 1, 5, 5)
    cases = [
        ((q, k, v), {"is_causal": True}),
        ((q, k, v, bool_mask), {}),
        ((q, k, v, float_mask), {"scale": 0.3}),
        ((q, *kv), {"is_causal": True, "enable_gqa": True}),
    ]
    for args, kwargs in cases:
        want = F.scaled_dot_product_attention(*args, **kwargs)
        got = attention(*args, **kwargs, key=key, seed=0, op=0)  # type: ignore[arg-type]
        torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)


def test_attention_dropout_drops_weights_by_position() -> None:
    key = dropout_key(3, range(2))
    q, k, v = (torch.randn(2, 4, 6, 8) for _ in range(3))
    got = attention(q, k, v, None, 0.25, True, key=key, seed=1, op=7)
    weights = torch.softmax((q @ k.transpose(-2, -1)) / math.sqrt(8) + torch.full(
        (6, 6), float("-inf")).triu(1), -1)  # fmt: skip
    keep = keep_mask(key, (2, 4, 6, 6), p=0.25, seed=1, op=7)
    torch.testing.assert_close(got, (weights * keep / 0.75) @ v, atol=1e-5, rtol=1e-5)
    heads = attention(q[:, 2:], k[:, 2:], v[:, 2:], None, 0.25, True, key=key, seed=1, op=7,
                      block=Block((2, 4, 6, 6), (0, 2, 0, 0)))  # fmt: skip
    torch.testing.assert_close(heads, got[:, 2:], atol=1e-6, rtol=1e-6)  # a TP rank's heads


class _Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = nn.Dropout(0.1), nn.Dropout(0.0)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.b(self.a(x))  # p=0: no mask drawn, no number taken
        y = F.dropout(y, 0.2, training=False)  # not training: the identity
        q = y.view(2, 3, 4, 2)
        y = F.scaled_dot_product_attention(q, q, q, dropout_p=0.3).reshape(2, 3, 8)
        return torch.dropout(y, 0.4, True)


def test_the_eager_forward_numbers_the_calls_that_draw() -> None:
    x = torch.randn(2, 3, 8)
    with positional_dropout(seed=4, step=2, rows=[5, 6]):
        got = _Net()(x)
    key = dropout_key(2, [5, 6])
    y = dropout(x, key, p=0.1, seed=4, op=0)
    q = y.view(2, 3, 4, 2)
    y = attention(q, q, q, None, 0.3, key=key, seed=4, op=1).reshape(2, 3, 8)
    assert torch.equal(got, dropout(y, key, p=0.4, seed=4, op=2))


def test_in_place_dropout_changes_its_input() -> None:
    x = torch.randn(2, 6)
    with positional_dropout(seed=0, step=1, rows=range(2)):
        y = x.clone()
        out = nn.Dropout(0.5, inplace=True)(y)
    assert out is y
    assert torch.equal(y, dropout(x, dropout_key(1, range(2)), p=0.5, seed=0, op=0))
