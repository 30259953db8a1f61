"""Fixed batches of a token file are a function of (seed, step): any step directly, each
window once per epoch, the same rows whoever asks."""

from __future__ import annotations

from itertools import islice

import numpy as np
import pytest
import torch

from hspmd.data.errors import DataError
from hspmd.data.windows import TokenWindows

IDS = np.arange(1, 402, dtype=np.uint16)  # 401 ids: 50 windows of 8 (+1)


def test_rows_are_windows_of_the_file() -> None:
    windows = TokenWindows(IDS, global_batch=4, seq_len=8, seed=0)
    tokens, targets = windows.batch(1)
    assert tokens.shape == targets.shape == (4, 8) and tokens.dtype == torch.int64
    for row, start in zip(tokens, windows.starts(1), strict=True):
        assert row.tolist() == IDS[start : start + 8].tolist()
    assert torch.equal(tokens[:, 1:], targets[:, :-1])


def test_each_window_once_an_epoch_then_reshuffled() -> None:
    windows = TokenWindows(IDS, global_batch=5, seq_len=8, seed=3)
    assert windows.num_windows == 50
    epoch0 = np.concatenate([windows.starts(s) for s in range(1, 11)])
    epoch1 = np.concatenate([windows.starts(s) for s in range(11, 21)])
    assert sorted(epoch0.tolist()) == sorted(epoch1.tolist()) == list(range(0, 400, 8))
    assert epoch0.tolist() != epoch1.tolist()


def test_a_step_across_two_epochs() -> None:
    windows = TokenWindows(IDS, global_batch=3, seq_len=8, seed=1)  # 50 = 16 x 3 + 2
    starts = windows.starts(17)  # samples 48, 49 of epoch 0 and 0 of epoch 1
    assert starts[2] == windows.starts(1)[0] or len(set(starts.tolist())) == 3
    again = TokenWindows(IDS, global_batch=3, seq_len=8, seed=1)
    assert starts.tolist() == again.starts(17).tolist()


def test_any_step_directly_equals_the_stream() -> None:
    windows = TokenWindows(IDS, global_batch=4, seq_len=8, seed=7)
    stream = list(islice(windows.stream(), 30))
    for step in (1, 12, 13, 30):
        tokens, targets = windows.batch(step)
        assert torch.equal(tokens, stream[step - 1][0]) and torch.equal(
            targets, stream[step - 1][1]
        )
    resumed = next(windows.stream(first=13))
    assert torch.equal(resumed[0], stream[12][0])


def test_seed_changes_the_order() -> None:
    a = TokenWindows(IDS, global_batch=4, seq_len=8, seed=0).batch(1)[0]
    b = TokenWindows(IDS, global_batch=4, seq_len=8, seed=1).batch(1)[0]
    assert not torch.equal(a, b)


def test_fewer_tokens_than_one_step() -> None:
    with pytest.raises(DataError, match="holds 401 tokens, fewer than one step of 64 x 8"):
        TokenWindows(IDS, global_batch=64, seq_len=8, seed=0, where="t.bin")
