"""The global batch of each step: ``(tokens, targets)`` of shape (global_batch, seq_len).

Every rank and the reference draw the same stream of global batches from
``hspmd.data.batches`` (seeded; the stdlib sources by default, or ``--data``), then take
their rows; so data never depends on the plan.

>>> from hspmd.train.config import TrainConfig
>>> config = TrainConfig(global_batch=2, seq_len=4, steps=2, data_max_bytes=1 << 16)
>>> [tokens.shape for tokens, _ in step_batches(config)]
[torch.Size([2, 4]), torch.Size([2, 4])]
"""

from __future__ import annotations

from collections.abc import Iterator
from itertools import islice

import torch

from hspmd.data import DEFAULT_MAX_BYTES, batches
from hspmd.train.config import TrainConfig

__all__ = ["step_batches"]


def step_batches(config: TrainConfig) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
    """The ``config.steps`` global batches of a run, in order."""
    stream = batches(
        config.global_batch,
        config.seq_len,
        config.seed,
        path=config.data,
        max_bytes=config.data_max_bytes or DEFAULT_MAX_BYTES,
    )
    return islice(stream, config.steps)
