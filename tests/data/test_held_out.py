"""The held-out part of a corpus: one cut, a pure function of the fraction; documents end
before it; evaluation batches come from after it and are the same for every seed."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from hspmd.data.errors import DataError
from hspmd.data.held_out import (
    byte_eval_batches,
    clip_documents,
    cut,
    split_bytes,
    split_ids,
    token_eval_batches,
)
from hspmd.data.tokens import TokenDocuments, eod_bounds


@pytest.mark.parametrize("total", [1, 7, 100, 12345])
@pytest.mark.parametrize("fraction", [0.0, 0.01, 0.1, 0.5, 0.99])
def test_the_cut_holds_out_the_last_fraction(total: int, fraction: float) -> None:
    at = cut(total, fraction)
    assert 0 <= at <= total
    assert total - at == np.ceil(total * fraction)  # at least the fraction, at most one more
    ids = np.arange(total)
    train, held = split_ids(ids, fraction)
    assert np.array_equal(np.concatenate([train, held]), ids) and len(train) == at


def test_byte_documents_are_cut_at_one_byte() -> None:
    docs = [b"abcdef", b"ghij", b"klmnopqrst"]  # 20 bytes: 0.25 holds out the last 5
    train, held = split_bytes(docs, 0.25)
    assert train == [b"abcdef", b"ghij", b"klmno"] and held == [b"pqrst"]
    train, held = split_bytes(docs, 0.5)  # the cut falls between two documents
    assert train == [b"abcdef", b"ghij"] and held == [b"klmnopqrst"]
    assert split_bytes(docs, 0.0) == (docs, [])


def test_documents_end_before_the_cut() -> None:
    ids = np.array([5, 6, 0, 7, 8, 9, 0, 4, 4, 0, 3, 3], dtype=np.uint16)
    docs = TokenDocuments(ids, *eod_bounds(ids, 0), where="t")
    clipped = clip_documents(docs, 8)  # inside the third document: it keeps [7] = one id
    assert (clipped.starts.tolist(), clipped.ends.tolist()) == ([0, 3], [3, 7])
    clipped = clip_documents(docs, 9)  # two ids of it: one token, its target
    assert clipped.ends.tolist() == [3, 7, 9]


def test_eval_batches_are_the_held_out_windows_whatever_the_seed() -> None:
    ids = np.arange(1000, dtype=np.uint16)
    _, held = split_ids(ids, 0.2)
    batches = token_eval_batches(held, count=3, global_batch=4, seq_len=8, where="t")
    assert len(batches) == 3 and all(t.shape == (4, 8) for t, _ in batches)
    assert min(int(t.min()) for t, _ in batches) >= 800  # only held-out ids
    starts = {int(t[r, 0]) for t, _ in batches for r in range(4)}
    assert len(starts) == 12  # twelve different windows, none read twice
    again = token_eval_batches(held, count=3, global_batch=4, seq_len=8, where="t")
    assert all(torch.equal(a[0], b[0]) for a, b in zip(batches, again, strict=True))


def test_too_few_held_out_windows_is_one_line_with_the_fix() -> None:
    held = np.arange(100, dtype=np.uint16)  # 12 windows of 8 (+1)
    with pytest.raises(DataError, match=r"holds 12 windows of 9 ids, fewer than --eval-batches "
                       r"4 x --global-batch 4 = 16 need: hold out more"):  # fmt: skip
        token_eval_batches(held, count=4, global_batch=4, seq_len=8, where="the held-out part")
    with pytest.raises(DataError, match="--eval-batches 2"):
        byte_eval_batches([b"x" * 60], count=2, global_batch=4, seq_len=8, where="held.txt")
    assert len(byte_eval_batches([b"x" * 80], count=2, global_batch=4, seq_len=8, where="h")) == 2
