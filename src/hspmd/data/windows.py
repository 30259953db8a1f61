"""Fixed-length batches from a token file, drawn by (seed, step) alone.

The ids are cut into windows of ``seq_len + 1`` that overlap by one id (window ``w`` starts
at ``w * seq_len``), so each id but the first is a target once per epoch. Sample ``i`` of the
run (row ``r`` of step ``s`` is ``i = (s - 1) * global_batch + r``) is window
``permutation(seed, epoch)[i % W]`` of epoch ``i // W``, ``W`` windows an epoch::

    ids       0 1 2 3 4 5 6 7 8      seq_len 4: windows [0..4] [4..8]
    window 0  t t t t .              tokens = window[:-1]
    window 1          t t t t .      targets = window[1:]

Any step is computed directly (``batch(step)``): a resume, a switch, an elastic redo or a
rank that joins late reads the same rows without replaying the steps before, and every
strategy takes its rows from the same global batch.

>>> ids = np.arange(100, dtype=np.uint16)
>>> windows = TokenWindows(ids, global_batch=2, seq_len=4, seed=0)
>>> tokens, targets = windows.batch(1)
>>> tokens.shape, bool((tokens[:, 1:] == targets[:, :-1]).all()), windows.num_windows
(torch.Size([2, 4]), True, 24)
"""

from __future__ import annotations

import functools
from collections.abc import Iterator
from dataclasses import dataclass

import numpy as np
import torch

from hspmd.data.errors import DataError
from hspmd.data.tokens import permutation

__all__ = ["TokenWindows"]


@functools.lru_cache(maxsize=2)
def _epoch_order(seed: int, epoch: int, size: int) -> np.ndarray:
    return permutation(seed, epoch, size)


@dataclass(frozen=True, slots=True, eq=False)
class TokenWindows:
    """The global batches of fixed length over ``ids`` (module docstring)."""

    ids: np.ndarray
    global_batch: int
    seq_len: int
    seed: int = 0
    where: str = "the token file"

    def __post_init__(self) -> None:
        if self.global_batch < 1 or self.seq_len < 1:
            raise DataError(f"global_batch={self.global_batch} and seq_len={self.seq_len} "
                            "must both be at least 1")  # fmt: skip
        if self.num_windows < self.global_batch:
            raise DataError(
                f"{self.where} holds {len(self.ids):,} tokens, fewer than one step of "
                f"{self.global_batch} x {self.seq_len} tokens needs "
                f"({self.global_batch * self.seq_len + 1:,}): use more data or a smaller "
                "--global-batch or --seq-len"
            )

    @property
    def num_windows(self) -> int:
        """Windows of an epoch."""
        return max(len(self.ids) - 1, 0) // self.seq_len

    def starts(self, step: int) -> np.ndarray:
        """Where the rows of ``step`` (1-based) start in ``ids``."""
        first = (step - 1) * self.global_batch
        samples = np.arange(first, first + self.global_batch, dtype=np.int64)
        epochs, within = np.divmod(samples, self.num_windows)
        out = np.empty(self.global_batch, dtype=np.int64)
        for epoch in np.unique(epochs):  # a step spans at most two epochs
            mask = epochs == epoch
            out[mask] = _epoch_order(self.seed, int(epoch), self.num_windows)[within[mask]]
        return out * self.seq_len

    def batch(self, step: int) -> tuple[torch.Tensor, torch.Tensor]:
        """``(tokens, targets)`` of ``step``, both ``(global_batch, seq_len)`` int64."""
        width = self.seq_len + 1
        rows = np.empty((self.global_batch, width), dtype=np.int64)
        for row, start in enumerate(self.starts(step).tolist()):
            rows[row] = self.ids[start : start + width]
        tensor = torch.from_numpy(rows)
        return tensor[:, :-1].contiguous(), tensor[:, 1:].contiguous()

    def stream(self, first: int = 1) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        """``batch(first)``, ``batch(first + 1)``, ... forever."""
        step = first
        while True:
            yield self.batch(step)
            step += 1
